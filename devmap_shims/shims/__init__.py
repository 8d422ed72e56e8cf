"""The engine: shim records, the registry, import hooks, install/uninstall."""
from devmap_shims.shims.record import Shim, Target

__all__ = ["Shim", "Target"]
