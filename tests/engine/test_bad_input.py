"""Junk from the environment, plugins and rows: one clear message naming the culprit, and the program goes on."""

from __future__ import annotations

import logging

import pytest

import devmap_shims
from devmap_shims import Shim, Target
from devmap_shims.shims import config, plugins
from devmap_shims.shims.engine import ENGINE

from .conftest import add_one, fake_row


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        ("DEVMAP_SHIMS", "maybe", "DEVMAP_SHIMS='maybe' is not understood; use 1 or 0"),
        ("DEVMAP_SHIMS_STRICT", "2", "DEVMAP_SHIMS_STRICT='2' is not understood; use 1 or 0"),
        ("DEVMAP_SHIMS_NO_PLUGINS", "please", "DEVMAP_SHIMS_NO_PLUGINS='please' is not understood"),
        ("DEVMAP_SHIMS_LOG", "verbose", "DEVMAP_SHIMS_LOG='verbose' is not a log level; use one of debug, info, warning"),
    ],
)
def test_junk_flag_values_are_named_once(variable, value, expected, monkeypatch, caplog):
    monkeypatch.setenv(variable, value)
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        assert devmap_shims.install() is True
        devmap_shims.install()
    assert caplog.text.count(expected) == 1, caplog.text


@pytest.mark.parametrize("variable", ["DEVMAP_SHIMS_DISABLE", "DEVMAP_SHIMS_FORCE"])
def test_unknown_ids_in_variables_list_the_known_ones(variable, monkeypatch):
    settings = config.read_settings({variable: "device-map-balance, no-such-shim ,"})
    problems = config.unknown_id_problems(settings, ["device-map-balance", "quant-state-follows-weight"])
    assert problems == [
        f"{variable} names unknown shim 'no-such-shim'; known shims: device-map-balance, "
        "quant-state-follows-weight. Ignoring it."
    ]


def test_a_mistyped_id_in_a_variable_gets_the_closest_known_one(monkeypatch):
    settings = config.read_settings({"DEVMAP_SHIMS_DISABLE": "device-map-balanse", "DEVMAP_SHIMS_FORCE": "a,b"})
    known = ["device-map-balance", "quant-state-follows-weight"]
    assert config.unknown_id_problems(settings, known) == [
        "DEVMAP_SHIMS_DISABLE names unknown shim 'device-map-balanse'; did you mean 'device-map-balance'? "
        "Ignoring it.",
        "DEVMAP_SHIMS_FORCE names 2 unknown shims, 'a' and 'b'; known shims: device-map-balance, "
        "quant-state-follows-weight. Ignoring them.",
    ]
    refused = config.unknown_id_problems(settings, known, ignored=False)  # strict mode's error
    assert [p for p in refused if "Ignoring" in p] == [] and refused[0].endswith("'device-map-balance'?")


def test_ten_thousand_unknown_ids_are_one_short_warning_each_place(monkeypatch):
    ids = [f"id{i}" for i in range(10_000)]
    monkeypatch.setenv("DEVMAP_SHIMS_DISABLE", ",".join(ids))
    monkeypatch.setenv("DEVMAP_SHIMS_PLUGINS", ",".join(ids))
    devmap_shims.install(_auto=True)  # at start-up, where DEVMAP_SHIMS_PLUGINS is read
    devmap_shims.uninstall()
    devmap_shims.install(exclude=ids)
    lines = devmap_shims.status()["warnings"]
    by_place = {place: [m for m in lines if m.startswith(place)]
                for place in ("DEVMAP_SHIMS_DISABLE", "install(exclude=...)", "DEVMAP_SHIMS_PLUGINS")}
    assert all(len(found) == 1 for found in by_place.values()), lines
    assert all(len(m) < 2000 for m in lines), max(lines, key=len)[:300]
    assert "10000 unknown shims, 'id0', 'id1', 'id2', 'id3', 'id4' and 9995 more" in by_place["DEVMAP_SHIMS_DISABLE"][0]
    assert "10000 distributions, 'id0'" in by_place["DEVMAP_SHIMS_PLUGINS"][0]


def test_a_malformed_shim_is_refused_where_it_is_declared_not_at_every_install():
    wrapper = lambda w, i, a, k: w(*a, **k)  # noqa: E731
    with pytest.raises(TypeError, match="targets must be devmap_shims.Target objects"):
        Shim("my-fix", ("my-bug",), ("accelerate.utils.modeling:get_max_memory",), wrapper)
    with pytest.raises(TypeError, match="Target module must be a non-empty string"):
        Target(None, None)
    with pytest.raises(TypeError, match="Shim id must be a non-empty string"):
        Shim("", ("my-bug",), (), wrapper)
    assert Target("m", "f", expect_params="max_memory").expect_params == ("max_memory",)
    assert devmap_shims.install() and devmap_shims.is_installed()


def test_malformed_plugin_row_is_dropped_with_its_name_and_field(fake_stack, caplog):
    bad = fake_row("bad-row", spec="not a specifier")
    good = fake_row("fake-bug")
    devmap_shims.register(Shim("fake-fix", ("fake-bug",), (Target("fakelib.core", "compute"),), add_one), [bad, good])
    with caplog.at_level(logging.WARNING, logger="devmap_shims"):
        devmap_shims.install(only=["fake-fix"])
        import fakelib.core

        assert fakelib.core.compute(3) == 7  # the good row still arms the shim
    assert "bad-row" in caplog.text and "'affected'" in caplog.text and "the row is ignored" in caplog.text
    assert "device-map-balance" in {s["id"] for s in devmap_shims.status()["shims"]}  # built-ins unaffected


class _EntryPoint:
    def __init__(self, name, obj):
        self.name, self.value, self._obj = name, f"acme:{name}", obj

    def load(self):
        if isinstance(self._obj, BaseException):
            raise self._obj
        return self._obj() if callable(self._obj) and not isinstance(self._obj, Shim) else self._obj


def plugin(monkeypatch, *eps, dist="acme-plugin"):
    """These entry points, of distribution ``dist``, in every group."""
    monkeypatch.setattr(plugins, "entry_points", lambda group: [(dist, ep) for ep in eps])


def test_plugin_colliding_with_a_builtin_id_is_renamed_and_said(monkeypatch):
    shim = Shim("device-map-balance", ("x",), (Target("acme.core", "f"),), add_one)
    plugin(monkeypatch, _EntryPoint("acme", [shim, shim]))
    shims, problems = plugins.plugin_shims(["device-map-balance"], [])
    assert [s.id for s in shims] == ["acme-plugin:device-map-balance"]
    assert any("is the id of a built-in shim; it is registered as 'acme-plugin:device-map-balance'" in p for p in problems)
    assert any("declared twice" in p for p in problems)


def test_plugin_that_raises_on_import_is_skipped(monkeypatch):
    plugin(monkeypatch, _EntryPoint("boom", ImportError("No module named 'acme_missing'")))
    shims, problems = plugins.plugin_shims([], [])
    assert shims == []
    assert problems == [
        "plugin acme-plugin: shim entry point 'boom' (acme:boom) failed to load (ImportError: No module named "
        "'acme_missing'); it is skipped"
    ]


def test_plugin_entry_point_that_is_not_a_shim(monkeypatch):
    plugin(monkeypatch, _EntryPoint("odd", [42]))
    shims, problems = plugins.plugin_shims([], [])
    assert shims == [] and "gave 42, not a devmap_shims Shim" in problems[0]


def test_install_arguments_of_the_wrong_type_are_named_not_read_as_true(fake_stack):
    """strict="false" was strict mode on, plugins="no" plugins on; only=5 an 'int is not iterable'
    from deep inside. A switch takes a bool or the environment variables' words; ids a list of
    strings or one string of ids separated by commas, as DEVMAP_SHIMS_DISABLE takes them."""
    with pytest.raises(TypeError, match=r"install\(only=...\) takes shim ids.*not int"):
        devmap_shims.install(only=5)
    with pytest.raises(TypeError, match=r"install\(exclude=...\) takes shim ids.*a list holding int 3"):
        devmap_shims.install(exclude=["device-map-balance", 3])
    with pytest.raises(TypeError, match=r"install\(strict='maybe'\) takes True or False"):
        devmap_shims.install(strict="maybe")
    with pytest.raises(TypeError, match=r"install\(plugins=\[\]\) takes True or False"):
        devmap_shims.install(plugins=[])
    assert not devmap_shims.is_installed()
    with pytest.raises(ValueError, match="install\\(only=...\\) names unknown shim ''"):
        devmap_shims.install(only="", strict=True)  # no id at all: named, not "no shim"
    assert devmap_shims.install(strict="false", exclude="device-map-balance, tied-sizes-counted-once")
    data = devmap_shims.status()
    assert data["strict"] is False and data["warnings"] == []
    off = {s["id"] for s in data["shims"] if not s["selected"]}
    assert off == {"device-map-balance", "tied-sizes-counted-once"}


def test_a_shim_id_the_variables_cannot_name_is_refused_where_it_is_declared():
    for bad in ("Bad Id!", "a,b", "*"):
        with pytest.raises(ValueError, match="cannot be named in DEVMAP_SHIMS_DISABLE"):
            Shim(bad, ("x",), (Target("a.b", "c"),), add_one)


def test_register_refuses_a_target_without_a_wrapper_and_labels_the_shim_it_keeps():
    with pytest.raises(ValueError, match=r"gives no wrapper for a.b:c: pass Shim\(wrapper=...\)"):
        devmap_shims.register(Shim("nowrap", ("x",), (Target("a.b", "c"),)))
    devmap_shims.register(Shim("mine", ("x",), (Target("a.b", "c"),), add_one))
    devmap_shims.install()
    assert next(s for s in devmap_shims.status()["shims"] if s["id"] == "mine")["source"] == "register()"


def test_register_rejects_non_shims_and_duplicates():
    with pytest.raises(TypeError, match="takes a devmap_shims.Shim"):
        devmap_shims.register("device-map-balance")
    shim = Shim("mine", ("x",), (Target("a.b", "c"),), add_one)
    devmap_shims.register(shim)
    with pytest.raises(ValueError, match="already registered"):
        devmap_shims.register(shim)
    # before install() as after it: install() would keep the built-in shim and drop this one unsaid
    with pytest.raises(ValueError, match="'device-map-balance' is the id of a built-in shim"):
        devmap_shims.register(Shim("device-map-balance", ("x",), (Target("a.b", "c"),), add_one))
    assert ENGINE.registry.warnings == []
