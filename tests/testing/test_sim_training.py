"""Training on simulated GPUs: forward with grad, backward, optimizer steps, as on CUDA.

A tiny Llama split over two simulated GPUs (accelerate's ``dispatch_model`` and
``from_pretrained(device_map=...)``) takes SGD and AdamW steps with the optimizers' CUDA defaults
(foreach) and gives the CPU's losses; gradients and optimizer states live on their parameters'
devices and are charged to them; a LoRA on a 4-bit model trains on two GPUs where bitsandbytes
has CPU kernels; a gradient or optimizer state on the wrong GPU raises torch's own error.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

if torch.version.cuda is None:
    pytest.skip(
        f"simulated GPUs need a CUDA build of torch; torch {torch.__version__} is the CPU-only build",
        allow_module_level=True,
    )

from torch.optim.optimizer import _default_to_fused_or_foreach  # noqa: E402

from devmap_shims.testing import simulated_gpus  # noqa: E402
from devmap_shims.testing._sim_machine import round_block  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # the libraries' own deprecations on the paths under test: torch 2.4's checkpoint calls
    # torch.cpu.amp.autocast; peft calls transformers 5's renamed gradient-checkpointing methods
    pytest.mark.filterwarnings("ignore:`torch.cpu.amp.autocast:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
STEPS = 3
MEMORY = "2GiB"  # transformers 5.x pre-allocates (capacity - 1.2 GiB) at load: keep capacity above that
SAME_INDEX = "Tensors of the same index must be on the same device and the same dtype except `step` tensors"
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
}


def two_layers():
    """Linear on cuda:0 -> .to("cuda:1") -> Linear on cuda:1 (call inside a simulation)."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 8).to("cuda:0"), torch.nn.Linear(8, 2).to("cuda:1")
    x = torch.randn(3, 4, device="cuda:0")

    def loss():
        return second(first(x).to("cuda:1")).pow(2).mean()

    return first, second, loss


# ------------------------------------------------------------------------------------------------
# gradients
# ------------------------------------------------------------------------------------------------
def test_gradients_live_on_their_parameters_devices_and_are_charged_there():
    with simulated_gpus(2) as machine:
        first, second, loss = two_layers()
        out = loss()
        assert out.device == CUDA1 and out.requires_grad and out.grad_fn is not None
        out.backward()
        del out
        params = list(first.parameters()) + list(second.parameters())
        for p in params:
            assert p.grad.device == p.device and p.grad.is_cuda and p.grad.get_device() == p.get_device()
        # the gradient that flowed back through .to("cuda:1") is on the source device, as on CUDA
        assert first.weight.grad.device == CUDA0 and second.weight.grad.device == CUDA1
        before = [machine.allocated(i) for i in (0, 1)]
        grads = {i: sum(round_block(p.grad.nbytes) for p in params if p.device.index == i) for i in (0, 1)}
        for p in params:
            p.grad = None
        assert [machine.allocated(i) for i in (0, 1)] == [before[0] - grads[0], before[1] - grads[1]]


def test_autograd_grad_retained_grads_and_accumulation_follow_the_tensors():
    with simulated_gpus(2):
        first, second, loss = two_layers()
        gw1, gw2 = torch.autograd.grad(loss(), [first.weight, second.weight])
        assert (gw1.device, gw2.device) == (CUDA0, CUDA1)
        hidden = first(torch.ones(2, 4, device="cuda:0"))
        hidden.retain_grad()
        second(hidden.to("cuda:1")).sum().backward()
        assert hidden.grad.device == CUDA0
        first.weight.grad = None
        torch.autograd.backward(loss())  # the functional form, twice: gradients accumulate
        once = first.weight.grad.clone()
        torch.autograd.backward(loss())
        assert first.weight.grad.device == CUDA0
        assert torch.allclose(first.weight.grad.cpu(), 2 * once.cpu())


def test_a_backward_hook_and_clip_grad_norm_see_the_simulated_devices():
    seen = []
    with simulated_gpus(2):
        first, second, loss = two_layers()
        second.weight.register_hook(lambda g: seen.append(g.shape))
        loss().backward()
        assert seen == [second.weight.shape]
        norm = torch.nn.utils.clip_grad_norm_(list(first.parameters()) + list(second.parameters()), 1e-3)
        assert norm.device == CUDA0  # the first gradient's device, as on CUDA
        assert first.weight.grad.device == CUDA0 and float(first.weight.grad.norm()) < 1e-3


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_recomputes_on_the_simulated_devices(reentrant):
    from torch.utils.checkpoint import checkpoint

    with simulated_gpus(2):
        first, second, _ = two_layers()
        x = torch.randn(3, 4, device="cuda:0", requires_grad=True)
        second(checkpoint(first, x, use_reentrant=reentrant).to("cuda:1")).sum().backward()
        assert first.weight.grad.device == CUDA0 and x.grad.device == CUDA0
        with_checkpoint = first.weight.grad.cpu()
        first.weight.grad = None
        second(first(x).to("cuda:1")).sum().backward()
        assert torch.equal(first.weight.grad.cpu(), with_checkpoint)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_recomputes_dropout_with_the_forwards_mask(reentrant):
    """Dropout on a GPU draws from its generator: checkpointing saves and restores that generator's
    state, as it does once CUDA is initialized, so the recomputed mask is the forward's."""
    from torch.utils.checkpoint import checkpoint

    with simulated_gpus(2):
        torch.manual_seed(0)
        first = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.5)).to("cuda:0")
        second = torch.nn.Linear(64, 2).to("cuda:1")
        x = torch.randn(3, 4, device="cuda:0", requires_grad=True)
        torch.cuda.manual_seed_all(5)
        second(checkpoint(first, x, use_reentrant=reentrant).to("cuda:1")).sum().backward()
        with_checkpoint = first[0].weight.grad.cpu()
        first[0].weight.grad = None
        torch.cuda.manual_seed_all(5)
        second(first(x).to("cuda:1")).sum().backward()
        assert torch.equal(first[0].weight.grad.cpu(), with_checkpoint)


# ------------------------------------------------------------------------------------------------
# optimizers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_take_the_cuda_default_and_keep_their_state_on_the_parameters_devices(name):
    with simulated_gpus(2):
        first, second, loss = two_layers()
        params = list(first.parameters()) + list(second.parameters())
        assert _default_to_fused_or_foreach(params, False, False) == (False, True)  # foreach, as for CUDA
        opt = OPTIMIZERS[name](params)
        for _ in range(2):
            loss().backward()
            opt.step()
            opt.zero_grad()
        for p in params:
            for key, value in opt.state[p].items():
                if torch.is_tensor(value) and value.dim():
                    assert value.device == p.device, (key, value.device, p.device)


def test_fused_adamw_runs_and_keeps_its_step_counts_on_the_gpus():
    with simulated_gpus(2):
        first, second, loss = two_layers()
        opt = torch.optim.AdamW(list(first.parameters()) + list(second.parameters()), lr=1e-2, fused=True)
        before = loss().item()
        for _ in range(3):
            loss().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        assert loss().item() < before
        assert opt.state[second.weight]["step"].device == CUDA1  # fused keeps `step` on the param's device
        assert first.weight.grad.device == CUDA0 and not first.weight.grad.any()


def test_grad_scaler_unscales_and_steps_on_the_gpus():
    with simulated_gpus(2):
        first, second, loss = two_layers()
        params = list(first.parameters()) + list(second.parameters())
        scaler = torch.amp.GradScaler("cuda") if hasattr(torch.amp, "GradScaler") else torch.cuda.amp.GradScaler()
        opt = torch.optim.SGD(params, lr=0.1)
        reference = torch.autograd.grad(loss(), first.weight)[0].cpu()
        before = first.weight.detach().cpu()
        scaler.scale(loss()).backward()
        assert torch.allclose(first.weight.grad.cpu(), reference * scaler.get_scale())
        scaler.unscale_(opt)
        assert torch.allclose(first.weight.grad.cpu(), reference) and first.weight.grad.device == CUDA0
        scaler.step(opt)
        scaler.update()
        assert torch.allclose(first.weight.detach().cpu(), before - 0.1 * reference)


# ------------------------------------------------------------------------------------------------
# wrong devices: torch's own errors
# ------------------------------------------------------------------------------------------------
def test_assigning_a_gradient_from_another_device_raises_torchs_error():
    with simulated_gpus(2):
        first, _, _ = two_layers()
        with pytest.raises(RuntimeError) as other_gpu:
            first.weight.grad = torch.zeros(8, 4, device="cuda:1")
        assert str(other_gpu.value) == (
            "attempting to assign a gradient located on device with index '1' to a tensor located on device "
            "with index '0'. Please ensure that the gradient and the tensor are on the same device"
        )
        with pytest.raises(RuntimeError) as cpu:
            first.weight.grad = torch.zeros(8, 4)
        assert str(cpu.value) == (
            "attempting to assign a gradient with device type 'cpu' to a tensor with device type 'cuda'. "
            "Please ensure that the gradient and the tensor are on the same device"
        )
        with pytest.raises(RuntimeError, match="attempting to assign a gradient with dtype"):
            first.weight.grad = torch.zeros(8, 4, dtype=torch.float64, device="cuda:1")  # dtype is checked first
        first.weight.grad = torch.ones(8, 4, device="cuda:0")
        assert first.weight.grad.device == CUDA0


def test_a_gradient_given_to_backward_on_another_device_raises_the_engines_error():
    with simulated_gpus(2):
        first, _, _ = two_layers()
        out = first(torch.ones(3, 4, device="cuda:0"))
        with pytest.raises(RuntimeError, match=r"^invalid gradient at index 0 - expected device cuda:0 but got cuda:1$"):
            out.backward(torch.ones(3, 8, device="cuda:1"))
        with pytest.raises(RuntimeError, match=r"^invalid gradient at index 0 - expected device cuda:0 but got cpu$"):
            torch.autograd.grad(out, first.weight, torch.ones(3, 8))
        out.sum().backward(torch.tensor(1.0))  # a 0-dim CPU gradient is moved, as the engine moves it
        assert first.weight.grad.device == CUDA0


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_an_optimizer_state_moved_to_another_gpu_raises_as_on_cuda(foreach):
    with simulated_gpus(2):
        first, second, loss = two_layers()
        opt = torch.optim.AdamW(list(first.parameters()) + list(second.parameters()), lr=1e-2, foreach=foreach)
        loss().backward()
        opt.step()
        state = opt.state[first.weight]
        state["exp_avg"] = state["exp_avg"].to("cuda:1")
        loss().backward()
        if foreach:  # the grouping before the foreach kernels
            with pytest.raises(RuntimeError, match=f"^{SAME_INDEX}"):
                opt.step()
        else:  # the first kernel that meets both: exp_avg.lerp_(grad, ...)
            with pytest.raises(RuntimeError) as err:
                opt.step()
            assert str(err.value) == (
                "Expected all tensors to be on the same device, but found at least two devices, cuda:1 and cuda:0!"
            )


def test_the_same_index_error_is_torchs_own_wording():
    """The grouping's error is the one the installed torch raises for a pair it refuses."""
    with pytest.raises(RuntimeError) as real:
        torch._C._group_tensors_by_device_and_dtype([[torch.ones(2)], [torch.ones(2, dtype=torch.int8)]], False)
    with simulated_gpus(2):
        a, b = torch.ones(2, device="cuda:0"), torch.ones(2, device="cuda:1")
        with pytest.raises(RuntimeError) as simulated:
            torch._C._group_tensors_by_device_and_dtype([[a], [b]], False)
        # a float32 CPU `step` beside a CUDA tensor is allowed; groups are keyed by simulated device
        step = torch.ones(2)
        grouped = torch._C._group_tensors_by_device_and_dtype([[a, b], [step, None]], True)
        assert set(grouped) == {(CUDA0, torch.float32), (CUDA1, torch.float32)}
        (lists0, idx0), (lists1, idx1) = grouped[(CUDA0, torch.float32)], grouped[(CUDA1, torch.float32)]
        assert lists0[0][0] is a and lists0[1][0] is step and idx0 == [0]
        assert lists1[0][0] is b and lists1[1] == [None] and idx1 == [1]
    assert str(simulated.value) == str(real.value).split("\n")[0]
    assert str(simulated.value).startswith(SAME_INDEX)


# ------------------------------------------------------------------------------------------------
# a tiny Llama on two GPUs
# ------------------------------------------------------------------------------------------------
def _train(model, ids, opt, steps=STEPS, check=None):
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if check is not None:
            check(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses)


def _grads_on_param_devices(model):
    devices = set()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.device == p.device, name
        devices.add(p.device)
    assert devices == {CUDA0, CUDA1}


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from devmap_shims.testing.models import save_tiny_causal_lm

    return save_tiny_causal_lm("llama", tmp_path_factory.mktemp("llama") / "llama")


def _load(path, device_map=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"device_map": device_map} if device_map is not None else {}
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs).train()


@pytest.mark.parametrize("loader", ["dispatch_model", "from_pretrained"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_tiny_llama_on_two_gpus_trains_to_the_cpus_losses(llama_checkpoint, loader, name):
    from accelerate import dispatch_model

    from devmap_shims.testing.models import sample_input_ids, two_gpu_split

    ids = sample_input_ids(batch=2, length=8)
    cpu_model = _load(llama_checkpoint)
    device_map = two_gpu_split(cpu_model)
    expected = _train(cpu_model, ids, OPTIMIZERS[name](cpu_model.parameters()))
    with simulated_gpus(2, memory=MEMORY) as machine:
        if loader == "dispatch_model":
            model = dispatch_model(_load(llama_checkpoint), device_map=device_map)
        else:
            model = _load(llama_checkpoint, device_map=device_map)
        loaded = [machine.allocated(i) for i in (0, 1)]
        opt = OPTIMIZERS[name](model.parameters())
        losses = _train(model, ids.to("cuda:0"), opt, check=_grads_on_param_devices)
        # optimizer state (AdamW's moments) stays on the GPUs
        if name == "adamw":
            assert machine.allocated(0) > loaded[0] and machine.allocated(1) > loaded[1]
    assert torch.allclose(losses, expected), (losses, expected)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_through_accelerates_hooks_gives_the_cpus_losses(llama_checkpoint, reentrant):
    from devmap_shims.testing.models import sample_input_ids, two_gpu_split

    ids = sample_input_ids(batch=2, length=8)
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    cpu_model = _load(llama_checkpoint)
    device_map = two_gpu_split(cpu_model)
    cpu_model.gradient_checkpointing_enable(**kwargs)
    expected = _train(cpu_model, ids, OPTIMIZERS["sgd"](cpu_model.parameters()))
    with simulated_gpus(2, memory=MEMORY):
        model = _load(llama_checkpoint, device_map=device_map)
        model.gradient_checkpointing_enable(**kwargs)
        assert model.is_gradient_checkpointing
        losses = _train(model, ids.to("cuda:0"), OPTIMIZERS["sgd"](model.parameters()), check=_grads_on_param_devices)
    assert torch.allclose(losses, expected), (losses, expected)


# ------------------------------------------------------------------------------------------------
# LoRA on a 4-bit model
# ------------------------------------------------------------------------------------------------
def _bnb_runs_4bit_on_cpu() -> str:
    """Why a 4-bit model cannot run on the simulated GPUs here, or "" when it can."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return "bitsandbytes is not installed"
    try:
        bnb.functional.quantize_4bit(torch.ones(128), quant_type="nf4")
    except Exception as exc:  # bitsandbytes < 0.46 reaches its CUDA library (or fails to load it)
        return (
            f"bitsandbytes {bnb.__version__} quantizes and multiplies 4-bit weights only with its CUDA "
            f"library ({type(exc).__name__}); its CPU kernels, which the simulated GPUs run, arrived in 0.46"
        )
    return ""


def test_a_lora_on_a_4bit_model_on_two_gpus_trains_to_the_cpus_losses(llama_checkpoint):
    reason = _bnb_runs_4bit_on_cpu()
    if reason:
        pytest.skip(reason)
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from devmap_shims.testing.models import sample_input_ids, two_gpu_split

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    ids = sample_input_ids(batch=2, length=8)
    device_map = two_gpu_split(_load(llama_checkpoint))

    def lora_losses(device_map, ids, check=None):
        model = AutoModelForCausalLM.from_pretrained(
            llama_checkpoint, quantization_config=quant, device_map=device_map, local_files_only=True
        )
        model = peft.prepare_model_for_kbit_training(model)  # also turns on (reentrant) gradient checkpointing
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
        q_proj = model.base_model.model.model.layers[1].self_attn.q_proj
        assert type(q_proj.base_layer).__name__ == "Linear4bit"
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-2)
        return _train(model, ids, opt, check=check), q_proj

    expected, _ = lora_losses("cpu", ids)

    def lora_grads_on_their_gpus(model):
        devices = set()
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and p.grad.device == p.device, name
                devices.add(p.device)
        assert devices == {CUDA0, CUDA1}

    with simulated_gpus(2, memory=MEMORY):
        losses, q_proj = lora_losses(device_map, ids.to("cuda:0"), lora_grads_on_their_gpus)
        assert q_proj.base_layer.weight.device == CUDA1 and q_proj.lora_A["default"].weight.device == CUDA1
    assert torch.allclose(losses, expected), (losses, expected)
    assert losses[-1] < losses[0]
