"""Chat messages -> the prompt text, with the model's own chat template.

The template is the tokenizer's (``transformers``' ``apply_chat_template``,
as vLLM's and Triton's OpenAI servers render it). The gateway learns where
each text model's tokenizer is from ``--tokenizer MODEL=PATH`` (the launcher
passes the ``ar`` models'); the tokenizer is loaded on the first chat
request for that model, off the event loop.
"""

from __future__ import annotations

import asyncio

from triton_omni_gateway.errors import OpenAIError


class ChatTemplates:
    def __init__(self, tokenizers: dict[str, str]):
        self.paths = dict(tokenizers)
        self._loaded: dict[str, asyncio.Future] = {}

    async def render(self, model: str, messages: list[dict[str, str]]) -> str:
        tokenizer = await self.tokenizer(model)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    async def tokenizer(self, model: str):
        if model not in self.paths:
            raise OpenAIError(400, f"model '{model}' has no chat template here: the gateway knows the templates of "
                              f"{sorted(self.paths) or 'no model'} (--tokenizer MODEL=PATH); /v1/completions "
                              "takes a plain prompt", param="model", code="no_chat_template")
        if model not in self._loaded:
            self._loaded[model] = asyncio.ensure_future(asyncio.to_thread(_load, self.paths[model]))
        try:
            tokenizer = await asyncio.shield(self._loaded[model])
        except OSError as error:
            del self._loaded[model]  # tried again at the next request
            raise OpenAIError(500, f"the tokenizer of '{model}' did not load: {error}", code="tokenizer") from None
        if not tokenizer.chat_template:
            raise OpenAIError(400, f"model '{model}' has no chat template; /v1/completions takes a plain prompt",
                              param="model", code="no_chat_template")
        return tokenizer


def _load(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
