"""The simulator raises what CUDA's kernels raise where their checks differ from TensorIterator's:
argument-by-argument wrappers (gather, scatter, clamp with tensor bounds, nll_loss, layer_norm...),
kernels with messages of their own (convolutions, scaled_dot_product_attention), CPU scalars
refused or counted (addcmul, addcdiv, losses, two scalars), ``out=`` outputs, generators of random
ops on existing tensors, ``x[idx] = v`` with a one-element value, CUDA events' elapsed_time, and
packed sequences' lengths on a GPU.

Each scenario's outcome on a real ``cuda:0`` (torch 2.11, NVIDIA H200) is what the simulated one
must give here, with the wording of the torch that runs; ``-m gpu`` compares the two on hardware.
The outcomes of :data:`NOT_YET_ON_A_GPU` follow from torch's schemas and have not run on one yet.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if torch.version.cuda is None:  # pragma: no cover - the simulator needs the CUDA build
    pytest.skip("the simulator needs a CUDA build of torch", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing._sim_state import TORCH_VERSION  # noqa: E402
from test_simulator import _outcome as outcome  # noqa: E402 - (error type, first line) or ("ok", device)

G = "cuda:0"
TI = "Expected all tensors to be on the same device, but found at least two devices, {} and {}!"


def ti(a: str = G, b: str = "cpu"):
    return "RuntimeError", TI.format(a, b)


def exact(arg: str, other: str, common: str, method: str):
    if TORCH_VERSION >= (2, 8):
        return "RuntimeError", (
            f"Expected all tensors to be on the same device, but got {arg} is on {other}, different from "
            f"other tensors on {common} (when checking argument in method {method})"
        )
    return "RuntimeError", (
        f"Expected all tensors to be on the same device, but found at least two devices, {common} and "
        f"{other}! (when checking argument for argument {arg} in method {method})"
    )


def on_cpu(arg: str, method: str):  # `arg` is on the CPU, the others on cuda:0
    return exact(arg, "cpu", G, method)


def on_gpu(arg: str, method: str):  # `arg` is on cuda:0, the first tensor on the CPU
    return exact(arg, G, "cpu", method)


def ok(device: str = G):
    return "ok", device


def c(*size, **kw):
    return torch.ones(*size, device=G, **kw)


def cpu0():
    return torch.tensor(2.0)


def put(x, index, value):
    x[index] = value
    return x


def out_call(f, *args, out):
    f(*args, out=out)
    return out


def elapsed(timing: bool, record: int):
    a, b = torch.cuda.Event(enable_timing=timing), torch.cuda.Event(enable_timing=timing)
    for e in (a, b)[:record]:
        e.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


TOO_MANY = ("RuntimeError", "Trying to pass too many CPU scalars to non-CPU kernel!")
ADDCMUL_NEW = TORCH_VERSION >= (2, 7)  # pytorch/pytorch#143264
NEW_EVENTS = TORCH_VERSION >= (2, 8)  # pytorch/pytorch#151404
LONG = dict(dtype=torch.long)

# name -> (scenario, outcome on a real cuda:0 in the torch that runs)
SCENARIOS = {
    # argument-by-argument wrappers
    "gather_cpu_index": (
        lambda: torch.gather(c(3), 0, torch.tensor([0])),
        on_cpu("index", "wrapper_CUDA_gather"),
    ),
    "gather_cpu_self": (
        lambda: torch.gather(torch.ones(3), 0, torch.tensor([0], device=G)),
        on_gpu("index", "wrapper_CUDA_gather"),
    ),
    "scatter_src": (
        lambda: torch.scatter(torch.zeros(3, device=G), 0, torch.tensor([0]), c(1)),
        on_cpu("index", "wrapper_CUDA_scatter_src"),
    ),
    "scatter__cpu_src": (
        lambda: torch.zeros(3, device=G).scatter_(0, torch.tensor([0], device=G), torch.ones(1)),
        on_cpu("src", "wrapper_CUDA_scatter__src"),
    ),
    "scatter__value": (
        lambda: torch.zeros(3, device=G).scatter_(0, torch.tensor([0]), 1.0),
        on_cpu("index", "wrapper_CUDA_scatter__value"),
    ),
    "scatter_add_": (
        lambda: torch.zeros(3, device=G).scatter_add_(0, torch.tensor([0]), c(1)),
        on_cpu("index", "wrapper_CUDA_scatter_add_"),
    ),
    "scatter_reduce_": (
        lambda: torch.zeros(3, device=G).scatter_reduce_(0, torch.tensor([0]), c(1), "sum"),
        on_cpu("index", "wrapper_CUDA_scatter_reduce__two"),
    ),
    "index_add__cpu_source": (
        lambda: torch.zeros(3, device=G).index_add_(0, torch.tensor([0], device=G), torch.ones(1)),
        on_cpu("source", "wrapper_CUDA_index_add_"),
    ),
    "index_copy_": (
        lambda: torch.zeros(3, device=G).index_copy_(0, torch.tensor([0]), c(1)),
        on_cpu("index", "wrapper_CUDA_index_copy_"),
    ),
    "index_fill_": (lambda: torch.zeros(3, device=G).index_fill_(0, torch.tensor([0]), 1.0), ti()),
    "clamp_cpu0_min": (lambda: c(2).clamp(min=cpu0()), on_cpu("min", "wrapper_CUDA_clamp_Tensor")),
    "clamp__cpu0_min": (lambda: c(2).clamp_(min=cpu0()), on_cpu("min", "wrapper_CUDA_clamp__Tensor")),
    "clip_cpu0_max": (lambda: torch.clip(c(2), max=cpu0()), on_cpu("max", "wrapper_CUDA_clamp_Tensor")),
    "clamp_cuda_min_cpu_max": (
        lambda: c(2).clamp(min=torch.tensor(1.0, device=G), max=cpu0()),
        on_cpu("max", "wrapper_CUDA_clamp_Tensor"),
    ),
    "clamp_cpu_self": (
        lambda: torch.ones(2).clamp(min=torch.tensor(1.0, device=G)),
        on_gpu("min", "wrapper_CUDA_clamp_Tensor"),
    ),
    "clamp_out_cpu": (lambda: torch.clamp(c(2), min=c(()), out=torch.ones(2)), ti()),
    "clamp_min_tensor": (
        lambda: torch.clamp_min(c(2), cpu0()),
        on_cpu("min", "wrapper_CUDA_clamp_min_Tensor"),
    ),
    "clamp_max_tensor": (lambda: c(2).clamp_max(cpu0()), on_cpu("max", "wrapper_CUDA_clamp_max_Tensor")),
    "nll_loss_cpu_target": (
        lambda: F.nll_loss(c(2, 3), torch.tensor([0, 1])),
        on_cpu("target", "wrapper_CUDA_nll_loss_forward"),
    ),
    "nll_loss_1d_cpu0_target": (
        lambda: F.nll_loss(c(3), torch.tensor(0)),
        on_cpu("target", "wrapper_CUDA_nll_loss_forward"),
    ),
    "nll_loss_4d": (
        lambda: F.nll_loss(c(1, 3, 2, 2), torch.zeros(1, 2, 2, **LONG)),
        on_cpu("target", "wrapper_CUDA__nll_loss2d_forward"),
    ),
    "cross_entropy_cpu_target": (
        lambda: F.cross_entropy(c(2, 3), torch.tensor([0, 1])),
        on_cpu("target", "wrapper_CUDA_nll_loss_forward"),
    ),
    "cross_entropy_3d": (
        lambda: F.cross_entropy(c(1, 3, 2), torch.zeros(1, 2, **LONG)),
        on_cpu("target", "wrapper_CUDA__nll_loss2d_forward"),
    ),
    "cross_entropy_cpu_weight": (
        lambda: F.cross_entropy(c(2, 3), torch.tensor([0, 1], device=G), weight=torch.ones(3)),
        on_cpu("weight", "wrapper_CUDA_nll_loss_forward"),
    ),
    "cross_entropy_cpu_input": (
        lambda: F.cross_entropy(torch.ones(2, 3), torch.tensor([0, 1], device=G)),
        on_gpu("target", "wrapper_CUDA_nll_loss_forward"),
    ),
    "cross_entropy_cpu_probabilities": (lambda: F.cross_entropy(c(2, 3), torch.ones(2, 3)), ti()),
    "layer_norm_cpu_weight": (
        lambda: F.layer_norm(c(2, 2), (2,), weight=torch.ones(2)),
        on_cpu("weight", "wrapper_CUDA__native_layer_norm"),
    ),
    "layer_norm_cpu_bias": (
        lambda: F.layer_norm(c(2, 2), (2,), weight=c(2), bias=torch.ones(2)),
        on_cpu("bias", "wrapper_CUDA__native_layer_norm"),
    ),
    "layer_norm_cpu_input": (
        lambda: F.layer_norm(torch.ones(2, 2), (2,), weight=c(2)),
        on_gpu("weight", "wrapper_CUDA__native_layer_norm"),
    ),
    "group_norm_cpu_weight": (
        lambda: F.group_norm(c(1, 2, 2), 1, weight=torch.ones(2)),
        on_cpu("weight", "wrapper_CUDA__native_group_norm"),
    ),
    "searchsorted_cpu_values": (
        lambda: torch.searchsorted(c(3), torch.ones(2)),
        on_cpu("self", "wrapper_CUDA_Tensor_searchsorted"),
    ),
    "searchsorted_cpu_sequence": (
        lambda: torch.searchsorted(torch.ones(3), c(2)),
        on_gpu("self", "wrapper_CUDA_Tensor_searchsorted"),
    ),
    "einsum_contracted": (
        lambda: torch.einsum("i,i->", c(2), torch.ones(2)),
        on_cpu("mat2", "wrapper_CUDA_bmm"),
    ),
    "einsum_mm_cpu_first": (
        lambda: torch.einsum("ij,jk->ik", torch.ones(2, 2), c(2, 2)),
        on_gpu("mat2", "wrapper_CUDA_bmm"),
    ),
    "einsum_bmm": (
        lambda: torch.einsum("bij,bjk->bik", c(1, 2, 2), torch.ones(1, 2, 2)),
        on_cpu("mat2", "wrapper_CUDA_bmm"),
    ),
    "einsum_elementwise": (lambda: torch.einsum("i,i->i", c(2), torch.ones(2)), ti()),
    "einsum_outer": (lambda: torch.einsum("i,j->ij", c(2), torch.ones(2)), ti()),
    "index_reduce__cpu_source": (
        lambda: torch.zeros(3, device=G).index_reduce_(0, torch.tensor([0], device=G), torch.ones(1), "prod"),
        on_cpu("source", "wrapper_CUDA_index_reduce_"),
    ),
    "masked_select_cpu_mask": (
        lambda: torch.masked_select(c(2), torch.tensor([True, False])),
        on_cpu("mask", "wrapper_CUDA__masked_select"),
    ),
    "masked_select_cpu0_mask": (
        lambda: torch.masked_select(c(2), torch.tensor(True)),
        on_cpu("mask", "wrapper_CUDA__masked_select"),
    ),
    "isin_cpu0": (
        lambda: torch.isin(c(3), torch.tensor(1.0)),
        on_cpu("test_elements", "wrapper_CUDA_isin_Tensor_Tensor"),
    ),
    "isin_cpu_elements": (
        lambda: torch.isin(torch.ones(3), torch.tensor([1.0], device=G)),
        on_gpu("test_elements", "wrapper_CUDA_isin_Tensor_Tensor"),
    ),
    "repeat_interleave_cpu0_repeats": (  # repeats become an index_select's index
        lambda: torch.repeat_interleave(c(2), torch.tensor(2)),
        on_cpu("index", "wrapper_CUDA__index_select"),
    ),
    "repeat_interleave_cpu_repeats": (
        lambda: torch.repeat_interleave(c(2), torch.tensor([1, 2])),
        on_cpu("index", "wrapper_CUDA__index_select"),
    ),
    "polar_cpu0_angle": (lambda: torch.polar(c(2), cpu0()), on_cpu("angle", "wrapper_CUDA_out_polar_out")),
    "complex_cpu0_imag": (
        lambda: torch.complex(c(2), cpu0()),
        on_cpu("imag", "wrapper_CUDA_out_complex_out"),
    ),
    "normal_cpu0_std": (
        lambda: torch.normal(c(2), cpu0()),
        on_cpu("std", "wrapper_CUDA_Tensor_Tensor_normal"),
    ),
    "take_cpu_index": (lambda: torch.take(c(3), torch.tensor([0])), on_cpu("index", "wrapper_CUDA__take")),
    "put__cpu_index": (
        lambda: torch.zeros(3, device=G).put_(torch.tensor([0]), c(1)),
        on_cpu("index", "wrapper_CUDA__put_"),
    ),
    "bincount_cpu_weights": (
        lambda: torch.bincount(torch.tensor([0, 1], device=G), weights=torch.ones(2)),
        on_cpu("weights", "wrapper_CUDA__bincount"),
    ),
    "dot_cpu": (lambda: torch.dot(c(2), torch.ones(2)), on_cpu("tensor", "wrapper_CUDA__dot")),
    "linalg_cross_cpu": (
        lambda: torch.linalg.cross(c(3), torch.ones(3)),
        on_cpu("other", "wrapper_CUDA_linalg_cross"),
    ),
    "prelu_cpu_weight": (
        lambda: F.prelu(c(2, 2), torch.ones(1)),
        on_cpu("weight", "wrapper_CUDA___prelu_kernel"),
    ),
    "addmv_cpu_vec": (lambda: torch.addmv(c(2), c(2, 2), torch.ones(2)), on_cpu("vec", "wrapper_CUDA_addmv")),
    "addr_cpu_vec2": (lambda: torch.addr(c(2, 2), c(2), torch.ones(2)), on_cpu("vec2", "wrapper_CUDA__addr")),
    "tensordot_cpu": (
        lambda: torch.tensordot(c(2, 2), torch.ones(2, 2), dims=1),
        on_cpu("mat2", "wrapper_CUDA_mm"),
    ),
    "diff_cpu_prepend": (  # cat([prepend, input])
        lambda: torch.diff(c(2), prepend=torch.ones(1)),
        on_gpu("tensors", "wrapper_CUDA_cat"),
    ),
    "searchsorted_cpu_sorter": (
        lambda: torch.searchsorted(c(3), c(2), sorter=torch.tensor([0, 1, 2])),
        (
            "RuntimeError",
            "torch.searchsorted(): sorter and boundary tensors should have same device type, but "
            "got sorter tensor device type cpu and input value tensor device type cuda:0",
        ),
    ),
    # ops that read only the other tensor's shape
    "resize_as__cpu": (lambda: c(2).resize_as_(torch.ones(3)), ok()),
    "view_as_cpu": (lambda: c(2).view_as(torch.ones(2)), ok()),
    "expand_as_cpu": (lambda: c(1).expand_as(torch.ones(3)), ok()),
    "masked_fill_one_element_value": (  # a shape error before any device check
        lambda: c(2).masked_fill(torch.tensor([True, False], device=G), torch.ones(1)),
        (
            "RuntimeError",
            "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with 1 dimension(s).",
        ),
    ),
    # messages of the kernels' own
    "conv2d_cpu_weight": (
        lambda: F.conv2d(c(1, 1, 3, 3), torch.ones(1, 1, 1, 1)),
        (
            "RuntimeError",
            "Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same",
        ),
    ),
    "conv2d_cpu_bias": (
        lambda: F.conv2d(c(1, 1, 3, 3), c(1, 1, 1, 1), torch.ones(1)),
        (
            "RuntimeError",
            "Input type (torch.cuda.FloatTensor) and bias type (torch.FloatTensor) should be the same",
        ),
    ),
    "conv1d_half_cpu_weight": (
        lambda: F.conv1d(c(1, 1, 3, dtype=torch.half), torch.ones(1, 1, 1, dtype=torch.half)),
        (
            "RuntimeError",
            "Input type (torch.cuda.HalfTensor) and weight type (torch.HalfTensor) should be the same",
        ),
    ),
    "conv_transpose2d_cpu_weight": (
        lambda: F.conv_transpose2d(c(1, 1, 3, 3), torch.ones(1, 1, 1, 1)),
        (
            "RuntimeError",
            "Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same",
        ),
    ),
    "sdpa_cpu_key": (
        lambda: F.scaled_dot_product_attention(c(1, 1, 2, 4), torch.ones(1, 1, 2, 4), c(1, 1, 2, 4)),
        (
            "RuntimeError",
            "Expected query, key, and value to have the same device type, but got query.device: "
            "cuda:0 key.device: cpu and value.device: cuda:0 instead.",
        ),
    ),
    "sdpa_cpu_query": (
        lambda: F.scaled_dot_product_attention(torch.ones(1, 1, 2, 4), c(1, 1, 2, 4), c(1, 1, 2, 4)),
        (
            "RuntimeError",
            "Expected query, key, and value to have the same device type, but got query.device: "
            "cpu key.device: cuda:0 and value.device: cuda:0 instead.",
        ),
    ),
    "take_along_dim_cpu_indices": (
        lambda: torch.take_along_dim(c(3), torch.tensor([0])),
        (
            "RuntimeError",
            "Expected tensor to have cuda:0 Device, but got tensor with cpu Device (while checking "
            "arguments for torch.take_along_dim():)",
        ),
    ),
    "masked_fill_cuda_mask_on_cpu": (
        lambda: torch.ones(2).masked_fill(torch.tensor([True, False], device=G), 0.0),
        (
            "RuntimeError",
            "expected self and mask to be on the same device, but got mask on cuda:0 and self on cpu",
        ),
    ),
    # CPU scalars: refused, counted, never an output
    "addcdiv_cpu0_tensor2": (lambda: c(2).addcdiv(c(2), cpu0()), ti()),
    "addcdiv_cpu0_self": (lambda: torch.addcdiv(cpu0(), c(2), c(2)), ti()),
    "addcmul_cpu0_tensor2": (lambda: c(2).addcmul(c(2), cpu0()), ok() if ADDCMUL_NEW else ti()),
    "addcmul__cpu0_tensor2": (lambda: c(2).addcmul_(c(2), cpu0()), ok() if ADDCMUL_NEW else ti()),
    "addcmul_cpu0_tensor1": (
        lambda: c(2).addcmul(cpu0(), c(2)),
        (
            "RuntimeError",
            "CPU Scalar support for tensor1 argument is not supported when calling addcmul on CUDA "
            "tensors. However, CPU Scalar support for tensor2 is supported, please swap your tensor1 "
            "and tensor2 terms.",
        )
        if ADDCMUL_NEW
        else ti(),
    ),
    "addcmul_cpu0_self": (
        lambda: torch.addcmul(cpu0(), c(2), c(2)),
        (
            "RuntimeError",
            "CPU Scalar support for self argument is not supported when calling addcmul on CUDA tensors.",
        )
        if ADDCMUL_NEW
        else ti(),
    ),
    "addcmul_cpu0_self_and_tensor2": (
        lambda: torch.addcmul(cpu0(), c(2), cpu0()),
        TOO_MANY if ADDCMUL_NEW else ti(),
    ),
    "mse_loss_cpu0_target": (lambda: F.mse_loss(c(2), cpu0()), ti()),
    "mse_loss_0dim_both": (lambda: F.mse_loss(c(()), cpu0()), ti()),
    "l1_loss_cpu0_target": (lambda: F.l1_loss(c(2), cpu0()), ti()),
    "add_two_cpu0_out_cuda": (lambda: out_call(torch.add, cpu0(), cpu0(), out=c(())), TOO_MANY),
    "add_out_cpu0": (lambda: out_call(torch.add, c(()), cpu0(), out=torch.tensor(0.0)), ti()),
    "mul_cpu0_ok": (lambda: cpu0() * c(2), ok()),
    "maximum_cpu0_ok": (lambda: torch.maximum(c(2), cpu0()), ok()),
    "lerp_cpu0_weight_ok": (lambda: torch.lerp(c(2), c(2), cpu0()), ok()),
    # random ops on existing tensors check the generator's device
    "normal__cpu_generator": (
        lambda: c(2).normal_(generator=torch.Generator()),
        ("RuntimeError", "Expected a 'cuda' device type for generator but found 'cpu'"),
    ),
    "bernoulli_cpu_generator": (
        lambda: torch.bernoulli(c(2) / 2, generator=torch.Generator()),
        ("RuntimeError", "Expected a 'cuda' device type for generator but found 'cpu'"),
    ),
    "multinomial_cpu_generator": (
        lambda: torch.multinomial(c(3), 1, generator=torch.Generator()),
        ("RuntimeError", "Expected a 'cuda' device type for generator but found 'cpu'"),
    ),
    "normal_means_cpu_generator": (
        lambda: torch.normal(c(2), c(2), generator=torch.Generator()),
        ("RuntimeError", "Expected a 'cuda' device type for generator but found 'cpu'"),
    ),
    "uniform__on_cpu_cuda_generator": (
        lambda: torch.ones(2).uniform_(generator=torch.Generator(device=G)),
        ("RuntimeError", "Expected a 'cpu' device type for generator but found 'cuda'"),
    ),
    "poisson_cpu_generator": (
        lambda: torch.poisson(c(2), generator=torch.Generator()),
        ("RuntimeError", "Expected a 'cuda' device type for generator but found 'cpu'"),
    ),
    "normal__cuda_generator_ok": (lambda: c(2).normal_(generator=torch.Generator(device=G)), ok()),
    # x[idx] = v drops v's leading 1-dims: a one-element value arrives 0-dim and is copied over
    "put_cpu_one_element": (lambda: put(torch.zeros(3, device=G), torch.tensor([0, 2]), torch.ones(1)), ok()),
    "put_cpu_1x1": (lambda: put(torch.zeros(3, device=G), torch.tensor([0, 2]), torch.ones(1, 1)), ok()),
    "put_cuda_one_element_into_cpu": (lambda: put(torch.zeros(2), torch.tensor([0]), c(1)), ok("cpu")),
    "put_cuda_values_into_cpu": (lambda: put(torch.zeros(2), torch.tensor([0, 1]), c(2)), ti()),
    "index_put__one_element_refused": (
        lambda: torch.zeros(3, device=G).index_put_((torch.tensor([0]),), torch.ones(1)),
        ti(),
    ),
    # events
    "elapsed_time_timed": (lambda: elapsed(True, 2) >= 0.0, ("ok", "True")),
    "elapsed_time_untimed": (
        lambda: elapsed(False, 2),
        ("ValueError", "Both events must be created with argument 'enable_timing=True'.")
        if NEW_EVENTS
        else ("RuntimeError", "CUDA error: invalid resource handle"),
    ),
    "elapsed_time_unrecorded": (
        lambda: elapsed(True, 1),
        (
            "ValueError" if NEW_EVENTS else "RuntimeError",
            "Both events must be recorded before calculating elapsed time.",
        ),
    ),
}


LENGTHS = ("RuntimeError", "'lengths' argument should be a 1D CPU int64 tensor, but got 1D cuda:0 Long tensor")


def pack(x, lengths):
    from torch.nn.utils.rnn import pack_padded_sequence

    return pack_padded_sequence(x, lengths).data


def _adam_step_with_a_tensor_lr():
    p = torch.nn.Parameter(c(2))
    p.grad = c(2)
    torch.optim.Adam([p], lr=torch.tensor(0.01), foreach=False).step()  # addcdiv_(..., value=tensor)
    return p


# Calls that CUDA accepts because torch's argument parser reads a 0-dim tensor as a number, or runs
# each CPU scalar in a kernel of its own, and packed sequences' sizes, which must stay on the CPU;
# from torch's schemas, dispatch and kernels' source, not yet run on a GPU.
SCENARIOS.update(
    {
        "addcdiv__cpu0_value": (lambda: c(2).addcdiv_(c(2), c(2), value=cpu0()), ok()),
        "add_cpu0_other_and_alpha": (lambda: torch.add(c(2), cpu0(), alpha=cpu0()), ok()),
        "adam_tensor_lr_single_tensor": (_adam_step_with_a_tensor_lr, ok()),
        "bce_logits_cpu0_weight_and_pos_weight": (
            lambda: F.binary_cross_entropy_with_logits(c(2), c(2), weight=cpu0(), pos_weight=cpu0()),
            ok(),
        ),
        "clamp_number_and_cpu0_bound": (lambda: c(2).clamp(0.0, cpu0()), ok()),
        "scatter_cpu0_value_keyword": (
            lambda: torch.zeros(3, device=G).scatter(0, torch.tensor([0], device=G), value=cpu0()),
            ok(),
        ),
        "l1_loss_0dim_both": (lambda: F.l1_loss(c(()), cpu0()), ok()),
        "native_group_norm_cpu_weight": (
            lambda: torch.native_group_norm(c(1, 2, 2), torch.ones(2), c(2), 1, 2, 2, 1, 1e-5)[0],
            on_cpu("weight", "wrapper_CUDA__native_group_norm"),
        ),
        # aten/src/ATen/native/PackedSequence.cpp checkLongTensor, for CUDA data as for CPU data
        "pack_padded_sequence_cuda_lengths": (lambda: pack(c(3, 2), torch.tensor([3, 2], device=G)), LENGTHS),
        "pack_padded_sequence_cpu_data_cuda_lengths": (
            lambda: pack(torch.ones(3, 2), torch.tensor([3, 2], device=G)),
            LENGTHS,
        ),
        "pad_packed_sequence_cuda_batch_sizes": (
            lambda: torch._VF._pad_packed_sequence(c(5), torch.tensor([2, 2, 1], device=G), False, 0.0, 3)[0],
            LENGTHS,
        ),
        "pack_padded_sequence_cpu_lengths_ok": (lambda: pack(c(3, 2), torch.tensor([3, 2])), ok()),
    }
)
NOT_YET_ON_A_GPU = {
    "addcdiv__cpu0_value",
    "add_cpu0_other_and_alpha",
    "adam_tensor_lr_single_tensor",
    "bce_logits_cpu0_weight_and_pos_weight",
    "clamp_number_and_cpu0_bound",
    "scatter_cpu0_value_keyword",
    "l1_loss_0dim_both",
    "native_group_norm_cpu_weight",
    "pack_padded_sequence_cuda_lengths",
    "pack_padded_sequence_cpu_data_cuda_lengths",
    "pad_packed_sequence_cuda_batch_sizes",
    "pack_padded_sequence_cpu_lengths_ok",
}


def simulated(fn):
    with torch.no_grad(), simulated_gpus(1, memory="8GiB"):
        return outcome(fn)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_simulated_gpu_raises_what_the_cuda_kernel_raises(name):
    fn, expected = SCENARIOS[name]
    assert simulated(fn) == expected


def test_elapsed_time_between_simulated_events_is_the_time_between_their_records():
    import time

    with simulated_gpus(1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        time.sleep(0.05)  # the work a throughput figure divides by
        end.record()
        torch.cuda.synchronize()
        forward, backward = start.elapsed_time(end), end.elapsed_time(start)
    assert 50.0 <= forward < 5000.0  # milliseconds, as CUDA's
    assert backward == -forward  # an end recorded first: negative, as cudaEventElapsedTime gives


def _like_takes_a_generator() -> bool:
    try:
        torch.rand_like(torch.empty(1), generator=torch.Generator())
    except TypeError:  # torch 2.9 and older
        return False
    return True


RANDOM_ON_A_TENSOR = [
    lambda x: torch.normal(x, 1.0),
    lambda x: torch._standard_gamma(x + 1),  # torch.distributions' Gamma, Beta, Chi2, StudentT
    lambda x: torch._sample_dirichlet(x + 1),
] + ([torch.rand_like] if _like_takes_a_generator() else [])


@pytest.mark.parametrize("op", RANDOM_ON_A_TENSOR)
def test_random_ops_on_simulated_tensors_draw_from_that_gpus_generator(op):
    with simulated_gpus(2):
        x = torch.zeros(4, device="cuda:1")
        draws = []
        for cpu_seed in (0, 1):  # the CPU generator does not decide them
            torch.manual_seed(cpu_seed)
            torch.cuda.manual_seed_all(7)
            draws.append(op(x))
        torch.cuda.manual_seed_all(8)
        draws.append(op(x))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_parity_with_real_cuda0(name):
    fn, expected = SCENARIOS[name]
    with torch.no_grad():
        real = outcome(fn)
        torch.cuda.synchronize()
    assert real == simulated(fn) == expected
