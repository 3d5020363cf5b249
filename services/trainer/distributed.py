"""The learner on several processes: FSDP2 (`fully_shard`) under torchrun, one GPU per process
(or CPU processes with gloo, for tests).

Rank 0 runs the trainer service and drives the others: every public call of the learner on rank 0
first broadcasts a command (its name and arguments) over a gloo process group on the CPU, then
runs it; the other ranks run `follow()`, which receives commands and runs the same code, so every
collective (FSDP's all-gathers and reduce-scatters, the sums below) is entered by all ranks in
the same order. Rank 0 alone gets the results.

- Weights: each decoder layer and the root are sharded on dim 0 (fp32 master, AdamW state
  sharded with it); with bf16_autocast on a device with native bf16, compute in bf16
  (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`).
- The update equals the single-process one on the same batch: every rank collates the whole
  batch, recomputes the old-policy log-probs of its share of the sequences (all-gathered), takes
  its share of every minibatch, and divides its summed loss by the minibatch's kept-token (or
  sequence) count, all-reduced. A rank with fewer micro-batches runs empty passes so the
  collectives match.
- Publishing: each rank keeps its own shard of the bf16 published weights and compares it with
  the new one (shared.patch.sharded); each tensor's changed slices go to one rank (all-to-all of
  raw bytes), which joins and entropy-codes it, and the coded streams go to rank 0 (a gather of
  raw bytes), which lays out the one container the single-process path would make. No rank holds
  the whole model.
- Checkpoints: torch.distributed.checkpoint, read back at any world size.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.trainer.batching import TrainBatch
from services.trainer.learner import Captured, Learner, LearnerConfig, resolve_device
from services.trainer.model_dir import resolve_model_dir
from services.trainer.rollout_math import token_logprobs
from services.trainer.settings import TrainerSettings
from shared.patch.codec import CHUNK_BYTES, build_patch, entropy_code
from shared.patch.format import EncodedTensor
from shared.patch.sharded import (
    dense_size,
    encode_shard,
    fingerprint_from_slices,
    owners,
    pack_encoded,
    receive_sizes,
    shard_sums,
    unpack,
    unpack_encoded,
)
from shared.tasks import Task

log = logging.getLogger(__name__)
_control: dist.ProcessGroup | None = None
STOP = "stop"


def launched_distributed() -> bool:
    """Started by torchrun (or alike) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


# How long a follower waits for rank 0's next command: the service sends none while it waits for
# trajectories (a paused or idle run), so this is long; a dead rank 0 ends the job via torchrun.
COMMAND_TIMEOUT = timedelta(days=7)


def init_process_groups(device: str = "auto", timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join the job torchrun describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...):
    the compute group (nccl on GPUs, gloo on CPUs; `timeout_s` bounds one collective) and a gloo
    group for commands. Returns (rank, world size)."""
    global _control
    on_gpu = resolve_device(device).type == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(seconds=timeout_s))
    _control = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def control_group() -> dist.ProcessGroup:
    if _control is None:
        raise RuntimeError("init_process_groups() first")
    return _control


class DistributedLearner(Learner):
    def __init__(self, config: LearnerConfig, model_dir: Path, pad_id: int) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.control = control_group()
        self._lock = threading.Lock()  # one command at a time (the HTTP checkpoint call vs the loop)
        super().__init__(config, model_dir, pad_id)

    # -- commands --

    def _run(self, name: str, *args: Any) -> Any:
        """On rank 0: tell every rank to run command `name`, then run it here."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 drives the learner; the others follow()")
        with self._lock:
            dist.broadcast_object_list([name, args], src=0, group=self.control)
            return _COMMANDS[name](self, *args)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it sends stop_followers()."""
        while True:
            message: list[Any] = [None, None]
            dist.broadcast_object_list(message, src=0, group=self.control)
            name, args = message
            if name == STOP:
                return
            _COMMANDS[name](self, *args)

    def close(self) -> None:
        try:
            self.stop_followers()
        except Exception as exc:  # a stop signal reaches every rank at once: followers may be gone
            log.warning("could not tell the other ranks to stop: %s", exc)

    def stop_followers(self) -> None:
        if self.rank == 0:
            with self._lock:
                dist.broadcast_object_list([STOP, ()], src=0, group=self.control)

    def train_step(self, trajectories: Any, version: int | None = None) -> dict[str, Any]:
        return self._run("train_step", list(trajectories), version)

    def capture(self, full_state: bool = False) -> Captured:
        return self._run("capture", full_state)

    def full_published(self) -> dict[str, torch.Tensor]:
        return self._run("full_published")

    def full_master(self) -> dict[str, torch.Tensor]:
        """The whole fp32 master weights on rank 0 (tests, export)."""
        return self._run("full_master")

    def load_published(self, state: dict[str, torch.Tensor]) -> None:
        self._run("load_published", state)

    def save(self, directory: Path) -> None:
        self._run("save", Path(directory))

    def load(self, directory: Path) -> None:
        self._run("load", Path(directory))

    def set_step(self, step: int) -> None:
        self._run("set_step", step)

    def evaluate(
        self, tokenizer: PreTrainedTokenizerBase, task: Task, prompts: list[tuple[str, str]], seed: int
    ) -> dict[str, float]:
        # Every rank generates the same sequences (same prompts, seed and weights), so FSDP's
        # collectives match step for step.
        return self._run("evaluate", tokenizer, task, prompts, seed)

    def published_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("sharded: use capture() or full_published()")

    # -- hooks of the update --

    def _device(self) -> torch.device:
        device = resolve_device(self.config.device)
        if device.type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return device

    @property
    def loss_scale(self) -> float:  # type: ignore[override]
        return float(self.world_size)  # FSDP divides the summed gradients by the world size

    def _prepare(
        self, model: torch.nn.Module, frozen: torch.nn.Module | None
    ) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = mixed if self.bf16 else MixedPrecisionPolicy()
        return _shard(model.to(self.device), policy), None if frozen is None else _shard(
            frozen.to(self.device), MixedPrecisionPolicy()
        )

    def _micro_batches(self, minibatch: torch.Tensor) -> list[torch.Tensor]:
        share = minibatch.tensor_split(self.world_size)
        mine = list(share[self.rank].split(self.config.micro_batch))
        most = math.ceil(share[0].numel() / self.config.micro_batch)  # rank 0's share is the largest
        return mine + [minibatch[:0]] * (most - len(mine))

    def _idle_pass(self, batch: TrainBatch) -> None:
        with self._autocast():
            logits = self.model(
                input_ids=batch.input_ids[:1], attention_mask=batch.attention_mask[:1], use_cache=False
            ).logits
        (logits.float().sum() * 0.0).backward()

    def _sum(self, value: torch.Tensor) -> torch.Tensor:
        total = value.to(self.device, copy=True)
        dist.all_reduce(total)
        return total

    def _logprobs_all(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        share = torch.arange(batch.sequences, device=self.device).tensor_split(self.world_size)
        mine = share[self.rank]
        parts = []
        for chunk in self._micro_batches(torch.arange(batch.sequences, device=self.device)):
            if not chunk.numel():
                with self._autocast():
                    model(
                        input_ids=batch.input_ids[:1],
                        attention_mask=batch.attention_mask[:1],
                        use_cache=False,
                    )
                continue
            with self._autocast():
                parts.append(
                    token_logprobs(
                        model,
                        batch.input_ids[chunk],
                        batch.attention_mask[chunk],
                        batch.completion_mask[chunk],
                        self.config.temperature,
                    )
                )
        width = batch.input_ids.shape[1]
        local = torch.zeros(share[0].numel(), width, dtype=torch.float32, device=self.device)
        if parts:
            local[: mine.numel()] = torch.cat(parts)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        return torch.cat([g[: s.numel()] for g, s in zip(gathered, share, strict=True)])

    # -- published weights, one shard per rank --

    def _slices(self) -> list[tuple[str, torch.Tensor, int, tuple[int, ...]]]:
        """(name, this rank's slice of the master tensor, its first flat element, full shape), in
        the names published_state() gives one process (tied weights once)."""
        out = []
        params = dict(self.model.named_parameters())
        for name in self._names:
            tensor = params.get(name)
            if tensor is None:  # a persistent buffer: replicated; rank 0 reports it whole
                buffer = self.model.get_buffer(name)
                out.append(
                    (name, buffer if self.rank == 0 else buffer.reshape(-1)[:0], 0, tuple(buffer.shape))
                )
                continue
            assert isinstance(tensor, DTensor)
            shape = tuple(tensor.shape)
            _, offset = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            start = offset[0] * math.prod(shape[1:]) if shape else 0
            out.append((name, tensor.to_local(), start, shape))
        return out

    def _init_published(self) -> None:
        if not hasattr(self, "_names"):
            state = self.model.state_dict()
            params = dict(self.model.named_parameters())
            tied = {n for n, _ in self.model.named_parameters(remove_duplicate=False)} - set(params)
            self._names = [n for n in state if n not in tied]
        slices = self._slices()
        self._meta = {name: (torch.bfloat16, shape) for name, _, _, shape in slices}
        self._offsets = {name: (start, local.numel()) for name, local, start, _ in slices}
        self.numel = sum(math.prod(shape) for _, shape in self._meta.values())
        self.dense_bytes = 2 * self.numel
        self.published = {name: local.detach().to(torch.bfloat16, copy=True) for name, local, _, _ in slices}
        sums = shard_sums([(name, self.published[name], start) for name, _, start, _ in slices])
        gathered = self._gather(sums)
        self.published_fingerprint = (
            fingerprint_from_slices(self._meta, _flat(gathered)) if self.rank == 0 else ""
        )
        self._layouts = self._gather(self._offsets)  # rank 0: each rank's (start, numel) per name

    def _gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` on rank 0 (a list by rank; [] on the others), over the CPU group."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out or []

    def _capture(self, full_state: bool) -> Captured | None:
        """Every rank: compare and encode its shard (shared.patch.sharded), send each tensor's
        slices to the rank that entropy-codes it (one all-to-all of raw bytes), code its share,
        and send the coded streams to rank 0 (one gather of raw bytes), which lays out the patch
        in make_patch. Rank 0 gets the seconds of each phase in Captured.timings."""
        t0 = time.perf_counter()
        new = {name: local.detach().to(torch.bfloat16, copy=True) for name, local, _, _ in self._slices()}
        offsets = {name: start for name, (start, _) in self._offsets.items()}
        with torch.no_grad():
            encoding = encode_shard(self.published, new, offsets)
            sums = shard_sums([(name, new[name], offsets[name]) for name in encoding.names])
        self.published = new
        t1 = time.perf_counter()
        metas = self._all_gather_rows(encoding.meta)
        owner = owners(metas)
        send, send_sizes = encoding.pack(owner, self.world_size)
        received = self._all_to_all(send, send_sizes, receive_sizes(metas, encoding.widths, owner, self.rank))
        t2 = time.perf_counter()
        encoded = entropy_code(unpack(received, metas, encoding, owner, self.rank, self._meta))
        t3 = time.perf_counter()
        blobs = self._gather_bytes(pack_encoded(encoded, encoding.names))
        gathered = self._gather((sums, [t1 - t0, t3 - t2]))
        state = self._full(new) if full_state else None
        if self.rank != 0:
            return None
        streams = [e for blob in blobs for e in unpack_encoded(blob, encoding.names, self._meta)]
        base_fp = self.published_fingerprint
        target_fp = self.published_fingerprint = fingerprint_from_slices(
            self._meta, _flat(g[0] for g in gathered)
        )
        timings = {
            "encode": t1 - t0,  # this rank's compare + encode + fingerprint parts
            "encode_max": max(g[1][0] for g in gathered),  # the slowest rank's
            "exchange": t2 - t1,  # the all-to-all (waits for the slowest encoder)
            "entropy": t3 - t2,  # this rank's join + zstd of the tensors it owns
            "entropy_max": max(g[1][1] for g in gathered),
            "gather": time.perf_counter() - t3,  # coded streams and sums to rank 0
        }
        make_patch = functools.partial(
            _build, self._meta, sorted(streams, key=lambda e: e.name), base_fp, target_fp
        )
        return Captured(make_patch, target_fp, state, timings)

    # -- raw-byte collectives on the compute group (NCCL on GPUs: tensors on this rank's device) --

    def _all_gather_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's int64 table of the same shape (host), by rank."""
        parts = [torch.empty_like(rows, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(parts, rows.to(self.device))
        return list(torch.stack(parts).cpu().unbind())

    def _all_to_all(
        self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]
    ) -> list[torch.Tensor]:
        """Bytes send[...] split by send_sizes to each rank; returns what each rank sent here (host)."""
        received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(received, send.to(self.device), recv_sizes, send_sizes)
        return list(received.cpu().split(recv_sizes))

    def _gather_bytes(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's uint8 buffer on rank 0's host, by rank ([] on the others); sizes first."""
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()], device=self.device))
        lengths = [int(n) for n in torch.cat(sizes).cpu()]
        padded = torch.zeros(max(1, *lengths), dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data.to(self.device)
        out = [torch.empty_like(padded) for _ in lengths] if self.rank == 0 else None
        dist.gather(padded, out, dst=0)
        return [t[:n].cpu() for t, n in zip(out, lengths, strict=True)] if out is not None else []

    def _full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors on rank 0's host from every rank's slices ({} on the others)."""
        parts = self._gather({name: t.detach().cpu() for name, t in local.items()})
        if self.rank != 0:
            return {}
        out = {}
        for name, (_, shape) in self._meta.items():
            flat = torch.empty(math.prod(shape), dtype=parts[0][name].dtype)
            for rank, part in enumerate(parts):
                start, count = self._layouts[rank][name]
                flat[start : start + count] = part[name].reshape(-1)
            out[name] = flat.view(shape)
        return out

    def _full_published(self) -> dict[str, torch.Tensor]:
        return self._full(self.published)

    def _full_master(self) -> dict[str, torch.Tensor]:
        return self._full({name: local for name, local, _, _ in self._slices()})

    def _load_published(self, state: dict[str, torch.Tensor] | None) -> None:
        """Rank 0 holds `state` whole; each rank receives only its slices."""
        mine: list[Any] = [None]
        pieces = None
        if self.rank == 0:
            assert state is not None
            pieces = [
                {
                    name: state[name].reshape(-1)[start : start + count].clone()
                    for name, (start, count) in layout.items()
                }
                for layout in self._layouts
            ]
        dist.scatter_object_list(mine, pieces, src=0, group=self.control)
        with torch.no_grad():
            for name, local, _, _ in self._slices():
                local.copy_(mine[0][name].view(local.shape).to(local.device, local.dtype))
        self._init_published()

    def _save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)  # one file per rank in it (shared storage across nodes)
        Learner.save(self, directory)

    def _evaluate(
        self, tokenizer: PreTrainedTokenizerBase, task: Task, prompts: list[tuple[str, str]], seed: int
    ) -> dict[str, float]:
        return Learner.evaluate(self, tokenizer, task, prompts, seed)


def _shard(model: torch.nn.Module, policy: MixedPrecisionPolicy) -> torch.nn.Module:
    decoder = cast(torch.nn.Module, model.model)  # HF decoder-only models: model.model.layers
    layers = cast(torch.nn.ModuleList, decoder.layers)
    for layer in layers:  # one FSDP unit per decoder layer
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _flat(lists: Any) -> list[Any]:
    return [item for items in lists for item in items]


def _build(
    meta: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    encoded: list[EncodedTensor],
    base_fp: str,
    target_fp: str,
    run: str,
    base_version: int,
    target_version: int,
) -> bytes:
    dense_bytes, numel = dense_size(meta)
    return build_patch(
        encoded,
        run=run,
        base_version=base_version,
        base_fingerprint=base_fp,
        target_version=target_version,
        target_fingerprint=target_fp,
        chunk_bytes=CHUNK_BYTES,
        dense_bytes=dense_bytes,
        numel=numel,
    )


_COMMANDS: dict[str, Any] = {
    "train_step": Learner.train_step,
    "capture": DistributedLearner._capture,
    "full_published": DistributedLearner._full_published,
    "full_master": DistributedLearner._full_master,
    "load_published": DistributedLearner._load_published,
    "save": DistributedLearner._save,
    "load": Learner.load,
    "set_step": Learner.set_step,
    "evaluate": DistributedLearner._evaluate,
}


def make_learner(config: LearnerConfig, model_dir: Path, pad_id: int) -> Learner:
    """The distributed learner when this process is one of several (torchrun), else Learner."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistributedLearner(config, model_dir, pad_id)
    return Learner(config, model_dir, pad_id)


def follow_until_stopped(learner: DistributedLearner) -> None:
    """A follower's life: run commands, then leave the process groups."""
    try:
        learner.follow()
    finally:
        dist.destroy_process_group()


def prepare_model(settings: TrainerSettings) -> Path:
    """The model directory, made by rank 0 first when it must be (the tiny-demo warm start), then
    by the others from its cache (on one node; several nodes need a model directory they all see)."""
    if dist.get_rank() == 0:
        path = resolve_model_dir(settings)
        dist.barrier(group=control_group())
    else:
        dist.barrier(group=control_group())
        path = resolve_model_dir(settings)
    return path


def run_follower(settings: TrainerSettings, model_dir: Path) -> None:
    """Ranks > 0: the same learner as rank 0's, driven by it."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    follow_until_stopped(DistributedLearner(LearnerConfig.of(settings), model_dir, pad_id))
