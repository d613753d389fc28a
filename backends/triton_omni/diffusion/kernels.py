"""What a diffusion transformer runs on, set at load: its linear layers in FP8, its attention kernel.

- ``quantization: fp8``: the linear layers of the DiT's repeated blocks (where its FLOPs are) hold
  their weights in float8 with a scale per output row, and each call quantizes its input per row
  the same way (torchao's ``Float8DynamicActivationFloat8WeightConfig``, ``PerRow``): Hopper's
  FP8 tensor cores do the matmul at twice bf16's rate. The layers a family keeps in bf16 (its
  ``fp8_kept``, or the model's ``fp8_kept`` parameter) and the ones outside the blocks
  (embedders, the final projection: little compute, much of the output's quality) stay as they
  are; the VAE and the text encoders are untouched. It pays most under ``compile: blocks``, which
  fuses the input's quantization into the kernels around the matmul. ``fp8_scales: tensor``: one
  scale per weight and per input instead (``PerTensor``), whose matmul is cuBLAS's own, where the
  row-wise one is a CUTLASS kernel of PyTorch's that runs some shapes slower
  (pytorch/pytorch#147971); rows with outliers lose more of their precision.
- ``fuse_projections``: each attention's query, key and value projections one linear layer
  (diffusers' ``fuse_qkv_projections``, the weights concatenated; the unfused layers dropped), for
  the families whose attention takes it: one matmul in place of three, and under FP8 one
  quantization of their input in place of three. The sums are the same; a matmul of another
  width may round a bf16 value differently.
- ``gelu_epilogue``: on a GPU, each feed-forward's tanh GELU applied by its projection's matmul
  (``fuse_gelu_epilogues``), saving a pass over the block's widest activation.
- ``attention_backend``: the kernel diffusers' attention dispatcher calls. ``auto`` times every
  kernel this host can run on the calls the network makes at its shape (without a mask, and, for
  a family whose passes pad shorter prompts, with one too) and keeps the fastest; a name sets it
  (refused at load if this host cannot run those calls). On the CPU ``auto`` keeps PyTorch's SDPA.
  The unmasked call is what decides for most families: their passes never pad (Qwen-Image's group
  requests by text length, FLUX's encoders pad to a fixed length), and a kernel that takes no mask
  (flash) must not lose to a masked call it never meets.
  Two of diffusers' backends fetch their kernel from the Hugging Face Hub, which an offline GPU
  host cannot reach; ``installed_kernel`` hands diffusers an installed one instead, as a PyTorch
  custom op that ``compile: blocks`` keeps whole in its graph, and each is a candidate where it is
  installed: FlashAttention-4 (``flash_4_hub``) from its pip package (``flash-attn-4``: CuTe DSL
  kernels for Hopper and Blackwell, compiled at first use), and FlashAttention-3 (``_flash_3_hub``,
  Hopper) from vLLM's build of it, which every vLLM wheel for CUDA carries
  (``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``, loaded alone: vLLM itself is not imported). That
  build takes only variable-length batches, so each call's rows go in as one sequence each.
- The VAE (on a GPU, unless ``exact_batching: pipeline`` keeps every kernel the pipeline's): its
  group norms run ``group_norm``, the same arithmetic spread over the whole GPU; its 3-D
  convolutions' weights (a video VAE's) are kept in ``channels_last_3d``, the layout cuDNN's
  convolutions compute in, which PyTorch's default layout makes it transpose into and back out of
  around every call, and pad height and width inside the convolution rather than in a copy.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "fp8")
FP8_SCALES = ("row", "tensor")  # torchao's PerRow, PerTensor
# diffusers' names of the kernels `auto` tries, in the order of a tie: PyTorch's own first
ATTENTION_CANDIDATES = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "flash", "_flash_3", "sage",
                        "flash_4_hub", "_flash_3_hub")
# vLLM's FlashAttention-3 build, inside its package
VLLM_FLASH_ATTENTION_3 = ("vllm_flash_attn", "_vllm_fa3_C.abi3.so")
# torch._scaled_mm's operands: both sizes of an FP8 weight must be multiples of 16
FP8_ALIGNMENT = 16
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores


@dataclass(frozen=True)
class Fp8Plan:
    """Which linear layers an FP8 load quantizes: every ``nn.Linear`` inside one of ``blocks``
    (the DiT's repeated block classes) whose name (from the network's root) matches none of the
    ``kept`` patterns (fnmatch, e.g. ``*.img_mlp.*``) and whose sizes FP8's matmul takes; and
    their ``scales``, one of ``FP8_SCALES``."""

    blocks: tuple[str, ...]
    kept: tuple[str, ...] = ()
    scales: str = "row"


    def layers(self, network: torch.nn.Module) -> list[str]:
        inside = [name for name, module in network.named_modules() if type(module).__name__ in self.blocks]
        chosen = []
        for name, module in network.named_modules():
            if not isinstance(module, torch.nn.Linear) or not any(name.startswith(f"{b}.") for b in inside):
                continue
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.kept):
                continue
            if module.in_features % FP8_ALIGNMENT or module.out_features % FP8_ALIGNMENT:
                continue
            chosen.append(name)
        return chosen


@dataclass(frozen=True)
class NetworkKernels:
    """What a runner sets on its DiT at load, and CFG parallel's worker on its copy: the fused
    projections, the FP8 plan (None: bf16 throughout), the attention kernel (None: diffusers'
    default, PyTorch's SDPA) and the GELU epilogues (of the layers FP8 left in bf16)."""

    fp8: Fp8Plan | None = None
    attention: str | None = None
    fused: bool = False
    gelu_epilogue: bool = False

    def apply(self, network: torch.nn.Module) -> None:
        if self.fused:  # before FP8: the fused layers are the ones quantized
            logger.info("fuse_projections: %d attention layers' projections fused", fuse_projections(network))
        if self.fp8 is not None:
            count = quantize_fp8(network, self.fp8)
            logger.info("quantization fp8: %d linear layers of the %s blocks, scales per %s (kept as they were: %s)",
                        count, ", ".join(self.fp8.blocks), self.fp8.scales, ", ".join(self.fp8.kept) or "none")
        if self.gelu_epilogue:  # after FP8 (which the runner does not combine with it): plain layers only
            if not (count := fuse_gelu_epilogues(network)):
                raise ValueError("model parameter gelu_epilogue: none of this DiT's feed-forwards is a tanh GELU "
                                 "over a bf16 or float16 projection")
            logger.info("gelu_epilogue: %d feed-forward GELUs applied in their projections' matmuls", count)
        if self.attention is not None:  # "native" too: a processor left unset follows diffusers'
            # process-wide active backend, which the last network set in this process chose
            installed_kernel(self.attention)
            network.set_attention_backend(self.attention)


# diffusers' fused layer -> the layers it replaces
FUSED_LAYERS = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"),
                "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


@torch.no_grad()
def fuse_projections(network: torch.nn.Module) -> int:
    """``network``'s attention projections fused in place (diffusers' ``fuse_qkv_projections``), the
    layers each fused one replaces deleted: the attention then reads only the fused ones, and the
    weights are not held twice. Returns how many attention layers were fused."""
    network.fuse_qkv_projections()
    fused = [m for m in network.modules() if getattr(m, "fused_projections", False)]
    for module in fused:
        children = dict(module.named_children())
        for part in (part for name, parts in FUSED_LAYERS.items() if name in children for part in parts):
            delattr(module, part)
    return len(fused)


def fuse_gelu_epilogues(network: torch.nn.Module) -> int:
    """Each feed-forward's first projection and its tanh GELU (diffusers' ``GELU`` with
    ``approximate="tanh"``: Wan's, Qwen-Image's and FLUX.1's double-stream blocks; FLUX.1's
    single-stream blocks apply theirs inline) one call on a GPU, the bias and the activation applied
    by the matmul's epilogue (``torch._addmm_activation``, cuBLASLt's GELU_BIAS, the same tanh
    approximation). Unfused, the GELU is a pass of its own over the widest activation of a block,
    written and read back once more. The GELU reads the float32 sum before it is rounded to bf16,
    so a value can move by a unit in its last place. Only plain bf16 or float16 layers on a GPU (an
    FP8 layer is left as it is). Returns how many were fused."""
    fused = 0
    for module in gelu_feed_forwards(network):
        if _epilogue_takes(module.proj):
            module.__class__ = _gelu_epilogue_class()  # its weights and their names as they were
            fused += 1
    return fused


def gelu_feed_forwards(network: torch.nn.Module) -> list[torch.nn.Module]:
    """``network``'s diffusers ``GELU`` modules with the tanh approximation and a biased linear
    projection: what ``fuse_gelu_epilogues`` can fuse, whatever their device and dtype."""
    from diffusers.models.activations import GELU

    return [m for m in network.modules() if type(m) is GELU and m.approximate == "tanh"
            and type(m.proj) is torch.nn.Linear and m.proj.bias is not None]


def _epilogue_takes(layer: torch.nn.Linear) -> bool:
    weight = layer.weight
    return (type(weight.data) is torch.Tensor and weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)
            and layer.bias.dtype == weight.dtype)  # cuBLASLt reads the bias as the output's type


@functools.cache
def _gelu_epilogue_class() -> type:
    from diffusers.models.activations import GELU

    class GeluEpilogue(GELU):
        """diffusers' ``GELU`` whose projection applies its bias and activation in the matmul."""

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            rows = hidden_states.reshape(-1, hidden_states.shape[-1])
            out = torch._addmm_activation(self.proj.bias, rows, self.proj.weight.t(), use_gelu=True)
            return out.view(*hidden_states.shape[:-1], out.shape[-1])

    return GeluEpilogue


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """``F.group_norm(x, groups, weight, bias, eps)``, computed so that a GPU spreads each group over
    many thread blocks. PyTorch's CUDA kernel reduces each (image, group) in a single block: a VAE's
    32 groups of one 1024² image keep 32 of a GPU's 100-odd multiprocessors busy, and its group
    norms take more of a FLUX decode than its convolutions. From half as many (image, group) rows
    as the GPU has multiprocessors, PyTorch's own kernel is as fast, and runs (as it does where
    autograd records, which ``out=`` does not). The arithmetic is PyTorch's: each group's mean and
    variance in float32 (Welford, over a float32 copy of one image at a time, the only temporary),
    then per channel ``a * x + b`` in float32, rounded once to ``x``'s dtype; only the order of the
    sums differs, so a bf16 value can move by a unit in its last place. The result is contiguous,
    as PyTorch's is, whatever the input's memory format."""
    x = x.contiguous()
    wide = x.is_cuda and x.shape[0] * groups >= _multiprocessors(x.device) // 2
    if wide or _needs_grad(x, weight, bias):  # out= below records no autograd history
        return torch.nn.functional.group_norm(x, groups, weight, bias, eps)
    out = torch.empty_like(x)
    channels = x.shape[1]
    shape = (channels,) + (1,) * (x.dim() - 2)
    for image, into in zip(x, out, strict=True):
        var, mean = torch.var_mean(image.view(groups, -1).float(), dim=-1, correction=0)
        scale = torch.rsqrt(var + eps).repeat_interleave(channels // groups)
        if weight is not None:
            scale = scale * weight.float()
        shift = -mean.repeat_interleave(channels // groups) * scale
        if bias is not None:
            shift = shift + bias.float()
        torch.addcmul(shift.view(shape), image, scale.view(shape), out=into)
    return out


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def spread_group_norms(module: torch.nn.Module) -> int:
    """Every ``nn.GroupNorm`` inside ``module`` runs ``group_norm``, in place; returns how many."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.GroupNorm)]
    for norm in norms:
        norm.forward = functools.partial(_group_norm_forward, norm)
    return len(norms)


def channels_last_convolutions(module: torch.nn.Module) -> int:
    """Every 3-D convolution's weight inside ``module`` in ``channels_last_3d``, in place; returns
    how many. A convolution computes in its weight's layout, and each output carries it on to the
    next layer, so the activations follow; the sums are the same, in another order."""
    convolutions = [m for m in module.modules() if isinstance(m, torch.nn.Conv3d)]
    for convolution in convolutions:
        convolution.weight.data = convolution.weight.data.contiguous(memory_format=torch.channels_last_3d)
    return len(convolutions)


def convolutions_pad_space(module: torch.nn.Module) -> int:
    """Every causal 3-D convolution inside ``module`` (a Wan VAE's ``WanCausalConv3d``) pads its
    input's height and width inside the convolution, in place; returns how many. Diffusers pads
    all three dimensions with ``F.pad`` first, a padded copy of every activation before every
    convolution of the decode; only the causal padding of time, on one side, stays a copy. The
    padding is zeros either way: the same sums."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    convolutions = [m for m in module.modules() if isinstance(m, WanCausalConv3d)]
    for convolution in convolutions:
        convolution.forward = functools.partial(_causal_convolution, convolution)
    return len(convolutions)


def _causal_convolution(convolution, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """``WanCausalConv3d.forward`` with its height and width padded by the convolution: its
    ``_padding`` is (width, width, height, height, 2 x time, 0), the earlier frames cached or zeros."""
    width, _, height, _, time, _ = convolution._padding
    if cache_x is not None and time > 0:
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        time -= cache_x.shape[2]
    if time > 0:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, time, 0))
    elif time < 0:  # a cache longer than the padding: F.pad's negative padding crops, as diffusers' does
        x = x[:, :, -time:]
    return torch.nn.functional.conv3d(x, convolution.weight, convolution.bias, convolution.stride,
                                      (0, height, width), convolution.dilation, convolution.groups)


def _group_norm_forward(norm: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    return group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)


def check_fp8(device: torch.device) -> None:
    """Refuses ``quantization: fp8`` where it cannot run, naming the parameter."""
    if device.type != "cuda":
        raise ValueError("model parameter quantization 'fp8' needs a GPU with FP8 tensor cores (compute capability "
                         f"8.9 or above: Ada, Hopper, Blackwell); this instance runs on {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(f"model parameter quantization 'fp8' needs compute capability 8.9 or above; "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ValueError("model parameter quantization 'fp8' needs torchao (pip install torchao)") from None


def quantize_fp8(network: torch.nn.Module, plan: Fp8Plan) -> int:
    """``plan``'s layers of ``network`` in FP8, in place (``check_fp8`` first); returns how many."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    chosen = set(plan.layers(network))
    granularity = PerRow() if plan.scales == "row" else PerTensor()
    quantize_(network, Float8DynamicActivationFloat8WeightConfig(granularity=granularity),
              filter_fn=lambda module, name: name in chosen)
    return len(chosen)


def resolve_attention(backend: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
                      masked: bool = False, tokens: int = 4096 + 256) -> str:
    """The attention kernel to set: ``backend``, checked on this host, or for ``auto`` the fastest
    this host runs on the network's heads over ``tokens`` (``choose_attention``; the family's
    ``attention_tokens``). ``masked``: the network's calls may pass a padding mask, so the kernel
    must take one."""
    calls = _ProbeCall.all_of(device, dtype, heads, head_dim, masked, tokens)
    if backend == "auto":
        return choose_attention(calls)
    error = _probe(backend, calls, rounds=0)
    if isinstance(error, Exception):
        raise ValueError(f"model parameter attention_backend {backend!r}: this host cannot run it "
                         f"({type(error).__name__}: {error})")
    return backend


def choose_attention(calls: list[_ProbeCall]) -> str:
    """The fastest of ``ATTENTION_CANDIDATES`` over ``calls`` (their times added); PyTorch's SDPA on
    the CPU."""
    if calls[0].q.device.type != "cuda":
        return "native"
    timings = {name: _probe(name, calls) for name in ATTENTION_CANDIDATES}
    usable = {name: seconds for name, seconds in timings.items() if isinstance(seconds, float)}
    chosen = min(usable, key=usable.get)
    logger.info("attention_backend auto: %s (ms per call%s: %s; not usable here: %s)", chosen,
                ", with and without a mask" if len(calls) > 1 else "",
                ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in usable.items()),
                ", ".join(name for name in timings if name not in usable) or "none")
    return chosen


@dataclass(frozen=True)
class _ProbeCall:
    """A call every kernel is tried on: two rows of the network's heads over ``tokens`` (a typical
    request's: a 1024² image's 4096 and 256 text tokens; a video's far more), optionally with the
    second row's padded keys masked out (its prompt shorter), and PyTorch's SDPA's output for it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    reference: torch.Tensor

    @classmethod
    def all_of(cls, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
               masked: bool, tokens: int = 4096 + 256) -> list[_ProbeCall]:
        """The unmasked call, and the masked one where the network may pass a mask."""
        masks = (False, True) if masked else (False,)
        return [cls.of(device, dtype, heads, head_dim, mask, tokens) for mask in masks]

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, masked: bool,
           tokens: int = 4096 + 256) -> _ProbeCall:
        from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

        tokens = tokens if device.type == "cuda" else 64
        generator = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(2, tokens, heads, head_dim, device=device, dtype=dtype, generator=generator)
                   for _ in range(3))
        mask = None
        if masked:
            mask = torch.ones(2, 1, 1, tokens, dtype=torch.bool, device=device)
            mask[1, ..., -100:] = False
        reference = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=AttentionBackendName.NATIVE)
        return cls(q, k, v, mask, reference)


def _probe(name: str, calls: list[_ProbeCall], rounds: int = 5) -> float | Exception:
    """Seconds per round of ``calls`` with backend ``name`` (each output checked against PyTorch's
    SDPA's), or the exception that says why it cannot run here."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    try:
        backend = usable_backend(name)
        for call in calls:
            out = dispatch_attention_fn(call.q, call.k, call.v, attn_mask=call.mask, backend=backend)
            if not torch.allclose(out.float(), call.reference.float(), atol=2e-2, rtol=2e-2):
                return ValueError("its output differs from PyTorch's SDPA" + (" with a mask" if call.mask is not None
                                                                            else ""))
        if rounds == 0 or calls[0].q.device.type != "cuda":
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(rounds):
            for call in calls:
                dispatch_attention_fn(call.q, call.k, call.v, attn_mask=call.mask, backend=backend)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / rounds
    except Exception as exc:  # a kernel this host lacks, or one that refuses masks: not a candidate
        return exc


def usable_backend(name: str):
    """diffusers' backend ``name``, its kernel installed where this project provides it
    (``installed_kernel``) and its requirements checked; raises why this host cannot run it."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    backend = AttentionBackendName(name)
    installed_kernel(name)
    _check_attention_backend_requirements(backend)
    return backend


def installed_kernel(backend: str) -> None:
    """For a backend of ``INSTALLED_KERNELS``: diffusers' registry of Hub kernels given the installed
    package's function (wrapped as a custom op), so that diffusers runs it and downloads nothing.
    Raises ImportError naming the package where it is not installed; other backends: nothing."""
    if backend not in INSTALLED_KERNELS:
        return
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    config = _HUB_KERNELS_REGISTRY[AttentionBackendName(backend)]
    if config.kernel_fn is None:
        config.kernel_fn = INSTALLED_KERNELS[backend]()
        # and the context-parallel forms diffusers would otherwise fetch (sequence parallel keeps its own attention)
        refuse = functools.partial(_not_context_parallel, backend)
        config.wrapped_forward_fn = config.wrapped_forward_fn or refuse
        config.wrapped_backward_fn = config.wrapped_backward_fn or refuse


def _not_context_parallel(backend: str, *args, **kwargs):
    raise NotImplementedError(f"attention_backend {backend!r} runs outside context parallelism only")


@functools.cache
def _flash_attention_4_op():
    """FlashAttention-4's forward as ``triton_omni::flash_attention_4``: torch.compile sees one op
    with a known output (the query's shape, the value's head size) instead of tracing the CuTe DSL
    launcher, which would break each compiled block's graph at its attention."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as exc:
        raise ImportError(f"flash_4_hub runs the flash-attn-4 package, which is not installed here "
                          f"(pip install flash-attn-4): {exc}") from None

    @torch.library.custom_op("triton_omni::flash_attention_4", mutates_args=())
    def flash_attention_4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None,
                          causal: bool) -> torch.Tensor:
        out = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    @flash_attention_4.register_fake
    def _(q, k, v, softmax_scale, causal):
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    def kernel_fn(q, k, v, softmax_scale=None, causal=False):  # the call diffusers' flash_4_hub makes
        return flash_attention_4(q, k, v, softmax_scale, causal)

    return kernel_fn


@functools.cache
def _flash_attention_3_op():
    """FlashAttention-3's forward, from vLLM's build, as ``triton_omni::flash_attention_3`` (a
    custom op, as FlashAttention-4's). Its library is loaded by path: importing vLLM would start
    its platform detection and logging in a process that serves no LLM."""
    torch.ops.load_library(_vllm_flash_attention_3_library())  # once a process: the same file where vLLM loaded it

    @torch.library.custom_op("triton_omni::flash_attention_3", mutates_args=())
    def flash_attention_3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None,
                          causal: bool) -> torch.Tensor:
        batch, q_len, heads, _ = q.shape
        kv_len, kv_heads = k.shape[1], k.shape[2]
        out = torch.ops._vllm_fa3_C.fwd(
            q.reshape(batch * q_len, heads, -1), k.reshape(batch * kv_len, kv_heads, -1),
            v.reshape(batch * kv_len, kv_heads, -1),
            None, None, None, None,  # k_new, v_new, q_v, out
            _row_starts(batch, q_len, q.device), _row_starts(batch, kv_len, q.device), None,  # cu_seqlens q, k, k_new
            None, None, q_len, kv_len,  # seqused q, k; max_seqlen q, k
            None, None, None, None, None, None,  # page_table, kv_batch_idx, leftpad_k, rotary cos, sin, seqlens
            None, None, None,  # q, k, v descale (FP8 inputs)
            q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale, causal,
            -1, -1, 0.0, True,  # window left, right; softcap; rotary_interleaved
            None, 1, None, 0,  # scheduler_metadata, num_splits, pack_gqa, sm_margin
            None, 1, 0, None)[0]  # s_aux, cp_world_size, cp_rank, cp_tot_seqused_k
        return out.view(batch, q_len, heads, v.shape[-1])

    @flash_attention_3.register_fake
    def _(q, k, v, softmax_scale, causal):
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    def kernel_fn(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  return_attn_probs=False, **unused):  # the call diffusers' _flash_3_hub makes
        if tuple(window_size) != (-1, -1) or softcap or return_attn_probs:
            raise NotImplementedError("_flash_3_hub: a window, a softcap or the attention's probabilities")
        return flash_attention_3(q, k, v, softmax_scale, causal)

    return kernel_fn


def _row_starts(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Where each row's tokens start in the variable-length batch, and where the last ends."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


def _vllm_flash_attention_3_library() -> str:
    """The path of vLLM's FlashAttention-3 library, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder).joinpath(*VLLM_FLASH_ATTENTION_3)
        if path.is_file():
            return str(path)
    where = f"vLLM at {folders[0]} has no {'/'.join(VLLM_FLASH_ATTENTION_3)} (a CPU build)" if folders else \
        "vLLM is not installed"
    raise ImportError(f"_flash_3_hub runs vLLM's FlashAttention-3 build, which is not installed here "
                      f"(pip install vllm, a CUDA build): {where}")


# diffusers' Hub-fetched backends whose kernel an installed package provides: backend -> its custom op's maker
INSTALLED_KERNELS = {"flash_4_hub": _flash_attention_4_op, "_flash_3_hub": _flash_attention_3_op}
