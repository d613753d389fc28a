"""The transformers engine hands on a thinker's states (``keep_states``): each position's layer 0
input plus its last layer's output, of the prompt on the first delta and of each token fed back on
the deltas after, as a Qwen2.5-Omni talker reads them. Held to the whole model's thinker over the
same tokens in one pass, alone and with other requests decoded in the same steps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen2_5OmniForConditionalGeneration
from triton_omni.ar.engine_transformers import TransformersEngine
from triton_omni.ar.language_model import language_model
from triton_omni.ar.sampling import ArLimits, SamplingOptions
from triton_omni.demo_models import resolve_model

PROMPTS = ["a lighthouse at night", "hello", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def demo():
    folder = Path(resolve_model("demo:tiny-qwen2.5-omni"))
    engine = TransformersEngine(str(language_model(folder, folder)), "cpu", torch.float32, max_num_seqs=4)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()
    yield engine, model
    asyncio.run(engine.shutdown())


async def reply(engine, prompt_ids: list[int], request_id: str, max_tokens: int, keep: bool = True):
    """(reply ids, the states of each delta) of one greedy request."""
    options = SamplingOptions.from_values({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
                                          ArLimits())
    ids, states = [], []
    async for delta in engine.generate(prompt_ids, options, request_id, keep_states=keep):
        ids += delta.token_ids
        if delta.states is not None:
            states.append(delta.states)
            # after each delta: the prompt's states and those of every token out but the last
            assert sum(len(s) for s in states) == len(prompt_ids) + len(ids) - 1
        else:  # a request that asked for none, or a last delta of no token (a stop at max_tokens)
            assert not keep or not delta.token_ids
    return ids, states


def model_states(model, prompt_ids: list[int], reply_ids: list[int]) -> torch.Tensor:
    """The whole model's thinker over the prompt and the reply but its last token, in one pass."""
    with torch.no_grad():
        hidden = model.thinker(input_ids=torch.tensor([prompt_ids + reply_ids[:-1]]),
                               output_hidden_states=True).hidden_states
    return hidden[0][0] + hidden[-1][0]


def test_the_states_are_the_models_alone_and_in_company(demo):
    engine, model = demo
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    lengths = [6, 9, 4]

    asked = list(enumerate(zip(prompts, lengths, strict=True)))

    async def run():
        alone = [await reply(engine, ids, f"alone-{i}", n) for i, (ids, n) in asked]
        together = await asyncio.gather(*(reply(engine, ids, f"together-{i}", n) for i, (ids, n) in asked))
        return alone, together

    alone, together = asyncio.run(run())
    for (_, (prompt_ids, n)), (ids, states), (ids_together, states_together) in zip(asked, alone, together,
                                                                                     strict=True):
        assert len(ids) == n and ids_together == ids
        assert len(states[0]) >= len(prompt_ids)  # the first delta holds the prompt's states
        expected = model_states(model, prompt_ids, ids)
        for got in (torch.cat(states), torch.cat(states_together)):
            assert got.shape == expected.shape and float((got - expected).abs().max()) < 1e-4
    # a wrong position moves them far past that tolerance
    assert float((expected[1:] - expected[:-1]).abs().max()) > 1.0


def test_a_request_that_asks_for_none_gets_none(demo):
    engine, _ = demo
    ids, states = asyncio.run(reply(engine, engine.tokenizer("hello")["input_ids"], "none", 3, keep=False))
    assert len(ids) == 3 and states == []
