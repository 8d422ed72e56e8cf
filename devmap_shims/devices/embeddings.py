"""Where a transformers model's input embeddings compute, read without importing transformers.

Shared by the shims that move a model's inputs to its token embeddings (``generate`` and the
vision-language ``forward``s).
"""

from __future__ import annotations

import weakref

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Any

from devmap_shims.devices.accelerate_hooks import execution_device
from devmap_shims.devices.tensors import tensor_type


def _input_embeddings(model: Any) -> Any:
    getter = getattr(model, "get_input_embeddings", None)
    if getter is None:
        return None
    try:
        return getter()
    except Exception:  # NotImplementedError on models without input embeddings
        return None


def _remembered_embeddings(model: Any, known: Any) -> Any:
    """``model.get_input_embeddings()``, remembered in ``known`` (model -> (parent, name, embedding),
    the first and last held weakly) for as long as ``parent._modules[name]`` still is that embedding.

    transformers 4.5x resolves ``get_input_embeddings`` through several attribute lookups (about
    18 us a call); the check of the remembered entry is one dict lookup. ``set_input_embeddings``
    and ``resize_token_embeddings`` replace the module in its parent, which drops the entry. The
    entry holds nothing strongly: where the parent is the model itself (T5's ``shared``), a strong
    reference would keep the model, its own key, alive for ever.
    """
    try:
        entry = known.get(model)
    except TypeError:  # not weak-referenceable or not hashable: ask every time
        return _input_embeddings(model)
    if entry is not None:
        parent, name, embedding = entry[0](), entry[1], entry[2]()
        if parent is not None and embedding is not None and parent._modules.get(name) is embedding:
            return embedding
    embedding = _input_embeddings(model)
    modules = getattr(model, "modules", None)
    if embedding is None or not callable(modules):
        return embedding
    for parent in modules():
        for name, child in parent._modules.items():
            if child is embedding:
                try:
                    known[model] = (weakref.ref(parent), name, weakref.ref(embedding))
                except TypeError:  # a module that cannot be referenced weakly: not remembered
                    pass
                return embedding
    return embedding


def input_embedding_device(model: Any, known: Any = None) -> Any:
    """Where ``model``'s input embeddings compute, or None when it cannot be told. ``known``: a
    ``WeakKeyDictionary`` that remembers where each model keeps its input embeddings."""
    embedding = _input_embeddings(model) if known is None else _remembered_embeddings(model, known)
    if embedding is None:
        return None
    own = getattr(embedding, "_parameters", None)  # a torch Module's: a dict read, not Module.__getattr__
    weight = own.get("weight") if isinstance(own, dict) else getattr(embedding, "weight", None)
    if not isinstance(weight, tensor_type()):
        parameters = getattr(embedding, "parameters", None)
        weight = next(iter(parameters()), None) if callable(parameters) else None
        if weight is None:
            return None
    device = weight.device
    if device.type == "meta":
        return execution_device(embedding)
    return device
