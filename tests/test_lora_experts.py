"""model/lora_experts.py: LoRA-adapted experts run their adapters beside the base experts (no merge), in training and
sampling: the same logits as peft's merged forward (to 1e-5 in fp32, Qwen3-MoE, Mixtral and GPT-OSS, whose experts
have biases; both expert parameters adapted, or down_proj alone), the same loss and adapter gradients (to 1e-6),
peft's own forward while the adapters are disabled, and experts it does not handle left to peft."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import REPO
from test_router_aux import MOE, TINY  # the same tiny Qwen3-MoE and Mixtral: 8 experts of 48 columns, 2 a token


# GPT-OSS: 4 experts of 48 columns, 2 a token, biases on every expert, its own gate; LoRA reaches its experts by
# lora.target_parameters (peft maps all-linear onto its attention only)
GPT_OSS = dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Gemma 4's mixture-of-experts variant: its experts beside its dense MLP (`experts`, not `mlp.experts`), reached by
# target_parameters too
GEMMA4_MOE = dict(head_dim=16, global_head_dim=32, sliding_window=4, hidden_size_per_layer_input=8,
                  vocab_size_per_layer_input=97, layer_types=["sliding_attention", "full_attention"],
                  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
OWN = {"gpt_oss": GPT_OSS, "gemma4_text": GEMMA4_MOE}
PARAMETERS = {"gpt_oss": EXPERT_PARAMETERS, "gemma4_text": ["experts.gate_up_proj", "experts.down_proj"]}


def adapted(family: str, targets, implementation: str = "grouped_mm", r: int = 4, parameters=None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **TINY, **OWN.get(family, MOE.get(family)))
    model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    if family == "gpt_oss":  # biases and sinks away from transformers' zeros, so that they matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("_bias", "sinks")):
                    p.normal_(std=0.5)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                             target_parameters=parameters))
    for name, p in model.named_parameters():  # B is zero at the start: give the adapters something to add
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model.eval()


def _ids():
    return torch.randint(3, 97, (3, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family, targets, parameters, swapped", [
    ("qwen3_moe", "all-linear", None, 2), ("mixtral", "all-linear", None, 2),
    ("qwen3_moe", ["q_proj", "down_proj"], None, 2), ("qwen3_moe", ["q_proj", "v_proj"], None, 0),
    ("mixtral", ["q_proj", "v_proj"], None, 0), ("gpt_oss", "all-linear", EXPERT_PARAMETERS, 2),
    ("gpt_oss", ["q_proj"], ["mlp.experts.down_proj"], 2), ("gpt_oss", "all-linear", None, 0),
    ("gemma4_text", "all-linear", PARAMETERS["gemma4_text"], 2), ("gemma4_text", "all-linear", None, 0)])
def test_unmerged_experts_give_peft_merged_forward(family, targets, parameters, swapped):
    from llmtrain.model import lora_experts

    peft_own, model = adapted(family, targets, parameters=parameters), adapted(family, targets, parameters=parameters)
    assert lora_experts.install(model) == swapped  # one experts module a layer where LoRA adapts an expert parameter
    assert lora_experts.install(model) == swapped  # again: the same forward
    ids = _ids()
    with torch.no_grad():
        merged = peft_own(input_ids=ids).logits
        beside = model(input_ids=ids).logits
        with peft_own.disable_adapter(), model.disable_adapter():  # peft's forward: the base model's logits
            base, disabled = peft_own(input_ids=ids).logits, model(input_ids=ids).logits
    assert (beside - merged).abs().max().item() < 1e-5
    assert torch.equal(disabled, base)
    if swapped:  # the adapters matter: without them the logits move
        assert (base - merged).abs().max().item() > 1e-3


def test_experts_of_a_transformers_without_the_expert_parallel_flag_run_as_peft():
    """transformers 5.17 (the GPU machine's) gives its experts modules no _is_expert_parallel, which the forward read:
    AttributeError in the first Qwen3-MoE LoRA step of the GPU rehearsal. Without it the experts are whole (only
    parallel/tensor._split_experts splits them, and sets it)."""
    from llmtrain.model import lora_experts

    peft_own, model = adapted("qwen3_moe", "all-linear"), adapted("qwen3_moe", "all-linear")
    assert lora_experts.install(model) == 2
    for module in model.modules():
        module.__dict__.pop("_is_expert_parallel", None)  # as 5.17 builds them
    with torch.no_grad():
        assert (model(input_ids=_ids()).logits - peft_own(input_ids=_ids()).logits).abs().max().item() < 1e-5


def _loss_and_grads(model, ids):
    model.train()
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "gemma4_text"])
def test_unmerged_experts_train_as_peft_merged_ones(family):
    """A training step through the unmerged experts: peft's loss and every adapter's gradient (the experts' A and B, the
    router's and attention's), to 1e-6 (Gemma 4's MoE, 4e-5 of each gradient's largest under peft 0.22); GPT-OSS's
    with its experts' biases in the forward."""
    from llmtrain.model import lora_experts

    parameters = PARAMETERS.get(family)
    peft_own, model = adapted(family, "all-linear", parameters=parameters), adapted(family, "all-linear",
                                                                                   parameters=parameters)
    lora_experts.install(model)
    ids = _ids()
    (want, expected), (got, grads) = _loss_and_grads(peft_own, ids), _loss_and_grads(model, ids)
    assert abs(got - want) < 1e-6
    assert expected.keys() == grads.keys() and any("experts" in n for n in grads)
    for name in expected:
        # Gemma 4: peft 0.22 sums its experts in another order than 0.21 (whose largest was 1.1e-6): its layer 0's
        # gradients, back through every layer, part at fp32's rounding (1.1e-5 of 0.55 measured, 2e-5 relative)
        bound = max(2e-6, 4e-5 * expected[name].abs().max().item()) if family == "gemma4_text" else 1e-6
        assert (grads[name] - expected[name]).abs().max().item() < bound, name


def test_zero_ranks_added_change_nothing():
    """torch's grouped matmul takes rows of a multiple of 16 bytes, so a rank such as 4 in bf16 or 3 in fp32 is padded
    with zero ranks: the padded product and gradients are the unpadded ones (4 more forced on rank 4 in fp32), and
    rank 3 trains as peft's merge does."""
    from llmtrain.model import lora_experts

    plain, padded = adapted("qwen3_moe", "all-linear"), adapted("qwen3_moe", "all-linear")
    lora_experts.install(plain), lora_experts.install(padded)
    ids = _ids()
    want, expected = _loss_and_grads(plain, ids)
    with mock.patch.object(lora_experts, "_rank_padding", lambda first: 4):
        got, grads = _loss_and_grads(padded, ids)
    assert abs(got - want) < 1e-6
    for name in expected:
        assert (grads[name] - expected[name]).abs().max().item() < 1e-6, name

    peft_own, model = adapted("qwen3_moe", "all-linear", r=3), adapted("qwen3_moe", "all-linear", r=3)
    lora_experts.install(model)
    (want, expected), (got, grads) = _loss_and_grads(peft_own, ids), _loss_and_grads(model, ids)
    assert abs(got - want) < 1e-6
    for name in expected:
        assert (grads[name] - expected[name]).abs().max().item() < 1e-6, name


def test_rank_padding_makes_16_byte_rows():
    from llmtrain.model.lora_experts import _rank_padding

    pads = {(r, dtype): _rank_padding(torch.empty(2, 5, r, dtype=dtype))
            for r in (3, 4, 8, 16) for dtype in (torch.float32, torch.bfloat16)}
    assert pads == {(3, torch.float32): 1, (3, torch.bfloat16): 5, (4, torch.float32): 0, (4, torch.bfloat16): 4,
                    (8, torch.float32): 0, (8, torch.bfloat16): 0, (16, torch.float32): 0, (16, torch.bfloat16): 0}


def test_experts_it_does_not_handle_stay_peft():
    """transformers' eager experts (a loop over the experts) are left to peft's merged forward."""
    from llmtrain.model import lora_experts

    assert lora_experts.install(adapted("qwen3_moe", "all-linear", implementation="eager")) == 0


def test_apply_lora_installs_them():
    """llmtrain's LoRA (model/modeling.apply_lora) runs the experts unmerged from the start."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.config import LoraConfig
    from llmtrain.model.modeling import apply_lora

    from llmtrain.model.modeling import unadapted_experts

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **TINY, **MOE["qwen3_moe"]))
    model = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert len(experts) == 2 and all("forward" in m.__dict__ for m in experts)
    assert unadapted_experts(model) == (0, ())  # all-linear reaches Qwen3-MoE's experts
    # GPT-OSS's it does not (the start-up says what lora.target_parameters would name), and target_parameters does
    for parameters, unadapted in [(None, tuple(EXPERT_PARAMETERS)), (EXPERT_PARAMETERS, ())]:
        oss = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **TINY, **GPT_OSS))
        oss = apply_lora(oss, LoraConfig(r=4, alpha=8, dropout=0.0, target_parameters=parameters))
        assert unadapted_experts(oss)[1] == unadapted


def test_the_family_table_says_whether_all_linear_reaches_each_mixtures_experts():
    """capabilities.Family.all_linear_experts (whether lora.dropout is refused under all-linear) is peft's own answer
    on one layer of each mixture of experts of the table (its tiny config above): Qwen3-MoE's and Mixtral's experts
    are adapted as parameters, GPT-OSS's and Gemma 4's (its MoE variant) are not; lora.target_parameters adapts
    them."""
    import json

    from transformers import AutoConfig

    from llmtrain import capabilities
    from llmtrain.config import LoraConfig
    from llmtrain.memory.params import _peft_adapted

    mixtures = {**MOE, **OWN}  # the tiny ones above (Gemma 4's MoE variant)
    seen = []
    for key, family in capabilities.FAMILIES.items():
        if key not in mixtures:
            assert not capabilities.experts(AutoConfig.for_model(key)), key  # a dense family
            continue
        config = AutoConfig.for_model(key, **TINY, **mixtures[key])
        cfg = json.dumps(config.to_dict(), sort_keys=True, default=str)
        assert bool(_peft_adapted(cfg, key, 4, "all-linear")[1]) == family.all_linear_experts, key
        assert capabilities.lora_adapts_parameters(key, LoraConfig(r=4, dropout=0.0)) == family.all_linear_experts
        seen.append(key)
    assert sorted(seen) == ["gemma4_text", "gpt_oss", "mixtral", "qwen3_moe"]
    named = LoraConfig(r=4, dropout=0.0, target_parameters=["mlp.experts.down_proj"])
    assert all(capabilities.lora_adapts_parameters(key, named) for key in seen)


def test_reading_an_experts_adapter_back_warns_of_nothing(tmp_path):
    """peft adds rank and alpha patterns for Qwen3-MoE's fused gate_up_proj and, reading the adapter back (export,
    generate, a reward model), warned they matched no module and were ignored, though it applies them (audit 39: the
    merged export equals the run to 6e-7). Read back as llmtrain reads final/: no warning, the same forward."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.config import LoraConfig
    from llmtrain.model.modeling import apply_lora, read_adapter

    config = AutoConfig.for_model("qwen3_moe", **TINY, **MOE["qwen3_moe"])
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    base.save_pretrained(tmp_path / "base")
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(r=4, alpha=8, dropout=0.0))
    for name, p in model.named_parameters():  # B away from 0, so that the adapter moves the forward
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(tmp_path / "adapter")
    assert "rank_pattern" in (tmp_path / "adapter" / "adapter_config.json").read_text()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = read_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), str(tmp_path / "adapter"))
    assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []
    model.eval(), again.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(_ids()).logits, model(_ids()).logits, atol=1e-5, rtol=1e-5)


def test_lora_dropout_on_experts_adapted_as_parameters_names_lora_dropout():
    """peft refuses lora_dropout for experts adapted as parameters; the paragraph had named lora.target_modules /
    lora.modules_to_save (doctor's second fail beside the layout's, audit 53): it names lora.dropout and its fix."""
    from transformers import AutoConfig

    from llmtrain.config import load_recipe
    from llmtrain.model.modeling import lora_problem

    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                               num_experts=4, num_experts_per_tok=2, vocab_size=97)
    recipe = REPO / "recipes" / "tiny.yaml"
    problem = lora_problem(load_recipe(recipe, ["lora={dropout: 0.1}"]), cfg)
    assert problem.startswith("lora.dropout=0.1: ") and problem.endswith("Set lora.dropout: 0.")
    assert lora_problem(load_recipe(recipe, ["lora={dropout: 0.0}"]), cfg) is None
