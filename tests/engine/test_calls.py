"""devmap_shims.calls: a call's arguments by name, for the signatures wrappers meet."""

from __future__ import annotations

import functools

import pytest

from devmap_shims.calls import argument, bind, positions, with_argument


def test_closures_of_one_factory_keep_their_own_defaults():
    # they share a code object, and so a cache key: the defaults are each function's own
    def make(default):
        def load(model, device=default):
            return model, device

        return load

    first, second = make("cuda:0"), make("cuda:1")
    assert bind(first, ("m",), {})["device"] == "cuda:0"
    assert bind(second, ("m",), {})["device"] == "cuda:1"
    second.__defaults__ = ("cuda:2",)  # set after the first bind
    assert bind(second, ("m",), {})["device"] == "cuda:2" == second("m")[1]


def test_a_keyword_only_default_changed_in_place_is_read_again():
    # __kwdefaults__ is a dict: a change in place keeps its identity
    def load(model, *, device="cuda:0"):
        return model, device

    assert bind(load, ("m",), {})["device"] == "cuda:0"
    load.__kwdefaults__["device"] = "cuda:1"
    assert bind(load, ("m",), {})["device"] == "cuda:1" == load("m")[1]

    class Ambiguous:  # as a tensor of several elements: == gives no plain truth
        def __eq__(self, other):
            raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")

        __hash__ = object.__hash__

    load.__kwdefaults__["device"] = default = Ambiguous()
    assert bind(load, ("m",), {})["device"] is default


def test_a_wrapper_of_a_bound_method_is_read_as_bound():
    # accelerate's hooked forward: update_wrapper(partial(new_forward, module), module.forward)
    class Model:
        def forward(self, input_ids, pixel_values=None):
            return input_ids, pixel_values

    model = Model()
    def new_forward(module, *args, **kwargs):
        return model.forward(*args, **kwargs)

    hooked = functools.update_wrapper(functools.partial(new_forward, model), model.forward)
    assert positions(Model.forward) == {"self": 0, "input_ids": 1, "pixel_values": 2}  # read first
    assert positions(hooked) == {"input_ids": 0, "pixel_values": 1}
    assert argument(hooked, "pixel_values", ("ids", "px"), {}) == (True, "px")
    assert hooked("ids", "px")[1] == "px"


def test_a_keyword_named_as_a_positional_only_parameter_is_not_it():
    def load(model, /, **options):
        return model, options

    args, kwargs = ("M",), {"model": "K"}
    assert argument(load, "model", args, kwargs) == (True, "M") == (True, load(*args, **kwargs)[0])
    args, kwargs = with_argument(load, "model", "NEW", args, kwargs)
    assert load(*args, **kwargs) == ("NEW", {"model": "K"})

    def move(x, device=None, /):
        return x, device

    args, kwargs = with_argument(move, "device", "cuda:1", ("x",), {})
    assert move(*args, **kwargs) == ("x", "cuda:1")

    def strict(x, y, /, z=None):
        return x, y, z

    with pytest.raises(TypeError, match="positional-only"):
        with_argument(strict, "y", 1, (), {})
