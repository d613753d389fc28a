"""How the CUDA graphs (cuda_graphs.py) key a denoiser's call: its tensors by shape, the rest by
value; a float (a graph per value) is never graphed. The graphs themselves need a GPU
(tests/gpu/test_cuda_graphs.py, tests/gpu/test_dit_graphs.py)."""

from __future__ import annotations

import torch
from triton_omni.diffusion.cuda_graphs import _Call


def call(rows: int = 1, img_shapes=((1, 32, 32),), **extra) -> _Call:
    kwargs = {"hidden_states": torch.zeros(rows, 16, 4), "timestep": torch.zeros(rows),
              "encoder_hidden_states": [torch.zeros(7, 8)] * rows, "img_shapes": [list(img_shapes)] * rows,
              "guidance": None, "return_dict": False} | extra
    return _Call((), kwargs)


def test_a_call_is_keyed_by_its_tensors_shapes_and_its_other_values():
    assert call().key == call().key
    assert call(rows=2).key != call().key
    assert call(img_shapes=((1, 16, 64),)).key != call().key  # same tensors, another layout
    assert len(call(rows=2).tensors) == 4


class Unhashable:
    __hash__ = None


def test_a_float_or_an_unhashable_argument_is_never_graphed():
    assert call().graphable
    assert not call(guidance=3.5).graphable
    assert not call(attention_kwargs=Unhashable()).graphable


def test_the_call_takes_new_tensors_in_its_tensors_places():
    c = call()
    fresh = [torch.ones_like(t) for t in c.tensors]
    args, kwargs = c.with_tensors(fresh)
    assert args == () and kwargs["hidden_states"] is fresh[0] and kwargs["encoder_hidden_states"][0] is fresh[2]
    assert kwargs["img_shapes"] == [[(1, 32, 32)]] and kwargs["return_dict"] is False
