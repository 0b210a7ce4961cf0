"""FSDP x TP (2-D) on CPU: 4 gloo processes under `accelerate launch --config_file accelerate_configs/cpu_tp.yaml`,
laid out as 2 shards x 2 tensor-parallel ranks, train exactly like 1 process with the same global batch, and their
checkpoints move between FSDP x TP, plain FSDP and 1 process. The 3-D layout, HSDP x TP (2 replicas x 2 shards x 2 TP,
8 processes, accelerate_configs/cpu_hsdp_tp.yaml), trains like 1 process too.

llmtrain splits each decoder layer's q/k/v/gate/up by columns and o/down by rows over the mesh's `tp` dimension
(tensor.apply_tensor_parallel, PyTorch's parallelize_module with the model's own plan); Accelerate's FSDP2 then
shards every weight over the `dp_shard` dimension. Processes 0-1 and 2-3 each read one batch: the global batch is
micro-batch x 2, not x 4.

The weights are compared with AdamW's eps at 1: Adam divides each element's update by the root of its own second
moment, so a 1e-9 difference in a near-zero gradient element becomes a visible weight difference (8.4e-5 measured
after 4 steps at the default eps, where losses and gradient norms agree to 1e-7); with eps 1 the update is the
momentum of the gradient itself, and the final weights compare the gradients element by element.

LoRA under FSDP x TP (each adapter laid out beside its split base layer: tensor.ADAPTER_SPLIT) trains like 1 process
and resumes on 1, and so does DoRA (its magnitudes and row norms laid out as the base layer's output); online RL
(GRPO, RLOO) samples and trains like 1 process, rollouts.jsonl holding each completion once, with a merged generation
copy too; KTO and distillation with LoRA train as plain FSDP on the same data ranks.

Four processes on two cores are slow: these tests are few and small, and marked slow.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    assert_same_steps,
    launch_finetune,
    load_weights,
    losses,
    max_abs_diff,
    open_port,
    records,
    rl_under_tp_against_one,
    run_train,
    write_recipe,
)

pytestmark = [pytest.mark.slow, pytest.mark.long(140)]

CONFIGS = {8: REPO / "accelerate_configs" / "cpu_hsdp_tp.yaml", 4: REPO / "accelerate_configs" / "cpu_tp.yaml",
           2: REPO / "accelerate_configs" / "cpu_fsdp.yaml", 1: REPO / "accelerate_configs" / "cpu_fsdp.yaml"}
MESH = {8: "4 data-parallel ranks (8 processes: 2 replicas x 2 shards x 2 tensor-parallel)",
        4: "2 data-parallel ranks (4 processes: 2 shards x 2 tensor-parallel)",
        2: "2 processes", 1: "1 process"}
DATA_RANKS = {8: 4, 4: 2, 2: 2, 1: 1}  # a tensor-parallel pair reads one batch
SGD_LIKE = {"lr": 0.1, "eps": 1.0, "max_grad_norm": 1e9}  # see the module docstring


def _launch(recipe: Path, port: int, processes: int, *overrides: str, resume: str | None = None) -> str:
    """`accelerate launch` of `llmtrain finetune RECIPE`: FSDP x TP 2x2 on 4 processes, plain FSDP2 on 2 or 1, each
    with the micro-batch that keeps the global micro-batch at 4 examples. Returns what the main process printed."""
    out = launch_finetune(CONFIGS[processes], processes, port, recipe,
                          f"train.micro_batch_size={4 // DATA_RANKS[processes]}", *overrides, resume=resume)
    assert f"x {MESH[processes]} = 4 examples/step" in out, out
    assert (processes >= 4) == ("tensor parallelism: 14 linear layers split over 2 processes" in out)
    assert "redistributing" not in out  # DTensor's performance notes are kept off the terminal
    return out


def _same_run(run: Path, reference: Path, *, tol: float) -> None:
    """The same steps over the same tokens, the same losses and the same final weights to `tol`."""
    assert [r["step"] for r in records(run)] == [r["step"] for r in records(reference)]
    assert [r["tokens"] for r in records(run)] == [r["tokens"] for r in records(reference)]  # the same examples
    assert losses(run) == pytest.approx(losses(reference), abs=tol)
    assert max_abs_diff(load_weights(run / "final"), load_weights(reference / "final")) < tol


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory):
    """`straight(processes, attention)` -> (recipe, run): the straight run of 4 steps (a checkpoint at step 2) on
    1 process (in this process) or launched on 2, 4 or 8, made once for the module and shared by the tests that
    compare with it or resume from its checkpoint (they copy it first, never change it)."""
    folder, made = tmp_path_factory.mktemp("tp-straight"), {}

    def get(processes: int, attention: str = "eager") -> tuple[Path, Path]:
        recipe = write_recipe(tiny_assets, folder, name=f"recipe-{attention}.yaml",
                              train={"max_steps": 4, "micro_batch_size": 4, **SGD_LIKE},
                              checkpoint={"every_steps": 2}, model={"attn_implementation": attention})
        run = folder / f"{processes}-{attention}"
        if (processes, attention) not in made:
            if processes == 1:
                run_train(recipe, f"output_dir={run}")
            else:
                _launch(recipe, open_port(), processes, f"output_dir={run}")
            made[processes, attention] = run
        return recipe, run

    return get


# auto: extended (varlen: FSDP)
@pytest.mark.parametrize("attention", ["eager", pytest.param("auto", marks=pytest.mark.extended)])
def test_fsdp_x_tp_2x2_trains_like_one_process(straight, attention):
    """2 shards x 2 TP x micro-batch 2 == 1 process x micro-batch 4: losses and gradient norms to 1e-6 (relative),
    final weights to 1e-6, with each TP'd weight stored in four pieces (2 shards x 2 TP) and each norm in two. With
    eager attention on padded rows, and with llmtrain's varlen attention (auto) on packed rows, whose kernel sees
    each process's half of the heads.

    The gradient checks: the norm is taken before clipping, and the loss of each process is its share of a sum
    normalised by the trained tokens of the whole window. Counting the TP pair's one batch twice (the window's
    tokens summed over 4 processes, not 2 data ranks) would halve the gradient, and averaging over 4 processes
    where FSDP averages over 2 would double it: either fails the norm by a factor of 2."""
    _, single = straight(1, attention)
    _, tp = straight(4, attention)

    assert_same_steps(tp, single, tol=1e-6)
    _same_run(tp, single, tol=1e-6)
    assert losses(tp)[-1] < losses(tp)[0]

    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(tp / "checkpoints" / "step_000002" / "pytorch_model_fsdp_0")).read_metadata()
    pieces = {name.rsplit("model.", 1)[-1]: sorted(tuple(c.offsets) for c in m.chunks)
              for name, m in meta.state_dict_metadata.items() if name.endswith("weight") and "optim" not in name}
    # q_proj (out x in = 128 x 128): columns split in two by TP, each half in two by FSDP -> 4 row blocks of 32;
    # down_proj (128 x 512): rows (its input) split by TP, then dim 0 by FSDP -> a 2 x 2 grid.
    assert pieces["layers.0.self_attn.q_proj.weight"] == [(0, 0), (32, 0), (64, 0), (96, 0)]
    assert pieces["layers.0.mlp.down_proj.weight"] == [(0, 0), (0, 256), (64, 0), (64, 256)]
    assert pieces["layers.0.input_layernorm.weight"] == [(0,), (64,)]  # whole on each TP rank, sharded by FSDP


@pytest.mark.extended  # 148 s in CI; main tier: test_families' compiled layers under TP, exact in float64
def test_model_compile_under_fsdp_x_tp_trains_as_the_eager_split_model(straight, tmp_path):
    """model.compile under FSDP x TP (refused until 2026-12-06: inductor's compile of the split layers' DTensor code
    recursed without end at the first backward, torch 2.13 on gloo): each module tensor parallelism split runs
    eagerly inside its compiled layer (tensor.eager_in_compile: 7 linears a layer here), a row-wise layer's
    asynchronous all-reduce waited for before the compiled graph takes its output (it had given DTensor's
    redistribute a plain gradient in backward); the norms, rotary embeddings, attention and activations between them
    compiled. 2 shards x 2 TP, 4 steps: the eager split run's losses and gradient norms to 1e-5 and final weights to
    1e-5 (inductor's fused kernels round otherwise)."""
    recipe, eager = straight(4)
    run = tmp_path / "compiled"
    out = _launch(recipe, open_port(), 4, "model.compile=true", f"output_dir={run}")
    assert "compile: 2 decoder layers (regional torch.compile), the 14 modules tensor parallelism split run eagerly" \
        in out, out
    assert_same_steps(run, eager, tol=1e-5)
    _same_run(run, eager, tol=1e-5)


# resume (extended for CI time): the adapter's sharded checkpoint read back on one FSDP process
@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["train", "resume"])
def test_lora_under_fsdp_x_tp_trains_like_one_process_and_resumes_on_one(tiny_assets, tmp_path, free_port, resume):
    """LoRA beside the split layers (tensor.ADAPTER_SPLIT): a column-wise layer's B keeps its 1/tp of the output
    rows and A runs whole; a row-wise layer's A takes its 1/tp of the input columns (its r outputs all-reduced) and
    B runs whole. 2 shards x 2 TP x micro-batch 2 == 1 process x micro-batch 4: losses and gradient norms to 1e-6,
    the final adapter (gathered whole, under peft's names) to 1e-6; its step-2 checkpoint resumes on 1 FSDP process
    to the same end. An A or B laid out wrong (an adapter's output beside the wrong rows, or a gradient not summed over
    the pair) changes the gradient norm at the first step."""
    recipe = write_recipe(tiny_assets, tmp_path, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                          train={"max_steps": 4, "micro_batch_size": 4, **SGD_LIKE}, checkpoint={"every_steps": 2},
                          model={"attn_implementation": "eager"})
    single = tmp_path / "one"
    run_train(recipe, f"output_dir={single}")
    tp = tmp_path / "tp"
    _launch(recipe, free_port, 4, f"output_dir={tp}")
    assert_same_steps(tp, single, tol=1e-6)
    assert losses(tp) == pytest.approx(losses(single), abs=1e-6) and losses(tp)[-1] < losses(tp)[0]
    # the degree it was written under, for the launch a refused resume names (preflight.resume_launch; audit 57)
    assert json.loads((tp / "checkpoints" / "step_000004" / "train_state.json").read_text())["tensor_parallel"] == 2
    name = "adapter_model.safetensors"
    a, b = load_weights(tp / "final" / name), load_weights(single / "final" / name)
    assert a.keys() == b.keys() and any("lora_A" in k for k in a) and max_abs_diff(a, b) < 1e-6
    if not resume:
        return
    run = Path(shutil.copytree(tp, tmp_path / "tp-on-one"))
    shutil.rmtree(run / "checkpoints" / "step_000004")
    shutil.rmtree(run / "final")
    assert "resumed from" in _launch(recipe, free_port + 1, 1, f"output_dir={run}", resume="auto")  # FSDP, 1 process
    assert losses(run) == pytest.approx(losses(single), abs=1e-6)
    assert max_abs_diff(load_weights(run / "final" / name), b) < 1e-6


# extended for CI time (4 processes beside one, ~100 s each); main tier: tests/test_families.py's float64 probe of
# DoRA under TP (Llama, Phi-3), exact to 3e-17. dropout: peft's second base matmul on the dropped input
@pytest.mark.extended
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dora_under_fsdp_x_tp_trains_like_one_process(tiny_assets, tmp_path, free_port, dropout):
    """DoRA (lora.dora) beside the split layers (tensor._split_dora), once refused: a column-wise layer's magnitudes
    split with its output rows, a row-wise one's whole on every rank with each row's norm summed over the pair. 2
    shards x 2 TP x micro-batch 2 == 1 process x micro-batch 4 on every linear: losses and gradient norms to 1e-6, the
    adapter with its magnitudes (moved off the base's row norms, where peft starts them) to 1e-6, and no DCP warning
    on the terminal (the checkpoint's check of the sharded LoRA B matrices had printed one at each save). A norm of
    one rank's half of a row, or magnitudes laid out beside the wrong rows, changes the first step's gradient norm.

    With lora.dropout 0.1 peft runs the base layer again on the dropped input; a row-wise adapter draws its mask on
    its rank's columns (not one process's), so the column-wise layers alone are adapted and the run is held to plain
    FSDP on the same data ranks (2 processes, micro-batch 2), whose masks are the pair's."""
    targets = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] if dropout else "all-linear"
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4, "micro_batch_size": 4, **SGD_LIKE},
                          lora={"r": 4, "alpha": 8, "dropout": dropout, "dora": True, "target_modules": targets},
                          checkpoint={"every_steps": 2}, model={"attn_implementation": "eager"})
    reference = tmp_path / "reference"
    if dropout:
        _launch(recipe, free_port + 1, 2, f"output_dir={reference}")
    else:
        run_train(recipe, f"output_dir={reference}")
    tp = tmp_path / "tp"
    out = _launch(recipe, free_port, 4, f"output_dir={tp}")
    assert "torch.distributed is disabled" not in out
    assert_same_steps(tp, reference, tol=1e-6)
    assert losses(tp) == pytest.approx(losses(reference), abs=1e-6)
    name = "adapter_model.safetensors"
    ours, theirs = load_weights(tp / "final" / name), load_weights(reference / "final" / name)
    assert ours.keys() == theirs.keys() and max_abs_diff(ours, theirs) < 1e-6
    base = load_weights(tiny_assets / "model" / "model.safetensors")
    magnitudes = {k: v for k, v in ours.items() if k.endswith("lora_magnitude_vector")}
    assert len(magnitudes) == (10 if dropout else 14)  # 2 layers x 5 (or 7) linears
    start = {k: torch.linalg.norm(base[k.removeprefix("base_model.model.").replace("lora_magnitude_vector",
                                                                                   "weight")], dim=1)
             for k in magnitudes}
    assert min((magnitudes[k] - start[k]).abs().max().item() for k in magnitudes) > 1e-4


@pytest.mark.extended  # main tier: test_fsdp_x_tp_2x2_trains_like_one_process, the tiled MLP under FSDP
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_tiled_mlp_under_fsdp_x_tp_trains_like_one_process(tiny_assets, tmp_path, free_port, lora):
    """model.tiled_mlp under FSDP x TP (was refused as untested): each shard of 8 tokens runs the split MLP (gate and
    up column-wise, down row-wise, its output all-reduced per shard), and the backward recomputes it shard by shard,
    the split weights' gradients (DTensors) summed over the shards as the Function's outputs. Both processes of a
    pair hold the same tokens, so they run the same shards and their collectives line up. 2 shards x 2 TP x
    micro-batch 2 == 1 process x micro-batch 4, the MLP and both norms tiled on each: losses, gradient norms and the
    final weights to 1e-6. With LoRA, the adapters beside the split layers (their split A or B DTensors) are the
    Function's differentiated inputs. The full fine-tune runs with checkpointing and the offload too (each layer
    recomputed, its tiled MLP's collectives again, in the same order on both processes of a pair)."""
    switches = {} if lora else {"gradient_checkpointing": True, "activation_offload": True}  # both long-context ones
    recipe = write_recipe(tiny_assets, tmp_path, model={"attn_implementation": "eager", "tiled_mlp": 8, **switches},
                          train={"max_steps": 3, "micro_batch_size": 4, **SGD_LIKE},
                          **({"lora": {"r": 4, "alpha": 8, "dropout": 0.0}} if lora else {}))
    single = tmp_path / "one"
    run_train(recipe, f"output_dir={single}")
    tp = tmp_path / "tp"
    out = _launch(recipe, free_port, 4, f"output_dir={tp}")
    assert "MLP tiled in shards of 8 tokens" in out
    assert_same_steps(tp, single, tol=1e-6)
    assert losses(tp) == pytest.approx(losses(single), abs=1e-6) and losses(tp)[-1] < losses(tp)[0]
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    assert max_abs_diff(load_weights(tp / "final" / name), load_weights(single / "final" / name)) < 1e-6


# extended for CI time (48 s, 4 processes): main tier, LoRA under FSDP x TP (the split model's forward the sampler
# runs), GRPO's rollouts and update on DDP and FSDP (test_grpo_run.py); rloo: its KL pass with the adapter disabled and
@pytest.mark.extended
@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_online_rl_full_fine_tunes_kl_under_fsdp_x_tp_equals_one_process(tiny_assets, tmp_path, free_port, algorithm):
    """A full fine-tune with rl.beta > 0 under FSDP x TP: the frozen copy is not split by TP but sharded over every
    process of the mesh (fsdp._frozen_mesh), run in the update's passes (GRPO) or gathered whole for the rollout
    (RLOO); 2 shards x 2 TP x 2 prompts equal 1 process x 4 prompts (the completions, rewards, losses and gradient
    norms: to 1e-5, a gradient norm near 31 held in fp32 to a few 1e-6), with a live KL. Refused by the table before
    stop 98."""
    out = rl_under_tp_against_one(tiny_assets, tmp_path, free_port, tiny_assets / "model", tol=1e-5,
                                  algorithm=algorithm, lora=False, rl={"beta": 0.04})
    assert "reference: the starting weights, sharded like the policy" in out
    got, want = records(tmp_path / "tp"), records(tmp_path / "one")
    assert [r["kl"] for r in got] == pytest.approx([r["kl"] for r in want], abs=1e-6)
    assert want[-1]["kl"] > 1e-6


@pytest.mark.extended
@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_loras_moving_reference_under_fsdp_x_tp_equals_one_process(tiny_assets, tmp_path, free_port, algorithm):
    """GRPO with LoRA, beta 0.1 and rl.sync_reference {every_steps: 2, alpha: 1} (AdapterReference) on 2 shards x 2
    TP: each process swaps its own slices of the adapter's snapshot in for the reference's forward. Step 4's
    reference is the adapter after step 2 and its policy moved since: a live KL through the swap (0 without it), equal
    to one process's. RLOO (refused before 2026-12-05) takes its KL in the rollout, where FSDP holds the policy
    gathered over the shards and still split over the TP pair: each process swaps in its TP slice of the snapshot's
    whole weights (AdapterReference._swapped_gathered)."""
    rl_under_tp_against_one(tiny_assets, tmp_path, free_port, tiny_assets / "model", tol=1e-5, steps=4,
                            algorithm=algorithm, rl={"beta": 0.1, "sync_reference": {"every_steps": 2, "alpha": 1.0}})
    got, want = records(tmp_path / "tp"), records(tmp_path / "one")
    assert [r["kl"] for r in got] == pytest.approx([r["kl"] for r in want], abs=1e-6)
    assert want[2]["kl"] == pytest.approx(0, abs=1e-7) and want[3]["kl"] > 1e-5  # step 3: the snapshot is the policy


# its advantages normalised over every data rank's completions
@pytest.mark.extended
@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_online_rl_with_lora_under_fsdp_x_tp_equals_one_process(tiny_assets, tmp_path, free_port, algorithm):
    """Sampling under tensor parallelism: each process of a TP pair runs the split model's forward in the fast sampler
    (its heads' keys and values in its static cache; eager, no merged copy: it had fallen back to the reference loop)
    and gets the whole logits, so with the same completion seeds the pair draws the same
    completions, which 2 shards x 2 TP x 2 prompts train as 1 process x 4 prompts: the tokens sampled, rewards,
    losses and gradient norms equal, the adapter to 1e-5; rollouts.jsonl holds each completion once (the pair's
    first process gives the records: collectives.gathered), the completions one process sampled."""
    import json

    out = rl_under_tp_against_one(tiny_assets, tmp_path, free_port, tiny_assets / "model", tol=1e-6,
                                  algorithm=algorithm)
    assert "samples with the reference loop" not in out  # the fast sampler, eager, on the split weights

    def completions(run):
        rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
        return sorted((r["step"], r["row"], r["generation"], r["completion"], r["reward"]) for r in rows)

    assert completions(tmp_path / "tp") == completions(tmp_path / "one") and len(completions(tmp_path / "one")) == 32
    name = "adapter_model.safetensors"
    # AdamW's first steps move a weight by about lr whatever its gradient's size, so a gradient of nearly 0 that
    # rounding tips moves it visibly: measured 1.0e-5 (lr 1e-2, 2 steps; the bound was 1e-5 and failed by that)
    assert max_abs_diff(load_weights(tmp_path / "tp" / "final" / name),
                        load_weights(tmp_path / "one" / "final" / name)) < 5e-5


# extended for CI time (~110 s each); main tier: tests/test_families.py's float64 probe of the copy under TP. kept: the
# copy held between rollouts and rewritten in place
@pytest.mark.extended
@pytest.mark.parametrize("copy", ["rollout", "kept"])
def test_a_merged_generation_copy_under_fsdp_x_tp_samples_as_one_process(tiny_assets, tmp_path, free_port, copy):
    """rl.merged_copy under tensor parallelism, once refused: each process merges its own part of each adapted
    linear (its rows of W + s B A under a column-wise split, its columns under a row-wise one) and runs the split
    layer on it (merged_copy._split_forward); a DoRA adapter's magnitudes folded in with each row's norm summed over
    the pair's columns (merged_copy._whole_rows). GRPO with DoRA, 2 shards x 2 TP x 2 prompts against 1 process x 4
    prompts, both with the copy: the same completions, rewards, losses and gradient norms (to 1e-6), and the run's
    header says so (tests/test_families.py holds the copy's logits to the unmerged adapters' under TP in float64, and
    counts the linears it merged)."""
    out = rl_under_tp_against_one(tiny_assets, tmp_path, free_port, tiny_assets / "model", tol=1e-6,
                                  lora={"dora": True}, rl={"merged_copy": copy})
    assert "samples with the reference loop" not in out
    from llmtrain.loop.phases import COPY_TEXT

    assert COPY_TEXT[copy] in out, out[-2000:]


@pytest.mark.extended  # main tier: online RL under FSDP x TP (the same sampling), LoRA under FSDP x TP
# hsdp: 8 processes against plain FSDP on 4 (the teacher over 2 replicas x 2 shards x 2 TP)
@pytest.mark.parametrize("processes", [4, 8], ids=["fsdp_x_tp", "hsdp_x_tp"])
def test_distillation_with_lora_under_fsdp_x_tp_trains_as_plain_fsdp(tiny_assets, tmp_path, processes):
    """On-policy distillation (lmbda 1: the student samples every step) from a teacher of other weights, its decoder
    sharded over every process (the TP pairs' too), the student LoRA under 2 shards x 2 TP: the same
    completions, losses and gradient norms as plain FSDP on the same 2 data ranks, the adapter to 1e-5. (A teacher
    equal to the student trains on a loss of 0 plus rounding, which no two layouts share.) Under HSDP x TP (2
    replicas x 2 shards x 2 TP, 4 data ranks) against plain FSDP on 4: the teacher in 1/4 a replica (its shards x
    TP), replicated over the replicas, as fsdp._frozen_mesh builds it."""
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_assets / "model", teacher)
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(teacher)).save_pretrained(teacher)
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-distill.yaml").read_text())
    recipe["data"].update(path=str(tiny_assets / "data" / "train.jsonl"), eval_split=None)
    recipe["model"]["name_or_path"] = str(tiny_assets / "model")
    recipe["distill"].update(teacher=str(teacher), lmbda=1.0)
    recipe["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    recipe["train"].update(max_steps=2, micro_batch_size=2, eval_every_steps=None, eval_samples=0,
                           eval_batch_size=None, lr=1e-2)
    recipe["checkpoint"] = {"every_steps": None}
    recipe["logging"] = {"progress": False, "plot": False, "every_steps": 1}
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(recipe))
    data_ranks = DATA_RANKS[processes]
    launch_finetune(CONFIGS[2], data_ranks, open_port(), path, f"output_dir={tmp_path / 'fsdp'}")
    launch_finetune(CONFIGS[processes], processes, open_port(), path, f"output_dir={tmp_path / 'tp'}")
    got, want = records(tmp_path / "tp"), records(tmp_path / "fsdp")
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=1e-6), key
    assert want[0]["loss"] > 1e-3  # the teacher differs: a loss to train on
    name = "adapter_model.safetensors"
    # Adam at lr 1e-2 turns the last bits of a near-zero gradient into a step: 1.9e-5 measured under HSDP x TP,
    # whose replicas add the gradients in another order (as KTO's test below)
    assert max_abs_diff(load_weights(tmp_path / "tp" / "final" / name),
                        load_weights(tmp_path / "fsdp" / "final" / name)) < (1e-5 if processes == 4 else 1e-4)
    # a replica's 4 processes (2 shards x 2 TP) share the teacher, as plain FSDP's 4 do, or 2 (FSDP x TP)
    _assert_frozen_spread(teacher, tmp_path, "teacher: sharded like the student,", spread={"tp": 4, "fsdp": data_ranks})


@pytest.mark.extended  # main tier: LoRA under FSDP x TP above (KTO's passes are the policy's forward, with and
# without the adapter), and KTO's FSDP launches in test_kto_run.py (the full fine-tune's reference sharded)
@pytest.mark.parametrize("lora, sync", [(True, False), (False, False), (False, True)],
                         ids=["lora", "full", "full-sync"])
def test_kto_under_fsdp_x_tp_trains_as_plain_fsdp(tiny_assets, tmp_path, lora, sync):
    """KTO under 2 shards x 2 TP trains as plain FSDP on 2 processes, the same 2 data ranks (so the same
    micro-batches and KL sequences): losses, KL estimates, rewards and gradient norms to 1e-6, the weights to 1e-4
    (Adam at lr 1e-2 and eps 1e-6; 1.9e-5 measured for the adapter). The reference: with LoRA the adapter disabled;
    a full fine-tune's the starting weights sharded like the policy and copied from its shards (each weight gathered
    from the policy's 2-D mesh and cut for the reference's, spread over the TP pair as over FSDP's shards:
    reference.copy_into). Adam's eps 1e-6, not 1e-8: an element whose gradient is rounding alone moves its weight by
    a fair part of lr in one run and not the other (1.74e-4 with 1e-8 at the full fine-tune's head). full-sync:
    kto.sync_reference every step at alpha 0.6 (TR-DPO), the policy mixed into the reference across the two meshes
    (it had stopped at the first sync: DTensor redistributes within one mesh only)."""
    import yaml

    recipe = yaml.safe_load((REPO / "recipes" / "tiny-kto.yaml").read_text())
    recipe["data"].update(path=str(tiny_assets / "data" / Path(recipe["data"]["path"]).name), eval_split=None)
    recipe["model"]["name_or_path"] = str(tiny_assets / "model")
    if lora:
        recipe["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    if sync:
        recipe["kto"]["sync_reference"] = {"every_steps": 1, "alpha": 0.6}
    recipe["train"].update(max_steps=3, micro_batch_size=4, eval_every_steps=None, eval_samples=0, warmup_steps=0,
                           lr=1e-2, eps=1e-6)
    recipe["logging"] = {"progress": False, "plot": False}
    path = tmp_path / "kto.yaml"
    path.write_text(yaml.safe_dump(recipe))
    launch_finetune(CONFIGS[2], 2, open_port(), path, f"output_dir={tmp_path / 'fsdp'}")
    launch_finetune(CONFIGS[4], 4, open_port(), path, f"output_dir={tmp_path / 'tp'}")
    got, want = records(tmp_path / "tp"), records(tmp_path / "fsdp")
    assert len(got) == len(want) == 3
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=1e-6), key
    # the KL estimate and the rewards: differences of summed log-probabilities (hundreds of tokens each), which the
    # TP pair's all-reduces sum in another order (KL 0.87071 against 0.87069 at the full fine-tune's third step)
    for key in ("kl", "rewards/chosen"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-4, abs=1e-5), key
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    assert max_abs_diff(load_weights(tmp_path / "tp" / "final" / name),
                        load_weights(tmp_path / "fsdp" / "final" / name)) < 1e-4
    if not lora:
        _assert_frozen_spread(tiny_assets / "model", tmp_path, "reference: the starting weights, sharded like the "
                                                                "policy (copied from its shards),")


@pytest.mark.extended  # 6 processes in all; main tier: NEFTune on one process and the sequence and pipeline rows
def test_neftunes_noise_under_fsdp_x_tp_is_plain_fsdps(tiny_assets, tmp_path):
    """train.neftune_alpha under 2 shards x 2 TP: the embedding stays whole on both processes of a TP pair, which draw
    the same noise (the same seed, the same draws) for the pair's one batch; the run equals plain FSDP on 2 processes
    (the same 2 data ranks, micro-batches and draws): gradient norms to 1e-6, losses and weights to 1e-5; the noise
    moves the loss (against plain FSDP without it)."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 3, "micro_batch_size": 4, **SGD_LIKE})
    runs = {name: tmp_path / name for name in ("plain", "fsdp", "tp")}
    _launch(recipe, open_port(), 2, f"output_dir={runs['plain']}")
    _launch(recipe, open_port(), 2, f"output_dir={runs['fsdp']}", "train.neftune_alpha=15")
    _launch(recipe, open_port(), 4, f"output_dir={runs['tp']}", "train.neftune_alpha=15")
    assert min(abs(a - b) for a, b in zip(losses(runs["fsdp"]), losses(runs["plain"]))) > 1e-3
    assert [r["grad_norm"] for r in records(runs["tp"])] == pytest.approx(
        [r["grad_norm"] for r in records(runs["fsdp"])], rel=1e-6)
    _same_run(runs["tp"], runs["fsdp"], tol=1e-5)


def _assert_frozen_spread(model: Path, runs: Path, line: str, spread: dict[str, int] | None = None) -> None:
    """A frozen model's decoder (distillation's teacher, KTO's reference) in 1/4 a process under 2 shards x 2 TP
    (fsdp._frozen_mesh: spread over the TP pair too; it was 1/2, replicated over the shards), 1/2 under plain FSDP
    on 2; its head whole on each: what the start-up line says the main process holds."""
    import json

    config = json.loads((model / "config.json").read_text())
    head = config["vocab_size"] * config["hidden_size"]
    for run, processes in (spread or {"tp": 4, "fsdp": 2}).items():
        said = re.search(re.escape(line) + r" ([\d,]+) of its ([\d,]+) parameters",
                         (runs / run / "train.log").read_text())
        held, total = (int(n.replace(",", "")) for n in said.groups())
        assert held - head == pytest.approx((total - head) / processes, rel=0.02), run


@pytest.mark.extended  # main tier: test_fsdp_x_tp_2x2_trains_like_one_process, test_fsdp.py's sharded resume
def test_fsdp_x_tp_checkpoints_move_between_tp_fsdp_and_one_process(straight, tmp_path, free_port):
    """An FSDP x TP checkpoint resumes on plain FSDP with 2 processes and on 1 process; and a 2-process FSDP
    checkpoint resumes on FSDP x TP. The global micro-batch is 4 examples everywhere, so the data order is kept:
    every resumed run sees the tokens, and reaches the losses and weights, of the run that never stopped. The runs
    are the module's straight ones (4 steps, a checkpoint at step 2: 2 steps trained after each resume).

    What FSDP x TP on FSDP x TP would add is covered without a 4-process launch of its own: FSDP x TP writes (the
    two resumes off it read every piece) and FSDP x TP reads (the resume from FSDP here, from 3-D below)."""
    recipe, tp = straight(4)
    _, fsdp = straight(2)
    _same_run(fsdp, tp, tol=1e-6)  # the straight runs agree, so either is the reference

    def cut(run: Path, name: str) -> Path:
        """As if the job died right after step 2's checkpoint: step 4's checkpoint and final/ are gone."""
        copy = Path(shutil.copytree(run, tmp_path / name))
        shutil.rmtree(copy / "checkpoints" / "step_000004")
        shutil.rmtree(copy / "final")
        assert [p.name for p in (copy / "checkpoints").iterdir()] == ["step_000002"]
        return copy

    for processes in (2, 1):
        run = cut(tp, f"tp-on-{processes}")
        out = _launch(recipe, free_port, processes, f"output_dir={run}", resume="auto")
        assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 2" in out
        _same_run(run, tp, tol=1e-6)

    back = cut(fsdp, "fsdp-on-tp")
    out = _launch(recipe, free_port, 4, f"output_dir={back}", resume="auto")
    assert "resumed from" in out
    _same_run(back, fsdp, tol=1e-6)


@pytest.mark.extended  # main tier: 8 processes: FSDP x TP 2x2 and HSDP 2x2 each against one process
def test_hsdp_x_tp_2x2x2_trains_like_one_process_and_resumes_on_fsdp_x_tp(straight, tmp_path, free_port):
    """3-D, 8 processes: 2 replicas x 2 shards x 2 TP x micro-batch 1 == 1 process x micro-batch 4 (losses, gradient
    norms and final weights to 1e-6), and its checkpoint (step 2 of 4) resumes on FSDP x TP 2 x 2 to the same end.
    Each replica is FSDP x TP as above; the replicas all-reduce the gradients of their shards once a step."""
    recipe, single = straight(1)
    _, three = straight(8)
    assert_same_steps(three, single, tol=1e-6)
    _same_run(three, single, tol=1e-6)

    run = Path(shutil.copytree(three, tmp_path / "3d-on-4"))
    shutil.rmtree(run / "checkpoints" / "step_000004")
    shutil.rmtree(run / "final")
    out = _launch(recipe, free_port, 4, f"output_dir={run}", resume="auto")
    assert "written by 4 data-parallel ranks, resumed on 2" in out  # data ranks: 4 of the 3-D run, 2 here
    _same_run(run, single, tol=1e-6)


@pytest.mark.extended  # main tier: llmtrain launch's refusals before any process (test_launch.py, test_capabilities.py)
def test_a_refused_launch_says_why_once_and_writes_nothing(tiny_assets, tmp_path, free_port):
    """QLoRA under cpu_tp.yaml is refused by all 4 processes before their process group exists: the paragraph is
    printed once (by the node's first process, not by every GPU's), every process exits 2, no run folder is made."""
    import subprocess
    import sys

    from helpers import ENV

    recipe = write_recipe(tiny_assets, tmp_path, lora={"r": 4}, model={"quantize": "nf4", "dtype": "bfloat16"})
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS[4]), "--main_process_port",
         str(free_port), "-m", "llmtrain", "finetune", str(recipe)], env=ENV, cwd=REPO, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("error: tensor parallelism (parallelism_config_tp_size: 2 in the launch config) does "
                             "not train a 4-bit base") == 1, proc.stderr
    assert "exitcode  : 2" in proc.stderr and not (tmp_path / "run").exists()
    # The printing process exits first (the others wait, cli.QUIET_EXIT_DELAY_S): torchrun's report names it, with
    # exit code 2, as the root cause; the launcher then ends the others.
    root = proc.stderr.split("Root Cause (first observed failure):", 1)[-1]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: 2 ", root), proc.stderr[-2000:]
