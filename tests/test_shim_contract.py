"""The contract every shim is held to, built-in or plugin: one test, parametrized over all of them.

A new shim gets these checks by being registered (a built-in one by having its module under
``devmap_shims/hooks/<library>/``). Checks that need a target library run on the stacks that have
it and skip elsewhere, saying why; the sample plugin shim below needs none, so every check runs
for at least one shim on every stack.

For each shim: its module imports no target library; its declaration is well-formed and its rows
exist (``fixes`` and the rows agree); each target resolves on the installed stack, on the class it
names, with the parameters the wrapper expects (or is skipped with a reason); inside the rows'
ranges it arms, outside it stays off, ``force`` arms it; with nothing to repair, results and
exceptions pass through unchanged; the wrapped target keeps the original's signature and pickles
and deep-copies as the original does (and is a plain function where compiled code reaches it); install, uninstall, install leaves exactly one layer and
restores by-name copies; a repair that raises gives the original's result, one warning per shim,
state ``failed``, and raises in strict mode.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import itertools
import pickle
import re
import subprocess
import sys
import textwrap
import types

import pytest

from devmap_shims import Shim, Target
from devmap_shims.compat_matrix import load_matrix
from devmap_shims.shims import ShimContext, ShimError, catalog, wrapping
from devmap_shims.shims.engine import ENGINE
from devmap_shims.shims.guard import bind_context
from devmap_shims.shims.record import resolve_ref
from devmap_shims.shims.registry import Registry
from devmap_shims.versions import TARGET_DISTRIBUTIONS, installed_versions, version_in

# -- the sample plugin: a shim for a bug in "contractlib", a library written by this module ----------
SAMPLE_LIB = "contractlib"
SAMPLE_CORE = '''
def scale(x, factor=2):
    """Multiply x by factor."""
    return x * factor

class Box:
    def __init__(self, device="cpu"):
        self.device = device

    def to(self, device, *, copy=False):
        return Box(device)

    @classmethod
    def make(cls, device):
        return cls(device)
'''
SAMPLE_ROW = {
    "id": "contract-sample:scale-off-by-one",
    "title": "scale() is off by one",
    "library": SAMPLE_LIB,
    "affected": {SAMPLE_LIB: ">=1.0,<2.0"},
    "fixed_in": {SAMPLE_LIB: "2.0.0"},
    "symptom": "scale(3) returns 6",
    "root_cause": "sample",
    "upstream": ["acme/contractlib#1"],
    "verification": ["I"],
    "workaround": "upgrade contractlib",
    "source": "contract-sample",
}


def _sample_repair(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    return result + 1 if isinstance(result, int) and not isinstance(result, bool) else result


SAMPLE = Shim(
    "contract-sample:scale-fix",
    (SAMPLE_ROW["id"],),
    (Target(f"{SAMPLE_LIB}.core", "scale", expect_params=("x",)), Target(f"{SAMPLE_LIB}.core", "Box.to")),
    _sample_repair,
    summary="sample plugin shim",
    source="plugin contract-sample",
)

BUILTIN, _PROBLEMS = catalog.builtin_shims()
SHIMS = BUILTIN + [SAMPLE]
MATRIX = load_matrix(extra_rows=[SAMPLE_ROW])
SENTINEL = object()


@pytest.fixture(scope="module", autouse=True)
def sample_library(tmp_path_factory):
    """contractlib 1.5.0 on sys.path, with dist-info so that its version is read as installed."""
    root = tmp_path_factory.mktemp("site")
    (root / SAMPLE_LIB).mkdir()
    (root / SAMPLE_LIB / "__init__.py").write_text("from contractlib.core import scale, Box\n")
    (root / SAMPLE_LIB / "core.py").write_text(textwrap.dedent(SAMPLE_CORE))
    (root / "contractconsumer.py").write_text("from contractlib.core import scale\n")
    dist = root / f"{SAMPLE_LIB}-1.5.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {SAMPLE_LIB}\nVersion: 1.5.0\n")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    yield root
    sys.path.remove(str(root))
    for name in list(sys.modules):
        if name.split(".")[0] in (SAMPLE_LIB, "contractconsumer"):
            del sys.modules[name]


@pytest.fixture(autouse=True)
def engine(monkeypatch):
    """A fresh engine that knows the sample plugin (as if its distribution were installed)."""
    for name in [n for n in __import__("os").environ if n.startswith("DEVMAP_SHIMS")]:
        monkeypatch.delenv(name)
    ENGINE.reset()
    ENGINE.register(SAMPLE, [SAMPLE_ROW])
    yield ENGINE
    ENGINE.reset()


def per_shim(test):
    return pytest.mark.parametrize("shim", SHIMS, ids=[s.id for s in SHIMS])(test)


def is_builtin(shim: Shim) -> bool:
    return shim.source == "builtin"


def module_of(shim: Shim) -> str:
    for ref in [shim.wrapper] + [t.wrapper for t in shim.targets]:
        if ref is not None:
            return ref.partition(":")[0] if isinstance(ref, str) else ref.__module__
    raise AssertionError(f"{shim.id} names no wrapper")


# -- resolving targets on the installed stack ---------------------------------------------------------
def resolve_target(target: Target):
    """``(owner, name, raw attribute)`` of ``target`` on this stack, or a string saying why it is not
    used here (the engine skips such a target with that reason)."""
    versions = installed_versions(sorted(set(TARGET_DISTRIBUTIONS) | {SAMPLE_LIB} | set(target.when)))
    top = target.module.split(".")[0]
    if top in TARGET_DISTRIBUTIONS and versions.get(top) is None:
        return f"{target.key}: {top} is not installed on this stack"
    for dist, spec in target.when.items():
        if versions.get(dist) is None or not version_in(versions[dist], spec):
            return f"{target.key}: only used where {dist} {spec} (here {versions.get(dist)})"
    try:
        module = importlib.import_module(target.module)
        return wrapping.resolve(module, target.qualname)
    except (ImportError, AttributeError) as exc:
        return f"{target.key} does not exist on this stack ({type(exc).__name__}: {exc})"


def resolvable(shim: Shim):
    """``[(target, (owner, name, raw))]`` for the targets that exist here; skips when none does."""
    found, reasons = [], []
    for target in shim.targets:
        resolved = resolve_target(target)
        if isinstance(resolved, str):
            reasons.append(resolved)
        else:
            found.append((target, resolved))
    if not found:
        pytest.skip("; ".join(reasons))
    return found


def original_callable(owner, name, raw):
    """The original as code calls it: a bound method's signature has no ``self``."""
    func = wrapping.callable_of(raw)
    if isinstance(owner, type) and not isinstance(raw, staticmethod):
        params = list(inspect.signature(func).parameters.values())[1:]
        return func, inspect.Signature(params)
    return func, inspect.signature(func)


# -- versions inside and outside a shim's rows ---------------------------------------------------------
def _candidates(spec: str):
    found = []
    for version in re.findall(r"\d+(?:\.\d+)*", spec):
        parts = [int(p) for p in version.split(".")]
        found.append(version)
        found.append(".".join(map(str, parts[:-1] + [parts[-1] + 1])))
        if parts[-1] > 0:
            found.append(".".join(map(str, parts[:-1] + [parts[-1] - 1])))
    return found + ["0.0.1", "999.0"]


def inside(spec: str):
    return next((v for v in _candidates(spec) if version_in(v, spec)), None)


def outside(spec: str):
    return next((v for v in _candidates(spec) if not version_in(v, spec)), None)


def versions_where(shim: Shim, applies: bool) -> dict:
    """Installed versions changed so that the shim's first row applies, or so that none of its rows
    does (a version outside each range, else the library absent where every version is affected)."""
    versions = dict(installed_versions(sorted(set(TARGET_DISTRIBUTIONS) | {SAMPLE_LIB})))
    rows = [MATRIX.get(bug_id) for bug_id in shim.fixes]
    if applies:
        versions.update({dist: inside(spec) for dist, spec in rows[0].affected.items()})
    else:
        dists = sorted({dist for row in rows for dist in row.affected})
        choices = [[outside(row.affected[d]) for row in rows if d in row.affected] + [None] for d in dists]
        for values in itertools.product(*choices):
            trial = dict(versions, **dict(zip(dists, values)))
            if not any(row.applies(trial) for row in rows):
                versions = trial
                break
    assert any(row.applies(versions) for row in rows) is applies, versions
    return versions


# -- declaration and rows -----------------------------------------------------------------------------------
def test_every_builtin_module_declares_a_shim():
    assert _PROBLEMS == []
    assert [module_of(s) for s in BUILTIN] == catalog.builtin_modules()


@per_shim
def test_declaration_is_well_formed(shim):
    assert re.match(r"^[a-z0-9]+(?:[-:][a-z0-9]+)*$", shim.id), shim.id
    assert shim.fixes and shim.targets and shim.summary
    for target in shim.targets:
        assert "." in target.module, f"{target.key}: hook the defining submodule, not a lazy top-level package"
        assert callable(resolve_ref(shim.wrapper_for(target)))
        if is_builtin(shim):  # built-in shim modules are imported just before one of these is
            top = target.module.split(".")[0]
            assert top in TARGET_DISTRIBUTIONS or top in catalog.libraries(), target.key
    if is_builtin(shim):
        module = importlib.import_module(module_of(shim))
        library = MATRIX.get(shim.fixes[0]).library
        assert module.__name__ == f"devmap_shims.hooks.{library}.{shim.id.replace('-', '_')}", (
            "a built-in shim lives in hooks/<library of its first row>/<shim id with _>.py"
        )
        assert catalog.ROWS_HEADING in (module.__doc__ or "")


@per_shim
def test_fixes_and_rows_agree(shim):
    from devmap_shims.scenarios import all_scenarios

    for bug_id in shim.fixes:
        assert bug_id in MATRIX, f"{shim.id} fixes {bug_id!r}, which is no row of the matrix"
    owners = catalog.shim_of_rows(SHIMS)
    assert all(owners[bug_id] == shim.id for bug_id in shim.fixes), "each row is fixed by one shim"
    module = module_of(shim)
    for bug_id, items in all_scenarios().items():
        for item in items:
            if item.func.__module__ == module:
                assert bug_id in shim.fixes, f"{module} replays {bug_id!r} but its shim does not fix it"


@per_shim
def test_importing_the_module_imports_no_target_library(shim):
    if not is_builtin(shim):
        pytest.skip("the sample plugin is declared in this test module")
    heavy = list(TARGET_DISTRIBUTIONS) + ["typing", "inspect", "logging"]
    code = f"import sys, {module_of(shim)}; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {sys.path!r}; {code}"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module_of(shim)} imports {out.strip()} (install() imports it at start-up)"


@per_shim
def test_each_target_resolves_on_the_class_it_names_with_the_expected_parameters(shim):
    for target, (owner, name, raw) in resolvable(shim):
        owner_name = target.qualname.rpartition(".")[0]
        if owner_name:
            named = functools.reduce(getattr, owner_name.split("."), importlib.import_module(target.module))
            assert owner is named or owner.__module__.split(".")[0] == target.module.split(".")[0], (
                f"{target.key} would be wrapped on {owner.__module__}.{owner.__name__}, outside its library"
            )
        params = set(inspect.signature(wrapping.callable_of(raw)).parameters)
        assert set(target.expect_params) <= params, target.key


# -- arming -----------------------------------------------------------------------------------------------
def states(engine, shim):
    return {t.target.key: t for t in engine.registry.shims[shim.id].targets if t.target in shim.targets}


@per_shim
@pytest.mark.parametrize("case", ["inside", "outside", "forced"])
def test_arms_inside_its_range_stays_off_outside_and_force_arms_it(shim, case, engine, monkeypatch):
    resolved = {t.key: found for t, found in resolvable(shim)}
    versions = versions_where(shim, applies=case == "inside")
    monkeypatch.setattr(Registry, "versions", lambda self: versions)
    engine.install(only=[shim.id], force=[shim.id] if case == "forced" else [])
    try:
        active = 0
        for key, entry in states(engine, shim).items():
            if key not in resolved:
                continue
            if case == "outside":
                assert entry.state == "skipped" and "bug not present" in entry.reason, (key, entry.reason)
                assert not wrapping.is_ours(vars(resolved[key][0])[resolved[key][1]])
            elif entry.target.when and entry.state == "skipped":
                # a target limited to some consumer versions (``when=``) may sit out the chosen ones
                assert "target not used on this stack" in entry.reason, (key, entry.reason)
            else:
                assert entry.state == "active", (key, entry.state, entry.reason)
                active += 1
        if case != "outside" and resolved:
            assert active, f"no target of {shim.id} armed"
    finally:
        engine.uninstall()


# -- the healthy path ---------------------------------------------------------------------------------------
@per_shim
def test_with_nothing_to_repair_results_and_errors_pass_through(shim):
    """Every argument None and no instance: the repair finds nothing to do and must not fail."""
    context = ShimContext(shim)
    for target, (owner, name, raw) in resolvable(shim):
        func, signature = original_callable(owner, name, raw)
        kwargs = {p.name: None for p in signature.parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        repair = bind_context(resolve_ref(shim.wrapper_for(target)), context)

        def returns(*args, **kw):
            return SENTINEL

        error = LookupError("raised by the library")

        def raises(*args, **kw):
            raise error

        for stub in (returns, raises):
            stub.__signature__ = signature
            stub.__name__ = func.__name__
        assert repair(returns, None, (), dict(kwargs)) is SENTINEL, target.key
        with pytest.raises(LookupError) as caught:
            repair(raises, None, (), dict(kwargs))
        assert caught.value is error, target.key


@per_shim
def test_wrapped_target_keeps_signature_and_pickles_and_copies_like_the_original(shim, engine):
    resolved = resolvable(shim)
    accessed = {t.key: getattr(owner, name) for t, (owner, name, raw) in resolved}
    engine.install(only=[shim.id], force=[shim.id])
    try:
        for target, (owner, name, raw) in resolved:
            layer = getattr(owner, name)
            assert wrapping.is_ours(vars(owner)[name]), target.key
            if shim.compile_reachable:  # Dynamo traces plain functions, and skips or crashes on proxies
                assert inspect.isfunction(wrapping.callable_of(vars(owner)[name])), target.key
            original = accessed[target.key]
            assert inspect.signature(layer) == inspect.signature(original), target.key
            assert getattr(layer, "__doc__", None) == getattr(original, "__doc__", None), target.key
            assert copy.deepcopy(layer) is layer and copy.copy(layer) is layer, target.key
            again = pickle.loads(pickle.dumps(layer))
            assert getattr(again, "__wrapped__", again) == getattr(layer, "__wrapped__", layer), target.key
    finally:
        engine.uninstall()


@per_shim
def test_install_uninstall_install_leaves_one_layer_and_restores_copies(shim, engine):
    resolved = resolvable(shim)
    copies = {}
    for target, (owner, name, raw) in resolved:
        if not isinstance(owner, type):
            copies[target.key] = [(m, k) for m, mod in list(sys.modules.items()) if mod is not None
                                  for k, v in list(getattr(mod, "__dict__", {}).items()) if v is raw]
    for _ in range(2):
        engine.install(only=[shim.id], force=[shim.id])
        for target, (owner, name, raw) in resolved:
            layer = vars(owner)[name]
            assert wrapping.owned_original(layer) is raw, f"{target.key}: not exactly one layer over the original"
            for module_name, key in copies.get(target.key, []):
                assert sys.modules[module_name].__dict__[key] is layer, f"{module_name}.{key} not rebound"
        engine.uninstall()
        for target, (owner, name, raw) in resolved:
            assert vars(owner)[name] is raw, target.key
            for module_name, key in copies.get(target.key, []):
                assert sys.modules[module_name].__dict__[key] is raw, f"{module_name}.{key} not restored"
    assert wrapping.layers_in_place() == 0


# -- a repair that raises ---------------------------------------------------------------------------------
def stand_in(target: Target, index: int):
    """A module named like nothing real, holding ``target``'s qualname as a stub returning SENTINEL."""
    parts = target.qualname.split(".")
    if len(parts) > 2:
        pytest.skip(f"{target.key}: nested qualnames have no stand-in")
    module = types.ModuleType(f"devmap_contract_stand_in_{index}")

    def stub(*args, **kwargs):
        if parts[-1] == "__init__":  # a constructor returns None: what it made is the instance's state
            args[0].made = SENTINEL
            return None
        return SENTINEL

    if len(parts) == 1:
        setattr(module, parts[0], stub)
    else:
        setattr(module, parts[0], type(parts[0], (), {parts[1]: stub}))
    sys.modules[module.__name__] = module
    return module


def call_stand_in(module, qualname: str):
    """What the stand-in gave: its result, or for a constructor what it set on the new instance."""
    owner, _, name = qualname.rpartition(".")
    if name == "__init__":
        return getattr(module, owner)().made
    return getattr(getattr(module, owner)() if owner else module, name)()


@per_shim
@pytest.mark.parametrize("strict", [False, True], ids=["fallback", "strict"])
def test_a_repair_that_raises_gives_the_original_result_one_warning_and_state_failed(shim, strict, engine):
    """The shim's targets, with its wrapper replaced by one that raises after the original ran."""
    calls = []

    def broken(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        calls.append(getattr(instance, "made", None) if result is None else result)  # __init__: see stand_in
        raise RuntimeError("repair broke")

    modules = [stand_in(t, i) for i, t in enumerate(shim.targets)]
    try:
        targets = tuple(Target(m.__name__, t.qualname, wrapper=broken) for m, t in zip(modules, shim.targets))
        broken_shim = shim.replace(id="contract-broken", targets=targets, wrapper=broken, state=shim.state,
                                   more_targets=None)
        engine.register(broken_shim)
        engine.install(only=["contract-broken"], force=["contract-broken"], strict=strict)
        for module, target in zip(modules, targets):
            if strict:
                with pytest.raises(ShimError, match="repair broke") as raised:
                    call_stand_in(module, target.qualname)
                # says what strict mode did, not the fallback it did not take
                assert "Strict mode" in str(raised.value) and "went on without" not in str(raised.value)
                continue
            assert call_stand_in(module, target.qualname) is SENTINEL
            assert call_stand_in(module, target.qualname) is SENTINEL
        assert calls and all(result is SENTINEL for result in calls)
        status = next(s for s in engine.status()["shims"] if s["id"] == "contract-broken")
        if not strict:
            assert status["state"] == "failed"
            assert len([w for w in engine.registry.warnings if "'contract-broken'" in w]) == 1
    finally:
        engine.uninstall()
        for module in modules:
            sys.modules.pop(module.__name__, None)
