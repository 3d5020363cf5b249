"""CUDA graphs of the decode step, one per batch-size bucket (as nano-vllm and vLLM capture them).

An eager decode step of a 28-layer model launches ~700 kernels, each paying the host's dispatch
cost, so at small batch the GPU waits on the host (bench/results/profile-*.json). A graph replays
the whole step (embedding, layers with fused kernels: fused_decode.py, logits, the cache's length
updates) with one launch. What a
graph needs, fixed shapes and addresses, the static KVCache gives: its allocation never moves, the
step reads lengths from the device, and attention covers the capacity with splits that exit early
past a row's length (kernels.py). Sampling, finish checks and compression run outside the graph.

Buckets: 1, 2, 4, 8, then multiples of 16 up to the batch, and the batch itself; a batch of n live
rows replays the smallest bucket >= n (the rows past n compute what nobody reads). Each bucket is
captured when first needed, all into one memory pool, and kept with its StaticStorage across
generate() calls (llm_engine.py says when they are dropped): capturing costs 50-100 ms a call.
"""

from __future__ import annotations

from typing import Any

import torch

from services.rollout.engine.fused_decode import FusedDecoder
from services.rollout.engine.kv_cache import StaticStorage
from services.rollout.models.decoder import DecoderLM


def buckets(batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < batch] + list(range(16, batch, 16)) + [batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """The captured decode steps over one StaticStorage; the engine keeps both across generate()
    calls, so a bucket is captured once per storage, not once per call."""

    def __init__(self, model: DecoderLM, storage: StaticStorage) -> None:
        self.decoder, self.storage = FusedDecoder(model), storage
        device = storage.lengths.device
        self.tokens = torch.zeros(storage.batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(storage.batch, dtype=torch.long, device=device)
        self.buckets = buckets(storage.batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool, from the first capture
        self.captures = 0

    def start(self, positions: torch.Tensor) -> None:
        """A new batch: positions [n] of its first generated tokens (rows [0, n) of the storage)."""
        self.positions[: positions.shape[0]].copy_(positions)

    def _step(self, b: int) -> torch.Tensor:
        positions = self.positions[:b]
        self.storage.record_positions(positions)
        logits = self.decoder(self.tokens[:b], positions, self.storage)
        self.storage.advance(b)
        positions += 1
        return logits

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up (compiles the Triton kernels, sets up cuBLAS) runs the step for real: put back
        # what it advanced. Its cache writes are the ones the next real step makes again.
        saved = self.storage.device_state(), self.positions.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step(b)
        torch.cuda.current_stream().wait_stream(stream)
        self.storage.restore_device_state(saved[0])
        self.positions.copy_(saved[1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(b)
        self._pool = graph.pool()
        self.captures += 1
        return graph, logits

    def select_rows(self, rows: list[int]) -> None:
        """Follow KVCache.select_rows: the live rows' positions move to the front."""
        index = torch.tensor(rows, device=self.positions.device)
        self.positions[: len(rows)] = self.positions.index_select(0, index)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decode tokens [n] (one per live row) -> logits [n, vocab]; advances the storage's device side."""
        n = tokens.shape[0]
        b = next(size for size in self.buckets if size >= n)
        self.tokens[:n].copy_(tokens)
        if b not in self._graphs:
            self._graphs[b] = self._capture(b)
        graph, logits = self._graphs[b]
        graph.replay()
        return logits[:n]
