"""Adaptive KV budget: hold a sampler-mismatch target by moving the rollout workers' KV budget.

A tighter KV budget saves memory but makes the sparse sampler drift from the dense policy: more
sequences vetoed by the Sparse-RL corrections (`rejection_rate`) and a larger per-token
KL(π_old_dense ‖ π_sampler) (`kl_old_sampler`). Sparrow (arXiv 2606.08446) adapts a
sparse-attention budget to hold a worst-token mismatch threshold; here the knob is the R-KV
budget the workers generate with, and the signal is one of the trainer's per-step correction
metrics. The controller is pure (no I/O): the trainer feeds it each step's evidence and publishes
the budget it answers with the next version (shared.registry.wire.RolloutDirective); workers take
it up when their weights reach that version.

The rule (`KVBudgetController.update`):

1. **Evidence at the current budget only.** A trajectory trained at step v may have been sampled
   at an older budget (its `sampling.kv_budget` says which; workers swap budgets with weights).
   The step's metric is split by sampling version (the learner's `by_staleness`); a version's
   figures count only if every trajectory of it was sampled at the budget in force and at or after
   the version that budget was first published with. Versions that mix budgets, or were sampled
   before the last move, are ignored (`evidence_from_step`).
2. **Smoothing weighed by that evidence.** The smoothed signal is an EMA of the current-budget
   observations, the step's weight `smoothing × share` where share is the fraction of the step's
   sequences that counted: a step of mostly stale samples barely moves it. The first observation
   at a budget sets it. A move resets it (the old budget's mismatch says little about the new one).
3. **Deadband and hysteresis.** No move until `min_sequences` sequences at the current budget
   have been seen since the last move. Then: signal > target × (1 + deadband) → raise the budget
   by the current step (less eviction, less mismatch); signal < target × (1 − deadband) → lower it
   (more KV saved); inside the band → hold. Always within [min_budget, max_budget].
4. **Step halving on reversal.** A move against the previous one halves the step (down to 1
   token); the `regrow_after`-th move in a row the same way doubles it back (up to `step`). When
   the target falls between two budgets `step` apart, the budget then settles between them instead
   of swinging from one to the other at every version (seen on a GPU: 56 ↔ 64 for 100 steps with
   step 8). With the default 2 (the second move doubles) the halving can be undone: a capped CPU
   demo cycled 32 → 28 → 30 → 34 → 32 → 28 (down 4, up 2, up 4, down 2, down 4) for 60 steps
   around a target met at 31; 3 settles there, but did not learn better in the demo (docs/training.md).
5. **A floor on the KV saved** (`min_saved`, off by default). The share of KV the sampler saved
   at the current budget (1 − Σ peak cache / Σ sequence length, smoothed as the signal) comes first:
   below the floor the budget goes down whatever the mismatch says, and a raise is cut to the tokens
   that keep it, at most `(saved − min_saved) / saved_per_token` where `saved_per_token` (the
   compressed sequences over all tokens) bounds what one more token of budget can cost: a sequence's
   peak grows by at most the raise, and only if the cache was compressing it. A cell whose mismatch
   at its start budget sits inside the band would otherwise hold a budget that saves too little (a
   GPU cell held 30-36 tokens at 38 % saved).

**What held the budget** (`kv_held_by` in each report, None when it moved with the version): `target`
(the signal inside the band), `evidence` (fewer than `min_sequences` at the budget since the last
move), `floor` (over the target, but `min_saved` allows no raise: the floor, not the target, set the
budget), `min_budget` / `max_budget` (a move the bounds stopped), `fixed`. A controller held by its
floor step after step has a target it cannot reach there (seen on a GPU: 36-41 % divergent against
0.1 at the 40 % floor for a whole run); the operator reads that here instead of from the budget alone.

Mode "fixed" never moves: the trainer publishes `start_budget` (None: nothing, workers keep their
own budget, the behaviour before this controller). In "adaptive" mode with no `start_budget` the
controller adopts the budget most of the first batch was sampled at (the workers' own).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from shared.schemas import Trajectory

# divergent_rate: the share of sequences with a token the dense policy would rarely have sampled
# (ξ < mask_low). Under a rule that vetoes only some of them (the default veto_negative, or the
# authors' token rule) the veto rate understates the mismatch: 3 % vetoed with 35 % divergent was seen.
Metric = Literal["rejection_rate", "divergent_rate", "kl_old_sampler"]
# Why the budget published with a version did not move (module docstring); None: it moved.
HeldBy = Literal["fixed", "evidence", "target", "floor", "min_budget", "max_budget"]


def kv_saved_share(lengths: Sequence[tuple[int, int]], budget: int, buffer: int, keep_prompt: bool) -> float:
    """The share of KV a compressing cache saves over sequences of these (prompt, completion) token
    lengths, as workers report it (1 − Σ peak stored / Σ tokens seen): a sequence's evictable tokens
    peak at `budget + buffer`, just before a compression; a kept prompt is stored whole besides them.
    On the demo's task it matches the engine's figure (32 + 2: 46.5 % both; 36 + 2: 40.2 and 40.3 %)."""
    seen = sum(p + c for p, c in lengths)
    cap = budget + buffer
    peak = sum(p + min(c, cap) if keep_prompt else min(p + c, cap) for p, c in lengths)
    return 1 - peak / seen if seen else 0.0


class KVControlSettings(BaseModel):
    """TrainerSettings.kv_control (env SPARSECAST_KV_CONTROL__MODE=adaptive, __TARGET=0.3, ...)."""

    mode: Literal["fixed", "adaptive"] = "fixed"
    # The default divergence rule (veto_negative) vetoes only the divergent losers, so its veto rate
    # shows part of the mismatch: the divergent share is the signal (docs/training.md, "Which signal").
    metric: Metric = "divergent_rate"
    # In the metric's units: a share of sequences for rejection_rate and divergent_rate, nats per
    # token for kl_old_sampler.
    target: float = Field(default=0.3, gt=0)
    # Half-width of the hold band, a fraction of the target: hold while |signal − target| ≤ deadband × target.
    deadband: float = Field(default=0.2, ge=0, lt=1)
    # EMA weight of a step made wholly of current-budget evidence (1: no smoothing).
    smoothing: float = Field(default=0.5, gt=0, le=1)
    # Sequences sampled at the current budget needed before the next move (hysteresis).
    min_sequences: int = Field(default=64, ge=1)
    min_budget: int = Field(default=16, ge=1)
    max_budget: int = Field(default=512, ge=1)
    start_budget: int | None = Field(default=None, ge=1, description="None: the workers' own budget")
    step: int = Field(default=4, ge=1, description="tokens per move")
    # Rule 4: the move in a row the same way that doubles the step back after a halving.
    regrow_after: int = Field(default=2, ge=2)
    # The least share of KV saved the controller keeps (rule 5); None: no floor, the bounds only.
    min_saved: float | None = Field(default=None, gt=0, lt=1)

    @model_validator(mode="after")
    def _bounds(self) -> KVControlSettings:
        if self.min_budget > self.max_budget:
            raise ValueError(f"min_budget {self.min_budget} > max_budget {self.max_budget}")
        if self.start_budget is not None and not self.min_budget <= self.start_budget <= self.max_budget:
            raise ValueError(
                f"start_budget {self.start_budget} is outside [{self.min_budget}, {self.max_budget}]")
        return self


@dataclass(frozen=True)
class Evidence:
    """One sampling version's share of a step: its sequences, the budget they were all sampled at
    (None: mixed or dense), the metric over them, and the KV they saved (`kv_saved`, with
    `saved_per_token` the most one more token of budget could cost it; None: not reported)."""

    version: int
    budget: int | None
    sequences: int
    value: float
    saved: float | None = None
    saved_per_token: float | None = None


def signal_key(metric: Metric, dense_mismatch: bool) -> str:
    """The step metric that carries `metric`: under eviction replay the trainer's own figures match
    the sampler by construction, so the learner also reports them against a dense recompute
    (`dense_<metric>`, when its LearnerConfig.dense_mismatch is on) and the controller reads those."""
    return f"dense_{metric}" if dense_mismatch else metric


def evidence_from_step(trajectories: Sequence[Trajectory], metrics: Mapping[str, Any], version: int,
                       key: str) -> list[Evidence]:
    """Split a learner step's metric `key` (`signal_key`) by sampling version (`by_staleness`,
    staleness = version − policy_version), each with the budget its trajectories were sampled at
    (None if they differ)."""
    budgets: dict[int, set[int | None]] = {}
    for t in trajectories:
        budgets.setdefault(t.policy_version, set()).add(t.sampling.kv_budget if t.sampling else None)
    cells = []
    for lag, figures in (metrics.get("by_staleness") or {}).items():
        sampled_at = version - int(lag)
        seen = budgets.get(sampled_at, {None})
        value = figures.get(key)
        if value is None:
            continue
        saved, per_token = figures.get("kv_saved"), figures.get("kv_saved_per_token")
        cells.append(Evidence(version=sampled_at, budget=next(iter(seen)) if len(seen) == 1 else None,
                              sequences=int(figures.get("sequences", 0)), value=float(value),
                              saved=None if saved is None else float(saved),
                              saved_per_token=None if per_token is None else float(per_token)))
    return cells


class KVBudgetController:
    """The budget to publish with each version (module docstring: the rule)."""

    def __init__(self, settings: KVControlSettings) -> None:
        self.settings = settings
        self.budget: int | None = settings.start_budget  # in force: published with the last version
        self.since: int = 0  # the first version published with `budget`
        self.signal: float | None = None  # smoothed metric at `budget` since the last move
        self.saved: float | None = None  # smoothed KV saved at `budget` (rule 5), as the signal
        self.saved_per_token: float | None = None
        self.evidence = 0  # sequences at `budget` behind `signal`
        self.moves = 0
        self.step = settings.step  # tokens of the next move (rule 4)
        self.direction = 0  # of the last move: +1 up, −1 down, 0 none yet
        self.streak = 0  # moves in a row made in `direction`
        self.held_by: HeldBy | None = "evidence" if self.adaptive else "fixed"

    @property
    def adaptive(self) -> bool:
        return self.settings.mode == "adaptive"

    def _clamp(self, budget: int) -> int:
        return min(max(budget, self.settings.min_budget), self.settings.max_budget)

    def _move(self, budget: int, version: int) -> None:
        if budget != self.budget:
            self.moves += self.budget is not None
            self.budget, self.since, self.signal, self.evidence = budget, version, None, 0
            self.saved = self.saved_per_token = None

    def update(self, cells: Iterable[Evidence], next_version: int) -> dict[str, Any]:
        """Take one step's evidence; return the report for the version about to be published
        (`kv_budget`: the budget published with `next_version`)."""
        cells = list(cells)
        if self.adaptive:
            if self.budget is None:  # adopt the workers' own budget: what most sequences used
                used = Counter[int]()
                for c in cells:
                    if c.budget is not None:
                        used[c.budget] += c.sequences
                if used:
                    own = used.most_common(1)[0][0]
                    self.budget, self.since = self._clamp(own), 0
                    if self.budget != own:  # clamped: the evidence was sampled at another budget
                        self.since = next_version
            self._observe(cells)
        signal, evidence, saved = self.signal, self.evidence, self.saved  # what the decision saw
        if self.adaptive:
            self._decide(next_version)
        return {"kv_budget": self.budget, "kv_signal": signal, "kv_evidence": evidence,
                "kv_saved_signal": saved, "kv_budget_since": self.since, "kv_step": self.step,
                "kv_direction": self.direction, "kv_streak": self.streak, "kv_held_by": self.held_by,
                # What the controller holds; a fixed budget holds nothing.
                "kv_metric": self.settings.metric if self.adaptive else None,
                "kv_target": self.settings.target if self.adaptive else None}

    def _observe(self, cells: list[Evidence]) -> None:
        total = sum(c.sequences for c in cells)
        current = [c for c in cells if c.budget is not None and c.budget == self.budget
                   and c.version >= self.since and c.sequences > 0]
        counted = sum(c.sequences for c in current)
        if not counted:
            return
        weight = self.settings.smoothing * counted / total

        def smooth(old: float | None, values: list[tuple[float, int]]) -> float | None:
            if not values:
                return old
            observed = sum(v * n for v, n in values) / sum(n for _, n in values)
            return observed if old is None else (1 - weight) * old + weight * observed

        self.signal = smooth(self.signal, [(c.value, c.sequences) for c in current])
        self.saved = smooth(self.saved, [(c.saved, c.sequences) for c in current if c.saved is not None])
        self.saved_per_token = smooth(self.saved_per_token, [
            (c.saved_per_token, c.sequences) for c in current if c.saved_per_token is not None])
        self.evidence += counted

    def _decide(self, next_version: int) -> None:
        s = self.settings
        if self.budget is None or self.signal is None or self.evidence < s.min_sequences:
            self.held_by = "evidence"
            return
        under_floor = s.min_saved is not None and self.saved is not None and self.saved < s.min_saved
        if under_floor or self.signal < s.target * (1 - s.deadband):
            direction = -1
        elif self.signal > s.target * (1 + s.deadband):
            direction = 1
        else:
            self.held_by = "target"
            return
        step, streak = self.step, self.streak + 1 if direction == self.direction else 1
        if self.direction and direction != self.direction:
            step = max(1, step // 2)
        elif streak >= s.regrow_after:
            step = min(s.step, step * 2)
        tokens = step if direction < 0 else min(step, self._room())
        if tokens < 1:  # the floor allows no raise: hold, the step as it was
            self.held_by = "floor"
            return
        self.step = step
        budget = self._clamp(self.budget + direction * tokens)
        if budget == self.budget:
            self.held_by = "max_budget" if direction > 0 else "min_budget"
            return
        self.direction, self.streak, self.held_by = direction, streak, None
        self._move(budget, next_version)

    def _room(self) -> int:
        """Tokens of budget a raise may add and keep `min_saved` (rule 5); unbounded without a floor
        or without compressed sequences (a raise then saves as much as before)."""
        floor, saved, per_token = self.settings.min_saved, self.saved, self.saved_per_token
        if floor is None or saved is None or not per_token:
            return self.settings.max_budget
        return int((saved - floor) / per_token + 1e-9)

    def resume(self, budget: int | None, metrics: Mapping[str, Any], version: int) -> None:
        """Continue from what was published last (the head manifest, `version`): its budget and,
        unless the budget moved with that version, the signal and evidence in its step metrics
        (`update`'s report); without them the budget counts from `version`. Fixed mode publishes
        its own setting whatever was published before."""
        if budget is None or not self.adaptive:
            return
        self.budget = self._clamp(budget)
        step, direction = metrics.get("kv_step"), metrics.get("kv_direction")
        if isinstance(step, int) and isinstance(direction, int):  # rule 4's state, as published
            self.step, self.direction = min(max(step, 1), self.settings.step), max(-1, min(direction, 1))
            streak = metrics.get("kv_streak")  # not in manifests from before it: one move, no doubling yet
            self.streak = max(streak, 0) if isinstance(streak, int) else int(self.direction != 0)
        since, signal, evidence = (metrics.get(k) for k in ("kv_budget_since", "kv_signal", "kv_evidence"))
        if (self.budget == budget and metrics.get("kv_budget") == budget and isinstance(since, int)
                and since < version):
            self.since = since
            self.signal = float(signal) if isinstance(signal, int | float) else None
            self.evidence = evidence if isinstance(evidence, int) else 0
            saved = metrics.get("kv_saved_signal")
            self.saved = float(saved) if isinstance(saved, int | float) else None
        else:  # moved with this version, or figures that do not describe its budget
            self.since, self.signal, self.evidence, self.saved = version, None, 0, None
        self.saved_per_token = None  # not published: the next step's evidence sets it

    def state(self) -> dict[str, Any]:
        """The whole state, for a checkpoint (`load_state`) and the trainer's status."""
        return {"kv_budget": self.budget, "kv_budget_since": self.since, "kv_signal": self.signal,
                "kv_evidence": self.evidence, "kv_moves": self.moves, "kv_step": self.step,
                "kv_direction": self.direction, "kv_streak": self.streak, "kv_saved_signal": self.saved,
                "kv_saved_per_token": self.saved_per_token, "kv_held_by": self.held_by}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.budget, self.since = state["kv_budget"], state["kv_budget_since"]
        self.signal, self.evidence, self.moves = state["kv_signal"], state["kv_evidence"], state["kv_moves"]
        # Checkpoints from before rule 4 start from a full step.
        self.step, self.direction = state.get("kv_step", self.settings.step), state.get("kv_direction", 0)
        self.streak = state.get("kv_streak", int(self.direction != 0))
        # ...and from before rule 5 without the KV saved: the next step's evidence sets it.
        self.saved, self.saved_per_token = state.get("kv_saved_signal"), state.get("kv_saved_per_token")
        self.held_by = state.get("kv_held_by", self.held_by)
