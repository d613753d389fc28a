"""A Qwen3-Omni talker's and code predictor's projections fused (the model parameter ``fuse_projections``).

At one utterance a speech step is bound by how many kernels it launches, not by the weights it
reads (``benchmarks/speech_step.py`` splits it). The code predictor runs its five layers for each
of a frame's fifteen codes, seven matmuls a layer; the talker runs twenty layers a step. Here each
attention's query, key and value projections become one linear layer, and each dense MLP's gate
and up projections another (the code predictor's MLPs, the talker's shared experts): the
predictor's layer runs four matmuls in place of seven (225 fewer a frame), the talker's layer
three fewer. The weights are the same ones, concatenated, so the outputs are the unfused layers'
up to the matmuls' rounding (a wider matmul may run another kernel).

The attention's own forward (``_fused_attention``) is transformers' with the one projection, from
the pieces in ``attention.py``.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qwen3_omni
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

from triton_omni.speech.attention import attend, queries_keys_values

# the talker's attention is the thinker's class; its shared expert is the talker's dense MLP
_ATTENTIONS = (qwen3_omni.Qwen3OmniMoeThinkerTextAttention, qwen3_omni.Qwen3OmniMoeTalkerCodePredictorAttention)
_MLPS = (qwen3_omni.Qwen3OmniMoeMLP, qwen3_omni.Qwen3OmniMoeTalkerTextMLP)


class FusedMLP(torch.nn.Module):
    """A dense MLP (``down(act(gate(x)) * up(x))``) whose gate and up projections are one linear layer."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.gate_up_proj = joined(mlp.gate_proj, mlp.up_proj)
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_projections(model: torch.nn.Module, parts: tuple[str, ...] = ("predictor", "talker")) -> Callable[[], None]:
    """Every Qwen3-Omni attention's q/k/v and every dense MLP's gate/up in the talker ``model``'s
    ``parts`` (``"talker"``: its own layers, ``"predictor"``: its code predictor's) fused, in place;
    returns what puts the unfused layers back (the benchmark measures both on one model's weights)."""
    undo: list[Callable[[], None]] = []
    predictor = list(model.code_predictor.modules())
    inside = {id(m) for m in predictor}
    modules = {"predictor": predictor, "talker": [m for m in model.modules() if id(m) not in inside]}
    for module in (m for part in parts for m in modules[part]):
        if isinstance(module, _ATTENTIONS):
            undo.append(_fuse_attention(module))
        for name, child in list(module.named_children()):
            if isinstance(child, _MLPS):
                setattr(module, name, FusedMLP(child))
                undo.append(lambda module=module, name=name, child=child: setattr(module, name, child))
    if not undo:
        raise ValueError("fuse_projections: the model has no Qwen3-Omni attention or MLP to fuse")

    def unfuse() -> None:
        for step in reversed(undo):
            step()

    return unfuse


def joined(*linears: torch.nn.Linear) -> torch.nn.Linear:
    """One linear layer whose outputs are ``linears``' outputs side by side."""
    weight = linears[0].weight
    fused = torch.nn.Linear(weight.shape[1], sum(linear.out_features for linear in linears),
                            bias=linears[0].bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([linear.weight for linear in linears]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([linear.bias for linear in linears]))
    return fused.requires_grad_(False)


def _fuse_attention(attention) -> Callable[[], None]:
    projections = attention.q_proj, attention.k_proj, attention.v_proj
    attention.qkv_proj = joined(*projections)
    attention.qkv_widths = tuple(p.out_features for p in projections)
    del attention.q_proj, attention.k_proj, attention.v_proj
    attention.forward = types.MethodType(_fused_attention, attention)

    def unfuse() -> None:
        del attention.qkv_proj, attention.qkv_widths, attention.forward
        attention.q_proj, attention.k_proj, attention.v_proj = projections

    return unfuse


def _fused_attention(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                     attention_mask, past_key_values=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Transformers' attention forward, its q/k/v one projection."""
    query, key, value = queries_keys_values(self, hidden_states)
    query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
    attended, weights = attend(self, query, key, value, attention_mask, past_key_values, **kwargs)
    return self.o_proj(attended.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights
