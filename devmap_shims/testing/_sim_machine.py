"""The simulated machine: device table, capacities and per-device memory accounting.

Memory is accounted per storage, the way the CUDA caching allocator accounts blocks: each
storage that lives on a simulated GPU is charged once (views share it), rounded up to the
allocator's 512-byte block size, and released when the storage dies (a weak reference to the
storage's Python object fires exactly then, because torch keeps that object alive for as long
as the storage itself lives).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Union

import torch

from devmap_shims.planning.sizes import TopologyError, parse_size

from . import _sim_state

MemorySpec = Union[int, str]

_BLOCK = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize


# name -> (major, minor, multi_processor_count)
_KNOWN_GPUS = {
    "NVIDIA A10G": (8, 6, 80),
    "NVIDIA A10": (8, 6, 72),
    "NVIDIA A100-SXM4-80GB": (8, 0, 108),
    "NVIDIA A100-SXM4-40GB": (8, 0, 108),
    "NVIDIA A100 80GB PCIe": (8, 0, 108),
    "NVIDIA H100 80GB HBM3": (9, 0, 132),
    "NVIDIA H100": (9, 0, 132),
    "NVIDIA H200": (9, 0, 132),
    "NVIDIA L4": (8, 9, 58),
    "NVIDIA L40S": (8, 9, 142),
    "Tesla T4": (7, 5, 40),
    "Tesla V100-SXM2-16GB": (7, 0, 80),
    "NVIDIA GeForce RTX 4090": (8, 9, 128),
    "NVIDIA GeForce RTX 3090": (8, 6, 82),
    "NVIDIA RTX A6000": (8, 6, 84),
}


def parse_memory(spec: MemorySpec) -> int:
    """Bytes for "23GiB", "512MiB", "10GB", "1.5 GiB" or an int byte count."""
    if isinstance(spec, bool):
        raise TypeError(f"memory must be a size such as '23GiB' or an int byte count, not {spec!r}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"memory must be positive, got {spec}")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"memory must be a size such as '23GiB' or an int byte count, not {spec!r}")
    try:
        value = parse_size(spec)  # the same units as `devmap-shims plan --gpus`
    except TopologyError:
        raise ValueError(
            f"cannot read memory size {spec!r}: use a number with a unit such as '23GiB', '512MiB', '10GB'"
        ) from None
    if value <= 0:
        raise ValueError(f"memory must be positive, got {spec!r}")
    return value


def format_size(size: int) -> str:
    """The CUDA caching allocator's size printer (c10/cuda/CUDACachingAllocator.cpp format_size)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


def round_block(nbytes: int) -> int:
    """Size the caching allocator charges for a request of ``nbytes`` (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // _BLOCK) * _BLOCK


class _CurrentDevice(threading.local):
    index = 0


@dataclass(frozen=True)
class SimulatedDeviceProperties:
    """Stand-in for ``torch.cuda.get_device_properties(i)`` (``_CudaDeviceProperties``)."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    L2_cache_size: int = 6 * 2**20
    max_threads_per_multi_processor: int = 1536
    regs_per_multiprocessor: int = 65536
    warp_size: int = 32
    uuid: str = ""
    pci_bus_id: int = 0
    pci_device_id: int = 0
    pci_domain_id: int = 0
    gcnArchName: str = "NVIDIA CUDA"

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // (1024 * 1024)}MB, "
            f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
            f"pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
            f"pci_domain_id={self.pci_domain_id}, L2_cache_size={self.L2_cache_size // (1024 * 1024)}MB)"
        )


class SimulatedMachine:
    """An N-GPU CUDA machine simulated on the CPU (see :func:`devmap_shims.testing.simulated_gpus`).

    Memory figures are in bytes and follow the CUDA caching allocator's accounting (storages,
    rounded to 512-byte blocks); ``reserved`` equals ``allocated`` (no cache is simulated).
    """

    def __init__(self, n: int, memory: Union[MemorySpec, Sequence[MemorySpec]], name: str) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"simulated_gpus needs n >= 1 GPUs, got {n!r}")
        if not isinstance(name, str) or not name.strip():
            raise TypeError(
                f"simulated_gpus(name=...) is the GPUs' name, a non-empty string, not {name!r:.60}")
        if isinstance(memory, (list, tuple)):
            if len(memory) != n:
                raise ValueError(f"memory lists {len(memory)} sizes for {n} simulated GPUs")
            caps = [parse_memory(m) for m in memory]
        else:
            caps = [parse_memory(memory)] * n
        self.name = name
        self._caps: List[int] = caps
        self._allocated: List[int] = [0] * n
        self._peak: List[int] = [0] * n
        self._num_ooms: List[int] = [0] * n
        self._num_allocs: List[int] = [0] * n
        self._current = _CurrentDevice()  # per thread, as cudaSetDevice: a new thread starts on 0
        major, minor, sms = _KNOWN_GPUS.get(name, (8, 0, 108))
        self._props = [
            SimulatedDeviceProperties(
                name=name,
                major=major,
                minor=minor,
                total_memory=cap,
                multi_processor_count=sms,
                uuid=f"GPU-5e1a0000-0000-0000-0000-{i:012d}",
                pci_bus_id=i,
            )
            for i, cap in enumerate(caps)
        ]
        # storage key -> weak reference to the storage object, carrying its device and charged bytes
        self._storages: Dict[int, _StorageRef] = {}
        self.oom_message: Callable[[int, int], str] = self._default_oom_message

    # ------------------------------------------------------------------ public queries
    @property
    def device_count(self) -> int:
        return len(self._caps)

    @property
    def current_device(self) -> int:
        return self._current.index

    def capacity(self, i: int) -> int:
        return self._caps[self._check(i)]

    def allocated(self, i: int) -> int:
        return self._allocated[self._check(i)]

    def max_allocated(self, i: int) -> int:
        return self._peak[self._check(i)]

    def free(self, i: int) -> int:
        i = self._check(i)
        return self._caps[i] - self._allocated[i]

    def reset_peak(self, i: int) -> None:
        i = self._check(i)
        self._peak[i] = self._allocated[i]

    def properties(self, i: int) -> SimulatedDeviceProperties:
        return self._props[self._check(i)]

    def num_ooms(self, i: int) -> int:
        return self._num_ooms[self._check(i)]

    def num_allocations(self, i: int) -> int:
        return self._num_allocs[self._check(i)]

    def __repr__(self) -> str:
        caps = ", ".join(format_size(c) for c in self._caps)
        return f"SimulatedMachine({self.device_count} x {self.name!r}; capacity {caps})"

    # ------------------------------------------------------------------ internals
    def _check(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self._caps):
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (simulated machine has {len(self._caps)} GPUs, "
                f"asked for device {i!r})"
            )
        return i

    def _set_current(self, i: int) -> None:
        self._current.index = self._check(i)

    def _default_oom_message(self, device: int, request: int) -> str:
        cap = self._caps[device]
        alloc = self._allocated[device]
        return (
            f"CUDA out of memory. Tried to allocate {format_size(request)}. GPU {device} has a total "
            f"capacity of {format_size(cap)} of which {format_size(cap - alloc)} is free. "
            f"Including non-PyTorch memory, this process has {format_size(alloc)} memory in use. "
            f"Of the allocated memory {format_size(alloc)} is allocated by PyTorch, and 0 bytes is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
            f"for Memory Management  ({_alloc_conf_doc_url()})"
        )

    def _precheck(self, device: int, nbytes: int) -> None:
        """Raise the OOM an allocation of ``nbytes`` on ``device`` would raise, before making it (a
        new storage, or the new block of one resized)."""
        nbytes = round_block(nbytes)
        if nbytes and self._allocated[device] + nbytes > self._caps[device]:
            self._num_ooms[device] += 1
            raise _oom_error_type()(self.oom_message(device, nbytes))

    def _charge(self, storage: torch.UntypedStorage, key: int, device: int) -> None:
        """Charge a new storage to ``device``; raises torch's OutOfMemoryError past capacity."""
        nbytes = round_block(storage.nbytes())
        self._precheck(device, nbytes)
        self._allocated[device] += nbytes
        if self._allocated[device] > self._peak[device]:
            self._peak[device] = self._allocated[device]
        self._num_allocs[device] += 1
        ref = _StorageRef(storage, self._on_storage_freed)
        ref.key, ref.device, ref.nbytes = key, device, nbytes
        self._storages[key] = ref

    def _precheck_resize(self, key: int, nbytes: int) -> None:
        """Raise the OOM that resizing the tracked storage ``key`` to ``nbytes`` raises on CUDA before
        anything changes: ``resize_bytes_cuda`` takes a block of the whole new size while the old one
        is still held, copies, then frees the old one."""
        ref = self._storages.get(key)
        new = round_block(nbytes)
        if ref is not None and new != ref.nbytes:
            self._precheck(ref.device, new)

    def _recharge(self, storage: torch.UntypedStorage, key: int) -> None:
        """Follow a tracked storage resized in place (``Tensor.resize_``, an ``out=`` that grew,
        ``UntypedStorage.resize_``, as FSDP frees and refills its flat parameters): its new size from
        now on, old and new blocks both at the peak. Past capacity it raises the OOM, though the
        storage has grown already (CUDA leaves it as it was)."""
        ref = self._storages.get(key)
        if ref is None:
            return
        device, old = ref.device, ref.nbytes
        new = round_block(storage.nbytes())
        if new == old:
            return
        if new > old:
            self._precheck(device, new)
        self._peak[device] = max(self._peak[device], self._allocated[device] + new)
        self._allocated[device] += new - old
        ref.nbytes = new
        if new:
            self._num_allocs[device] += 1

    def _on_storage_freed(self, ref: "_StorageRef") -> None:
        if self._storages.get(ref.key) is ref:
            del self._storages[ref.key]
            self._allocated[ref.device] -= ref.nbytes
            _sim_state.DEVICE_OF.pop(ref.key, None)

    def _drop_all(self) -> None:
        self._storages.clear()


class _StorageRef(weakref.ref):
    """Weak reference to a storage on a simulated GPU; its callback releases the bytes."""

    __slots__ = ("key", "device", "nbytes")


def _oom_error_type() -> type:
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _alloc_conf_doc_url() -> str:
    # the link at the end of CUDA's OOM message moved to docs.pytorch.org in torch 2.11
    if _sim_state.TORCH_VERSION >= (2, 11):
        return "https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf"
    return "https://pytorch.org/docs/stable/notes/cuda.html#environment-variables"

