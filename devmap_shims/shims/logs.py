"""The ``devmap_shims`` logger at the level ``DEVMAP_SHIMS_LOG`` asks for, printed on stderr until the
program configures logging itself, and by the program's handlers from then on."""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Optional


def configure(level: Optional[str]) -> None:
    """Give the ``devmap_shims`` logger ``level`` (``DEVMAP_SHIMS_LOG``), and a stderr handler
    unless the program configured logging itself: then its handlers print our records, once."""
    if not level:
        return
    import logging

    log = logging.getLogger("devmap_shims")
    log.setLevel(level.upper())
    if logging.getLogger().handlers:
        return
    if not any(getattr(h, "_devmap_shims", False) for h in log.handlers):
        handler = _stderr_until_configured()()
        handler._devmap_shims = True
        log.addHandler(handler)


def _stderr_until_configured() -> Any:
    """The handler class of :func:`configure` (made on first use: ``logging`` is imported
    only when ``DEVMAP_SHIMS_LOG`` is set)."""
    import logging
    import sys

    class StderrUntilConfigured(logging.Handler):
        """Prints our records on the current ``sys.stderr`` while the program has configured no
        logging; once the root logger has a handler (``basicConfig`` after start-up), the records
        go to the program's handlers alone, by propagation."""

        def __init__(self) -> None:
            super().__init__()
            self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

        def emit(self, record: Any) -> None:
            stream = sys.stderr
            if stream is None or logging.getLogger().handlers:
                return
            try:
                stream.write(self.format(record) + "\n")
                stream.flush()
            except Exception:
                self.handleError(record)

    return StderrUntilConfigured
