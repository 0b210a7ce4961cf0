"""train.optimizer=adamw_8bit: bitsandbytes' 8-bit AdamW (its CPU kernels run here): it trains as AdamW does,
resumes bit for bit, its state is what the estimate counts; under FSDP, HSDP and FSDP x TP each process updates its
shard (one process's update where the shards hold whole blocks) and resumes on the same shards."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import (
    ENV,
    REPO,
    cli,
    crash_at_step,
    launch_finetune,
    load_weights,
    losses,
    max_abs_diff,
    open_port,
    records,
    run_train,
    write_recipe,
)

from llmtrain.config import load_recipe

pytest.importorskip("bitsandbytes")


def _recipe(tiny_assets, tmp_path, **train):
    return write_recipe(tiny_assets, tmp_path, train={"max_steps": 6, "micro_batch_size": 8, "lr": 3e-3,
                                                      "warmup_steps": 0, "seed": 7, **train},
                        checkpoint={"every_steps": 3}, logging={"every_steps": 1, "progress": False, "plot": False})


@pytest.mark.slow
def test_it_trains_as_adamw_does_and_resumes_bit_for_bit(tiny_assets, tmp_path, monkeypatch):
    """Six steps of the tiny full fine-tune: the 8-bit moments follow fp32 AdamW's losses to within 1% (the first
    step exactly: both start from zero moments, and Adam's first update is lr x sign-like g / |g|); a run killed in
    step 5 and resumed from the step-3 checkpoint ends with the uninterrupted run's losses and weights, bit for bit
    (the quantised moments and their absmax are saved and restored as they were)."""
    recipe = _recipe(tiny_assets, tmp_path, optimizer="adamw_8bit")
    run_train(recipe, f"output_dir={tmp_path / 'straight'}")
    run_train(recipe, f"output_dir={tmp_path / 'fp32'}", "train.optimizer=adamw")
    eight, fp32 = [r["loss"] for r in records(tmp_path / "straight")], [r["loss"] for r in records(tmp_path / "fp32")]
    assert eight[0] == fp32[0] and eight[-1] < eight[0] - 0.5
    assert eight == pytest.approx(fp32, rel=1e-2) and eight != fp32  # close, and not the same optimizer
    state = torch.load(tmp_path / "straight" / "checkpoints" / "step_000006" / "optimizer.bin", weights_only=False)
    moments = [s["__bnb_optimizer_quant_state__"] for s in state["state"].values()]  # bitsandbytes' saved layout
    embedding = 104 * 128  # the tiny model's vocabulary x hidden: its moments in 32 bits, as HF's adamw_bnb_8bit
    assert {q[k].dtype for q in moments for k in ("state1", "state2") if q[k].numel() >= 4096} == {torch.uint8,
                                                                                                    torch.float32}
    assert [q["state1"].numel() for q in moments if q["state1"].numel() >= 4096 and q["state1"].dtype ==
            torch.float32] == [embedding]
    assert {q["state1"].dtype for q in moments if q["state1"].numel() < 4096} == {torch.float32}  # the norms
    crash_at_step(monkeypatch, recipe, 5, f"output_dir={tmp_path / 'cut'}")
    run_train(recipe, f"output_dir={tmp_path / 'cut'}", resume="auto")
    assert [r["loss"] for r in records(tmp_path / "cut")] == eight
    assert max_abs_diff(load_weights(tmp_path / "cut" / "final"), load_weights(tmp_path / "straight" / "final")) == 0


def test_its_state_is_what_the_estimate_counts(tiny_assets, tmp_path):
    """The bytes of bitsandbytes' state after a step (two uint8 moments and their fp32 absmax per block of 256) against
    memory.states.optimizer_bytes for the same parameters: equal where a tensor holds 4,096 elements or more (below,
    bitsandbytes keeps 32-bit moments: the tiny model's norms, 0.3% of its state), the embedding's 32-bit moments 8
    bytes a parameter (embedding_state_bytes), and the estimate's optimizer row of the tiny recipe the whole state.
    On Mistral-7B the state is about a quarter of fp32 AdamW's."""
    from transformers import AutoModelForCausalLM

    from llmtrain.memory import estimate_for_recipe
    from llmtrain.memory.states import ADAMW_8BIT_BYTES_PER_PARAM, optimizer_bytes
    from llmtrain.model.modeling import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets / "model"), dtype=torch.float32)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=False,
                                kind="adamw_8bit")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()

    def state_bytes(params):
        return sum(t.numel() * t.element_size() for p in params for k, t in optimizer.state[p].items()
                   if k in ("state1", "state2", "absmax1", "absmax2"))

    embedding = model.get_input_embeddings().weight
    big = [p for p in model.parameters() if p.numel() >= 4096 and p is not embedding]
    counted = optimizer_bytes(sum(p.numel() * 4 for p in big), "adamw_8bit", param_bytes=4)
    assert state_bytes(big) == pytest.approx(counted, rel=2e-3)
    assert state_bytes([embedding]) == 8 * embedding.numel()
    everything = state_bytes(list(model.parameters()))
    recipe = load_recipe(_recipe(tiny_assets, tmp_path, optimizer="adamw_8bit"))
    assert estimate_for_recipe(recipe).breakdown["optimizer"] == pytest.approx(everything, rel=1e-2)
    assert everything - 8 * embedding.numel() == pytest.approx(
        optimizer_bytes(4 * (sum(p.numel() for p in model.parameters()) - embedding.numel()), "adamw_8bit"), rel=1e-2)
    assert optimizer_bytes(4 * 10**9, "adamw_8bit") / optimizer_bytes(4 * 10**9) == pytest.approx(0.254, abs=1e-3)
    assert ADAMW_8BIT_BYTES_PER_PARAM < 8


def test_it_keeps_an_embeddings_moments_in_32_bits_and_steps_as_hf_trainers_adamw_bnb_8bit(tiny_assets, tmp_path):
    """HF Trainer's optim=adamw_bnb_8bit (what config.py names as its counterpart) registers 32-bit moments for every
    nn.Embedding with bitsandbytes, as peft's LoRA+ optimizer does; llmtrain's had quantised the embedding's too (a
    10-step full fine-tune 1.3e-3 from HF's in the weights; audit 43). Five steps of the same gradients: the same
    state dtypes and the same weights, to the bit."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from llmtrain.model.modeling import build_optimizer

    ours, theirs = (AutoModelForCausalLM.from_pretrained(str(tiny_assets / "model"), dtype=torch.float32)
                    for _ in range(2))
    mine = build_optimizer(ours, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=False,
                           kind="adamw_8bit")
    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_bnb_8bit", learning_rate=1e-3, weight_decay=0.0,
                             adam_epsilon=1e-8, use_cpu=True, report_to=[])
    hf = Trainer(model=theirs, args=args).create_optimizer()
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(5):
            for p, q in zip(ours.parameters(), theirs.parameters()):
                p.grad = torch.randn(p.shape, generator=generator)
                q.grad = p.grad.clone()
            mine.step()
            hf.step()
    finally:  # HF's registrations live in bitsandbytes' process-wide manager, by parameter id: a later optimizer's
        # parameter at a reused id would take them (llmtrain's own optimizer registers nothing there)
        bnb.optim.GlobalOptimManager.get_instance().initialize()
    embedding = ours.get_input_embeddings().weight
    assert mine.state[embedding]["state1"].dtype == hf.state[theirs.get_input_embeddings().weight]["state1"].dtype \
        == torch.float32
    assert {mine.state[p]["state1"].dtype for p in ours.parameters() if p.numel() >= 4096 and p is not embedding} \
        == {torch.uint8}
    assert max_abs_diff(dict(ours.named_parameters()), dict(theirs.named_parameters())) == 0.0


def test_a_tied_heads_copy_on_a_stage_keeps_32_bit_moments_as_the_embedding_does(tiny_assets):
    """A pipeline's last stage holds a tied head as a copy of its own (a Linear): its moments must be the first
    stage's embedding's kind, or the two copies, summed gradients and all, would be updated apart."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model.modeling import embedding_ids

    config = AutoConfig.from_pretrained(str(tiny_assets / "model"), tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    assert set(embedding_ids(model)) == {id(model.model.embed_tokens.weight)}  # one tensor, the head's too
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # a stage's copy
    assert set(embedding_ids(model)) == {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    untied = AutoModelForCausalLM.from_pretrained(str(tiny_assets / "model"))
    assert embedding_ids(untied) == [id(untied.model.embed_tokens.weight)]


P, E = 7_248_023_552, 32_768 * 4_096  # Mistral-7B's parameters, its embedding's (32-bit moments: 8 bytes each)
EIGHT = (P - E) * 2 * (1 + 4 / 256) + E * 8


@pytest.mark.parametrize("dtype, ratio", [("float32", EIGHT / (8 * P)), ("bfloat16", EIGHT / (4 * P))])
def test_the_estimate_counts_a_quarter_of_fp32_adamws_state(tmp_path, dtype, ratio):
    """recipes/mistral7b-full.yaml on one GPU: the optimizer row against AdamW's, whose moments are in the weights'
    dtype (8 bytes a parameter in fp32, 4 in bf16: 54.0 and 27.0 GiB; 8-bit 14.5 either way, 0.75 of it the
    embedding's 32-bit moments); the rest unchanged."""
    from llmtrain.memory import estimate_for_recipe

    path = tmp_path / "r.yaml"
    path.write_text((REPO / "recipes" / "mistral7b-full.yaml").read_text())
    plain = estimate_for_recipe(load_recipe(path, [f"model.dtype={dtype}"]))
    eight = estimate_for_recipe(load_recipe(path, [f"model.dtype={dtype}", "train.optimizer=adamw_8bit"]))
    assert eight.breakdown["optimizer"] / plain.breakdown["optimizer"] == pytest.approx(ratio, rel=1e-6)
    assert eight.breakdown["optimizer"] / 2**30 == pytest.approx(14.46, abs=0.01)
    assert eight.breakdown["weights"] == plain.breakdown["weights"]
    assert eight.per_gpu_peak_bytes < plain.per_gpu_peak_bytes


def test_every_layout_takes_it(tiny_assets, tmp_path):
    """doctor's layout row: FSDP, HSDP, FSDP x TP and pipeline stages under FSDP or DDP pass (each refused before
    2026-12-05: 'bitsandbytes' 8-bit AdamW updates plain tensors')."""
    from llmtrain.doctor import check_layout

    recipe = load_recipe(_recipe(tiny_assets, tmp_path, optimizer="adamw_8bit"))
    launches = {c: yaml.safe_load((REPO / "accelerate_configs" / c).read_text())
                for c in ("cpu_fsdp.yaml", "cpu_tp.yaml", "cpu_hsdp.yaml", "cpu_ddp.yaml")}
    for config, launch in launches.items():
        assert check_layout(recipe, launch)[0][1] == "pass", config
    staged = load_recipe(_recipe(tiny_assets, tmp_path, optimizer="adamw_8bit", micro_batch_size=1,
                                 micro_batch_tokens=64, grad_accum_steps=2),
                         ["parallel.pipeline_parallel=2", "model.attn_implementation=auto"])
    for config in ("cpu_fsdp.yaml", "cpu_ddp.yaml"):
        assert check_layout(staged, launches[config])[0][1] == "pass", config


def test_fit_shards_it_under_fsdp(tmp_path):
    """--fit for an 8-bit full fine-tune of Mistral-7B on 8 x 80 GiB: FSDP is proposed beside DDP (it had been left
    out: FSDP refused the 8-bit optimizer), its optimizer row the 8-bit state divided by the 8 shards; where nothing
    fits 16 GiB, FSDP on more GPUs is the way out, and the advice for fp32 AdamW under FSDP names 8-bit AdamW."""
    from llmtrain.memory import estimate_run
    from llmtrain.memory import fit as fitting
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec
    from llmtrain.memory.states import optimizer_bytes

    shape = load_model_shape("mistral-7b")
    spec = TrainSpec(method="full", dtype="bfloat16", mixed_precision="bf16", strategy="ddp", num_gpus=8,
                     optimizer="adamw_8bit", gpu_memory_gib=80.0)
    result = fitting.fit(shape, spec)
    assert {"ddp", "fsdp"} <= {c.spec.strategy for c in result.candidates}
    sharded = estimate_run(shape, spec.but(strategy="fsdp"))
    embedding = shape.params_embed  # its moments in 32 bits: 8 bytes a parameter
    assert sharded.breakdown["optimizer"] == pytest.approx(
        (optimizer_bytes((shape.params_total - embedding) * 4, "adamw_8bit") + 8 * embedding) / 8, rel=1e-3)
    assert fitting.more_gpus(shape, spec.but(gpu_memory_gib=16.0)) is not None
    fp32 = spec.but(optimizer="adamw", strategy="fsdp", gpu_memory_gib=16.0, num_gpus=2)
    assert "8-bit AdamW (train.optimizer=adamw_8bit / --optimizer adamw_8bit)" in fitting.overflow_advice(
        estimate_run(shape, fp32))


def test_fit_turns_to_it_before_more_gpus():
    """recipes/mistral7b-full.yaml (fp32 AdamW) on 4 x 32 GiB: nothing fits (FSDP 35.4 GiB a GPU), and --fit had
    proposed FSDP on 8 GPUs; now, as LoRA turns to QLoRA, the full fine-tune turns to 8-bit AdamW on these 4 (24.0
    GiB at micro-batch 8) and says so; the recommendation line names the override."""
    from helpers import estimate_memory

    recipe = str(REPO / "recipes" / "mistral7b-full.yaml")
    fit = " ".join(estimate_memory(recipe, "--num-gpus", "4", "--gpu-memory", "32", "--fit").stdout.split())
    assert "--fit: AdamW's state fits none of these GPUs; bitsandbytes' 8-bit AdamW (a quarter of its state) does " \
        "(train.optimizer=adamw_8bit)" in fit
    assert "llmtrain launch --config_file accelerate_configs/fsdp.yaml --num_processes 4" in fit and \
        "train.optimizer=adamw_8bit" in fit.split("llmtrain launch")[-1]
    said = estimate_memory(recipe, "--num-gpus", "4", "--gpu-memory", "32", "--strategy", "fsdp", check=False)
    line = " ".join(said.stdout.split())
    assert "does not fit: needs 35.4 GiB per GPU of 32; on 4 x 32 GiB use --config_file accelerate_configs/fsdp.yaml" \
        in line and "train.optimizer=adamw_8bit (see --fit)" in line


def test_an_estimate_from_flags_shards_it_under_fsdp_and_on_fsdp_stages():
    """`estimate-memory --model ... --optimizer adamw_8bit --strategy fsdp` is estimated (exit 2 before 2026-12-05):
    its optimizer row the DDP one's over the 8 GPUs; with --pipeline-parallel 2 a stage's over its 4 FSDP shards."""
    from helpers import estimate_memory

    flags = ("--model", "mistral-7b", "--method", "full", "--optimizer", "adamw_8bit", "--num-gpus", "8")
    sharded = json.loads(estimate_memory(*flags, "--strategy", "fsdp", "--json").stdout)
    whole = json.loads(estimate_memory(*flags, "--strategy", "ddp", "--json").stdout)
    assert sharded["breakdown"]["optimizer"] * 8 == pytest.approx(whole["breakdown"]["optimizer"], rel=1e-6)
    staged = ("--pipeline-parallel", "2", "--micro-batch-tokens", "4096", "--grad-accum", "2", "--json")
    stages = {s: json.loads(estimate_memory(*flags, "--strategy", s, *staged, check=False).stdout)["breakdown"]
              for s in ("fsdp", "ddp")}  # (DDP stages do not fit 80 GiB: exit 4, estimated)
    assert stages["fsdp"]["optimizer"] * 4 == pytest.approx(stages["ddp"]["optimizer"], rel=1e-6)


def test_whole_blocks_says_which_row_splits_quantise_in_one_process_blocks():
    """A pipeline stage's 8-bit moments resume on another number of FSDP shards where both numbers split the rows
    evenly into whole blocks of 256 (parallel/pipeline/checkpoint.read_stages): every 7B layer over 8, the tiny
    model's 104-row head over 2 (52 x 128 = 26 blocks); not 105 rows (53 / 52), nor 3 rows of 96 (288 elements: a
    block and an eighth). One piece is one process's layout whatever the shape."""
    from llmtrain.model.adamw_8bit import whole_blocks

    assert whole_blocks((4096, 4096), 8) and whole_blocks((14336, 4096), 8) and whole_blocks((104, 128), 2)
    assert whole_blocks((105, 128), 1) and whole_blocks((6, 96), 1)
    assert not whole_blocks((105, 128), 2) and not whole_blocks((6, 96), 2) and not whole_blocks((32000, 4096), 3)


def test_without_bitsandbytes_it_is_refused_in_one_line(monkeypatch):
    """finetune's refusal, and doctor's row (it had none: the recipe passed doctor, then finetune stopped)."""
    import importlib.util

    from llmtrain.config import Recipe
    from llmtrain.doctor import check_optimizer
    from llmtrain.errors import LLMTrainError
    from llmtrain.model.modeling import build_optimizer

    recipe = Recipe.model_validate({"model": {"name_or_path": "m"}, "output_dir": "runs/m",
                                    "data": {"path": "d.jsonl", "format": "prompt_completion"},
                                    "train": {"optimizer": "adamw_8bit"}})
    ((name, status, said),) = check_optimizer(recipe)
    assert (name, status) == ("8-bit AdamW", "pass") and said.startswith("bitsandbytes 0.")
    assert check_optimizer(recipe.model_copy(update={"train": recipe.train.model_copy(update={"optimizer": "adamw"})}
                                             )) == []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(LLMTrainError, match=r"^train.optimizer=adamw_8bit needs bitsandbytes: pip install "
                       r"'llmtrain\[qlora\]', or set train.optimizer=adamw.$"):
        build_optimizer(torch.nn.Linear(2, 2), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=False,
                        kind="adamw_8bit")
    assert check_optimizer(recipe) == [("8-bit AdamW", "fail", "train.optimizer=adamw_8bit needs bitsandbytes, which "
                                        "is not installed: pip install 'llmtrain[qlora]', or set "
                                        "train.optimizer=adamw.")]



@pytest.mark.slow
def test_a_resume_with_the_other_optimizer_is_one_paragraph(tiny_assets, tmp_path, monkeypatch):
    """A run of fp32 AdamW stopped after its step-3 checkpoint, resumed with train.optimizer=adamw_8bit (and the other
    way round): exit 2 with the paragraph, nothing written (it went on to load bitsandbytes' optimizer with AdamW's
    moments and stopped at the first step with KeyError: 'state1', a traceback)."""
    recipe = _recipe(tiny_assets, tmp_path)
    for was, now in (("adamw", "adamw_8bit"), ("adamw_8bit", "adamw")):
        run = tmp_path / was
        crash_at_step(monkeypatch, recipe, 5, f"output_dir={run}", f"train.optimizer={was}")
        before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
        proc = cli("finetune", str(recipe), f"output_dir={run}", f"train.optimizer={now}", "--resume", "auto",
                   check=False)
        said = " ".join(proc.stderr.split())
        assert proc.returncode == 2 and "Traceback" not in said, said
        assert f"holds train.optimizer={was}'s state and this recipe has train.optimizer={now}" in said
        assert f"Set train.optimizer={was} to resume it" in said
        assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


@pytest.mark.slow
def test_on_fsdps_shards_it_is_one_process_update_where_the_shards_hold_whole_blocks(tmp_path):
    """tests/adamw_8bit_probe.py: 4 parameters sharded by torch's fully_shard over 2 gloo processes, 5 steps of
    llmtrain's 8-bit AdamW from the same gradients as one process's bnb.optim.AdamW8bit. Equal to the bit where each
    shard holds whole blocks of 256 (256 x 128 split by rows), under 4,096 elements (32-bit moments, 40 x 64) and where
    a process holds nothing (1 x 8,192: rank 1's shard is empty). 101 x 128 split 51 / 50 rows starts rank 1's blocks
    half a block off: another blockwise quantisation, no further from fp32 AdamW than one process's (2.7e-3 after 5
    steps at lr 1e-2, both) and 2.4e-3 from it."""
    import adamw_8bit_probe as probe
    import bitsandbytes as bnb

    out = tmp_path / "sharded.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(open_port()), str(REPO / "tests" / "adamw_8bit_probe.py"), str(out)],
                          env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sharded = torch.load(out)

    def one_process(optimizer):
        params = probe.parameters()
        opt = optimizer(list(params.values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        for step in range(probe.STEPS):
            for name, g in probe.gradients(step).items():
                params[name].grad = g
            opt.step()
        return {name: p.detach() for name, p in params.items()}

    one, fp32 = one_process(bnb.optim.AdamW8bit), one_process(torch.optim.AdamW)
    start = probe.parameters()
    for name in ("aligned", "small", "one_row"):
        assert torch.equal(sharded[name], one[name]) and not torch.equal(one[name], start[name]), name
    apart = (sharded["misaligned"] - one["misaligned"]).abs().max()
    assert 0 < apart < 5e-3
    assert (sharded["misaligned"] - fp32["misaligned"]).abs().max() <= 1.1 * (one["misaligned"] - fp32[
        "misaligned"]).abs().max()


def _uneven_model(tiny_assets, folder):
    """The tiny model with its 104-row vocabulary padded to 105 rows (unused): 2 processes hold 53 and 52 rows of 128
    columns of the embedding and the head, so rank 1's blocks of 256 start half a block off one process's (104 rows
    split 52 / 52: whole blocks, as every other weight of the tiny model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets / "model"), dtype=torch.float32)
    model.resize_token_embeddings(105, mean_resizing=False)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_assets / "model")).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.extended  # main tier: test_pipeline's 8-bit AdamW on FSDP-sharded stages (the moments on FSDP's shards,
# trained as one process and resumed on them: the same optimizer path, 78 s of CI's 30 minutes)
def test_two_fsdp_processes_train_what_one_process_trains_and_resume_on_their_shards(tiny_assets, tmp_path,
                                                                                        free_port):
    """The 8-bit AdamW under FSDP (each process updates its shard with bitsandbytes' kernel; the moments and their
    absmax are DTensors laid out as the parameter): 2 processes x micro-batch 2 against 1 process x 4, 6 steps at lr
    3e-3 (a checkpoint every 3). Losses and gradient norms as one process's, the weights to 5e-4: one process with
    micro-batches of 2 accumulated twice is 2.5e-4 from itself with 4 (34 of 519K weights past 3e-5: Adam's division of
    a gradient near 0 by its own size, and an 8-bit moment a step apart), where FSDP's fp32 AdamW is 3.7e-3 off. A run
    preempted after the step-3 checkpoint and resumed on its 2 shards ends as the uninterrupted one to the bit; on 1
    process (FSDP's 1 shard) as well to round-off, since its blocks are the 2 shards' (whole rows, whole blocks);
    a 105-row vocabulary (uneven blocks) is refused there."""
    recipe = _recipe(tiny_assets, tmp_path, optimizer="adamw_8bit", micro_batch_size=2, grad_accum_steps=1)
    config = REPO / "accelerate_configs" / "cpu_fsdp.yaml"
    run_train(recipe, f"output_dir={tmp_path / 'one'}", "train.micro_batch_size=4")
    said = launch_finetune(config, 2, free_port, recipe, f"output_dir={tmp_path / 'fsdp'}")
    assert "FSDP2 on CPU: 2 processes" in said
    one, two = records(tmp_path / "one"), records(tmp_path / "fsdp")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=1e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)
    apart = max_abs_diff(load_weights(tmp_path / "fsdp" / "final"), load_weights(tmp_path / "one" / "final"))
    launch_finetune(config, 2, free_port, recipe, f"output_dir={tmp_path / 'fp32'}", "train.optimizer=adamw")
    fp32 = max_abs_diff(load_weights(tmp_path / "fp32" / "final"), load_weights(tmp_path / "one" / "final"))
    assert apart < 5e-4 < fp32

    resumed = _preempted(tmp_path / "fsdp", tmp_path / "resumed")
    said = launch_finetune(config, 2, free_port, recipe, f"output_dir={resumed}", resume="auto")
    assert f"resumed from {resumed / 'checkpoints' / 'step_000003'} at step 3" in said
    assert [r["loss"] for r in records(resumed)] == [r["loss"] for r in two]
    assert max_abs_diff(load_weights(resumed / "final"), load_weights(tmp_path / "fsdp" / "final")) == 0

    # On 1 process: the 2 shards split whole rows into whole blocks, one process's, so the moments read onto 1 shard
    one = _preempted(tmp_path / "fsdp", tmp_path / "on-one")
    said = launch_finetune(config, 1, free_port, recipe, f"output_dir={one}", "train.micro_batch_size=4",
                           resume="auto")
    assert "written by 2 data-parallel ranks, resumed on 1" in said
    assert [r["loss"] for r in records(one)] == pytest.approx([r["loss"] for r in two], abs=1e-5)
    assert max_abs_diff(load_weights(one / "final"), load_weights(tmp_path / "fsdp" / "final")) < 1e-4

    # A 105-row vocabulary splits 53 / 52 rows: rank 1's blocks start half a block off one process's, so those
    # moments resume on 2 shards only: refused before anything loads, the run left as it was
    name = f"model.name_or_path={_uneven_model(tiny_assets, tmp_path / 'uneven-model')}"
    launch_finetune(config, 2, free_port, recipe, name, f"output_dir={tmp_path / 'uneven-run'}")
    uneven = _preempted(tmp_path / "uneven-run", tmp_path / "uneven")
    before = sorted(p.name for p in uneven.rglob("*"))
    proc = cli("launch", "--config_file", str(config), "--num_processes", "1", "--main_process_port", str(free_port),
               str(recipe), name, f"output_dir={uneven}", "train.micro_batch_size=4", "--resume", "auto",
               check=False)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "Traceback" not in said, said[-3000:]
    # (the head's: the embedding's moments are 32-bit ones, which read onto any shards)
    assert "train.optimizer=adamw_8bit's moments of lm_head.weight quantised in blocks of each of its 2 " \
        "shards, and this launch shards it otherwise" in said
    assert sorted(p.name for p in uneven.rglob("*")) == before


def _preempted(run, into):
    """A copy of `run` as if the job died after its step-3 checkpoint: the step-6 one and final/ are gone."""
    shutil.copytree(run, into)
    shutil.rmtree(into / "checkpoints" / "step_000006")
    shutil.rmtree(into / "final")
    return into


@pytest.mark.slow
@pytest.mark.extended  # main tier: FSDP's shards above
@pytest.mark.parametrize("config", ["cpu_tp.yaml", "cpu_hsdp.yaml"], ids=["fsdp_x_tp", "hsdp"])
def test_under_fsdp_x_tp_and_hsdp_it_trains_as_one_process_and_resumes(tiny_assets, tmp_path, free_port, config):
    """4 processes: 2 shards x 2 tensor-parallel (the row-parallel o_proj and down_proj split by columns, 64 of the
    tiny model's 128: blocks of 256 span 4 of a shard's rows, not one process's blocks), and 2 replicas x 2 shards
    (HSDP: each replica's moments the same, saved once). Against one process's 8-bit AdamW: losses to 1e-4, the
    weights to 1e-3 (measured 7.3e-4 under TP, o_proj; 2.9e-4 under HSDP), where fp32 AdamW's are 3.7e-3 off. A run
    preempted after its step-3 checkpoint and resumed on the same launch ends as the uninterrupted one."""
    recipe = _recipe(tiny_assets, tmp_path, optimizer="adamw_8bit", micro_batch_size=2, grad_accum_steps=1)
    launch = REPO / "accelerate_configs" / config
    per_rank = f"train.micro_batch_size={2 if config == 'cpu_tp.yaml' else 1}"  # 2 data ranks under TP, 4 else
    run_train(recipe, f"output_dir={tmp_path / 'one'}", "train.micro_batch_size=4")
    run_train(recipe, f"output_dir={tmp_path / 'fp32'}", "train.micro_batch_size=4", "train.optimizer=adamw")
    said = launch_finetune(launch, 4, free_port, recipe, f"output_dir={tmp_path / 'four'}", per_rank)
    assert ("2 shards x 2 tensor-parallel" if config == "cpu_tp.yaml" else "2 replicas x 2 shards") in said
    assert losses(tmp_path / "four") == pytest.approx(losses(tmp_path / "one"), abs=1e-4)
    one = load_weights(tmp_path / "one" / "final")
    assert max_abs_diff(load_weights(tmp_path / "four" / "final"), one) < 1e-3 < max_abs_diff(
        load_weights(tmp_path / "fp32" / "final"), one)

    resumed = _preempted(tmp_path / "four", tmp_path / "resumed")
    launch_finetune(launch, 4, free_port, recipe, f"output_dir={resumed}", per_rank, resume="auto")
    assert losses(resumed) == losses(tmp_path / "four")
    assert max_abs_diff(load_weights(resumed / "final"), load_weights(tmp_path / "four" / "final")) == 0
