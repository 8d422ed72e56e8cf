"""install / uninstall / status on fake target modules (no torch)."""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest
import wrapt

import devmap_shims
from devmap_shims import Shim, Target
from devmap_shims.shims import wrapping

from .conftest import add_one, fake_row


def register_fake(target="compute", wrapper=add_one, spec=">=1.0,<2.0", **shim_kw):
    shim = Shim("fake-fix", ("fake-bug",), (Target("fakelib.core", target, **shim_kw.pop("target_kw", {})),), wrapper, **shim_kw)
    fixed = {"fakelib": "2.0.0"} if spec == ">=1.0,<2.0" else "unfixed"
    devmap_shims.register(shim, matrix_rows=[fake_row(spec=spec, fixed_in=fixed, last_checked="2026-11-01")])
    return shim


def shim_status(shim_id="fake-fix"):
    return next(s for s in devmap_shims.status()["shims"] if s["id"] == shim_id)


def test_install_then_import_wraps_defining_module_and_every_copy(fake_stack):
    register_fake()
    assert devmap_shims.install(only=["fake-fix"])
    assert shim_status()["state"] == "pending"
    import fakeconsumer
    import fakelib
    import fakelib.core

    assert fakelib.core.compute(3) == 7
    assert fakelib.compute(3) == 7
    assert fakeconsumer.compute(3) == 7 and fakeconsumer.compute_again(3) == 7
    assert fakeconsumer.use(3) == 7
    state = shim_status()
    assert state["state"] == "active"
    assert state["targets"][0]["rebound"] == []  # hooked early: every copy bound the wrapper itself


def test_import_then_install_rebinds_by_name_copies(fake_stack):
    import fakeconsumer
    import fakelib
    import fakelib.core

    original = fakelib.core.compute
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    assert fakelib.core.compute(3) == 7
    assert fakeconsumer.compute(3) == 7 and fakeconsumer.use(3) == 7 and fakelib.compute(3) == 7
    rebound = set(shim_status()["targets"][0]["rebound"])
    assert {"fakeconsumer.compute", "fakeconsumer.compute_again", "fakelib.compute"} <= rebound
    devmap_shims.uninstall()
    assert fakelib.core.compute is original
    assert fakeconsumer.compute is original and fakelib.compute is original and fakeconsumer.compute_again is original
    assert fakeconsumer.use(3) == 6


def test_targets_already_imported_are_rebound_in_one_pass_over_sys_modules(fake_stack, monkeypatch):
    """With torch and transformers imported a pass over sys.modules reads thousands of namespaces:
    install() arms every target already imported, then rebinds all their by-name copies at once."""
    import fakeconsumer
    import fakelib.core

    passes = []
    real = wrapping.rebind_many
    monkeypatch.setattr(wrapping, "rebind_many", lambda pairs, *a: passes.append(len(pairs)) or real(pairs, *a))
    shim = Shim("fake-fix", ("fake-bug",), (Target("fakelib.core", "compute"), Target("fakelib.core", "fragile")), add_one)
    devmap_shims.register(shim, matrix_rows=[fake_row(spec=">=1.0,<2.0", fixed_in={"fakelib": "2.0.0"})])
    devmap_shims.install(only=["fake-fix"])
    assert passes == [2]
    assert fakeconsumer.compute(3) == 7 and fakelib.compute(3) == 7 and fakelib.core.compute(3) == 7
    targets = {t["target"].rpartition(":")[2]: t for t in shim_status()["targets"]}
    assert {"fakeconsumer.compute", "fakeconsumer.compute_again", "fakelib.compute"} <= set(targets["compute"]["rebound"])
    assert targets["fragile"]["state"] == "active"


@pytest.mark.parametrize("order", [("on-definition", "on-copy"), ("on-copy", "on-definition")])
def test_a_shim_on_a_by_name_copy_wraps_the_layer_armed_in_the_same_install(fake_stack, order):
    """One shim wraps ``fakelib.core.compute``, another the copy ``fakeconsumer.compute``, both
    modules imported before install(): every name ends with both layers, whichever arms first, as
    when each target's copies were rebound as soon as it was armed."""
    import fakeconsumer
    import fakelib.core

    original = fakelib.core.compute
    targets = {"on-definition": Target("fakelib.core", "compute"), "on-copy": Target("fakeconsumer", "compute")}
    for name in order:
        devmap_shims.register(
            Shim(name, (f"bug-{name}",), (targets[name],), add_one),
            matrix_rows=[fake_row(bug_id=f"bug-{name}", spec=">=1.0,<2.0", fixed_in={"fakelib": "2.0.0"})],
        )
    devmap_shims.install(only=list(order))
    assert fakelib.core.compute(3) == 8 and fakeconsumer.compute(3) == 8 and fakelib.compute(3) == 8
    devmap_shims.uninstall()
    assert fakelib.core.compute is original and fakeconsumer.compute is original and fakelib.compute is original


def test_copies_made_while_installed_are_undone_by_uninstall_and_follow_the_next_install(fake_stack):
    """A module imported while the shims are on copies the wrapper itself (transformers imported
    inside a replay copies accelerate's wrapped functions): uninstall must take those copies back
    too, or they keep repairing after uninstall and a later install never reaches that module."""
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    import fakeconsumer
    import fakelib
    import fakelib.core

    assert fakeconsumer.use(3) == 7
    devmap_shims.uninstall()
    original = fakelib.core.compute
    assert not wrapping.is_ours(original)
    assert fakeconsumer.compute is original and fakelib.compute is original and fakeconsumer.compute_again is original
    assert fakeconsumer.use(3) == 6
    devmap_shims.install(only=["fake-fix"])
    assert shim_status()["state"] == "active"
    assert fakeconsumer.use(3) == 7 and fakelib.compute(3) == 7
    devmap_shims.uninstall()
    assert fakeconsumer.use(3) == 6 and fakeconsumer.compute is original


def test_copies_of_two_stacked_layers_go_back_to_the_original(fake_stack):
    register_fake()
    second = Shim("fake-fix-2", ("fake-bug-2",), (Target("fakelib.core", "compute"),), add_one)
    devmap_shims.register(second, matrix_rows=[fake_row("fake-bug-2", fixed_in={"fakelib": "2.0.0"})])
    devmap_shims.install(only=["fake-fix", "fake-fix-2"])
    import fakeconsumer
    import fakelib.core

    assert fakeconsumer.use(3) == 8  # both layers
    devmap_shims.uninstall()
    assert not wrapping.is_ours(fakelib.core.compute) and fakeconsumer.compute is fakelib.core.compute
    assert fakeconsumer.use(3) == 6


def test_install_twice_is_a_noop_and_wraps_once(fake_stack):
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    assert fakelib.core.compute(3) == 7  # not 8: one layer
    inner = fakelib.core.compute.__wrapped__
    assert not wrapping.is_ours(inner)


def test_install_again_with_other_arguments_warns(fake_stack, caplog):
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        devmap_shims.install(exclude=["fake-fix"])
    assert "already called with other arguments" in caplog.text


def test_the_programs_install_replaces_the_start_up_install(fake_stack, caplog, monkeypatch):
    from devmap_shims.shims import plugins

    monkeypatch.setattr(plugins, "entry_points", lambda group: [])  # no plugin distribution here
    register_fake()
    devmap_shims.install(_auto=True)  # what DEVMAP_SHIMS=1 does at interpreter start-up
    import fakelib.core

    assert fakelib.core.compute(3) == 7 and devmap_shims.status()["auto_enabled"]
    with caplog.at_level(logging.INFO, logger="devmap_shims"):
        assert devmap_shims.install(exclude=["fake-fix"])
    assert fakelib.core.compute(3) == 6  # the program's exclude holds
    assert shim_status()["selected"] is False and not devmap_shims.status()["auto_enabled"]
    assert "install() from the program replaces the start-up install" in caplog.text
    assert "exclude=('fake-fix',)" in caplog.text


def test_a_replacing_install_that_strict_mode_refuses_keeps_the_start_up_install(fake_stack, monkeypatch):
    from devmap_shims.shims import plugins

    monkeypatch.setattr(plugins, "entry_points", lambda group: [])
    monkeypatch.setenv("DEVMAP_SHIMS_DISABLE", "nope-1,nope-2")
    register_fake()
    devmap_shims.install(_auto=True)
    import fakelib.core

    with pytest.raises(ValueError) as refused:
        devmap_shims.install(exclude=["no-such-shim"], strict=True)
    assert "no-such-shim" in str(refused.value) and "Ignoring" not in str(refused.value)
    assert devmap_shims.is_installed() and devmap_shims.status()["auto_enabled"]
    assert fakelib.core.compute(3) == 7  # the start-up install still repairs


def test_the_programs_plain_install_keeps_the_start_up_install(fake_stack, caplog, monkeypatch):
    from devmap_shims.shims import plugins

    monkeypatch.setattr(plugins, "entry_points", lambda group: [])
    register_fake()
    devmap_shims.install(_auto=True)
    import fakelib.core

    wrapper = fakelib.core.compute
    with caplog.at_level(logging.INFO, logger="devmap_shims"):
        assert devmap_shims.install()
    assert fakelib.core.compute is wrapper and fakelib.core.compute(3) == 7
    assert devmap_shims.status()["auto_enabled"] and "replaces" not in caplog.text


def test_a_wrapped_method_deep_copied_with_its_instance_is_bound_to_the_copy(fake_stack):
    import copy
    import functools

    register_fake(target="Thing.to", wrapper=lambda w, i, a, k: w(*a, **k))
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    thing = fakelib.core.Thing("cuda:0")
    copied = copy.deepcopy({"thing": thing, "move": functools.partial(thing.to, "cuda:1"), "to": thing.to})
    assert copied["thing"] is not thing
    assert copied["move"].func.__self__ is copied["thing"] and copied["to"].__self__ is copied["thing"]
    assert copied["move"]().device == "cuda:1"
    unbound = fakelib.core.Thing.to
    assert copy.deepcopy(unbound) is unbound  # read from the class: copied as itself


def test_a_method_rebound_from_its_func_keeps_the_repair(fake_stack):
    """accelerate's prepare_model (mixed precision) and peft rebind a model's method as
    ``MethodType(wrap(model.forward.__func__), model)``: the repair stays in every later call."""
    import functools
    import types

    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append((instance, args))
        return wrapped(*args, **kwargs)

    register_fake(target="Thing.to", wrapper=spy)
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    thing = fakelib.core.SubThing("cpu")
    func = thing.to.__func__

    @functools.wraps(func)
    def autocast_like(*args, **kwargs):
        return func(*args, **kwargs)

    thing.to = types.MethodType(autocast_like, thing)
    assert thing.to("cuda:1").device == "cuda:1"
    assert seen == [(thing, ("cuda:1",))]


def test_a_repairs_library_call_and_an_out_of_memory_error_are_the_callers(fake_stack):
    from devmap_shims.shims import library_call

    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError, by name
        pass

    failures = {"library": lambda: library_call(int, "not a number"), "memory": lambda: (_ for _ in ()).throw(
        OutOfMemoryError("CUDA out of memory"))}

    def repair(wrapped, instance, args, kwargs):
        return failures[args[0]]()

    register_fake(wrapper=repair)
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    with pytest.raises(ValueError, match="invalid literal"):
        fakelib.core.compute("library")
    with pytest.raises(OutOfMemoryError):
        fakelib.core.compute("memory")
    assert shim_status()["state"] == "active" and shim_status()["call_failures"] == 0
    assert devmap_shims.status()["warnings"] == []


def test_install_uninstall_install(fake_stack):
    register_fake()
    import fakelib.core

    original = fakelib.core.compute
    for _ in range(2):
        devmap_shims.install(only=["fake-fix"])
        assert fakelib.core.compute(3) == 7
        assert devmap_shims.uninstall()
        assert fakelib.core.compute is original
    assert devmap_shims.uninstall() is False  # uninstall without install


def test_uninstall_before_import_cancels_the_hook(fake_stack):
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    devmap_shims.uninstall()
    import fakelib.core

    assert fakelib.core.compute(3) == 6
    assert not wrapping.is_ours(fakelib.core.compute)


def test_foreign_wrapt_layer_on_top_survives_uninstall(fake_stack):
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    original = fakelib.core.compute.__wrapped__
    wrapt.wrap_function_wrapper(fakelib.core, "compute", lambda w, i, a, k: w(*a, **k) * 10)
    assert fakelib.core.compute(3) == 70
    devmap_shims.uninstall()
    foreign = fakelib.core.compute
    assert isinstance(foreign, wrapt.FunctionWrapper) and not wrapping.is_ours(foreign)
    assert foreign.__wrapped__ is original
    assert fakelib.core.compute(3) == 60


def test_foreign_wrapt_layer_below_is_kept(fake_stack):
    import fakelib.core

    wrapt.wrap_function_wrapper(fakelib.core, "compute", lambda w, i, a, k: w(*a, **k) * 10)
    foreign = fakelib.core.compute
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    assert fakelib.core.compute(3) == 61
    devmap_shims.uninstall()
    assert fakelib.core.compute is foreign


def test_existing_dunder_wrapped_is_not_mistaken_for_ours(fake_stack):
    """transformers' generate carries __wrapped__ from torch.no_grad(): still wrap it."""
    import functools

    import fakelib.core

    plain = fakelib.core.compute

    @functools.wraps(plain)
    def decorated(*a, **k):
        return plain(*a, **k)

    fakelib.core.compute = decorated
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    assert fakelib.core.compute(3) == 7
    assert shim_status()["state"] == "active"


def test_bug_outside_range_is_skipped_with_reason_and_force_arms_it(fake_stack):
    register_fake(spec=">=2.0")
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    assert fakelib.core.compute(3) == 6
    state = shim_status()
    assert state["state"] == "skipped" and not state["applies"]
    assert "fakelib 1.2.0 is outside >=2.0" in state["targets"][0]["reason"]
    devmap_shims.uninstall()
    devmap_shims.install(only=["fake-fix"], force=["fake-fix"])
    assert fakelib.core.compute(3) == 7
    assert shim_status()["forced"] is True


def test_target_when_gate_skips_target_for_other_consumer_versions(fake_stack):
    register_fake(target_kw={"when": {"fakelib": ">=5"}})
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    assert fakelib.core.compute(3) == 6
    assert "target not used on this stack" in shim_status()["targets"][0]["reason"]


@pytest.mark.parametrize("changed, phrase", [
    ({"target_kw": {"expect_params": ("x", "scale", "device")}}, "signature drift"),
    ({"target": "no_such_function"}, "target missing"),
], ids=["signature-drift", "target-missing"])
@pytest.mark.parametrize("imported_first", [False, True])
def test_a_target_the_library_changed_is_skipped_with_a_warning_and_refused_in_strict_mode(
    fake_stack, caplog, changed, phrase, imported_first
):
    """The bug applies but its target is gone or takes other parameters: the call runs unrepaired,
    which one warning says (the user would otherwise lose the repair without a word); strict mode
    raises ShimError, from install() or from the import that arms it."""
    from devmap_shims.shims.registry import ShimError

    register_fake(**changed)
    if imported_first:
        import fakelib.core  # noqa: F401
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        devmap_shims.install(only=["fake-fix"])
        import fakelib.core

    assert fakelib.core.compute(3) == 6
    target = shim_status()["targets"][0]
    assert target["state"] == "skipped" and phrase in target["reason"]
    warned = [r.getMessage() for r in caplog.records if "fake-fix" in r.getMessage()]
    assert len(warned) == 1 and "runs unrepaired" in warned[0] and phrase in warned[0], warned
    devmap_shims.uninstall()
    if imported_first:
        with pytest.raises(ShimError, match=phrase):
            devmap_shims.install(only=["fake-fix"], strict=True)
        assert not devmap_shims.is_installed()
    else:
        import sys

        del sys.modules["fakelib.core"]
        devmap_shims.install(only=["fake-fix"], strict=True)
        with pytest.raises(ShimError, match=phrase):
            import fakelib.core  # noqa: F401


def test_a_method_the_release_only_inherits_from_another_library_is_skipped_unwarned(fake_stack, caplog):
    """transformers 4.27's PreTrainedModel.cuda is torch's Module.cuda: that release has no method of
    its own there, so nothing of its to repair and nothing missing; strict mode takes it too."""
    register_fake(target="Thing.__repr__")  # object's
    import fakelib.core  # noqa: F401

    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        assert devmap_shims.install(only=["fake-fix"], strict=True)
    target = shim_status()["targets"][0]
    assert target["state"] == "skipped" and "inherited from builtins.object" in target["reason"]
    assert "fake-fix" not in caplog.text


@pytest.mark.parametrize("forced", [False, True])
def test_a_target_skipped_for_a_bug_that_is_not_here_is_not_warned_about(fake_stack, caplog, forced):
    """Outside the rows' range the target may not exist yet: forced there, the shim is skipped on it,
    without a warning that the library changed, and strict mode takes it."""
    register_fake(target="no_such_function", spec=">=5.0")
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        devmap_shims.install(only=["fake-fix"], force=["fake-fix"] if forced else None, strict=forced)
        import fakelib.core  # noqa: F401
    assert shim_status()["targets"][0]["state"] == "skipped" and "fake-fix" not in caplog.text


def test_only_and_exclude_select(fake_stack):
    register_fake()
    devmap_shims.install(exclude=["fake-fix"])
    import fakelib.core

    assert fakelib.core.compute(3) == 6
    state = shim_status()
    assert state["selected"] is False and state["state"] == "skipped"


def test_unknown_ids_warn_or_raise_in_strict(fake_stack, caplog):
    register_fake()
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        assert devmap_shims.install(only=["fake-fxi"])
    assert "unknown shim 'fake-fxi'" in caplog.text and "did you mean 'fake-fix'" in caplog.text
    devmap_shims.uninstall()
    with pytest.raises(ValueError, match="fake-fxi"):
        devmap_shims.install(force=["fake-fxi"], strict=True)
    assert not devmap_shims.is_installed()


def test_a_strict_install_that_cannot_wrap_an_imported_target_raises_and_leaves_nothing_on(fake_stack):
    """The library was imported first, so install() wraps at once: in strict mode a target that
    cannot be wrapped is install()'s error, and no shim stays half installed (a second install
    would otherwise say True and do nothing)."""
    from devmap_shims.shims import importhook
    from devmap_shims.shims.registry import ShimError

    import fakelib.core

    original, describe = fakelib.core.compute, vars(fakelib.core.Thing)["describe"]
    broken = Shim("fake-fix", ("fake-bug",), (Target("fakelib.core", "compute"),), "no_such_module:repair")
    devmap_shims.register(broken, matrix_rows=[fake_row(last_checked="2026-11-01")])
    devmap_shims.register(Shim("fake-good", ("fake-bug",), (Target("fakelib.core", "Thing.describe"),), add_one))
    with pytest.raises(ShimError, match="could not wrap fakelib.core:compute"):
        devmap_shims.install(strict=True)
    assert not devmap_shims.is_installed() and importhook.waiting() == 0
    assert fakelib.core.compute is original and vars(fakelib.core.Thing)["describe"] is describe
    with pytest.raises(ShimError):
        devmap_shims.install(strict=True)  # asked again: the same answer, not a silent True
    assert devmap_shims.install()  # without strict mode: the failing shim is off, the other on
    assert shim_status("fake-fix")["state"] == "failed" and shim_status("fake-good")["state"] == "active"


def test_uninstall_cancels_the_wait_for_a_target_library(fake_stack):
    from devmap_shims.shims import importhook

    register_fake()
    devmap_shims.install()
    assert importhook.waiting() > 0
    devmap_shims.uninstall()
    assert importhook.waiting() == 0


@pytest.mark.parametrize("fails", [False, True], ids=["import-succeeds", "import-fails"])
def test_install_during_another_threads_import_of_a_target_waits_for_it(fake_stack, fails):
    """install() while another thread is still running a target module: the shim arms when that
    import finishes (on the object the module left in sys.modules in its place), and when it fails,
    the module's code is not run a second time."""
    import threading

    (fake_stack / "fakelib" / "_gate.py").write_text(
        "import threading\nstarted, release, runs = threading.Event(), threading.Event(), []\n"
    )
    (fake_stack / "fakelib" / "slow.py").write_text(
        "import sys, threading, types\nfrom fakelib._gate import started, release, runs\n"
        "runs.append(threading.current_thread().name)\nstarted.set()\nrelease.wait(30)\n"
        "def compute(x):\n    return x\n"
        + ("raise RuntimeError('the import failed')\n" if fails else "")
        # as transformers' _LazyModule: the module puts another object in its place, same spec
        + "class _Lazy(types.ModuleType):\n    pass\n"
        "lazy = _Lazy(__name__)\nlazy.__dict__.update({k: v for k, v in globals().items() if k != '__name__'})\n"
        "sys.modules[__name__] = lazy\n"
    )
    from fakelib import _gate

    devmap_shims.register(Shim("fake-fix", ("fake-bug",), (Target("fakelib.slow", "compute"),), add_one),
                          matrix_rows=[fake_row(last_checked="2026-11-01")])
    outcome = []

    def import_it():
        try:
            import fakelib.slow

            outcome.append(fakelib.slow)
        except RuntimeError as exc:
            outcome.append(exc)

    importer = threading.Thread(target=import_it, name="importer")
    importer.start()
    assert _gate.started.wait(30)
    devmap_shims.install(only=["fake-fix"])
    _gate.release.set()
    importer.join(30)
    for waiter in [t for t in threading.enumerate() if t.name == "devmap-shims waits for fakelib.slow"]:
        waiter.join(30)
    assert _gate.runs == ["importer"]
    if fails:
        assert isinstance(outcome[0], RuntimeError)
    else:
        assert type(outcome[0]).__name__ == "_Lazy"
        assert outcome[0].compute(1) == 2 and shim_status()["state"] == "active"


def test_signature_and_docs_are_the_originals(fake_stack):
    import fakelib.core

    original = fakelib.core.compute
    register_fake()
    devmap_shims.install(only=["fake-fix"])
    assert inspect.signature(fakelib.core.compute) == inspect.signature(original)
    assert fakelib.core.compute.__doc__ == original.__doc__ and fakelib.core.compute.__name__ == "compute"


@pytest.mark.parametrize("qualname", ["Thing.to", "Thing.make", "Thing.describe"])
@pytest.mark.parametrize("compile_reachable", [False, True])
def test_methods_classmethods_staticmethods(fake_stack, qualname, compile_reachable):
    import fakelib.core

    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append((instance, args))
        return wrapped(*args, **kwargs)

    owner = fakelib.core.Thing
    raw = vars(owner)[qualname.split(".")[1]]
    register_fake(target=qualname, wrapper=spy, compile_reachable=compile_reachable)
    devmap_shims.install(only=["fake-fix"])
    thing = fakelib.core.SubThing("cpu")
    if qualname == "Thing.to":
        assert thing.to("cuda:1").device == "cuda:1"
        assert seen == [(thing, ("cuda:1",))]
    elif qualname == "Thing.make":
        assert fakelib.core.SubThing.make("cuda:2").device == "cuda:2"
        assert seen == [(fakelib.core.SubThing, ("cuda:2",))]
    else:
        assert thing.describe(5) == "thing 5"
        assert seen[0][1] == (5,)
    layer = vars(owner)[qualname.split(".")[1]]
    if compile_reachable:
        assert not isinstance(layer, wrapt.FunctionWrapper)
        assert inspect.isfunction(wrapping.callable_of(layer))
    devmap_shims.uninstall()
    assert vars(owner)[qualname.split(".")[1]] is raw


def test_status_is_plain_data(fake_stack):
    import json

    register_fake()
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core  # noqa: F401

    data = devmap_shims.status()
    json.dumps(data)  # plain data
    assert data["installed"] is True
    assert {"versions", "shims", "warnings", "imported_before_install", "auto_enabled"} <= set(data)
    assert data["versions"]["fakelib"] == "1.2.0"


@pytest.mark.parametrize("how", ["reload", "assign"])
def test_status_says_a_target_reloaded_or_replaced_after_arming_no_longer_runs_the_shim(fake_stack, how):
    import importlib

    register_fake(target="Thing.to", wrapper=lambda w, i, a, k: "repaired")
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    assert fakelib.core.Thing().to("cuda:1") == "repaired"
    assert shim_status()["state"] == "active"
    if how == "reload":
        importlib.reload(fakelib.core)  # a new Thing class, without the layer
    else:
        fakelib.core.Thing.to = lambda self, device: "replaced"
    assert fakelib.core.Thing().to("cuda:1") != "repaired"
    state = shim_status()
    assert state["state"] == "failed"
    (target,) = state["targets"]
    assert target["state"] == "failed" and target["reason"] == "replaced after arming"
    assert "fakelib.core:Thing.to no longer calls the layer of shim 'fake-fix'" in target["error"]
    assert "devmap_shims.uninstall() then devmap_shims.install()" in target["error"]
    assert "1 failed: fake-fix" in str(devmap_shims.status())  # the summary counts it as failed
    devmap_shims.uninstall()
    devmap_shims.install(only=["fake-fix"])  # what the message says: the new class gets the layer
    assert fakelib.core.Thing().to("cuda:1") == "repaired"
    assert shim_status()["state"] == "active"


def _decorated(below, kind):
    """``below`` under a foreign decorator that calls it and says so through ``__wrapped__``."""
    import functools

    if kind == "wrapt":
        return wrapt.FunctionWrapper(below, lambda w, i, a, k: w(*a, **k))

    @functools.wraps(below)
    def logged(*args, **kwargs):
        return below(*args, **kwargs)

    return logged


@pytest.mark.parametrize("compile_reachable", [False, True])
@pytest.mark.parametrize("kind", ["wrapt", "functools.wraps"])
@pytest.mark.parametrize("target", ["compute", "Thing.to", "Thing.make"])
def test_status_keeps_a_target_active_under_a_foreign_wrapper_that_calls_it(
    fake_stack, compile_reachable, kind, target
):
    """``module.f = deco(module.f)`` and ``Cls.m = deco(Cls.m)``, where ``Cls.m`` is the layer as read
    from the class (a bound wrapper or a bound method, not the layer itself)."""
    register_fake(target=target, compile_reachable=compile_reachable,
                  wrapper=lambda w, i, a, k: ("repaired", w(*a, **k)))
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    owner, name = (fakelib.core, target) if "." not in target else (fakelib.core.Thing, target.split(".")[1])
    call = {"compute": lambda: fakelib.core.compute(3), "Thing.to": lambda: fakelib.core.Thing().to("cuda:1"),
            "Thing.make": lambda: fakelib.core.Thing.make("cuda:1")}[target]
    if target == "Thing.make" and kind == "wrapt":  # wrapt's own way to patch a classmethod
        wrapt.wrap_function_wrapper(fakelib.core, target, lambda w, i, a, k: w(*a, **k))
    else:
        setattr(owner, name, _decorated(getattr(owner, name), kind))
    assert call()[0] == "repaired"  # the repair still runs ...
    assert shim_status()["state"] == "active"  # ... so status says so


def test_kill_switch_beats_install(fake_stack, monkeypatch):
    monkeypatch.setenv("DEVMAP_SHIMS", "0")
    register_fake()
    assert devmap_shims.install(only=["fake-fix"], force=["fake-fix"]) is False
    import fakelib.core

    assert fakelib.core.compute(3) == 6
    assert devmap_shims.status()["killed"] is True


def test_env_disable_and_force(fake_stack, monkeypatch):
    register_fake(spec=">=2.0")
    monkeypatch.setenv("DEVMAP_SHIMS_FORCE", "fake-fix")
    devmap_shims.install()
    import fakelib.core

    assert fakelib.core.compute(3) == 7
    devmap_shims.uninstall()
    monkeypatch.setenv("DEVMAP_SHIMS_DISABLE", "*")
    devmap_shims.install()
    assert fakelib.core.compute(3) == 6


def test_exclude_star_leaves_every_shim_off_as_the_variable_does(fake_stack, caplog):
    register_fake()
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        devmap_shims.install(exclude="*")
    import fakelib.core

    assert fakelib.core.compute(3) == 6  # the bug, unrepaired
    (entry,) = [s for s in devmap_shims.status()["shims"] if s["id"] == "fake-fix"]
    assert entry["state"] == "skipped" and not entry["selected"]
    assert {t["reason"] for t in entry["targets"]} == {"disabled by install(exclude='*')"}
    assert "unknown shim" not in caplog.text
    devmap_shims.uninstall()
    devmap_shims.install(exclude=["*"], force=["fake-fix"])  # force does not override a switch-off
    assert fakelib.core.compute(3) == 6


def test_repair_sees_the_original_through_wrapped(fake_stack):
    """Repairs bind arguments by name: inspect.signature(wrapped) must be the original's."""
    seen = []

    def introspect(wrapped, instance, args, kwargs):
        seen.append(list(inspect.signature(wrapped).parameters))
        return wrapped(*args, **kwargs)

    register_fake(wrapper=introspect)
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    assert fakelib.core.compute(3) == 6
    assert seen == [["x", "scale"]]


@pytest.mark.parametrize("order", [("Thing.to", "SubThing.to"), ("SubThing.to", "Thing.to")])
def test_two_targets_of_one_shim_on_the_same_attribute_wrap_it_once(fake_stack, order):
    """``SubThing.to`` is ``Thing.to`` inherited: both are wrapped where defined, so the second target
    would put a second layer of the same repair over the first."""
    calls = []

    def counting(wrapped, instance, args, kwargs):
        calls.append(args)
        return wrapped(*args, **kwargs)

    import fakelib.core

    original = vars(fakelib.core.Thing)["to"]
    shim = Shim("fake-fix", ("fake-bug",), tuple(Target("fakelib.core", q) for q in order), counting)
    devmap_shims.register(shim, matrix_rows=[fake_row()])
    devmap_shims.install(only=["fake-fix"])
    assert fakelib.core.SubThing().to("cuda:1").device == "cuda:1"
    assert calls == [("cuda:1",)]  # one repair per call
    first, second = shim_status()["targets"]
    assert first["state"] == "active" and second["state"] == "skipped"
    assert second["reason"] == f"the same attribute as fakelib.core:{order[0]}, which this shim wraps already"
    devmap_shims.uninstall()
    assert vars(fakelib.core.Thing)["to"] is original


@pytest.mark.parametrize("imported", ["before install", "after install"])
def test_an_override_that_only_claims_to_wrap_the_base_method_is_wrapped_too(fake_stack, imported,
                                                                             monkeypatch):
    """``@functools.wraps(Thing.to)`` on an override that never calls ``Thing.to``: its own
    attribute, so its own layer, whichever module is imported first."""
    import sys

    monkeypatch.delitem(sys.modules, "fakesub", raising=False)  # a fresh import in each case
    (fake_stack / "fakesub.py").write_text(
        "import functools\nfrom fakelib.core import Thing\n"
        "class Sub(Thing):\n"
        "    @functools.wraps(Thing.to)\n"
        "    def to(self, device, *, copy=False):\n"
        "        return Sub(device)\n"
    )
    calls = []

    def counting(wrapped, instance, args, kwargs):
        calls.append(type(instance).__name__)
        return wrapped(*args, **kwargs)

    if imported == "before install":
        import fakesub  # noqa: F401
    targets = (Target("fakelib.core", "Thing.to"), Target("fakesub", "Sub.to"))
    devmap_shims.register(Shim("fake-fix", ("fake-bug",), targets, counting), matrix_rows=[fake_row()])
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core  # noqa: F401
    import fakesub

    assert fakesub.Sub().to("cuda:1").device == "cuda:1"
    assert calls == ["Sub"]
    assert [t["state"] for t in shim_status()["targets"]] == ["active", "active"]


def test_two_targets_of_one_shim_on_the_same_attribute_with_their_own_wrappers_both_run(fake_stack):
    seen = []

    def noting(label):
        return lambda wrapped, instance, args, kwargs: seen.append(label) or wrapped(*args, **kwargs)

    targets = (Target("fakelib.core", "Thing.to", wrapper=noting("base")),
               Target("fakelib.core", "SubThing.to", wrapper=noting("sub")))
    devmap_shims.register(Shim("fake-fix", ("fake-bug",), targets), matrix_rows=[fake_row()])
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    fakelib.core.SubThing().to("cuda:1")
    assert sorted(seen) == ["base", "sub"]


def test_two_shims_on_one_target_stack_and_come_off(fake_stack):
    import fakelib.core

    original = fakelib.core.compute
    register_fake()
    devmap_shims.register(Shim("times-ten", ("fake-bug",), (Target("fakelib.core", "compute"),), lambda w, i, a, k: w(*a, **k) * 10))
    devmap_shims.install(only=["fake-fix", "times-ten"])
    assert fakelib.core.compute(3) in (61, 70)  # both layers run, whichever is outside
    assert {s["id"]: s["state"] for s in devmap_shims.status()["shims"] if s["id"] in ("fake-fix", "times-ten")} == {
        "fake-fix": "active", "times-ten": "active"}
    devmap_shims.uninstall()
    assert fakelib.core.compute is original


def test_a_shim_registered_over_one_whose_repair_failed_stacks_and_both_come_off(fake_stack, caplog):
    def broken(wrapped, instance, args, kwargs):
        raise KeyError("bug in the repair")

    import fakelib.core

    original = fakelib.core.compute
    register_fake(wrapper=broken)
    devmap_shims.install()
    assert fakelib.core.compute(3) == 6  # the repair failed: the library's own result, shim off
    devmap_shims.register(Shim("plus-ten", ("fake-bug",), (Target("fakelib.core", "compute"),),
                               lambda w, i, a, k: w(*a, **k) + 10))
    assert fakelib.core.compute(3) == 16
    states = {s["id"]: s["state"] for s in devmap_shims.status()["shims"]}
    assert (states["fake-fix"], states["plus-ten"]) == ("failed", "active")
    caplog.clear()
    devmap_shims.uninstall()
    assert fakelib.core.compute is original
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # each layer came off in turn


def test_shim_error_from_a_repair_passes_through_unchanged(fake_stack):
    from devmap_shims.shims.registry import ShimError

    def refuse(wrapped, instance, args, kwargs):
        raise ShimError("refused on purpose")

    register_fake(wrapper=refuse)
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    with pytest.raises(ShimError, match="^refused on purpose$"):
        fakelib.core.compute(3)


def test_a_library_error_the_repair_handled_is_not_raised_after_a_later_repair_bug(fake_stack, caplog):
    """A repair that tries a newer keyword, catches the TypeError, calls again and then fails on
    its own bug: the retry's result comes back and the shim goes off, as for any failing repair;
    the handled TypeError is not raised at the caller."""

    def retry_then_break(wrapped, instance, args, kwargs):
        try:
            result = wrapped(*args, new_option=True, **kwargs)
        except TypeError:
            result = wrapped(*args, **kwargs)
        return result + {}["missing"]

    register_fake(wrapper=retry_then_break)
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        assert fakelib.core.compute(3) == 6
    assert shim_status()["state"] == "failed" and shim_status()["call_failures"] == 1


def test_the_plain_call_after_a_failed_repair_gets_the_callers_arguments(fake_stack, caplog):
    def edit_then_break(wrapped, instance, args, kwargs):
        kwargs["scale"] = 10
        raise KeyError("device")

    register_fake(wrapper=edit_then_break)
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        assert fakelib.core.compute(3, scale=2) == 6
    assert shim_status()["state"] == "failed"


@pytest.mark.parametrize("exc_type", [GeneratorExit, asyncio.CancelledError, KeyboardInterrupt])
def test_control_flow_exceptions_reach_the_caller_and_keep_the_shim_on(fake_stack, exc_type):
    """``GeneratorExit`` and ``asyncio.CancelledError`` are not a broken repair: they go to the
    caller, the original is not run a second time, and the shim stays on."""
    calls = []

    def cancelled(wrapped, instance, args, kwargs):
        calls.append("repair")
        raise exc_type()

    register_fake(wrapper=cancelled)
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    with pytest.raises(exc_type):
        fakelib.core.compute(3)
    assert calls == ["repair"]
    assert shim_status()["state"] == "active" and shim_status()["call_failures"] == 0


def _generator_repair(wrapped, instance, args, kwargs):
    yield wrapped(*args, **kwargs) + 1


async def _coroutine_repair(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1


async def _async_generator_repair(wrapped, instance, args, kwargs):
    yield wrapped(*args, **kwargs) + 1


@pytest.mark.parametrize("repair, kind", [
    (_generator_repair, "a generator function"),
    (_coroutine_repair, "a coroutine function"),
    (_async_generator_repair, "an async generator function"),
])
@pytest.mark.parametrize("strict", [False, True])
def test_a_repair_that_would_run_after_the_call_returned_is_refused_at_arming(
    fake_stack, caplog, repair, kind, strict
):
    """Calling a generator or async repair returns before its body runs: an error in it would reach
    the caller out of the guard's reach, and the caller would get a generator or a coroutine in
    place of the library's result. Such a shim is refused when its target is armed, named with its
    repair, and the library runs unpatched (strict mode: the import raises)."""
    from devmap_shims.shims.registry import ShimError

    register_fake(wrapper=repair)
    devmap_shims.install(only=["fake-fix"], strict=strict)
    if strict:
        with pytest.raises(ShimError, match=f"{repair.__name__}.* is {kind}"):
            import fakelib.core  # noqa: F401
        return
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        import fakelib.core

        assert fakelib.core.compute(3) == 6
    assert shim_status()["state"] == "failed"
    warned = [r.getMessage() for r in caplog.records if "fake-fix" in r.getMessage()]
    assert len(warned) == 1 and f"{repair.__name__}' is {kind}" in warned[0], warned
    assert "Report this" not in warned[0]  # the shim's own mistake, not one for devmap-shims to hear of


def test_a_shim_whose_state_cannot_be_made_is_off_and_the_others_install(fake_stack, caplog):
    """``Shim(state=factory)`` raising at install() fails that shim alone, with one warning; the
    other shims arm, install() succeeds again, and a fork's fresh states do not stop at it."""
    from devmap_shims.shims import engine

    def broken_state():
        raise RuntimeError("state factory broke")

    register_fake()
    devmap_shims.register(Shim("times-ten", ("fake-bug",), (Target("fakelib.core", "compute"),),
                               lambda w, i, a, k: w(*a, **k) * 10, state=broken_state))
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        for _ in range(2):
            assert devmap_shims.install(only=["fake-fix", "times-ten"])
            import fakelib.core

            assert fakelib.core.compute(3) == 7
            broken = shim_status("times-ten")
            assert broken["state"] == "failed" and "state factory broke" in broken["targets"][0]["error"]
            assert shim_status()["state"] == "active"
            assert devmap_shims.uninstall()
    assert sum("state factory broke" in r.getMessage() for r in caplog.records) == 1
    devmap_shims.install(only=["fake-fix", "times-ten"])
    engine._after_fork_in_child()  # what a forked child runs: the broken factory does not stop it
    assert fakelib.core.compute(3) == 7


def test_a_strict_install_raises_when_a_shims_state_cannot_be_made(fake_stack):
    from devmap_shims.shims.registry import ShimError

    register_fake(state=lambda: {}["missing"])
    with pytest.raises(ShimError, match="making its state"):
        devmap_shims.install(only=["fake-fix"], strict=True)


@pytest.mark.parametrize("when", ["before install", "while installed"])
def test_a_class_in_sys_modules_does_not_stop_install_or_uninstall(fake_stack, monkeypatch, when):
    """A class placed in ``sys.modules`` (a settings object) has a read-only ``mappingproxy`` for a
    namespace: its copy of the target stays as it is, and install() and uninstall() go on."""
    import sys

    import fakelib.core

    register_fake()

    def place():
        monkeypatch.setitem(sys.modules, "acme_settings", type("Settings", (), {"compute": fakelib.core.compute}))

    if when == "before install":
        place()
    assert devmap_shims.install(only=["fake-fix"])
    assert fakelib.core.compute(3) == 7
    if when == "while installed":
        place()
    assert devmap_shims.uninstall() and not devmap_shims.is_installed()
    assert fakelib.core.compute(3) == 6


def test_a_shim_registered_while_install_loads_plugins_is_installed(fake_stack, monkeypatch):
    """Plugins load without the registry lock held; a register() from another thread meanwhile
    is part of that install, as it was while install() held the lock throughout."""
    import threading

    from devmap_shims.shims.engine import Engine

    load_plugins = Engine._plugins
    others = []

    def plugins_while_another_thread_registers(self, *args, **kwargs):
        if not others:
            others.append(threading.Thread(target=register_fake))
            others[0].start()
            others[0].join()
        return load_plugins(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "_plugins", plugins_while_another_thread_registers)
    assert devmap_shims.install()
    import fakelib.core

    assert fakelib.core.compute(3) == 7 and shim_status()["state"] == "active"


def test_install_decides_again_without_its_lock_when_another_thread_installed_meanwhile(fake_stack, monkeypatch):
    import threading

    from devmap_shims.shims.engine import ENGINE, Engine

    load_plugins = Engine._plugins
    held = []

    def plugins_while_another_thread_installs(self, *args, **kwargs):
        held.append(self.registry.lock._is_owned())
        if len(held) == 1:
            other = threading.Thread(target=lambda: (devmap_shims.install(), devmap_shims.uninstall()))
            other.start()
            other.join()
        return load_plugins(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "_plugins", plugins_while_another_thread_installs)
    assert devmap_shims.install() and ENGINE.installed
    assert held == [False, False, False]  # the first call, the other thread's, the retry


def test_a_method_repair_reads_positional_arguments_by_name(fake_stack):
    """The original a method's repair gets is bound: its signature has no ``self``, so reading
    ``device`` by name finds the first positional argument, not the second."""
    from devmap_shims.calls import argument, bind

    seen = []

    def read(wrapped, instance, args, kwargs):
        seen.append((argument(wrapped, "device", args, kwargs), bind(wrapped, args, kwargs)))
        return wrapped(*args, **kwargs)

    register_fake(target="Thing.to", wrapper=read)
    devmap_shims.install(only=["fake-fix"])
    import fakelib.core

    fakelib.core.Thing("cpu").to("cuda:1")
    assert seen == [((True, "cuda:1"), {"device": "cuda:1", "copy": False})]
