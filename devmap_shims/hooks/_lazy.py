"""Helpers that keep hook modules cheap to import.

``install()`` imports every hook module to read its ``SHIMS`` declarations, in every process that
enables the shims, so a hook module may import neither target libraries nor slow standard modules
(``logging``, ``inspect``, ``typing``) at module level. Use :class:`LazyLogger` for logging.
"""

from __future__ import annotations


class LazyLogger:
    """A ``logging.Logger`` stand-in that imports ``logging`` on first use."""

    __slots__ = ("_name", "_logger")

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger = None

    def __getattr__(self, attr: str):
        if self._logger is None:
            import logging

            self._logger = logging.getLogger(self._name)
        return getattr(self._logger, attr)
