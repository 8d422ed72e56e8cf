"""Tiny random causal LMs (Llama, Qwen2, Qwen3, Gemma2, Mistral) and helpers to run them.

Each model is built from a config written in code (hidden size 64, 2 layers, vocabulary 256)
with seeded random weights; :func:`save_tiny_causal_lm` writes one as a safetensors checkpoint
that ``from_pretrained`` loads offline.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .seeding import reinit_weights, seeded

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel


#: Every causal-LM architecture the builders know, in a stable order.
ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma2", "mistral")

# arch -> (config class, model class) names in the top-level transformers namespace.
_ARCH_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

TINY_VOCAB = 256
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_FIRST_ORDINARY_ID = 3

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

# What makes each architecture itself: bias terms (Qwen2), q/k norms and explicit
# head_dim (Qwen3), logit soft-capping, sliding window and tied head (Gemma2),
# sliding window (Mistral). Tied embeddings follow each family's small checkpoints.
_ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 16, "tie_word_embeddings": True},
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 64,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "mistral": {"sliding_window": 64, "tie_word_embeddings": False},
}


class UnsupportedArchError(RuntimeError):
    """The installed transformers has no model class for the requested architecture."""

# --------------------------------------------------------------------------- archs

def _arch_classes(arch: str) -> tuple[type, type]:
    """Config and model classes for ``arch``, or :class:`UnsupportedArchError` saying why not."""
    return classes_named(_ARCH_CLASSES, arch)


def classes_named(table: dict[str, tuple[str, str]], arch: str) -> tuple[type, type]:
    """The transformers config and model classes ``table`` names for ``arch`` (``{arch: (config
    class name, model class name)}``), or :class:`UnsupportedArchError` saying why not."""
    if arch not in table:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(table)}")
    import transformers

    config_name, model_name = table[arch]
    try:
        return getattr(transformers, config_name), getattr(transformers, model_name)
    except AttributeError:
        raise UnsupportedArchError(
            f"{arch}: transformers {transformers.__version__} has no {model_name} "
            f"(it arrived in a later release); upgrade transformers to build this model"
        ) from None


def supported_archs() -> tuple[str, ...]:
    """The architectures of :data:`ARCHS` that the installed transformers can build."""
    return tuple(a for a in ARCHS if a not in unsupported_archs())


def unsupported_archs() -> dict[str, str]:
    """Architectures the installed transformers cannot build, each with the reason (for skips)."""
    missing: dict[str, str] = {}
    for arch in ARCHS:
        try:
            _arch_classes(arch)
        except UnsupportedArchError as exc:
            missing[arch] = str(exc)
    return missing


# --------------------------------------------------------------------------- configs


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``arch`` (hidden 64, 4 heads, 2 KV heads, vocab 256, 2 layers).

    ``overrides`` are config attributes (``num_hidden_layers=4``, ``tie_word_embeddings=False``...).
    """
    config_cls, _ = _arch_classes(arch)
    kwargs = {**_COMMON, **_ARCH_OVERRIDES[arch], **overrides}
    return config_cls(**kwargs)

# --------------------------------------------------------------------------- causal LMs


def _arch_seed(arch: str, seed: int) -> int:
    """Weight seed per (arch, seed): Llama and Mistral share a layout but not their weights."""
    return seed * 101 + ARCHS.index(arch)


def _randomize_final_norm(model: torch.nn.Module, seed: int, *, gemma_offset: bool) -> None:
    """Give the last RMSNorm zero-mean random gains.

    With a tied head, logits are ``E @ (g * norm(h))`` and ``h`` is dominated by the current
    token's own embedding, so with ``g == 1`` the current token always scores highest and
    greedy decoding repeats it forever. Zero-mean gains remove that self-preference; the
    next token becomes a varied function of the context, as in an untied model.
    Gemma's RMSNorm multiplies by ``1 + weight``, hence the offset.
    """
    norm = getattr(model.base_model, "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        return
    gen = torch.Generator().manual_seed(seed + 7)
    gains = torch.randn(norm.weight.shape, generator=gen, dtype=torch.float32)
    with torch.no_grad():
        norm.weight.copy_((gains - 1.0 if gemma_offset else gains).to(norm.weight.dtype))


def tiny_causal_lm(
    arch: str,
    *,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A tiny random ``*ForCausalLM`` of ``arch`` on the CPU, in eval mode.

    The same ``arch``, ``num_layers``, ``seed`` and overrides give bit-identical weights.
    Raises :class:`UnsupportedArchError` when the installed transformers lacks ``arch``.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, num_hidden_layers=num_layers, **config_overrides)
    with seeded(seed):
        model = AutoModelForCausalLM.from_config(config)
    weight_seed = _arch_seed(arch, seed)
    # A tied table is also the output head: keep it small next to the layers' outputs so
    # the current token does not dominate its own logits (fewer greedy fixed points).
    # Gemma scales its input embeddings by sqrt(hidden_size); draw them smaller by as much.
    embedding_std = 0.25 if config.tie_word_embeddings else 1.0
    if arch == "gemma2":
        embedding_std *= config.hidden_size**-0.5
    reinit_weights(model, weight_seed, embedding_std=embedding_std)
    _randomize_final_norm(model, weight_seed, gemma_offset=arch == "gemma2")
    model.to(dtype)
    model.eval()
    return model


def _save_kwargs(save_pretrained: Any) -> dict[str, Any]:
    """Ask for safetensors where ``save_pretrained`` still has the switch (4.x); 5.x always uses it."""
    params = inspect.signature(save_pretrained).parameters
    return {"safe_serialization": True} if "safe_serialization" in params else {}


def dtype_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    """The keyword that gives ``from_pretrained`` / ``from_config`` a dtype: ``torch_dtype`` on
    transformers 4, ``dtype`` on 5, which renamed it."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def save_tiny_causal_lm(arch: str, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Build :func:`tiny_causal_lm` ``(arch, **kwargs)`` and save it (safetensors) to ``path``.

    ``AutoModelForCausalLM.from_pretrained(path, device_map=...)`` then loads it offline.
    Returns ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    model = tiny_causal_lm(arch, **kwargs)
    model.save_pretrained(path, **_save_kwargs(model.save_pretrained))
    return path


def sample_input_ids(
    batch: int = 1, length: int = 8, vocab: int = TINY_VOCAB, seed: int = 0
) -> torch.Tensor:
    """``[batch, length]`` int64 token ids on the CPU, drawn from ordinary (non-special) ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(_FIRST_ORDINARY_ID, vocab, (batch, length), generator=gen, dtype=torch.long)


def greedy_generate(model: Any, input_ids: torch.Tensor, max_new_tokens: int = 16) -> torch.Tensor:
    """Exactly ``max_new_tokens`` greedy tokens per row (EOS suppressed), returned on the CPU.

    ``input_ids`` go in as given (put them on the model's first device yourself when
    the scenario needs it); only the new tokens come back.
    """
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=PAD_ID,
        )
    return out[:, input_ids.shape[1] :].cpu()


# embedding + first layer on cuda:0, the rest (and the untied head) on cuda:1
_TWO_GPU_SPLIT = {
    "model.embed_tokens": 0,
    "model.layers.0": 0,
    "model.layers.1": 1,
    "model.norm": 1,
    "model.rotary_emb": 1,
    "lm_head": 1,
}


def two_gpu_split(model: torch.nn.Module) -> dict[str, int]:
    """A device map splitting a tiny two-layer Llama-style model over two GPUs (embedding and first
    layer on 0, the rest on 1), with only the modules ``model`` has: ``model.rotary_emb`` appeared
    in transformers 4.45."""
    names = {name for name, _ in model.named_modules()}
    return {key: gpu for key, gpu in _TWO_GPU_SPLIT.items() if key in names}
