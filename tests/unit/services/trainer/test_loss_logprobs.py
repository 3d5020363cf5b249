"""Dense token log-prob recomputation, and one GRPO step moving the policy the right way."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.trainer.loss import LossConfig, grpo_advantages, grpo_loss
from services.trainer.rollout_math import token_logprobs


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=20,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    return Qwen3ForCausalLM(cfg).eval()


def _unpadded(model, ids: list[int], prompt_len: int, temperature: float) -> list[float]:
    with torch.no_grad():  # a reference value: no graph (float() of a grad tensor warns)
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    return [float(logp[t - 1, ids[t]]) for t in range(prompt_len, len(ids))]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_token_logprobs_match_unpadded_forward(model, side, temperature):
    seqs = [([1, 5, 6], [7, 8, 2]), ([1, 4], [9, 3, 3, 2])]  # (prompt, completion)
    width = max(len(p) + len(c) for p, c in seqs)
    ids, attn, comp = [], [], []
    for p, c in seqs:
        pad = width - len(p) - len(c)
        row, a, m = p + c, [1] * (len(p) + len(c)), [0] * len(p) + [1] * len(c)
        if side == "left":
            ids.append([0] * pad + row), attn.append([0] * pad + a), comp.append([0] * pad + m)
        else:
            ids.append(row + [0] * pad), attn.append(a + [0] * pad), comp.append(m + [0] * pad)
    with torch.no_grad():
        got = token_logprobs(model, torch.tensor(ids), torch.tensor(attn), torch.tensor(comp), temperature)
    for i, (p, c) in enumerate(seqs):
        mask = torch.tensor(comp[i]).bool()
        assert got[i][mask].tolist() == pytest.approx(_unpadded(model, p + c, len(p), temperature), abs=1e-5)
        assert (got[i][~mask] == 0).all()


def test_token_logprobs_rejects_completion_at_position_zero(model):
    with pytest.raises(ValueError, match="position 0"):
        token_logprobs(model, torch.tensor([[1, 2]]), torch.ones(1, 2), torch.ones(1, 2), 1.0)


def test_grpo_step_raises_logprob_of_better_sample(model):
    torch.manual_seed(0)
    local = Qwen3ForCausalLM(model.config)
    local.load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 5, 7, 8, 2], [1, 5, 9, 3, 2]])  # one group: same prompt, two completions
    attn = torch.ones_like(ids)
    comp = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]])
    adv = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    with torch.no_grad():
        old = token_logprobs(local, ids, attn, comp, 1.0)
    opt = torch.optim.SGD(local.parameters(), lr=0.5)
    loss, _ = grpo_loss(token_logprobs(local, ids, attn, comp, 1.0), old, old, adv, comp, LossConfig())
    loss.backward()
    opt.step()
    with torch.no_grad():
        new = token_logprobs(local, ids, attn, comp, 1.0)
    assert float(new[0].sum()) > float(old[0].sum())  # rewarded completion more likely
    assert float(new[1].sum()) < float(old[1].sum())  # the other one less
