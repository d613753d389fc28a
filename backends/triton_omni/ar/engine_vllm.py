"""The vLLM engine: ``AsyncLLM`` driven from the runner's event loop.

``generate`` streams DELTA outputs; ``encode`` uses vLLM's pooling runner with
the ``token_embed`` task and the activation off, which returns the raw last
hidden states ``[num_tokens, hidden]`` (the same tensor the transformers
engine reads from ``hidden_states[-1]``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import torch

from triton_omni.ar.engine import ArEngine, Delta
from triton_omni.ar.request import SamplingOptions


class VllmEngine(ArEngine):
    def __init__(self, model: str, mode: str, dtype: str, max_model_len: int, engine_args: dict[str, Any]):
        from transformers import AutoConfig
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # vLLM on CPU takes a KV cache size from the environment (GiB); keep the demo small.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        args: dict[str, Any] = {"model": model, "dtype": dtype, "max_model_len": max_model_len}
        if mode == "encode":
            args |= {"runner": "pooling", "pooler_config": {"task": "token_embed"}}
        args |= engine_args  # model parameter `engine_args` (JSON) overrides anything above
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self.hidden_size = AutoConfig.from_pretrained(model).hidden_size

    async def generate(self, prompt_ids: list[int], options: SamplingOptions, request_id: str) -> AsyncIterator[Delta]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=options.max_tokens,
            min_tokens=options.min_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            seed=options.seed,
            stop=options.stop or None,
            ignore_eos=options.ignore_eos,
            repetition_penalty=options.repetition_penalty,
            output_kind=RequestOutputKind.DELTA,
        )
        num_tokens = 0
        async for output in self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id):
            completion = output.outputs[0]
            num_tokens += len(completion.token_ids)
            finish = (completion.finish_reason or "stop") if output.finished else None
            yield Delta(completion.text, num_tokens, finish)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def encode(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """All prompts go to the engine at once; its scheduler batches them."""
        return list(await asyncio.gather(*(self._encode_one(ids, i) for i, ids in enumerate(batch))))

    async def _encode_one(self, prompt_ids: list[int], index: int) -> torch.Tensor:
        from vllm import PoolingParams

        params = PoolingParams(task="token_embed", use_activation=False)
        request_id = f"encode-{id(prompt_ids)}-{index}"
        result = None
        async for output in self.engine.encode({"prompt_token_ids": prompt_ids}, params, request_id):
            result = output.outputs.data
        if result is None:
            raise RuntimeError(f"vLLM returned no embeddings for request {request_id}")
        return result

    async def shutdown(self) -> None:
        self.engine.shutdown()
