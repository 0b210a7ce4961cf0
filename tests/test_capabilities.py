"""The capability table walked cell by cell: every training mode on every layout trains or is refused in one paragraph.

The 7 modes (capabilities.MODES) x 5 multi-process layouts on the tiny model, as a user launches them with `llmtrain
launch`: DDP and FSDP on 2 processes, FSDP x TP on 4 (2 shards x 2), sequence parallelism and a pipeline of 2 stages
on 2. Each mode is its shipped tiny recipe (a full fine-tune) with the tiny model, 2 steps, no eval; each layout adds
what it needs of any recipe (a token budget and accumulation for the stages, a token budget for the sequence group).

- In-process (fast): `llmtrain launch`'s checks for all 35 cells (accelerate's parser, the recipe, the launch config,
  the model's config: no process starts). A cell the table refuses, or a rule of its layout, is refused with its
  reason; every other cell passes every check. The table printed in docs/scaling.md is the table's own.
- Through the command line (slow): refused cells exit 2 with one paragraph, no traceback and no run folder; the cells
  the table supports that no other test launches train 2 steps and equal one process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ENV, REPO, launch_finetune, records, run_train

from llmtrain import capabilities
from llmtrain.errors import LLMTrainError

CONFIGS = REPO / "accelerate_configs"
# layout -> (launch config, processes, overrides every recipe needs on it)
LAYOUTS = {
    "ddp": ("cpu_ddp.yaml", 2, []),
    "fsdp": ("cpu_fsdp.yaml", 2, []),
    "tp": ("cpu_tp.yaml", 4, []),
    "sp": ("cpu_ddp.yaml", 2, ["parallel.sequence_parallel=2", "train.micro_batch_size=1",
                               "train.micro_batch_tokens=128"]),
    "pp": ("cpu_ddp.yaml", 2, ["parallel.pipeline_parallel=2", "train.micro_batch_size=1",
                               "train.micro_batch_tokens=128", "train.grad_accum_steps=2"]),
}
# online RL on stages samples with the reference loop (through them) and trains passes of one shape
RL_STAGES = ["rl.sampler=reference", "rl.micro_batch_tokens=128"]
MODE_RECIPES = {"sft": "tiny.yaml", "preference": "tiny-dpo.yaml", "kto": "tiny-kto.yaml",
                "reward_model": "tiny-reward.yaml",
                "grpo": "tiny-grpo.yaml", "rloo": "tiny-rloo.yaml", "distill": "tiny-distill.yaml"}
# Supported cells that another test already launches (and compares with one process): not launched again here
ELSEWHERE = {("sft", "ddp"): "test_ddp.py", ("sft", "fsdp"): "test_fsdp.py", ("sft", "tp"): "test_tp.py",
             ("sft", "sp"): "test_sequence_parallel.py", ("sft", "pp"): "test_pipeline.py",
             ("preference", "ddp"): "test_preference.py", ("preference", "fsdp"): "test_preference.py",
             ("preference", "tp"): "test_preference.py", ("kto", "ddp"): "test_kto_run.py",
             ("kto", "fsdp"): "test_kto_run.py", ("kto", "pp"): "test_kto_run.py",
             ("reward_model", "ddp"): "test_reward_model.py", ("grpo", "ddp"): "test_grpo_run.py",
             ("grpo", "fsdp"): "test_grpo_run.py", ("rloo", "ddp"): "test_rloo.py", ("rloo", "fsdp"): "test_rloo.py",
             ("distill", "ddp"): "test_distill.py", ("distill", "fsdp"): "test_distill.py",
             ("reward_model", "pp"): "test_pipeline.py", ("preference", "pp"): "test_pipeline.py",
             ("grpo", "pp"): "test_pipeline.py", ("rloo", "pp"): "test_pipeline.py",
             ("distill", "pp"): "test_pipeline.py",
             ("kto", "tp"): "test_tp.py", ("grpo", "tp"): "test_tp.py", ("rloo", "tp"): "test_tp.py",
             ("distill", "tp"): "test_tp.py",
             ("distill", "sp"): "test_distill.py",
             **{(m, "sp"): "test_sequence_parallel.py" for m in ("preference", "kto", "reward_model", "grpo", "rloo")}}
CELLS = [(m, layout) for m in capabilities.MODES for layout in LAYOUTS]


pytestmark = pytest.mark.long(110)  # tests/conftest.py


@pytest.fixture(scope="module")
def mode_recipes(tiny_assets, tmp_path_factory) -> dict[str, Path]:
    """Each mode's tiny recipe on the tiny model (its teacher too), 2 steps, no eval, nothing saved but final/."""
    out = tmp_path_factory.mktemp("modes")
    model, data = tiny_assets / "model", tiny_assets / "data"
    recipes = {}
    for mode, name in MODE_RECIPES.items():
        recipe = yaml.safe_load((REPO / "recipes" / name).read_text())
        if mode == "kto":  # LoRA (its reference the disabled adapter: no second model loaded in each cell)
            recipe["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
        recipe["data"]["path"] = str(data / Path(recipe["data"]["path"]).name)
        recipe["data"].update(eval_split=None, cache_dir=str(tiny_assets.parent / "data-cache"))
        recipe["model"]["name_or_path"] = str(model)
        if mode == "distill":
            recipe["distill"]["teacher"] = str(model)
        recipe["train"].update(max_steps=2, micro_batch_size=4 if mode == "kto" else 2, eval_every_steps=None,
                               eval_batch_size=None, eval_samples=0, warmup_steps=0)
        recipe["checkpoint"] = {"every_steps": None, "save_final": False}
        recipe["logging"] = {"progress": False, "plot": False}
        recipe["output_dir"] = str(out / "runs" / mode)
        if "rl" in recipe:
            recipe["rl"]["num_generations"] = 4
        recipes[mode] = out / f"{mode}.yaml"
        recipes[mode].write_text(yaml.safe_dump(recipe, sort_keys=False))
    return recipes


def _argv(recipe: Path, layout: str, out: Path, port: int = 0, *, mode: str = "sft") -> list[str]:
    config, processes, overrides = LAYOUTS[layout]
    if not capabilities.MODES[mode].token_budget:  # KTO: micro-batches of examples (packed rows all the same)
        overrides = [o for o in overrides if not o.startswith(("train.micro_batch_size", "train.micro_batch_tokens"))]
    if layout == "pp" and mode in ("grpo", "rloo"):  # online RL's passes through the stages: rows of its own budget
        overrides = [*overrides, *RL_STAGES]
    if layout == "pp" and mode == "distill":  # the student samples through the stages
        overrides = [*overrides, "distill.sampler=reference"]
    return ["--config_file", str(CONFIGS / config), "--num_processes", str(processes), "--main_process_port",
            str(port), str(recipe), *overrides, f"output_dir={out}"]


def _expected(mode: str, layout: str) -> str | None:
    """The words the refusal must hold (None: the cell trains)."""
    why = capabilities.cell(mode, layout)
    return why.split(". ")[0] if why is not None else None


@pytest.mark.parametrize("mode, layout", CELLS, ids=[f"{m}-{lay}" for m, lay in CELLS])
def test_llmtrain_launch_refuses_each_unsupported_cell_and_passes_each_supported_one(mode_recipes, tmp_path, mode,
                                                                                     layout):
    from llmtrain.launcher import accelerate_command

    out = tmp_path / "run"
    expected = _expected(mode, layout)
    if expected is None:
        command = accelerate_command(_argv(mode_recipes[mode], layout, out, mode=mode))
        assert command[-1].startswith("output_dir=") and "finetune" in command  # accelerate launch ... -m llmtrain
    else:
        with pytest.raises(LLMTrainError) as refused:
            accelerate_command(_argv(mode_recipes[mode], layout, out, mode=mode))
        assert expected in " ".join(str(refused.value).split()), str(refused.value)
    assert not out.exists()  # nothing written either way


@pytest.mark.parametrize("mode", ["grpo", "distill"])
def test_tensor_parallelism_samples_the_split_weights_merged_or_not(mode_recipes, tmp_path, mode):
    """Under tensor parallelism the fast sampler runs each process's split weights, eagerly (it had fallen back to the
    reference loop there), with the adapters unmerged or on a merged generation copy of each process's part (refused
    until 2026-12-06, when the copy was made of whole weights; tests/test_tp.py trains it): both launch, and the
    run's header says the graph sampler runs its step eagerly."""
    import torch

    from llmtrain.launcher import accelerate_command
    from llmtrain.loop.phases import sampler_text

    key = "rl" if mode == "grpo" else "distill"
    argv = _argv(mode_recipes[mode], "tp", tmp_path / "run", mode=mode)
    for copy in ("rollout", "kept", "off"):
        assert "finetune" in accelerate_command([*argv, "lora.r=4", f"{key}.merged_copy={copy}"])
    assert not (tmp_path / "run").exists()
    assert sampler_text("graph", torch.device("cuda"), split=True) == "graph: static under tensor parallelism"
    assert sampler_text("graph", torch.device("cuda")) == "graph"


@pytest.mark.parametrize("recipe", ["tiny-dpo.yaml", "tiny-reward.yaml"])
def test_the_pipelines_budget_advice_holds_a_pair_and_the_budget_check_says_what_fits(recipe):
    """A pair is two sequences of up to data.max_seq_len: the stages' token budget the refusal advises holds
    micro_batch_size pairs (it had advised the slots of one sequence, which the processes then refused, advising the
    max_seq_len already set; audit 12), and the data's budget check advises half the budget for a pair's sequences."""
    from llmtrain.config import load_recipe
    from llmtrain.data.checks import check_budget

    with pytest.raises(LLMTrainError) as refused:
        load_recipe(REPO / "recipes" / recipe, ["parallel.pipeline_parallel=2", "train.micro_batch_size=1",
                                                "train.grad_accum_steps=2", "data.max_seq_len=32"])
    said = " ".join(str(refused.value).split())
    assert ("Set train.micro_batch_tokens=64 (the slots of train.micro_batch_size=1 pairs of 2 sequences of "
            "data.max_seq_len)") in said, said
    (_, status, detail), = check_budget(32, [20, 51], max_seq_len=32, pairs=True)
    assert status == "fail" and "at least 51, or truncate the examples with data.max_seq_len=16 (a pair" in detail
    (_, _, detail), = check_budget(32, [20, 51], max_seq_len=32)  # one sequence: already cut there, no such advice
    assert detail.endswith("Raise train.micro_batch_tokens to at least 51.")
    (_, _, detail), = check_budget(32, [20, 51], max_seq_len=64)
    assert detail.endswith("or truncate the examples with data.max_seq_len=32.")


def test_every_problem_of_a_recipe_is_said_at_once():
    """A full fine-tune's KTO on pipeline stages without a token budget and with a micro-batch of 1: the stages' one
    row shape (a budget) and its KL's micro-batch, in one refusal (each used to come only once the one before it was
    fixed); its frozen reference, once refused there too, is each stage's copy of its own part now."""
    from llmtrain.config import load_recipe

    with pytest.raises(LLMTrainError) as refused:
        load_recipe(REPO / "recipes" / "tiny-kto.yaml", ["parallel.pipeline_parallel=2", "train.micro_batch_size=1"])
    said = " ".join(str(refused.value).split())
    assert "reference" not in said, said
    assert "Set train.micro_batch_tokens=64 (the slots of train.micro_batch_size=1 rows of data.max_seq_len)" in said
    assert "at least 2" in said and "or a token budget (train.micro_batch_tokens) that holds two examples" in said


def test_the_table_in_docs_scaling_is_the_tables_own():
    page = (REPO / "docs" / "scaling.md").read_text()
    assert capabilities.table_markdown() in page


@pytest.mark.slow
def test_a_refused_layout_exits_2_with_one_paragraph_and_writes_nothing(mode_recipes, tmp_path):
    """Every cell of the table trains; what a layout refuses of a recipe (here a 4-bit base under tensor
    parallelism, whose packed weights cannot be split) stops `llmtrain launch` before any process starts: exit 2,
    one paragraph naming the fix, no traceback, nothing written."""
    out = tmp_path / "run"
    argv = ["--config_file", str(CONFIGS / "cpu_tp.yaml"), "--num_processes", "4", "--main_process_port", "0",
            str(mode_recipes["distill"]), "lora.r=4", "model.quantize=nf4", f"output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "llmtrain", "launch", *argv], env=ENV, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert "does not train a 4-bit base (model.quantize)" in " ".join(proc.stderr.split())
    assert "launch it with accelerate_configs/ddp.yaml" in " ".join(proc.stderr.split())
    assert not out.exists()


def test_finetune_of_a_pipeline_without_a_launcher_is_one_paragraph(mode_recipes, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(LLMTrainError, match="this is one process .no launcher started it.: run it with `llmtrain "
                                            "launch"):
        run_train(mode_recipes["sft"], *LAYOUTS["pp"][2], f"output_dir={out}")
    assert not out.exists()


UNCOVERED = [cell for cell in CELLS if _expected(*cell) is None and cell not in ELSEWHERE]


def test_every_supported_cell_is_launched_by_a_test():
    """Each cell the table supports is trained by multi-process test: its own file's, or this file's below."""
    for cell, name in ELSEWHERE.items():
        assert _expected(*cell) is None, f"{cell} is refused but {name} is said to train it"
        assert (REPO / "tests" / name).is_file()
    assert UNCOVERED == [("reward_model", "fsdp"), ("reward_model", "tp")]


# reward_model-tp (4 processes, 37 s) in the extended tier: main tier, reward_model-fsdp (the score head's cell) and
# test_tp.py's FSDP x TP against one process
@pytest.mark.slow
@pytest.mark.parametrize("mode, layout", [pytest.param(m, lay, id=f"{m}-{lay}", marks=[pytest.mark.extended] * (
    lay == "tp")) for m, lay in UNCOVERED])
def test_a_supported_cell_trains_and_equals_one_process(mode_recipes, tmp_path, free_port, mode, layout):
    """2 data ranks (FSDP's 2 shards; FSDP x TP's 2 shards of 2 tensor-parallel ranks) x 2 pairs a micro-batch: the
    step one process takes with 4."""
    config, processes, overrides = LAYOUTS[layout]
    one = tmp_path / "one"
    run_train(mode_recipes[mode], *overrides, "train.micro_batch_size=4", f"output_dir={one}")
    launched = tmp_path / "launched"
    launch_finetune(CONFIGS / config, processes, free_port, mode_recipes[mode], *overrides, f"output_dir={launched}")
    ours, theirs = records(launched), records(one)
    assert len(ours) == len(theirs) == 2
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], abs=1e-5)
    assert [r["grad_norm"] for r in ours] == pytest.approx([r["grad_norm"] for r in theirs], rel=1e-4)


@pytest.fixture(scope="module")
def tiny_moe(tiny_assets, tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE (4 experts, 2 a token) beside the tiny task's tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out = tmp_path_factory.mktemp("moe")
    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, vocab_size=512, max_position_embeddings=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in (tiny_assets / "model").glob("*token*"):
        shutil.copy(f, out)
    return out


@pytest.mark.parametrize("changes, says", [(["model.tiled_mlp=true"], "model.tiled_mlp tiles a dense MLP"),
                                           (["lora.r=4"], "lora.dropout=0.05: qwen3_moe's MLP is a mixture of 4 "
                                                          "experts"),
                                           (["lora.dropout=0", "lora.dora=true"], "lora.dora: qwen3_moe's MLP is a "
                                                                                  "mixture of 4 experts")])
def test_a_mixture_of_experts_refuses_the_tiled_mlp_and_lora_dropout_in_one_paragraph(mode_recipes, tiny_moe,
                                                                                       tmp_path, changes, says):
    """Each ended in a traceback (the tiled MLP: 163 lines in the expert block) or a refusal naming the wrong keys
    (LoRA dropout: lora.target_modules); doctor passed both. Now finetune refuses before writing, and doctor fails."""
    from llmtrain.config import load_recipe
    from llmtrain.doctor import check_layout

    overrides = [f"model.name_or_path={tiny_moe}", "model.dtype=float32", *changes]
    with pytest.raises(LLMTrainError, match=says):
        run_train(mode_recipes["sft"], *overrides, f"output_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()
    (name, status, detail), = check_layout(load_recipe(mode_recipes["sft"], overrides), {})
    assert status == "fail" and says in detail
    run_train(mode_recipes["sft"], *overrides, "lora.dropout=0", "model.tiled_mlp=null", "lora.dora=false",
              f"output_dir={tmp_path / 'fixed'}")  # the fix each names trains
    assert (tmp_path / "fixed" / "summary.json").is_file()


def test_the_tensor_parallel_plan_styles_llmtrain_builds_and_the_embedding_it_keeps_whole():
    """Column- and row-wise linears and QK-norm's summed gradients are built; transformers 5.17 (the GPU machine's)
    adds "embed_tokens": "embedding_rowwise" to a tied model's plan, which llmtrain keeps whole as it keeps every
    embedding (before, every tied model under tensor parallelism was refused there). Phi's gathered plan splits the
    weights, not the heads: its fused qkv_proj's outputs must divide, not the K/V heads. A mixture of experts (Mixtral)
    splits by expert: its experts a layer must divide."""
    from transformers import MixtralConfig, Phi3Config, Qwen3Config

    from llmtrain.capabilities import tensor_plan_problems

    qwen3 = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, tie_word_embeddings=True)
    qwen3.base_model_tp_plan = {**qwen3.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    assert tensor_plan_problems(qwen3, 2) == []
    assert "num_key_value_heads (2) evenly" in " ".join(tensor_plan_problems(qwen3, 4))
    phi = Phi3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert tensor_plan_problems(phi, 2) == [] and tensor_plan_problems(phi, 4) == []  # 2 K/V heads on 4: gathered
    said = " ".join(tensor_plan_problems(phi, 3))
    assert "qkv_proj's outputs, (num_attention_heads + 2 x num_key_value_heads) x head_dim (128) evenly" in said, said
    assert "num_key_value_heads (2)" not in said and "intermediate_size (128)" in said
    # a mixture of experts splits by expert: Mixtral's 8 a layer over 2 or 4, not over 3 (nor its heads)
    mixtral = MixtralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert tensor_plan_problems(mixtral, 2) == [] and tensor_plan_problems(mixtral, 4) != []  # 2 K/V heads
    said = " ".join(tensor_plan_problems(mixtral, 3))
    assert "experts of each layer (8) evenly, and 8 is not a multiple of 3" in said, said
    mixtral.intermediate_size = 101  # its experts' width: each expert stays whole, so it need not divide
    assert tensor_plan_problems(mixtral, 2) == []


def test_gemma_4s_heterogeneous_config_is_read_layer_by_layer():
    """Gemma 4's checkpoints give their global layers a head size and K/V heads of their own (global_head_dim,
    num_global_key_value_heads): transformers makes the config heterogeneous (per_layer_config) and raises where
    num_key_value_heads or head_dim is read off the config itself, which every Gemma 4 run did at its first check (a
    traceback). Each layer's value is read off its own (layer_values): the sequence and tensor-parallel checks ask
    each layer's K/V heads, the FLOP count each layer's head size. Under tensor parallelism its dense layers split
    (the plan's expert entries name nothing there); its mixture-of-experts variant splits its experts by expert."""
    from transformers import Gemma4TextConfig

    from llmtrain.capabilities import layer_values, sequence_config_problem, tensor_plan_problems

    def gemma4(**own):
        return Gemma4TextConfig(**{**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                                          layer_types=["sliding_attention", "full_attention"] * 2), **own})

    config = gemma4()
    with pytest.raises(RuntimeError, match="per-layer attribute"):  # what every check had read
        config.num_key_value_heads  # noqa: B018
    assert layer_values(config, "num_key_value_heads") == [2, 1, 2, 1]
    assert layer_values(config, "head_dim") == [16, 32, 16, 32]
    assert sequence_config_problem(2, config) is None  # 2 K/V heads split, 1 is replicated
    assert "3 key/value heads" in sequence_config_problem(2, gemma4(num_key_value_heads=4,
                                                                    num_global_key_value_heads=3))
    said = " ".join(tensor_plan_problems(config, 2))  # the global layers' one K/V head does not split over 2
    assert "key/value heads of layers 1, 3 (1) evenly" in said and "experts" not in said, said
    assert tensor_plan_problems(gemma4(num_global_key_value_heads=2), 2) == []
    moe = dict(num_global_key_value_heads=2, enable_moe_block=True, top_k_experts=2, moe_intermediate_size=32)
    assert tensor_plan_problems(gemma4(num_experts=4, **moe), 2) == []  # its experts split by expert, 2 a process
    assert "experts of each layer (3) evenly" in " ".join(tensor_plan_problems(gemma4(num_experts=3, **moe), 2))


def test_the_flop_count_takes_each_layers_head_size():
    """MFU's attention FLOPs (run/metrics.flop_model): 6 x heads x each layer's head size a query-key pair, Gemma 4's
    global layers at their own (a config that raised before)."""
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from llmtrain.run.metrics import flop_model

    config = Gemma4TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, global_head_dim=32, vocab_size=64,
                              vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    assert flop_model(AutoModelForCausalLM.from_config(config)).attn_per_square == 6 * 4 * (16 + 32 + 16 + 32)


# An FSDP refusal of the kind the table held until 2026-12-05 (a full fine-tune's reference copied from a random
# start, which FSDP read again from model.name_or_path): the machinery that keeps such a refusal out of --fit's
# proposals, with no such rule in the table today
_RANDOM_COPY = "a full fine-tune's frozen reference of a random start (a rule for this test)"


@pytest.mark.parametrize("changes, refused", [
    ({"rl": {"algorithm": "rloo", "rewards": [{"type": "answer_match"}], "beta": 0.04},
      "model": {"random_init": True}}, _RANDOM_COPY),
    ({"rl": {"algorithm": "rloo", "rewards": [{"type": "answer_match"}], "beta": 0.04},
      "model": {"random_init": True}}, None),
    ({"rl": {"algorithm": "rloo", "rewards": [{"type": "answer_match"}], "cast_lm_head_to_fp32": True}}, None),
    ({"rl": {"algorithm": "rloo", "rewards": [{"type": "answer_match"}]}, "train": {"optimizer": "adamw_8bit"}},
     None),
    ({"preference": {"reference": "copy"}, "model": {"random_init": True}}, _RANDOM_COPY),
    ({"preference": {}}, None)])
def test_fit_proposes_no_layout_the_table_refuses(changes, refused, monkeypatch):
    """estimate-memory's --fit asks the table what FSDP refuses of the recipe (capabilities.sharding_problems, carried
    as spec.unshardable): where an FSDP rule refuses it (here one added for the test: a full fine-tune's copy of a
    random start, which the table refused until FSDP's reference became a copy of the policy's shards), a recipe that
    no single GPU holds gets no FSDP, HSDP or more-GPU proposal, and the recommendation says why in the table's
    words. The same runs without the rule (the table today), an RLOO run with its LM head in fp32 or with 8-bit
    AdamW, and the same size of DPO run get FSDP."""
    from llmtrain import capabilities

    if refused is not None:
        monkeypatch.setattr(capabilities, "RULES", (*capabilities.RULES, capabilities.Rule(
            "fsdp", lambda r, _: capabilities.reference_copy(r) and r.model.random_init, refused)))
    from llmtrain.config import Recipe
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.fit import fit, recommendation
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    fmt = "prompt" if "rl" in changes else "preference"
    recipe = Recipe.model_validate({
        "model": {"name_or_path": "mistral-7b", "dtype": "bfloat16", "kernels": "none", **changes.pop("model", {})},
        "data": {"path": "unread.jsonl", "format": fmt, "max_seq_len": 1024},
        "train": {"micro_batch_size": 1, "mixed_precision": "bf16", **changes.pop("train", {})},
        "output_dir": "unwritten", **changes})
    shape = load_model_shape("mistral-7b")
    spec = spec_from_recipe(recipe, strategy="ddp", num_gpus=8)
    assert (spec.unshardable is None) == (refused is None)
    found = fit(shape, spec)
    strategies = {c.spec.strategy for c in found.candidates}
    if refused is None:
        assert "fsdp" in strategies
        return
    assert refused in spec.unshardable and strategies <= {"ddp"} and found.more_gpus is None
    est = estimate(shape, spec)
    if not est.fits:  # the RL run (the DPO run fits DDP)
        said = " ".join(recommendation(shape, est).split())
        assert "nothing fits 8 x 80 GiB (FSDP, whose shards shrink with more GPUs, is out: " in said
        assert refused in said


def test_fsdps_offload_under_pipeline_stages_is_refused_by_the_launch_and_each_process(mode_recipes):
    """Pipeline stages shard each stage with FSDP2 themselves and never applied the launch's fsdp_offload_params (the
    shards stayed on the GPU while doctor said every setting was followed, audit 3): refused from the launch config
    (llmtrain launch, doctor), from the variables accelerate launch sets (each process) and by the estimate's layout;
    without stages the offload is accelerate's own and passes."""
    from llmtrain.config import load_recipe
    from llmtrain.layout import Layout

    staged = load_recipe(mode_recipes["sft"], LAYOUTS["pp"][2])
    plain = load_recipe(mode_recipes["sft"], [])
    launch = yaml.safe_load((CONFIGS / "cpu_fsdp.yaml").read_text())
    launch["num_processes"] = 4
    launch["fsdp_config"]["fsdp_offload_params"] = True
    env = {"WORLD_SIZE": "4", "ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"}
    for layout in (Layout.from_launch(launch, staged), Layout.from_environment(staged, env),
                   Layout.of_strategy(staged, "fsdp", gpus=4, offload=True)):
        (problem,) = [p for p in capabilities.problems(staged, layout) if "fsdp_offload_params" in p]
        assert "which the stages do not apply" in problem and "Set fsdp_offload_params: false" in problem
    assert not [p for p in capabilities.problems(plain, Layout.from_launch(launch, plain)) if "offload" in p]
    launch["fsdp_config"]["fsdp_offload_params"] = False
    assert not [p for p in capabilities.problems(staged, Layout.from_launch(launch, staged)) if "offload" in p]
