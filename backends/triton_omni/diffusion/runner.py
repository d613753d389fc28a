"""``DiffusionRunner``: a diffusers text-to-image pipeline, batched exactly.

Stable Diffusion, Qwen-Image and Z-Image pipelines, each through its family
adapter (``families.py``): the pipeline's own text recipe for a ``prompt``,
its own guidance rule, its own ``__call__``.

Exact batching, as a recipe:
1. every text prompt is encoded on its own (batch 1), so its embeddings never
   depend on its neighbours;
2. requests are grouped by what one pipeline call must share (size, steps,
   guidance, token count);
3. each group runs in chunks padded to one fixed batch size, with one
   generator per request. At a fixed batch size the UNet/VAE rows are
   bit-identical whatever the other rows hold (batch *size* changes kernel
   choice and the low bits), so a request's image depends only on its own
   inputs and seed. ``exact_batching=False`` skips the padding: faster for
   small batches, but images may differ in the last bit with the batch size.
   ``exact_batching="pipeline"`` runs each request's own pipeline call (under
   step batching, its own forward passes), at the batch size diffusers' call
   for that request alone uses: every image equals that call's bit for bit,
   on any device and dtype, and batching's gain is given up.

``batching="step"`` replaces whole-batch calls with the step engine
(``steps.py``): requests join and leave the running batch at every
denoising step; ``submit`` hands it one request at a time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from triton_omni.demo_models import build_in_memory, in_memory, resolve_model
from triton_omni.diffusion.cfg_parallel import CfgParallel
from triton_omni.diffusion.cuda_graphs import GraphedDenoiser
from triton_omni.diffusion.kernels import (
    FP8_SCALES,
    QUANTIZATIONS,
    Fp8Plan,
    NetworkKernels,
    channels_last_convolutions,
    check_fp8,
    convolutions_pad_space,
    gelu_feed_forwards,
    resolve_attention,
    spread_group_norms,
)
from triton_omni.diffusion.request import DiffusionLimits, DiffusionRequest
from triton_omni.diffusion.sequence_parallel import SequenceParallel
from triton_omni.diffusion.step_cache import parse_step_cache
from triton_omni.diffusion.steps import STEPS_AHEAD, StepEngine, StepJob, to_pixels
from triton_omni.dtypes import torch_dtype
from triton_omni.errors import RequestCancelledError, RequestValidationError
from triton_omni.families import FAMILIES, Family, Guidance, StepAdapter, family_of
from triton_omni.gpu_memory import cap_torch
from triton_omni.lora import AdapterError, Adapters, read_experts_adapter, read_pipeline_adapter
from triton_omni.transfers import to_device

logger = logging.getLogger(__name__)

# (request index, step just finished, total steps)
StepCallback = Callable[[int, int, int], None]
IsCancelled = Callable[[int], bool]


# what `compile` may name, comma-separated ("off": none): a DiT's repeated blocks, the VAE's decoder
COMPILE_PARTS = ("blocks", "vae")
EXACT_MODES = ("true", "false", "pipeline")
# torch.compile's arguments for `compile` (a test makes sizes dynamic from the start)
COMPILE_OPTIONS: dict[str, Any] = {}


class CompileWatch:
    """``on_compile(seconds)`` after each torch.compile compilation in this process, through
    dynamo's compile callbacks (a compile that sets off others, a graph break's, is one).

    Why: a compile that happens under load stalls every request of its step batch for seconds.
    That happens when a shape, a guard or a recompile limit is missed at warm-up. The metric it
    feeds shows it, and so do the benchmarks, which read it around their timed rounds."""

    def __init__(self, on_compile: Callable[[float], None]):
        from torch._dynamo.callback import callback_handler

        self._handler, self._on_compile, self._started = callback_handler, on_compile, None
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, *_) -> None:  # torch's callbacks take a CallbackArgs (older versions: nothing)
        self._started = time.monotonic()

    def _end(self, *_) -> None:
        if self._started is not None:
            self._on_compile(time.monotonic() - self._started)
            self._started = None

    def close(self) -> None:
        """Stop watching. ``torch._dynamo.reset()`` clears every callback, so they may be gone."""
        for callbacks, callback in ((self._handler.start_callbacks, self._start),
                                    (self._handler.end_callbacks, self._end)):
            if callback in callbacks:
                callbacks.remove(callback)


def compile_blocks(transformer: torch.nn.Module, options: dict) -> None:
    """The forward of each repeated block of a diffusion transformer compiled with torch.compile, in
    place. Why blocks rather than the whole model: the blocks share one code, compiled once for all
    of them, in seconds rather than minutes, and a step that skips blocks or runs a sub-batch still
    finds them compiled. Why the forward rather than the module: the step cache's hooks wrap the
    forward later and stay eager Python; compiled with the block, their per-request state would
    recompile it at every step. Each new shape (batch, image size, token count) compiles on its first
    step; after the second, torch marks the sizes that changed dynamic."""
    for block in transformer.modules():
        if type(block).__name__ in transformer._repeated_blocks:
            block.forward = torch.compile(block.forward, **options)


@dataclass(frozen=True)
class DiffusionRunnerConfig:
    model: str
    device: str = "cpu"
    dtype: str = "auto"  # auto: float16 on CUDA, float32 on CPU
    batch_size: int = 8
    # True/"true": padded to one batch size; False/"false": not; "pipeline": each request's passes alone
    exact_batching: bool | str = True
    # Replay the UNet's steps as CUDA graphs (cuda_graphs.py); CUDA only, ignored on CPU.
    cuda_graphs: bool = True
    limits: dict[str, Any] = field(default_factory=dict)  # DiffusionLimits overrides
    defaults: dict[str, Any] = field(default_factory=dict)  # default steps/size/guidance
    # This model's share of its GPU: the torch allocator is capped at it (gpu_memory.py).
    gpu_memory_utilization: float | None = None
    # "request": whole batches, start to end; "step": requests join and leave at every step (steps.py)
    batching: str = "request"
    # step batching: UNet rows in flight at most (a request with guidance takes two); 0: 2 x batch_size
    max_rows: int = 0
    on_full: str = "wait"  # step batching beyond max_rows: "wait" (FIFO) or "reject"
    # step batching: which group of requests (size, token count) steps next (steps.py)
    group_order: str = "most_behind"
    # step batching on a GPU: steps queued before the engine waits for the oldest (0: no bound; steps.py)
    steps_ahead: int = STEPS_AHEAD
    # step batching, DiT families: every request's step cache unless it says otherwise (step_cache.py)
    step_cache: str = "off"
    # CFG parallel (step batching, where the family takes it): the negatives' pass on this second device
    cfg_device: str | None = None
    # "blocks": torch.compile each repeated block of a diffusion transformer (regional compilation);
    # "vae": the VAE's decoder; "blocks,vae": both; "off": neither
    compile: str = "off"
    # sequence parallel: the transformer's forward over this device and these (sequence_parallel.py)
    sp_devices: tuple[str, ...] = ()
    # LoRA adapters a request may name (lora.py): name -> folder, file or hub id; and how many stay on the device
    lora_adapters: dict[str, str | dict[str, str]] = field(default_factory=dict)
    max_loras: int = 4
    # a pass whose requests all run one adapter at one scale runs it fused into copies of the weights (lora.py)
    lora_fuse: bool = False
    # "fp8": the DiT's block layers in float8 (kernels.py); fp8_kept: layers left in bf16 (None: the family's)
    quantization: str = "none"
    fp8_kept: tuple[str, ...] | None = None
    fp8_scales: str = "row"  # "row" or "tensor" (kernels.py)
    # each attention's q, k and v projections one linear layer (kernels.py), where the family's attention takes it
    fuse_projections: bool = False
    # on a GPU, each feed-forward's tanh GELU applied in its projection's matmul (kernels.py)
    gelu_epilogue: bool = False
    # diffusers' attention kernel for the DiT: "auto" (the fastest this host runs), or a backend's name
    attention_backend: str = "auto"

    def __post_init__(self):
        if self.batching not in ("request", "step"):
            raise ValueError(f"batching must be 'request' or 'step', got {self.batching!r}")
        if self.exact_mode not in EXACT_MODES:
            raise ValueError(f"model parameter exact_batching must be one of {', '.join(EXACT_MODES)}, "
                             f"got {self.exact_batching!r}")
        try:
            step_cache = parse_step_cache(self.step_cache)
        except ValueError as exc:
            raise ValueError(f"model parameter step_cache {self.step_cache!r}: {exc}") from None
        if step_cache.on and self.batching != "step":
            raise ValueError("model parameter step_cache needs batching 'step' (the cache is kept per request "
                             "between its steps)")
        if self.cfg_device is not None and self.batching != "step":
            raise ValueError("CFG parallel (parallel 'cfg') needs batching 'step'")
        if not self.compiled <= set(COMPILE_PARTS):  # "", "," and unknown parts alike
            raise ValueError(f"model parameter compile must be off or one or more of {', '.join(COMPILE_PARTS)} "
                             f"(comma-separated), got {self.compile!r}")
        if self.sp_devices:
            self._check_sequence_parallel(step_cache.on)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"model parameter quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.fp8_scales not in FP8_SCALES:
            raise ValueError(f"model parameter fp8_scales must be one of {', '.join(FP8_SCALES)}, "
                             f"got {self.fp8_scales!r}")
        if self.quantization != "none" and self.lora_adapters:
            raise ValueError(f"model parameter quantization {self.quantization!r}: not with lora_adapters (an "
                             "adapter's factors are added to the bf16 layers they wrap)")
        if self.fuse_projections and self.lora_adapters:
            raise ValueError("model parameter fuse_projections: not with lora_adapters (adapters wrap the "
                             "separate projections)")
        if self.fuse_projections and self.exact_mode == "pipeline":
            raise ValueError("model parameter fuse_projections: not with exact_batching pipeline (whose "
                             "promise is the pipeline's own layers)")
        if self.gelu_epilogue and self.lora_adapters:
            raise ValueError("model parameter gelu_epilogue: not with lora_adapters (an adapter wraps the "
                             "projection the epilogue's matmul reads around)")
        if self.gelu_epilogue and self.quantization != "none":
            raise ValueError(f"model parameter gelu_epilogue: not with quantization {self.quantization!r} (the "
                             "feed-forwards' projections are then FP8 layers, whose GELU compile: blocks fuses "
                             "into their output's quantization)")
        if self.gelu_epilogue and self.exact_mode == "pipeline":
            raise ValueError("model parameter gelu_epilogue: not with exact_batching pipeline (whose "
                             "promise is the pipeline's own kernels)")
        if self.lora_fuse and not self.lora_adapters:
            raise ValueError("model parameter lora_fuse: this model has no lora_adapters to fuse")
        if self.lora_fuse and self.exact_mode != "false":
            raise ValueError("model parameter lora_fuse needs exact_batching false: a fused adapter's image is "
                             "within a level of the unfused one, so a request's image would depend on its company")
        if self.lora_adapters and (self.sp_devices or self.cfg_device is not None):
            raise ValueError("model parameter lora_adapters: not with a parallel mode (its workers hold the "
                             "transformer without the adapters)")

    @property
    def compiled(self) -> frozenset[str]:
        """The parts ``compile`` names: ``blocks``, ``vae``; none for ``off``."""
        if self.compile == "off":
            return frozenset()
        return frozenset(part.strip() for part in self.compile.split(","))

    def _check_sequence_parallel(self, step_cache: bool) -> None:
        """What sequence parallel does not combine with, refused at load: every rank must run the
        same blocks, so no step cache (its decision is taken per rank, on the rank's share); one
        parallel mode at a time; the blocks as loaded: eager, in bf16, with diffusers' attention and
        projections (the workers are not compiled, quantized, fused or given another kernel)."""
        for clash, what in ((step_cache, "a step cache"), (self.cfg_device is not None, "CFG parallel"),
                            ("blocks" in self.compiled, f"compile {self.compile!r}"),
                            (self.quantization != "none", f"quantization {self.quantization!r}"),
                            (self.fuse_projections, "fuse_projections"),
                            (self.gelu_epilogue, "gelu_epilogue"),
                            (self.attention_backend != "auto", f"attention_backend {self.attention_backend!r}")):
            if clash:
                raise ValueError(f"sequence parallel does not combine with {what}")

    @property
    def exact_mode(self) -> str:
        """``exact_batching`` as one of ``EXACT_MODES`` (a bool reads as ``"true"``/``"false"``)."""
        return str(self.exact_batching).lower()

    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype, self.device, cuda_default=torch.float16)


# An edit model's defaults where they differ (a model's `limits` parameter still sets them)
EDIT_LIMITS = {"max_size": 2048, "max_embeds_tokens": 2048}

@dataclass
class _Job:
    index: int
    request: DiffusionRequest
    cond: torch.Tensor  # [T, H]
    uncond: torch.Tensor | None  # [T', H] when guidance is on
    pooled: torch.Tensor | None = None  # [P] where the family reads a pooled embedding
    scale_read: bool = False  # the network reads the scale itself (guidance-distilled), negative pass or not

    def group_key(self) -> tuple:
        r = self.request
        guided = self.uncond is not None
        return (r.height, r.width, r.num_frames, r.num_inference_steps,
                r.guidance_scale if guided or self.scale_read else 0.0, r.guidance_scale_2 if guided else None,
                self.cond.shape[0], self.uncond.shape[0] if guided else 0,
                id(r) if r.images else None,  # a call's input images are every row's: such a request runs alone
                r.lora, r.lora_scale if r.lora else None)  # and so is its adapter


class DiffusionRunner:
    def __init__(self, config: DiffusionRunnerConfig, on_batch: Callable[[int], None] | None = None,
                 on_capture: Callable[[], None] | None = None, on_lora: Callable[[str, str], None] | None = None,
                 on_compile: Callable[[float], None] | None = None):
        """``on_batch``: step batching calls it with each step's request count;
        ``on_capture``: called after each CUDA graph capture; ``on_lora(event, adapter)``: each
        request with an adapter, each adapter loaded and each evicted (``lora.Adapters``);
        ``on_compile(seconds)``: with ``compile``, after each torch.compile compilation
        (``CompileWatch``)."""
        from diffusers import DiffusionPipeline

        self.config = config
        self._on_lora = on_lora
        self.step_cache = parse_step_cache(config.step_cache)  # the model's default
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype()
        built_here = in_memory(config.model)
        path = config.model if built_here else resolve_model(config.model)
        if config.gpu_memory_utilization is not None:
            cap_torch(config.gpu_memory_utilization, config.device)

        def load() -> None:
            self.pipeline = build_in_memory(config.model, self.device, self.dtype) if built_here \
                else DiffusionPipeline.from_pretrained(path, dtype=self.dtype).to(self.device)
            self.pipeline.set_progress_bar_config(disable=True)
            self.family: Family = family_of(self.pipeline)

        # step batching: the engine's thread runs every torch operation, the load included (steps.py)
        self.steps = self._step_engine(load, on_batch) if config.batching == "step" else None
        if self.steps is None:
            load()
        capabilities = self.family.capabilities
        hidden = self.family.hidden_size()
        # an edit's output is its input image's size by default (about 1024² pixels, a side up to 2048),
        # and its embeddings hold the image's vision tokens beside the prompt's (about 1340 for 1024²)
        self.output = self.family.output  # an image or a video: what each request's result is
        # what the family makes is its own: the `limits` parameter bounds requests, it does not redefine a video
        made = {"frames_step": self.family.frames_step(), "default_frames": self.output.default_frames,
                "fps": self.output.fps}
        self.limits = DiffusionLimits(**({"hidden_size": hidden, "size_multiple": self.family.size_multiple(),
                                          "pooled_size": self.family.pooled_size(), "max_images": capabilities.images}
                                         | (EDIT_LIMITS if capabilities.edits else {}) | self.output.limits()
                                         | config.limits | made))
        self.graphs: GraphedDenoiser | None = None
        self.sequence_parallel: SequenceParallel | None = None
        self.cfg_parallel: CfgParallel | None = None
        self.adapters: Adapters | None = None
        self.compile_watch: CompileWatch | None = None
        self._empty: torch.Tensor | None = None  # the encoding of "" (_empty_prompt)
        try:
            if config.lora_adapters:  # before compile: the adapted layers are part of the compiled blocks
                self._load_adapters()
            if config.sp_devices:
                self._sequence_parallel([torch.device(d) for d in config.sp_devices])
            if self.step_cache.on and not capabilities.step_cache:
                raise ValueError(f"model parameter step_cache {config.step_cache!r}: the {self.family.name} "
                                 "family has no step cache (it skips a diffusion transformer's blocks)")
            kernels, graphed = self._kernels(), self._graphed()
            if self.steps is not None:  # a step of 3 rows runs 3, unless graphs or compiled code want few sizes
                self.steps.fixed_shapes = graphed or "blocks" in config.compiled
            if config.cfg_device is not None:  # before rank 0's kernels: the worker takes the weights as loaded
                self._parallel_cfg(torch.device(config.cfg_device), kernels, graphed)
            for network in self.family.networks:
                self._on_torch_thread(lambda network=network: kernels.apply(network))
            spread = self._vae_kernels()
            if self.steps is not None:  # a compiled decoder keeps one shape; a spread one is faster alone
                self.steps.decode_alone = spread or "vae" in config.compiled
            if config.compiled and on_compile is not None:
                self.compile_watch = CompileWatch(on_compile)
            self._compile()
            if graphed:
                self.graphs = self._graphs(on_capture)
        except Exception:
            self.close()
            raise
        logger.info("Diffusion runner ready: %s (%s, family %s) on %s, %s, hidden %d, CUDA graphs %s, %s batching",
                    path, type(self.pipeline).__name__, self.family.name, self.device, self.dtype, hidden,
                    "on" if self.graphs else "off", config.batching)

    def _load_adapters(self) -> None:
        if not self.family.capabilities.lora:
            raise ValueError(f"model parameter lora_adapters: the {self.family.name} family takes no LoRA adapters "
                             "per request (its denoiser is not a diffusion transformer)")
        c = self.config
        networks, flattened = self.family.networks, self.family.lora_flattened
        if len(networks) == 1:
            for name, source in c.lora_adapters.items():
                if not isinstance(source, str):
                    raise AdapterError(f"LoRA adapter {name!r} names a file per denoiser, and this model has one: "
                                       "give its path")
            network, read = networks[0], functools.partial(read_pipeline_adapter, self.pipeline, networks[0])
        else:  # several denoisers: one adapter holds a part for each (its layers named from the component)
            components = {id(module): component for component, module in self.pipeline.components.items()}
            named = {components[id(network)]: network for network in networks}  # transformer, transformer_2
            network, read = torch.nn.ModuleDict(named), functools.partial(read_experts_adapter, self.pipeline, named)
            flattened = tuple(f"{component}.{layer}" for component in named for layer in flattened)
        self.adapters = self._on_torch_thread(lambda: Adapters(
            network, read, c.lora_adapters, c.max_loras, flattened, run=self._on_torch_thread,
            on_event=self._on_lora, fuse=c.lora_fuse))
        if self.steps is not None:
            self.steps.adapter.lora_rows = self.adapters.rows

    def _graphed(self) -> bool:
        """Whether the denoiser's forward replays CUDA graphs (cuda_graphs.py), where the family takes
        them: a UNet's steps always, a DiT's under ``compile: blocks`` (eager, its step is the
        GPU's work alone; compiled, and more so in FP8, the launches between kernels are a step's
        share). Not with LoRA adapters (a graph would hold one pass's), nor sequence parallel
        (each forward talks to the workers). CFG parallel's worker does as rank 0."""
        c, capabilities = self.config, self.family.capabilities
        if not (c.cuda_graphs and self.device.type == "cuda" and capabilities.cuda_graphs):
            return False
        if capabilities.compile and "blocks" not in c.compiled:
            return False
        for clash, what in ((self.adapters is not None, "LoRA adapters change between passes"),
                            (self.sequence_parallel is not None, "sequence parallel's forwards talk to the workers")):
            if clash:
                logger.info("CUDA graphs off: %s", what)
                return False
        return True

    def _graphs(self, on_capture: Callable[[], None] | None) -> GraphedDenoiser:
        # step batching: a graph per (bucket, size, token count) in use; a pass the step cache
        # decides per request runs as it is
        graphable = self.steps.adapter.graphable if self.steps is not None else None
        return GraphedDenoiser(self.family.network, max_graphs=32 if self.config.batching == "step" else 16,
                               on_capture=on_capture, graphable=graphable)

    def _kernels(self) -> NetworkKernels:
        """The fused projections, FP8 plan and attention kernel this model's DiT runs with (kernels.py),
        checked here."""
        c = self.config
        if not self.family.capabilities.compile:  # no repeated transformer blocks: a UNet
            if c.quantization != "none" or c.attention_backend != "auto" or c.fuse_projections or c.gelu_epilogue:
                raise ValueError(f"model parameters quantization, attention_backend, fuse_projections and "
                                 f"gelu_epilogue: the {self.family.name} family has no diffusion transformer")
            return NetworkKernels()
        if c.fuse_projections and not self.family.capabilities.fused_projections:
            raise ValueError(f"model parameter fuse_projections: the {self.family.name} family's attention "
                             "does not take fused projections")
        if c.gelu_epilogue and not any(gelu_feed_forwards(n) for n in self.family.networks):
            raise ValueError(f"model parameter gelu_epilogue: the {self.family.name} family's DiT has no "
                             "feed-forward with a tanh GELU")
        if c.gelu_epilogue and (self.device.type != "cuda" or self.dtype not in (torch.bfloat16, torch.float16)):
            raise ValueError(f"model parameter gelu_epilogue: needs a GPU and bfloat16 or float16 (cuBLASLt's "
                             f"epilogue), not {self.device.type} in {str(self.dtype).removeprefix('torch.')}")
        plan = None
        if c.quantization == "fp8":
            check_fp8(self.device)
            plan = Fp8Plan(tuple(self.family.network._repeated_blocks),
                           self.family.fp8_kept if c.fp8_kept is None else c.fp8_kept, c.fp8_scales)
        attention = None  # sequence parallel keeps diffusers' own (its config refuses another)
        if self.sequence_parallel is None:
            heads, head_dim = self.family.attention_shape()
            tokens = self.family.attention_tokens()
            attention = self._on_torch_thread(lambda: resolve_attention(c.attention_backend, self.device, self.dtype,
                                                                        heads, head_dim, self.family.attention_masked,
                                                                        tokens))
            logger.info("attention_backend %s: %s", c.attention_backend, attention)
        return NetworkKernels(plan, attention, c.fuse_projections, c.gelu_epilogue)

    def _vae_kernels(self) -> bool:
        """On a GPU the VAE's group norms run ``kernels.group_norm`` (PyTorch's arithmetic, spread
        over the whole GPU) and its 3-D convolutions' weights are kept in cuDNN's layout
        (``kernels.channels_last_convolutions``), its causal ones padding height and width inside the
        convolution (``kernels.convolutions_pad_space``), except under ``exact_batching: pipeline``, whose
        promise is the pipeline's kernels bit for bit; returns whether any group norm was spread.
        Step batching then decodes each finished image alone: one image's decode so spread takes
        less than its share of a batch's, whose group norms PyTorch's kernel runs (a 1024² decode
        at 4 fills the GPU as it is, and stays as slow). ``compile: vae`` leaves the decoder to
        inductor, whose group norms and layouts are its own."""
        c = self.config
        if self.device.type != "cuda" or c.exact_mode == "pipeline" or "vae" in c.compiled:
            return False
        vae = self.pipeline.vae
        count, convolutions, padded = self._on_torch_thread(
            lambda: (spread_group_norms(vae), channels_last_convolutions(vae), convolutions_pad_space(vae)))
        if count:
            logger.info("The VAE's %d group norms run spread over the GPU (kernels.group_norm)", count)
        if convolutions:
            logger.info("The VAE's %d 3-D convolutions compute in channels_last_3d, %d of them padding height and "
                        "width themselves", convolutions, padded)
        return count > 0

    def _compile(self) -> None:
        """``compile: blocks``: the forward of each repeated block of the diffusion transformer compiled
        (``compile_blocks``), in place, so that every caller (the pipeline, the step engine, the step
        cache) runs it; CFG parallel's worker compiles its copy the same way. ``vae``: the VAE's
        decoder's forward, in place too (the step engine then decodes each image alone, so that a
        new batch size never compiles again)."""
        parts, name = self.config.compiled, self.config.compile
        if "blocks" in parts:
            if not self.family.capabilities.compile:
                raise ValueError(f"model parameter compile {name!r}: the {self.family.name} family has no "
                                 "diffusion transformer blocks to compile")
            for transformer in self.family.networks:
                compile_blocks(transformer, COMPILE_OPTIONS)
                logger.info("torch.compile: the %s blocks of %s (each new shape compiles on its first step)",
                            ", ".join(transformer._repeated_blocks), type(transformer).__name__)
        if "vae" in parts:
            if not self.family.capabilities.vae_compile:
                raise ValueError(f"model parameter compile {name!r}: the {self.family.name} family's VAE is not "
                                 "compiled (leave 'vae' out)")
            decoder = self.pipeline.vae.decoder
            decoder.forward = torch.compile(decoder.forward, **COMPILE_OPTIONS)
            logger.info("torch.compile: the decoder of %s (each new image size compiles on its first decode)",
                        type(self.pipeline.vae).__name__)

    def _sequence_parallel(self, devices: list[torch.device]) -> None:
        if not self.family.capabilities.sequence_parallel:
            raise ValueError(f"parallel 'sp': the {self.family.name} family does not take sequence parallel (it "
                             "splits a diffusion transformer's output tokens)")
        networks = self.family.networks
        self.sequence_parallel = self._on_torch_thread(lambda: SequenceParallel(networks, devices))
        logger.info("Sequence parallel (Ulysses): %s over %s", ", ".join(type(n).__name__ for n in networks),
                    ", ".join(str(d) for d in self.sequence_parallel.devices))

    def _parallel_cfg(self, device: torch.device, kernels: NetworkKernels, graphed: bool) -> None:
        if not self.family.capabilities.cfg_parallel:
            taking = ", ".join(family.name for family in FAMILIES.values() if family.capabilities.cfg_parallel)
            raise ValueError(f"CFG parallel runs a family's negative prompts in a pass of their own, on a second "
                             f"GPU: the {self.family.name} family does not (families that do: {taking})")
        options = COMPILE_OPTIONS if "blocks" in self.config.compiled else None
        self.cfg_parallel = self._on_torch_thread(lambda: CfgParallel(self.family.networks, device, options,
                                                                      kernels, graphed))
        self.steps.adapter.cfg_parallel = self.cfg_parallel
        logger.info("CFG parallel: the negatives' pass on %s, in a worker process", device)

    def _step_engine(self, load: Callable[[], None], on_batch) -> StepEngine:
        """The step engine, which loads the pipeline on its thread (``load``) and takes the family's
        step adapter for its loop."""
        c = self.config

        def adapter(device: torch.device) -> StepAdapter:
            load()
            return self.family.step_adapter(self.pipeline, device, self.dtype)

        return StepEngine(self.device, self.dtype, adapter, max_rows=c.max_rows or 2 * c.batch_size,
                          exact=c.exact_mode == "true", per_request=c.exact_mode == "pipeline",
                          on_full=c.on_full, on_batch=on_batch, group_order=c.group_order,
                          steps_ahead=c.steps_ahead)

    def _on_torch_thread(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the thread that runs this runner's torch work: the step engine's, else the caller's."""
        return fn() if self.steps is None else self.steps.call(fn).result()

    def submit(self, request: DiffusionRequest, on_step: Callable[[int, int], None] | None = None,
               is_cancelled: Callable[[], bool] | None = None,
               on_cached: Callable[[int, int], None] | None = None) -> Future:
        """Step batching: one request into the running batch. The future
        resolves to its image ``[H, W, 3]`` uint8, or its video's frames ``[F, H, W, 3]`` (or its error). ``on_cached``:
        (steps computed, steps skipped) when it ends, if it used the step cache."""
        def prepare() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # on the engine's thread
            job = self._prepare(0, request)
            return job.cond, job.uncond, job.pooled

        guided = self._guided(request)
        step_job = StepJob(prepare, 2 if guided else 1, request.guidance_scale,
                           request.num_inference_steps, request.height, request.width,
                           self._generator(request.seed), on_step, is_cancelled,
                           step_cache=request.step_cache or self.step_cache, on_cached=on_cached,
                           images=request.images, frames=request.num_frames,
                           guidance_scale_2=request.guidance_scale_2)
        if request.lora is None:
            return self.steps.submit(step_job)
        return self._submit_adapted(step_job, request.lora, request.lora_scale)

    def _submit_adapted(self, step_job: StepJob, name: str, scale: float) -> Future:
        """A request with an adapter enters the engine once its adapter is in a slot (read and copied
        in by the adapters' loader meanwhile, while the engine keeps stepping), and leaves it pinned
        until its image is done."""
        result: Future = Future()

        def enter(slot: Future) -> None:
            if slot.exception() is not None:
                result.set_exception(slot.exception())
                return
            step_job.lora = (slot.result(), scale)
            try:
                future = self.steps.submit(step_job)
            except Exception as exc:
                self.adapters.release(step_job.lora[0])
                result.set_exception(exc)
                return
            future.add_done_callback(lambda done: (self.adapters.release(step_job.lora[0]), _chain(done, result)))

        self.adapters.acquire(name).add_done_callback(enter)
        return result

    def close(self) -> None:
        """Stops the engine and the workers and gives the device memory back: the pipeline is
        dropped, and with ``compile`` torch.compile's caches too (they hold the compiled
        blocks, and through them the weights, for as long as the process lives)."""
        if self.adapters is not None:
            self.adapters.close()
        if self.steps is not None:
            self.steps.stop()
        for parallel in (self.sequence_parallel, self.cfg_parallel):
            if parallel is not None:
                parallel.close()
        self.sequence_parallel = self.cfg_parallel = None
        if self.compile_watch is not None:
            self.compile_watch.close()
            self.compile_watch = None
        self._release()

    def _release(self) -> None:
        if getattr(self, "pipeline", None) is None:
            return
        if self.graphs is not None:
            self.graphs.remove()  # its graphs hold their pool's memory and the blocks' compiled code
        if self.config.compiled:
            modules = [module for network in self.family.networks for module in network.modules()]
            for module in (*modules, self.pipeline.vae.decoder):
                module.__dict__.pop("forward", None)  # the compiled forward _compile set
            torch._dynamo.reset()  # this process's compile caches: a stub's are its model's alone
        self.pipeline = self.family = self.graphs = self.adapters = None
        if self.steps is not None:
            self.steps.adapter = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def parse(self, inputs: dict[str, Any]) -> DiffusionRequest:
        request = DiffusionRequest.from_inputs(inputs, self.limits, self.config.defaults)
        if self.family.capabilities.edits and not request.images:
            raise RequestValidationError("images", f"is required: {type(self.pipeline).__name__} edits an input "
                                         "image (give `images`, or `image` as pixels)", None, show_value=False)
        if request.images:
            self._size_from_images(request)
        if (request.prompt is None and request.negative_prompt_embeds is None and request.negative_prompt is None
                and self._guided(request) and not self.family.has_text_encoder()):
            raise RequestValidationError("negative_prompt_embeds", "is required for guidance with prompt_embeds: "
                                         "this model has no text encoder to encode the pipeline's default negative "
                                         'prompt ""', None, show_value=False)
        if self.sequence_parallel is not None:
            if request.images and not self.family.images_in_latents:
                raise RequestValidationError(request.images_field, "not with sequence parallel (its split is the "
                                             "output's tokens)", None, show_value=False)
            # a size the family's sequence cannot share over the ranks
            self.family.check_sequence_parallel(request, len(self.sequence_parallel.devices),
                                                on_cpu=self.device.type == "cpu")
        if request.guidance_scale_2 is not None and len(self.family.networks) < 2:  # as the pipeline refuses it
            raise RequestValidationError("guidance_scale_2", f"the {self.family.name} family has one denoiser "
                                         "(guidance_scale_2 is the second expert's scale, for a model with two)",
                                         request.guidance_scale_2)
        if request.lora is not None:
            if self.adapters is None:
                raise RequestValidationError("lora", "this model serves no LoRA adapters (its lora_adapters "
                                             "parameter names none)", request.lora)
            self.adapters.check(request.lora)
        if request.step_cache is not None and request.step_cache.on:
            if self.sequence_parallel is not None:
                raise RequestValidationError("step_cache", "not with sequence parallel (every GPU must run the same "
                                             "blocks)", str(request.step_cache))
            if self.steps is None:
                raise RequestValidationError("step_cache", "needs a model with batching 'step' (the cache is kept "
                                             "per request between its steps)", str(request.step_cache))
            if not self.family.capabilities.step_cache:
                raise RequestValidationError("step_cache", f"the {self.family.name} family has no step cache (it "
                                             "skips a diffusion transformer's blocks)", str(request.step_cache))
        return request

    def _size_from_images(self, request: DiffusionRequest) -> None:
        """The pipeline's checks of its input images, and, for a side the request did not give, the
        output's size the pipeline takes from them, held to this model's limits."""
        size = self.family.check_images(request.images, request.images_field)
        if size is None:
            return
        height, width = size
        limits = self.limits
        for name, given, value in (("height", request.sized[0], height), ("width", request.sized[1], width)):
            if not given:
                if not limits.min_size <= value <= limits.max_size:
                    raise RequestValidationError(name, f"the input image gives {value}, outside this model's "
                                                 f"[{limits.min_size}, {limits.max_size}]: give {name}", value)
                setattr(request, name, value)

    def run(self, requests: list[DiffusionRequest], on_step: StepCallback | None = None,
            is_cancelled: IsCancelled | None = None) -> list[torch.Tensor | Exception]:
        """Images ``[H, W, 3]`` uint8 (videos: ``[F, H, W, 3]``), or the exception of each failed
        request, in order."""
        if self.steps is not None:
            return self._run_steps(requests, on_step, is_cancelled)
        results: list[torch.Tensor | Exception | None] = [None] * len(requests)
        groups: dict[tuple, list[_Job]] = defaultdict(list)
        for i, request in enumerate(requests):
            try:
                job = self._prepare(i, request)
                groups[job.group_key()].append(job)
            except RequestValidationError as exc:
                results[i] = exc
        chunk_size = 1 if self.config.exact_mode == "pipeline" else self.config.batch_size
        for jobs in groups.values():
            for start in range(0, len(jobs), chunk_size):
                chunk = jobs[start : start + chunk_size]
                try:
                    for job, image in zip(chunk, self._run_chunk(chunk, on_step, is_cancelled), strict=True):
                        results[job.index] = image
                except Exception as exc:
                    logger.exception("Diffusion batch of %d failed", len(chunk))
                    for job in chunk:
                        results[job.index] = exc
        return results  # type: ignore[return-value]

    def _run_steps(self, requests, on_step, is_cancelled) -> list[torch.Tensor | Exception]:
        futures: list[Future | Exception] = []
        with self.steps.together():  # one call's requests share their first step, as Triton's batch does
            for i, request in enumerate(requests):
                try:
                    futures.append(self.submit(request, None if on_step is None else
                                               lambda step, total, i=i: on_step(i, step, total),
                                               None if is_cancelled is None else lambda i=i: is_cancelled(i)))
                except Exception as exc:
                    futures.append(exc)
        results = []
        for future in futures:
            try:
                results.append(future if isinstance(future, Exception) else future.result())
            except Exception as exc:
                results.append(exc)
        return results

    # -- steps of the recipe ------------------------------------------------------

    def _prepare(self, index: int, request: DiffusionRequest) -> _Job:
        cond, pooled = (request.prompt_embeds, request.pooled_prompt_embeds) if request.prompt is None \
            else self._encode_prompt(request.prompt, request.images)
        cond = to_device(cond, self.device, self.dtype)
        pooled = None if pooled is None else to_device(pooled, self.device, self.dtype)
        uncond = None
        if self._guided(request):
            uncond = to_device(self._negative(request, cond), self.device, self.dtype)
            if self.family.negatives_in_one_batch:
                cond, uncond = _same_length(cond, uncond)
        return _Job(index, request, cond, uncond, pooled, self.family.capabilities.guidance is Guidance.DISTILLED)

    def _guided(self, request: DiffusionRequest) -> bool:
        """Whether the request runs classifier-free guidance, by its family's rule."""
        return self.family.uses_guidance(request.guidance_scale, request.has_negative)

    def _negative(self, request: DiffusionRequest, cond: torch.Tensor) -> torch.Tensor:
        """What a guided request's negative side is conditioned on, as its pipeline would have it:
        the negative embeddings or text given; zero tokens from an encoder (the stage before this
        one had no negative to give): the null condition; none at all: the empty prompt, which is
        what the pipeline encodes for a negative prompt it was not given (a family that guides only
        with a negative prompt, Qwen-Image, never gets here without one)."""
        embeds = request.negative_prompt_embeds
        if embeds is not None:
            return embeds if embeds.shape[0] > 0 else torch.zeros_like(cond)
        if request.negative_prompt or self.family.recipe.images:  # an edit's encoder reads "" with the image
            return self._encode_prompt(request.negative_prompt or "", request.images)[0]
        return self._empty_prompt()

    def _encode_prompt(self, prompt: str, images: list = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt's sequence and, where the family reads one, its pooled embedding (``images``: the
        request's, which an edit family's text encoder reads with the prompt)."""
        with torch.inference_mode():
            return self.family.encode_prompt(prompt, self.device, images)

    def _empty_prompt(self) -> torch.Tensor:
        """The encoding of "", every guided request's negative side when it has none: encoded once,
        so that such a request's admission neither runs the text encoder nor waits for the GPU."""
        if self._empty is None:
            self._empty = self._encode_prompt("")[0]
        return self._empty

    def _run_chunk(self, jobs: list[_Job], on_step, is_cancelled) -> list[torch.Tensor | Exception]:
        first = jobs[0].request
        padding = self.config.batch_size - len(jobs) if self.config.exact_mode == "true" else 0
        rows = jobs + [jobs[0]] * padding  # padding rows repeat a real row; their output is dropped
        generators = [self._generator(job.request.seed) for job in jobs] + [self._generator(0)] * padding
        guided = jobs[0].uncond is not None
        kwargs: dict[str, Any] = self.family.call_kwargs(
            [job.cond for job in rows], [job.uncond for job in rows] if guided else None, first.guidance_scale)
        if first.guidance_scale_2 is not None and guided:
            kwargs["guidance_scale_2"] = first.guidance_scale_2
        if first.images:
            kwargs |= self.family.image_kwargs(first.images)
        if jobs[0].pooled is not None:
            kwargs |= self.family.pooled_kwargs([job.pooled for job in rows])
        kwargs |= self.family.size_kwargs(first.height, first.width, first.num_frames) | {
            "num_inference_steps": first.num_inference_steps,
            "generator": generators,
            "output_type": "pt",
            "callback_on_step_end": self._step_callback(jobs, on_step, is_cancelled),
        }
        started = time.perf_counter()
        with torch.inference_mode(), self._adapter(first):
            images = self.family.call_output(self.family.call(kwargs))[: len(jobs)]
        queued = time.perf_counter()
        # Images are final outputs that leave the server over the network: one
        # device-to-host copy per batch here is cheaper than a CUDA tensor per
        # response, which the Python backend hands over through CUDA IPC.
        pixels = to_pixels(images)
        logger.debug("chunk of %d: pipeline call %.1f ms, then waiting for the images %.1f ms", len(jobs),
                     (queued - started) * 1e3, (time.perf_counter() - queued) * 1e3)
        cancelled = is_cancelled or (lambda i: False)
        return [RequestCancelledError() if cancelled(job.index) else pixels[k] for k, job in enumerate(jobs)]

    @contextlib.contextmanager
    def _adapter(self, request: DiffusionRequest) -> Iterator[None]:
        """Around one pipeline call whose rows all run ``request``'s adapter (request batching groups so)."""
        if request.lora is None:
            yield
            return
        slot = self.adapters.acquire(request.lora).result()
        try:
            with self.adapters.rows.bind([(slot, request.lora_scale)], self.device):
                yield
        finally:
            self.adapters.release(slot)

    def _step_callback(self, jobs: list[_Job], on_step, is_cancelled):
        total = jobs[0].request.num_inference_steps

        def callback(pipeline, step: int, timestep, callback_kwargs: dict) -> dict:
            live = [job for job in jobs if not (is_cancelled and is_cancelled(job.index))]
            for job in live:
                if on_step is not None:
                    on_step(job.index, step + 1, total)
            if not live:
                pipeline._interrupt = True  # every request of the batch was cancelled: skip the remaining steps
            return callback_kwargs

        return callback

    def _generator(self, seed: int | None) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(secrets.randbits(63) if seed is None else seed)


def _chain(done: Future, result: Future) -> None:
    """``result`` takes ``done``'s outcome."""
    if done.exception() is not None:
        result.set_exception(done.exception())
    else:
        result.set_result(done.result())


def _same_length(cond: torch.Tensor, uncond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Guidance runs both sides in one batch, so they need one token count.
    An AR prompt and its negative rarely tokenize to the same length: the
    shorter side is padded with zero rows (the null condition). Deterministic,
    so an image still depends only on its own request."""
    tokens = max(cond.shape[0], uncond.shape[0])
    return _pad_tokens(cond, tokens), _pad_tokens(uncond, tokens)


def _pad_tokens(embeds: torch.Tensor, tokens: int) -> torch.Tensor:
    missing = tokens - embeds.shape[0]
    return embeds if missing == 0 else torch.cat([embeds, embeds.new_zeros(missing, embeds.shape[1])])
