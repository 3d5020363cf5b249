"""Warm start in a shortened mode: deterministic bytes, a loadable HF dir, and cache reuse."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.trainer import warmstart, warmstart_recipe
from services.trainer.warmstart import ensure_warmstart_model, train_warmstart
from services.trainer.warmstart_recipe import LevelCheck, WarmstartRecipe

# No level check: a 3-step model samples no level right (`test_a_build_that_lacks_a_level_...`).
SHORT = WarmstartRecipe(steps=3, batch_size=4, warmup_steps=1, eval_prompts=0, level_check=None)


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_short_warmstart_is_deterministic_and_loadable(tmp_path):
    train_warmstart(SHORT, tmp_path / "a", log_every=0)
    train_warmstart(SHORT, tmp_path / "b", log_every=0)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    other = SHORT.model_copy(update={"seed": 1})
    train_warmstart(other, tmp_path / "c", log_every=0)
    assert _digest(tmp_path / "c") != _digest(tmp_path / "a")

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == len(tok)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert (tmp_path / "a" / "generation_config.json").is_file()
    assert json.loads((tmp_path / "a" / "warmstart.json").read_text())["recipe_hash"] == SHORT.fingerprint()


def test_cache_is_reused_and_keyed_by_recipe(tmp_path, monkeypatch):
    recipe = SHORT.model_copy(update={"eval_prompts": 2})
    first = ensure_warmstart_model(tmp_path, recipe)
    report = json.loads((first / "warmstart.json").read_text())
    assert set(report["eval"]) == set(recipe.task_mix) == {"addition"}  # evaluation ran, on the demo task
    digest = _digest(first)

    def no_training(*args, **kwargs):
        raise AssertionError("cached model should have been reused")

    monkeypatch.setattr(warmstart, "train_warmstart", no_training)
    assert ensure_warmstart_model(tmp_path, recipe) == first and _digest(first) == digest
    with pytest.raises(AssertionError, match="reused"):  # a different recipe is a different cache entry
        ensure_warmstart_model(tmp_path, recipe.model_copy(update={"lr": 1e-3}))
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left behind


SMALL_CACHE: dict[str, int | str | bool] = {"policy": "rkv", "budget": 12, "buffer": 2, "keep_prompt": False}
# Eviction-aware from the first step and checked under the cache trained under (the default recipe
# before the gate and the demo's check became its defaults).
FROM_THE_START: dict[str, None] = {"evict_from_sampled": None, "evicted_check_kv": None}


def test_eviction_aware_warmstart_trains_chosen_rows_under_replayed_masks(tmp_path, monkeypatch):
    masked_rows = []
    real = warmstart._evicted_rows

    def spy(evict, kv, model, batch, examples, chosen, tokenizer):
        masks = real(evict, kv, model, batch, examples, chosen, tokenizer)
        causal = torch.ones_like(masks[0, 0, 0]).tril().bool()
        for row in chosen:  # a chosen row sees less than the causal prefix somewhere: eviction bit
            real_len = int(batch["attention_mask"][row].sum())
            assert (masks[row, :, :, :real_len, :real_len] < causal[:real_len, :real_len]).any()
        masked_rows.append(len(chosen))
        return masks

    monkeypatch.setattr(warmstart, "_evicted_rows", spy)
    recipe = WarmstartRecipe(steps=3, batch_size=8, sampled_target=None, eval_prompts=4, evict_share=1.0,
                             evict_every=1, evict_kv=SMALL_CACHE, **FROM_THE_START)
    train_warmstart(recipe, tmp_path, log_every=0)
    assert masked_rows == [8, 8, 8]
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config._attn_implementation == "sdpa"  # the saved model loads as a plain one


def test_the_evicted_share_is_replayed_on_one_step_in_evict_every(tmp_path, monkeypatch):
    """Half the replays for the same share of examples: steps 0, 2, 4 replay all of their rows."""
    replayed: list[tuple[int, int]] = []
    real = warmstart._evicted_rows

    def count(evict, kv, model, batch, examples, chosen, tokenizer):
        replayed.append((len(examples), len(chosen)))
        return real(evict, kv, model, batch, examples, chosen, tokenizer)

    monkeypatch.setattr(warmstart, "_evicted_rows", count)
    recipe = WarmstartRecipe(steps=5, batch_size=4, sampled_target=None, eval_prompts=0, evict_share=0.5,
                             evict_every=2, evict_kv=SMALL_CACHE, **FROM_THE_START)
    train_warmstart(recipe, tmp_path, log_every=0)
    assert replayed == [(4, 4)] * 3


def test_the_stop_waits_for_the_sampled_accuracy_under_the_cache(tmp_path, monkeypatch):
    """Dense sampled accuracy past its target is not enough: the check under `evict_kv` (on the
    rollout engine) must pass too, and a dense-SFT recipe stops on the dense check alone."""
    import services.rollout.engine.evaluation as engine_evaluation

    under_cache = iter([0.1, 0.2, 0.5])
    engine_checks: list[int] = []

    def dense_check(*args, **kwargs):  # past sampled_target, below the default sampled_ceiling
        return {"accuracy": 0.6, "mean_reward": 0.6}

    def engine_check(engine, tokenizer, task, pairs, kv, temperature, batch, seed):
        engine_checks.append(len(pairs))
        assert kv.policy == "rkv" and kv.budget == 12 and temperature == 1.0
        return {"accuracy": next(under_cache), "reward": 0.0, "length": 1.0, "kv_saved": 0.5}

    monkeypatch.setattr(warmstart, "evaluate", dense_check)
    monkeypatch.setattr(engine_evaluation, "evaluate", engine_check)
    recipe = WarmstartRecipe(steps=20, batch_size=2, eval_prompts=0, evict_share=0.5, evict_kv=SMALL_CACHE,
                             check_from=2, check_every=2, sampled_target=0.4, evicted_target=0.3,
                             evicted_check_prompts=8, **FROM_THE_START)
    report = train_warmstart(recipe, tmp_path / "evicted", log_every=0)
    assert report["steps_done"] == 6 and engine_checks == [8, 8, 8]
    assert [c.get("evicted_sampled_accuracy") for c in report["sampled_checks"]] == [0.1, 0.2, 0.5]

    dense = recipe.model_copy(update={"evict_share": 0.0})
    assert train_warmstart(dense, tmp_path / "dense", log_every=0)["steps_done"] == 2

    # A cached sampler that never reaches its target: the stop comes at the dense ceiling, not at `steps`.
    under_cache = iter([0.1] * 20)
    engine_checks.clear()
    capped = recipe.model_copy(update={"sampled_ceiling": 0.5})
    report = train_warmstart(capped, tmp_path / "capped", log_every=0)
    assert report["steps_done"] == 2 and engine_checks == [8]
    assert report["sampled_checks"][-1]["stopped_at_ceiling"] is True
    # Without a ceiling the wait goes on to `steps`.
    under_cache = iter([0.1] * 20)
    uncapped = recipe.model_copy(update={"sampled_ceiling": None})
    assert train_warmstart(uncapped, tmp_path / "uncapped", log_every=0)["steps_done"] == 20


def test_eviction_aware_sft_starts_at_the_first_check_past_its_gate(tmp_path, monkeypatch):
    """`evict_from_sampled`: dense SFT (no replay) until a dense check reaches the gate, then the
    evicted share on one step in `evict_every`, and the report names the step it started at."""
    import services.rollout.engine.evaluation as engine_evaluation

    dense_accuracy = iter([0.05, 0.25, 0.3, 0.5])
    replayed_at: list[int] = []
    real = warmstart._evicted_rows

    def count(evict, kv, model, batch, examples, chosen, tokenizer):
        replayed_at.append(warmstart.steps_trained())
        return real(evict, kv, model, batch, examples, chosen, tokenizer)

    monkeypatch.setattr(warmstart, "_evicted_rows", count)
    monkeypatch.setattr(warmstart, "evaluate",
                        lambda *a, **k: {"accuracy": next(dense_accuracy), "mean_reward": 0.0})
    monkeypatch.setattr(engine_evaluation, "evaluate",
                        lambda *a, **k: {"accuracy": 0.5, "reward": 0.0, "length": 1.0, "kv_saved": 0.5})
    recipe = WarmstartRecipe(steps=20, batch_size=2, eval_prompts=0, evict_share=0.5, evict_every=2,
                             evict_kv=SMALL_CACHE, check_from=2, check_every=2, sampled_target=0.4,
                             evicted_target=0.4, evict_from_sampled=0.2)
    start = warmstart.steps_trained()
    report = train_warmstart(recipe, tmp_path, log_every=0)
    # Checks after steps 2, 4, 6, 8: the gate passes at 4 (0.25); steps 5-8 (indices 4-7) train, and
    # the even indices 4 and 6 replay; the stop comes at 8 (dense 0.5, under the cache 0.5).
    assert report["eviction_aware_from"] == 4 and report["steps_done"] == 8
    assert [at - start for at in replayed_at] == [4, 6]
    assert report["sampled_checks"][1]["eviction_aware_from"] == 4
    assert "eviction_aware_from" not in report["sampled_checks"][2]


def test_later_fields_are_part_of_the_recipe_hash_only_when_set():
    """Recipes from before `evict_from_sampled`, `evicted_check_kv` and `level_check` (all None)
    keep their hashes and their cached warm starts; set, each makes a recipe of its own. The command
    line gives the default recipe, or the one before them with `--evict-from-sampled none
    --check-under train --check-every 50 --no-level-check`."""
    before = WarmstartRecipe(**FROM_THE_START, check_every=50, level_check=None)
    fields = before.model_dump()
    del fields["evict_from_sampled"], fields["evicted_check_kv"], fields["level_check"]
    blob = json.dumps({"recipe": fields, "vocab": warmstart_recipe.char_vocab(),
                       "version": warmstart_recipe.RECIPE_VERSION, "torch": torch.__version__.split("+")[0]},
                      sort_keys=True)
    assert before.fingerprint() == hashlib.sha256(blob.encode()).hexdigest()
    default = WarmstartRecipe()
    assert default.evict_from_sampled == 0.2
    assert default.evicted_check_kv == warmstart_recipe.DEMO_WORKER_CACHE
    gated = before.model_copy(update={"evict_from_sampled": 0.2})
    checked = before.model_copy(update={"level_check": warmstart_recipe.LevelCheck()})
    assert len({before.fingerprint(), gated.fingerprint(), checked.fingerprint(), default.fingerprint()}) == 4
    assert default.level_check == warmstart_recipe.LevelCheck(min_sampled=0.15, prompts=64, rebuilds=2)
    parse = warmstart_recipe.arg_parser().parse_args
    assert warmstart_recipe.recipe_from_args(parse(["--out", "x"])) == default
    old = parse(["--out", "x", "--evict-from-sampled", "none", "--check-under", "train",
                 "--check-every", "50", "--no-level-check"])
    assert warmstart_recipe.recipe_from_args(old) == before
    gate = parse(["--out", "x", "--evict-from-sampled", "0.4"])
    assert warmstart_recipe.recipe_from_args(gate).evict_from_sampled == 0.4
    assert default.check_every == 25
    coarser = warmstart_recipe.recipe_from_args(parse(["--out", "x", "--check-every", "50"]))
    assert coarser.check_every == 50 and coarser.fingerprint() != default.fingerprint()
    with pytest.raises(ValidationError):
        warmstart_recipe.recipe_from_args(parse(["--out", "x", "--check-every", "0"]))
    with pytest.raises(SystemExit) as usage:  # the command line says so instead of a traceback
        warmstart.main(["--out", "x", "--check-every", "0"])
    assert usage.value.code == 2


def test_the_stop_can_check_under_another_cache_than_the_one_trained_under(tmp_path, monkeypatch):
    """`evicted_check_kv`: the replays keep training under `evict_kv` while the stop's check (and the
    report's `evicted_sampled`) samples under the other cache."""
    import services.rollout.engine.evaluation as engine_evaluation

    replay_kvs: list[tuple[int, bool]] = []
    check_kvs: list[tuple[int, bool]] = []
    real = warmstart._evicted_rows

    def replay(evict, kv, model, batch, examples, chosen, tokenizer):
        replay_kvs.append((kv.budget, kv.keep_prompt))
        return real(evict, kv, model, batch, examples, chosen, tokenizer)

    def engine_check(engine, tokenizer, task, pairs, kv, temperature, batch, seed):
        check_kvs.append((kv.budget, kv.keep_prompt))
        return {"accuracy": 0.5, "reward": 0.0, "length": 1.0, "kv_saved": 0.5}

    monkeypatch.setattr(warmstart, "_evicted_rows", replay)
    monkeypatch.setattr(warmstart, "evaluate", lambda *a, **k: {"accuracy": 0.6, "mean_reward": 0.6})
    monkeypatch.setattr(engine_evaluation, "evaluate", engine_check)
    check_cache = {**SMALL_CACHE, "budget": 16, "keep_prompt": True}
    recipe = WarmstartRecipe(steps=20, batch_size=2, eval_prompts=2, evict_share=0.5, evict_kv=SMALL_CACHE,
                             check_from=2, check_every=2, sampled_target=0.4, evicted_target=0.4,
                             evict_from_sampled=None, evicted_check_kv=check_cache)
    report = train_warmstart(recipe, tmp_path, log_every=0)
    assert report["steps_done"] == 2 and replay_kvs == [(12, False)]
    assert check_kvs == [(16, True), (16, True)]  # the stop's check, then the report's


def test_levels_are_drawn_by_their_running_loss():
    """The "loss" curriculum: uniform until every level has a loss, then a level's share follows its
    running per-token loss, with `uniform_share` of the draws still spread evenly."""
    import random

    from shared.tasks import get_task

    tasks = {"addition": get_task("addition", min_digits=3, max_digits=6)}
    level_loss = warmstart.LevelLoss(tasks, uniform_share=0.2, decay=0.5)
    assert level_loss.weights() == {"addition": [0.25] * 4}
    level_loss.update(["addition"] * 3, [0, 1, 2], [0.1, 0.1, 0.1])
    assert level_loss.weights() == {"addition": [0.25] * 4}  # 6 digits not seen yet
    level_loss.update(["addition"] * 2, [3, 3], [0.6, 0.8])
    weights = level_loss.weights()["addition"]
    assert weights[3] == pytest.approx(0.05 + 0.8 * 0.7) and weights[0] == pytest.approx(0.05 + 0.8 * 0.1)
    level_loss.update(["addition"], [3], [0.1])  # running: 0.5 * 0.7 + 0.5 * 0.1
    assert level_loss.loss["addition"][3] == pytest.approx(0.4)

    drawn = warmstart._sample_examples(tasks, {"addition": 1.0}, 2000, random.Random(0),
                                       {"addition": [0.1, 0.1, 0.1, 0.7]})
    digits = [len(prompt.split("+")[1].strip()) for prompt, *_ in drawn]
    assert [level for *_, level in drawn] == [d - 3 for d in digits]  # each example names its level
    assert 0.65 < digits.count(6) / len(digits) < 0.75 and 0.07 < digits.count(3) / len(digits) < 0.13


def test_the_loss_curriculum_is_a_recipe_of_its_own_and_deterministic(tmp_path):
    """The "loss" curriculum is a recipe of its own (its own cache key) and byte-deterministic too."""
    curriculum = SHORT.model_copy(update={"level_sampling": "loss", "steps": 4})
    assert curriculum.fingerprint() != SHORT.model_copy(update={"steps": 4}).fingerprint()
    first = train_warmstart(curriculum, tmp_path / "a", log_every=0)
    train_warmstart(curriculum, tmp_path / "b", log_every=0)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") and first["steps_done"] == 4


def test_room_for_rl_counts_the_gap_only_where_the_cache_leaves_a_signal():
    # (dense, under the cache) per level: a learned level, one the cache hurts, one it breaks, one unlearned
    levels = [(0.9, 0.9), (0.8, 0.2), (0.7, 0.05), (0.1, 0.0)]
    assert warmstart.room_for_rl(levels, floor=0.1) == pytest.approx(0.6 / 4)
    assert warmstart.room_for_rl(levels, floor=0.0) == pytest.approx((0.6 + 0.65 + 0.1) / 4)
    assert warmstart.room_for_rl([(0.5, 0.7)], floor=0.1) == 0.0  # the cache ahead of dense is no room


def _fake_checks(monkeypatch, cached_by_check: list[list[float]]):
    """Dense checks at 0.6 overall and 0.8 per level; the cache's per-level accuracy from a schedule."""
    import services.rollout.engine.evaluation as engine_evaluation

    schedule = iter(cached_by_check)
    current: list[float] = []

    def dense_check(model, tokenizer, task, prompts, sample, seed=0):
        return {"accuracy": 0.8 if task.min_digits == task.max_digits else 0.6, "mean_reward": 0.0}

    def engine_check(engine, tokenizer, task, pairs, kv, temperature, batch, seed):
        nonlocal current
        if task.min_digits == 3:  # the first level: a new check
            current = next(schedule)
        return {"accuracy": current[task.min_digits - 3], "reward": 0.0, "length": 1.0, "kv_saved": 0.5}

    monkeypatch.setattr(warmstart, "evaluate", dense_check)
    monkeypatch.setattr(engine_evaluation, "evaluate", engine_check)


def test_the_room_stop_waits_for_room_and_else_keeps_the_roomiest_check(tmp_path, monkeypatch):
    recipe = WarmstartRecipe(steps=8, batch_size=2, eval_prompts=0, evict_share=0.5, evict_kv=SMALL_CACHE,
                             check_from=2, check_every=2, room_target=0.2, room_prompts=2)
    # rooms: 0.0 (all learned under the cache), 0.6 / 4 (6 digits below the floor), 1.4 / 4 -> stop at step 6
    _fake_checks(monkeypatch, [[0.8] * 4, [0.8, 0.8, 0.2, 0.0], [0.8, 0.5, 0.3, 0.2], [0.8] * 4])
    report = train_warmstart(recipe, tmp_path / "target", log_every=0)
    assert report["steps_done"] == report["kept_step"] == 6
    assert [c["room"] for c in report["sampled_checks"]] == pytest.approx([0.0, 0.15, 0.35])
    assert report["sampled_checks"][1]["levels_evicted_sampled"] == [0.8, 0.8, 0.2, 0.0]

    # The bound first: the weights of the roomiest check (step 4) are the ones saved, the same bytes
    # as a run that stops there on its target.
    _fake_checks(monkeypatch, [[0.8] * 4, [0.8, 0.8, 0.2, 0.0]])
    assert train_warmstart(recipe.model_copy(update={"room_target": 0.15}), tmp_path / "at4",
                           log_every=0)["steps_done"] == 4
    _fake_checks(monkeypatch, [[0.8] * 4, [0.8, 0.8, 0.2, 0.0], [0.8] * 4, [0.8] * 4])
    report = train_warmstart(recipe, tmp_path / "bound", log_every=0)
    assert report["steps_done"] == 8 and report["kept_step"] == 4
    assert _digest(tmp_path / "bound") == _digest(tmp_path / "at4")


def test_the_command_line_sets_the_cache_the_sft_is_evicted_under(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(warmstart, "build_warmstart",
                        lambda recipe, out, log_every: built.append(recipe) or
                        {"final_loss": 0, "train_seconds": 0, "total_seconds": 0, "eval": {}})
    warmstart.main(["--out", str(tmp_path), "--seed", "3"])
    warmstart.main(["--out", str(tmp_path), "--seed", "3", "--evict-budget", "36"])
    default, wider = built
    assert default == warmstart_recipe.WarmstartRecipe(seed=3)  # nothing given: the default recipe
    assert wider.evict_kv == {**default.evict_kv, "budget": 36} and default.evict_kv["budget"] == 32
    assert wider.fingerprint() != default.fingerprint()  # its own cache entry
    warmstart.main(["--out", str(tmp_path), "--seed", "3", "--scratchpad", "column"])
    column = built[-1]
    assert default.task_options["addition"]["scratchpad"] == "sum"  # named: the recipe's hash says it
    assert column.task_options["addition"] == {**default.task_options["addition"], "scratchpad": "column"}
    assert column.fingerprint() != default.fingerprint()
    # --ensure (what the demo runs) builds the same recipes: nothing given, the default's cache entry.
    ensured = []
    monkeypatch.setattr(warmstart, "ensure_warmstart_model",
                        lambda cache, recipe: ensured.append(recipe) or Path(cache))
    warmstart.main(["--ensure", str(tmp_path)])
    warmstart.main(["--ensure", str(tmp_path), "--scratchpad", "column"])
    assert ensured[0].fingerprint() == warmstart_recipe.WarmstartRecipe().fingerprint()
    assert ensured[1].task_options["addition"]["scratchpad"] == "column"


def _fake_levels(monkeypatch, per_seed: dict[int, list[float]]) -> list[int]:
    """`level_sampled_accuracy` as given per seed; returns the seeds it was asked about."""
    asked: list[int] = []

    def levels(model_dir, recipe):
        asked.append(recipe.seed)
        return per_seed[recipe.seed]

    monkeypatch.setattr(warmstart, "level_sampled_accuracy", levels)
    return asked


CHECKED = SHORT.model_copy(update={"level_check": warmstart_recipe.LevelCheck(min_sampled=0.15, prompts=2,
                                                                      rebuilds=2)})


def test_a_build_that_lacks_a_level_is_built_again_from_the_next_seed(tmp_path, monkeypatch, capsys):
    train_warmstart(SHORT.model_copy(update={"seed": 1}), tmp_path / "seed1", log_every=0)
    asked = _fake_levels(monkeypatch, {0: [0.9, 0.6, 0.05, 0.0], 1: [0.9, 0.7, 0.4, 0.2]})
    report = warmstart.build_warmstart(CHECKED, tmp_path / "out", log_every=0)
    assert asked == [0, 1]  # seed 1 passed: seed 2 not built
    assert report["seed_built"] == 1 and report["level_check_passed"] is True
    assert [b["seed"] for b in report["builds"]] == [0, 1]
    assert report["builds"][0]["levels_sampled"] == [0.9, 0.6, 0.05, 0.0]
    # Seed 1's weights, byte for byte, under the requested recipe's hash (so the cache finds them).
    assert _digest(tmp_path / "out") == _digest(tmp_path / "seed1")
    assert warmstart_recipe.is_current(tmp_path / "out", CHECKED)
    saved = json.loads((tmp_path / "out" / "warmstart.json").read_text())
    assert saved["recipe_hash"] == CHECKED.fingerprint() and saved["recipe"]["seed"] == 0
    assert saved["seed_built"] == 1
    example = warmstart._level_example(CHECKED, 3)
    assert example.startswith("add ") and len(example.split("+")[1]) == 6  # a 6-digit sum
    note = f"NOTE seed 0's build samples prompts like {example!r} right 0% of the time, under 15%: building"
    assert note in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "seed1"]  # no scratch dir left behind


def test_a_build_that_passes_is_kept_as_built_and_none_passing_keeps_the_strongest(tmp_path, monkeypatch,
                                                                                  capsys):
    train_warmstart(SHORT, tmp_path / "plain", log_every=0)
    asked = _fake_levels(monkeypatch, {0: [0.9, 0.5, 0.3, 0.15]})  # at the threshold: passes
    report = warmstart.build_warmstart(CHECKED, tmp_path / "first", log_every=0)
    assert asked == [0] and report["seed_built"] == 0 and len(report["builds"]) == 1
    assert _digest(tmp_path / "first") == _digest(tmp_path / "plain")

    train_warmstart(SHORT.model_copy(update={"seed": 1}), tmp_path / "seed1", log_every=0)
    asked = _fake_levels(monkeypatch, {0: [0.9, 0.05, 0.0, 0.0], 1: [0.9, 0.6, 0.3, 0.1],
                                       2: [0.9, 0.6, 0.2, 0.05]})
    report = warmstart.build_warmstart(CHECKED, tmp_path / "none", log_every=0)
    assert asked == [0, 1, 2]  # rebuilds=2: three builds at most
    assert report["seed_built"] == 1 and report["level_check_passed"] is False  # weakest level 0.1: the best
    assert "NOTE no build of seeds 0-2 passed: keeping seed 1's" in capsys.readouterr().out
    assert _digest(tmp_path / "none") == _digest(tmp_path / "seed1")


def test_the_level_check_samples_each_level_of_the_task(tmp_path):
    train_warmstart(SHORT, tmp_path, log_every=0)
    levels = warmstart.level_sampled_accuracy(tmp_path, CHECKED)
    assert len(levels) == len(warmstart.get_task("addition", **SHORT.task_options["addition"]).levels()) == 4
    assert all(0.0 <= a <= 1.0 for a in levels)


def test_the_gpu_recipes_and_the_cli_can_do_without_the_level_check():
    from bench.learning import GPU_RECIPE, PRESETS

    # Unset, the field stays out of their hashes (`test_later_fields_...`): the documented runs' warm starts.
    assert GPU_RECIPE.level_check is None and PRESETS["smoke"].recipe.level_check is None
    parse = warmstart_recipe.arg_parser().parse_args
    assert warmstart_recipe.recipe_from_args(parse(["--out", "x", "--no-level-check"])).level_check is None
    assert warmstart_recipe.recipe_from_args(parse(["--out", "x"])).level_check == LevelCheck()
