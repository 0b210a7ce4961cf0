"""`llmtrain doctor`: a good tiny recipe passes; broken ones fail or warn on the right row with the right exit code."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import GSM8K, MISTRAL, REPO, needs
from helpers import invoke, write_recipe

from llmtrain.config import load_recipe
from llmtrain.data.checks import check_eos_trained, check_masks
from llmtrain.data.formats import IGNORE
from llmtrain.data.prepare import DataStats
from llmtrain.doctor import check_batch, check_fsdp, check_precision, check_shared_fs, run_doctor


def rows(checks):
    return {name: (status, detail) for name, status, detail in checks}


def stats(examples: int, tokens: int, trained: int, dropped: int = 0, truncated: int = 0) -> DataStats:
    return DataStats(examples=examples, dropped=dropped, truncated=truncated, tokens=tokens, trained_tokens=trained,
                     length_p50=1, length_p90=1, length_p99=1, length_max=1)


# --------------------------------------------------------------------------- pure checks


def test_masks():
    assert rows(check_masks(stats(0, 0, 0, dropped=5), train_on_prompt=False, text=False, max_seq_len=8))[
        "loss mask"][0] == "fail"
    # every token but each example's first is trained although the prompt should be masked
    assert rows(check_masks(stats(2, 20, 18), train_on_prompt=False, text=False, max_seq_len=64))[
        "loss mask"][0] == "warn"
    assert rows(check_masks(stats(2, 20, 18), train_on_prompt=True, text=False, max_seq_len=64))[
        "loss mask"][0] == "pass"
    got = rows(check_masks(stats(2, 20, 6, dropped=1, truncated=1), train_on_prompt=False, text=False,
                           max_seq_len=64))
    assert got["dropped"][0] == "warn" and "Raise data.max_seq_len (now 64)" in got["dropped"][1]
    assert got["truncated"][0] == "warn"
    # pairs dropped for a reason a longer max_seq_len does not mend are not told to raise it
    same = stats(9, 90, 30, dropped=1)
    same.drops = {"chosen equal to rejected": 1}
    said = rows(check_masks(same, train_on_prompt=False, text=False, max_seq_len=64, unit="pairs"))["dropped"][1]
    assert "1 chosen equal to rejected" in said and "max_seq_len" not in said and "Fix or remove the rows" in said
    same.drops["no answer token within data.max_seq_len"] = 1
    assert "Raise data.max_seq_len (now 64)" in rows(check_masks(same, train_on_prompt=False, text=False,
                                                                  max_seq_len=64, unit="pairs"))["dropped"][1]


def test_eos_trained(tiny_tok):
    eos = tiny_tok.eos_token_id
    good = [[IGNORE, IGNORE, 40, eos]] * 3
    assert rows(check_eos_trained(good, tiny_tok))["eos trained"][0] == "pass"
    assert rows(check_eos_trained([[IGNORE, 40, 41]] * 3, tiny_tok))["eos trained"][0] == "fail"
    mixed = rows(check_eos_trained(good + [[IGNORE, 40, 41], [IGNORE, IGNORE, eos]], tiny_tok))
    assert mixed["eos trained"][0] == "warn" and "1 do not" in mixed["eos trained"][1]
    assert mixed["empty replies"][0] == "warn"


def test_launch_checks(tiny_assets, tmp_path):
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path), ["train.mixed_precision=bf16", "output_dir=runs/x"])
    assert rows(check_precision(recipe, {"mixed_precision": "fp16"}))["mixed precision"][0] == "warn"
    assert rows(check_precision(recipe, {"mixed_precision": "bf16"}))["mixed precision"][0] == "pass"
    assert "= 24 examples" in rows(check_batch(recipe, {"num_processes": 6}))["global batch"][1]
    assert rows(check_shared_fs(recipe, {"num_machines": 1}))["shared filesystem"][0] == "pass"
    # relative paths are each node's working directory's: node-local under /tmp, else a warning saying where they
    # resolve (the documented multi-node commands, from a shared home, had failed)
    status, detail = rows(check_shared_fs(recipe, {"num_machines": 2}, cwd=Path("/tmp/w")))["shared filesystem"]
    assert status == "fail" and "output_dir=runs/x (/tmp/w/runs/x)" in detail and "is node-local" in detail
    home = load_recipe(write_recipe(tiny_assets, tmp_path), ["output_dir=runs/x", "data.cache_dir=.cache/d"])
    status, detail = rows(check_shared_fs(home, {"num_machines": 2}, cwd=Path("/home/me")))["shared filesystem"]
    assert status == "warn" and "output_dir=runs/x (/home/me/runs/x from here)" in detail
    assert "launch every node from the same shared folder, or give absolute paths" in detail
    status, _ = rows(check_shared_fs(load_recipe(write_recipe(tiny_assets, tmp_path), ["output_dir=/tmp/run"]),
                                     {"num_machines": 2}, cwd=Path("/home/me")))["shared filesystem"]
    assert status == "fail"
    shared = load_recipe(write_recipe(tiny_assets, tmp_path), ["output_dir=/shared/run", "data.cache_dir=/shared/c"])
    status, detail = rows(check_shared_fs(shared, {"num_machines": 2}))["shared filesystem"]
    assert status == "warn" and "/shared/run" in detail
    assert rows(check_fsdp(recipe, {}, params=7_000_000_000, fits=False))["fsdp"][0] == "fail"
    assert rows(check_fsdp(recipe, {}, params=7_000_000_000, fits=None))["fsdp"][0] == "warn"
    assert rows(check_fsdp(recipe, {"distributed_type": "FSDP"}, params=7_000_000_000, fits=False))["fsdp"][0] == "pass"
    assert rows(check_fsdp(recipe, {}, params=10_000_000, fits=True))["fsdp"][0] == "pass"


# --------------------------------------------------------------------------- whole runs


def test_good_tiny_recipe(tiny_assets, tmp_path):
    checks = run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)), gpu_memory=80)
    assert {s for _, s, _ in checks} <= {"pass", "warn"}, checks
    got = rows(checks)
    assert got["memory"][0] == "pass" and got["eos trained"][0] == "pass" and got["loss mask"][0] == "pass"
    proc = invoke("doctor", str(write_recipe(tiny_assets, tmp_path)))
    assert "output_dir:" not in proc.stdout  # the table alone: the resolved recipe only with --show-recipe
    assert "no GPU here" in proc.stdout or "per GPU estimated" in proc.stdout
    assert "output_dir:" in invoke("doctor", str(write_recipe(tiny_assets, tmp_path)), "--show-recipe").stdout
    # a machine without a GPU is information, not a warning; rows that cannot run are shown as skipped
    no_gpu = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)), gpu_memory=None))
    if no_gpu["memory"][1].startswith("no GPU here"):
        assert no_gpu["memory"][0] == "info" and " per GPU estimated, not checked against a card" in no_gpu["memory"][1]
    broken = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path), [f"model.tokenizer={tmp_path / 'no'}"]),
                             gpu_memory=80))
    assert broken["tokenizer eos/pad"][0] == "fail" and broken["loss mask"] == ("skipped", "needs the tokenizer")


def test_a_model_the_estimate_cannot_shape_gets_one_memory_row(tiny_assets, tmp_path):
    """No "pass --gpu-memory" beside "no estimate" (issue 53, item 11): without an estimate there is nothing to check
    against a card, so the one row says why there is none."""
    from llmtrain.doctor import check_memory

    model = tmp_path / "other-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                   "vocab_size": 128}))
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path), [f"model.name_or_path={model}"])
    checks, est = check_memory(recipe, None, None)
    assert est is None and len(checks) == 1, checks
    (name, status, detail), = checks
    assert (name, status) == ("memory", "warn") and detail.startswith("no estimate: ") and "gpt2" in detail
    assert "--gpu-memory" not in detail


def test_a_4bit_mixture_of_experts_is_told_its_experts_stay_whole(tiny_assets, tmp_path):
    """bitsandbytes quantizes linear layers; a mixture of experts' experts are 3-D parameters it leaves in model.dtype,
    which doctor counts from the config (the run says the same from the loaded model). A dense model gets no row.
    (Qwen/Qwen3-30B-A3B's config: 28,991,029,248 of 30,532,122,624 weights, 54.0 GiB in bf16.)"""
    from llmtrain.doctor import check_experts_quantized

    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
         "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000, "tie_word_embeddings": False}))
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, lora={"r": 4, "dropout": 0.0}),
                         [f"model.name_or_path={model}", "model.quantize=nf4", "model.dtype=bfloat16"])
    (name, status, detail), = check_experts_quantized(recipe)
    experts = 2 * 8 * 3 * 256 * 64  # layers x experts x (gate, up, down) x hidden x moe_intermediate
    # + attention (q, o: 256 x 256; k, v: 128 x 256), router 8 x 256, norms, embeddings and head 1000 x 256 each
    total = experts + 2 * (2 * 256 * 256 + 2 * 128 * 256 + 8 * 256 + 2 * 256 + 2 * 64) + 2 * 1000 * 256 + 256
    assert (name, status) == ("4-bit experts", "warn")
    assert f"leaves in bfloat16: {experts:,} of its {total:,} weights, {experts * 2 / 2**30:.1f} GiB" in detail, detail
    assert "GiB) on every process" in detail  # the recipe alone: one process
    # an FSDP launch of 8 shards each parameter: each process holds an eighth (a new user read 54 GiB a process)
    (_, _, sharded), = check_experts_quantized(recipe, {"distributed_type": "FSDP", "num_processes": 8})
    assert "GiB), 1/8 of it on each process (8 processes: FSDP / HSDP)" in sharded, sharded
    (_, _, ddp), = check_experts_quantized(recipe, {"distributed_type": "MULTI_GPU", "num_processes": 8})
    assert "on every process" in ddp
    dense = load_recipe(write_recipe(tiny_assets, tmp_path, lora={"r": 4}), ["model.quantize=nf4"])
    assert check_experts_quantized(dense) == []


def test_nothing_trained_fails(tiny_assets, tmp_path):
    # prompts of ~16 tokens cut at 8: no completion token is left in any example
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 8})
    assert rows(run_doctor(load_recipe(recipe), gpu_memory=80))["loss mask"][0] == "fail"
    proc = invoke("doctor", str(recipe), check=False)
    assert proc.returncode == 1 and "loss mask" in proc.stdout


def test_a_tokenizer_that_is_not_the_models_fails_its_token_ids_row(tiny_assets, tmp_path):
    """Its ids past the model's embedding had passed every row, and finetune stopped in the embedding's lookup
    (IndexError, a traceback, the run folder made); with model.new_tokens the grown rows hold them."""
    from transformers import AutoTokenizer

    grown = AutoTokenizer.from_pretrained(tiny_assets / "model")
    grown.add_tokens(["reverse"])  # id 104, past the tiny model's 104 rows
    grown.save_pretrained(tmp_path / "grown")
    recipe = write_recipe(tiny_assets, tmp_path, model={"tokenizer": str(tmp_path / "grown")})
    status, detail = rows(run_doctor(load_recipe(recipe), gpu_memory=80))["token ids"]
    assert status == "fail" and detail.startswith(f"model.tokenizer '{tmp_path / 'grown'}' gives the data token ids up "
                                                  "to 104 ('reverse'), and the model"), detail
    assert "has 104 embedding rows" in detail
    assert "token ids" not in rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)), gpu_memory=80))


def test_a_chat_template_that_cannot_render_is_said_once_and_the_data_is_not_read(tiny_assets, tmp_path):
    """The chat template's failure is its own row; the data row, whose every example would fail the same way, says it
    waits on it instead of repeating the paragraph for one row of the data."""
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ raise_exception('no chats here') }}")
    recipe = write_recipe(tiny_assets, tmp_path, data={"chat_template": str(template)})
    got = rows(run_doctor(load_recipe(recipe), gpu_memory=80))
    assert got["chat template"][0] == "fail" and "no chats here" in got["chat template"][1]
    assert got["data"] == ("skipped", "needs a chat template that renders (the chat template row)")
    assert "loss mask" not in got and "eos trained" not in got


def test_empty_completions_warn(tiny_assets, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"reverse ab{i} =", "completion": ""}) + "\n" for i in range(8)))
    got = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path, data={"path": str(data)})), gpu_memory=80))
    assert got["empty replies"][0] == "warn"


def test_precision_mismatch_warns_exit_0(tiny_assets, tmp_path):
    launch = tmp_path / "fp16.yaml"
    launch.write_text("distributed_type: MULTI_GPU\nmixed_precision: fp16\nnum_processes: 2\n")
    proc = invoke("doctor", str(write_recipe(tiny_assets, tmp_path)), "train.mixed_precision=bf16",
                  "--accelerate-config", str(launch), "--gpu-memory", "80")
    line = next(ln for ln in proc.stdout.splitlines() if "mixed precision" in ln)
    assert "warn" in line and proc.returncode == 0


def test_multinode_node_local_output_fails(tiny_assets, tmp_path):
    proc = invoke("doctor", str(write_recipe(tiny_assets, tmp_path)), "output_dir=/tmp/x", "--accelerate-config",
                  str(REPO / "accelerate_configs" / "fsdp_multinode.yaml"), "--gpu-memory", "80", check=False)
    assert proc.returncode == 1
    assert "fail" in next(ln for ln in proc.stdout.splitlines() if "shared filesystem" in ln)


def test_invalid_recipe_exits_2(tiny_assets, tmp_path):
    proc = invoke("doctor", str(write_recipe(tiny_assets, tmp_path)), "train.lr=-1", check=False)
    assert proc.returncode == 2


@needs(MISTRAL)
@needs(GSM8K)
def test_mistral_7b_full_without_fsdp_fails(tmp_path):
    lines = (GSM8K / "train.jsonl").read_text().splitlines()[:16]
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(lines) + "\n")
    recipe = load_recipe(REPO / "recipes" / "mistral7b-full.yaml", [
        f"model.name_or_path={MISTRAL}", f"data.path={tmp_path / 'gsm8k.jsonl'}", "data.name=null",
        "data.eval_split=null", "data.eval_max_examples=null", f"data.cache_dir={tmp_path / 'cache'}"])
    got = rows(run_doctor(recipe, gpu_memory=80))
    assert got["chat template"][0] == "pass" and got["eos trained"][0] == "pass", got
    assert got["tokenizer eos/pad"][0] in ("pass", "warn")
    assert got["fsdp"][0] == "fail" and "accelerate_configs/fsdp.yaml" in got["fsdp"][1]
    assert got["memory"][0] == "fail" and "fsdp" in got["memory"][1].lower()  # the --fit advice



def test_many_passes_over_a_small_data_set_are_warned_by_doctor_and_finetune(tiny_assets, tmp_path):
    """6 rows, max_steps=30: 30 passes at 1 step an epoch, memorised; 10 passes or fewer and epochs asked for are
    not warned (nor online RL's prompts, sampled anew each pass)."""
    from helpers import run_train, write_recipe

    from llmtrain.config import load_recipe
    from llmtrain.data.checks import check_epochs
    from llmtrain.doctor import run_doctor

    data = tmp_path / "six.jsonl"
    six = (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[:6]
    data.write_text("".join(line + "\n" for line in six))
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data), "eval_split": None},
                          train={"max_steps": 30, "warmup_steps": 1})
    r = load_recipe(recipe)
    (name, status, detail), = check_epochs(r, steps_per_epoch=1, examples=6)
    assert (name, status) == ("epochs", "warn")
    assert "train.max_steps=30 is 30 passes over the 6 train examples" in detail
    assert check_epochs(r, steps_per_epoch=3, examples=48) == []  # 10 passes
    assert check_epochs(load_recipe(recipe, ["train.max_steps=null", "train.epochs=30"]), steps_per_epoch=1,
                        examples=6) == []
    found = {n: (st, d) for n, st, d in run_doctor(r, gpu_memory=80)}
    assert found["epochs"][0] == "warn"
    run_train(recipe)  # 4 rows a micro-batch here
    assert "warning (epochs): train.max_steps=30 is 15 passes over the 6 train examples (2 steps an epoch)" in \
        " ".join((tmp_path / "run" / "train.log").read_text().split())


def test_warmup_at_or_past_the_run_length_is_warned_by_doctor_and_finetune(tiny_assets, tmp_path):
    """max_steps=20 with warmup_steps: 20 (a recipe shortened for a smoke test) trains on the ramp alone."""
    from helpers import run_train, write_recipe

    from llmtrain.config import load_recipe
    from llmtrain.data.checks import check_warmup
    from llmtrain.doctor import run_doctor

    assert check_warmup(20, 20)[0][1] == "warn" and "train.warmup_steps=20 is not below the run's 20 steps" in \
        check_warmup(20, 20)[0][2]
    assert check_warmup(2, 20)[0][1] == "pass" and check_warmup(0, 5)[0][1] == "pass"
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 3, "warmup_steps": 5})
    rows = {name: (status, detail) for name, status, detail in run_doctor(load_recipe(recipe), gpu_memory=80)}
    assert rows["schedule"][0] == "warn"
    run_train(recipe)
    assert "warning (schedule): train.warmup_steps=5 is not below the run's 3 steps" in \
        (tmp_path / "run" / "train.log").read_text()


def test_a_tensor_parallel_launch_counts_data_ranks_and_refuses_qlora(tiny_assets, tmp_path):
    """fsdp_tp.yaml (8 processes as 4 shards x 2 TP): the global batch is over 4 data-parallel ranks; LoRA passes, a
    QLoRA recipe (a 4-bit base) fails the tensor-parallelism row, as finetune would refuse it."""
    launch = REPO / "accelerate_configs" / "fsdp_tp.yaml"
    full = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)), accelerate_config=launch, gpu_memory=80))
    assert full["layout"][0] == "pass" and "tensor parallelism" in full["layout"][1]
    assert full["global batch"][1].startswith("4 data-parallel ranks x 4 examples")
    lora = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path, lora={"r": 4})), accelerate_config=launch,
                           gpu_memory=80))
    assert lora["layout"][0] == "pass"
    qlora = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path, lora={"r": 4},
                                                     model={"quantize": "nf4", "dtype": "bfloat16"})),
                            accelerate_config=launch, gpu_memory=80))
    assert qlora["layout"][0] == "fail" and "does not train a 4-bit base" in qlora["layout"][1]
    alone = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)), gpu_memory=80))["layout"]
    assert alone[0] == "pass" and "tensor" not in alone[1]


def test_a_pipelines_stages_count_as_one_data_rank(tiny_assets, tmp_path):
    """cpu_ddp.yaml's 2 processes as 2 pipeline stages read one batch between them: the global batch is 1 data rank's
    (the run's own start-up line says 'x 1 data-parallel rank'); doctor had counted 2 processes, twice the batch. On 4
    processes, 2 pipelines. The layout row names no DDP."""
    from llmtrain.doctor import check_batch

    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, model={"attn_implementation": "auto"},
                                      data={"eval_split": None},
                                      train={"micro_batch_size": 1, "micro_batch_tokens": 64, "grad_accum_steps": 4}),
                         ["parallel.pipeline_parallel=2"])
    launch = {"num_processes": 2, "distributed_type": "MULTI_GPU"}
    assert check_batch(recipe, launch)[0][2].startswith(
        "1 data-parallel rank x 64 tokens (train.micro_batch_tokens) x 4 (train.grad_accum_steps) = 256 tokens")
    assert check_batch(recipe, {**launch, "num_processes": 4})[0][2].startswith("2 data-parallel ranks x 64 tokens")
    launched = rows(run_doctor(recipe, accelerate_config=REPO / "accelerate_configs" / "cpu_ddp.yaml"))
    assert launched["global batch"][1].endswith("= 256 tokens per optimizer step")
    # and no DDP in the layout's words: there is no replica to average over (it had said "DDP + pipeline parallelism")
    assert "on 2 processes: pipeline parallelism (2 stages)" in launched["layout"][1], launched["layout"]


def test_mesh_that_does_not_divide_the_processes_fails_with_an_example_that_fits(tiny_assets):
    """A 2 x 3 HSDP mesh on the 4 processes of cpu_hsdp.yaml: finetune refuses it, and so does doctor now (it
    passed), with flags that fit the launch; the shipped 2 x 2 passes. (The tiny model's local config: a hub id such
    as "x" had each passing layout ask the hub for it, 49 s of retries without a network.)"""
    import yaml

    from llmtrain.doctor import check_layout

    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", [f"model.name_or_path={tiny_assets / 'model'}"])
    launch = yaml.safe_load((REPO / "accelerate_configs" / "cpu_hsdp.yaml").read_text())
    (name, status, detail), = check_layout(recipe, launch)
    assert (name, status) == ("layout", "pass") and detail == "supervised fine-tuning on 4 processes: FSDP / HSDP " \
        "(2 replicas)"
    launch["parallelism_config"]["parallelism_config_dp_shard_size"] = 3
    (name, status, detail), = check_layout(recipe, launch)
    assert (name, status) == ("layout", "fail")
    assert "mesh is 2 x 3 = 6 processes" in detail and "the job has 4 processes" in detail
    assert "for these 4 processes on 1 node: --parallelism_config_dp_shard_size 4" in detail
    launch["num_machines"], launch["num_processes"] = 2, 16
    assert "for these 16 processes on 2 nodes: --parallelism_config_dp_replicate_size 2 " \
           "--parallelism_config_dp_shard_size 8" in check_layout(recipe, launch)[0][2]
    assert check_layout(recipe, {"num_processes": 2})[0][:2] == ("layout", "pass")  # no mesh: DDP


def test_a_max_seq_len_past_the_models_positions_warns(tiny_assets, tmp_path):
    from llmtrain.data.checks import check_context

    assert check_context(1024, 512)[0][:2] == ("context", "warn") and "Lower data.max_seq_len to 512" in \
        check_context(1024, 512)[0][2]
    assert check_context(512, 512)[0][1] == "pass" and check_context(4096, None) == []
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 1024})  # the tiny Llama has 512 positions
    assert ("context", "warn") in [c[:2] for c in run_doctor(load_recipe(recipe))]


def test_an_rl_recipes_global_batch_counts_prompts_and_their_completions():
    recipe = load_recipe(REPO / "recipes" / "llama3-8b-grpo.yaml")
    detail = rows(check_batch(recipe, {}))["global batch"][1]
    assert detail.endswith("= 8 prompts (64 completions) per optimizer step"), detail
    assert "x 8 prompts (train.micro_batch_size)" in detail


@pytest.mark.parametrize("name, unit", [("tiny-dpo.yaml", "pairs"), ("tiny-reward.yaml", "pairs"),
                                        ("tiny-kto.yaml", "examples"), ("tiny-distill.yaml", "prompts")])
def test_the_global_batch_counts_what_the_modes_micro_batch_holds(name, unit):
    """A DPO recipe's global batch had said "2 examples" of what are pairs (2 pairs: 4 sequences): the unit is the
    capability table's, as finetune's start-up line says it."""
    recipe = load_recipe(REPO / "recipes" / name)
    per = recipe.train.micro_batch_size
    assert rows(check_batch(recipe, {}))["global batch"][1].startswith(f"1 process x {per} {unit} ")


def test_one_is_singular_and_the_chat_templates_trained_tokens_are_explained(tmp_path, tiny_tok):
    """doctor said "1 processes", "1 warm-up steps" and "the reply trains as '4</s>'" (issue 53)."""
    from llmtrain.data.checks import check_chat_template, check_warmup

    recipe = load_recipe(REPO / "recipes" / "tiny.yaml")
    assert rows(check_batch(recipe, {}))["global batch"][1].startswith("1 process x 16 examples")
    assert rows(check_warmup(1, 300))["schedule"][1] == "1 warm-up step of 300"
    assert rows(check_warmup(2, 300))["schedule"][1] == "2 warm-up steps of 300"
    chat = load_recipe(REPO / "recipes" / "tiny.yaml", ["data.format=messages"])
    detail = rows(check_chat_template(chat, tiny_tok))["chat template"][1]
    assert detail.startswith("renders; of the chat [user: 'What is 2 + 2?', assistant: '4'], the tokens trained (the "
                             "reply and its end of turn; the prompt is masked) read '4"), detail


def test_an_unreachable_hub_is_found_once_and_said_in_one_row(tmp_path):
    """A recipe of hub ids with the hub out of reach (here: HF_ENDPOINT at a closed local port): doctor asks once,
    says so in its `hub` row and reads the hub ids from the cache only, instead of retrying every file for a
    minute (12 'Retrying' lines and 52 s before)."""
    from helpers import ENV, LLMTRAIN, open_port

    env = {**ENV, "HF_ENDPOINT": f"http://127.0.0.1:{open_port()}", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run([*LLMTRAIN, "doctor", str(REPO / "recipes" / "llama3-8b-grpo.yaml")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Retrying" not in said, said
    hub = said[said.index("│ hub"):said.index("│ tokenizer")]
    assert "warn" in hub and "cannot be reached" in hub and "HF_HUB_OFFLINE=1" in hub


def test_an_eval_batch_many_times_the_training_micro_batch_is_warned(tiny_assets, tmp_path):
    """16 eval examples of 64K against a 64K training budget: evaluation would set the memory peak (the issue's
    llama3-8b-lora case); unset, or within 4x, nothing is said."""
    from llmtrain.data.checks import check_eval_batch

    def recipe(**train):
        return load_recipe(write_recipe(tiny_assets, tmp_path, train={"micro_batch_size": 1, **train}))

    (name, status, detail), = check_eval_batch(recipe(micro_batch_tokens=65536, eval_batch_size=16), [65536],
                                               [60000, 65536])
    assert (name, status) == ("eval batch", "warn")
    assert "16 x 65,536 = 1,048,576 tokens" in detail and "16x the training micro-batch's 65,536" in detail
    assert "or lower it to 1" in detail
    assert check_eval_batch(recipe(micro_batch_tokens=65536), [65536], [65536]) == []  # batched by the budget
    assert check_eval_batch(recipe(micro_batch_tokens=65536, eval_batch_size=4), [65536], [65536]) == []
    (_, _, detail), = check_eval_batch(recipe(micro_batch_size=2, eval_batch_size=64), [100, 500], [400])
    assert "64 x 400 = 25,600 tokens" in detail and "or lower it to 2" in detail


def test_the_context_check_reads_a_hub_ids_built_in_or_cached_config(tmp_path):
    """A shipped 7B recipe names a hub id: max_position_embeddings comes from the config estimate-memory reads (the
    built-in one here, offline, with an empty cache), so a max_seq_len past it warns. Before: the check read a
    local config.json only and said nothing for a hub id."""
    from helpers import ENV, LLMTRAIN, open_port

    from llmtrain.config import ModelConfig, RopeScaling
    from llmtrain.doctor import _max_positions

    assert _max_positions(ModelConfig(name_or_path="meta-llama/Llama-2-7b-hf")) == 4096
    # not Llama 3's 8192: its config's own rope scaling
    assert _max_positions(ModelConfig(name_or_path="meta-llama/Llama-3.1-8B-Instruct")) == 131072
    assert _max_positions(ModelConfig(name_or_path="mistralai/Mistral-7B-Instruct-v0.3")) == 32768
    # the recipe's model.rope_scaling, as the run scales the model (finetune's check takes the loaded model's; the
    # doctor's had warned a recipe that sets the scaling it advises)
    yarn = RopeScaling(rope_type="yarn", factor=4.0)
    assert _max_positions(ModelConfig(name_or_path="meta-llama/Llama-2-7b-hf", rope_scaling=yarn)) == 16384
    env = {**ENV, "HF_ENDPOINT": f"http://127.0.0.1:{open_port()}", "HF_HOME": str(tmp_path / "hf"),
           "COLUMNS": "400"}  # one line a row
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run([*LLMTRAIN, "doctor", str(REPO / "recipes" / "llama7b-lora.yaml"), "data.max_seq_len=8192"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    context = [line for line in proc.stdout.splitlines() if line.startswith("│ context")]
    assert len(context) == 1 and "warn" in context[0], proc.stdout + proc.stderr
    assert "max_position_embeddings=4096" in context[0] and "Lower data.max_seq_len to 4096" in context[0]


def test_a_hub_mixture_of_experts_is_checked_by_its_built_in_config(monkeypatch):
    """With no config to read (offline, nothing cached), the layout row reads a hub id's built-in one: it took heads
    and layers only from there, so the shipped Qwen3-30B-A3B recipe (model.router_aux_loss_coef) failed as "qwen3_moe
    has no experts (a dense MLP)". Now it passes, and lora.dropout is refused naming its 128 experts."""
    from llmtrain.doctor import check_layout
    from llmtrain.errors import LLMTrainError
    from llmtrain.model import modeling

    def offline(cfg):
        raise LLMTrainError("cannot read it offline")

    monkeypatch.setattr(modeling, "load_model_config", offline)
    path = REPO / "recipes" / "qwen3-30b-a3b-lora.yaml"
    (_, status, detail), = check_layout(load_recipe(path), {})
    assert status == "pass", detail
    (_, status, detail), = check_layout(load_recipe(path, ["lora.dropout=0.05"]), {})
    assert status == "fail" and "lora.dropout=0.05: qwen3_moe's MLP is a mixture of 128 experts" in detail


@pytest.mark.parametrize("shipped", ["qwen3-8b-lora.yaml", "qwen3-30b-a3b-lora.yaml", "gpt-oss-20b-lora.yaml"])
def test_a_hub_model_under_tensor_parallelism_is_checked_by_its_built_in_config(monkeypatch, shipped):
    """With no config to read (offline, nothing cached), the layout row read a hub id's built-in config as a bare
    namespace, without the model's tensor-parallel plan: every shipped recipe on fsdp_tp.yaml failed as "qwen3 has
    none" (its plan). Now transformers' config is built from it: the shipped recipes pass on FSDP x TP 2 x 4, and a
    tensor-parallel size that does not divide the model's K/V heads (8) or experts is refused naming them."""
    import yaml

    from llmtrain.doctor import check_layout
    from llmtrain.errors import LLMTrainError
    from llmtrain.model import modeling

    def offline(cfg):
        raise LLMTrainError("cannot read it offline")

    monkeypatch.setattr(modeling, "load_model_config", offline)
    recipe = load_recipe(REPO / "recipes" / shipped)
    launch = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_tp.yaml").read_text())
    (_, status, detail), = check_layout(recipe, launch)
    assert status == "pass" and "tensor parallelism" in detail, detail
    launch["parallelism_config"].update(parallelism_config_tp_size=16, parallelism_config_dp_shard_size=2)
    launch["num_processes"] = 32
    (_, status, detail), = check_layout(recipe, launch)
    assert status == "fail" and "num_key_value_heads (" in detail and "not a multiple of 16" in detail, detail


def test_doctor_checks_a_recipe_as_its_header_launches_it(tiny_assets, tmp_path):
    """Without --accelerate-config, doctor takes the launch config of the recipe's header, as estimate-memory does, and
    says so: llama7b.yaml's FSDP over 8 GPUs (19.2 GiB per GPU of 8, which fits an 80 GB card), where it checked one
    process holding the whole model before (126.2 GiB: a fail), as it still does when given that launch."""
    def rows(*args):
        proc = invoke("doctor", str(REPO / "recipes" / "llama7b.yaml"), "--gpu-memory", "80", *args, check=False)
        said = " ".join(proc.stdout.split())
        return said, {row: said.split(f"│ {row} │ ")[1].split(" ")[0] for row in ("memory", "layout")}

    said, header = rows()
    assert "launch: accelerate_configs/fsdp.yaml, from the recipe's header" in said, said
    assert header == {"memory": "pass", "layout": "pass"} and "(8 x 80 GiB)" in said
    assert "on 8 processes: FSDP" in said
    said, alone = rows("--accelerate-config", "accelerate_configs/single_gpu.yaml")
    assert "from the recipe's header" not in said and alone["memory"] == "fail", said


def test_turning_evaluation_off_keeps_its_other_keys_with_a_warning(tiny_assets, tmp_path):
    """data.eval_split=null turns evaluation off; a recipe's data.eval_max_examples then caps nothing (it had been a
    refusal, so turning eval off took a second key) and its train.eval_every_steps acts on nothing (it had passed
    without a word): the recipe loads, and doctor (and finetune, which runs the same checks) says both in one line."""
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, data={"eval_max_examples": 10},
                                      train={"eval_every_steps": 2}), ["data.eval_split=null"])
    checks = {name: (status, detail) for name, status, detail in run_doctor(recipe, gpu_memory=80)}
    status, detail = checks["no eval"]
    assert status == "warn"
    assert "train.eval_every_steps=2 and data.eval_max_examples=10 have nothing to act on" in " ".join(detail.split())
    one = load_recipe(write_recipe(tiny_assets, tmp_path, train={"eval_every_steps": 2}), ["data.eval_split=null"])
    (detail,) = [d for name, _, d in run_doctor(one, gpu_memory=80) if name == "no eval"]
    assert "train.eval_every_steps=2 has nothing to act on" in " ".join(detail.split())  # (it had said "have")
    assert "no eval" not in {name for name, _, _ in run_doctor(
        load_recipe(write_recipe(tiny_assets, tmp_path)), gpu_memory=80)}  # (write_recipe: no eval keys)


def test_hub_dataset_keys_on_local_files_are_said_unused(tiny_assets, tmp_path):
    """A recipe made for a hub dataset (`name: main`, a `split`) pointed at local files reads every row of them and
    neither key (they had been ignored without a word): one warning names both, and how to quiet it."""
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, data={"name": "main", "split": "test"}))
    checks = {name: (status, detail) for name, status, detail in run_doctor(recipe, gpu_memory=80)}
    status, detail = checks["hub keys"]
    assert status == "warn" and " ".join(detail.split()).startswith(
        "data.path is local files, which have no configurations or splits: every row of them is read, and "
        "data.name=main and data.split=test are not used"), detail
    # the advice, taken as written, quiets it (it had said "Unset data.split", and data.split=null is refused)
    assert "Unset data.name (data.name=null) and set data.split=train, its default" in " ".join(detail.split())
    advised = load_recipe(write_recipe(tiny_assets, tmp_path, data={"name": "main", "split": "test"}),
                          ["data.name=null", "data.split=train"])
    assert "hub keys" not in {name for name, _, _ in run_doctor(advised, gpu_memory=80)}
    assert "hub keys" not in {name for name, _, _ in run_doctor(
        load_recipe(write_recipe(tiny_assets, tmp_path)), gpu_memory=80)}


def test_preference_pairs_rendered_through_a_chat_template_are_checked_as_chats(tiny_tok):
    """doctor had said "not used (data.format=preference, data.chat_template false)" of pairs whose recipe sets
    data.chat_template: true (recipes/mistral7b-dpo.yaml), and rendered no chat: pairs were left out of the formats
    that use a template."""
    from llmtrain.data.checks import check_chat_template

    pairs = load_recipe(REPO / "recipes" / "tiny-reward.yaml", ["data.chat_template=true"])
    detail = rows(check_chat_template(pairs, tiny_tok))["chat template"][1]
    assert detail.startswith("renders; of the chat [user: 'What is 2 + 2?', assistant: '4'], the tokens trained"), \
        detail
    text = load_recipe(REPO / "recipes" / "tiny-reward.yaml", ["data.chat_template=false"])
    assert rows(check_chat_template(text, tiny_tok))["chat template"][1] == \
        "not used (data.format=preference, data.chat_template false)"


def test_the_memory_row_and_the_runs_prediction_price_tensor_parallelism(tmp_path):
    """doctor's memory row on an FSDP x TP launch is estimate-memory's for it, and so is the estimate a run on that
    mesh logs in summary.json (estimate_for_run): both had priced plain FSDP over all 8 GPUs, leaving the launch's
    tp out (Llama-3.1-8B on 24 GiB cards: doctor 22.4 GiB "pass" where estimate-memory said 24.5; audit 10)."""
    from types import SimpleNamespace

    import torch

    from llmtrain.doctor import check_memory
    from llmtrain.memory import estimate_for_run, estimate_run
    from llmtrain.memory.params import recipe_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    repo = REPO
    recipe = load_recipe(repo / "recipes" / "llama7b.yaml", ["model.name_or_path=meta-llama/Llama-3.1-8B"])
    shape = recipe_model_shape(recipe)
    as_launched = estimate_run(shape, spec_from_recipe(recipe, strategy="fsdp", num_gpus=8, tp=2, gpu_memory_gib=24))
    plain = estimate_run(shape, spec_from_recipe(recipe, strategy="fsdp", num_gpus=8, gpu_memory_gib=24))
    assert as_launched.per_gpu_peak_bytes > 24 * 2**30 > plain.per_gpu_peak_bytes  # the two sides of the card
    rows, est = check_memory(recipe, repo / "accelerate_configs" / "fsdp_tp.yaml", 24.0)
    assert est.per_gpu_peak_bytes == as_launched.per_gpu_peak_bytes
    assert [status for name, status, _ in rows if name == "memory"] == ["fail"], rows
    mesh = SimpleNamespace(dp_replicate_size=1, tp_size=2)
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name="FSDP"), num_processes=8,
                                  parallelism_config=mesh, device=torch.device("cpu"), print=print,
                                  state=SimpleNamespace(fsdp_plugin=SimpleNamespace(cpu_offload=None)))
    assert estimate_for_run(recipe, accelerator).per_gpu_peak_bytes == as_launched.per_gpu_peak_bytes


def test_a_reward_models_data_rows_say_where_each_answer_is_scored(tiny_assets, tmp_path):
    """A reward model trains no token's label (each answer is scored at its last token): doctor and the start-up
    line had said "29.6% of tokens trained", a fraction of masks its loss never reads."""
    data = {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference", "max_seq_len": 32,
            "cache_dir": str(tmp_path / "cache")}
    found = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path, data=data, reward_model={}))))
    assert found["data"][0] == "pass" and "pairs, each answer scored at its last token, " in found["data"][1]
    assert found["loss mask"] == ("pass", "each answer scored at its last token: no token's label is trained")
    assert not any("of tokens trained" in detail for _, detail in found.values())
    dpo = rows(run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path, data=data, preference={}))))
    assert "% of tokens trained" in dpo["data"][1] and "scored" not in dpo["data"][1]  # DPO trains the answers


def test_what_finetune_refuses_of_the_eval_file_or_the_weights_fails_doctor_too(tiny_assets, tmp_path):
    """A missing or malformed data.eval_split file passed doctor (the train split alone prepared, and a "no eval"
    warning told the user to give an eval split), and a model folder with a config.json and no weights passed every
    row: finetune refuses both. doctor fails them with finetune's words."""
    import shutil

    recipe = write_recipe(tiny_assets, tmp_path, data={"eval_split": str(tmp_path / "absent.jsonl"),
                                                       "cache_dir": str(tmp_path / "cache")})
    found = rows(run_doctor(load_recipe(recipe)))
    assert found["data"] == ("fail", f"data file '{tmp_path / 'absent.jsonl'}' does not exist (data.eval_split). "
                                     "Check the path.") and "no eval" not in found
    (tmp_path / "bad_eval.jsonl").write_text('{"question": "a"}\n')
    found = rows(run_doctor(load_recipe(recipe, [f"data.eval_split={tmp_path / 'bad_eval.jsonl'}"])))
    assert found["data"][0] == "fail" and "have columns ['question']" in found["data"][1]
    bare = tmp_path / "noweights"
    bare.mkdir()
    for f in (tiny_assets / "model").glob("*.json"):
        shutil.copy(f, bare)
    found = rows(run_doctor(load_recipe(recipe, [f"model.name_or_path={bare}", "data.eval_split=null"])))
    assert found["model weights"][0] == "fail" and "has a config.json but no weights" in found["model weights"][1]
    assert "model weights" not in rows(run_doctor(load_recipe(recipe, ["data.eval_split=null"])))


def test_empty_replies_are_counted_over_every_row(tiny_assets, tmp_path):
    """Five rows with an empty completion after row 200 went unsaid (the stop-token check reads the first 200 rows):
    the preparation counts the rows that train one token alone, over every row, wherever they are."""
    good = [json.loads(x) for x in (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[:200]]
    data = tmp_path / "late_empty.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in good + [{"prompt": "reverse ab =", "completion": ""}] * 5))
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data), "eval_split": None,
                                                       "cache_dir": str(tmp_path / "cache")})
    found = rows(run_doctor(load_recipe(recipe)))
    assert found["empty replies"] == ("warn", "5 of 205 examples train only the stop token: their completion is "
                                              "empty. Check data.fields.")
    data.write_text("".join(json.dumps(r) + "\n" for r in good))
    assert "empty replies" not in rows(run_doctor(load_recipe(recipe)))


def test_an_eval_split_that_is_the_training_data_is_said(tiny_assets, tmp_path):
    """data.eval_split naming data.path's own file (or the split data.split trains on) trained on every eval row
    without a word: the eval loss measured memorisation."""
    from llmtrain.data.checks import check_eval_overlap

    train = tiny_assets / "data" / "train.jsonl"
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(train), "eval_split": str(train)})
    [(name, status, detail)] = check_eval_overlap(load_recipe(recipe))
    assert (name, status) == ("eval overlap", "warn") and f"names the file {train}, which data.path trains on" in detail
    assert check_eval_overlap(load_recipe(recipe, [f"data.eval_split={tiny_assets / 'data' / 'eval.jsonl'}"])) == []
    assert check_eval_overlap(load_recipe(recipe, ["data.eval_split=0.1"])) == []
    folder = load_recipe(recipe, [f"data.path={tiny_assets / 'data'}", "data.split=test", "data.eval_split=test"])
    assert "the split 'test' data.split trains on" in check_eval_overlap(folder)[0][2]


def test_doctor_checks_output_dir_and_a_layout_that_needs_a_launch(tiny_assets, tmp_path):
    """output_dir a file: finetune and launch refuse it, doctor had no row and passed it; a recipe whose layout needs
    several processes, checked without --accelerate-config: the one process finetune starts refuses it, and the
    layout row had passed (audit 34)."""
    from llmtrain.config import load_recipe
    from llmtrain.doctor import run_doctor

    (tmp_path / "a-file").write_text("x")
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path), [
        f"output_dir={tmp_path / 'a-file'}", "parallel.sequence_parallel=2", "model.attn_implementation=auto"])
    got = {name: (status, detail) for name, status, detail in run_doctor(recipe, gpu_memory=80)}
    assert got["output_dir"][0] == "fail" and "is a file" in got["output_dir"][1]
    assert got["layout"][0] == "warn" and "pass the launch's config with --accelerate-config" in got["layout"][1]
    fine = {name: status for name, status, _ in run_doctor(load_recipe(write_recipe(tiny_assets, tmp_path)),
                                                           gpu_memory=80)}
    assert fine["output_dir"] == "pass" and fine["layout"] == "pass"


def test_a_failure_several_rows_find_alike_is_said_once(tiny_assets, tmp_path):
    """An rl.environment that does not import failed the data, the rewards and the tools rows in the same words:
    three copies of one paragraph (audit 36). The first row says it; the others are skipped, naming it."""
    import yaml

    from llmtrain.doctor import run_doctor

    recipe = yaml.safe_load((REPO / "recipes" / "tiny-tools-grpo.yaml").read_text())
    recipe["model"]["name_or_path"] = str(tiny_assets / "model")
    recipe["data"].update(path=str(tiny_assets / "data" / "train_tool_prompts.jsonl"),
                          eval_split=str(tiny_assets / "data" / "eval_tool_prompts.jsonl"),
                          chat_template=str(tiny_assets / "data" / "tools.jinja"))  # not the clone's assets/tiny
    recipe["output_dir"] = str(tmp_path / "run")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    checks = run_doctor(load_recipe(tmp_path / "r.yaml", ["rl.environment=no_such_module_z:Env"]), gpu_memory=80)
    failing = [(name, detail) for name, status, detail in checks if status == "fail"]
    assert sum("no_such_module_z" in detail for _, detail in failing) == 1, failing
    first = next(name for name, detail in failing if "no_such_module_z" in detail)
    assert any(status == "skipped" and detail == f"fails as the {first} row says" for _, status, detail in checks)


def test_the_eval_generations_keys_without_eval_data_are_said_unused(tiny_assets, tmp_path):
    """train.eval_samples, eval_batch_size and eval_max_new_tokens act on the eval set alone: without one they had
    passed without a word, and the run wrote no samples.jsonl (audit 47)."""
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, train={"eval_every_steps": 2, "eval_samples": 4,
                                                                    "eval_max_new_tokens": 5, "eval_batch_size": 2}),
                         ["data.eval_split=null"])
    (detail,) = [d for name, _, d in run_doctor(recipe, gpu_memory=80) if name == "no eval"]
    assert "train.eval_every_steps=2, train.eval_batch_size=2, train.eval_samples=4 and train.eval_max_new_tokens=5 " \
        "have nothing to act on" in " ".join(detail.split()), detail


def test_a_rate_setting_nothing_reads_is_said(tiny_assets, tmp_path):
    """train.min_lr_ratio with a constant schedule and lora.lr_embedding without lora.lr_ratio had been accepted
    without a word (audit 47). Said, not refused: a run's recipe.yaml spells every key out, and a run of before must
    stay readable by generate, eval and --resume."""
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path), ["train.schedule=constant", "train.min_lr_ratio=0.5",
                                                                "lora.r=4", "lora.lr_embedding=1e-3"])
    (detail,) = [d for name, _, d in run_doctor(recipe, gpu_memory=80) if name == "unread"]
    flat = " ".join(detail.split())
    assert "train.min_lr_ratio=0.5 is where the linear and cosine schedules end" in flat
    assert "lora.lr_embedding=0.001 is LoRA+'s rate of the embeddings' adapter" in flat
    plain = load_recipe(write_recipe(tiny_assets, tmp_path), ["train.schedule=cosine", "train.min_lr_ratio=0.5"])
    assert "unread" not in {name for name, _, _ in run_doctor(plain, gpu_memory=80)}


def test_doctors_sequence_row_reads_every_layers_key_value_heads(tmp_path):
    """doctor's sequence-parallelism row had split the first layer's K/V heads only, so a model whose global layers
    have K/V heads of their own (Gemma 4's) that a group cannot split passed beside the layout row's failure (audit
    51): no row where the layout row fails, and each layer's split said where they differ."""
    from transformers import AutoConfig

    from llmtrain.doctor import check_layout, check_sequence_parallel
    from llmtrain.tiny import FAMILY_LAYERS

    def gemma4(global_kv: int) -> Path:
        folder = tmp_path / f"gemma4-{global_kv}"
        AutoConfig.for_model("gemma4_text", **{**FAMILY_LAYERS["gemma4_text"], "num_global_key_value_heads": global_kv},
                             vocab_size=104, hidden_size=128, num_attention_heads=12, intermediate_size=256,
                             vocab_size_per_layer_input=104).save_pretrained(folder)
        return folder

    launch = {"num_processes": 4}
    for global_kv, want in ((3, []), (2, "3 of the 12 query heads and 1 K/V head(s) or 1 K/V head (each of 2 repeated "
                                          "2 times) (by layer)")):
        recipe = load_recipe(REPO / "recipes" / "tiny.yaml", [f"model.name_or_path={gemma4(global_kv)}",
                                                              "parallel.sequence_parallel=4"])
        rows = check_sequence_parallel(recipe, launch)
        if want == []:
            assert rows == [] and check_layout(recipe, launch)[0][1] == "fail"
        else:
            (name, status, detail), = rows
            assert status == "pass" and want in detail, detail


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on CUDA it can run (kernels fetches it)")
def test_doctor_fails_flash_attention_2_where_it_cannot_run():
    """model.attn_implementation=flash_attention_2 without flash-attn or CUDA passed doctor, and the run ended in
    transformers' ImportError (audit 49): a `run needs` fail, in launch's words; auto passes."""
    from llmtrain.launcher import needs_problems

    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", ["model.attn_implementation=flash_attention_2"])
    said = needs_problems(recipe, {}, user_code=False)
    assert any(p.startswith("model.attn_implementation=flash_attention_2 needs the flash-attn package (or kernels, "
                            "which fetches it from the hub) and a CUDA device") for p in said), said
    assert needs_problems(load_recipe(REPO / "recipes" / "tiny.yaml"), {}, user_code=False) == []


def test_what_finetune_refuses_of_the_model_files_or_output_dir_fails_doctor_too(tiny_assets, tmp_path):
    """Audit 53: doctor passed (or only warned of) what finetune refuses whatever its flags: a truncated weights file
    (an interrupted copy: safetensors reads its header alone), a config that needs the model's own code, an output_dir
    under a file, the recipe file inside a run folder that starting again empties; and it advised --resume auto for
    a finished run that kept no checkpoint, which finetune then refused."""
    import shutil

    from llmtrain.model.modeling import weights_problem

    recipe = write_recipe(tiny_assets, tmp_path, data={"eval_split": None, "cache_dir": str(tmp_path / "cache")})
    cut = tmp_path / "cut"
    shutil.copytree(tiny_assets / "model", cut)
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:5000])
    assert weights_problem(str(tiny_assets / "model")) is None
    stale = tmp_path / "stale-index"  # one model.safetensors beside an index: transformers reads the file alone
    shutil.copytree(tiny_assets / "model", stale)
    (stale / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    assert weights_problem(str(stale)) is None
    found = rows(run_doctor(load_recipe(recipe, [f"model.name_or_path={cut}"])))
    assert found["model weights"][0] == "fail" and "(model.safetensors: SafetensorError" in found["model weights"][1]
    assert "a weights file is truncated or damaged" in found["model weights"][1]
    own = tmp_path / "own-code"
    shutil.copytree(tiny_assets / "model", own)
    config = json.loads((own / "config.json").read_text())
    (own / "config.json").write_text(json.dumps({**config, "model_type": "mymodel", "auto_map": {
        "AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModelForCausalLM"}}))
    found = rows(run_doctor(load_recipe(recipe, [f"model.name_or_path={own}"])))
    assert found["model"][0] == "fail" and "set model.trust_remote_code: true" in found["model"][1]

    (tmp_path / "a-file").write_text("x")
    found = rows(run_doctor(load_recipe(recipe, [f"output_dir={tmp_path / 'a-file' / 'run'}"])))
    assert found["output_dir"][0] == "fail" and "is a file, not a folder" in found["output_dir"][1]
    failed = tmp_path / "failed-start"  # a start that ended before its first checkpoint: finetune starts it again
    failed.mkdir()
    (failed / ".llmtrain-run").write_text("This folder is an llmtrain run.\n")
    inside = failed / "my.yaml"
    shutil.copy(recipe, inside)
    checks = run_doctor(load_recipe(inside, [f"output_dir={failed}"]), recipe_file=inside)
    assert rows(checks)["output_dir"][0] == "fail" and "lies inside output_dir" in rows(checks)["output_dir"][1]
    finished = tmp_path / "finished"
    (finished / "final").mkdir(parents=True)
    (finished / ".llmtrain-run").write_text("This folder is an llmtrain run.\n")
    (finished / "summary.json").write_text("{}")
    found = rows(run_doctor(load_recipe(recipe, [f"output_dir={finished}"])))
    assert found["output_dir"][0] == "warn" and "kept no checkpoint, so --resume auto has nothing to continue from" \
        in found["output_dir"][1]


def test_doctor_renders_the_system_prompt_and_gives_reward_functions_the_runs_step_count(tiny_assets, tmp_path,
                                                                                       monkeypatch):
    """Two doctor fails of what finetune trains (audit 53): a chat template that requires a system turn, with
    data.system_prompt set (the probe chat had none), and a reward function that divides by trainer_state.max_steps
    where train.max_steps is unset (doctor gave it 0; the run counts its epochs' steps)."""
    from llmtrain.data.checks import check_chat_template
    from llmtrain.doctor import check_rewards_run
    from llmtrain.model.modeling import load_tokenizer

    template = tmp_path / "system.jinja"
    template.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversations must start with a "
                        "system message') }}{% endif %}{{ bos_token }}{% for m in messages %}<|{{ m['role'] | upper "
                        "}}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor "
                        "%}{% if add_generation_prompt %}<|ASSISTANT|>{% endif %}")
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path), [f"data.chat_template={template}"])
    tokenizer = load_tokenizer(recipe.model)
    [(_, status, detail)] = check_chat_template(recipe, tokenizer)
    assert status == "fail" and "must start with a system message" in detail
    with_system = load_recipe(write_recipe(tiny_assets, tmp_path), [f"data.chat_template={template}",
                                                                    "data.system_prompt=You reverse strings."])
    [(_, status, detail)] = check_chat_template(with_system, tokenizer)
    assert status == "pass" and detail.endswith("read '4</s>'"), detail

    (tmp_path / "curriculum.py").write_text(
        "def scheduled(completions, trainer_state, **kwargs):\n"
        "    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rl = load_recipe(REPO / "recipes" / "tiny-grpo.yaml", [
        f"model.name_or_path={tiny_assets / 'model'}", f"data.path={tiny_assets / 'data' / 'train.jsonl'}",
        "data.eval_split=null", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=null",
        "rl.rewards=[{type: function, function: 'curriculum:scheduled'}]"])
    assert check_rewards_run(rl, tokenizer) == [("rewards", "pass", "scheduled import and score the first rows")]


def test_an_environment_whose_reset_needs_a_column_the_data_lack_fails_doctor_as_the_run_refuses_it(
        tiny_assets, tmp_path, monkeypatch):
    """rl.environment's reset(term, ...) with no column 'term' in the prompts: finetune refuses it before writing
    anything, doctor's tools row had passed it (audit 53)."""
    import yaml

    from llmtrain.doctor import check_tools
    from llmtrain.model.modeling import load_tokenizer

    (tmp_path / "books.py").write_text(
        "class Book:\n"
        "    def reset(self, term, prompt=None, **columns):\n"
        "        self.word = term\n\n"
        "    def lookup(self) -> str:\n"
        '        """Look up the code of the word in question."""\n'
        "        return self.word\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-tools-grpo.yaml").read_text())
    recipe["model"]["name_or_path"] = str(tiny_assets / "model")
    recipe["data"].update(path=str(tiny_assets / "data" / "train_tool_prompts.jsonl"), eval_split=None,
                          chat_template=str(tiny_assets / "data" / "tools.jinja"), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    shipped = load_recipe(tmp_path / "r.yaml")
    tokenizer = load_tokenizer(shipped.model)
    assert [status for _, status, _ in check_tools(shipped, tokenizer)] == ["pass"]
    [(_, status, detail)] = check_tools(load_recipe(tmp_path / "r.yaml", ["rl.environment=books:Book"]), tokenizer)
    assert status == "fail" and detail.startswith("rl.environment books:Book's reset needs the argument 'term', "
                                                  "which nothing passes"), detail


def test_a_gpu_launch_this_machine_cannot_run_is_a_warn(monkeypatch):
    """`llmtrain launch` refuses a launch of more processes, one a GPU, than this machine has GPUs; doctor had passed
    it (audit 53). A warn: doctor may check the recipe away from the machine that runs it."""
    import torch
    import yaml

    from llmtrain.doctor import check_launch_settings

    path = REPO / "accelerate_configs" / "ddp.yaml"
    launch = yaml.safe_load(path.read_text())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    got = check_launch_settings(launch, path)
    assert [(n, s) for n, s, _ in got] == [("launch settings", "pass"), ("GPUs here", "warn")]
    assert "starts 8 processes on this machine, one a GPU" in got[1][2] and "no GPU" in got[1][2]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert [n for n, _, _ in check_launch_settings(launch, path)] == ["launch settings"]
    cpu = REPO / "accelerate_configs" / "cpu_ddp.yaml"
    assert [n for n, _, _ in check_launch_settings(yaml.safe_load(cpu.read_text()), cpu)] == ["launch settings"]
