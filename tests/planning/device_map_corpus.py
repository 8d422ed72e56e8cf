"""Device-map corpus: published model configs x GPU topology x quantization x strategy.

Configs are typed from the models' published ``config.json`` values (no Hub access); only the
fields that decide parameter shapes are given, the rest are the architecture's defaults. Shared by
tests/planning/test_corpus.py and benchmarks/bench_device_map.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

GiB = 2**30

MODELS: Dict[str, Dict[str, Any]] = {
    # google/gemma-2-27b: 256k vocab, tied embeddings kept unquantized (2.2 GiB in bf16)
    "gemma-2-27b": dict(
        model_type="gemma2", vocab_size=256000, hidden_size=4608, intermediate_size=36864,
        num_hidden_layers=46, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
        tie_word_embeddings=True,
    ),
    # google/gemma-7b: the same 256k tied vocabulary, on every transformers since 4.38
    "gemma-7b": dict(
        model_type="gemma", vocab_size=256000, hidden_size=3072, intermediate_size=24576,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16, head_dim=256,
        tie_word_embeddings=True,
    ),
    "gemma-2-9b": dict(
        model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
        num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        tie_word_embeddings=True,
    ),
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    ),
    "llama-3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "llama-3-70b": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rope_theta=500000.0, tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    "qwen2.5-72b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Case:
    model: str
    gpus: int
    gpu_gib: float
    quantization: str = "4bit"
    strategy: str = "auto"
    cpu_gib: float = 180
    #: user max_memory for some GPUs (GiB), on top of the topology
    caps: Tuple[Tuple[int, float], ...] = ()
    #: why the 1.10 balance target is not the right yardstick for this case, if it is not
    ratio_exemption: Optional[str] = None
    tags: Tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        caps = "-caps" + "_".join(f"{g}:{v:g}" for g, v in self.caps) if self.caps else ""
        return f"{self.model}-{self.quantization}-{self.gpus}x{self.gpu_gib:g}GiB-{self.strategy}{caps}"

    def max_memory(self) -> Dict[Any, int]:
        mm: Dict[Any, int] = {i: int(self.gpu_gib * GiB) for i in range(self.gpus)}
        for gpu, gib in self.caps:
            mm[gpu] = int(gib * GiB)
        mm["cpu"] = int(self.cpu_gib * GiB)
        return mm


CASES = (
    Case("gemma-2-27b", 8, 23, tags=("headline",)),
    Case("gemma-2-27b", 7, 23),
    Case("gemma-2-27b", 8, 23, quantization="none"),
    Case("gemma-2-27b", 8, 23, strategy="balanced"),
    Case("gemma-2-27b", 8, 23, strategy="balanced_low_0"),
    Case("gemma-2-27b", 8, 23, quantization="8bit"),
    Case("gemma-2-27b", 8, 23, caps=tuple((g, 3) for g in range(8))),
    # GPU 0 capped below the 2.2 GiB embedding that must come first: it has to stay empty
    Case("gemma-2-27b", 8, 23, caps=((0, 1),)),
    Case("gemma-2-9b", 4, 16),
    Case("gemma-7b", 8, 23, tags=("headline",)),
    Case("mistral-7b", 8, 23),
    Case("mistral-7b", 4, 24, quantization="none"),
    Case("llama-3-8b", 8, 23),
    Case("llama-3-8b", 2, 24, quantization="none"),
    Case("llama-3-8b", 4, 8, strategy="balanced_low_0"),
    Case("llama-3-70b", 8, 23),
    Case("llama-3-70b", 8, 80, quantization="none", tags=("bench",)),
    Case("llama-3-70b", 4, 80, quantization="none", strategy="balanced_low_0"),
    Case(
        "llama-3-70b", 4, 24, quantization="none",
        ratio_exemption="131 GiB of bf16 weights on 4x24 GiB GPUs: the model must be offloaded, so every GPU is "
        "filled to its budget (GPU 0 keeps room for the largest offloaded block) instead of balanced",
        tags=("offload",),
    ),
    Case("llama-3.2-1b", 4, 2),
    Case("qwen2.5-0.5b", 8, 23),
    Case("qwen2.5-7b", 8, 23),
    Case("qwen2.5-7b", 3, 24, quantization="none"),
    Case("qwen2.5-72b", 4, 24),
    Case("qwen2.5-72b", 8, 80, quantization="none", strategy="balanced"),
    Case("qwen2.5-72b", 8, 23, quantization="8bit"),
    Case("llama-3-70b", 8, 23, caps=tuple((g, 6) for g in range(8))),
)


class ArchitectureMissing(LookupError):
    """The installed transformers predates the model's architecture."""


def config_for(model: str) -> Any:
    """A transformers config object built from the published values (fresh each call)."""
    import transformers
    from transformers import AutoConfig

    fields = dict(MODELS[model])
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        if "Unrecognized model identifier" in str(exc):
            raise ArchitectureMissing(f"transformers {transformers.__version__} has no {model_type}") from None
        raise
