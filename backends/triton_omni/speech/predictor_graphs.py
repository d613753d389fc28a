"""The code predictor's frame on a GPU as CUDA graphs: its 15 passes and draws replayed as one.

A frame's residual codebooks take the code predictor 15 passes, each a few small kernels per
layer, run from Python: at Qwen3-Omni's shapes a frame then costs the host's launch time, not
the GPU's (``benchmarks/speech_step.py`` splits a step into its parts). Here the whole frame (the
passes over a static KV cache, each codebook's head, its draw, the next codebook's embedding) is
captured once per batch size when the stage loads and replayed at each step, the rows padded up
to the nearest captured size.

``PredictorFrame`` is that frame with static shapes, plain tensor work that also runs eagerly (the
CPU tests hold it to the eager predictor). Its draws are the eager path's (the predictor's
temperature, top-k and top-p, then the argmax of the probabilities over exponential noise, which
is ``torch.multinomial``'s one-sample path), but a row's noise for the frame's 15 draws comes from
its generator in one call before the replay, not in 15: a seeded utterance is as reproducible as
on the eager path, with other codes. Greedy rows get the eager path's codes.

With ``compile`` (the model parameter's ``predictor``), the predictor's passes and the draws run
under torch.compile inside the graph: a replay still launches every kernel on the GPU, a few
microseconds each, and inductor fuses the norms, rotary embeddings, activations and the draws'
elementwise work into far fewer. Only the captured frames call the compiled forward: the eager
path's growing ``DynamicCache`` would recompile it at every length.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from transformers import StaticCache

from triton_omni.ar.batching import filtered_probs

# the batch sizes captured: a step of n rows replays the smallest that holds them
CAPTURED_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# compiled variants a compiled pass may keep (dynamo's default is 8): its guards split the ladder of
# batch sizes (static, then dynamic, and 1 on its own), the widths and the prefills into more than that
RECOMPILE_LIMIT = 64


class PredictorFrame:
    """One frame's residual codes for ``rows`` rows, every tensor allocated once.

    Inputs (written before a run): ``hidden`` and ``first`` (each row's talker state and first
    code's embedding), ``noise`` (a sampled row's exponential noise for each draw), ``params`` (a
    row's temperature, top-k, top-p and min-p) and ``greedy``. Outputs: ``codes`` [rows, groups - 1]
    and ``total``, the sum of their embeddings."""

    def __init__(self, predictor, groups: int, rows: int, sampled: list[float], forward=None, choose=None):
        """``forward``, ``choose``: the predictor's model and the draw to run (compiled ones), by
        default the model itself and ``choose_codes``."""
        config = predictor.config
        device, dtype = predictor.lm_head[0].weight.device, predictor.lm_head[0].weight.dtype
        self.predictor, self.draws = predictor, groups - 1
        self.forward, self.choose = forward or predictor.model, choose or choose_codes
        self.hidden = torch.zeros(rows, 1, config.hidden_size, device=device, dtype=dtype)
        self.first = torch.zeros_like(self.hidden)
        self.noise = torch.ones(rows, self.draws, config.vocab_size, device=device)
        self.params = torch.tensor([sampled] * rows, device=device)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        self.cache = StaticCache(config=config, max_cache_len=groups)  # 2 positions, then one a draw
        # pass 0 reads positions 0 and 1, pass t position t + 1: each attends to the positions up to its own
        self.positions = [torch.tensor([[0, 1]], device=device)] + [
            torch.tensor([[t + 1]], device=device) for t in range(1, self.draws)]
        keys = torch.arange(groups, device=device)
        self.masks = [{kind: (keys[None, :] <= p[0][:, None])[None, None].expand(rows, 1, -1, -1)
                       for kind in set(config.layer_types)} for p in self.positions]
        self.codes = self.total = None
        self.flags: tuple[bool, ...] | None = None  # the greedy rows ``greedy`` holds
        if forward is not None:
            self._prime()

    @torch.inference_mode()
    def _prime(self) -> None:
        """The static cache's layers made by one uncompiled pass (``run`` starts them over): made
        by a compiled first call, they would take a compiled variant of their own."""
        self.predictor.model(inputs_embeds=torch.cat([self.hidden, self.first], dim=1), attention_mask=self.masks[0],
                             position_ids=self.positions[0], past_key_values=self.cache, use_cache=True)

    @torch.inference_mode()
    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()  # the stale keys past it are masked out
        inputs = torch.cat([self.hidden, self.first], dim=1)
        codes, total = [], torch.zeros_like(self.first)
        for draw in range(self.draws):
            out = self.forward(inputs_embeds=inputs, attention_mask=self.masks[draw],
                                       position_ids=self.positions[draw], past_key_values=self.cache, use_cache=True)
            logits = self.predictor.lm_head[draw](out.last_hidden_state[:, -1]).float()
            code = self.choose(logits, self.params, self.noise[:, draw], self.greedy)
            codes.append(code)
            inputs = self.predictor.get_input_embeddings()[draw](code)[:, None]
            total = total + inputs
        self.codes, self.total = torch.stack(codes, dim=1), total
        return self.codes, self.total


def choose_codes(logits: torch.Tensor, params: torch.Tensor, noise: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Each row's code: the argmax of its filtered probabilities over its exponential ``noise``
    (``torch.multinomial``'s one-sample path), or of its logits where ``greedy``."""
    probs, order = filtered_probs(logits, params)
    picks = order.gather(1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), picks)


class PredictorGraphs:
    """A ``PredictorFrame`` captured as a CUDA graph for each of ``CAPTURED_ROWS`` up to ``max_rows``,
    all in one memory pool (a step replays one of them); with ``compile``, its passes and draws
    compiled first (each shape compiles in the warm-up before its capture)."""

    def __init__(self, predictor, groups: int, max_rows: int, sampled: list[float], compile: bool = False):
        self.device = predictor.lm_head[0].weight.device
        forward, choose = (compiled_forward(predictor.model), torch.compile(own_code(choose_codes))) if compile \
            else (None, None)
        sizes = [n for n in CAPTURED_ROWS if n < max_rows] + [max_rows]
        pool = torch.cuda.graph_pool_handle()
        self.frames: dict[int, tuple[PredictorFrame, torch.cuda.CUDAGraph]] = {}
        with torch.cuda.device(self.device), compiling(compile):
            for rows in sorted(sizes, reverse=True):  # the largest first: the others fit in its pool
                frame = PredictorFrame(predictor, groups, rows, sampled, forward, choose)
                self.frames[rows] = frame, captured(frame.run, pool)

    def __call__(self, hidden: torch.Tensor, first: torch.Tensor, greedy: list[bool],
                 generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's residual codes and their embeddings' sum; ``generators``: a sampled row's."""
        rows = hidden.shape[0]
        size = min(n for n in self.frames if n >= rows)
        frame, graph = self.frames[size]
        frame.hidden[:rows].copy_(hidden)
        frame.first[:rows].copy_(first)
        flags = tuple(greedy) + (True,) * (size - rows)  # the padding rows draw greedily, unread
        if flags != frame.flags:  # rows join and leave far less often than they step
            frame.greedy.copy_(torch.tensor(flags).to(self.device, non_blocking=True))
            frame.flags = flags
        for row, generator in enumerate(generators):
            if not greedy[row]:
                frame.noise[row].exponential_(1, generator=generator)
        graph.replay()
        return frame.codes[:rows].clone(), frame.total[:rows].clone()


def compiled_forward(model: torch.nn.Module):
    """The predictor ``model``'s forward under torch.compile, with a code object of this call's
    own (``own_code``)."""
    return functools.partial(torch.compile(own_code(_predictor_pass)), model)


def own_code(function: types.FunctionType) -> types.FunctionType:
    """``function`` with a code object of its own. torch.compile keeps a function's compiled
    variants on its code object, shared by every copy compiled in the process: transformers wraps
    every model's forward in one decorator, so the predictor's shapes would share one set with
    any other model compiled in the process, and another runner's (another dtype) would find it
    full; past ``recompile_limit`` a shape runs eagerly, silently."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


@contextlib.contextmanager
def compiling(compile: bool = True):
    """Compiles inside it keep up to ``RECOMPILE_LIMIT`` variants, and one past it fails (the load)
    instead of running its shape eagerly."""
    if not compile:
        yield
        return
    config = torch._dynamo.config
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True))
        except AttributeError:  # a PyTorch without the option: past the limit, a shape runs eagerly
            stack.enter_context(config.patch(recompile_limit=RECOMPILE_LIMIT))
        yield


def _predictor_pass(model, **inputs):
    return model(**inputs)


def captured(run, pool, warmups: int = 2) -> torch.cuda.CUDAGraph:
    """``run`` called ``warmups`` times on a side stream (lazy set-ups: caches, kernels), then captured
    in ``pool``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph
