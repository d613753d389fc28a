"""Qwen2.5-Omni's talker prompt (``Qwen25Talker``) from the thinker's states, held to the model's own
``generate(return_audio=True)`` on the tiny demo: the prefill and the states its steps read equal
what ``generate`` hands its talker; a greedy talker over them draws ``generate``'s codes, and
``StreamingToken2Wav`` turns those into ``generate``'s waveform; another voice draws other codes; a
bad voice or states are refused naming the field."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration
from triton_omni.demo_models import resolve_model
from triton_omni.errors import RequestValidationError
from triton_omni.speech.demos import CODEC_EOS, CODEC_PAD
from triton_omni.speech.qwen25_talker import Qwen25Talker
from triton_omni.speech.token2wav import StreamingToken2Wav

from tests.support.qwen25 import generate_seen, greedy_codes, thinker_states

REPLY_TOKENS, MAX_CODES, STEPS, SEED = 12, 40, 4, 7


@pytest.fixture(scope="module")
def demo():
    folder = resolve_model("demo:tiny-qwen2.5-omni")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a lighthouse at night"}], tokenize=False,
                                         add_generation_prompt=True)
    talker = Qwen25Talker(model.talker, model.thinker.get_input_embeddings(), model.speaker_map, model.config)
    return model, tokenizer(text, return_tensors="pt").input_ids, talker


def generated(model, ids, voice: str):
    """generate's reply ids, what it handed its talker, its codes and its waveform (greedy)."""
    torch.manual_seed(SEED)
    return generate_seen(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, voice,
                         thinker_do_sample=False, thinker_max_new_tokens=REPLY_TOKENS, talker_do_sample=False,
                         talker_max_new_tokens=MAX_CODES, talker_eos_token_id=[CODEC_PAD, CODEC_EOS],
                         token2wav_num_steps=STEPS)


def test_the_prompt_codes_and_waveform_are_generates(demo):
    model, ids, talker = demo
    reply, seen, wav = generated(model, ids, "Chelsie")
    prompt = talker.prompt(ids[0].tolist(), reply, "chelsie", states=thinker_states(model, ids, reply))
    with torch.no_grad():
        expected = model.talker.thinker_to_talker_proj(seen["inputs_embeds"][0])
    assert prompt.embeds.shape == expected.shape and float((prompt.embeds - expected).abs().max()) < 1e-5
    reply_part = seen["thinker_reply_part"][0]  # generate's: the trailing states, then the pad marker's
    assert float((torch.stack([*prompt.trailing, prompt.pad]) - reply_part).abs().max()) < 1e-5
    codes = greedy_codes(talker, prompt, MAX_CODES)
    assert codes == seen["codes"] and len(codes) > 12
    speaker = talker.speakers["chelsie"]
    stream = StreamingToken2Wav(model.token2wav, num_steps=STEPS).stream(
        speaker["cond"].float(), speaker["ref_mel"].float(), torch.Generator().manual_seed(SEED))
    samples = torch.cat([stream.add(codes[:20]), stream.add(codes[20:], final=True)])
    assert samples.shape == wav.shape and float((samples - wav).abs().max()) < 1e-5


def test_another_voice_draws_other_codes(demo):
    model, ids, talker = demo
    reply, seen, _ = generated(model, ids, "Chelsie")
    states = thinker_states(model, ids, reply)
    codes = {voice: greedy_codes(talker, talker.prompt(ids[0].tolist(), reply, voice, states=states), MAX_CODES)
             for voice in ("chelsie", "ethan")}
    assert codes["chelsie"] == seen["codes"] and codes["ethan"] != codes["chelsie"]


@pytest.mark.parametrize(("change", "field"), [
    ({"voice": "nobody"}, "voice"),
    ({"reply_ids": []}, "reply_ids"),
    ({"states": torch.zeros(3, 8)}, "thinker_states"),
])
def test_bad_input_is_refused_naming_its_field(demo, change, field):
    _, ids, talker = demo
    arguments = {"prompt_ids": ids[0].tolist(), "reply_ids": [5, 6], "voice": "chelsie",
                 "states": torch.zeros(ids.shape[1] + 1, talker.width)} | change
    with pytest.raises(RequestValidationError) as error:
        talker.prompt(**arguments)
    assert error.value.parameter == field


@pytest.mark.parametrize("slot_cache", [False, True])
def test_utterances_stepped_together_speak_as_each_alone(demo, slot_cache, monkeypatch):
    """The talker's continuous batching (``TalkerBatcher``) with Qwen2.5-Omni's talker, on either KV
    cache (the ``SlotCache`` is what its CUDA graphs replay over on a GPU: here run as it is, read 32
    columns wide, then all of them as the speech grows past 32): two voices' utterances arriving
    together, and a third joining mid-speech alone (``TalkerPrefill``) while its reply is still being
    written (a state at a time, slower than the talker steps: its row waits, its passes thrown away),
    each draw the codes the talker alone draws for them (greedy), spoken a code a frame as they are
    drawn."""
    import queue
    import threading
    import time

    from triton_omni.ar.sampling import SamplingOptions
    from triton_omni.speech.talker import TalkerBatcher, Utterance

    model, ids, talker = demo
    reply, _, _ = generated(model, ids, "Chelsie")
    states = thinker_states(model, ids, reply)
    prompts = {voice: talker.prompt(ids[0].tolist(), reply, voice, states=states) for voice in ("chelsie", "ethan")}
    alone = {voice: greedy_codes(talker, prompt, MAX_CODES) for voice, prompt in prompts.items()}
    from triton_omni.speech import talker_graphs

    monkeypatch.setattr(talker_graphs, "SMALLEST_WIDTH", 16)
    monkeypatch.setattr(talker_graphs, "SMALLEST_PREFILL", 16)
    longest = len(prompts["chelsie"].embeds) + MAX_CODES
    batcher = TalkerBatcher(talker, 4, cuda_graphs=False, max_len=longest + 1, slot_cache=slot_cache)
    spoken: dict[str, queue.SimpleQueue] = {}
    try:
        def utterance(name: str, voice: str, prompt=None) -> Utterance:
            spoken[name] = queue.SimpleQueue()
            prompt = prompt or prompts[voice]
            return Utterance(prompt, SamplingOptions(temperature=0.0, repetition_penalty=1.05, max_tokens=MAX_CODES),
                             spoken[name].put, prompt_ids=prompt.prompt_codes)

        def written_slowly(prompt) -> None:
            for row in range(count + 1, len(states)):
                time.sleep(0.02)
                prompt.extend(talker.on_device(states[row:row + 1]))
                batcher.wake()
            prompt.finish(talker.end_state)
            batcher.wake()

        count = ids.shape[1]  # the reply's first two tokens: the prompt's states and the first reply token's
        being_written = talker.prompt(ids[0].tolist(), reply[:2], "ethan", whole=False, states=states[:count + 1])
        batcher.submit(utterance("first", "chelsie"))
        batcher.submit(utterance("second", "ethan"))
        frames = {"first": [spoken["first"].get(timeout=60)], "second": [], "third": []}
        writer = threading.Thread(target=written_slowly, args=(being_written,))
        batcher.submit(utterance("third", "ethan", being_written))  # the first is speaking: it joins mid-speech
        writer.start()
        for name, frames_of in spoken.items():
            while (item := frames_of.get(timeout=60)) is not None:
                assert not isinstance(item, BaseException), item
                frames[name].append(item)
        writer.join(timeout=60)
    finally:
        batcher.stop()
    assert batcher.waits > 0
    assert [code for [code] in frames["first"]] == alone["chelsie"]
    assert [code for [code] in frames["second"]] == alone["ethan"]
    assert [code for [code] in frames["third"]] == alone["ethan"]


def test_codes_token2wav_cannot_read_are_never_drawn_but_the_stop_codes(demo):
    """The real model's talker draws from 8448 codes and its ``token2wav`` reads 8193: a random-weight
    talker (the benchmarks') would draw the rest, past the decoder's table. Here the tiny model's
    decoder reads 60 of its 64: 61 (the start code, suppressed as generate does) and 63 are never
    drawn; 60 and 62 (pad and end) still stop the talker; 64 codes readable leave the start code alone."""
    import copy

    model, _, talker = demo
    assert talker.suppressed.tolist() == [61]
    config = copy.deepcopy(model.config)
    config.token2wav_config.dit_config.num_embeds = 60
    narrower = Qwen25Talker(model.talker, model.thinker.get_input_embeddings(), model.speaker_map, config)
    assert sorted(set(narrower.suppressed.tolist())) == [61, 63] and narrower.stop_ids == [CODEC_PAD, CODEC_EOS]
