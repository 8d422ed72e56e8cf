"""What a shim is: plain records, no behaviour.

A :class:`Shim` names the compat-matrix rows it fixes, where its targets live (per consumer
version, because targets move between releases) and the wrapper that repairs a call. Whether a shim
is armed is decided by the matrix rows, never by the shim itself.

A wrapper has wrapt's signature ``wrapper(wrapped, instance, args, kwargs)``: ``wrapped`` is the
original callable (already bound for methods), ``instance`` the object a method was called on (or
None). The engine guards every call: when the wrapper's own repair logic raises, the error is
logged once and the original is called unchanged (or its result returned, if it already ran);
exceptions raised by the original itself always propagate untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Tuple, Union

Wrapper = Callable[[Callable[..., Any], Any, Tuple[Any, ...], dict], Any]
#: A wrapper, or a lazy ``"package.module:function"`` reference to one (imported only when its
#: target is wrapped, so declaring a shim costs nothing at start-up).
WrapperRef = Union[str, Wrapper]


@dataclass(frozen=True)
class Target:
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

    module: str
    qualname: str
    when: Mapping[str, str] = field(default_factory=dict)
    expect_params: Tuple[str, ...] = ()
    wrapper: WrapperRef | None = None

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Shim:
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
    """

    id: str
    fixes: Tuple[str, ...]
    targets: Tuple[Target, ...]
    wrapper: WrapperRef | None = None
    compile_reachable: bool = False
    summary: str = ""
    source: str = "builtin"

    def wrapper_for(self, target: Target) -> WrapperRef:
        ref = target.wrapper if target.wrapper is not None else self.wrapper
        if ref is None:
            raise ValueError(f"shim {self.id!r} gives no wrapper for {target.key}")
        return ref


def resolve_ref(ref: WrapperRef) -> Wrapper:
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
