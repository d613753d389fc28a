"""From engine deltas to ``ar`` responses (the vLLM backend's semantics), and
the tensors each response carries (on a fake ``pb_utils``)."""

from __future__ import annotations

import json

import pytest
from triton_omni.ar import Delta, ReturnOptions
from triton_omni.ar.engine import TokenLogprob
from triton_omni.ar.response import ResponseAssembler
from triton_omni_protocol import AR_GENERATE_INPUTS

from tests.support import fake_pb_utils


def lp(token: int, logprob: float, rank: int = 1, text: str = "t") -> dict[int, TokenLogprob]:
    return {token: TokenLogprob(logprob, rank, text)}


DELTAS = [
    Delta("Hel", 1, None, 0, [lp(5, -0.5, text="Hel")], -0.5),
    Delta("lo", 1, None, 0, [lp(6, -0.25, text="lo")], -0.75),
    Delta("!", 1, "length", 0, [lp(7, -1.0, text="!")], -1.75),
]


def test_streaming_sends_what_is_new_and_the_running_cumulative_logprob():
    assembler = ResponseAssembler(n=1, num_input_tokens=4, stream=True)
    responses = [assembler.add(d) for d in DELTAS]
    assert [r.texts for r in responses] == [["Hel"], ["lo"], ["!"]]
    assert [r.num_output_tokens for r in responses] == [[1], [1], [1]]
    assert [r.cumulative_logprobs for r in responses] == [[-0.5], [-0.75], [-1.75]]
    assert [r.final for r in responses] == [False, False, True]
    assert [r.finish_reasons for r in responses] == [None, None, ["length"]]
    assert all(r.num_input_tokens == 4 for r in responses)


def test_not_streaming_sends_one_whole_response_with_the_prompt_first():
    assembler = ResponseAssembler(n=1, num_input_tokens=4, stream=False, prompt="Say: ")
    responses = [r for d in DELTAS if (r := assembler.add(d)) is not None]
    assert len(responses) == 1
    (whole,) = responses
    assert whole.texts == ["Say: Hello!"]
    assert whole.num_output_tokens == [3]
    assert whole.cumulative_logprobs == [-1.75]
    assert [next(iter(p)) for p in whole.logprobs[0]] == [5, 6, 7]
    assert whole.final and whole.finish_reasons == ["length"]


def test_several_completions_end_when_the_last_one_does():
    assembler = ResponseAssembler(n=2, num_input_tokens=1, stream=True)
    first = assembler.add(Delta("a", 1, "stop", index=1))
    last = assembler.add(Delta("b", 2, "length", index=0))
    assert first.texts == ["", "a"] and not first.final
    assert last.texts == ["b", ""] and last.num_output_tokens == [2, 0]
    assert last.final and last.finish_reasons == ["length", "stop"]


def test_not_streaming_gathers_each_completion_on_its_own():
    assembler = ResponseAssembler(n=2, num_input_tokens=1, stream=False)
    deltas = [Delta("a", 1, None, 1, [lp(1, -0.1)], -0.1), Delta("b", 1, None, 0, [lp(2, -0.2)], -0.2),
              Delta("c", 1, "stop", 1, [lp(3, -0.3)], -0.4), Delta("d", 2, "length", 0, [lp(4, -0.4)], -0.6)]
    responses = [assembler.add(d) for d in deltas]
    assert responses[:3] == [None, None, None]  # one response, when the last completion ends
    whole = responses[3]
    assert whole.texts == ["bd", "ac"] and whole.num_output_tokens == [3, 2]
    assert [[next(iter(p)) for p in positions] for positions in whole.logprobs] == [[2, 4], [1, 3]]
    assert whole.cumulative_logprobs == [-0.6, -0.4] and whole.finish_reasons == ["length", "stop"]


@pytest.mark.parametrize("deltas", [
    DELTAS,
    [Delta("a", 1, None, 0), Delta("b", 2, None, 0), Delta("c", 1, "stop", 0)],  # no logprobs asked
    [Delta("a", 1, None, 1, [lp(1, -0.1)], -0.1), Delta("b", 1, "stop", 0, [lp(2, -0.2)], -0.2),
     Delta("c", 1, "length", 1, [lp(3, -0.3)], -0.4)],  # two completions, interleaved
], ids=["logprobs", "plain", "n=2"])
def test_merging_in_place_reads_as_merging_into_a_new_response(deltas):
    """What the response queue does to a waiting response (absorb, in place)
    is what the client would have read from the responses one by one (then)."""
    def streamed():
        n = 1 + max(d.index for d in deltas)
        assembler = ResponseAssembler(n=n, num_input_tokens=4, stream=True)
        return [assembler.add(d) for d in deltas]

    merged_new, merged_in_place = streamed(), streamed()
    expected = merged_new[0]
    for later in merged_new[1:]:
        expected = expected.then(later)
    waiting = merged_in_place[0]
    for later in merged_in_place[1:]:
        assert waiting.absorb(later) is waiting
    assert waiting == expected


@pytest.fixture
def ar_io():
    fake_pb_utils.install()
    from triton_omni.triton import ar_io

    return ar_io


def outputs(response) -> dict:
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


def test_outputs_are_present_exactly_when_asked(ar_io):
    assembler = ResponseAssembler(n=1, num_input_tokens=4, stream=True)
    middle, last = assembler.add(DELTAS[0]), None
    for delta in DELTAS[1:]:
        last = assembler.add(delta)
    assert set(outputs(ar_io.generate_response(middle, ReturnOptions()))) == {"text_output"}
    everything = ReturnOptions(True, True, True, True, True)
    assert set(outputs(ar_io.generate_response(middle, everything))) == {
        "text_output", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens"}  # not final
    tensors = outputs(ar_io.generate_response(last, everything))
    assert tensors["finish_reason"].tolist() == [b"length"]
    assert tensors["num_input_tokens"].dtype.name == "uint32" and tensors["num_input_tokens"].tolist() == [4]
    assert tensors["num_output_tokens"].tolist() == [1]
    assert tensors["cumulative_logprob"].tolist() == [-1.75]
    assert json.loads(tensors["logprobs"][0]) == [{"7": {"logprob": -1.0, "rank": 1, "decoded_token": "!"}}]


def test_every_sampling_tensor_is_an_input_of_ar(ar_io):
    from triton_omni.ar.request import SAMPLING_TENSORS

    inputs = {spec.name for spec in AR_GENERATE_INPUTS}
    assert set(SAMPLING_TENSORS) <= inputs
    assert {f"return_{name}" for name in ReturnOptions.__dataclass_fields__} <= inputs
