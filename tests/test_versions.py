"""Normalised version comparison: torch builds people run must land in the right range."""

from __future__ import annotations

import pytest

from devmap_shims.versions import installed_version, normalize, release_tuple, satisfies, version_in


@pytest.mark.parametrize(
    "version, release",
    [
        ("2.6.0a0+ecf3bae40a.nv25.01", "2.6"),  # NVIDIA NGC container build
        ("2.6.0.dev20241112+cu124", "2.6"),  # nightly
        ("2.6.0rc1", "2.6"),
        ("2.5.1+cu121", "2.5.1"),  # local tag
        ("0.45.3", "0.45.3"),
        ("1!2.0", "2"),
    ],
)
def test_normalize(version, release):
    assert normalize(version) == release


@pytest.mark.parametrize(
    "version", ["2.6.0a0+ecf3bae40a.nv25.01", "2.6.0.dev20241112+cu124", "2.6.0rc1"]
)
def test_prerelease_torch_builds_count_as_their_release(version):
    # plain PEP 440 puts these in neither range; a two-range matrix would miss them
    assert version_in(version, ">=2.6")
    assert not version_in(version, "<2.6")
    assert version_in(version, ">=2.5,<2.7")


def test_local_tag_is_its_release():
    assert version_in("2.5.1+cu121", "==2.5.1")
    assert version_in("2.5.1+cu121", "<2.6")
    assert not version_in("2.5.1+cu121", ">=2.6")


def test_bitsandbytes_fix_boundary():
    assert version_in("0.45.2", ">=0.41.2,<0.45.3")
    assert not version_in("0.45.3", ">=0.41.2,<0.45.3")
    assert version_in("0.45.3.dev0", ">=0.45.3")  # a dev build of the fixed release has the fix


def test_any_version_spec():
    assert version_in("0.0.1", "*") and version_in("99", "")


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError):
        release_tuple("not-a-version")
    with pytest.raises(ValueError):
        version_in("1.0", ">>1")


def test_satisfies_names_the_failing_requirement():
    versions = {"bitsandbytes": "0.50.2", "diffusers": "0.31.0", "torch": None}
    ok, why = satisfies(versions, {"diffusers": ">=0.31,<0.33", "bitsandbytes": "<0.45.3"})
    assert not ok and why == "bitsandbytes 0.50.2 is outside <0.45.3"
    ok, why = satisfies(versions, {"torch": ">=2"})
    assert not ok and why == "torch is not installed"
    ok, why = satisfies(versions, {"diffusers": ">=0.31,<0.33"})
    assert ok and "diffusers 0.31.0" in why
    # a malformed specifier (a Target's when=...) is blamed, not the installed version
    ok, why = satisfies(versions, {"diffusers": ">>0.31"})
    assert not ok and why == "'>>0.31' is not a version specifier (for diffusers)"
    ok, why = satisfies({"diffusers": "not-a-version"}, {"diffusers": ">=0.31"})
    assert not ok and why == "diffusers not-a-version is not a comparable version"


def test_installed_version_reads_metadata_without_importing():
    import sys

    assert installed_version("pytest") is not None
    assert installed_version("no-such-distribution-here") is None
    assert "wrapt" not in sys.modules or installed_version("wrapt")
