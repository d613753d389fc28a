"""The runner's prompt tokenization: a fast tokenizer's Rust backend called
directly gives the ids the tokenizer's own call gives."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from triton_omni.ar.runner import _token_ids_of
from triton_omni.demo_models import resolve_model

PROMPTS = [
    "a lighthouse on a cliff at dusk, oil painting",
    "",
    "  leading and trailing spaces  ",
    "lines\nand\ttabs\r\n",
    "unicode: café, 東京, emoji 🦜, RTL שלום",
    "special tokens in the text: <|endoftext|> and <|pad|>",
    "long " * 300,
]


@pytest.fixture
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("demo:tiny-qwen2"))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fast_path_gives_the_ids_of_the_call(tokenizer, prompt):
    token_ids = _token_ids_of(tokenizer)
    assert token_ids(prompt) == tokenizer(prompt, add_special_tokens=True)["input_ids"]


def test_fast_tokenizer_takes_the_backend(tokenizer, monkeypatch):
    token_ids = _token_ids_of(tokenizer)
    monkeypatch.setattr(type(tokenizer), "__call__", lambda *args, **kwargs: pytest.fail("the call was used"))
    assert token_ids("hello") == tokenizer.backend_tokenizer.encode("hello", add_special_tokens=True).ids


def test_a_backend_left_truncating_is_reset_first(tokenizer):
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    token_ids = _token_ids_of(tokenizer)
    prompt = "long " * 30
    assert len(token_ids(prompt)) > 4
    assert token_ids(prompt) == tokenizer(prompt, add_special_tokens=True)["input_ids"]
