"""Two gloo CPU processes running the DistributedLearner beside a single-process Learner on the
same batches; what they did is written as JSON for test_trainer_distributed.py to judge.

python -m tests.integration.distributed_run OUT_DIR MODEL_DIR

Phase 1 (world 2, torch.multiprocessing): rank 0 drives, rank 1 follows. One step on both
learners: metrics, master weights, the published patch and fingerprints; held-out evaluation;
a DCP checkpoint after step 1, then a second step on 9 sequences (rank 1 gets fewer micro-batches
and runs empty passes). Phase 2 (this process, world 1): a plain
Learner resumes from that checkpoint and takes the same second step.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from transformers import AutoTokenizer

from services.trainer.learner import Learner, LearnerConfig
from services.trainer.optim import OptimSettings
from services.trainer.settings import TrainerSettings
from shared.patch import apply_patch, extract_patch, fingerprint, read_header
from shared.tasks import get_task
from tests.unit.services.trainer.test_trainer_step import _trajectories

WORLD = 2


def learner_config(data_dir: Path) -> LearnerConfig:
    # fp32 compute (no autocast, no bf16 params) so the two paths can agree to float rounding;
    # micro-batches of 2 over 6 sequences per minibatch: ranks take 3 each, in 2 micro-batches.
    return LearnerConfig.of(TrainerSettings(
        model="unused",
        data_dir=str(data_dir),
        device="cpu",
        optim=OptimSettings(lr=1e-3),
        micro_batch=2,
        ppo_updates=2,
        bf16_autocast=False,
        loss={"kl_coef": 0.1},
        activation_checkpointing=True,
    ))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def master(learner: Learner) -> dict[str, torch.Tensor]:
    params = dict(learner.model.named_parameters())
    return {name: params[name].detach().clone() for name in learner.published}


def _metrics(m: dict[str, Any]) -> dict[str, float]:
    return {k: m[k] for k in ("loss", "grad_norm", "kl_ref", "clip_fraction", "entropy")}


def _worker(rank: int, out: str, model_dir: str, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from services.trainer.distributed import DistributedLearner, follow_until_stopped, init_process_groups

    init_process_groups("cpu")
    out_dir = Path(out)
    learner = DistributedLearner(learner_config(out_dir), Path(model_dir), pad_id=0)
    if rank != 0:
        follow_until_stopped(learner)
        return
    result: dict[str, Any] = {}
    single = Learner(learner_config(out_dir), Path(model_dir), pad_id=0)
    batch1, batch2 = _trajectories(vocab=90, seed=1), _trajectories(vocab=90, groups=3, samples=3, seed=2)
    v0 = learner.full_published()
    result["fingerprint_v0"] = [learner.published_fingerprint, single.published_fingerprint, fingerprint(v0)]
    task = get_task("addition")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = task.make_prompts(4, seed=7)
    result["evaluate"] = [
        learner.evaluate(tokenizer, task, prompts, seed=3),
        single.evaluate(tokenizer, task, prompts, seed=3),
    ]

    dist_m, single_m = learner.train_step(batch1, version=0), single.train_step(batch1, version=0)
    result["metrics"] = [_metrics(dist_m), _metrics(single_m)]
    result["master_diff"] = max_diff(learner.full_master(), master(single))
    captured, reference = learner.capture(full_state=True), single.capture()
    v1 = captured.state or {}
    patch = captured.make_patch("r", 0, 1)
    # The same weights through the single-process extractor: the same bytes.
    result["patch_identical"] = patch == extract_patch(v0, v1, run="r", base_version=0, target_version=1)
    result["patch_changed"] = read_header(patch).changed
    replica = {k: v.clone() for k, v in v0.items()}
    apply_patch(replica, patch)
    result["applied_diff"] = max_diff(replica, v1)
    # Against the single process's own weights (rounding may flip a few bf16 values).
    result["published_diff"] = max_diff(v1, single.full_published())
    result["single_patch_changed"] = read_header(reference.make_patch("r", 0, 1)).changed
    result["fingerprint_v1"] = [captured.fingerprint, fingerprint(v1)]

    learner.save(out_dir / "ckpt")
    result["saved"] = {"fingerprint": learner.published_fingerprint, "step": learner.step}
    torch.save(learner.full_master(), out_dir / "master_at_save.pt")
    learner.train_step(batch2, version=1)
    torch.save(learner.full_master(), out_dir / "master_step2.pt")
    learner.stop_followers()
    (out_dir / "world2.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def resume_at_world_one(out_dir: Path, model_dir: Path) -> dict[str, Any]:
    learner = Learner(learner_config(out_dir), model_dir, pad_id=0)
    learner.load(out_dir / "ckpt")
    at_save = torch.load(out_dir / "master_at_save.pt")
    result = {
        "fingerprint": learner.published_fingerprint,
        "step": learner.step,
        "master_diff_at_load": max_diff(master(learner), at_save),
    }
    learner.train_step(_trajectories(vocab=90, groups=3, samples=3, seed=2), version=1)
    result["master_diff_step2"] = max_diff(master(learner), torch.load(out_dir / "master_step2.pt"))
    return result


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(str(out_dir), str(model_dir), port), nprocs=WORLD, join=True)
    torch.set_num_threads(1)
    result = json.loads((out_dir / "world2.json").read_text())
    result["world1"] = resume_at_world_one(out_dir, model_dir)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
