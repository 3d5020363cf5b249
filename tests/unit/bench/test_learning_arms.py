"""bench.learning's command line: `ARM@kl=COEF` gives one arm its own KL anchor weight, so anchored
and unanchored arms share a run (one warm start, one judgement against the plain `dense`); a bad
name is a usage error before any warm start is built; `--build-only` builds the warm start alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import learning
from bench.learning import main, parse_arm
from services.trainer.warmstart_recipe import WarmstartRecipe
from tests.unit.bench.arm_steps import arm_step_rows


def test_an_arm_name_may_carry_its_own_anchor_weight() -> None:
    assert parse_arm("dense") == ("dense", None)
    assert parse_arm("dense@kl=0.04") == ("dense", 0.04)
    assert parse_arm("adaptive_replayed_veto_negative@kl=0") == ("adaptive_replayed_veto_negative", 0.0)


@pytest.mark.parametrize("name", ["nope", "nope@kl=0.1", "dense@kl", "dense@kl=", "dense@kl=x",
                                  "dense@kl=-0.1", "dense@kl=nan", "dense@kl=inf", "dense@lr=1e-4"])
def test_a_bad_arm_name_says_why(name: str) -> None:
    with pytest.raises(ValueError, match="unknown arm|the only option"):
        parse_arm(name)


@pytest.mark.parametrize(("arms", "seeds", "says"), [
    ("dense,nope", "0", "unknown arm"), ("dense,dense@kl=-1", "0", "the only option"),
    ("dense,dense", "0", "named twice"), ("dense", "0,x", "--seeds"), ("dense", "1,1", "named twice")])
def test_bad_arms_or_seeds_are_a_usage_error_before_the_warm_start(
        arms: str, seeds: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(SystemExit) as exc:
        main(["--preset", "smoke", "--arms", arms, "--seeds", seeds, "--cache", str(cache),
              "--out", str(tmp_path / "r.json")])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    assert not cache.exists()  # nothing was built


def test_the_arms_anchor_weight_overrides_the_configs(tiny_model_dir: str, tmp_path: Path) -> None:
    """The learner keeps a frozen reference (and logs `kl_ref`) only when its loss is anchored."""
    anchored = arm_step_rows("dense@kl=0.5", tiny_model_dir, tmp_path)
    assert all("kl_ref" in r for r in anchored)
    assert anchored[-1]["kl_ref"] > 0.0  # the first step moved the policy off its reference
    unanchored = arm_step_rows("dense@kl=0", tiny_model_dir, tmp_path, kl_coef=0.5)
    assert not any("kl_ref" in r for r in unanchored)


def test_build_only_builds_the_configured_warm_start_and_runs_no_arm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--build-only`: the warm start the `--set` flags configure, built into `--cache`; no arm, no result."""
    built: list[tuple[Path, int]] = []

    def fake_build(cache: Path, recipe: WarmstartRecipe) -> Path:  # services.trainer.warmstart builds
        built.append((cache, recipe.seed))
        model_dir = cache / "warmstart-fake"
        model_dir.mkdir(parents=True)
        (model_dir / "warmstart.json").write_text(json.dumps({"steps_done": 320, "eval": {"addition": {}}}))
        return model_dir

    monkeypatch.setattr(learning, "ensure_warmstart_model", fake_build)
    out = tmp_path / "r.json"
    main(["--preset", "smoke", "--set", "recipe.seed=5", "--build-only", "--cache", str(tmp_path / "cache"),
          "--out", str(out)])
    assert built == [(tmp_path / "cache", 5)]
    printed = json.loads(capsys.readouterr().out)
    assert printed["warmstart"] == str(tmp_path / "cache" / "warmstart-fake")
    assert printed["steps_done"] == 320
    assert not out.exists() and not out.with_suffix(".runs").exists()
