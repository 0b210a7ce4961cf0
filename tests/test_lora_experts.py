"""model/lora_experts.py: LoRA-adapted experts run their adapters beside the base experts (no merge) while the fast
sampler runs: the same logits as peft's merged forward (to 1e-5 in fp32, Qwen3-MoE and Mixtral; both expert parameters
adapted, or down_proj alone), peft's own forward back after the block, and experts it does not handle left to peft."""

from __future__ import annotations

import pytest
import torch

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=97)
MOE = {"qwen3_moe": dict(head_dim=16, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2),
       "mixtral": dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)}


def adapted(family: str, targets, implementation: str = "grouped_mm"):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **TINY, **MOE[family])
    model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    for name, p in model.named_parameters():  # B is zero at the start: give the adapters something to add
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model.eval()


@pytest.mark.parametrize("family, targets, swapped", [
    ("qwen3_moe", "all-linear", 2), ("mixtral", "all-linear", 2), ("qwen3_moe", ["q_proj", "down_proj"], 2),
    ("qwen3_moe", ["q_proj", "v_proj"], 0), ("mixtral", ["q_proj", "v_proj"], 0)])
def test_unmerged_experts_give_peft_merged_forward(family, targets, swapped):
    from llmtrain.model.lora_experts import unmerged_experts

    model = adapted(family, targets)
    ids = torch.randint(3, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        merged = model(input_ids=ids).logits
        with unmerged_experts(model) as n:
            beside = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert n == swapped  # one experts module a layer where LoRA adapts an expert parameter
    assert (beside - merged).abs().max().item() < 1e-5
    assert torch.equal(again, merged)  # peft's forward back
    if swapped:  # the adapters matter: without them the logits move
        with torch.no_grad(), model.disable_adapter():
            assert (model(input_ids=ids).logits - merged).abs().max().item() > 1e-3


def test_experts_it_does_not_handle_stay_peft():
    """transformers' eager experts (a loop over the experts) are left to peft's merged forward."""
    from llmtrain.model.lora_experts import unmerged_experts

    model = adapted("qwen3_moe", "all-linear", implementation="eager")
    with unmerged_experts(model) as n:
        assert n == 0
