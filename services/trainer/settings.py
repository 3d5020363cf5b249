"""Settings of the trainer service (env prefix SPARSECAST_, nested with __, e.g.
SPARSECAST_LOSS__CORRECTIONS__TOKEN_MASK=false).

The optimizer is one section, `optim` (`services.trainer.optim.OptimSettings`: SPARSECAST_OPTIM__LR,
__WEIGHT_DECAY, __BETA1, __BETA2, __GRAD_CLIP). The flat names it replaced (SPARSECAST_LR,
SPARSECAST_WEIGHT_DECAY, SPARSECAST_BETA1, SPARSECAST_BETA2, SPARSECAST_GRAD_CLIP) still set it,
with a deprecation warning; in Python, `optim=OptimSettings(...)` is the only way.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.trainer.kv_budget import KVControlSettings
from services.trainer.loss import LossConfig
from services.trainer.optim import OptimSettings
from shared.coord import CoordSettings
from shared.patch.codec import Encoding
from shared.sampling import FLAT_SAMPLING_NAMES, SamplingSettings
from shared.settings import ModelServiceSettings

# The flat names of the `optim` section's fields before it was one (deprecated; FlatAliases).
FLAT_OPTIM_NAMES: dict[str, tuple[str, str]] = {
    field: ("optim", field) for field in ("lr", "weight_decay", "beta1", "beta2", "grad_clip")
}


class PublishSettings(BaseModel):
    """What the trainer publishes to the registry with each version."""

    model_config = ConfigDict(extra="forbid")

    # How patches are encoded (docs/patch-format.md): "zstd" picks values or bitdelta per tensor
    # (fast: ~0.1 s to build or apply the demo model's patch on 2 cores); "auto" also tries ctxans,
    # the context-modelled coder, 0.74-0.78x the i.i.d. entropy floor on the 1.7B shape (10-40 %
    # fewer bytes than bitdelta) but ~4-5x slower to encode and decode: worth it on slow links. The
    # sharded (FSDP) writer uses "zstd" whatever is set here.
    encoding: Encoding = "zstd"
    # Snapshots the trainer uploads itself every N versions (0: none); not the registry's
    # SPARSECAST_SNAPSHOT_EVERY, which has the registry build them from the patches.
    snapshot_every: int = Field(default=0, ge=0)


# The flat names of the `publish` section's fields before it was one (deprecated; FlatAliases).
FLAT_PUBLISH_NAMES: dict[str, tuple[str, str]] = {
    "patch_encoding": ("publish", "encoding"), "upload_snapshot_every": ("publish", "snapshot_every"),
}


class TrainerSettings(ModelServiceSettings):
    port: int = 8000
    # "tiny-demo": the cached warm-start tiny model (services.trainer.warmstart); else a HF model dir.
    model: str = "tiny-demo"
    # Where the warm-start model is cached (shared by demo runs and tests started from the same folder).
    warmstart_cache: str = ".cache/warmstart"
    data_dir: str = "./data/trainer"  # checkpoints, metrics.jsonl, the warm-start cache
    # api_token: the bearer token for writes (prompts, pause/resume, checkpoint). Unset: a random
    # token is made at startup and written to <data_dir>/api-token (on a loopback bind only: off
    # loopback the service refuses to start).
    # publish_token: the bearer token of the trainer's registry writes (SPARSECAST_PUBLISH_TOKEN,
    # the registry's publish_token); unset: api_token (deprecated, warned). worker_token: the
    # credential the rollout workers sign trajectories with (shared.signing); set, the trainer
    # refuses unsigned or badly signed trajectories; unset, signatures are not checked (loopback
    # development only). Either way it trains only groups its ledger admitted
    # (services.trainer.admission).
    publish_token: str | None = None
    worker_token: str | None = None
    # The trainer cannot run without its registry and Redis (whose URL carries the trainer's Redis
    # user and password where Redis requires auth): both are required.
    registry_url: str = "http://127.0.0.1:8100"
    redis_url: str = "redis://127.0.0.1:6379"
    coord: CoordSettings = Field(default_factory=CoordSettings)

    # AdamW and the gradient clip (Sparse-RL's lr 1e-6, wd 0.1, betas (0.9, 0.98), clip 1.0; the
    # tiny demo model needs a larger lr to move within minutes: services.trainer.optim.DEMO_OPTIM).
    optim: OptimSettings = Field(default_factory=OptimSettings)
    loss: LossConfig = Field(default_factory=LossConfig)
    # Must equal the workers' (one section, shared.sampling): logp_old_dense is recomputed at this
    # temperature over the full vocabulary; trajectories sampled otherwise are refused and counted.
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    groups_per_step: int = Field(default=16, ge=1)
    micro_batch: int = Field(default=64, ge=1, description="sequences per forward/backward pass")
    # Optimizer steps per rollout batch, each on a shuffled 1/N of its sequences: the PPO ratio then
    # moves off 1 between updates and the clip acts (Sparse-RL: 4). 1 = one step on the whole batch.
    ppo_updates: int = Field(default=4, ge=1)
    collect_timeout_s: float = Field(default=600.0, gt=0, description="step with what arrived after this")
    max_steps: int = Field(default=0, ge=0, description="0 = train until stopped")
    # Compute in bf16 (fp32 master weights); a CPU without native bf16 products computes in fp32.
    bf16_autocast: bool = True
    # Recompute each decoder layer's activations in the backward pass instead of keeping them:
    # less memory for longer sequences or bigger micro-batches, about a third more compute.
    activation_checkpointing: bool = False
    # Report `batch_gain` (two more forward passes per step, in fp32 before and after the update):
    # the advantage-weighted log-prob change, > 0 when the update moved toward the better samples
    # of each group. A low-noise sign of learning where reward is noisy.
    measure_batch_gain: bool = False
    # The learner's state (master weights, Adam moments, step, RNG) is written before each Nth
    # version is published, so a crash resumes at the head exactly; with N > 1 a crash resumes the
    # head's weights from the registry with moments up to N - 1 versions old (docs/coordination.md).
    checkpoint_every: int = Field(
        default=1, ge=0, description="versions between checkpoints, each written before its version is out"
    )
    # Held-out validation: every `eval_every` steps (and once before the first), the policy's T = 1
    # accuracy with a dense cache on `eval_prompts` fixed prompts of the default task, in the step's
    # metrics as heldout_accuracy / heldout_reward. 0 = off.
    eval_every: int = Field(default=0, ge=0)
    eval_prompts: int = Field(default=128, ge=1)
    # The default task's options for those prompts (get_task's keywords, e.g. {"scratchpad": "sum"}
    # for addition): the held-out prompts then ask for the completions the run trains on.
    eval_task_options: dict[str, int | str] = Field(default_factory=dict)
    publish: PublishSettings = Field(default_factory=PublishSettings)
    seed: int = 0
    # Request limits of POST /v1/prompts (why: docs/coordination.md, "Bad input"): the body (413
    # over it, checked while it streams in) and each prompt's fields (422).
    max_body_bytes: int = Field(default=32 << 20, ge=1)
    max_prompt_chars: int = Field(default=65_536, ge=1, description="~16k tokens of text")
    max_answer_chars: int = Field(default=4_096, ge=1)
    max_metadata_bytes: int = Field(default=16_384, ge=0, description="metadata as UTF-8 JSON")
    # Faults (docs/coordination.md): how often the trainer checks that every submitted group is
    # queued, in flight, trained or dead-lettered, and queues again what Redis lost; and how long
    # its step loop may go without progress before /healthz reports it stuck (a step on a large
    # model, or the first warm start, must fit in it).
    reconcile_every_s: float = Field(default=15.0, gt=0)
    stall_s: float = Field(default=600.0, gt=0)
    # Default task for POST /v1/prompts with generated prompts.
    default_task: str = "addition"
    samples_per_prompt: int = Field(default=8, ge=1)
    # The rollout workers' KV budget, published with every version (services.trainer.kv_budget):
    # "fixed" (default) publishes start_budget if set, else nothing; "adaptive" moves it between
    # min_budget and max_budget to hold `metric` at `target`. SPARSECAST_KV_CONTROL__MODE=adaptive, ...
    kv_control: KVControlSettings = Field(default_factory=KVControlSettings)

    flat_aliases = FLAT_OPTIM_NAMES | FLAT_PUBLISH_NAMES | FLAT_SAMPLING_NAMES
