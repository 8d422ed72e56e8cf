"""Settings from ``DEVMAP_SHIMS_*`` environment variables.

=========================  ==========================================================================
``DEVMAP_SHIMS``           ``1`` installs the shims at interpreter start (through the ``.pth`` file);
                           ``0`` is a kill switch that beats everything, ``install()`` calls included.
``DEVMAP_SHIMS_DISABLE``   comma-separated shim ids to leave off, or ``*`` for all.
``DEVMAP_SHIMS_FORCE``     comma-separated shim ids to arm even outside their matrix row's range.
``DEVMAP_SHIMS_STRICT``    ``1``: a shim that fails raises instead of logging and falling back.
``DEVMAP_SHIMS_LOG``       ``debug``, ``info``, ``warning`` or ``error`` (any case): level of the
                           ``devmap_shims`` logger.
``DEVMAP_SHIMS_NO_PLUGINS`` ``1``: ignore shims and matrix rows from other distributions.
``DEVMAP_SHIMS_PLUGINS``   comma-separated distributions whose plugins load at interpreter start-up
                           (``DEVMAP_SHIMS=1``), or ``*``; unset, none does (``install()`` called
                           from code loads every plugin).
=========================  ==========================================================================

A bad value never stops the program (a ``.pth`` file that raised would break every Python process
on the machine): it gives one warning that names the variable, the value and the valid choices,
and the setting keeps its default. Unknown shim ids are checked later, once the shim list is known.
"""

from __future__ import annotations

import os
TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")

ENV_ENABLE = "DEVMAP_SHIMS"
ENV_DISABLE = "DEVMAP_SHIMS_DISABLE"
ENV_FORCE = "DEVMAP_SHIMS_FORCE"
ENV_STRICT = "DEVMAP_SHIMS_STRICT"
ENV_LOG = "DEVMAP_SHIMS_LOG"
ENV_NO_PLUGINS = "DEVMAP_SHIMS_NO_PLUGINS"
ENV_PLUGINS = "DEVMAP_SHIMS_PLUGINS"
ALL_VARIABLES = (ENV_ENABLE, ENV_DISABLE, ENV_FORCE, ENV_STRICT, ENV_LOG, ENV_NO_PLUGINS, ENV_PLUGINS)


class Settings:
    """What the environment asks for. ``problems`` lists one message per bad value."""

    __slots__ = (
        "enable", "disable", "disable_all", "force", "strict", "log_level", "no_plugins", "plugins", "problems",
    )

    def __init__(self) -> None:
        self.enable: Optional[bool] = None  # None: variable unset
        self.disable: Tuple[str, ...] = ()
        self.disable_all = False
        self.force: Tuple[str, ...] = ()
        self.strict = False
        self.log_level: Optional[str] = None
        self.no_plugins = False
        self.plugins: Tuple[str, ...] = ()  # named for start-up
        self.problems: List[str] = []

    @property
    def killed(self) -> bool:
        return self.enable is False

    def switched_off(self, shim_id: str) -> str:
        """The variable that keeps ``shim_id`` off whatever the versions ('' when none does): the
        kill switch, or DEVMAP_SHIMS_DISABLE (which DEVMAP_SHIMS_FORCE does not override)."""
        if self.killed:
            return f"{ENV_ENABLE}=0"
        if self.disable_all:
            return f"{ENV_DISABLE}=*"
        return f"{ENV_DISABLE}={shim_id}" if shim_id in self.disable else ""

    def as_dict(self) -> Dict[str, object]:
        return {
            "enable": self.enable,
            "disable": ["*"] if self.disable_all else list(self.disable),
            "force": list(self.force),
            "strict": self.strict,
            "log_level": self.log_level,
            "no_plugins": self.no_plugins,
            "plugins": list(self.plugins),
        }


def flag(raw: Optional[str]) -> Optional[bool]:
    """True or False for a switch value (``1``/``true``/``yes``/``on``, any case, and their
    opposites), None when ``raw`` is unset, empty or not understood."""
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    return None


def _flag(env: Mapping[str, str], name: str, settings: Settings) -> Optional[bool]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = flag(raw)
    if value is not None:
        return value
    settings.problems.append(not_understood(name, raw))
    return None


#: Problems with the environment that start-up has logged already (a program's ``install()``
#: later keeps them in its report without logging them a second time).
LOGGED_AT_START_UP: Set[str] = set()


def not_understood(name: str, raw: str) -> str:
    """What is said of a switch whose value :func:`flag` does not understand."""
    return f"{name}={_shown(raw)} is not understood; use 1 or 0 (also true/false, yes/no, on/off). Ignoring it."


def _shown(value: str, width: int = 60) -> str:
    """``repr(value)``, cut at ``width`` characters: a 10 kB variable is not echoed in full."""
    return repr(value) if len(value) <= width else f"{value[:width]!r}... ({len(value)} characters)"


def _ids(env: Mapping[str, str], name: str) -> Tuple[str, ...]:
    return split_ids(env.get(name, ""))


def split_ids(raw: str) -> Tuple[str, ...]:
    """The ids of a list separated by commas, as the variables and ``install()`` take them."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def install_ids(name: str, ids: Any) -> Optional[Tuple[str, ...]]:
    """``install(name=ids)`` as a tuple of shim ids: an iterable of strings, or one string of ids
    separated by commas, as ``DEVMAP_SHIMS_DISABLE`` takes them."""
    if ids is None:
        return None
    if isinstance(ids, str):  # one with no id at all stays, to be named as an unknown id
        return split_ids(ids) or (ids,)
    wrong = ""
    try:
        ids = tuple(ids)
    except TypeError:
        wrong = type(ids).__name__
    else:
        odd = [i for i in ids if not isinstance(i, str)]
        wrong = f"a list holding {type(odd[0]).__name__} {odd[0]!r:.40}" if odd else ""
    if wrong:
        raise TypeError(f"install({name}=...) takes shim ids, as a list of strings or one string like "
                        f"'a,b', not {wrong}")
    return ids


def install_switch(name: str, value: Any) -> Optional[bool]:
    """``install(name=value)`` for a switch: None, a bool, 0 or 1, or the words the environment
    variables take (``"false"``, ``"on"``...); anything else is refused rather than read as true."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and flag(value) is not None:
        return flag(value)
    words = ", ".join(TRUE + FALSE)
    raise TypeError(f"install({name}={value!r:.40}) takes True or False (or one of {words})")


def read_settings(env: Optional[Mapping[str, str]] = None) -> Settings:
    """Parse the ``DEVMAP_SHIMS_*`` variables of ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    settings = Settings()
    settings.enable = _flag(env, ENV_ENABLE, settings)
    disable = _ids(env, ENV_DISABLE)
    settings.disable_all = "*" in disable
    settings.disable = tuple(i for i in disable if i != "*")
    settings.force = _ids(env, ENV_FORCE)
    settings.strict = bool(_flag(env, ENV_STRICT, settings))
    settings.no_plugins = bool(_flag(env, ENV_NO_PLUGINS, settings))
    settings.plugins = _ids(env, ENV_PLUGINS)
    level = env.get(ENV_LOG, "").strip().lower()
    if level:
        if level in LOG_LEVELS:
            settings.log_level = level
        else:
            settings.problems.append(
                f"{ENV_LOG}={_shown(env.get(ENV_LOG, ''))} is not a log level; use one of {', '.join(LOG_LEVELS)}. "
                "Ignoring it."
            )
    return settings


#: Unknown names quoted in one message; the rest are counted (a variable of 10,000 ids is one line).
SHOWN_NAMES = 5


def listed(names: List[str], shown: int = SHOWN_NAMES) -> str:
    """``'a', 'b' and 'c'``, or the first ``shown`` of ``names`` and how many more, each cut short
    as :func:`_shown` does."""
    quoted = [_shown(n) for n in names[:shown]]
    if len(names) > shown:
        return f"{', '.join(quoted)} and {len(names) - shown} more"
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


class UnknownShimId(ValueError):
    """Strict mode's refusal of a switch or an ``install()`` argument that names no shim: the
    user's configuration, which the CLI reports as a usage error (exit 2)."""


def unknown_ids(place: str, unknown: List[str], known: List[str]) -> str:
    """The message for ``unknown`` (ids of no shim) named by ``place`` (a variable, an install()
    argument): one id gets the closest known id, several the list of known ones."""
    import difflib

    everything = f"known shims: {', '.join(sorted(known))}"
    if len(unknown) == 1:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        return f"{place} names unknown shim {_shown(unknown[0])}; " + (
            f"did you mean {close[0]!r}?" if close else everything
        )
    return f"{place} names {len(unknown)} unknown shims, {listed(unknown)}; {everything}"


def unknown_id_problems(settings: Settings, known: List[str], ignored: bool = True) -> List[str]:
    """A message for each of DISABLE/FORCE that names ids of no shim: one per variable, however
    many ids it names; ``ignored`` (a warning, not strict mode's error) says they are ignored."""
    problems = []
    for name, ids in ((ENV_DISABLE, settings.disable), (ENV_FORCE, settings.force)):
        unknown = list(dict.fromkeys(i for i in ids if i not in known))
        if unknown:
            problem = unknown_ids(name, unknown, known)
            if ignored:
                stop = "" if problem.endswith("?") else "."
                problem += f"{stop} Ignoring {'it' if len(unknown) == 1 else 'them'}."
            problems.append(problem)
    return problems
