"""A real tiny Qwen3 trained with AdamW: every step's patch reproduces the published bf16 weights."""

import torch
from transformers import Qwen3ForCausalLM

from shared.modeling import qwen3_config
from shared.patch import apply_patch, extract_patch, fingerprint, merge_patches, read_header
from shared.patch.codec import bits


def test_adamw_steps_patch_to_bit_identical_weights():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config("tiny"))  # fp32 master weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.98), weight_decay=0.1)

    def published() -> dict[str, torch.Tensor]:
        return {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}

    versions = [published()]
    replica = {k: v.clone() for k, v in versions[0].items()}
    patches = []
    tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    for step in range(3):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        versions.append(published())
        patch = extract_patch(
            versions[-2], versions[-1], run="tiny", base_version=step, target_version=step + 1
        )
        header = apply_patch(replica, patch)
        patches.append(patch)
        assert all(torch.equal(bits(replica[k]), bits(versions[-1][k])) for k in replica)
        assert fingerprint(replica) == fingerprint(versions[-1]) == header.target_fingerprint
        assert 0 < header.changed < header.numel
        assert len(patch) < header.dense_bytes / 4

    merged = merge_patches(patches, versions[0])
    assert read_header(merged).changed < sum(read_header(p).changed for p in patches)
    fresh = {k: v.clone() for k, v in versions[0].items()}
    apply_patch(fresh, merged)
    assert fingerprint(fresh) == fingerprint(versions[-1])
