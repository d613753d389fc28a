"""The scheduler's Triton-free parts: request parsing and the admission budget."""

from __future__ import annotations

import asyncio
import json

import pytest
from triton_omni.errors import RequestRejectedError, RequestValidationError
from triton_omni.scheduler import BudgetConfig, EmbedsBudget, OmniRequest, SchedulerLimits

from tests.support.fake_stages import FakeStages

LIMITS = SchedulerLimits(max_images=4)


def test_request_routes_come_from_the_request():
    request = OmniRequest.from_inputs({"text_input": "a fox", "modalities": ["image", "text"],
                                       "parameters": '{"height": 128, "max_tokens": 5, "num_images": 2}'}, LIMITS)
    assert request.wants_text and request.wants_image and request.num_images == 2
    assert request.image_options == {"height": 128} and request.text_options == {"max_tokens": 5}
    assert OmniRequest.from_inputs({"text_input": "a fox"}, LIMITS).modalities == ("text",)


def test_a_tensor_wins_over_the_same_key_in_parameters():
    request = OmniRequest.from_inputs({"text_input": "x", "seed": 3, "parameters": '{"seed": 9}'}, LIMITS)
    assert request.image_options["seed"] == 3 and request.text_options["seed"] == 3


def test_parameters_take_every_ar_sampling_key_and_string_forms():
    """The same contract as `ar`: vLLM's keys, numbers as strings; `ar` validates the text options."""
    request = OmniRequest.from_inputs({"text_input": "x", "parameters": json.dumps(
        {"max_tokens": "3", "presence_penalty": "0.5", "stop_token_ids": [7], "num_inference_steps": "2",
         "guidance_scale": "7.5"})}, LIMITS)
    assert request.text_options == {"max_tokens": "3", "presence_penalty": "0.5", "stop_token_ids": [7]}
    assert request.image_options == {"num_inference_steps": 2, "guidance_scale": 7.5}


def test_several_images_get_consecutive_seeds():
    request = OmniRequest.from_inputs({"text_input": "x", "seed": 10, "num_images": 3}, LIMITS)
    assert [request.image_options_for(i)["seed"] for i in range(3)] == [10, 11, 12]


@pytest.mark.parametrize("inputs, parameter", [
    ({}, "text_input"),
    ({"text_input": " "}, "text_input"),
    ({"text_input": "x", "modalities": []}, "modalities"),
    ({"text_input": "x", "modalities": ["speech"]}, "modalities"),
    ({"text_input": "x", "modalities": ["text", "text"]}, "modalities"),
    ({"text_input": "x", "modalities": ["image", "video"]}, "modalities"),
    ({"text_input": "x", "parameters": '{"num_frames": "many"}'}, "num_frames"),
    ({"text_input": "x", "num_images": 5}, "num_images"),
    ({"text_input": "x", "enhance_prompt": "yes"}, "enhance_prompt"),
    ({"text_input": "x", "parameters": "{"}, "parameters"),
    ({"text_input": "x", "parameters": '{"best_of": 2}'}, "parameters"),
    ({"text_input": "x", "parameters": '{"height": "tall"}'}, "height"),
    ({"text_input": "x", "parameters": '{"n": 2}'}, "n"),
    ({"text_input": "x", "parameters": '{"logprobs": 1}'}, "logprobs"),
    ({"text_input": "x", "parameters": '{"num_inference_steps": 4294967297.5}'}, "num_inference_steps"),
    ({"text_input": "x", "parameters": '{"num_inference_steps": 4294967297}'}, "num_inference_steps"),
    ({"text_input": "x", "parameters": '{"height": 4294967328}'}, "height"),
    ({"text_input": "x", "parameters": '{"seed": 9223372036854775808}'}, "seed"),
    ({"text_input": "x", "num_images": 4, "parameters": '{"seed": 9223372036854775806}'}, "seed"),
    ({"text_input": "x", "parameters": "[" * 100_000 + "]" * 100_000}, "parameters"),
    ({"text_input": "x", "parameters": "{}", "options": "{}"}, "options"),
    ({"text_input": "x", "options": '{"frobnicate": 1}'}, "options"),
])
def test_bad_requests_name_the_parameter(inputs, parameter):
    with pytest.raises(RequestValidationError, match=parameter):
        OmniRequest.from_inputs(inputs, LIMITS)


def test_options_alias_and_request_parameters():
    """`options` is `parameters` under a name Triton's HTTP /generate does not reserve; request
    parameters carry the same keys; unknown keys are errors wherever they come from."""
    request = OmniRequest.from_inputs({"text_input": "x", "options": '{"max_tokens": 3}'}, LIMITS,
                                      {"num_inference_steps": "4", "presence_penalty": 0.5})
    assert request.text_options == {"max_tokens": 3, "presence_penalty": 0.5}
    assert request.image_options == {"num_inference_steps": 4}
    with pytest.raises(RequestValidationError, match="request parameters"):
        OmniRequest.from_inputs({"text_input": "x"}, LIMITS, {"temprature": 1})


def run(coro):
    return asyncio.run(coro)


def test_budget_rejects_what_can_never_fit():
    async def scenario():
        budget = EmbedsBudget(BudgetConfig(max_bytes=100))
        with pytest.raises(RequestRejectedError, match="exceed the admission budget of 100 bytes") as info:
            async with budget.reserve(101):
                pass
        assert info.value.reason == "embeds_budget" and budget.in_flight == 0

    run(scenario())


def test_budget_reject_policy_refuses_while_full_and_admits_after():
    async def scenario():
        seen = []
        budget = EmbedsBudget(BudgetConfig(max_bytes=100, policy="reject"), on_change=seen.append)
        async with budget.reserve(80):
            with pytest.raises(RequestRejectedError, match="80 bytes of prompt embeddings in flight"):
                async with budget.reserve(30):
                    pass
        async with budget.reserve(30):
            pass
        assert seen == [80, 0, 30, 0]

    run(scenario())


def test_budget_wait_policy_admits_when_memory_is_freed_and_times_out_otherwise():
    async def scenario():
        budget = EmbedsBudget(BudgetConfig(max_bytes=100, policy="wait", max_wait_s=0.3))
        order = []

        async def hold(name, nbytes, seconds):
            async with budget.reserve(nbytes):
                order.append(name)
                await asyncio.sleep(seconds)

        await asyncio.gather(hold("first", 80, 0.1), hold("second", 80, 0))
        assert order == ["first", "second"]
        async with budget.reserve(80):
            with pytest.raises(RequestRejectedError):
                async with budget.reserve(80):
                    pass

    run(scenario())


# -- routing, on scripted stages ------------------------------------------------------------


def scheduled(stages, **inputs):
    from triton_omni.scheduler import BudgetConfig, EmbedsBudget, OmniScheduler

    async def collect():
        scheduler = OmniScheduler(stages, EmbedsBudget(BudgetConfig()))
        return [event async for event in scheduler.run(OmniRequest.from_inputs(inputs, LIMITS))]

    return asyncio.run(collect())


def test_text_route_streams_the_ar_deltas_only():
    from triton_omni.scheduler import TextDelta

    stages = FakeStages()
    events = scheduled(stages, text_input="x", modalities=["text"], parameters='{"max_tokens": "3"}')
    assert [e.text for e in events] == list(stages.words)
    assert all(isinstance(e, TextDelta) for e in events)
    assert stages.calls == [("generate", ("x", {"max_tokens": "3"}))]


@pytest.mark.parametrize("modalities", [["text", "audio"], ["audio"]])
def test_the_audio_route_speaks_the_thinkers_reply_in_its_chat_template(modalities):
    """The prompt in the chat template goes to ar, whose reply's token ids go to speech with its
    options by the speech stage's names, from the reply's first token on (speech is called before
    the thinker has finished, and reads the rest as it comes); the reply's text is sent only where
    text is asked for."""
    from triton_omni.scheduler import AudioChunk, TextDelta

    stages = FakeStages()
    events = scheduled(stages, text_input="a fox", modalities=modalities, voice="ethan", talker_temperature=0.0,
                       chunk_frames=4, max_tokens=3)
    assert [e.text for e in events if isinstance(e, TextDelta)] == (list(stages.words) if "text" in modalities
                                                                    else [])
    assert [e.audio for e in events if isinstance(e, AudioChunk)] == [f"samples {i}" for i in range(stages.steps)]
    [generate, (stage, (prompt, first, options))] = stages.calls
    assert generate == ("generate", ("<user>a fox<assistant>", {"max_tokens": 3}))
    assert (stage, prompt, options) == ("speak", "<user>a fox<assistant>",
                                        {"voice": "ethan", "temperature": 0.0, "chunk_frames": 4})
    assert stages.replies == [[0, 1, 2]]
    assert 1 <= len(first) < 3 and first == [0, 1, 2][:len(first)]  # called before the reply was whole


def test_a_talker_that_reads_the_thinkers_states_gets_them_and_starts_at_the_second_token():
    """Qwen2.5-Omni's talker reads the thinker's states at every token: ar is asked for them, each
    delta's go to the talker with the reply, and speech is called once the reply's first token has
    its state (which comes with the second token), before the reply is whole."""
    stages = FakeStages(words=("once ", "upon ", "a ", "time"), speaks_from_states=True)
    scheduled(stages, text_input="a fox", modalities=["audio"])
    [generate, (stage, (_, first, _))] = stages.calls
    assert generate == ("generate", ("<user>a fox<assistant>", {}, ("states",)))
    assert stage == "speak" and 2 <= len(first) < 4
    assert stages.spoken_states == [["prompt", "token 0", "token 1", "token 2"]]


def test_input_audio_goes_to_the_thinker_in_its_template_and_its_states_to_the_talker():
    """A prompt with audio is the user turn of the model's template, its audio parts before the
    text, on both routes; speaking, the thinker is asked for its states at the audio, which the
    talker gets with the reply."""
    stages = FakeStages()
    scheduled(stages, text_input="a fox", modalities=["text"], input_audio=[b"clip"])
    assert stages.calls == [("generate", ("<user><audio>a fox<assistant>", {}, ([b"clip"], False)))]
    stages = FakeStages()
    scheduled(stages, text_input="a fox", modalities=["audio"], input_audio=[b"one", b"two"])
    [generate, speak] = stages.calls
    assert generate == ("generate", ("<user><audio><audio>a fox<assistant>", {}, ([b"one", b"two"], True)))
    assert speak[1][0] == "<user><audio><audio>a fox<assistant>"
    assert speak[1][-1] == (["heard"], "states of 2 clips", None)
    with pytest.raises(RequestValidationError, match="needs modalities") as error:
        OmniRequest.from_inputs({"text_input": "a fox", "modalities": ["image"], "input_audio": [b"x"]}, LIMITS)
    assert error.value.parameter == "input_audio"


def test_image_route_encodes_then_diffuses_each_image_with_its_own_seed_and_progress():
    from triton_omni.scheduler import ImageResult, Progress

    stages = FakeStages()
    events = scheduled(stages, text_input="a fox", modalities=["image"], num_images=2, seed=7,
                       negative_prompt="blurry")
    images = sorted((e.index, e.image) for e in events if isinstance(e, ImageResult))
    assert images == [(0, "image of a fox seed 7"), (1, "image of a fox seed 8")]
    assert [prompts for stage, prompts in stages.calls if stage == "encode"] == [("a fox", "blurry")]
    progress = [e for e in events if isinstance(e, Progress) and e.stage == "diffusion"]
    assert sorted((e.image_index, e.step) for e in progress) == [(i, s) for i in (0, 1) for s in (1, 2, 3)]
    assert not any(stage == "generate" for stage, _ in stages.calls)


def test_the_video_route_is_the_diffusion_route_and_carries_the_frame_rate():
    """``modalities: ["video"]`` encodes then diffuses as ``["image"]`` does, ``num_frames`` passed to
    the diffusion model; its answer (a video model's frames) comes back with their rate."""
    from triton_omni.scheduler import ImageResult

    stages = FakeStages()
    events = scheduled(stages, text_input="a fox", modalities=["video"], seed=7, parameters='{"num_frames": 9}')
    [result] = [e for e in events if isinstance(e, ImageResult)]
    assert (result.image, result.fps) == ("9 frames of a fox seed 7", 16.0)
    [(_, (_, _, options))] = [call for call in stages.calls if call[0] == "diffuse"]
    assert options == {"num_frames": 9, "seed": 7}


def test_hybrid_route_runs_both_branches_and_enhance_rewrites_first():
    from triton_omni.scheduler import EnhancedPrompt, ImageResult, TextDelta

    stages = FakeStages()
    events = scheduled(stages, text_input="a fox", modalities=["text", "image"], enhance_prompt=True)
    assert any(isinstance(e, TextDelta) for e in events) and any(isinstance(e, ImageResult) for e in events)
    rewrite = [e for e in events if isinstance(e, EnhancedPrompt) and e.done]
    assert rewrite and rewrite[0].text == "once upon a time"
    assert ("encode", ("once upon a time", None)) in stages.calls  # the image uses the rewrite


def test_a_failing_stage_fails_the_request_and_cancels_the_other_branch():
    from triton_omni.errors import StageError

    stages = FakeStages(fail={"diffuse": StageError("diffusion", "INVALID_ARG", "bad height")}, hang={"generate"})
    with pytest.raises(StageError, match="bad height"):
        scheduled(stages, text_input="a fox", modalities=["text", "image"])
    assert stages.cancelled == ["generate"]


def test_input_images_go_to_diffusion_or_else_to_the_thinker_and_pass_through_untouched():
    """Input images are the diffusion model's where 'image' is asked for, else the thinker's: in its
    template's user turn, a text reply's or a spoken one's (the thinker then asked for its states at
    them, which the talker gets with the prompt's positions; or, for a talker reading every state, for
    those)."""
    from triton_omni.scheduler.request import OmniRequest, SchedulerLimits

    for modalities in (["audio"], ["text", "audio"]):
        stages = FakeStages()
        scheduled(stages, text_input="a fox", modalities=modalities, images=[b"one"])
        [generate, speak] = stages.calls
        assert generate == ("generate", ("<user><image>a fox<assistant>", {}, ([], True), ("images", [b"one"])))
        assert speak[1][-1] == (["heard"], "states of 0 clips", "positions of 1 images")
    stages = FakeStages(speaks_from_states=True)
    scheduled(stages, text_input="a fox", modalities=["audio"], images=[b"one"])
    assert stages.calls[0] == ("generate", ("<user><image>a fox<assistant>", {}, ("states",), ("images", [b"one"])))
    stages = FakeStages()
    scheduled(stages, text_input="a fox", modalities=["text"], images=[b"one", b"two"], input_audio=[b"clip"])
    assert stages.calls == [("generate", ("<user><audio><image><image>a fox<assistant>", {}, ([b"clip"], False),
                                          ("images", [b"one", b"two"])))]
    assert OmniRequest.from_inputs({"text_input": "a fox", "modalities": ["image"], "images": [b"a"]},
                                   SchedulerLimits()).seen == []
    request = OmniRequest.from_inputs({"text_input": "a fox", "modalities": ["image"], "images": [b"a", b"b"]},
                                      SchedulerLimits())
    assert request.images == [b"a", b"b"] and "images" not in request.image_options
