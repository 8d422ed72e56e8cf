"""Placement arithmetic behind the device-map shim and ``devmap-shims plan``.

Pure Python: nothing here imports torch or the Hugging Face libraries. A model enters as a
:class:`~devmap_shims.planning.layout.Layout` (units in module order with their byte sizes, as the
installed stack computes them), budgets as accelerate-style ``max_memory`` dicts with integer
GPU ids.
"""

from __future__ import annotations

from devmap_shims.planning.assess import TOLERANCE, Assessment, assess, lower_bound, plainly_healthy
from devmap_shims.planning.layout import Layout, Unit, build_layout
from devmap_shims.planning.module_walk import layout_from_module
from devmap_shims.planning.repair import RepairOutcome, plan_units, repair
from devmap_shims.planning.sizes import TopologyError, format_bytes, parse_gpus, parse_size

__all__ = [
    "TOLERANCE",
    "Assessment",
    "Layout",
    "RepairOutcome",
    "TopologyError",
    "Unit",
    "assess",
    "build_layout",
    "format_bytes",
    "layout_from_module",
    "lower_bound",
    "parse_gpus",
    "parse_size",
    "plainly_healthy",
    "plan_units",
    "repair",
]
