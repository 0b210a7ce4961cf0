"""Each model family through llmtrain's paths: a tiny random model of the family (the tiny task's shapes, tokenizer
and ids; Llama, Qwen3 and Gemma 3 tied, as Llama 3.2, Gemma 3 and Qwen3 below 8B are) on every path the capability table
(capabilities.FAMILIES) does not refuse, and every refused cell refused before any process starts.

- SFT end to end (`llmtrain finetune` in this process, packed rows through the varlen attention): the loss falls and
  final/ loads back as the family's model with the trained weights.
- LoRA by the family's module names (all-linear finds Phi's fused qkv_proj and gate_up_proj; Llama's names on Phi are
  refused naming Phi's); QLoRA (bitsandbytes' 4-bit base on this CPU) on every linear and the loss falling.
- DPO on 8 pairs: the first step's loss is log 2 (policy = reference), then it falls and every pair is ranked right.
- GRPO with the fast sampler (rl.sampler: static) draws, steps and trains exactly what the reference sampler does.
- Liger's kernels patch each family's layer (where liger-kernel is installed: its kernels need CUDA to run).
- Through `accelerate launch`: FSDP on 2 processes, sequence parallelism over 2 and a pipeline of 2 stages (the tied
  ones' two copies summed) and tensor parallelism on 4 (Qwen2's biases, QK-norm's gradients summed over the group,
  Phi's fused projections gathered) each equal one process, final/ included (a tied head saved once); a cell the
  table refuses is refused in one paragraph by `llmtrain launch`.
What each family's layer adds is checked piece by piece in test_fastpath (packed = alone, the chunked loss),
test_memory_families (the estimate) and test_fast_sample (the sampler). docs/models.md."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (REPO, assert_same_steps, launch_finetune, load_weights, max_abs_diff, records,
                     rl_under_tp_against_one, run_train, write_recipe)

from llmtrain import capabilities
from llmtrain.tiny import FAMILY_LAYERS

pytestmark = pytest.mark.long(100)  # tests/conftest.py

# Each family's tiny layer is prepare-tiny's (tiny.FAMILY_LAYERS); Llama and Qwen3 here with the tied head that Llama
# 3.2 and Qwen3 below 8B have (the tiny task's own model is untied Llama)
TIED = {"tie_word_embeddings": True}
FAMILIES = {"llama": {**FAMILY_LAYERS["llama"], **TIED}, "qwen3": {**FAMILY_LAYERS["qwen3"], **TIED},
            **{f: FAMILY_LAYERS[f] for f in ("qwen2", "gemma3_text", "phi3")}}
# The mixtures of experts (the capability table's families whose layer llmtrain leaves to transformers): the tiny
# model's attention, 4 experts of 64 columns a layer, 2 a token; GPT-OSS's with its sinks and a window of 8 on every
# other layer
MOE = {f: FAMILY_LAYERS[f] for f in ("qwen3_moe", "mixtral", "gpt_oss")}
# what LoRA adapts of a family's experts beyond lora.target_modules (GPT-OSS's, by name)
EXPERT_PARAMETERS = {"gpt_oss": {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}}
# Gemma 4's text model (dense; its layer as transformers runs it), as its checkpoints are: per-layer embeddings of 16 a
# layer, local layers (a window of 8; heads of 32, 4 K/V heads) and global ones of their own head size (64) and K/V
# heads (2, their keys also their values: attention_k_eq_v), so that its config is heterogeneous (transformers'
# per_layer_config, which raises where a layer's value is read off the config); its last two layers share the keys and
# values of the two before them, their MLPs double-wide
OWN_LAYER = {"gemma4_text": {**FAMILY_LAYERS["gemma4_text"], "vocab_size_per_layer_input": 104}}


def family_model(tiny_assets, folder, family: str, **more):
    """The tiny model's shapes and special ids in `family`'s layer (and `more` of its config), random weights, the tiny
    tokenizer beside them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").exists():
        return folder
    tiny = json.loads((tiny_assets / "model" / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    own = {**FAMILIES, **MOE, **OWN_LAYER}[family]
    config = AutoConfig.for_model(family, **{**{k: tiny[k] for k in keep}, **own, **more})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # Gemma 4's learned scalar a layer (a buffer read from the checkpoint): not its init's 1
        for i, (name, buffer) in enumerate((n, b) for n, b in model.named_buffers() if n.endswith("layer_scalar")):
            buffer.fill_(0.9 + 0.2 * i)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_assets / "model").save_pretrained(folder)
    return folder


def test_prepare_tinys_families_are_configs_transformers_takes_without_a_warning(tiny_tok):
    """`prepare-tiny --family gpt_oss` printed transformers' warning that its YaRN factor (32) is not the ratio of
    its lengths (512 / 4,096): every family's tiny config is one transformers reads without a word."""
    import logging

    from llmtrain.tiny import build_model

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        for family in FAMILY_LAYERS:
            build_model(tiny_tok, seed=0, family=family)
            assert not said, (family, said)
    finally:
        logger.removeHandler(handler)
    rope = build_model(tiny_tok, seed=0, family="gpt_oss").config.rope_parameters  # the real one's YaRN, scaled
    assert rope["rope_type"] == "yarn" and rope["original_max_position_embeddings"] * rope["factor"] == 512


@pytest.mark.parametrize("family", sorted(FAMILIES) + [pytest.param(f, marks=pytest.mark.extended)
                                                      for f in [*MOE, *OWN_LAYER]])
def test_each_family_trains_on_packed_rows_and_its_final_model_loads_back(tiny_assets, tmp_path, family):
    from transformers import AutoModelForCausalLM

    folder = family_model(tiny_assets, tmp_path / family, family)
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(folder), "attn_implementation": "auto"},
                          train={"max_steps": 16, "micro_batch_size": 8, "lr": 3e-3})
    summary = run_train(recipe)
    lines = records(tmp_path / "run")
    first, last = [sum(r["loss"] for r in part) / 4 for part in (lines[:4], lines[-4:])]
    # it learns the tiny task: measured 4.15-4.20 -> 2.96-3.29 over the four families
    assert len(lines) == 16 and last < 0.85 * first, (first, last)
    assert summary["final_loss"] == pytest.approx(lines[-1]["loss"])
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").eval()
    assert final.config.model_type == family and type(final) is type(base)
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    with torch.no_grad():
        assert (final(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-2  # the trained weights


@pytest.fixture(scope="module")
def models(tiny_assets, tmp_path_factory):
    """Each family's tiny model, made once for the module."""
    root = tmp_path_factory.mktemp("families")
    return {f: family_model(tiny_assets, root / f, f) for f in {**FAMILIES, **MOE, **OWN_LAYER}}


def _mode_recipe(tiny_assets, tmp_path, model, shipped: str, **sections) -> Path:
    """A shipped tiny recipe on `model`: no eval, nothing saved, logged every step; `sections` update it."""
    recipe = yaml.safe_load((REPO / "recipes" / shipped).read_text())
    recipe["model"]["name_or_path"] = str(model)
    recipe["data"].update(path=str(tiny_assets / "data" / Path(recipe["data"]["path"]).name), eval_split=None,
                          cache_dir=str(tiny_assets.parent / "data-cache"))
    recipe["train"].update(eval_every_steps=None, eval_batch_size=None, eval_samples=0, warmup_steps=0)
    recipe["checkpoint"] = {"every_steps": None, "save_final": False}
    recipe["logging"] = {"progress": False, "plot": False, "every_steps": 1}
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    out = tmp_path / f"{Path(recipe['output_dir']).name}.yaml"  # each run's own
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return out


# --------------------------------------------------------------------------- in this process

ADAPTED = {"phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}}
LLAMA_NAMES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_adapts_each_familys_own_linear_layers_and_names_them_when_asked_for_others(models, family):
    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.errors import LLMTrainError
    from llmtrain.model.modeling import apply_lora, load_model

    model = load_model(ModelConfig(name_or_path=str(models[family]), dtype="float32"), None)
    adapted = apply_lora(model, LoraConfig(r=4, dropout=0.0))  # target_modules: all-linear
    names = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in adapted.named_parameters() if "lora_A" in n}
    assert names == ADAPTED.get(family, LLAMA_NAMES)
    if family == "phi3":  # Llama's names on Phi's fused projections: refused, naming Phi's own
        model = load_model(ModelConfig(name_or_path=str(models[family]), dtype="float32"), None)
        with pytest.raises(LLMTrainError, match="named down_proj, gate_up_proj, lm_head, o_proj, qkv_proj"):
            apply_lora(model, LoraConfig(r=4, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj"]))
    # one name of several that matches nothing (peft adapts the others without a word): refused, naming it
    model = load_model(ModelConfig(name_or_path=str(models[family]), dtype="float32"), None)
    with pytest.raises(LLMTrainError, match=r"lora.target_modules names vproj, which no module of this model is "
                                            r"called, so no adapter would be put there\. This .* model's linear "
                                            r"layers are named .*o_proj"):
        apply_lora(model, LoraConfig(r=4, dropout=0.0, target_modules=["o_proj", "vproj"]))
    model = load_model(ModelConfig(name_or_path=str(models[family]), dtype="float32"), None)
    with pytest.raises(LLMTrainError, match=r"lora.modules_to_save names lmhead, which no module of this model is "
                                            r"called, so nothing would be trained in full\..* Its embeddings .* are "
                                            r".*embed_tokens"):  # (peft had trained no head in full, silently)
        apply_lora(model, LoraConfig(r=4, dropout=0.0, modules_to_save=["lmhead"]))
    model = load_model(ModelConfig(name_or_path=str(models[family]), dtype="float32"), None)
    with pytest.raises(LLMTrainError, match=r"lora.target_parameters names mlp.experts.gate_up_proj, which no "
                                            r"parameter of this model is called"):  # (peft's RuntimeWarning, and on)
        apply_lora(model, LoraConfig(r=4, dropout=0.0, target_parameters=["mlp.experts.gate_up_proj"]))


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["qwen3_moe-lora"])
def test_dpo_starts_at_log_2_and_ranks_every_pair_right(models, tiny_assets, tmp_path, family):
    """8 pairs, 10 full steps: at step 1 the policy is the reference (a loss of exactly log 2, margins 0); then the
    pairs are learnt (measured over the four families: 0.693 -> 0.24-0.30, accuracy 1.0). Qwen3-MoE under LoRA (lr
    1e-2: 0.693 -> 0.488, accuracy 1.0): the policy's experts run their adapters unmerged, the reference pass
    (adapters disabled) peft's forward, the base's (model/lora_experts.py); were the reference adapted too, the
    margins would stay 0."""
    family, lora = family.removesuffix("-lora"), family.endswith("-lora")
    pairs = tmp_path / "pairs8.jsonl"
    pairs.write_text("".join((tiny_assets / "data" / "train_pairs.jsonl").read_text().splitlines(True)[:8]))
    recipe = _mode_recipe(tiny_assets, tmp_path, models[family], "tiny.yaml", preference={"loss": "dpo", "beta": 0.1},
                          data={"path": str(pairs), "format": "preference"},
                          train={"max_steps": 10, "micro_batch_size": 8, "lr": 1e-2 if lora else 3e-3},
                          **({"lora": {"r": 8, "dropout": 0.0}} if lora else {}), output_dir=str(tmp_path / "run"))
    run_train(recipe)
    lines = records(tmp_path / "run")
    assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and lines[0]["rewards/margins"] == 0.0
    assert lines[-1]["loss"] < (0.55 if lora else 0.45) and lines[-1]["rewards/accuracies"] == 1.0, lines[-1]


# the mixtures of experts: trained in full and under LoRA (peft's parameter adapters on the router and experts; the
# experts' run beside them while sampling, model/lora_experts.py); Qwen3-MoE's and GPT-OSS's LoRA in the main tier
@pytest.mark.parametrize("family", sorted(FAMILIES) + [
    pytest.param(f, marks=[] if f in ("qwen3_moe-lora", "gpt_oss-lora", "gemma4_text") else [pytest.mark.extended])
    for f in sorted(m for m in {**MOE, **OWN_LAYER} if capabilities.FAMILIES[m].fast_sampler)
    + [f"{f}-lora" for f in sorted(m for m in {**MOE, **OWN_LAYER} if capabilities.FAMILIES[m].fast_sampler)]])
def test_grpo_with_the_fast_sampler_trains_exactly_what_the_reference_sampler_trains(models, tiny_assets, tmp_path,
                                                                                     family):
    """3 GRPO steps of 4 prompts x 8 completions at temperature 1, rewarded where a completion starts with a-m (about
    a third do, so the groups' advantages move the weights): the fast sampler (its static cache, the family's norms,
    windows and RoPEs; a mixture's router and experts; GPT-OSS's sinks, and under LoRA its experts' adapters; Gemma
    4's per-layer inputs) draws the reference loop's completions token for token at every step, so the losses and
    updates are the same too."""
    family, lora = family.removesuffix("-lora"), family.endswith("-lora")
    runs = {}
    for sampler in ("static", "reference"):
        out = tmp_path / sampler
        recipe = _mode_recipe(tiny_assets, tmp_path, models[family], "tiny-grpo.yaml",
                              rl={"num_generations": 8, "sampler": sampler, "temperature": 1.0,
                                  "rewards": [{"type": "format", "pattern": r"^\s*[a-m]"}]},
                              train={"max_steps": 3, "micro_batch_size": 4, "lr": 1e-3 * (1 + 9 * lora)},
                              **({"lora": {"r": 8, "dropout": 0.0, **EXPERT_PARAMETERS.get(family, {})}}
                                 if lora else {}), output_dir=str(out))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no fall-back to the slow loop
            run_train(recipe)
        rollouts = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
        runs[sampler] = (records(out), [(r["step"], r["completion_ids"]) for r in rollouts])
    (fast, drawn), (reference, want) = runs["static"], runs["reference"]
    assert drawn == want and {s for s, _ in drawn} == {1, 2, 3}
    assert [r["loss"] for r in fast] == [r["loss"] for r in reference]
    assert any(r["reward_std"] > 0 for r in fast)  # the groups had something to learn from


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in ("gemma3_text", "phi3") else
                                                 [pytest.mark.extended]) for f in sorted(FAMILIES)])
def test_qlora_quantizes_every_linear_layer_of_the_family_and_learns(models, tiny_assets, tmp_path, family):
    """A 4-bit nf4 base (bitsandbytes on this CPU) under LoRA r16 on all-linear, 24 steps on 16 examples at lr 1e-2:
    every decoder linear is a Linear4bit (Phi's fused ones too) and the loss falls (measured: the last step's over
    the first's 0.52 Gemma 3, 0.80 Phi-3, 0.89 Qwen2, 0.69 Qwen3; adapters on a random base learn slowly)."""
    import bitsandbytes as bnb

    small = tmp_path / "train16.jsonl"
    small.write_text("".join((tiny_assets / "data" / "train.jsonl").read_text().splitlines(True)[:16]))
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(models[family]), "quantize": "nf4",
                                                        "dtype": "bfloat16", "attn_implementation": "auto"},
                          data={"path": str(small)}, lora={"r": 16, "alpha": 32, "dropout": 0.0},
                          train={"max_steps": 24, "micro_batch_size": 16, "lr": 1e-2})
    from llmtrain.config import load_recipe
    from llmtrain.model.modeling import load_model

    loaded = load_model(load_recipe(recipe).model, None)
    quantized = {n.rsplit(".", 1)[-1] for n, m in loaded.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantized == ADAPTED.get(family, LLAMA_NAMES)
    run_train(recipe)
    lines = records(tmp_path / "run")
    assert lines[-1]["loss"] < 0.9 * lines[0]["loss"], (lines[0]["loss"], lines[-1]["loss"])


def test_lora_reaches_gpt_oss_experts_by_target_parameters(models, tiny_assets, tmp_path):
    """all-linear adapts GPT-OSS's attention only (peft maps it onto no expert of GPT-OSS's); lora.target_parameters
    names its 3-D experts (peft's ParamWrapper: each expert its own A and B, run unmerged beside the biased experts,
    model/lora_experts.py): they train, are saved in the adapter, are counted by the recipe's estimate, and merge back
    (`llmtrain export --merge`) into a model that computes what the adapter on the base computes."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmtrain.run.export import export_merged

    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(models["gpt_oss"]),
                                                        "attn_implementation": "auto"},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0,
                                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
                          train={"max_steps": 12, "micro_batch_size": 8, "lr": 1e-2})
    from llmtrain.config import load_recipe
    from llmtrain.memory.params import lora_plan, recipe_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    loaded = load_recipe(recipe)
    spec, shape = spec_from_recipe(loaded), recipe_model_shape(loaded)
    counted = lora_plan(shape, r=spec.lora_r, targets=spec.lora_target_modules,
                        parameters=spec.lora_target_parameters).trainable(shape)
    run_train(recipe)
    lines = records(tmp_path / "run")
    assert lines[-1]["loss"] < 0.9 * lines[0]["loss"], (lines[0]["loss"], lines[-1]["loss"])
    saved = load_file(str(tmp_path / "run" / "final" / "adapter_model.safetensors"))
    experts = sorted({k.split(".layers.")[1].split(".", 1)[1] for k in saved if ".experts." in k})
    assert experts == ["mlp.experts.base_layer.lora_A.weight", "mlp.experts.base_layer.lora_B.weight",
                       "mlp.experts.lora_A.weight", "mlp.experts.lora_B.weight"], experts
    assert any(k.endswith("q_proj.lora_A.weight") for k in saved)  # all-linear's attention too
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models["gpt_oss"]),
                                        tmp_path / "run" / "final").eval()
    merged = AutoModelForCausalLM.from_pretrained(export_merged(tmp_path / "run")).eval()
    base = AutoModelForCausalLM.from_pretrained(models["gpt_oss"]).eval()
    assert counted == sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) > 20_000
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        assert (merged(input_ids=ids).logits - want).abs().max() < 1e-4
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-3  # the adapter changed the model


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_lora_on_a_mixture_of_experts_says_what_a_4bit_base_leaves_whole(models, tiny_assets, tmp_path, quantize):
    """bitsandbytes quantizes linear layers, and each layer's experts are two 3-D parameters, which stay bf16: the
    start-up says how many weights and bytes (Qwen3-30B-A3B: 29 B of 30.5 B weights, 54 GiB), so "QLoRA" is not read
    as a 4-bit base. peft's own patterns for the experts' fused gate_up_proj (warned as matching no module) are not
    printed; LoRA on an unquantized base says nothing of it."""
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(models["qwen3_moe"]), "quantize": quantize,
                                                        "dtype": "bfloat16", "attn_implementation": "auto"},
                          lora={"r": 4, "dropout": 0.0}, train={"max_steps": 2}, checkpoint={"save_final": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_train(recipe)
    assert not [str(w.message) for w in caught if "_pattern keys" in str(w.message)]
    log = " ".join((tmp_path / "run" / "train.log").read_text().split())
    # 2 layers x 4 experts x (gate_up 128 x 128 + down 128 x 64) in bf16
    said = ("warning (model.quantize=nf4): bitsandbytes quantizes linear layers, and this qwen3_moe model's experts "
            "are 3-D parameters (every expert of a layer in one tensor), so they stay bfloat16: 196,608 of the base's")
    assert (said in log) == (quantize is not None), log[:600]
    if quantize:
        assert f"{2 * 4 * (128 * 128 + 128 * 64) * 2 / 2**30:,.2f} GiB on every process" in log


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_liger_patches_each_familys_layer(models, family):
    """liger-kernel's per-family patch (its kernels run on CUDA only; the patching itself runs anywhere): Gemma 3's
    MLP is a GeGLU, which liger names geglu where the others take swiglu."""
    pytest.importorskip("liger_kernel.transformers")
    from llmtrain.config import ModelConfig
    from llmtrain.model.modeling import _apply_liger, load_model

    model = load_model(ModelConfig(name_or_path=str(models[family]), dtype="float32"), None)
    _apply_liger(model)
    layer = model.model.layers[0]  # liger patches the instances' forward (and their repr), not their classes
    assert repr(layer.mlp).startswith("LigerGEGLUMLP" if family == "gemma3_text" else "Liger"), repr(layer.mlp)
    assert repr(layer.input_layernorm).startswith("LigerRMSNorm")


# --------------------------------------------------------------------------- the capability table's family column

CONFIGS = REPO / "accelerate_configs"
# layout -> (launch config, processes, overrides of every recipe on it, the 1-process run's micro-batch size)
LAUNCH = {
    "ddp": ("cpu_ddp.yaml", 2, ["train.micro_batch_size=2"], 4),
    "fsdp": ("cpu_fsdp.yaml", 2, ["train.micro_batch_size=2"], 4),
    # 2 FSDP shards x 2 tensor-parallel: 2 data ranks, each 2 micro-batches a step (QK-norm's summed gradients
    # accumulate across them)
    "tp": ("cpu_tp.yaml", 4, ["train.micro_batch_size=1", "train.grad_accum_steps=2"], 4),
    "sp": ("cpu_ddp.yaml", 2, ["parallel.sequence_parallel=2", "train.micro_batch_size=1",
                               "train.micro_batch_tokens=128"], None),
    "pp": ("cpu_ddp.yaml", 2, ["parallel.pipeline_parallel=2", "train.micro_batch_size=1",
                               "train.micro_batch_tokens=64", "train.grad_accum_steps=2"], None),
}
CELLS = [(f, layout) for f in sorted({**FAMILIES, **MOE, **OWN_LAYER}) for layout in LAUNCH]


def _family_recipe(tiny_assets, tmp_path, model) -> Path:
    return write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(model), "attn_implementation": "auto"},
                        data={"eval_split": None}, train={"max_steps": 3, "lr": 1e-3, "max_grad_norm": 1.0})


@pytest.mark.parametrize("family, layout", CELLS, ids=[f"{f}-{lay}" for f, lay in CELLS])
def test_llmtrain_launch_passes_or_refuses_each_family_on_each_layout(models, tiny_assets, tmp_path, family, layout):
    """`llmtrain launch`'s checks (no process starts): a cell the family's row refuses is refused in one paragraph
    naming the family and the reason; every other cell passes."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.launcher import accelerate_command

    config, processes, overrides, _ = LAUNCH[layout]
    out = tmp_path / "run"
    argv = ["--config_file", str(CONFIGS / config), "--num_processes", str(processes), "--main_process_port", "0",
            str(_family_recipe(tiny_assets, tmp_path, models[family])), *overrides, f"output_dir={out}"]
    why = capabilities.family_cell(family, layout)
    if why is None:
        assert "finetune" in accelerate_command(argv)
    else:
        with pytest.raises(LLMTrainError) as refused:
            accelerate_command(argv)
        said = " ".join(str(refused.value).split())
        assert capabilities.FAMILIES[family].name in said and why.split(". ")[0] in said, said
    assert not out.exists()


# Main tier: Gemma 3 under FSDP and on pipeline stages (the most its own: tied, two RoPEs, windows, QK-norm), GPT-OSS
# under FSDP (sinks, windows, experts with biases); the other
# cells in the extended tier (make test-all), each beside a main-tier test of the same layout on Llama's layer
# (test_fsdp.py, test_tp.py, test_sequence_parallel.py, test_pipeline.py)
# Gemma 4 on stages: test_gemma_4_with_lora_on_interleaved_stages_trains_what_one_process_trains in the main tier
MAIN = {("gemma3_text", "fsdp"), ("gemma3_text", "pp"), ("gpt_oss", "fsdp"), ("gemma4_text", "fsdp")}
TRAINED = [pytest.param(f, lay, id=f"{f}-{lay}", marks=[pytest.mark.slow] + ([] if (f, lay) in MAIN else
                                                                     [pytest.mark.extended]))
           for f, lay in CELLS if capabilities.family_cell(f, lay) is None]


# Gemma 4 in fp32 on several processes: its gradient norm drifts from one process's by up to 4e-4 by the third step
# (equal to 3e-7 at the first), as its dynamics multiply a difference about tenfold an AdamW step: in float64 its
# tensor-parallel run's gradients are 5e-15 from one process's at the first step, 1e-13 at the second, 1e-12 at the
# third (test_gemma_4s_tensor_parallel_split_is_exact_in_float64), fp32's rounding (1e-7) grows alike. A reduction
# left out or doubled is 2x the norm; the weights end up to 2e-4 apart (a QK-norm gradient unsummed: 3.7e-3)
ROUNDING = {"gemma4_text": (1e-3, 5e-4)}


@pytest.mark.parametrize("family, layout", TRAINED)
def test_each_family_trains_on_each_layout_its_row_allows_what_one_process_trains(models, tiny_assets, tmp_path,
                                                                                  free_port, family, layout):
    """3 full steps through `accelerate launch` against one process reading the same examples a step: FSDP on 2
    processes (the tied weight sharded once), sequence parallelism over 2 (the family's heads and windows on the
    gathered sequence), a pipeline of 2 stages (the tied weight's two copies summed; Gemma 3's local layer on one
    stage and its global layer on the other, each with its RoPE), tensor parallelism on 4 (2 shards x 2)."""
    config, processes, overrides, single_batch = LAUNCH[layout]
    recipe = _family_recipe(tiny_assets, tmp_path, models[family])
    alone = [o for o in overrides if not o.startswith("parallel.")]
    if single_batch is not None:
        alone = [f"train.micro_batch_size={single_batch}"]
    run_train(recipe, *alone, f"output_dir={tmp_path / 'one'}")
    launch_finetune(CONFIGS / config, processes, free_port, recipe, *overrides, f"output_dir={tmp_path / 'many'}")
    steps, weights = ROUNDING.get(family, (1e-5, 1e-4))
    assert_same_steps(tmp_path / "many", tmp_path / "one", tol=steps)
    assert len(records(tmp_path / "one")) == 3
    # every weight (QK-norm's too: one tensor-parallel rank's copy is saved, each rank's trained on its own heads'
    # gradient part would be 3.7e-3 off after 3 steps)
    assert max_abs_diff(load_weights(tmp_path / "many" / "final"), load_weights(tmp_path / "one" / "final")) < weights


# Gemma 4 of 6 layers (local and global in turn), the last 3 sharing the keys and values of layers 1 (global) and 2
# (local): every split of it into stages hands a different set of them across its boundaries
GEMMA4_SIX = dict(num_hidden_layers=6, num_kv_shared_layers=3, layer_types=["sliding_attention", "full_attention"] * 3)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gemma_4s_stages_chained_in_one_process_are_its_forward_and_backward_in_float64(tiny_assets, tmp_path,
                                                                                         monkeypatch, moe):
    """Gemma 4's pipeline stages (parallel/pipeline/stage.py) run one after the other in one process, each on what the
    one before it handed on (the hidden states, the later layers' per-layer inputs made on the first stage, the keys
    and values a later stage's sharing layers read), for every split of its 6 layers into 2 and 3 stages and into 6:
    the last stage's output is the decoder's own (transformers' forward on the packed row) to 1e-12 in float64, and so
    is every parameter's gradient, the per-layer embedding's and projection's (on the first stage) among them."""
    import itertools

    from transformers.integrations import moe as experts

    from llmtrain.config import ModelConfig
    from llmtrain.model.modeling import load_model
    from llmtrain.parallel.pipeline.stage import Stage, kv_handoffs, kv_sharing

    can = experts._can_use_grouped_mm  # torch's grouped matmul takes no float64: transformers' fallback op then does
    monkeypatch.setattr(experts, "_can_use_grouped_mm", lambda x, w, offsets: w.dtype != torch.float64 and
                        can(x, w, offsets))

    folder = family_model(tiny_assets, tmp_path / "model", "gemma4_text", **GEMMA4_SIX,
                          **(GEMMA4_EXPERTS if moe else {}))
    lm = load_model(ModelConfig(name_or_path=str(folder), dtype="float32", attn_implementation="varlen"), None)
    lm = lm.double()
    config = lm.config
    assert kv_sharing(config) == [None, "store", "store", "reuse", "reuse", "reuse"]
    # what crosses each boundary: nothing before the first store, then the global layer's, then both kinds' until the
    # last local layer that reads them
    assert [kv_handoffs(config, b) for b in range(1, 6)] == [
        [], ["full_attention"], ["full_attention", "sliding_attention"], ["full_attention", "sliding_attention"],
        ["full_attention"]]
    g = torch.Generator().manual_seed(3)
    lengths = [9, 14, 5, 20]
    ids = torch.randint(3, config.vocab_size, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    probe = torch.randn(1, sum(lengths), config.hidden_size, generator=g, dtype=torch.float64)

    def grads(out):
        lm.zero_grad()
        (out * probe).sum().backward()
        return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    want = lm.model(input_ids=ids, position_ids=positions).last_hidden_state
    want_grads = grads(want)
    assert any("per_layer_model_projection" in n for n in want_grads)
    splits = [(1, 5), (2, 4), (3, 3), (4, 2), (5, 1), (2, 2, 2), (1, 3, 2), (1,) * 6]
    for split in splits:
        ranges = stage_layers_of(split)
        stages = [Stage(lm, r, first=i == 0, last=i == len(ranges) - 1) for i, r in enumerate(ranges)]
        out = ids
        for stage in stages:
            out = stage(*(out if isinstance(out, tuple) else (out,)), position_ids=positions, cu_seq_lens=cu)
        assert (out - want).abs().max() < 1e-12, split
        got = grads(out)
        assert got.keys() == want_grads.keys()
        assert max((got[n] - want_grads[n]).abs().max() for n in got) < 1e-12, split


def stage_layers_of(counts) -> list[range]:
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


@pytest.mark.slow
def test_gemma_4_with_lora_on_interleaved_stages_trains_what_one_process_trains(models, tiny_assets, tmp_path,
                                                                               free_port):
    """Gemma 4 with LoRA on 2 processes of interleaved 1F1B, 4 virtual stages of one layer (so each boundary hands on
    its own set of shared keys and values, and the per-layer inputs, which nothing trains under LoRA, travel without
    a gradient), 3 steps of 2 micro-batches against one process: losses to 1e-6, gradient norms to 1e-5, the adapter
    to 1e-5 (measured 3.6e-6: fp32's rounding of the micro-batches' gradients summed in another order)."""
    recipe = _family_recipe(tiny_assets, tmp_path, models["gemma4_text"])
    common = ["lora.r=4", "lora.dropout=0", "train.micro_batch_size=1", "train.micro_batch_tokens=64",
              "train.grad_accum_steps=2"]
    run_train(recipe, *common, f"output_dir={tmp_path / 'one'}")
    out = launch_finetune(CONFIGS / "cpu_ddp.yaml", 2, free_port, recipe, *common, "parallel.pipeline_parallel=2",
                          "parallel.pipeline_schedule=interleaved_1f1b", "parallel.pipeline_chunks=2",
                          f"output_dir={tmp_path / 'pp'}")
    assert "stage 0: layers 0-0, stage 2: layers 2-2 (ScheduleInterleaved1F1B" in out, out
    assert_same_steps(tmp_path / "pp", tmp_path / "one", tol=1e-5)
    assert [r["loss"] for r in records(tmp_path / "pp")] == pytest.approx(
        [r["loss"] for r in records(tmp_path / "one")], abs=1e-6)
    name = "adapter_model.safetensors"
    assert max_abs_diff(load_weights(tmp_path / "pp" / "final" / name),
                        load_weights(tmp_path / "one" / "final" / name)) < 1e-5


@pytest.mark.slow
def test_gemma_4_grpo_samples_and_trains_on_two_stages_as_one_process(models, tiny_assets, tmp_path, free_port):
    """Gemma 4 with LoRA, GRPO on 2 stages (refused before 2026-12-05: the stages handed on the hidden states alone
    while decoding): layers 0-1 (a local and a global layer, each storing its keys and values) on one, 2-3 (sharing
    them) on the other, so every decoding step hands on the per-layer inputs and both kinds' new keys and values, the
    receiving stage holding their whole length (stage.Stage._decode). Against one process: the same 48 completions
    token for token, rewards, losses and gradient norms to Gemma 4's rounding (ROUNDING), the adapter to 1e-4
    (measured: losses 4e-9 apart, gradient norms 1.4e-5 relative, the adapter 2.2e-5; with Adam's eps 1e-8 a lora_A
    element whose gradient is fp32's rounding of 0 at step 1 moved by lr: 2.9e-3)."""
    common = ["lora.r=4", "lora.dropout=0", "rl.sampler=reference", "rl.micro_batch_tokens=96", "rl.num_generations=4",
              "rl.max_completion_tokens=8", "train.micro_batch_size=2", "train.grad_accum_steps=2",
              "model.attn_implementation=auto"]
    recipe = _mode_recipe(tiny_assets, tmp_path, models["gemma4_text"], "tiny-grpo.yaml",
                          rl={"temperature": 1.0, "rewards": [{"type": "format", "pattern": r"^\s*[a-m]"}]},
                          train={"max_steps": 3, "lr": 1e-2, "eps": 1e-3},
                          checkpoint={"every_steps": None, "save_final": True})
    run_train(recipe, *common, f"output_dir={tmp_path / 'one'}")
    out = launch_finetune(CONFIGS / "cpu_ddp.yaml", 2, free_port, recipe, *common, "parallel.pipeline_parallel=2",
                          f"output_dir={tmp_path / 'pp'}")
    assert "stage 0: layers 0-1" in out and "sampled through the stages" in out, out
    drawn = [[json.loads(x)["completion_ids"] for x in (run / "rollouts.jsonl").read_text().splitlines()]
             for run in (tmp_path / "pp", tmp_path / "one")]
    assert drawn[0] == drawn[1] and len(drawn[0]) == 3 * 2 * 2 * 4
    steps, _ = ROUNDING["gemma4_text"]
    assert_same_steps(tmp_path / "pp", tmp_path / "one", tol=steps)
    for key in ("reward", "loss"):
        assert [r[key] for r in records(tmp_path / "pp")] == pytest.approx(
            [r[key] for r in records(tmp_path / "one")], abs=1e-5), key
    assert any(r["reward_std"] > 0 for r in records(tmp_path / "one"))
    name = "adapter_model.safetensors"
    assert max_abs_diff(load_weights(tmp_path / "pp" / "final" / name),
                        load_weights(tmp_path / "one" / "final" / name)) < 1e-4


def test_experts_lora_does_not_reach_are_counted_against_the_bases_weights(models, tiny_assets, tmp_path, capsys):
    """GPT-OSS's experts, which all-linear does not reach: the note counted them against every weight, the adapters
    included, where the 4-bit warning counts the base's (audit 58: 49,152 of 96,464 and of 89,296)."""
    from safetensors.torch import load_file

    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(models["gpt_oss"])},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0}, data={"eval_split": None}, train={"max_steps": 1})
    run_train(recipe)
    base = sum(t.numel() for t in load_file(models["gpt_oss"] / "model.safetensors").values())
    assert f"of the base's {base:,} weights) are 3-D parameters that lora.target_modules does not reach" in \
        capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("family, lora", [pytest.param("qwen3_moe", True, marks=pytest.mark.extended),
                                          pytest.param("qwen3_moe", False, marks=pytest.mark.extended),
                                          pytest.param("gpt_oss", True, marks=pytest.mark.extended)],
                         ids=["qwen3_moe-lora", "qwen3_moe-full", "gpt_oss-lora"])
def test_a_mixture_of_experts_under_fsdp_x_tp_trains_like_one_process_and_resumes(models, tiny_assets, tmp_path,
                                                                                 free_port, family, lora):
    """A mixture of experts under FSDP x TP 2 x 2 (its experts split by expert, parallel/tensor._split_experts; with
    LoRA on its linears and experts, their adapters unmerged beside the split experts in grouped matmuls; GPT-OSS's
    sinks split with their heads) through `accelerate launch`, 4 steps, against one process reading the same examples:
    losses and gradient norms to 1e-5, the final weights (gathered whole) to 1e-4. Its step-2 checkpoint (the experts
    or their adapters, and the optimizer's state, in the checkpoint's pieces) resumes on FSDP x TP to the same end.
    (transformers' own split of these experts, by columns in an interleaved layout, could not be written there.)"""
    import shutil

    config, processes, overrides, single_batch = LAUNCH["tp"]
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(models[family]),
                                                        "attn_implementation": "auto"},
                          **({"lora": {"r": 4, "alpha": 8, "dropout": 0.0, **EXPERT_PARAMETERS.get(family, {})}}
                             if lora else {}),
                          data={"eval_split": None}, checkpoint={"every_steps": 2},
                          train={"max_steps": 4, "lr": 1e-3, "max_grad_norm": 1.0})
    run_train(recipe, f"train.micro_batch_size={single_batch}", f"output_dir={tmp_path / 'one'}")
    out = launch_finetune(CONFIGS / config, processes, free_port, recipe, *overrides, f"output_dir={tmp_path / 'tp'}")
    assert ("tensor parallelism: 8 linear layers split over 2 processes, and 2 layers' experts split by expert "
            "(each process 2 of each layer's 4)") in out, out
    assert_same_steps(tmp_path / "tp", tmp_path / "one", tol=1e-5)
    name = "adapter_model.safetensors" if lora else ""
    one = load_weights(tmp_path / "one" / "final" / name)
    many = load_weights(tmp_path / "tp" / "final" / name)
    assert one.keys() == many.keys() and any(".experts." in k for k in one)
    assert max_abs_diff(many, one) < 1e-4
    run = Path(shutil.copytree(tmp_path / "tp", tmp_path / "resumed"))
    shutil.rmtree(run / "checkpoints" / "step_000004")
    shutil.rmtree(run / "final")
    out = launch_finetune(CONFIGS / config, processes, free_port + 1, recipe, *overrides, f"output_dir={run}",
                          resume="auto")
    assert "resumed from" in out
    assert [r["loss"] for r in records(run)] == pytest.approx([r["loss"] for r in records(tmp_path / "tp")], abs=1e-6)
    assert max_abs_diff(load_weights(run / "final" / name), many) < 1e-6


@pytest.mark.slow
@pytest.mark.extended  # main tier: the SFT launch above, DPO's reference pass on one process
def test_dpo_with_lora_on_a_mixture_of_experts_under_fsdp_x_tp_equals_one_process(models, tiny_assets, tmp_path,
                                                                                   free_port):
    """DPO with LoRA on Qwen3-MoE's linears and experts under FSDP x TP 2 x 2, 6 steps on 8 pairs: the reference pass
    (the adapters disabled: peft's forward, the base experts split by expert) and the policy's (the adapters unmerged
    beside them) as one process runs them: the first step's loss is log 2, every step's loss and margin equal one
    process's to 1e-5."""
    pairs = tmp_path / "pairs8.jsonl"
    pairs.write_text("".join((tiny_assets / "data" / "train_pairs.jsonl").read_text().splitlines(True)[:8]))
    recipe = _mode_recipe(tiny_assets, tmp_path, models["qwen3_moe"], "tiny.yaml", preference={"loss": "dpo",
                                                                                                "beta": 0.1},
                          data={"path": str(pairs), "format": "preference"}, lora={"r": 8, "dropout": 0.0},
                          train={"max_steps": 6, "micro_batch_size": 8, "lr": 1e-2})
    run_train(recipe, f"output_dir={tmp_path / 'one'}")
    config, processes, _, _ = LAUNCH["tp"]
    launch_finetune(CONFIGS / config, processes, free_port, recipe, "train.micro_batch_size=2",
                    "train.grad_accum_steps=2", f"output_dir={tmp_path / 'tp'}")
    one, tp = records(tmp_path / "one"), records(tmp_path / "tp")
    assert tp[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and len(tp) == len(one) == 6
    for a, b in zip(tp, one):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], abs=1e-5)
    assert tp[-1]["loss"] < tp[0]["loss"] - 0.05


@pytest.mark.slow
@pytest.mark.extended  # main tier: the SFT launch above, GRPO under FSDP x TP on Llama's layer (test_tp.py)
def test_grpo_with_lora_on_a_mixture_of_experts_under_fsdp_x_tp_equals_one_process(models, tiny_assets, tmp_path,
                                                                                   free_port):
    """GRPO with LoRA on Qwen3-MoE's linears and experts under FSDP x TP 2 x 2: each process of a pair samples with
    its half of every layer's experts (the pair's outputs summed), so the pair draws the same completions as one
    process, which 2 data ranks x 2 prompts train as 1 process x 4 prompts: the tokens sampled, rewards, losses and
    gradient norms equal to 1e-5, the adapter to 3e-4: Adam divides each element's step by the element's own gradient
    size, so an element whose gradient is near zero moves by lr (1e-2) x its sums' rounding, which four processes add
    in another order (one element of 4,096 1.4e-4 off on an AMX host, the rest within 4e-5)."""
    rl_under_tp_against_one(tiny_assets, tmp_path, free_port, models["qwen3_moe"], tol=1e-5)
    name = "adapter_model.safetensors"
    assert max_abs_diff(load_weights(tmp_path / "tp" / "final" / name),
                        load_weights(tmp_path / "one" / "final" / name)) < 3e-4


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", pytest.param("ddp", marks=pytest.mark.extended),
                                    pytest.param("tp", marks=pytest.mark.extended)])
def test_lora_on_gpt_oss_experts_trains_on_two_processes_what_one_process_trains(models, tiny_assets, tmp_path,
                                                                                 free_port, layout):
    """LoRA on GPT-OSS's attention and experts (lora.target_parameters: the experts' adapters run unmerged beside the
    biased experts, model/lora_experts.py; under FSDP each on the unsharded experts of its layer) through `accelerate
    launch` on 2 processes (FSDP x TP: 4, its attention split by heads with their sinks, its experts by expert): the
    losses and every adapter weight of one process's run."""
    config, processes, overrides, single_batch = LAUNCH[layout]
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(models["gpt_oss"]),
                                                        "attn_implementation": "auto"},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0, **EXPERT_PARAMETERS["gpt_oss"]},
                          data={"eval_split": None}, train={"max_steps": 3, "lr": 1e-3, "max_grad_norm": 1.0})
    run_train(recipe, f"train.micro_batch_size={single_batch}", f"output_dir={tmp_path / 'one'}")
    launch_finetune(CONFIGS / config, processes, free_port, recipe, *overrides, f"output_dir={tmp_path / 'many'}")
    assert_same_steps(tmp_path / "many", tmp_path / "one", tol=1e-5)
    from safetensors.torch import load_file

    one, many = (load_file(str(tmp_path / run / "final" / "adapter_model.safetensors")) for run in ("one", "many"))
    assert one.keys() == many.keys() and any(".experts." in k for k in one)
    assert max((one[k] - many[k]).abs().max().item() for k in one) < 1e-4


# --------------------------------------------------------------------------- Gemma 3's multimodal checkpoints


def _multimodal_gemma3(text_folder: Path, out: Path, *, old_keys: bool) -> Path:
    """A Gemma 3 checkpoint as the hub ships google/gemma-3-4b-it and up (model_type gemma3: a small vision tower, the
    projector, the text model in text_config), whose text model is `text_folder`'s; `old_keys`: under the names
    transformers 4.5x saved (language_model.model.*, as the hub's files are), else 5.x's (model.language_model.*)."""
    from safetensors.torch import save_file
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma3Config,
                              Gemma3ForConditionalGeneration)

    text = AutoConfig.from_pretrained(text_folder).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=100,
                          boi_token_index=101, eoi_token_index=102)
    torch.manual_seed(1)
    model = Gemma3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(AutoModelForCausalLM.from_pretrained(text_folder).model.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(text_folder).save_pretrained(out)
    if old_keys:
        old = {"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.",
               "model.multi_modal_projector.": "multi_modal_projector."}
        state = {}
        for k, v in model.state_dict().items():
            prefix = next((p for p in old if k.startswith(p)), None)
            if k != "lm_head.weight":  # tied: the hub's files have no head
                state[old[prefix] + k[len(prefix):] if prefix else k] = v.contiguous()
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("old_keys", [True, False], ids=["hub-keys", "transformers-5-keys"])
def test_a_gemma_3_multimodal_checkpoint_trains_its_text_model(models, tiny_assets, tmp_path, old_keys):
    """google/gemma-3-4b-it and up are Gemma3ForConditionalGeneration checkpoints, which AutoModelForCausalLM builds
    whole (vision tower included) and llmtrain's paths could not read (a traceback in the FLOP count, 2026-11-29).
    llmtrain builds the text model alone from the checkpoint's language-model weights: the same logits as the text
    model it holds, the vision weights unread; it fine-tunes, and final/ is a Gemma3ForCausalLM; the estimate reads
    the same model; a LoRA adapter merges back onto it (`llmtrain export --merge`)."""
    from transformers import AutoModelForCausalLM

    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.memory.params import load_model_shape
    from llmtrain.model.modeling import load_model
    from llmtrain.run.export import export_merged

    text = models["gemma3_text"]
    mm = _multimodal_gemma3(text, tmp_path / "mm", old_keys=old_keys)
    loaded = load_model(ModelConfig(name_or_path=str(mm), dtype="float32"), None)
    assert type(loaded).__name__ == "Gemma3ForCausalLM" and loaded.config.model_type == "gemma3_text"
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(text).eval()(input_ids=ids).logits
        assert (loaded.eval()(input_ids=ids).logits - want).abs().max() < 1e-5  # (its attention: sdpa here)
    assert load_model_shape(str(mm)).params_total == load_model_shape(str(text)).params_total
    assert load_model(ModelConfig(name_or_path=str(mm), dtype="float32"), LoraConfig(r=4, dropout=0.0)) is not None
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(mm), "attn_implementation": "auto"},
                          lora={"r": 4, "dropout": 0.0}, train={"max_steps": 3, "lr": 1e-2})
    run_train(recipe)
    assert len(records(tmp_path / "run")) == 3
    merged = AutoModelForCausalLM.from_pretrained(export_merged(tmp_path / "run"))
    assert type(merged).__name__ == "Gemma3ForCausalLM"
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(text), tmp_path / "run" / "final")
    with torch.no_grad():  # the adapter, trained on the text model of the checkpoint, merged into it
        got, adapter = merged.eval()(input_ids=ids).logits, adapted.eval()(input_ids=ids).logits
        assert (got - adapter).abs().max() < 1e-5 and (got - want).abs().max() > 1e-3
    # a full fine-tune's final/ holds the text model under its own names (transformers 5 would save it under the
    # checkpoint's language_model.* names it was read from, which no loader maps back: every weight random)
    run_train(recipe, "lora=null", "train.lr=1e-3", f"output_dir={tmp_path / 'full'}")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")
    moved = (final.model.embed_tokens.weight - AutoModelForCausalLM.from_pretrained(text).model.embed_tokens.weight)
    assert 0 < moved.abs().max() < 0.01  # trained 3 steps at 1e-3 (a random init is ~0.1 away)


def test_a_gemma_4_multimodal_checkpoint_trains_its_text_model(models, tiny_assets, tmp_path):
    """google/gemma-4-* are Gemma4ForConditionalGeneration checkpoints (model_type gemma4: its text model under
    model.language_model.*, beside vision and audio towers): llmtrain builds the text model alone from them, as for
    Gemma 3's, with the same logits as the text model it holds, and fine-tunes it; final/ is a Gemma4ForCausalLM."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma4Config,
                              Gemma4ForConditionalGeneration)

    from llmtrain.config import ModelConfig
    from llmtrain.model.modeling import load_model
    from llmtrain.run.export import export_merged

    text = models["gemma4_text"]
    torch.manual_seed(1)
    whole = Gemma4ForConditionalGeneration(Gemma4Config(text_config=AutoConfig.from_pretrained(text).to_dict(),
                                                        vision_config=None, audio_config=None))
    whole.model.language_model.load_state_dict(AutoModelForCausalLM.from_pretrained(text).model.state_dict())
    whole.save_pretrained(tmp_path / "mm")
    AutoTokenizer.from_pretrained(text).save_pretrained(tmp_path / "mm")
    loaded = load_model(ModelConfig(name_or_path=str(tmp_path / "mm"), dtype="float32"), None)
    assert type(loaded).__name__ == "Gemma4ForCausalLM" and loaded.config.model_type == "gemma4_text"
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(text).eval()(input_ids=ids).logits
        assert (loaded.eval()(input_ids=ids).logits - want).abs().max() < 1e-5
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(tmp_path / "mm"),
                                                        "attn_implementation": "auto"},
                          lora={"r": 4, "dropout": 0.0}, train={"max_steps": 3, "lr": 1e-2})
    run_train(recipe)
    assert len(records(tmp_path / "run")) == 3
    merged = AutoModelForCausalLM.from_pretrained(export_merged(tmp_path / "run"))  # the adapter on the text model
    assert type(merged).__name__ == "Gemma4ForCausalLM"
    with torch.no_grad():
        assert (merged.eval()(input_ids=ids).logits - want).abs().max() > 1e-3  # trained


def test_the_family_table_in_docs_models_is_the_tables_own():
    assert capabilities.families_markdown() in (REPO / "docs" / "models.md").read_text()


@pytest.mark.slow
def _tp_probe(port: int, out: Path, *args: str) -> list[dict]:
    """tests/tp_probe.py through `torch.distributed.run` on 2 processes: each rank's record."""
    import os
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(port), str(REPO / "tests" / "tp_probe.py"), str(out), *args], check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_gemma_4s_tensor_parallel_split_is_exact_in_float64(free_port, tmp_path):
    """Gemma 4's dense layer under llmtrain's tensor parallelism over 2 processes (tests/tp_probe.py through
    `torch.distributed.run`: local and global layers of their own head sizes and K/V heads, keys that are the values,
    kv sharing, double-wide MLPs, per-layer embeddings), in float64 with its norms in float64 too, three AdamW steps:
    each step's loss equals one process's to 1e-12 and every weight's gradient to 1e-10, and each q_proj holds half
    its rows. (With QK-norm's gradient left unsummed over the pair, the first step's is 3.2e-2 off.)"""
    for got in _tp_probe(free_port, tmp_path):
        for step in got["steps"]:  # three AdamW steps: a difference grows about tenfold a step from 5e-15
            assert step["loss_diff"] < 1e-12 and step["grad_diff"] < 1e-10 and step["largest_grad"] > 0.1, got
        assert [local * 2 for _, local in got["q_rows"]] == [whole for whole, _ in got["q_rows"]] == [64, 128] * 2
        # q, k, v, o and the MLP's three; no v on a global layer (its keys are its values), no k or v where shared
        assert got["sharded"] == 7 + 6 + 5 + 5


# model, LoRA -> the largest gradient difference a step allows in float64, the layers split (the experts' modules
# counted), the trained tensors. Measured: 1e-16 (Qwen3-MoE, Mixtral: each token's pair with an expert is computed whole
# on one rank, so only the sums over the pair differ in order) and 6e-13 (Gemma 4's third step, as its dense layer's)
EXPERTS_PROBE = {("qwen3_moe", False): (1e-14, 5 * 2, 25), ("qwen3_moe", True): (1e-14, 5 * 2, 28),
                 ("mixtral", False): (1e-14, 5 * 2, 21), ("mixtral", True): (1e-14, 5 * 2, 28),
                 ("gemma4_moe", False): (1e-11, 27, 94), ("gemma4_moe", True): (1e-11, 27, 88),
                 ("gpt_oss", False): (1e-14, 5 * 2, 37), ("gpt_oss", True): (1e-14, 5 * 2, 24)}


@pytest.mark.parametrize("model, lora", [pytest.param(m, lo, id=f"{m}-{'lora' if lo else 'full'}",
                                                      marks=[] if (m, lo) == ("qwen3_moe", True) else
                                                      [pytest.mark.extended]) for m, lo in EXPERTS_PROBE])
def test_a_mixture_of_experts_tensor_parallel_split_is_exact_in_float64(free_port, tmp_path, model, lora):
    """A mixture of experts under llmtrain's tensor parallelism over 2 processes (tests/tp_probe.py), its experts split
    by expert (each rank 2 of each layer's 4, whole; a token's pair with the other rank's expert goes to none here),
    the router whole (GPT-OSS: llmtrain's own plan, its attention sinks split with their heads, its experts' biases
    with their experts), in float64, three AdamW steps: each step's loss equals one process's to 1e-12 and every trained
    weight's gradient to EXPERTS_PROBE's bound. With LoRA on every linear layer and on the experts (B random, so the
    adapters count from the first step): each rank runs its experts' rows of the whole factors, whose gradients are
    summed over the pair. Caught (Qwen3-MoE with LoRA, the first step's largest gradient difference): the tokens'
    gradient left unsummed, 1.2e-2; the routing weights', 3.0e-3; the factors', 1.5e-2."""
    bound, sharded, trained = EXPERTS_PROBE[model, lora]
    for got in _tp_probe(free_port, tmp_path, model, *(["lora"] if lora else [])):
        for step in got["steps"]:
            assert step["loss_diff"] < 1e-12 and step["grad_diff"] < bound, got
            assert step["largest_grad"] > 0.03
            assert step["trained"] == trained
        assert got["sharded"] == sharded
        assert got["experts"] == [[4, 2]] * (2 if model != "gemma4_moe" else 4)  # each rank 2 of each layer's 4
        assert got["sinks"] == ([[4, 2]] * 2 if model == "gpt_oss" else [])  # GPT-OSS's: with their heads
        # estimate-memory's tensor-parallel slice counts the weights each rank holds of a layer (the router whole)
        from llmtrain.memory.params import _shape_from_json, tensor_parallel_shape

        shape = tensor_parallel_shape(_shape_from_json(got["config"], "probe"), 2)
        assert shape.experts.local == 2 and (shape.layer(0) if shape.layer_shapes else shape).params_per_layer == \
            got["layer_params"]


@pytest.mark.parametrize("model, linears", [("llama", 14), ("phi3", 8)])
def test_dora_and_the_merged_copy_under_tensor_parallelism_are_exact(free_port, tmp_path, model, linears):
    """DoRA on every linear under llmtrain's tensor parallelism over 2 processes (tests/tp_probe.py in float64):
    Llama's column-wise layers keep their rows' magnitudes and norms, its row-wise ones whole magnitudes with each row's
    norm summed over the pair; Phi-3's fused qkv_proj and gate_up_proj (the gathered plan) whole magnitudes with
    their rows' norms gathered. Three AdamW steps' losses and every gradient (the magnitudes' among them) equal one
    process's to 1e-15 (measured: exact, and 3e-17). Then the merged generation copy (rl.merged_copy, each policy;
    `kept` rewritten in place the second time) under TP: every adapted linear merged on each process, its logits one
    process's copy's and the unmerged adapters' to 1e-6 (the copy is merged in fp32: 5e-8 and 9e-8 measured), and not
    the base model's (the adapters, random B, count). Refused before 2026-12-06, both."""
    for got in _tp_probe(free_port, tmp_path, model, "dora", "merged"):
        for step in got["steps"]:
            assert step["loss_diff"] < 1e-15 and step["grad_diff"] < 1e-15 and step["largest_grad"] > 0.03, got
        assert [copy["policy"] for copy in got["merged"]] == ["rollout", "kept", "kept"]
        for copy in got["merged"]:
            assert copy["linears"] == [linears, linears] and copy["from_base"] > 0.1, copy
            assert copy["from_one"] < 1e-6 and copy["from_unmerged"] < 1e-6, copy
            # and the fast sampler, asked for it as a run's rollouts ask, samples through it (it had run the split
            # layers unmerged whatever rl.merged_copy said)
            assert copy["sampled_linears"] == [linears, linears] and copy["sampled_same"], copy


def test_compiled_layers_under_tensor_parallelism_are_exact(free_port, tmp_path):
    """model.compile's regional compile of a tensor-parallel model (tests/tp_probe.py in float64, 2 processes): Phi-3's
    gathered plan with DoRA on every linear, each split module (the linears, the adapters beside them, DoRA's
    magnitudes with their norms' collectives) eager inside its compiled layer (tensor.eager_in_compile), against one
    process's compiled model: three AdamW steps' losses and every gradient to 1e-15 (measured: exact, and 3.5e-17).
    tests/test_tp.py trains it under FSDP x TP, where the compile had failed."""
    for got in _tp_probe(free_port, tmp_path, "phi3", "dora", "compile"):
        for step in got["steps"]:
            assert step["loss_diff"] < 1e-15 and step["grad_diff"] < 1e-15 and step["largest_grad"] > 0.03, got


# Gemma 4 with 4 experts of 64 beside each MLP, 2 a token (its config's own name for them: top_k_experts)
GEMMA4_EXPERTS = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64)


@pytest.mark.slow
@pytest.mark.extended  # main tier: the dense Gemma 4 under FSDP, GPT-OSS's experts under FSDP
@pytest.mark.parametrize("layout", ["fsdp", "sp"])
def test_gemma_4s_mixture_of_experts_trains_on_two_processes(tiny_assets, tmp_path, free_port, layout):
    """Gemma 4 with experts beside each MLP under FSDP and sequence parallelism on 2 processes, 3 full steps, against
    one process reading the same examples: the first step's loss to 1e-6 and gradient norm to 1e-6 (relative: the
    reductions), the later ones to 2e-3 (measured on the tests' model, its layer scalars 0.9 to 1.5: 8.3e-6 and
    2.1e-4 under FSDP, 1.8e-5 and 1.3e-4 under sequence parallelism; up to 1.4e-3 with every layer scalar 1), as
    rounding grows through AdamW and flips a token's expert now and then."""
    model = family_model(tiny_assets, tmp_path / "model", "gemma4_text", **GEMMA4_EXPERTS)
    config, processes, overrides, single_batch = LAUNCH[layout]
    recipe = _family_recipe(tiny_assets, tmp_path, model)
    alone = [o for o in overrides if not o.startswith("parallel.")]
    run_train(recipe, *([f"train.micro_batch_size={single_batch}"] if single_batch else alone),
              f"output_dir={tmp_path / 'one'}")
    launch_finetune(CONFIGS / config, processes, free_port, recipe, *overrides, f"output_dir={tmp_path / 'many'}")
    many, one = records(tmp_path / "many"), records(tmp_path / "one")
    assert len(many) == len(one) == 3
    assert abs(many[0]["loss"] - one[0]["loss"]) < 1e-6 and abs(many[0]["grad_norm"] / one[0]["grad_norm"] - 1) < 1e-6
    assert_same_steps(tmp_path / "many", tmp_path / "one", tol=2e-3)


@pytest.mark.slow
def test_gemma_4s_mixture_of_experts_trains_end_to_end(tiny_assets, tmp_path):
    """Gemma 4 with experts beside each MLP (enable_moe_block; its config names the experts a token goes through
    top_k_experts, not num_experts_per_tok): `llmtrain finetune` with LoRA on its linears and its experts
    (lora.target_parameters) trains, MFU counting 2 of its 4 experts a token (run/metrics.flop_model had read
    num_experts_per_tok and ended every such run in an AttributeError); model.router_aux_loss_coef is refused in one
    paragraph before anything is written (transformers gives Gemma 4 no load-balancing loss)."""
    from transformers import AutoModelForCausalLM

    from llmtrain.errors import LLMTrainError
    from llmtrain.run.metrics import flop_model

    folder = family_model(tiny_assets, tmp_path / "model", "gemma4_text", **GEMMA4_EXPERTS)
    model = AutoModelForCausalLM.from_pretrained(folder)
    config = model.config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    two = flop_model(model).body_per_token
    config.top_k_experts = 4  # every expert a token
    assert flop_model(AutoModelForCausalLM.from_config(config)).body_per_token - two == 6 * experts // 2
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(folder), "attn_implementation": "auto"},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0,
                                "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
                          data={"eval_split": None}, train={"max_steps": 3, "lr": 1e-3})
    summary = run_train(recipe, f"output_dir={tmp_path / 'run'}")
    losses = [r["loss"] for r in records(tmp_path / "run")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and summary["final_loss"] == losses[-1]
    with pytest.raises(LLMTrainError, match="has none") as refused:
        run_train(recipe, "model.router_aux_loss_coef=0.001", f"output_dir={tmp_path / 'aux'}")
    assert "model.router_aux_loss_coef=0.001" in str(refused.value) and not (tmp_path / "aux").exists()


def test_prepare_tiny_writes_each_familys_layer_for_the_same_task_and_it_trains(tiny_assets, tmp_path):
    """`llmtrain prepare-tiny DIR --family NAME` (a user trying a family's path on the CPU, docs/models.md): every
    family of the capability table has its tiny layer (a family added to the table must add one), each writes a model
    of its model_type at the tiny sizes beside the same tokenizer and data as the Llama's, a name that is no family is
    refused in one paragraph, and the Qwen3 one trains on the tiny recipe (the loss falls)."""
    from helpers import invoke

    from llmtrain.tiny import FAMILY_LAYERS, MODEL_KWARGS

    assert set(FAMILY_LAYERS) == set(capabilities.FAMILIES)
    for family in FAMILY_LAYERS:
        out = tmp_path / family
        proc = invoke("prepare-tiny", str(out), "--family", family)
        config = json.loads((out / "model" / "config.json").read_text())
        assert config["model_type"] == family and config["hidden_size"] == MODEL_KWARGS["hidden_size"], proc.stdout
        assert (out / "data" / "train.jsonl").read_bytes() == (tiny_assets / "data" / "train.jsonl").read_bytes()
        tokenizer = "model/tokenizer.json"
        assert (out / tokenizer).read_bytes() == (tiny_assets / tokenizer).read_bytes()
    proc = invoke("prepare-tiny", str(tmp_path / "nope"), "--family", "llama4", check=False)
    assert proc.returncode == 2 and "--family llama4: not a model_type prepare-tiny builds (did you mean llama?); " \
        "use one of llama, mistral" in " ".join((proc.stdout + (proc.stderr or "")).split()) and \
        not (tmp_path / "nope").exists()
    # the model_type's name, not the family's (it had got no suggestion; audit 11)
    proc = invoke("prepare-tiny", str(tmp_path / "nope"), "--family", "gemma3", check=False)
    assert proc.returncode == 2 and "(did you mean gemma3_text?)" in (proc.stdout + (proc.stderr or ""))
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(tmp_path / "qwen3" / "model")},
                          train={"max_steps": 16, "micro_batch_size": 8, "lr": 3e-3})
    run_train(recipe)
    losses = [r["loss"] for r in records(tmp_path / "run")]
    assert sum(losses[-4:]) < sum(losses[:4]) - 1.0, losses
