"""Keep the garbage collector's full passes off a long-lived service's data path.

A service process holds a few hundred thousand objects from its imports (torch, pydantic, the
web stack) that live as long as it does, and CPython's cyclic collector walks all of them at
every full (generation-2) collection. In bench.wan's relay run (8 workers, 100 ms RTT, a loaded
2-core host) each worker paid one such pass of 0.11-0.22 s, most of them during versions 8-9, the
versions that stalled: a pass stops every stream the worker forwards, and in a pipeline every
worker after it waits too. Freezing the heap once start-up is done moves those objects to a
permanent generation the collector skips, as vLLM's engine does after its warm-up
(`vllm.utils.gc_utils.freeze_gc_heap`); objects allocated later are collected as before. The
entry points (`python -m services.rollout`, `python -m services.registry`) freeze once their app
is built; apps built in-process (tests) are left alone.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze every object still tracked; returns how
    many are frozen (gc.get_freeze_count)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
