"""What a shim is: plain records, no behaviour.

A :class:`Shim` names the compat-matrix rows it fixes, where its targets live (per consumer
version, because targets move between releases) and the wrapper that repairs a call. Whether a shim
is armed is decided by the matrix rows, never by the shim itself.

A wrapper has wrapt's signature ``wrapper(wrapped, instance, args, kwargs)``: ``wrapped`` is the
original callable (already bound for methods), ``instance`` the object a method was called on (or
None). A wrapper marked with :func:`with_context` takes the shim's :class:`ShimContext` first:
``wrapper(context, wrapped, instance, args, kwargs)``; it is how a wrapper keeps state between
calls, reads strict mode and reports, without reaching for process-wide globals. The engine
guards every call: when the wrapper's own repair logic raises, the error is logged once and the
original is called unchanged (or its result returned, if it already ran); exceptions raised by
the original itself always propagate untouched.
"""

from __future__ import annotations

# ``typing`` costs ~20 ms to import and this package may be imported at every interpreter start
# (DEVMAP_SHIMS=1): annotations are strings (``from __future__ import annotations``) and typing is
# imported only when a type checker runs, which treats ``TYPE_CHECKING`` as true. Every module of
# the package that runs at start-up uses this idiom.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Iterable, Mapping, Optional, Tuple, Union

    Wrapper = Callable[[Callable[..., Any], Any, Tuple[Any, ...], dict], Any]
    #: A wrapper, or a lazy ``"package.module:function"`` reference to one (imported only when its
    #: target is wrapped, so declaring a shim costs nothing at start-up).
    WrapperRef = Union[str, Wrapper]


class _Record:
    """Immutable value object (dataclasses would cost start-up time: they import inspect)."""

    __slots__: Tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _set(self, **values: Any) -> None:
        for name in self.__slots__:
            object.__setattr__(self, name, values[name])

    def _values(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, n) for n in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.key if hasattr(self, "key") else None))

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({fields})"


class Target(_Record):
    """One callable to wrap.

    module:
        The *defining* module, e.g. ``"accelerate.utils.modeling"``; never a lazy top-level package
        such as ``transformers``.
    qualname:
        ``"infer_auto_device_map"`` or ``"QuantState.to"`` (attribute path inside ``module``).
    when:
        Extra version requirements on consumers, ``{"transformers": ">=5"}``: the target is only
        wrapped where they hold (transformers 5 computes device maps with its own copy of
        accelerate's functions, so the shim must follow it there).
    expect_params:
        Parameter names the wrapper relies on. If the installed target's signature lacks one, the
        target is skipped with the reason "signature drift" instead of being wrapped blindly.
    wrapper:
        Overrides the shim's wrapper for this target.
    """

    __slots__ = ("module", "qualname", "when", "expect_params", "wrapper")
    module: str
    qualname: str
    when: Mapping[str, str]
    expect_params: Tuple[str, ...]
    wrapper: WrapperRef | None

    def __init__(
        self,
        module: str,
        qualname: str,
        *,
        when: Mapping[str, str] | None = None,
        expect_params: Tuple[str, ...] = (),
        wrapper: WrapperRef | None = None,
    ) -> None:
        for field, value in (("module", module), ("qualname", qualname)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"Target {field} must be a non-empty string, not {value!r:.60}")
        if isinstance(expect_params, str):  # one name, not its letters
            expect_params = (expect_params,)
        when = dict(when or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in when.items()):
            raise TypeError(f"Target when must map distribution names to specifiers, not {when!r:.80}")
        self._set(
            module=module,
            qualname=qualname,
            when=when,
            expect_params=tuple(expect_params),
            wrapper=wrapper,
        )

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


class Shim(_Record):
    """A workaround for one or more compat-matrix rows.

    id:
        Stable identifier used by ``install(only=..., exclude=..., force=...)`` and the
        ``DEVMAP_SHIMS_*`` variables. Plugin shims are prefixed with their distribution name.
    fixes:
        Ids of the matrix rows this shim works around. The shim is armed when at least one of
        them applies to the installed versions (or when forced).
    targets:
        Where to hook.
    wrapper:
        Default wrapper for every target (see module docstring).
    compile_reachable:
        True when a target can run inside ``torch.compile``d code (``Params4bit.to`` for example):
        such targets get a plain ``functools.wraps`` function instead of a wrapt proxy, because
        Dynamo skips or crashes on wrapt proxies.
    summary:
        One line for ``doctor`` and ``matrix``.
    state:
        A factory (a class, ``dict`` ...) for the state the shim's wrappers share between calls,
        reached through :class:`ShimContext.state`. The engine makes a fresh one at every
        ``install()`` and drops it at ``uninstall()``.
    more_targets:
        A function (or lazy ``"module:function"`` reference) returning more targets (:class:`Target`),
        called once, when the shim's first target is armed: for targets that depend on the
        installed library's files (the model classes that override ``generate``), found only where
        the bug applies and only once the library is being imported.
    repairs:
        False for a shim that only detects the configuration of its rows and warns (strict mode:
        raises), and does not repair them: ``doctor`` then counts its rows as warned about, not
        fixed.
    """

    __slots__ = (
        "id", "fixes", "targets", "wrapper", "compile_reachable", "summary", "source", "state", "more_targets",
        "repairs",
    )
    id: str
    fixes: Tuple[str, ...]
    targets: Tuple[Target, ...]
    wrapper: WrapperRef | None
    compile_reachable: bool
    summary: str
    source: str
    state: Optional[Callable[[], Any]]
    more_targets: Union[str, Callable[[], Iterable[Target]], None]
    repairs: bool

    def __init__(
        self,
        id: str,
        fixes: Tuple[str, ...],
        targets: Tuple[Target, ...],
        wrapper: WrapperRef | None = None,
        *,
        compile_reachable: bool = False,
        summary: str = "",
        source: str = "builtin",
        state: Optional[Callable[[], Any]] = None,
        more_targets: Union[str, Callable[[], Iterable[Target]], None] = None,
        repairs: bool = True,
    ) -> None:
        if isinstance(fixes, str):
            fixes = (fixes,)
        if not isinstance(id, str) or not id:
            raise TypeError(f"Shim id must be a non-empty string, not {id!r:.60}")
        if id == "*" or "," in id or any(c.isspace() for c in id):
            raise ValueError(f"Shim id {id!r:.60} cannot be named in DEVMAP_SHIMS_DISABLE or _FORCE (a list "
                             "separated by commas, '*' for all): leave out spaces and commas")
        targets = tuple(targets)
        wrong = [t for t in targets if not isinstance(t, Target)]
        if wrong:  # caught here, not at every later install()
            raise TypeError(f"shim {id!r}: targets must be devmap_shims.Target objects, not {wrong[0]!r:.80}")
        self._set(
            id=id,
            fixes=tuple(fixes),
            targets=targets,
            wrapper=wrapper,
            compile_reachable=bool(compile_reachable),
            summary=summary,
            source=source,
            state=state,
            more_targets=more_targets,
            repairs=bool(repairs),
        )

    @property
    def key(self) -> str:
        return self.id

    def replace(self, **changes: Any) -> Shim:
        """A copy with some fields changed (used to prefix plugin ids)."""
        values = {n: getattr(self, n) for n in self.__slots__}
        values.update(changes)
        return Shim(
            values.pop("id"), values.pop("fixes"), values.pop("targets"), values.pop("wrapper"), **values
        )

    def wrapper_for(self, target: Target) -> WrapperRef:
        ref = target.wrapper if target.wrapper is not None else self.wrapper
        if ref is None:
            raise ValueError(f"shim {self.id!r} gives no wrapper for {target.key}: pass Shim(wrapper=...) or "
                             "Target(wrapper=...)")
        return ref


def with_context(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``wrapper`` as taking the shim's :class:`ShimContext` before wrapt's four arguments::

        @with_context
        def repair(context, wrapped, instance, args, kwargs):
            context.state.calls += 1
            ...
    """
    wrapper.__devmap_context__ = True  # type: ignore[attr-defined]
    return wrapper


def takes_context(wrapper: Any) -> bool:
    return bool(getattr(wrapper, "__devmap_context__", False))


def resolve_ref(ref: Any) -> Any:
    """Import a lazy ``"module:function"`` reference (or return a callable as is)."""
    if callable(ref):
        return ref
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"wrapper reference {ref!r} must look like 'package.module:function'")
    import importlib

    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
