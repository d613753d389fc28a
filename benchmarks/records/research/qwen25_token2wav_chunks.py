"""Can Qwen2.5-Omni's ``token2wav`` stream? Its DiT's mel for one chunk of codes, decoded with some
codes of context either side (and the same noise, sliced), against the whole sequence's mel.

The ODE chains 36 DiT passes whose block mask (24 mel frames, 12 codes, a block) reaches a block
back and a block ahead, so in principle a frame depends on the whole utterance; measured here on the
tiny demo (2 layers), its attention and gates scaled by ``GAIN`` (at 1 the random DiT barely mixes
frames: a chunk with no context is within 5e-6 of the whole, which would prove nothing):

GAIN 10, chunks of 12 codes, 144 codes (2026-12-05, CPU, float32), max |mel difference| (peak 4.24):

| context before / after (codes) | 0 / 0 | 12 / 0 | 12 / 12 | 24 / 12 | 24 / 24 | 48 / 48 |
|---|---|---|---|---|---|---|
| | 1.3e-2 | 5.4e-3 | 9.3e-6 | 3.6e-6 | 2.4e-7 | 3.6e-7 |

and a chunk whose context starts off a block boundary (18 codes before, 24 after): 7.2e-3. So in
practice the dependence decays within a block or two: a streamed decode with its chunks' starts on
block boundaries and two blocks of context either side gives the whole decode's mel within float
noise here, and a wrong boundary or no context is 10^4 times off, which a test can tell apart. The
real DiT has 22 layers (layers 0 and 20 look back, 10 looks ahead): the context it needs must be
measured at its shapes (a GPU) before the stage's default is set.

Run:  .venv/bin/python benchmarks/records/research/qwen25_token2wav_chunks.py [GAIN]
"""
import contextlib
import os
import sys

import torch
from transformers import Qwen2_5OmniForConditionalGeneration
from triton_omni.demo_models import resolve_model

os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_num_threads(1)
CODES, CHUNK = 144, 12
SCALED = ("to_q", "to_k", "to_v", "to_out", "attn_norm.linear")  # attention, and the gates before it


@contextlib.contextmanager
def given_noise(noise: torch.Tensor):
    """``sample`` draws its initial noise with ``torch.randn``: this hands it ``noise`` instead."""
    real = torch.randn
    torch.randn = lambda *args, **kwargs: noise.clone()
    try:
        yield
    finally:
        torch.randn = real


def main():
    gain = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(resolve_model("demo:tiny-qwen2.5-omni")).eval()
    dit = model.token2wav.code2wav_dit_model
    with torch.no_grad():
        for name, weight in dit.named_parameters():
            if weight.dim() == 2 and any(part in name for part in SCALED):
                weight.mul_(gain)
    speaker = model.speaker_map["Chelsie"]
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 60, (1, CODES), generator=generator)
    noise = torch.randn(1, 2 * CODES, 80, generator=generator)

    @torch.no_grad()
    def mel(first: int, end: int) -> torch.Tensor:  # codes [first, end): mel [1, 80, 2 (end - first)]
        with given_noise(noise[:, 2 * first:2 * end]):
            return dit.sample(speaker["cond"].float(), speaker["ref_mel"].float(), codes[:, first:end])

    whole = mel(0, CODES)
    print(f"mel peak {float(whole.abs().max()):.3g}")
    for before, after in [(0, 0), (12, 0), (12, 12), (24, 12), (24, 24), (48, 48), (18, 24)]:
        worst = 0.0
        for start in range(4 * CHUNK, CODES - 4 * CHUNK, CHUNK):
            first, end = start - before, start + CHUNK + after
            part = mel(first, end)[..., 2 * before:2 * (before + CHUNK)]
            worst = max(worst, float((part - whole[..., 2 * start:2 * (start + CHUNK)]).abs().max()))
        print(f"context {before} before, {after} after: max mel difference {worst:.3g}")


if __name__ == "__main__":
    main()
