"""Which bitsandbytes parameters a model holds, and which of them the installed release can move."""

from __future__ import annotations

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Set


def bnb_kinds(model: Any) -> Set[str]:
    """The bitsandbytes parameter classes in ``model`` (``Params4bit``, ``Int8Params``). Read from the
    parameters: transformers sets ``is_loaded_in_4bit`` only after ``dispatch_model`` returns."""
    try:
        return {type(p).__name__ for p in model.parameters()} & {"Params4bit", "Int8Params"}
    except Exception:  # not a torch module
        return set()


def _bnb_at_least(spec: str) -> bool:
    from devmap_shims.versions import installed_version, version_in

    version = installed_version("bitsandbytes")
    return version is not None and version_in(version, spec)


def bnb_moves_4bit() -> bool:
    """True when the installed bitsandbytes moves 4-bit weights whole (0.43.2 and later)."""
    return _bnb_at_least(">=0.43.2")


def bnb_moves_8bit() -> bool:
    """True when the installed bitsandbytes moves 8-bit weights (0.48.0 and later)."""
    return _bnb_at_least(">=0.48.0")


def bnb_movable(model: Any) -> bool:
    """Whether every kind of bitsandbytes parameter in ``model`` can be moved by this release (True
    for a model without any)."""
    kinds = bnb_kinds(model)
    return ("Params4bit" not in kinds or bnb_moves_4bit()) and ("Int8Params" not in kinds or bnb_moves_8bit())
