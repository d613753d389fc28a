"""The talker's steps with each layer's width-independent work under torch.compile (``compile: talker``).

A Qwen3-Omni talker step is about 85 kernels a layer, most of them small elementwise and
reduction ones (three RMSNorms, the rotary embedding, the MoE block's routing and sums), each a
few microseconds even replayed from a CUDA graph: at one utterance the step is bound by their
count, not by the weights it reads. Compiling the whole step would take a variant per batch size
and attention width (the captured ladder is dozens of them, minutes a load). Only the KV cache's
write and the attention read the width, so each layer's step is split in three here:

- before attention (the input norm, the q/k/v projections, the q/k norms, the rotary embedding),
  compiled;
- the cache write and the attention, as transformers runs them;
- after attention (the output projection, the residual, the norm, the MoE block, the residual),
  compiled.

A step of one row runs its six chosen experts as reductions over their weights, each projection
a product with the row summed over its width (``_chosen_experts``), which inductor compiles into
one kernel that reads each chosen expert's weights where they are. transformers' ``grouped_mm``
first sorts, counts and scatters the rows by expert, small kernels inductor cannot fuse, and its
``batched_mm`` copies the chosen experts' weights before its matmuls (the copies written and read
again). With more rows a reduction would read an expert's weights once per row that chose it (at
64 rows most of the 128 experts, several times each), so those steps keep the grouped matmuls.

The layers share each compiled region (PyTorch's regional compilation: a module's parameters are
the compiled code's inputs, not its constants), so a load compiles the two regions once per batch
size shape, whatever the widths and however many layers. Only the steps of ``TalkerSteps`` built
with ``compile`` run the regions (``active``); every other pass of the model (prefills, the eager
reference steps) runs transformers' layer as it is.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

from triton_omni.speech.attention import attend, queries_keys_values
from triton_omni.speech.predictor_graphs import own_code

# a step of at most this many rows runs its experts as reductions over their weights (``_chosen_experts``)
FEW_ROWS = 1


class CompiledRegions:
    """The talker model's decoder layers, each running its two compiled regions while ``running``
    on the thread that runs them (any other thread's passes run transformers' layers meanwhile)."""

    _wrapping = threading.Lock()

    def __init__(self, talker):
        self._thread = threading.local()
        self.before = torch.compile(own_code(_before_attention))
        self.after = torch.compile(own_code(_after_attention))
        for layer in talker.model.layers:
            layer.forward = functools.partial(self._layer, layer, layer.forward)

    @classmethod
    def of(cls, talker) -> CompiledRegions:
        """The talker's regions, made at its first compiled steps (its layers are wrapped once)."""
        with cls._wrapping:
            if getattr(talker, "_compiled_regions", None) is None:
                talker._compiled_regions = cls(talker)
            return talker._compiled_regions

    @contextlib.contextmanager
    def running(self):
        """The layers' passes inside it, on this thread, run the compiled regions."""
        self._thread.active = True
        try:
            yield
        finally:
            self._thread.active = False

    def _layer(self, layer, transformers_forward, hidden_states, attention_mask=None, position_ids=None,
               past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
        if not getattr(self._thread, "active", False):
            return transformers_forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                        past_key_values=past_key_values, use_cache=use_cache,
                                        position_embeddings=position_embeddings, **kwargs)
        query, key, value = self.before(layer, hidden_states, *position_embeddings)
        attended, _ = attend(layer.self_attn, query, key, value, attention_mask, past_key_values,
                             position_ids=position_ids, use_cache=use_cache, **kwargs)
        return self.after(layer, hidden_states, attended)


def _before_attention(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The layer's queries, keys and values of ``hidden`` [rows, positions, width], rotated
    (transformers' decoder layer and attention up to the cache's update; its q/k/v one projection
    with ``fuse_projections``)."""
    query, key, value = queries_keys_values(layer.self_attn, layer.input_layernorm(hidden))
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    return query, key, value


def _after_attention(layer, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The layer's output from its input ``residual`` and its attention's ``attended`` (transformers'
    decoder layer after the attention interface)."""
    hidden = residual + layer.self_attn.o_proj(attended.reshape(*residual.shape[:-1], -1).contiguous())
    return hidden + _moe(layer.mlp, layer.post_attention_layernorm(hidden))


def _moe(block, hidden: torch.Tensor) -> torch.Tensor:
    """The sparse MoE block's output (transformers' ``forward``), its router called past its module's
    hooks: the model records the router's logits through one, which reads a ``ContextVar``, and
    dynamo breaks the region there. At most ``FEW_ROWS`` rows, the experts run as
    ``_chosen_experts`` (whatever the model's ``experts_implementation``)."""
    rows = hidden.view(-1, hidden.shape[-1])
    shared = block.shared_expert(rows)
    _, weights, experts = block.gate.forward(rows)
    few = rows.shape[0] <= FEW_ROWS
    routed = _chosen_experts(block.experts, rows, experts, weights) if few else block.experts(rows, experts, weights)
    out = routed + torch.sigmoid(block.shared_expert_gate(rows)) * shared
    return out.view(hidden.shape)


def _chosen_experts(experts, rows: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The ``experts`` module's output for ``rows`` [rows, width], each row through its ``chosen``
    experts [rows, k] weighted by ``weights`` [rows, k]: each projection a product of the chosen
    experts' weights (``gate_up_proj`` [experts, 2 x inner, width], ``down_proj`` [experts, width,
    inner], as the Qwen3-Omni talker's experts hold them) with the row, summed over its width, which
    inductor fuses, gather included, into one reduction a projection."""
    k = chosen.shape[-1]
    picked = chosen.reshape(-1)
    inputs = rows.repeat_interleave(k, dim=0)  # [rows x k, width]: each row once per expert it chose
    inner = experts._apply_gate((experts.gate_up_proj[picked] * inputs[:, None, :]).sum(-1))
    out = (experts.down_proj[picked] * inner[:, None, :]).sum(-1) * weights.reshape(-1, 1)
    return out.view(*chosen.shape, -1).sum(1).to(rows.dtype)
