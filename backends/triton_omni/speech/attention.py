"""A Qwen3-Omni talker's and code predictor's attention in pieces, as this project's passes run it.

Transformers' attention projects, norms and rotates the queries and keys, writes the cache, then
calls its attention interface; with a mask, SDPA's interface first copies each key head's keys
and values once for every query head that shares it (``repeat_kv``: the talker's key heads are
each read by eight query heads, and at a long utterance its step then copies megabytes a layer).
A pass reading one position at a time (a talker step, a code predictor draw) needs no copy: the
query heads of a key head become that head's query positions (``folded_attention``), all
with the one position's mask, and SDPA reads each key once. The compiled regions of ``compile:
talker`` (``talker_regions.py``), the fused attention (``fused_projections.py``) and the code
predictor's frame (``predictor_graphs.py``) run these pieces.
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import eager_attention_forward


def queries_keys_values(attention, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention's normed queries and keys and its values of ``hidden`` [rows, positions, width],
    each [rows, heads, positions, head_dim], before the rotary embedding (transformers' attention),
    through its fused projection where it has one."""
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    fused = getattr(attention, "qkv_proj", None)  # (``fuse_projections``' own attribute)
    if fused is not None:
        query, key, value = fused(hidden).split(attention.qkv_widths, dim=-1)
    else:
        query, key, value = attention.q_proj(hidden), attention.k_proj(hidden), attention.v_proj(hidden)
    return (attention.q_norm(query.view(shape)).transpose(1, 2), attention.k_norm(key.view(shape)).transpose(1, 2),
            value.view(shape).transpose(1, 2))


def attend(attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, past_key_values,
           **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention's output before its output projection, [rows, positions, heads x head_dim] or
    [rows, positions, heads, head_dim], and its weights: the cache written, then transformers'
    attention interface (transformers' attention); a pass of one position under SDPA with a mask
    that reads every query head alike ([rows, 1, 1, columns]), folded (``folded_attention``)."""
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, attention.layer_idx)
    one_row_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))
    if query.shape[2] == 1 and attention.config._attn_implementation == "sdpa" and one_row_mask and \
            not attention.training:
        return folded_attention(query, key, value, attention_mask, attention.scaling), None
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, eager_attention_forward)
    return interface(attention, query, key, value, attention_mask,
                     dropout=0.0 if not attention.training else attention.attention_dropout,
                     scaling=attention.scaling, sliding_window=attention.sliding_window, **kwargs)


def folded_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Grouped-query attention of ``query`` [rows, heads, n, head_dim] over ``keys`` and ``values``
    [rows, key heads, columns, head_dim], as [rows, n, heads x head_dim]: each key head's query heads
    folded into its query positions (transformers' ``repeat_kv`` gives query head h the key head
    h // shared), so SDPA reads each key once; ``mask`` is ``folded_mask``'s."""
    rows, heads, n, head_dim = query.shape
    key_heads = keys.shape[1]
    folded = query.reshape(rows, key_heads, heads // key_heads * n, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, n, head_dim).transpose(1, 2).reshape(rows, n, heads * head_dim)


def folded_mask(positions: torch.Tensor, columns: int, shared: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [1, 1, shared x n, columns] of ``folded_attention`` for queries at
    ``positions`` (n of them, ``shared`` query heads a key head): each sees the columns up to its own."""
    seen = torch.arange(columns, device=positions.device)[None, :] <= positions[:, None]  # [n, columns]
    additive = torch.zeros(seen.shape, dtype=dtype, device=positions.device).masked_fill(~seen, float("-inf"))
    return additive.repeat(shared, 1)[None, None]
