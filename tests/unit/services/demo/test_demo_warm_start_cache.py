"""`sparsecast demo` finds a cached warm start in its own process: no child importing torch and
transformers (9 s of every cached run on a 2-core Zen 3), the same hash the build stamps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import REPO_ROOT
from services.demo.launcher import Stack
from services.demo.options import DemoOptions
from services.trainer.warmstart_recipe import STAMP_FILE, WarmstartRecipe, cached_model_dir


def test_the_recipes_hash_needs_neither_torch_nor_transformers() -> None:
    probe = ("import json, sys\n"
             "from services.demo.launcher import Stack\n"
             "from services.trainer.warmstart_recipe import WarmstartRecipe\n"
             "print(json.dumps([WarmstartRecipe().fingerprint(),"
             " [m for m in ('torch', 'transformers') if m in sys.modules]]))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    fingerprint, imported = json.loads(done.stdout)
    assert imported == []
    # test_warmstart.py pins the hash's torch field to the imported torch's version
    assert fingerprint == WarmstartRecipe().fingerprint()


@pytest.mark.parametrize("scratchpad", [None, "column"])
def test_a_cached_warm_start_is_used_without_a_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      scratchpad: str | None) -> None:
    monkeypatch.chdir(tmp_path)  # the demo's cache is .cache/warmstart under the working directory
    addition = {**WarmstartRecipe().task_options["addition"]}
    if scratchpad:
        addition["scratchpad"] = scratchpad
    recipe = WarmstartRecipe(task_options={"addition": addition})
    cached = cached_model_dir(Path(".cache/warmstart").resolve(), recipe)
    cached.mkdir(parents=True)
    (cached / STAMP_FILE).write_text(recipe.fingerprint() + "\n")
    stack = Stack(DemoOptions(folder=tmp_path / "demo", scratchpad=scratchpad))
    started: list[str] = []
    monkeypatch.setattr(stack.procs, "start", lambda name, *a, **k: started.append(name))
    assert stack.warm_start_model() == cached and started == []
    (cached / STAMP_FILE).write_text("another recipe's hash\n")  # stale: the build's child is started
    with pytest.raises(AttributeError):  # the stub returns no child to follow
        stack.warm_start_model()
    assert started == ["warmstart"]
