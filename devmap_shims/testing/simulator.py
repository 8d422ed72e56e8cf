"""A simulated N-GPU CUDA machine on the CPU, for inference and training code and CI without GPUs.

::

    from devmap_shims.testing import simulated_gpus

    with simulated_gpus(4, memory="23GiB", name="NVIDIA A10G") as machine:
        model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
        out = model.generate(ids.to("cuda:0"), max_new_tokens=8)
        print(machine.max_allocated(3))

What is simulated
    * ``torch.cuda``: ``is_available``, ``device_count``, ``current_device``/``set_device``,
      ``torch.cuda.device(i)``, ``get_device_name``, ``get_device_properties`` (name, major/minor,
      ``total_memory``, ``multi_processor_count``), ``get_device_capability``, ``mem_get_info``,
      ``memory_allocated``/``max_memory_allocated``/``memory_reserved``/``memory_stats``,
      ``reset_peak_memory_stats``, ``synchronize``, ``empty_cache``, RNG seeding and state, and
      the same names under ``torch.accelerator`` where torch has it.
    * Tensors on ``cuda:N`` are ordinary CPU tensors whose storage is recorded as living on
      simulated GPU N: ``.device``, ``.is_cuda``, ``.get_device()`` and ``repr`` say ``cuda:N``;
      views, ``.data``, ``detach()``, ``nn.Parameter`` and other ``Tensor._make_subclass``
      subclasses (bitsandbytes ``Params4bit``) share the storage and so the device. Factories with
      ``device=``, ``to``/``cuda``/``cpu``, ``nn.Module.to``/``.cuda`` move tensors between
      simulated devices the way CUDA does (a move to another device copies; to the same device
      returns the tensor itself). ``torch.device(0)`` is ``cuda:0`` on every supported torch.
    * CUDA's device checks: an op whose operands sit on different devices raises CUDA's own
      ``RuntimeError`` ("Expected all tensors to be on the same device, ..."); 0-dim CPU tensors
      and Python scalars mix with CUDA tensors where CUDA allows it; CPU index tensors index CUDA
      tensors.
    * Memory: each GPU has a capacity; every storage on it is charged (rounded to the caching
      allocator's 512-byte blocks) until it is freed; an allocation past capacity raises
      ``torch.OutOfMemoryError`` with CUDA's message naming the GPU.
    * ``torch.Generator("cuda:N")`` and a default generator per GPU, which ``torch.cuda``'s seeding
      functions seed and every random op on that GPU draws from, dropout included;
      ``torch.cuda.Stream``/``Event`` (inert), ``pin_memory()``.
    * Libraries that cache which accelerator the machine has (diffusers) have that cache cleared
      when a simulation starts and when it ends (:mod:`._sim_probes`).
    * Autograd (:mod:`._sim_autograd`): forward passes record history, ``backward()`` and
      ``torch.autograd.grad`` run, and each gradient lives on its tensor's device (``p.grad`` of
      a parameter on ``cuda:N`` is on ``cuda:N`` and charged to it; a gradient that flows back
      through ``.to("cuda:1")`` reaches the source device). Optimizers take their CUDA defaults
      (foreach; fused when asked) and keep their state on the parameters' devices; ``zero_grad``,
      ``clip_grad_norm_``, ``GradScaler``, activation checkpointing (reentrant or not, through
      accelerate's hooks) and ``saved_tensors_hooks`` work. Torch's own errors for a gradient on
      the wrong device: ``p.grad = t`` ("attempting to assign a gradient located on device with
      index ..."), ``backward(gradient)`` ("invalid gradient at index 0 - expected device ..."),
      and an optimizer state on another GPU than its parameter ("Tensors of the same index must
      be on the same device ..." from the foreach grouping; CUDA's same-device error from the
      for-loop kernels).

What is not simulated
    * Inside a backward pass, the gradients torch's C++ engine makes are plain CPU tensors until
      they reach a leaf: Python backward code (hooks, ``Function.backward``) sees them report
      ``cpu``, they join tensors of any simulated device without a device error (a custom
      ``Function`` returning a gradient on the wrong GPU is not caught), and they are charged to
      a GPU only once stored as ``.grad``. :class:`SimulatedAutogradError` is no longer raised;
      the name stays for code that catches it.
    * Numerics of GPU kernels: ops run with CPU kernels, so results equal the CPU results, not
      CUDA's (``torch.autocast("cuda")`` changes no dtype; TF32, flash attention and
      fused kernels are not used). Streams and events have no semantics (all work is synchronous).
    * ``torch.compile``: inside a simulation it returns the function or module unchanged (runs
      eagerly), because Dynamo cannot trace simulated tensors.
    * The allocator's cache (reserved == allocated), memory fractions, CUDA graphs, IPC, NCCL,
      and anything that calls the CUDA driver itself (custom CUDA extensions, bitsandbytes < 0.46
      kernels). ``safetensors`` loading with ``device="cuda:N"`` does work (it goes through torch).
    * Threads: torch function modes are thread-local. Work submitted to a
      ``concurrent.futures.ThreadPoolExecutor`` during the simulation runs inside it (transformers
      loads checkpoints that way), and so do ``nn.DataParallel``'s replicas (its collectives are
      copies between the simulated GPUs, without NCCL: :mod:`._sim_threads`); other threads run
      unintercepted (their tensors are plain CPU tensors, and a move to ``cuda`` there reaches the
      real driver and fails).
    * ``torch.save`` writes simulated tensors as CPU tensors (``torch.load`` with a
      ``map_location`` naming a simulated GPU, or of a checkpoint saved on real CUDA, does load
      onto the simulated GPUs; a callable ``map_location`` is used as given).
    * Error messages: the device-mismatch messages follow torch's own by version (TensorIterator
      ops "found at least two devices, A and B!"; index_select/embedding, mm/bmm/addmm/linear/
      matmul, cat/stack, equal, bucketize with the "(when checking argument ...)" suffix, in the torch >= 2.8
      wording where torch changed it); other ops that CUDA checks argument by argument get the
      TensorIterator wording.

Tensors created inside a simulation remain valid CPU tensors after it ends and then report
``cpu``. Only one simulation can be active at a time.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Iterator, List, Sequence, Tuple, Union

import torch

from . import _sim_autograd, _sim_cuda, _sim_functions, _sim_generators, _sim_optim, _sim_state as S
from . import _sim_streams, _sim_threads
from ._sim_storages import storage_resize_
from ._sim_autograd import SimulatedAutogradError
from ._sim_devices import clear_parse_cache
from ._sim_load import load as _load, real_load as _real_load
from ._sim_machine import MemorySpec, SimulatedDeviceProperties, SimulatedMachine, format_size, parse_memory
from ._sim_mode import SimulationMode
from ._sim_probes import forget_cached_probes

__all__ = [
    "SimulatedAutogradError",
    "SimulatedDeviceProperties",
    "SimulatedMachine",
    "format_size",
    "is_simulated",
    "parse_memory",
    "real_cpu_tensor",
    "simulated_gpus",
]

_storage_id = torch._C._storage_id
_TensorBase = torch._C.TensorBase
_real_device_get = _TensorBase.device.__get__
_real_is_cuda_get = _TensorBase.is_cuda.__get__
_real_is_cpu_get = _TensorBase.is_cpu.__get__
_real_get_device = _TensorBase.get_device

CUDA_BUILD_HELP = (
    "devmap_shims.testing.simulated_gpus needs a CUDA build of torch, but torch {version} is the "
    "CPU-only build (torch.version.cuda is None). On the CPU-only build torch.device(0) cannot mean "
    "cuda:0, which accelerate and transformers rely on. Install the CUDA build (no GPU or driver is "
    "needed): `pip install torch --index-url https://download.pytorch.org/whl/cu121`, or on Linux the "
    "plain PyPI wheel (`pip install torch`), which is a CUDA build."
)

# Set by tests to exercise the torch.device stand-in on builds that do not need it.
FORCE_DEVICE_STANDIN = False


# ---------------------------------------------------------------------------------------------
# Tensor attributes reporting the simulated device
# ---------------------------------------------------------------------------------------------
def _sim_idx(t: torch.Tensor) -> Any:
    if S.DEPTH.n:
        return None
    try:
        return S.DEVICE_OF.get(_storage_id(t))
    except (RuntimeError, TypeError):
        return None


def _device(self: torch.Tensor) -> torch.device:
    idx = _sim_idx(self)
    if idx is not None:
        return S.CUDA_DEVICES[idx]
    return _real_device_get(self)


def _is_cuda(self: torch.Tensor) -> bool:
    return _sim_idx(self) is not None or _real_is_cuda_get(self)


def _is_cpu(self: torch.Tensor) -> bool:
    return _sim_idx(self) is None and _real_is_cpu_get(self)


def _get_device(self: torch.Tensor) -> int:
    idx = _sim_idx(self)
    if idx is not None:
        return idx
    return _real_get_device(self)


def _record_stream(self: torch.Tensor, stream: Any) -> None:
    # simulated streams are inert; torch's own parser would reject them before any mode sees them
    if isinstance(stream, _sim_streams.SimulatedStream):
        return None
    return _TensorBase.record_stream(self, stream)


_device.__doc__ = _TensorBase.device.__doc__
_get_device.__doc__ = _TensorBase.get_device.__doc__


# ---------------------------------------------------------------------------------------------
# patching with exact restoration
# ---------------------------------------------------------------------------------------------
class _Patcher:
    """Sets attributes and puts back exactly what was there (or removes what was not)."""

    def __init__(self) -> None:
        self._records: List[Tuple[Any, str, bool, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        d = owner.__dict__
        had = name in d
        self._records.append((owner, name, had, d.get(name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        errors = []
        while self._records:
            owner, name, had, old = self._records.pop()
            try:
                if had:
                    setattr(owner, name, old)
                else:
                    delattr(owner, name)
            except Exception as e:  # keep restoring the rest
                errors.append(f"{getattr(owner, '__name__', owner)}.{name}: {e!r}")
        if errors:
            raise RuntimeError("simulated_gpus could not restore: " + "; ".join(errors))

    @property
    def targets(self) -> List[Tuple[Any, str]]:
        return [(owner, name) for owner, name, _h, _o in self._records]


def _cuda_modules() -> List[Any]:
    mods = [torch.cuda]
    for sub in ("memory", "random", "streams"):
        m = getattr(torch.cuda, sub, None)
        if m is not None:
            mods.append(m)
    return mods


def _accelerator_modules() -> List[Any]:
    acc = getattr(torch, "accelerator", None)
    if acc is None:
        return []
    mods = [acc]
    mem = getattr(acc, "memory", None)
    if mem is not None and mem is not acc:
        mods.append(mem)
    return mods


def _compile_eagerly(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile`` during a simulation: Dynamo cannot trace simulated tensors (its fake
    tensors would open the real CUDA driver), so the function or module runs eagerly."""
    if model is None:
        return lambda fn: fn
    return model


def _outside_falls_back(stand_in: Any, original: Any) -> Any:
    """A stand-in function that calls the original once no simulation runs (a module that bound
    ``from torch.cuda import device_count`` during a simulation keeps working after it)."""
    if not isinstance(stand_in, types.FunctionType) or not callable(original):
        return stand_in

    @functools.wraps(stand_in)
    def call(*args: Any, **kwargs: Any) -> Any:
        if S.MACHINE is None:
            return original(*args, **kwargs)
        return stand_in(*args, **kwargs)

    return call


def _int_device_needs_standin() -> bool:
    if FORCE_DEVICE_STANDIN:
        return True
    try:
        return torch.device(0) != torch.device("cuda", 0)
    except RuntimeError:
        return True


def _install(patcher: _Patcher) -> None:
    # ThreadPoolExecutor workers (transformers >= 5 loads checkpoints so), nn.DataParallel
    _sim_threads.install(patcher)
    T = torch.Tensor
    patcher.set(T, "device", property(_device, doc=_TensorBase.device.__doc__))
    patcher.set(T, "is_cuda", property(_is_cuda, doc=_TensorBase.is_cuda.__doc__))
    patcher.set(T, "is_cpu", property(_is_cpu, doc=_TensorBase.is_cpu.__doc__))
    patcher.set(T, "get_device", _get_device)
    patcher.set(T, "record_stream", _record_stream)
    patcher.set(torch.UntypedStorage, "resize_", storage_resize_)  # not a torch function
    for namespace, modules in (
        (_sim_cuda.cuda_namespace(), _cuda_modules()),
        (_sim_cuda.accelerator_namespace(), _accelerator_modules()),
    ):
        for name, value in namespace.items():
            for mod in modules:
                if name in mod.__dict__:
                    patcher.set(mod, name, _outside_falls_back(value, mod.__dict__[name]))
    patcher.set(torch, "Generator", _sim_generators.GeneratorStandIn)
    patcher.set(torch.backends.cudnn, "is_acceptable", _sim_cuda.cudnn_is_acceptable)
    # transformers 4.4x compiles the forward for static/hybrid caches when the model is on CUDA
    patcher.set(torch, "compile", _compile_eagerly)
    for owner in (torch, torch.serialization):
        if owner.__dict__.get("load") is _real_load:
            patcher.set(owner, "load", _load)
    if _int_device_needs_standin():
        patcher.set(torch, "device", _sim_cuda.DeviceStandIn)
    # the backward pass runs in the C++ engine; optimizers group their tensors in C++
    _sim_autograd.install_engine(patcher)
    _sim_functions.install(patcher)  # custom Functions' backward: gradients on their outputs' GPUs
    _sim_optim.install_grouping(patcher)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def _require_cuda_build() -> None:
    if torch.version.cuda is None:
        raise RuntimeError(CUDA_BUILD_HELP.format(version=torch.__version__))


@contextlib.contextmanager
def simulated_gpus(
    n: int = 2,
    memory: Union[MemorySpec, Sequence[MemorySpec]] = "1GiB",
    name: str = "NVIDIA A10G",
) -> Iterator[SimulatedMachine]:
    """Simulate ``n`` CUDA GPUs of ``memory`` each (a size like ``"23GiB"``/``"10GB"``, an int
    byte count, or a list with one size per GPU) named ``name``; yields the
    :class:`SimulatedMachine`. Leaving the block restores torch exactly."""
    _require_cuda_build()
    if S.MACHINE is not None:
        raise RuntimeError(
            f"simulated_gpus() is already active ({S.MACHINE!r}); simulations cannot be nested. "
            "Leave the running simulation first (in pytest, do not combine the simulated_gpus fixture "
            "or marker with another simulated_gpus() block)."
        )
    machine = SimulatedMachine(n, memory, name)
    patcher = _Patcher()
    mode = SimulationMode()
    entered = False
    S.MACHINE = machine
    S.CUDA_DEVICES[:] = [torch.device("cuda", i) for i in range(machine.device_count)]
    try:
        _sim_cuda.start()
        _install(patcher)
        forget_cached_probes()
        machine._patched = patcher.targets  # type: ignore[attr-defined]
        mode.__enter__()
        entered = True
        S.DEPTH.in_mode = True
        yield machine
    finally:
        try:
            if entered:
                mode.__exit__(None, None, None)
        finally:
            S.MACHINE = None
            S.DEVICE_OF.clear()
            S.CUDA_DEVICES.clear()
            S.DEPTH.n = 0
            S.DEPTH.backward = 0
            S.DEPTH.op_outputs = None
            S.DEPTH.saved_hooks = 0
            S.DEPTH.in_mode = False
            clear_parse_cache()
            _sim_cuda.stop()
            machine._drop_all()
            patcher.restore()
            forget_cached_probes()


def active_machine() -> Any:
    """The running :class:`SimulatedMachine`, or None."""
    return S.MACHINE


def is_simulated(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives on a GPU of the running simulation."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"is_simulated expects a tensor, got {type(tensor).__name__}")
    return S.MACHINE is not None and S.sim_index(tensor) is not None


def real_cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The data behind a simulated tensor as a plain CPU tensor that reports ``cpu``.

    For a tensor on a simulated GPU this is a detached copy (the simulated device belongs to
    the storage, so a tensor sharing it would report the GPU too); any other tensor is
    returned detached, without a copy.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"real_cpu_tensor expects a tensor, got {type(tensor).__name__}")
    with torch.no_grad():
        if is_simulated(tensor):
            return tensor.cpu()
        return tensor.detach()
