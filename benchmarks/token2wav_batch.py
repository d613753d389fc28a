"""Qwen2.5-Omni's streamed ``token2wav``: several streams' chunks decoded together (``decode_round``,
their DiT windows stacked into one ODE) against the same chunks one stream after another, the way the
speech stage's decoder thread ran them before. Each stream gets a block of codes a round (12 codes, a
block's worth of the talker's steps), after a warm-up that fills every stream's context; the figure is
a round's median time, side by side in one run, and the samples of both ways are compared. On a GPU, a
third way: together, the ODE replayed from the CUDA graphs the speech stage captures at load
(``OdeGraphs``; up to 8 windows a graph, more run eagerly), against together eagerly. Each way's
vocoder is timed apart too (its calls in a round, the device synchronised around each): what of a
round is the DiT's ODE and what the vocoder after it.

    python benchmarks/token2wav_batch.py --preset tiny [--streams 1,4,16] [--rounds 6]
    python benchmarks/token2wav_batch.py --preset realistic   # Qwen2.5-Omni-7B's token2wav, random weights, GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def token2wav(preset: str, device: str):
    """(``Qwen2_5OmniToken2WavModel`` in float32 on ``device``, a voice's (cond, ref_mel))."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel
    from triton_omni.demo_models import resolve_model

    if preset == "tiny":
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(resolve_model("demo:tiny-qwen2.5-omni"))
        decoder, speaker = model.token2wav, model.speaker_map["Chelsie"]
        voice = speaker["cond"].float(), speaker["ref_mel"].float()
    else:  # the 7B's shapes (the config's defaults), random weights
        config = Qwen2_5OmniConfig().token2wav_config
        torch.manual_seed(0)
        decoder = Qwen2_5OmniToken2WavModel(config)
        dit = config.dit_config
        voice = torch.randn(1, dit.enc_emb_dim), torch.randn(1, 300, dit.mel_dim)
    return decoder.float().to(device).eval(), voice


class VocoderClock:
    """Wraps a decoder's vocoder (``samples``) to add up the time its calls take, the device
    synchronised before and after each."""

    def __init__(self, decoder, device: str):
        self.decoder, self.device, self.spent = decoder, device, 0.0
        self.vocode = decoder.samples

    def __enter__(self) -> VocoderClock:
        def timed(mel):
            self._sync()
            began = time.perf_counter()
            samples = self.vocode(mel)
            self._sync()
            self.spent += time.perf_counter() - began
            return samples

        self.decoder.samples = timed
        return self

    def __exit__(self, *_) -> None:
        del self.decoder.samples  # the class's own method again

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=("tiny", "realistic"), default="tiny")
    parser.add_argument("--streams", default="1,4,16", help="comma-separated stream counts")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per count")
    parser.add_argument("--steps", type=int, default=10, help="the ODE's time points (generate's default: 10)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    from triton_omni.speech.token2wav import StreamingToken2Wav

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, (cond, ref_mel) = token2wav(args.preset, device)
    decoder = StreamingToken2Wav(model, num_steps=args.steps)
    decoders = {"one after another": decoder, "together": decoder}
    if device == "cuda":  # as the speech stage runs it there
        decoders["together, captured"] = StreamingToken2Wav(model, num_steps=args.steps)
        decoders["together, captured"].capture([(cond, ref_mel)], max_rows=max(map(int, args.streams.split(","))))
    block = decoder.block_codes
    warm = block * (decoder.context_blocks + 1)
    vocab = model.code2wav_dit_model.config.num_embeds
    figures = {}
    for streams in [int(n) for n in args.streams.split(",")]:
        generator = torch.Generator().manual_seed(1)
        codes = torch.randint(0, vocab, (streams, warm + block * args.rounds), generator=generator)
        times, vocoder_times, samples = {}, {}, {}
        for way, decoding in decoders.items():
            opened = [decoding.stream(cond, ref_mel, torch.Generator().manual_seed(i)) for i in range(streams)]
            chunks = [(opened[i], codes[i, :warm].tolist(), False) for i in range(streams)]
            rounds = [chunks] + [[(opened[i], codes[i, warm + r * block:warm + (r + 1) * block].tolist(), False)
                                  for i in range(streams)] for r in range(args.rounds)]
            spent, vocoding, out = [], [], [[] for _ in range(streams)]
            for r, chunk_round in enumerate(rounds):
                if device == "cuda":
                    torch.cuda.synchronize()
                began = time.perf_counter()
                with VocoderClock(decoding, device) as vocoder:
                    if way.startswith("together"):
                        results = decoding.decode_round(chunk_round)
                    else:
                        results = [decoding.decode_round([chunk])[0] for chunk in chunk_round]
                if device == "cuda":
                    torch.cuda.synchronize()
                if r > 0:  # the first round fills the context
                    spent.append(time.perf_counter() - began)
                    vocoding.append(vocoder.spent)
                for i, result in enumerate(results):
                    out[i].append(result)
            times[way] = statistics.median(spent) * 1000
            vocoder_times[way] = statistics.median(vocoding) * 1000
            samples[way] = [torch.cat(parts) for parts in out]
        apart = max(float((a - b).abs().max()) for way in samples for a, b in
                    zip(samples[way], samples["one after another"], strict=True))
        ratio = times["together"] / times["one after another"]
        figures[streams] = {"together_ms": times["together"], "one_after_another_ms": times["one after another"],
                            "ratio": ratio, "max_abs_difference": apart,
                            "vocoder_ms": vocoder_times}
        captured = ""
        if "together, captured" in times:
            figures[streams] |= {"captured_ms": times["together, captured"],
                                 "captured_ratio": times["together, captured"] / times["together"]}
            captured = (f"; the ODE captured {times['together, captured']:.1f} ms "
                        f"({figures[streams]['captured_ratio']:.3f} of eager)")
        print(f"token2wav, a block of codes for {streams} streams: together {times['together']:.1f} ms, one after "
              f"another {times['one after another']:.1f} ms ({ratio:.3f}){captured}; samples apart at most "
              f"{apart:.1e}", flush=True)
        print("  of which the vocoder: " + ", ".join(f"{way} {vocoder_times[way]:.1f} ms" for way in times), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"preset": args.preset, "device": device, "streams": figures}, out, indent=2)


if __name__ == "__main__":
    main()
