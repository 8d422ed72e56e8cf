"""The engine: shim records, the registry, post-import hooks, wrapping, install/uninstall.

What a shim author needs is here: :class:`Shim` and :class:`Target` (the declaration),
:func:`with_context` and :class:`ShimContext` (state, strict mode and the report for wrappers),
:class:`ShimError`, :class:`LazyLogger`, :func:`library_call` (library code a repair runs for the
user: its errors are the user's), :func:`later_call` (shim code run after the hooked call returned,
under the same fail-open rule). The built-in shims live in ``devmap_shims/hooks/<library>/``,
one module each. Importing this package is cheap (``import devmap_shims`` does): the registry, and
with it ``threading``, is imported by ``install()`` or on first use of its names.
"""

from __future__ import annotations

from devmap_shims.shims.record import Shim, Target, with_context

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "LazyLogger", "Shim", "ShimContext", "ShimError", "Target", "later_call", "library_call", "with_context",
]


class LazyLogger:
    """A ``logging.Logger`` stand-in for the shims' modules: ``LazyLogger(__name__).info(...)``
    imports ``logging`` on first use, not when the module is imported."""

    __slots__ = ("_name", "_logger")

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger = None

    def __getattr__(self, attr: str) -> Any:
        if self._logger is None:
            import logging

            self._logger = logging.getLogger(self._name)
        return getattr(self._logger, attr)


def __getattr__(name: str) -> Any:
    if name in ("ShimContext", "ShimError"):
        from devmap_shims.shims import registry

        return getattr(registry, name)
    if name in ("library_call", "later_call"):
        from devmap_shims.shims import guard

        return getattr(guard, name)
    raise AttributeError(f"module 'devmap_shims.shims' has no attribute {name!r}")
