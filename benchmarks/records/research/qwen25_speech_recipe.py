"""Qwen2.5-Omni's spoken reply rebuilt from the thinker's ids and states, held to the model's own
``generate(return_audio=True)`` on the tiny demo (``demo:tiny-qwen2.5-omni``): the groundwork for the
speech stage's Qwen2.5-Omni path (issue 74), not product code.

Measured (2026-12-05, transformers 5.19.0, CPU, float32): greedy thinker and talker, the talker's
60 codes equal generate's; the waveform from ``token2wav`` over the whole code sequence, with the
noise drawn from the same global RNG state, equal to generate's bit for bit (max difference 0.0 of
a peak 0.18); another noise seed moves it by 0.105. What it takes:

- the thinker's states: for the prompt and every reply token but the last, its layer-0 input
  (token embeddings) plus its last layer (after the final norm), summed in the thinker's dtype; one
  pass over prompt + reply[:-1] gives the same states as generate's steps (within 2.4e-7);
- the talker's prefill: those sums for the prompt, the voice's ``bos_token`` embedding (the
  thinker's table), then the first reply token's sum; then one state a step: reply tokens 1..n-2,
  the text-eos embedding, then the text-pad embedding for every step after;
- NOT the codec pad and bos embeddings the talker's forward adds at its prefill's last two
  positions: generate (5.19) passes the talker no attention mask, and the forward adds them only
  with one, so the reference never has them (adding them moved the prefill's logits by 0.033 and
  the codes from the 13th on);
- positions 0..P+1 then one a step (text only: the three mrope rows equal);
- repetition penalty 1.05 over the prompt's codec ids (mask x P, pad, bos) and the codes drawn,
  the codec bos suppressed; stop at the codec pad or eos, dropped;
- ``token2wav`` in float32 on the whole sequence (its ODE chains 36 DiT passes whose block mask
  reaches a block back and ahead each: no chunk of codes decodes alone to the same samples).

Run:  .venv/bin/python benchmarks/records/research/qwen25_speech_recipe.py ["prompt" [Chelsie|Ethan]]
"""
import os
import sys

import torch
from transformers import AutoTokenizer, DynamicCache, Qwen2_5OmniForConditionalGeneration
from triton_omni.demo_models import resolve_model
from triton_omni.speech.demos import CODEC_BOS, CODEC_EOS, CODEC_MASK, CODEC_PAD

os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_num_threads(1)
STOP = [CODEC_PAD, CODEC_EOS]
PENALTY = 1.05


def reference(model, ids, voice):
    """generate's reply ids, codes and waveform (greedy; seed 7)."""
    seen = {}
    token2wav = model.token2wav.forward

    def keep(code, *args, **kwargs):
        seen["codes"] = code[0].tolist()
        return token2wav(code, *args, **kwargs)

    model.token2wav.forward = keep
    torch.manual_seed(7)
    with torch.no_grad():
        seq, wav = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker=voice,
                                  thinker_max_new_tokens=12, thinker_do_sample=False, talker_do_sample=False,
                                  talker_eos_token_id=STOP, talker_max_new_tokens=60)
    model.token2wav.forward = token2wav
    return seq[0, ids.shape[1]:].tolist(), seen["codes"], wav.flatten()


@torch.no_grad()
def rebuilt(model, ids, reply, voice, max_codes=60):
    thinker, talker = model.thinker, model.talker
    prompt_len = ids.shape[1]
    tokens = torch.tensor([ids[0].tolist() + reply[:-1]])
    states = thinker(input_ids=tokens, output_hidden_states=True).hidden_states
    both = states[0][0] + states[-1][0]
    embed = thinker.get_input_embeddings()
    speaker = model.speaker_map[voice]
    bos = embed(torch.tensor([speaker["bos_token"]]))
    prefill = torch.cat([both[:prompt_len], bos, both[prompt_len:prompt_len + 1]])
    queue = [*both[prompt_len + 1:].unbind(0), embed(torch.tensor([talker.config.tts_text_end_token_id]))[0],
             embed(torch.tensor([talker.config.tts_text_pad_token_id]))[0]]
    cache, codec = DynamicCache(), talker.model.embed_tokens
    inputs = talker.thinker_to_talker_proj(prefill)[None]
    positions = torch.arange(inputs.shape[1])[None, None].expand(3, 1, -1)
    hidden = talker.model(inputs_embeds=inputs, position_ids=positions, past_key_values=cache,
                          use_cache=True).last_hidden_state
    history, codes = [CODEC_MASK] * prompt_len + [CODEC_PAD, CODEC_BOS], []
    for step in range(max_codes):
        logits = talker.codec_head(hidden[:, -1]).float()[0]
        seen = torch.tensor(sorted(set(history)))
        logits[seen] = torch.where(logits[seen] < 0, logits[seen] * PENALTY, logits[seen] / PENALTY)
        logits[CODEC_BOS] = float("-inf")
        code = int(logits.argmax())
        history.append(code)
        if code in STOP:
            break
        codes.append(code)
        state = queue.pop(0) if len(queue) > 1 else queue[0]
        position = torch.full((3, 1, 1), inputs.shape[1] + step)
        step_inputs = talker.thinker_to_talker_proj(codec(torch.tensor([code]))[0] + state)[None, None]
        hidden = talker.model(inputs_embeds=step_inputs, position_ids=position, past_key_values=cache,
                              use_cache=True).last_hidden_state
    torch.manual_seed(7)  # generate's draws: none before the noise with greedy decoding
    wav = model.token2wav(torch.tensor([codes]), conditioning=speaker["cond"].float(),
                          reference_mel=speaker["ref_mel"].float())
    return codes, wav.flatten()


def main():
    path = resolve_model("demo:tiny-qwen2.5-omni")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    prompt = sys.argv[1] if len(sys.argv) > 1 else "a lighthouse at night"
    voice = sys.argv[2] if len(sys.argv) > 2 else "Chelsie"
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    reply, codes, wav = reference(model, ids, voice)
    mine, mine_wav = rebuilt(model, ids, reply, voice)
    print(f"codes: generate {len(codes)}, rebuilt {len(mine)}, equal {codes == mine}")
    print(f"waveform: {len(wav)} samples, max difference {float((wav - mine_wav).abs().max()):.3g} "
          f"(peak {float(wav.abs().max()):.3g})")


if __name__ == "__main__":
    main()
