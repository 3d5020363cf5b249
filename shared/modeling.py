"""Model configs used by tests, benchmarks and demos (no downloads)."""

from __future__ import annotations

from transformers import Qwen3Config

# name -> (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab). "0.6b", "1.7b" and "4b" are
# the published Qwen3-0.6B / 1.7B / 4B shapes; "tiny" is for unit tests, "small" (~36M params) for CPU
# benchmarks.
_QWEN3_SHAPES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (256, 768, 4, 4, 2, 64, 1024),
    "small": (512, 1536, 10, 8, 4, 64, 8192),
    "0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
    "1.7b": (2048, 6144, 28, 16, 8, 128, 151936),
    "4b": (2560, 9728, 36, 32, 8, 128, 151936),
}


def qwen3_config(shape: str) -> Qwen3Config:
    """A transformers Qwen3Config for one of the shapes "tiny", "small", "0.6b", "1.7b", "4b"."""
    if shape not in _QWEN3_SHAPES:
        raise ValueError(f"unknown Qwen3 shape {shape!r}; choose one of {sorted(_QWEN3_SHAPES)}")
    hidden, intermediate, layers, heads, kv_heads, head_dim, vocab = _QWEN3_SHAPES[shape]
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=40960 if shape in ("0.6b", "1.7b", "4b") else 4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
