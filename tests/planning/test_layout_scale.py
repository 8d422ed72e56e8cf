"""A layout of tens of thousands of units (a mixture-of-experts model whose every Linear is a
block) is built and used without leaving the garbage collector more to follow: objects that
outlive a young collection bring on full collections over the whole model, which at 79,246
modules take over a second each."""

from __future__ import annotations

import gc

from devmap_shims.planning import layout_from_module, plan_units, repair


class Module:
    """What the walk reads of a torch module: its ``_parameters``, ``_modules`` and ``_buffers``,
    set through its ``__dict__`` as ``nn.Module.__setattr__`` does (which makes the dict exist)."""

    def __init__(self, children=None, params=None, buffers=None):
        self.__dict__.update(
            _parameters=dict(params or {}), _modules=dict(children or {}), _buffers=dict(buffers or {})
        )


class Linear(Module):
    def __init__(self):
        super().__init__(params={"weight": object()})


def moe(layers: int, experts: int) -> Module:
    def expert():
        return Module({name: Linear() for name in ("gate_proj", "up_proj", "down_proj")})

    def layer():
        return Module({
            "self_attn": Module({name: Linear() for name in ("q_proj", "k_proj", "v_proj", "o_proj")}),
            "mlp": Module({"experts": Module({str(i): expert() for i in range(experts)})}),
        })

    return Module({"model": Module({"layers": Module({str(i): layer() for i in range(layers)})})})


def sizes_of(model: Module) -> dict:
    sizes = {}

    def walk(prefix, module):
        for name, child in module._modules.items():
            full = f"{prefix}.{name}" if prefix else name
            sizes[full] = 1.5 if not child._modules else 0.0  # 4-bit sizes are fractional
            walk(full, child)

    walk("", model)
    return sizes


def tracked_after_collection(make):
    gc.collect()
    before = len(gc.get_objects())
    kept = make()
    gc.collect()
    return kept, len(gc.get_objects()) - before


def test_a_large_layout_leaves_a_handful_of_objects_for_the_collector():
    model = moe(layers=8, experts=64)  # 1,568 units
    sizes = sizes_of(model)
    layout, tracked = tracked_after_collection(lambda: layout_from_module(model, sizes))
    units = layout.units
    assert len(units) == 8 * (4 + 64 * 3)
    assert {u.size for u in units} == {2}  # 1.5 rounds to 2
    # the layout, its name / size / span / children containers: not one object per unit or module
    assert tracked < 40, tracked

    budgets = {g: 0.3 * layout.total for g in range(4)}
    collapsed = {"": 0}
    outcome, tracked = tracked_after_collection(lambda: repair(layout, collapsed, budgets))
    assert outcome.repaired and len(set(plan_units(layout, budgets).values())) == 4
    assert tracked < 60, tracked


def test_the_direct_walk_names_each_object_once_and_each_name_once():
    """As torch's ``named_*`` do: no None child, a module under two names under its first only; a
    buffer named like a child already met is dropped."""
    shared = Linear()
    model = Module(
        {"a": shared, "b": None, "c": shared, "d": Linear()},
        params={"w": object()},
        buffers={"d": object(), "e": object()},
    )
    layout = layout_from_module(model, {"a": 3, "d": 5})
    assert [(u.name, u.size) for u in layout.units] == [("w", 0), ("a", 3), ("d", 5), ("e", 0)]
    assert layout.children == {"": ("w", "a", "d", "e")}
