"""Random ops whose signatures take no generator: on a simulated GPU they draw from that GPU's
default generator (:func:`._sim_generators.drawing_from` lends its state to the CPU's for the
call), so ``torch.cuda.manual_seed`` decides them, as on CUDA.

:data:`NO_GENERATOR_OPS` lists them with, where a call can draw nothing, the arguments that say
so; the calls that draw nothing run without the swap."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from devmap_shims.calls import argument_at

from . import _sim_state as S
from ._sim_generators import default_generator, drawing_from
from ._sim_generic import generic
from ._sim_operands import tensor_operands, torch_functions

#: (names, position of the training switch, position, name and default of the dropout probability):
#: a call told ``training=False`` draws nothing, nor one whose probability is 0, which ATen returns
#: untouched on CUDA as on the CPU (``_dropout_impl``). None: that argument never spares the draw
#: (CUDA's ``native_dropout`` draws even with p == 0). torch's functional forms hand both on by
#: keyword (``multi_head_attention_forward`` its ``dropout_p`` by position); the C bindings take
#: them by position.
NO_GENERATOR_OPS: Tuple[Tuple[Tuple[str, ...], Optional[int], Optional[int], Optional[str], Any], ...] = (
    (("dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "feature_dropout", "feature_dropout_",
      "alpha_dropout", "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_"), 2, 1, "p", 0.5),
    (("native_dropout",), 2, None, None, None),
    (("rrelu", "rrelu_"), 3, None, None, None),
    (("gumbel_softmax",), None, None, None, None),
    (("scaled_dot_product_attention",), None, 4, "dropout_p", 0.0),  # without dropout_p: every forward
    (("multi_head_attention_forward",), 13, 10, "dropout_p", None),
    (("fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
      "fractional_max_pool3d_with_indices"), None, None, None, None),  # their random samples
)


def _rules() -> Dict[Any, Tuple[Optional[int], Optional[int], Optional[str], Any]]:
    rules = {}
    for names, *rule in NO_GENERATOR_OPS:
        for f in torch_functions(*names):
            rules[f] = tuple(rule)
    return rules


RULES = _rules()


def h_no_generator(func: Any, args: Any, kwargs: Any) -> Any:
    """One of :data:`RULES`' ops: on a simulated GPU, a call that draws draws from its generator."""
    ts = tensor_operands(args, kwargs)
    idx = S.sim_index(ts[0]) if ts else None
    if idx is None or not draws(func, args, kwargs):
        return generic(func, args, kwargs)
    return drawing_from(default_generator(idx), generic, func, args, kwargs)


def draws(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether this call draws (else it runs without the swap of generators, 1.5-5 us a call): not
    one told ``training=False`` (every dropout of a model in eval mode), not one whose dropout
    probability is 0 (attention without ``dropout_p``, in every forward). Where in doubt, it draws."""
    rule = RULES.get(func)
    if rule is None:
        return True
    training_at, p_at, p_name, p_default = rule
    if training_at is not None and argument_at(args, kwargs, training_at, "training", "train") is False:
        return False
    if p_at is None:
        return True
    p = argument_at(args, kwargs, p_at, p_name)
    p = p_default if p is None else p
    return not (isinstance(p, (int, float)) and p == 0)
