"""One module per hooked area. Each declares ``SHIMS``, a tuple of :class:`devmap_shims.shims.Shim`.

Importing a hook module must not import any target library: wrappers are named by lazy
``"module:function"`` references or import torch & co. inside their bodies.
"""
