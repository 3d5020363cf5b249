"""Values that must agree across services, and the one place each agreement is checked.

- Sampling (temperature, top-p, top-k = 0): the trainer recomputes logp_old_dense at its own
  temperature over the full vocabulary, and the recorded sampler log-probs are taken before
  top-k/top-p. A worker sampling otherwise would make the rejection-sampling ratio measure that,
  not the KV cache: the trainer refuses such trajectories (`sampling_mismatch`) and flags such
  workers in its status (the same check on the sampling a worker reports on its heartbeat).
- Run: workers, trainer and registry of one run share the run-scoped Redis keys and the
  registry path (shared.coord.keys, shared.registry.transport), so a worker of another run sees
  neither the prompts nor the weights: the run agrees by construction.
- KV policy vs engine: vLLM keeps a dense KV cache; the native engine runs every policy
  (`served_kv_policy` for a worker's setting, `kv_policy_refusal` for a request).
"""

from __future__ import annotations

from typing import Protocol

from shared.schemas import SamplingInfo

# Engines that keep a dense KV cache whatever policy is asked for.
DENSE_ONLY_ENGINES = frozenset({"vllm"})


class SamplingAssumption(Protocol):
    """What the trainer assumes about how its samples were drawn (shared.sampling.SamplingSettings)."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_p(self) -> float: ...


def sampling_mismatch(expected: SamplingAssumption, got: SamplingInfo | None) -> str | None:
    """Why samples drawn as `got` cannot be trained on under `expected`, or None."""
    if got is None:
        return "the worker did not report its sampling parameters"
    if got.temperature != expected.temperature:
        return f"sampled at temperature {got.temperature}, the trainer assumes {expected.temperature}"
    if got.top_p != expected.top_p or got.top_k != 0:
        return (f"sampled with top_p={got.top_p}, top_k={got.top_k}; "
                f"the trainer assumes top_p={expected.top_p}, top_k=0")
    return None


def served_kv_policy(engine: str, configured: str) -> str:
    """The KV policy a worker on `engine` runs when its setting says `configured`."""
    return "dense" if engine in DENSE_ONLY_ENGINES else configured


def kv_policy_refusal(engine: str, requested: str | None) -> str | None:
    """Why `engine` cannot serve a request for KV policy `requested` (None: the default), or None."""
    if engine in DENSE_ONLY_ENGINES and (requested or "dense") != "dense":
        return (f"kv_policy {requested!r} needs the native engine; this worker runs {engine}, "
                "which keeps a dense KV cache")
    return None
