"""``folded_attention`` (speech/attention.py) at shapes the tiny demos lack (one key head there):
several key heads, each shared by several query heads, one and two query positions, against
transformers' SDPA interface (its keys repeated for every query head); a fold that pairs query
heads with the wrong key head is far from it (the comparison can fail)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from triton_omni.speech.attention import folded_attention, folded_mask

ROWS, HEADS, KEY_HEADS, COLUMNS, HEAD_DIM = 3, 8, 2, 16, 8


def transformers_attention(query, keys, values, mask):
    attention = torch.nn.Module()
    attention.num_key_value_groups, attention.is_causal = HEADS // KEY_HEADS, True
    out, _ = sdpa_attention_forward(attention, query, keys, values, mask, scaling=HEAD_DIM ** -0.5)
    return out.reshape(*out.shape[:2], -1)


@pytest.mark.parametrize("positions", [[0, 1], [5]], ids=["two positions", "one position"])
def test_folded_attention_is_transformers_with_several_key_heads(positions):
    generator = torch.Generator().manual_seed(0)
    n = len(positions)
    query = torch.randn(ROWS, HEADS, n, HEAD_DIM, generator=generator)
    keys, values = (torch.randn(ROWS, KEY_HEADS, COLUMNS, HEAD_DIM, generator=generator) for _ in range(2))
    mask = folded_mask(torch.tensor(positions), COLUMNS, HEADS // KEY_HEADS, query.dtype)
    seen = (torch.arange(COLUMNS)[None, :] <= torch.tensor(positions)[:, None])[None, None].expand(ROWS, 1, -1, -1)
    expected = transformers_attention(query, keys, values, seen)
    torch.testing.assert_close(folded_attention(query, keys, values, mask, HEAD_DIM ** -0.5), expected)
    wrong = folded_attention(query.flip(1), keys, values, mask, HEAD_DIM ** -0.5)  # heads with the wrong keys
    assert (wrong - expected).abs().max() > 0.1


def test_a_step_reads_each_rows_own_columns_folded():
    """A talker step's mask, a row of columns per utterance ([rows, 1, 1, width], as the slot cache
    makes it), read alike by every query head."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(ROWS, HEADS, 1, HEAD_DIM, generator=generator)
    keys, values = (torch.randn(ROWS, KEY_HEADS, COLUMNS, HEAD_DIM, generator=generator) for _ in range(2))
    mask = (torch.arange(COLUMNS)[None, :] < torch.tensor([4, 16, 9])[:, None])[:, None, None, :]
    expected = transformers_attention(query, keys, values, mask)
    torch.testing.assert_close(folded_attention(query, keys, values, mask, HEAD_DIM ** -0.5), expected)
