"""Compact decoder models with Hugging Face parameter names."""

from services.rollout.models.decoder import DecoderLM, causal_attention, load_pretrained

__all__ = ["DecoderLM", "causal_attention", "load_pretrained"]
