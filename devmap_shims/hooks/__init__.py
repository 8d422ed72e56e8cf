"""The built-in shims: ``hooks/<library>/<shim>.py``, one module per shim.

The folder is the library whose bug the shim works around; the module is named after the shim id
(``bitsandbytes/quant_state_follows_weight.py`` is ``quant-state-follows-weight``). Each module
declares ``SHIM`` (its targets, the matrix rows it fixes), its wrappers and the scenarios that
replay its rows; its docstring lists those rows' version ranges. The engine finds the modules by
listing these folders (:mod:`devmap_shims.shims.catalog`): there is no list to edit.

Importing a shim module must not import any target library (nor ``typing``, ``logging`` or
``inspect``, which would cost ``install()`` its start-up budget): wrappers and scenarios import
torch & co. inside their bodies. ``_``-prefixed modules hold helpers shared within a folder.
"""
