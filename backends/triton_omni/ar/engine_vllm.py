"""The vLLM engine: ``AsyncLLM`` (vLLM V1) on the runner's event loop.

``generate`` streams DELTA outputs; ``encode`` uses vLLM's pooling runner with
the ``token_embed`` task and the activation off, which returns the raw last
hidden states ``[num_tokens, hidden]`` (the same tensor the transformers
engine reads from ``hidden_states[-1]``).

Sampling options are validated by vLLM's own ``SamplingParams``; its
``VLLMValidationError`` becomes a ``RequestValidationError`` naming the
parameter, so the client gets INVALID_ARG with vLLM's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm import AsyncEngineArgs, PoolingParams, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM

from triton_omni.ar.engine import ArEngine, Delta, TokenLogprob
from triton_omni.ar.sampling import SamplingOptions
from triton_omni.ar.shared_engine import EngineSeat, watch_engine
from triton_omni.cpu_affinity import descendants, pin_process_tree
from triton_omni.errors import RequestValidationError
from triton_omni.processes import alive, mapped_shared_memory, parents, start_ticks

if TYPE_CHECKING:
    from triton_omni.ar.vision_prompt import VisionInputs

logger = logging.getLogger(__name__)

# How long vLLM waits for its engine core to exit after SIGTERM before it kills it (its default:
# 5 s). A killed core leaves its shared memory behind, and on a busy host (two cores, a server
# loading beside it) a clean exit has taken longer than the default.
ENGINE_EXIT_S = 30.0
MULTIPROCESSING_SHM = ("psm_", "sem.mp-")  # the names Python's multiprocessing gives its segments, semaphores

# vLLM's CPU KV cache when neither engine_args nor VLLM_CPU_KVCACHE_SPACE sizes it: room for this
# many sequences of max_model_len tokens, up to 1 GiB
CPU_KV_SEQUENCES = 64
CPU_KV_MAX_BYTES = 1 << 30


def cpu_kv_cache_bytes(config, max_model_len: int) -> int:
    """The KV cache a CPU engine allocates for a model of ``config`` (transformers'): room for
    ``CPU_KV_SEQUENCES`` sequences of ``max_model_len`` tokens, keys and values counted in float32
    (vLLM's cache is that or narrower), at most ``CPU_KV_MAX_BYTES``. vLLM's CPU backend touches
    its whole cache at start: one GiB per engine, as before, made a tiny demo model's worker hold a
    GiB of memory it never used, four times over in the demo server."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * 4
    return min(CPU_KV_MAX_BYTES, CPU_KV_SEQUENCES * max_model_len * per_token)


class VllmEngine(ArEngine):
    name = "vllm"

    def __init__(self, model: str, mode: str, dtype: str, max_model_len: int, engine_args: dict[str, Any],
                 seat: EngineSeat | None = None, cpus: frozenset[int] | None = None,
                 adapters: dict[str, str] | None = None, max_loras: int = 4):
        """``seat``: this instance's place in front of an engine core it
        shares with other instances (shared_engine.py); None: its own engine.
        ``cpus``: the CPUs the engine core it starts runs on (cpu_affinity.py).
        ``adapters``: LoRA adapters (name -> PEFT folder) requests may name; vLLM keeps
        ``max_loras`` on the device and batches requests of different adapters together."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        # disable_log_stats: vLLM's own statistics (its Prometheus registry, its periodic throughput
        # log line) live in this process, which serves no /metrics: nobody reads them, and updating
        # them per engine step costs the stub's GIL, which bounds it under load. Triton's metrics
        # (triton/metrics.py) count what they counted.
        args: dict[str, Any] = {"model": model, "dtype": dtype, "max_model_len": max_model_len,
                                "disable_log_stats": True}
        if mode == "encode":
            args |= {"runner": "pooling", "pooler_config": {"task": "token_embed"}}
        if current_platform.is_cpu():
            # vLLM on the CPU compiles the model with inductor at every engine start (0.32 fails to
            # load its own compiled model back), which lengthens the start that a developer and CI
            # wait for at every server start (benchmarks/engine_start.py). `engine_args`
            # {"enforce_eager": false} compiles.
            args["enforce_eager"] = True
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # vLLM's own setting, which overrides this one
                args["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(config, engine_args.get("max_model_len",
                                                                                           max_model_len))
        self.adapters = {name: LoRARequest(name, index + 1, path)
                         for index, (name, path) in enumerate(sorted((adapters or {}).items()))}
        if self.adapters:
            args |= {"enable_lora": True, "max_loras": min(max_loras, len(self.adapters)),
                     "max_lora_rank": lora_rank(adapters.values())}
        args |= engine_args  # model parameter `engine_args` (JSON) overrides anything above
        self.seat, self._watch = seat, None
        if seat is None:
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        else:
            self.engine = _shared_engine(AsyncEngineArgs(**args), seat)
            if not seat.starts_engine:
                self._watch = watch_engine(seat, on_exit=lambda: _engine_gone(self.engine))
        # seen now, while it runs: a core killed later (by vLLM's shutdown, or by anyone) maps nothing
        self._core = _engine_core(self.engine)
        self._core_segments = _core_segments(self._core)
        if cpus:
            try:
                _pin_engine_core(self.engine, cpus)
            except ValueError:  # the kernel refused the CPUs: no engine core left behind
                self.engine.shutdown()
                raise
        self.hidden_size = config.hidden_size
        self.max_logprobs = self.engine.vllm_config.model_config.max_logprobs
        self.max_num_seqs = self.engine.vllm_config.scheduler_config.max_num_seqs

    def check(self, options: SamplingOptions, logprobs: int | None = None) -> None:
        self.sampling_params(options, logprobs)

    def sampling_params(self, options: SamplingOptions, logprobs: int | None = None):
        """vLLM's ``SamplingParams`` for ``options``; ``logprobs`` asks for
        at least that many log probabilities (0: the sampled token's only)."""
        wanted = options.logprobs if logprobs is None else max(logprobs, options.logprobs or 0)
        if wanted is not None and wanted > self.max_logprobs:
            raise RequestValidationError("logprobs", f"this engine returns at most {self.max_logprobs}", wanted)
        # Only keys off their defaults: an empty list never reaches vLLM (its "not set" is None).
        kwargs = {key: getattr(options, key) for key in options.changed_keys()} | {"logprobs": wanted}
        try:
            if options.structured_outputs is not None:
                kwargs["structured_outputs"] = StructuredOutputsParams(**options.structured_outputs)
            return SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
        except Exception as exc:  # VLLMValidationError, ValueError, TypeError from vLLM's checks
            raise _validation_error(exc) from None

    async def stream(self, prompt_ids: list[int], options: SamplingOptions, request_id: str,
                     logprobs: int | None, on_delta: Callable[[Delta], None], lora: str | None = None,
                     prompt_embeds: torch.Tensor | None = None,
                     states_at: tuple[int, list[int]] | None = None, keep_states: bool = False,
                     states_input: torch.Tensor | None = None, vision: VisionInputs | None = None) -> None:
        """vLLM's output handler hands each output to the request itself.

        ``AsyncLLM.generate`` puts every output in the request's collector and
        wakes the task that awaits it; under load that is a task switch per
        request at every engine step, on the thread whose GIL the stub's
        requests and responses wait for. Here the collector's ``put`` delivers
        the output where the handler produces it, and the task wakes once,
        when the request is done. The collector is vLLM's own (``add_request``
        returns it; its output processor calls ``put``), so nothing else of
        the request's life changes: aborts, errors, the engine's death. (``states_at``, ``keep_states``,
        ``states_input``: never asked of this engine, ``check_states`` refuses them.)"""
        params = self.sampling_params(options, logprobs)
        done = asyncio.get_running_loop().create_future()

        def deliver(output) -> None:  # on the output handler; must never raise into it
            if done.done():  # finished, failed, or cancelled (vLLM's abort puts a last output)
                return
            if isinstance(output, BaseException):  # the engine's failure, for every request
                done.set_exception(output)
                return
            try:
                for completion in output.outputs:  # DELTA + n > 1: one child completion per output
                    on_delta(_delta(completion))
                if output.finished:
                    done.set_result(None)
            except BaseException as exc:
                done.set_exception(exc)

        try:
            collector = await self.engine.add_request(request_id, engine_input(prompt_ids, prompt_embeds), params,
                                                      lora_request=self.adapters.get(lora) if lora else None)
        except Exception as exc:
            if type(exc).__name__ == "VLLMValidationError":  # raised by the engine's input checks
                raise _validation_error(exc) from None
            raise
        collector.put = deliver
        if (waiting := collector.output) is not None:  # came before the line above
            collector.output = None
            deliver(waiting)
        try:
            await done
        except BaseException:  # cancelled, or failed: the engine forgets the request
            done.cancel()  # no more deliveries (a no-op when it failed)
            with contextlib.suppress(Exception):  # a dead engine cannot abort: its own error goes on
                await self.engine.abort(collector.request_id, internal=True)
            raise

    def check_images(self, field: str) -> None:
        raise RequestValidationError(field, "the vLLM engine is handed the thinker's language model alone, "
                                     "whose rotary embedding knows no image positions; a thinker that reads "
                                     "images runs on engine: transformers", "images")

    def check_states(self, field: str) -> None:
        raise RequestValidationError(field, "the vLLM engine hands on no hidden states (its outputs "
                                     "are tokens); a thinker whose talker reads them runs on engine: transformers",
                                     True)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def encode(self, batch: list[list[int]], layers: tuple[int, ...] = (-1,),
                     attended: list[int] | None = None, loras: list[str | None] | None = None) -> list[torch.Tensor]:
        """All prompts go to the engine at once; its scheduler batches them.
        vLLM's pooling runner returns the last layer of attended tokens only (the runner never
        asks for more: ``_vllm_cannot_encode``)."""
        if tuple(layers) != (-1,) or attended is not None:
            raise ValueError(f"vLLM returns the last hidden layer of every token only, not layers {layers}"
                             f"{' with unattended padding' if attended is not None else ''}")
        loras = loras or [None] * len(batch)
        if len(batch) == 1:  # the stub's one prompt per call: no task of its own
            return [await self._encode_one(batch[0], 0, loras[0])]
        return list(await asyncio.gather(*(self._encode_one(ids, i, lora)
                                           for i, (ids, lora) in enumerate(zip(batch, loras, strict=True)))))

    async def _encode_one(self, prompt_ids: list[int], index: int, lora: str | None = None) -> torch.Tensor:
        params = PoolingParams(task="token_embed", use_activation=False)
        request_id = f"encode-{uuid.uuid4().hex}-{index}"  # unique across concurrent batches
        result = None
        async for output in self.engine.encode(engine_input(prompt_ids), params, request_id,
                                               lora_request=self.adapters.get(lora) if lora else None):
            result = output.outputs.data
        if result is None:
            raise RuntimeError(f"vLLM returned no embeddings for request {request_id}")
        return result

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.set()
        engine, self.engine = self.engine, None
        now = _engine_core(engine)
        core, segments = self._core | now, self._core_segments | _core_segments(now)
        # the first frontend of a shared engine shuts the engine core down with it
        engine.shutdown(timeout=ENGINE_EXIT_S)
        _remove_what_a_killed_core_left(core, segments)
        if self.seat is not None:
            self.seat.release()
        # AsyncLLM.__del__ shuts down once more. Left to interpreter exit, it finds vLLM's module
        # globals already gone and prints a TypeError traceback at every server stop; collected
        # now, while everything is still there, it is a no-op.
        del engine
        gc.collect()


def _engine_core_processes(llm) -> list:
    """The engine core processes this frontend started (a shared engine's other frontends: none)."""
    manager = getattr(llm.engine_core.resources, "engine_manager", None)
    return list(getattr(manager, "processes", ()))


def _engine_core(llm) -> set[tuple[int, int | None]]:
    """Pid and start ticks of every running process of the engine core this frontend started."""
    return {(pid, started) for process in _engine_core_processes(llm) for pid in descendants(process.pid)
            if (started := start_ticks(pid)) is not None}


def _core_segments(core: set[tuple[int, int | None]]) -> set[Path]:
    """The ``/dev/shm`` files the engine core's processes (``_engine_core``) map now that are its own:
    Python's ``multiprocessing`` names (vLLM's shared-memory queues), less what this process maps
    (a core forked from it, vLLM's way on a CPU, maps the parent's files too: the stub's
    Python-backend region)."""
    mine = mapped_shared_memory([os.getpid()])
    return {segment for segment in mapped_shared_memory([pid for pid, _ in core])
            if segment.name.startswith(MULTIPROCESSING_SHM) and segment not in mine}


def _remove_what_a_killed_core_left(core: set[tuple[int, int | None]], segments: set[Path],
                                    wait_s: float = 15.0) -> None:
    """An engine core that exits cleanly unlinks its ``/dev/shm`` segments; one that vLLM had to
    kill (it did not exit within ``ENGINE_EXIT_S`` of SIGTERM) leaves them until the process that
    started it exits (its resource tracker's), which may be a long-lived one: a test session, a
    stub that loads the model again. Once every process of the core is gone, what of its own it
    mapped (``_core_segments``), left, and no live process maps is removed here."""
    deadline = time.monotonic() + wait_s
    while (left := [pid for pid, started in core if alive(pid, started)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        logger.warning("vLLM engine core processes %s still run after its shutdown; their shared memory stays", left)
        return
    # a file that a live process still maps is still in use, whoever made it
    for segment in segments - mapped_shared_memory(list(parents())):
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()


# vLLM's max_lora_rank takes one of these
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank(folders) -> int:
    """The smallest rank vLLM takes that holds every adapter's (their ``adapter_config.json``)."""
    from peft import LoraConfig

    ranks = []
    for folder in folders:
        config = LoraConfig.from_pretrained(folder)
        ranks += [config.r, *config.rank_pattern.values()]
    return next((rank for rank in VLLM_LORA_RANKS if rank >= max(ranks)), max(ranks))


def _delta(completion) -> Delta:
    """One of vLLM's ``CompletionOutput`` (DELTA) as the engines' ``Delta``."""
    return Delta(
        text=completion.text,
        num_tokens=len(completion.token_ids),
        finish_reason=completion.finish_reason,
        index=completion.index,
        logprobs=None if completion.logprobs is None else [
            {token: TokenLogprob(lp.logprob, lp.rank, lp.decoded_token or "") for token, lp in position.items()}
            for position in completion.logprobs],
        cumulative_logprob=completion.cumulative_logprob,
        token_ids=list(completion.token_ids),
    )


def engine_input(prompt_ids: list[int], prompt_embeds: torch.Tensor | None = None) -> dict:
    """A tokenized prompt as vLLM's engine input (its ``TokensInput``): the
    runner has tokenized and checked the prompt already. Given as a raw prompt
    instead (``{"prompt_token_ids": ...}``), vLLM renders it again, and
    releases after 0.24 do that on a thread pool, one more thread taking the
    stub's GIL for every request. With ``prompt_embeds`` (a prompt holding audio), its
    ``EmbedsInput``, on the host (the engine core copies it to the device); the engine was started
    with ``enable_prompt_embeds``."""
    if prompt_embeds is not None:
        return {"type": "embeds", "prompt_embeds": prompt_embeds.cpu()}
    return {"type": "token", "prompt_token_ids": prompt_ids}


def _shared_engine(engine_args, seat: EngineSeat):
    """An ``AsyncLLM`` on this seat's sockets; the first frontend starts the
    engine core first, with every frontend's addresses (what ``vllm serve
    --api-server-count N`` does in its parent process)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines
    from vllm.v1.executor import Executor

    config = engine_args.create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT)
    manager = None
    if seat.starts_engine:
        addresses = EngineZmqAddresses(inputs=[seat.input_address(i) for i in range(seat.frontends)],
                                       outputs=[seat.output_address(i) for i in range(seat.frontends)])
        # vLLM 0.24 yields a tuple, later releases a CoreEngineLaunch; both start with the engine manager
        with launch_core_engines(config, Executor.get_class(config), not engine_args.disable_log_stats,
                                 addresses) as launched:
            manager = launched[0] if isinstance(launched, tuple) else launched.engine_manager
            seat.record_engine([proc.pid for proc in manager.processes])
        # the handshake ran as the block ended: the engine core is up and connecting to every frontend
    llm = AsyncLLM.from_vllm_config(config, disable_log_stats=engine_args.disable_log_stats,
                                    client_addresses=seat.client_addresses, client_count=seat.frontends,
                                    client_index=seat.frontend)
    if manager is not None:
        # as for an engine it starts itself: the client watches the engine core and shuts it down with it
        llm.engine_core.resources.engine_manager = manager
        llm.engine_core.start_engine_core_monitor()
    return llm


def _pin_engine_core(llm, cpus: frozenset[int]) -> None:
    """The engine core this frontend started, with every thread and worker
    process under it, on ``cpus`` (a shared engine's other frontends started
    none: the first one pins it)."""
    for process in _engine_core_processes(llm):
        pin_process_tree(process.pid, cpus)


def _engine_gone(llm) -> None:
    """What vLLM's own monitor does when an engine core it started exits:
    mark it dead (new requests fail with ``EngineDeadError``) and shut the
    client down, which fails the requests in flight."""
    llm.engine_core.resources.engine_dead = True
    llm.engine_core.shutdown()


_SUFFIX = re.compile(r"\s*\(parameter=.*\)\s*$")


def _validation_error(exc: Exception) -> RequestValidationError:
    """vLLM's message, under the parameter it names (its ``parameter``
    attribute, else the sampling key its message starts with)."""
    message = _SUFFIX.sub("", str(exc)).strip() or type(exc).__name__
    parameter = getattr(exc, "parameter", None)
    if parameter is None:
        first = re.match(r"[`'\"]?(\w+)", message)
        parameter = first.group(1) if first and first.group(1) in SamplingOptions.names() else "sampling_parameters"
    return RequestValidationError(parameter, f"rejected by vLLM: {message}", None, show_value=False)
