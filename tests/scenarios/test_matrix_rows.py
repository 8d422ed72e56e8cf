"""Every compat-matrix row with a shim is proven on the installed stack.

Inside the row's affected range: the scenario fails without the shims (so a wrong row, or a silent
upstream fix, is caught) and passes with them. Outside it: the scenario passes without the shims and
the shim stays off.
"""

from __future__ import annotations

import pytest

from devmap_shims.compat_matrix import load_matrix
from devmap_shims.scenarios import all_scenarios
from devmap_shims.scenarios.replay import replay
from devmap_shims.shims import catalog
from devmap_shims.versions import installed_versions

MATRIX = load_matrix()
SHIMS = {shim.id: shim for shim in catalog.builtin_shims()[0]}
SHIM_OF = catalog.shim_of_rows(SHIMS.values())
ROWS_WITH_SHIMS = [row for row in MATRIX.rows if row.id in SHIM_OF]
SCENARIOS = all_scenarios()
CASES = [
    pytest.param(row, item, id=f"{row.id}/{item.name}", marks=pytest.mark.bug(row.id))
    for row in ROWS_WITH_SHIMS
    for item in SCENARIOS.get(row.id, [])
]


@pytest.mark.parametrize("row", ROWS_WITH_SHIMS, ids=lambda r: r.id)
def test_every_row_with_a_shim_has_a_scenario_or_says_why(row):
    assert SCENARIOS.get(row.id) or row.no_scenario, (
        f"matrix row {row.id!r} is fixed by shim {SHIM_OF[row.id]!r} but has no scenario in that shim's "
        "module and no `no_scenario` reason"
    )


@pytest.mark.parametrize("row, item", CASES)
def test_scenario_without_and_with_shims(row, item):
    shim_id = SHIM_OF[row.id]
    versions = installed_versions(MATRIX.distributions())
    affected = row.applies(versions)
    without = replay(item, shims=False)
    if without.unavailable:
        pytest.skip(without.detail)
    with_shims = replay(item, shims=True, shim_id=shim_id)
    if affected:
        assert not without.ok, f"{row.id} applies here but did not reproduce without shims: {without.detail}"
        assert with_shims.ok, f"{shim_id} did not fix {row.id}: {with_shims.detail}"
        assert with_shims.shim_active, with_shims.shim_states
    else:
        assert without.ok, f"{row.id} does not apply here yet the scenario failed: {without.detail}"
        assert with_shims.ok, with_shims.detail
        # the shim may rightly be armed for another row it fixes (dispatch-skip-keys on accelerate < 1.0)
        if not any(MATRIX.get(other).applies(versions) for other in SHIMS[shim_id].fixes):
            assert not with_shims.shim_active, f"{shim_id} armed outside its range: {with_shims.shim_states}"
