"""nn.DataParallel and custom autograd Functions on simulated GPUs, as on CUDA.

DataParallel scatters its input over the GPUs, replicates the module, runs the replicas in threads
of their own and gathers the outputs: its collectives are kernels of their own and its workers
threads, both outside a simulation before. ``transformers.Trainer`` on two GPUs without a
launcher wraps the model in it. A custom Function's backward gets its gradients on the devices of
its outputs.
"""

from __future__ import annotations

import copy
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

if torch.version.cuda is None:
    pytest.skip("simulated GPUs need a CUDA build of torch", allow_module_level=True)

from devmap_shims.testing import real_cpu_tensor, simulated_gpus  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("input_on", ["cuda:0", "cpu"])
def test_data_parallel_runs_a_replica_on_each_gpu_and_gives_the_cpus_results(input_on):
    ref = _mlp()
    x = torch.randn(6, 8)
    expected = ref(x)
    expected.sum().backward()
    seen = []
    with simulated_gpus(2, memory="1GiB") as m:
        model = copy.deepcopy(ref).to("cuda:0")
        model.zero_grad()
        model[0].register_forward_hook(lambda mod, args, out: seen.append((args[0].device, out.device)))
        parallel = torch.nn.DataParallel(model, device_ids=[0, 1])
        out = parallel(x.to(input_on))
        assert out.device == CUDA0 and m.max_allocated(1) > 0
        assert sorted(seen, key=str) == [(CUDA0, CUDA0), (CUDA1, CUDA1)]
        out.sum().backward()
        assert model[0].weight.grad.device == CUDA0
        assert torch.allclose(real_cpu_tensor(out), expected, atol=1e-6)
        assert torch.allclose(real_cpu_tensor(model[0].weight.grad), ref[0].weight.grad, atol=1e-6)


def test_data_parallels_replicas_draw_each_from_its_own_gpus_generator():
    """Both GPUs seeded alike: each replica's dropout draws from its GPU's generator, so the two
    halves of the batch get the same masks. The replicas' threads share the one CPU generator the
    draws go through; switching threads as often as possible makes their swaps meet."""
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            with simulated_gpus(2, memory="1GiB"):
                model = torch.nn.Sequential(*[torch.nn.Dropout(0.5) for _ in range(20)]).to("cuda:0")
                torch.cuda.manual_seed_all(0)
                out = real_cpu_tensor(torch.nn.DataParallel(model, device_ids=[0, 1])(torch.ones(64, 4096)))
                assert torch.equal(out[:32], out[32:])
    finally:
        sys.setswitchinterval(interval)


def test_the_collectives_place_what_they_return_as_torch_documents():
    from torch.nn.parallel import comm

    with simulated_gpus(2):
        t = torch.arange(6.0, device="cuda:0")
        first, second = comm.broadcast(t, devices=[0, 1])
        assert first is t and second.device == CUDA1
        assert torch.equal(real_cpu_tensor(second), real_cpu_tensor(t))
        chunks = comm.scatter(torch.arange(6.0), devices=[0, 1], chunk_sizes=[4, 2])
        assert [(c.device, c.shape[0]) for c in chunks] == [(CUDA0, 4), (CUDA1, 2)]
        gathered = comm.gather(chunks, destination="cpu")
        assert gathered.device.type == "cpu" and torch.equal(gathered, torch.arange(6.0))
        halves = [torch.ones(2**18, device="cuda:0"), torch.ones(2**18, device="cuda:1")]
        torch.cuda.reset_peak_memory_stats(0)
        held = torch.cuda.memory_allocated(0)
        assert comm.gather(halves, destination=0).device == CUDA0
        assert torch.cuda.max_memory_allocated(0) - held == 2 * 2**20  # the result only, as CUDA
        ones = [torch.ones(3, device="cuda:0"), torch.ones(3, device="cuda:1")]
        total = comm.reduce_add(ones, destination=1)
        assert total.device == CUDA1 and torch.equal(real_cpu_tensor(total), torch.full((3,), 2.0))


def test_trainer_on_two_gpus_trains_through_data_parallel():
    """transformers' Trainer sees two GPUs, no launcher: it wraps the model in nn.DataParallel."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 6))
    rows = [{"input_ids": i, "labels": i} for i in ids]
    with simulated_gpus(2, memory="2GiB") as m, tempfile.TemporaryDirectory() as out:
        model = transformers.LlamaForCausalLM(config)
        args = transformers.TrainingArguments(out, per_device_train_batch_size=2, max_steps=2, report_to=[],
                                              save_strategy="no", disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        assert args.n_gpu == 2
        result = trainer.train()
        assert result.training_loss > 0 and next(model.parameters()).device == CUDA0
        assert m.max_allocated(1) > 0  # a replica ran on the second GPU


class _Double(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Double.seen.append(grad.device)
        return grad * 2


def test_a_custom_functions_backward_gets_its_gradient_on_its_outputs_gpu():
    _Double.seen.clear()
    with simulated_gpus(2):
        x = torch.ones(3, device="cuda:1", requires_grad=True)
        _Double.apply(x).sum().backward()  # the gradient the engine makes for sum()
        (_Double.apply(x) * torch.ones(3, device="cuda:1")).sum().backward()
        assert x.grad.device == CUDA1
    assert _Double.seen == [CUDA1, CUDA1]
