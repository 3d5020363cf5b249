"""The learner: policy weights, optimizer and one GRPO + Sparse-RL update per rollout batch.

No Redis, no registry, no HTTP: the trainer service (core.py) feeds it trajectories and publishes
what it returns, and bench/learning.py drives it in-process with the same code. One call of
`train_step`:

1. recompute the dense old-policy log-probs of every sampled token (`logp_old_dense`) and, with a
   KL term, the frozen reference policy's;
2. Sparse-RL corrections from ξ = π_old_dense / π_sampler, once over the whole batch;
3. `ppo_updates` AdamW steps, each on a shuffled 1/N of the sequences (micro-batched), so the PPO
   ratio moves off 1 and the clip acts (Sparse-RL: 128 prompts × 8 samples, global batch 256 →
   4 updates per rollout).

The learner takes what it reads, `LearnerConfig` (the `optim` and `loss` sections and the step's
shape), not the trainer's whole settings: `LearnerConfig.of(settings)` picks them out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from services.trainer.batching import TrainBatch, collate
from services.trainer.evaluation import evaluate
from services.trainer.loss import Corrections, LossConfig, grpo_advantages, grpo_loss, sparse_rl_corrections
from services.trainer.optim import OptimSettings
from services.trainer.rollout_math import token_logprobs
from shared.dtypes import compute_dtype
from shared.patch import dense_bytes, extract_patch, fingerprint
from shared.patch.codec import Encoding
from shared.schemas import Sample, Trajectory
from shared.tasks import Task

if TYPE_CHECKING:
    from services.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)

# Eviction replay keeps the bf16 weights of this many recent versions, so samples up to this stale
# replay under the weights that drew them (the demo's workers run one version behind).
REPLAY_VERSIONS = 4
# Correction metrics reported per staleness (trainer version − sampling version): with staleness
# > 0, ξ mixes weight lag with KV sparsity, so the two are only comparable split this way.
_BY_STALENESS = ("xi_mean", "kl_old_sampler", "rejection_rate", "divergent_rate", "token_mask_rate")
# The mismatch figures also reported against a dense recompute when the recompute is replayed
# (`LearnerConfig.dense_mismatch`): the adaptive KV budget's signals.
DENSE_MISMATCH = ("rejection_rate", "divergent_rate", "kl_old_sampler")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def published_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """bf16 copies of the weights under the names HF's save_pretrained writes: a tied lm_head
    shares the embedding's storage and is listed once (the first name), like the rollout engines."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().to(torch.bfloat16, copy=True)
    return out


@dataclass(frozen=True)
class LearnerConfig:
    """Everything the learner reads: its two sections, and the few values that shape a step. No
    defaults here: each has its one, in `TrainerSettings` (`LearnerConfig.of`)."""

    optim: OptimSettings
    loss: LossConfig
    device: str  # "auto": cuda when there is one
    seed: int  # the initial RNG state and the minibatch order
    micro_batch: int  # sequences per forward/backward pass
    ppo_updates: int  # optimizer steps per rollout batch
    temperature: float  # the workers' sampling temperature (logp_old_dense is recomputed at it)
    bf16_autocast: bool
    activation_checkpointing: bool
    measure_batch_gain: bool
    patch_encoding: Encoding
    # Under eviction replay the old log-probs follow the sampler's own cache, so the step's mismatch
    # figures read ~0 at any budget; the adaptive KV budget then needs them against a dense recompute
    # too (`dense_<metric>`; one more no-grad forward per step).
    dense_mismatch: bool = False

    @classmethod
    def of(cls, settings: TrainerSettings) -> LearnerConfig:
        return cls(optim=settings.optim, loss=settings.loss, device=settings.device, seed=settings.seed,
                   micro_batch=settings.micro_batch, ppo_updates=settings.ppo_updates,
                   temperature=settings.sampling.temperature, bf16_autocast=settings.bf16_autocast,
                   activation_checkpointing=settings.activation_checkpointing,
                   measure_batch_gain=settings.measure_batch_gain, patch_encoding=settings.publish.encoding,
                   dense_mismatch=(settings.kv_control.mode == "adaptive"
                                   and settings.loss.recompute == "replayed"))


@dataclass
class Captured:
    """The published weights of one step, captured: `make_patch(run, base_version, target_version)`
    builds the patch from the previous capture's weights to these (host work only, no collective,
    safe in a thread while the next step trains); `state`, the full bf16 weights when asked for."""

    make_patch: Callable[[str, int, int], bytes]
    fingerprint: str
    state: dict[str, torch.Tensor] | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase (sharded capture)


class Learner:
    """One process holding the whole model. The hooks (`_device`, `_prepare`, `_micro_batches`,
    `_idle_pass`, `_sum`, `_logprobs_all`, `loss_scale` and the publishing methods) are what the
    distributed learner (distributed.py) overrides; the update itself is written once, here."""

    loss_scale = 1.0  # FSDP averages gradients over ranks; the distributed learner undoes that
    world_size, rank = 1, 0

    def __init__(self, config: LearnerConfig, model_dir: Path, pad_id: int) -> None:
        self.config = config
        self.device = self._device()
        self.pad_id = pad_id
        # bf16 autocast where the device multiplies bf16 natively; a CPU that only emulates it
        # (AVX2: ~30x slower than fp32) computes in fp32, as the rollout engine does there.
        self.bf16 = config.bf16_autocast and compute_dtype(self.device, torch.bfloat16) == torch.bfloat16
        if config.bf16_autocast and not self.bf16:
            log.info("bf16 autocast off: this CPU has no native bf16 matrix products (fp32 compute)")
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.config.use_cache = False
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The KL anchor: the starting weights (the warm start), frozen, in the dtype they were saved in
        # (upcast, exactly, where that dtype is only emulated).
        frozen = None
        if config.loss.kl_coef > 0:
            frozen = AutoModelForCausalLM.from_pretrained(model_dir).eval()
            frozen.to(compute_dtype(self.device, frozen.dtype))
            frozen.requires_grad_(False)
        self.evict = None
        if config.loss.recompute == "replayed":
            from services.trainer.eviction_masks import LAYER_MASKED, EvictionMasks

            for m in (model, frozen):
                if m is not None:
                    m.set_attn_implementation(LAYER_MASKED)
            # Replayed in the precision the learner computes in (a worker's, where bf16 is native).
            precision = torch.bfloat16 if self.bf16 else torch.float32
            self.evict = EvictionMasks(model.config, self.device, precision)
        self._sampled_weights: dict[int, dict[str, torch.Tensor]] = {}  # bf16 weights by version
        self.replayed_samples = 0  # samples the engine replayed (the rest came with their worker's record)
        self.model, self.ref_model = self._prepare(model, frozen)
        optim = config.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr,
                                           weight_decay=optim.weight_decay, betas=(optim.beta1, optim.beta2))
        self.step = 0
        # Minibatch order: its own generator, so sampling elsewhere does not change which sequences
        # share an update (a checkpoint stores its state).
        self.shuffle = torch.Generator().manual_seed(config.seed)
        self._init_published()

    def _device(self) -> torch.device:
        return resolve_device(self.config.device)

    def _prepare(self, model: torch.nn.Module,
                 frozen: torch.nn.Module | None) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        return model.to(self.device), None if frozen is None else frozen.to(self.device)

    # -- one update --

    def train_step(self, trajectories: Sequence[Trajectory], version: int | None = None) -> dict[str, Any]:
        """One rollout batch → `ppo_updates` optimizer steps. `version`: the weights' version now,
        for staleness (default: the newest version among the trajectories)."""
        s = self.config
        batch = collate(trajectories, self.pad_id)
        if version is None:
            version = max(batch.policy_versions)
        if self.evict is not None:
            batch.layer_masks = self._replayed_masks(trajectories, batch, version)
        batch = batch.to(self.device)
        advantages = grpo_advantages(batch.rewards, batch.group_index)
        mask = batch.completion_mask
        self.model.train()
        with torch.no_grad():
            logp_old = self._logprobs_all(self.model, batch)
            logp_ref = self._logprobs_all(self.ref_model, batch) if self.ref_model is not None else None
            logp_dense = None
            if s.dense_mismatch or s.loss.divergence_against == "dense":
                # Without replayed masks the old log-probs already are dense.
                logp_dense = (logp_old if batch.layer_masks is None else
                              self._logprobs_all(self.model, dataclasses.replace(batch, layer_masks=None)))
        judged_by = logp_dense if s.loss.divergence_against == "dense" else None
        corrections = sparse_rl_corrections(logp_old, batch.logp_sampler, mask, s.loss.corrections,
                                            advantages, logp_divergence=judged_by)
        dense: dict[str, float] = {}
        if logp_dense is not None and s.dense_mismatch:
            figures = (corrections.metrics if logp_dense is logp_old else
                       sparse_rl_corrections(logp_dense, batch.logp_sampler, mask, s.loss.corrections,
                                             advantages).metrics)
            dense = {f"dense_{k}": figures[k] for k in DENSE_MISMATCH}
        logp_before = None
        if s.measure_batch_gain:
            # In fp32 before and after the update: under bf16 autocast the weights are rounded at every
            # matmul, and a step that moves few of them across a rounding boundary measures as noise.
            with torch.no_grad(), self._fp32():
                logp_before = self._logprobs_all(self.model, batch)

        updates = min(s.ppo_updates, batch.sequences)
        order = torch.randperm(batch.sequences, generator=self.shuffle).to(self.device)
        # Summed over this process's micro-batches, then over processes: loss, clip and KL tokens.
        totals = torch.zeros(4, dtype=torch.float64)
        grad_norms, lr_scales = [], []
        for minibatch in order.tensor_split(updates):
            micro = self._micro_batches(minibatch)
            mine = torch.cat(micro) if micro else minibatch[:0]
            # Each process knows its own rows' counts; summed over processes, every process divides
            # by the minibatch's total and decides alike whether it steps.
            own = corrections.rows(mine)
            counts = torch.stack([own.normalizer(s.loss.aggregation), own.surviving().sum(),
                                  own.has_tokens.sum()]).double()
            normalizer, survivors, sequences = self._sum(counts).to(self.device).unbind()
            if float(survivors) < s.loss.min_surviving_sequences:
                continue  # no evidence: weights and optimizer state stay exactly as they are
            share = float(survivors / sequences)
            lr_scale = min(1.0, share / s.loss.full_step_share) if s.loss.scale_lr_by_survivors else 1.0
            self.optimizer.zero_grad(set_to_none=True)
            for rows in micro:
                if not rows.numel():
                    self._idle_pass(batch)
                    continue
                loss, m = self._loss(batch, rows, logp_old, logp_ref, advantages, corrections, normalizer)
                (loss * self.loss_scale).backward()
                kept = float(corrections.keep_token[rows].sum())
                totals += torch.tensor([float(loss.detach()), m["clip_fraction"] * kept,
                                        m.get("kl_ref", 0.0) * kept, kept], dtype=torch.float64)
            grad_norms.append(self._clip_grad_norm())
            self._optimizer_step(lr_scale)
            lr_scales.append(lr_scale)
        self.step += 1
        loss_sum, clip_sum, kl_sum, kl_tokens = self._sum(totals).tolist()
        taken = len(lr_scales)

        kept_all = float(corrections.keep_token.sum().clamp(min=1))
        gain: dict[str, float] = {}
        if logp_before is not None:
            with torch.no_grad(), self._fp32():
                logp_after = self._logprobs_all(self.model, batch)
            moved = (logp_after - logp_before) * advantages[:, None] * corrections.keep_token
            gain["batch_gain"] = float(moved.sum()) / kept_all
        if logp_ref is not None:
            gain["kl_ref"] = kl_sum / max(kl_tokens, 1.0)  # per kept token, whatever the micro-batching
        completion_lengths = mask.sum(dim=1).float()
        return {
            "step": self.step,
            "groups": len(trajectories),
            "sequences": batch.sequences,
            "updates": taken,  # optimizer steps taken; `skipped_updates` more had no surviving sequence
            "skipped_updates": updates - taken,
            "lr_scale": sum(lr_scales) / taken if taken else 0.0,
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std()) if batch.sequences > 1 else 0.0,
            "accuracy": float(batch.correct.float().mean()),
            "loss": loss_sum / max(taken, 1),
            "grad_norm": sum(grad_norms) / taken if taken else 0.0,
            "clip_fraction": clip_sum / kept_all,
            "completion_tokens_mean": float(completion_lengths.mean()),
            # Monte-Carlo estimate of the dense policy's per-token entropy: mean −log π_old of the
            # sampled tokens (exact in expectation for on-policy samples; ξ ≈ 1 keeps it close).
            "entropy": float(-(logp_old * mask).sum() / mask.sum().clamp(min=1)),
            # KV the samplers kept vs what a dense cache holds at the end of each sequence.
            "kv_saved": _kv_saved(batch).get("kv_saved", 0.0),
            "kv_peak_bytes_mean": float(batch.kv_peak_bytes.mean()),
            "staleness": {str(k): v for k, v in batch.staleness(version).items()},
            "by_staleness": self._by_staleness(batch, version, logp_old, advantages,
                                               logp_dense if s.dense_mismatch else None, judged_by),
            **{k: v for k, v in corrections.metrics.items() if k != "kept_tokens"},
            **dense,
            **gain,
        }

    def _optimizer_step(self, lr_scale: float) -> None:
        """One AdamW step at lr × lr_scale (the survivors' share: Adam's step does not shrink with
        the loss's 1/N, so the learning rate carries it)."""
        groups = self.optimizer.param_groups
        base = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, base, strict=True):
                group["lr"] = lr

    def _replayed_masks(self, trajectories: Sequence[Trajectory], batch: TrainBatch,
                        version: int) -> torch.Tensor | None:
        """What each sampled token's query saw in the sampler's compressed cache, per layer and KV head:
        the engine replays every sparse-cache sample under the weights of the version that sampled it
        (kept for the last REPLAY_VERSIONS versions; older ones replay under the weights now) and its
        trajectory's KV config; dense samples see the causal prompt. None when no sample was sparse.
        The masks are dense booleans, B × layers × KV heads × L² bytes: fine for the demo and bench
        shapes, not for billion-parameter models at thousands of tokens."""
        from services.rollout.engine import KVConfig
        from services.trainer.eviction_masks import batch_masks

        if self.world_size > 1:
            raise NotImplementedError("eviction replay runs in one process (recompute='replayed')")
        assert self.evict is not None
        # The weights now are version `version`'s (published after the last step): keep them, so
        # that samples a worker draws from them while the next steps train replay exactly.
        self._sampled_weights[version] = published_state(self.model)
        for old in sorted(self._sampled_weights)[:-REPLAY_VERSIONS]:
            del self._sampled_weights[old]
        config = cast(PreTrainedModel, self.model).config
        layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
        by_config: dict[tuple[str, int], list[tuple[int, Sample]]] = {}
        seen: dict[int, torch.Tensor] = {}
        row = 0
        for t in trajectories:
            kv = t.sampling.kv_config if t.sampling is not None else None
            weights = t.policy_version if t.policy_version in self._sampled_weights else version
            for sample in t.samples:
                if kv is not None:
                    recorded = self._recorded_visibility(sample, layers, kv_heads)
                    if recorded is not None:  # the worker's own record: exact, and no replay to run
                        seen[row] = recorded
                    else:
                        replay_group = (json.dumps(kv, sort_keys=True), weights)
                        by_config.setdefault(replay_group, []).append((row, sample))
                row += 1
        for (key, weights), rows in by_config.items():
            cache = KVConfig.model_validate(json.loads(key))
            visible = self.evict(self._sampled_weights[weights], [x.prompt_ids for _, x in rows],
                                 [x.completion_ids for _, x in rows], cache)
            seen.update({r: v.cpu() for (r, _), v in zip(rows, visible, strict=True)})
        self.replayed_samples += sum(len(rows) for rows in by_config.values())
        if not seen:
            return None
        return batch_masks(batch.attention_mask, layers, kv_heads, seen)

    @staticmethod
    def _recorded_visibility(sample: Sample, layers: int, kv_heads: int) -> torch.Tensor | None:
        """The sample's visibility from the evictions its worker recorded (Sample.evicted_at), or None
        (not recorded, or a record that does not fit this model: then the engine replays it)."""
        from services.rollout.engine.eviction_log import visibility

        if sample.evicted_at is None:
            return None
        try:
            return visibility(sample.evicted_at, layers, kv_heads,
                              len(sample.prompt_ids) + len(sample.completion_ids))
        except ValueError as exc:
            log.warning("replaying a sample whose recorded eviction does not fit: %s", exc)
            return None

    def _micro_batches(self, minibatch: torch.Tensor) -> list[torch.Tensor]:
        """This process's micro-batches of a minibatch (an empty one: run _idle_pass)."""
        return list(minibatch.split(self.config.micro_batch))

    def _idle_pass(self, batch: TrainBatch) -> None:
        """A forward/backward contributing nothing (only processes with collectives need it)."""

    def _sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over processes (here: one)."""
        return value

    def _clip_grad_norm(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP

    def _loss(self, batch: TrainBatch, rows: torch.Tensor, logp_old: torch.Tensor,
              logp_ref: torch.Tensor | None, advantages: torch.Tensor, corrections: Corrections,
              normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        logp_new = self._logprobs_local(self.model, batch, rows)
        return grpo_loss(logp_new, logp_old[rows], batch.logp_sampler[rows], advantages[rows],
                         batch.completion_mask[rows], self.config.loss,
                         logp_ref=None if logp_ref is None else logp_ref[rows],
                         corrections=corrections.rows(rows), normalizer=normalizer)

    def _by_staleness(self, batch: TrainBatch, version: int, logp_old: torch.Tensor, advantages: torch.Tensor,
                      logp_dense: torch.Tensor | None = None,
                      logp_divergence: torch.Tensor | None = None) -> dict[str, dict[str, float]]:
        versions = torch.tensor(batch.policy_versions, device=self.device)[batch.group_index]
        out = {}
        for lag in sorted(set(batch.staleness(version))):
            rows = (version - versions == lag).nonzero()[:, 0]

            def figures(logp: torch.Tensor, rows: torch.Tensor = rows) -> dict[str, float]:
                judged_by = None if logp_divergence is None else logp_divergence[rows]
                return sparse_rl_corrections(logp[rows], batch.logp_sampler[rows],
                                             batch.completion_mask[rows], self.config.loss.corrections,
                                             advantages[rows], judged_by).metrics

            old = figures(logp_old)
            out[str(lag)] = {k: old[k] for k in _BY_STALENESS} | {"sequences": int(rows.numel())}
            out[str(lag)] |= _kv_saved(batch, rows)
            if logp_dense is not None:
                dense = old if logp_dense is logp_old else figures(logp_dense)
                out[str(lag)] |= {f"dense_{k}": dense[k] for k in DENSE_MISMATCH}
        return out

    def _logprobs_all(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        """Token log-probs of every sequence of the batch (no_grad callers)."""
        return self._logprobs_local(model, batch, torch.arange(batch.sequences, device=self.device))

    def _logprobs_local(self, model: torch.nn.Module, batch: TrainBatch, rows: torch.Tensor) -> torch.Tensor:
        """Token log-probs of `rows`, micro-batched (no_grad callers get the whole set at once)."""
        parts = []
        for chunk in rows.split(self.config.micro_batch):
            with self._autocast():
                masks = None if batch.layer_masks is None else batch.layer_masks[chunk]
                parts.append(token_logprobs(model, batch.input_ids[chunk], batch.attention_mask[chunk],
                                            batch.completion_mask[chunk], self.config.temperature, masks))
        return torch.cat(parts)

    @contextlib.contextmanager
    def _fp32(self) -> Iterator[None]:
        """Compute in fp32 inside (bf16 autocast off)."""
        bf16, self.bf16 = self.bf16, False
        try:
            yield
        finally:
            self.bf16 = bf16

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def evaluate(self, tokenizer: PreTrainedTokenizerBase, task: Task, prompts: list[tuple[str, str]],
                 seed: int) -> dict[str, float]:
        """Held-out T = 1 accuracy of the policy now (evaluation.evaluate)."""
        return evaluate(cast(PreTrainedModel, self.model), tokenizer, task, prompts, sample=True, seed=seed)

    # -- published weights --

    def _init_published(self) -> None:
        self.published = published_state(self.model)  # the bf16 weights published last
        self.numel = sum(t.numel() for t in self.published.values())
        self.dense_bytes = dense_bytes(self.published)
        self.published_fingerprint = fingerprint(self.published)

    def published_state(self) -> dict[str, torch.Tensor]:
        """bf16 copies of the weights now (published or not)."""
        return published_state(self.model)

    def full_published(self) -> dict[str, torch.Tensor]:
        """The whole published bf16 weights (the v0 snapshot, resuming, tests)."""
        return self.published

    def capture(self, full_state: bool = False) -> Captured:
        """Take the weights now as the next published version; the patch from the last capture
        is built by the returned Captured.make_patch (with the whole weights in `state` if asked)."""
        old, new = self.published, published_state(self.model)
        base_fp, target_fp = self.published_fingerprint, fingerprint(new)
        self.published, self.published_fingerprint = new, target_fp
        make_patch = functools.partial(_extract, old, new, base_fp, target_fp,
                                       encoding=self.config.patch_encoding)
        return Captured(make_patch, target_fp, new if full_state else None)

    def load_published(self, state: dict[str, torch.Tensor]) -> None:
        """Set the master weights to published bf16 values (resume from the registry's head)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state.items():
                target: torch.Tensor = params[name] if name in params else self.model.get_buffer(name)
                target.copy_(tensor.to(target.device, target.dtype))
        self._init_published()

    def state_checksum(self) -> str:
        """Per tensor, the float64 sum and sum of squares of the master weights and of every
        optimizer state (Adam's moments and step count), hashed: two states that differ in any
        value almost surely differ here. A few reductions per tensor on the device, cheap enough
        to take at every checkpoint and after every resume (the resume check, docs/coordination.md)."""
        digest = hashlib.sha256()
        with torch.no_grad():
            tensors: list[tuple[str, torch.Tensor]] = [("param", p) for p in self.model.parameters()]
            for i, state in enumerate(self.optimizer.state.values()):
                tensors += [(f"{i}.{k}", v) for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
            for name, tensor in tensors:
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                t = local.detach().to(torch.float64)
                pair = torch.stack([t.sum(), (t * t).sum()])
                digest.update(name.encode() + pair.cpu().numpy().tobytes())
        return digest.hexdigest()[:16]

    def set_step(self, step: int) -> None:
        """Progress is the registry's head: after resuming from its weights the count follows it."""
        self.step = step

    def close(self) -> None:
        """Release what the learner drives (the distributed learner's followers)."""

    # -- checkpoints (torch.distributed.checkpoint: any world size reads any other's) --

    def save(self, directory: Path) -> None:
        """Master weights and optimizer state (DCP, one file per process) and the counters."""
        model, optim = get_state_dict(self.model, self.optimizer)
        with warnings.catch_warnings():  # one process: DCP says it assumes so
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save({"model": model, "optim": optim}, checkpoint_id=directory)
        if self.rank == 0:
            torch.save({"step": self.step, "shuffle": self.shuffle.get_state()}, directory / "learner.pt")

    def load(self, directory: Path) -> None:
        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=directory)
        set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=optim)
        counters = torch.load(directory / "learner.pt", weights_only=False)
        self.step = counters["step"]
        self.shuffle.set_state(counters["shuffle"])
        self._init_published()


def _extract(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], base_fp: str, target_fp: str,
             run: str, base_version: int, target_version: int, *, encoding: Encoding = "zstd") -> bytes:
    return extract_patch(old, new, run=run, base_version=base_version, target_version=target_version,
                         base_fingerprint=base_fp, target_fingerprint=target_fp, encoding=encoding)


def _kv_saved(batch: TrainBatch, rows: torch.Tensor | slice = slice(None)) -> dict[str, float]:
    """KV the samplers of `rows` (default all) saved against a dense cache (`kv_saved`), and the
    most one more token of budget could cost it (`kv_saved_per_token`: a sequence's peak grows by at
    most one token, and only if its cache evicted): the adaptive budget's floor (kv_budget, rule 5).
    Empty when the samplers reported no cache."""
    peak = batch.kv_peak_tokens[rows]
    if not peak.sum() > 0:
        return {}
    tokens = batch.attention_mask[rows].sum(dim=1).float().sum()
    return {"kv_saved": float(1 - peak.sum() / tokens),
            "kv_saved_per_token": float((batch.kv_evicted[rows] > 0).sum() / tokens)}
