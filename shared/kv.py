"""KV-cache policy names and budget defaults: a contract between workers, trainer, CLI and chart.

`KV_POLICIES` is the one list of names: the engine's `Policy` type, the worker's setting, the
request body, the CLI's choices and the chart's schema take it from here or are tested against
it (tests/unit/deploy/test_deploy_k8s.py). The defaults are Sparse-RL's R-KV setup (REFERENCE §1):
512 tokens kept, re-compressed every 128 decode steps. `LAYER_BUDGETS` names how a budget is
spread over the layers: `uniform` (every layer keeps `budget`) or `pyramid` (PyramidKV, Cai et al.
2024: lower layers keep more, upper fewer, in arithmetic steps, `layers × budget` in all).
"""

from __future__ import annotations

from typing import Literal, get_args

Policy = Literal["dense", "streaming", "snapkv", "h2o", "rkv"]
KV_POLICIES: tuple[Policy, ...] = get_args(Policy)
SPARSE_POLICIES: tuple[Policy, ...] = tuple(p for p in KV_POLICIES if p != "dense")
LayerBudgets = Literal["uniform", "pyramid"]
LAYER_BUDGETS: tuple[LayerBudgets, ...] = get_args(LayerBudgets)

DEFAULT_KV_BUDGET = 512
DEFAULT_KV_BUFFER = 128
# PyramidKV's beta (KVCache-Factory's default): the top layer keeps budget / beta, the bottom one
# 2 × budget − budget / beta.
DEFAULT_PYRAMID_BETA = 20
