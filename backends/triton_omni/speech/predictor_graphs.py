"""The code predictor's frame on a GPU as CUDA graphs: its 15 passes and draws replayed as one.

A frame's residual codebooks take the code predictor 15 passes, each a few small kernels per
layer, run from Python: at Qwen3-Omni's shapes a frame then costs the host's launch time, not
the GPU's (``benchmarks/speech_step.py`` splits a step into its parts). Here the whole frame (the
passes over a static KV cache, each codebook's head, its draw, the next codebook's embedding) is
captured once per batch size when the stage loads and replayed at each step, the rows padded up
to the nearest captured size.

``PredictorFrame`` is that frame with static shapes, plain tensor work that also runs eagerly (the
CPU tests hold it to the eager predictor). Its passes are transformers' decoder layers over a KV
cache of the frame's own, with what transformers' model computes at every pass made once: the
rotary embedding of each pass's positions and each pass's mask, additive. Its attention reads the
keys and values as they are, one copy for all the query heads that share them, not repeated for
each of them: a frame's query heads of a key head are folded into the query's positions (a pass
reads one or two positions, the mask says which keys each sees), which leaves transformers' two
copies a layer and pass (``repeat_kv``, that SDPA with a mask needs) and the mask's conversion out
of each of the frame's 75 passes through a layer. Its draws are the eager path's (the predictor's
temperature, top-k and top-p, then the argmax of the probabilities over exponential noise, which
is ``torch.multinomial``'s one-sample path), but a row's noise for the frame's 15 draws comes from
its generator in one call before the replay, not in 15: a seeded utterance is as reproducible as
on the eager path, with other codes. A draw ranks only the codes its top-k keeps (a ``topk``, not
the codebook's sort): the same distribution, and on a CPU the same codes (on a GPU, tied logits
may rank in another order, and sums over fewer columns round otherwise). Greedy rows get the eager
path's codes (in bfloat16 on a GPU, but at a near tie, which another attention kernel may break
otherwise).

With ``compile`` (the model parameter's ``predictor``), the predictor's passes and the draws run
under torch.compile inside the graph: a replay still launches every kernel on the GPU, a few
microseconds each, and inductor fuses the norms, rotary embeddings, activations and the draws'
elementwise work into far fewer. Only the captured frames run this pass; the eager path (a CPU,
or ``cuda_graphs: false``) runs transformers' model over a growing ``DynamicCache``.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

from triton_omni.ar.batching import filtered_probs
from triton_omni.speech.attention import folded_attention, folded_mask, queries_keys_values

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
        """``forward``, ``choose``: the pass (``predictor_pass``'s arguments after the model) and the
        draw to run (compiled ones), by default ``predictor_pass`` and ``choose_codes``."""
        config, model = predictor.config, predictor.model
        device, dtype = predictor.lm_head[0].weight.device, predictor.lm_head[0].weight.dtype
        self.predictor, self.draws = predictor, groups - 1
        self.forward = forward or functools.partial(predictor_pass, model)
        self.choose = choose or choose_codes
        self.hidden = torch.zeros(rows, 1, config.hidden_size, device=device, dtype=dtype)
        self.first = torch.zeros_like(self.hidden)
        self.noise = torch.ones(rows, self.draws, config.vocab_size, device=device)
        temperature, top_k, top_p, min_p = sampled
        top_k = int(top_k) or config.vocab_size  # 0: no top-k (``SamplingOptions``'), the whole codebook
        self.params = torch.tensor([[temperature, top_k, top_p, min_p]] * rows, device=device)
        # every row samples with the same top-k: only that many codes are ranked, not the codebook
        self.ranked = top_k if top_k < config.vocab_size else None
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        attention = model.layers[0].self_attn
        windows = [layer.self_attn.sliding_window for layer in model.layers]
        if any(window is not None and window < groups for window in windows):  # its passes see every position
            raise ValueError(f"the code predictor's sliding windows {windows} are shorter than its frame ({groups})")
        self.keys = [torch.zeros(rows, config.num_key_value_heads, groups, attention.head_dim, device=device,
                                 dtype=dtype) for _ in model.layers]
        self.values = [torch.zeros_like(keys) for keys in self.keys]
        # pass 0 reads positions 0 and 1, pass t position t + 1: each attends to the positions up to its own
        self.positions = [torch.tensor([0, 1], device=device)] + [
            torch.tensor([t + 1], device=device) for t in range(1, self.draws)]
        self.rotary = [model.rotary_emb(self.hidden, p[None]) for p in self.positions]
        shared = config.num_attention_heads // config.num_key_value_heads
        self.masks = [folded_mask(p, groups, shared, dtype) for p in self.positions]
        self.codes = self.total = None
        self.flags: tuple[bool, ...] | None = None  # the greedy rows ``greedy`` holds

    @torch.inference_mode()
    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.cat([self.hidden, self.first], dim=1)
        codes, total = [], torch.zeros_like(self.first)
        for draw in range(self.draws):
            hidden = self.forward(inputs, *self.rotary[draw], self.masks[draw], self.positions[draw], self.keys,
                                  self.values)
            logits = self.predictor.lm_head[draw](hidden[:, -1]).float()
            code = self.choose(logits, self.params, self.noise[:, draw], self.greedy, self.ranked)
            codes.append(code)
            inputs = self.predictor.get_input_embeddings()[draw](code)[:, None]
            total = total + inputs
        self.codes, self.total = torch.stack(codes, dim=1), total
        return self.codes, self.total


def predictor_pass(model, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                   positions: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """The code predictor ``model``'s pass over ``hidden`` [rows, n, width] at ``positions`` (their
    rotary ``cos`` and ``sin``, their ``folded_mask``): transformers' decoder layers and final norm,
    each layer's keys and values written at ``positions`` of its ``keys`` and ``values`` buffers
    [rows, key heads, groups, head_dim] and read as they are (``folded_attention``)."""
    for layer, layer_keys, layer_values in zip(model.layers, keys, values, strict=True):
        attention = layer.self_attn
        query, key, value = queries_keys_values(attention, layer.input_layernorm(hidden))
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        layer_keys.index_copy_(2, positions, key)
        layer_values.index_copy_(2, positions, value)
        attended = folded_attention(query, layer_keys, layer_values, mask, attention.scaling)
        hidden = hidden + attention.o_proj(attended)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.norm(hidden)


def choose_codes(logits: torch.Tensor, params: torch.Tensor, noise: torch.Tensor, greedy: torch.Tensor,
                 ranked: int | None = None) -> torch.Tensor:
    """Each row's code: the argmax of its filtered probabilities over its exponential ``noise``
    (``torch.multinomial``'s one-sample path; a rank's noise is its column's), or of its logits
    where ``greedy``. ``ranked``: ``filtered_probs``' (the most any row's top-k keeps)."""
    probs, order = filtered_probs(logits, params, ranked)
    picks = order.gather(1, (probs / noise[:, :probs.shape[-1]]).argmax(dim=-1, keepdim=True)).squeeze(1)
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
    """``predictor_pass`` for ``model`` under torch.compile, with a code object of this call's own
    (``own_code``)."""
    return functools.partial(torch.compile(own_code(predictor_pass)), model)


def own_code(function: types.FunctionType) -> types.FunctionType:
    """``function`` with a code object of its own. torch.compile keeps a function's compiled
    variants on its code object, shared by every copy compiled in the process: another runner's
    frames (another dtype, another model) compiling the same function would find its variants
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
