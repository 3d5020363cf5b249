"""KV-cache policy names and budget defaults: a contract between workers, trainer, CLI and chart.

`KV_POLICIES` is the one list of names: the engine's `Policy` type, the worker's setting, the
request body, the CLI's choices and the chart's schema take it from here or are tested against
it (tests/unit/test_deploy_k8s.py). The defaults are Sparse-RL's R-KV setup (REFERENCE §1):
512 tokens kept, re-compressed every 128 decode steps.
"""

from __future__ import annotations

from typing import Literal, get_args

Policy = Literal["dense", "streaming", "snapkv", "h2o", "rkv"]
KV_POLICIES: tuple[Policy, ...] = get_args(Policy)
SPARSE_POLICIES: tuple[Policy, ...] = tuple(p for p in KV_POLICIES if p != "dense")

DEFAULT_KV_BUDGET = 512
DEFAULT_KV_BUFFER = 128
