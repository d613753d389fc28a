"""The vLLM engine's settings a CPU host can check without starting one: the KV cache's size."""

from __future__ import annotations

from transformers import Qwen2Config
from triton_omni.ar.engine_vllm import CPU_KV_MAX_BYTES, CPU_KV_SEQUENCES, cpu_kv_cache_bytes


def test_a_cpu_kv_cache_holds_the_sequences_a_model_needs_and_no_more_than_a_gib():
    tiny = Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    per_token = 2 * 2 * 2 * (32 // 4) * 4  # keys and values, layers, KV heads, head size, float32
    assert cpu_kv_cache_bytes(tiny, 1024) == CPU_KV_SEQUENCES * 1024 * per_token  # 8 MiB, not a GiB
    # a 7 B model's cache (28 layers, 4 KV heads of 128) reaches the cap
    seven_b = Qwen2Config(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4)
    assert cpu_kv_cache_bytes(seven_b, 4096) == CPU_KV_MAX_BYTES
    # it grows with the sequences' length until then
    assert cpu_kv_cache_bytes(tiny, 2048) == 2 * cpu_kv_cache_bytes(tiny, 1024)
