"""Where the libraries' objects keep their tensors, read without importing the libraries.

Shared by the shims, :func:`devmap_shims.check_devices` and the scenarios: the tensors of a
bitsandbytes quantization state (:mod:`.quant_state`), an 8-bit layer's int8 weights and scales
(:mod:`.int8_state`), which bitsandbytes parameters a model holds and which the release can move
(:mod:`.bnb_params`), accelerate's hooks on a module and the
device they run it on (:mod:`.accelerate_hooks`), where a model's input embeddings compute
(:mod:`.embeddings`), the ``torch.Tensor`` type (:mod:`.tensors`).
Every function imports torch on first use only.
"""
