"""Every compat-matrix row with a shim is proven on the installed stack.

Inside the row's affected range: the scenario fails without the shims (so a wrong row, or a silent
upstream fix, is caught) and passes with them. Outside it: the scenario passes without the shims and
the shim stays off.
"""

from __future__ import annotations

import pytest

from devmap_shims.compat_matrix import load_matrix
from devmap_shims.scenarios import load_all, replay
from devmap_shims.versions import installed_versions

MATRIX = load_matrix()
ROWS_WITH_SHIMS = [row for row in MATRIX.rows if row.shim]
SCENARIOS = load_all()
CASES = [
    pytest.param(row, item, id=f"{row.id}/{item.func.__name__}", marks=pytest.mark.bug(row.id))
    for row in ROWS_WITH_SHIMS
    for item in SCENARIOS.get(row.id, [])
]


@pytest.mark.parametrize("row", ROWS_WITH_SHIMS, ids=lambda r: r.id)
def test_every_row_with_a_shim_has_a_scenario_or_says_why(row):
    assert SCENARIOS.get(row.id) or row.no_scenario, (
        f"matrix row {row.id!r} names shim {row.shim!r} but has no scenario in devmap_shims/scenarios "
        "and no `no_scenario` reason"
    )


@pytest.mark.parametrize("row, item", CASES)
def test_scenario_without_and_with_shims(row, item):
    affected = row.applies(installed_versions(MATRIX.distributions()))
    without = replay(item, shims=False)
    if without.unavailable:
        pytest.skip(without.detail)
    with_shims = replay(item, shims=True, shim_id=row.shim)
    if affected:
        assert not without.ok, f"{row.id} applies here but did not reproduce without shims: {without.detail}"
        assert with_shims.ok, f"{row.shim} did not fix {row.id}: {with_shims.detail}"
        assert with_shims.shim_active, with_shims.shim_states
    else:
        assert without.ok, f"{row.id} does not apply here yet the scenario failed: {without.detail}"
        assert with_shims.ok, with_shims.detail
        # the shim may rightly be armed for another row it fixes (dispatch-skip-keys on accelerate < 1.0)
        versions = installed_versions(MATRIX.distributions())
        if not any(other.applies(versions) for other in MATRIX.for_shim(row.shim)):
            assert not with_shims.shim_active, f"{row.shim} armed outside its range: {with_shims.shim_states}"
