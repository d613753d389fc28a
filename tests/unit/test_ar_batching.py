"""The transformers engine's continuous batching, on the tiny demo model (no server).

Concurrent requests are decoded together, and each one's text is what it
would be alone: its own options, its own seeded generator."""

from __future__ import annotations

import asyncio

import pytest
import torch
from triton_omni.ar.engine_transformers import TransformersEngine
from triton_omni.ar.sampling import ArLimits, SamplingOptions
from triton_omni.demo_models import resolve_model

PROMPTS = ["hello world", "a lighthouse on a cliff at dusk, oil painting", "x", "the quick brown fox jumps over"]


@pytest.fixture(scope="module")
def engine():
    engine = TransformersEngine(resolve_model("demo:tiny-qwen2"), "cpu", torch.float32, max_num_seqs=6)
    yield engine
    asyncio.run(engine.shutdown())


def options(**values) -> SamplingOptions:
    return SamplingOptions.from_values(values, ArLimits())


async def generate(engine, prompt: str, opts: SamplingOptions, request_id: str, on_delta=None):
    text, tokens, reason = "", 0, None
    async for delta in engine.generate(engine.tokenizer(prompt)["input_ids"], opts, request_id):
        text, tokens, reason = text + delta.text, tokens + delta.num_tokens, delta.finish_reason
        if on_delta is not None:
            await on_delta(tokens)
    return text, tokens, reason


def mixed_options(i: int) -> SamplingOptions:
    """Greedy and sampled rows, different lengths, penalties, top-k/top-p/min-p."""
    if i % 3 == 0:
        return options(max_tokens=12 + i, temperature=0.0, repetition_penalty=1.3)
    return options(max_tokens=20 + i, seed=100 + i, temperature=0.9, top_p=0.9, top_k=40, min_p=0.01,
                   min_tokens=5)


def test_concurrent_requests_each_get_their_own_text_as_if_alone(engine):
    requests = [(PROMPTS[i % len(PROMPTS)], mixed_options(i)) for i in range(10)]

    async def run():
        alone = [await generate(engine, p, o, f"alone-{i}") for i, (p, o) in enumerate(requests)]
        before = engine.batcher.max_rows_seen
        together = await asyncio.gather(*(generate(engine, p, o, f"together-{i}")
                                          for i, (p, o) in enumerate(requests)))
        return alone, together, before

    engine.batcher.max_rows_seen = 0
    alone, together, alone_rows = asyncio.run(run())
    assert alone_rows == 1  # one at a time really ran alone
    assert together == alone
    assert engine.batcher.max_rows_seen == 6  # decoded together, up to max_num_seqs
    assert {reason for _, _, reason in together} <= {"length", "stop"}


def test_a_request_joins_a_running_batch_mid_flight(engine):
    first, second = options(max_tokens=40, seed=1, ignore_eos=True), options(max_tokens=10, seed=2, ignore_eos=True)

    async def run():
        alone = [await generate(engine, PROMPTS[0], first, "a"), await generate(engine, PROMPTS[1], second, "b")]
        started = asyncio.get_running_loop().create_future()

        async def start_second(tokens):
            if tokens >= 15 and not started.done():
                started.set_result(asyncio.ensure_future(generate(engine, PROMPTS[1], second, "b2")))

        long = await generate(engine, PROMPTS[0], first, "a2", on_delta=start_second)
        return alone, [long, await started.result()]

    alone, mid_flight = asyncio.run(run())
    assert mid_flight == alone


def test_cancelling_one_request_leaves_the_others_running(engine):
    async def run():
        async def cancel_after_a_few(tokens):
            if tokens >= 3:
                await engine.abort("victim")

        victim = asyncio.ensure_future(generate(engine, PROMPTS[2], options(max_tokens=200, ignore_eos=True),
                                                "victim", on_delta=cancel_after_a_few))
        others = [generate(engine, PROMPTS[i], options(max_tokens=30, ignore_eos=True, seed=i), f"other-{i}")
                  for i in range(3)]
        results = await asyncio.gather(victim, *others)
        return results

    victim, *others = asyncio.run(run())
    assert victim[2] == "abort" and victim[1] < 200
    assert [(tokens, reason) for _, tokens, reason in others] == [(30, "length")] * 3


def first_greedy_token(engine, prompt: str) -> int:
    with torch.inference_mode():
        ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]])
        return int(engine.model(ids).logits[0, -1].argmax())


def test_stop_strings_and_stop_tokens_end_one_row_only(engine):
    greedy = {"max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    stop_token = first_greedy_token(engine, PROMPTS[1])

    async def run():
        free = await generate(engine, PROMPTS[1], options(**greedy), "free")
        stop_text = free[0][5:8]
        results = await asyncio.gather(generate(engine, PROMPTS[1], options(**greedy, stop=[stop_text]), "cut"),
                                       generate(engine, PROMPTS[1], options(**greedy, stop_token_ids=[stop_token]),
                                                "by-token"),
                                       generate(engine, PROMPTS[1], options(**greedy), "free2"))
        return free, stop_text, results

    free, stop_text, (cut, by_token, free_again) = asyncio.run(run())
    assert cut[2] == "stop" and free[0].startswith(cut[0]) and stop_text not in cut[0]
    assert (by_token[1], by_token[2]) == (1, "stop")
    assert free_again == free


def test_min_tokens_holds_off_the_stop_token(engine):
    stop_token = first_greedy_token(engine, PROMPTS[0])
    opts = options(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token], min_tokens=6)
    _, tokens, _ = asyncio.run(generate(engine, PROMPTS[0], opts, "m"))
    assert tokens >= 6


def test_a_draw_is_torch_multinomial_s_own_without_reading_back():
    """``_draws`` stands in for ``torch.multinomial(probs, 1, generator=...)`` (which reads the
    probabilities back to the host to check them): the same token from the same generator state,
    over distributions with zeros, and the generators left in the same state."""
    from triton_omni.ar.batching import _draws

    for seed in range(50):
        probs = torch.rand(300, generator=torch.Generator().manual_seed(1000 + seed))
        probs[probs < 0.6] = 0
        probs /= probs.sum()
        theirs, ours = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(3):
            assert torch.equal(_draws(probs[None], [ours])[0], torch.multinomial(probs, 1, generator=theirs))
        assert torch.equal(ours.get_state(), theirs.get_state())


def test_rows_drawn_together_draw_what_each_draws_alone():
    """``_draws`` over a batch: each row's noise from its own generator, in row order (two rows
    sharing one generator draw one after the other), as drawing the rows one at a time does."""
    from triton_omni.ar.batching import _draws

    probs = torch.rand(4, 300, generator=torch.Generator().manual_seed(7))
    probs /= probs.sum(dim=-1, keepdim=True)

    def generators():
        shared = torch.Generator().manual_seed(3)
        return [torch.Generator().manual_seed(1), shared, torch.Generator().manual_seed(2), shared]

    alone = [_draws(row[None], [generator])[0] for row, generator in zip(probs, generators(), strict=True)]
    together = _draws(probs, generators())
    assert together.tolist() == torch.stack(alone).tolist()
    assert together.tolist() != _draws(probs, generators()[::-1]).tolist()  # other generators, other tokens


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"),
                         [(0.9, 50, 0.8, 0.0), (1.0, 40, 0.9, 0.01), (0.7, 0, 0.95, 0.0), (1.0, 10, 1.0, 0.05),
                          (1.0, 50, 0.8, 0.0)])
def test_filtered_probabilities_are_transformers_warpers(temperature, top_k, top_p, min_p):
    """Temperature, top-k, top-p and min-p for a batch at once: the distribution ``generate``'s
    warpers leave (in their order: top-p over what top-k kept), over a vocabulary's logits."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    from triton_omni.ar.batching import filtered_probs

    logits = torch.randn(4, 2048, generator=torch.Generator().manual_seed(5))
    vocab = logits.shape[-1]
    params = torch.tensor([[temperature, top_k or vocab, top_p, min_p]] * len(logits))
    probs, order = filtered_probs(logits, params)
    ours = torch.zeros_like(probs).scatter(1, order, probs)
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) \
        + ([TopPLogitsWarper(top_p)] if top_p < 1 else []) + ([MinPLogitsWarper(min_p)] if min_p else [])
    theirs = logits.clone()
    for warper in warpers:
        theirs = warper(None, theirs)
    theirs = theirs.softmax(dim=-1)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs)
    if top_p < 1:  # top-p took tokens that top-k kept
        assert (ours > 0).sum(dim=-1).max() < (top_k or vocab)
    if top_k:  # only the top k ranked (the code predictor's topk): the same first k columns
        ranked_probs, ranked_order = filtered_probs(logits, params, ranked=top_k)
        assert ranked_probs.shape[-1] == top_k
        torch.testing.assert_close(ranked_probs, probs[:, :top_k], rtol=0, atol=0)
        assert torch.equal(ranked_order, order[:, :top_k])


def test_penalties_for_all_rows_at_once_equal_transformers_processors_row_by_row():
    """Each row's repetition penalty (over its prompt and its output, as transformers' processor
    reads its ids) and its stop tokens banned below ``min_tokens``, applied to a whole batch at
    once: bit for bit the processors' logits, row by row; and they move the logits."""
    from types import SimpleNamespace

    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor
    from triton_omni.ar.batching import _penalise

    generator = torch.Generator().manual_seed(0)
    rows = [SimpleNamespace(options=SamplingOptions(repetition_penalty=penalty, min_tokens=min_tokens),
                            prompt_ids=torch.randint(0, 50, (n,), generator=generator).tolist(),
                            output_ids=torch.randint(0, 50, (k,), generator=generator).tolist(), stop_ids=stops)
            for penalty, min_tokens, n, k, stops in [(1.05, 0, 12, 4, [3]), (1.0, 8, 5, 2, [3, 7]),
                                                     (1.3, 5, 9, 6, [3]), (1.05, 2, 7, 0, [])]]
    logits = torch.randn(len(rows), 50, generator=generator)
    ours = logits.clone()
    _penalise(ours, rows)
    for i, row in enumerate(rows):
        ids = torch.tensor([row.prompt_ids + row.output_ids])
        theirs = RepetitionPenaltyLogitsProcessor(row.options.repetition_penalty)(ids, logits[i:i + 1].clone())
        if row.stop_ids:
            theirs = MinNewTokensLengthLogitsProcessor(len(row.prompt_ids), row.options.min_tokens, row.stop_ids,
                                                       device="cpu")(ids, theirs)
        assert torch.equal(ours[i], theirs[0]), i
    assert not torch.equal(ours, logits) and not torch.equal(ours[0], logits[0]) and torch.isinf(ours[1, 7])
