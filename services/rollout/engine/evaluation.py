"""A task's accuracy under a KV cache, sampled by the engine: what a worker would score.

Shared by the budget calibration (services.rollout.calibration), bench.learning and the trainer's
eviction-aware warm start, which stops on the accuracy its model samples under the demo's cache.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from services.rollout.engine.config import GenerationOutput, KVConfig, SamplingParams
from services.rollout.engine.llm_engine import LLMEngine
from shared.tasks import Task


def generate(engine: LLMEngine, tokenizer: PreTrainedTokenizerBase, task: Task, prompts: list[str],
             samples: int, kv: KVConfig, temperature: float, seed: int,
             batch: int) -> list[tuple[list[int], list[GenerationOutput]]]:
    """(prompt ids, outputs) per prompt, `samples` outputs each, in engine batches of ≤ `batch` sequences."""
    ids = [tokenizer(p).input_ids for p in prompts]
    per_batch = max(1, batch // samples)
    out = []
    for start in range(0, len(ids), per_batch):
        chunk = ids[start:start + per_batch]
        params = SamplingParams(temperature=temperature, max_new_tokens=task.max_new_tokens,
                                stop_token_ids=(tokenizer.eos_token_id,), seed=seed + start)
        outputs = engine.generate([p for p in chunk for _ in range(samples)], params, kv)
        out += [(p, outputs[i * samples:(i + 1) * samples]) for i, p in enumerate(chunk)]
    return out


def evaluate(engine: LLMEngine, tokenizer: PreTrainedTokenizerBase, task: Task, pairs: list[tuple[str, str]],
             kv: KVConfig, temperature: float, batch: int, seed: int) -> dict[str, float]:
    """Accuracy, mean reward, completion length and the share of KV the cache saved (1 − peak
    stored tokens / tokens seen) of one sample per prompt."""
    results = generate(engine, tokenizer, task, [p for p, _ in pairs], 1, kv, temperature, seed, batch)
    rewards, correct, lengths, peak, total = [], [], [], 0, 0
    for (prompt_ids, outputs), (_, answer) in zip(results, pairs, strict=True):
        out = outputs[0]
        reward, ok = task.reward(str(tokenizer.decode(out.token_ids, skip_special_tokens=True)), answer)
        rewards.append(reward)
        correct.append(ok)
        lengths.append(len(out.token_ids))
        peak += out.kv.peak_tokens
        total += len(prompt_ids) + len(out.token_ids)
    n = len(pairs)
    return {"accuracy": sum(correct) / n, "reward": sum(rewards) / n, "length": sum(lengths) / n,
            "kv_saved": 1 - peak / total}
