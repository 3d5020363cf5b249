"""Sparse-KV generation engine (no HTTP): see docs/engine.md."""

from services.rollout.engine.config import GenerationOutput, KVConfig, KVStats, SamplingParams
from services.rollout.engine.llm_engine import LLMEngine

__all__ = ["GenerationOutput", "KVConfig", "KVStats", "LLMEngine", "SamplingParams"]
