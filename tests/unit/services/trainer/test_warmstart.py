"""Warm start in a shortened mode: deterministic bytes, a loadable HF dir, and cache reuse."""

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.trainer import warmstart
from services.trainer.warmstart import WarmstartRecipe, ensure_warmstart_model, train_warmstart

SHORT = WarmstartRecipe(steps=3, batch_size=4, warmup_steps=1, eval_prompts=0)


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
                             evict_every=1, evict_kv=SMALL_CACHE)
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
                             evict_every=2, evict_kv=SMALL_CACHE)
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
                             evicted_check_prompts=8)
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
