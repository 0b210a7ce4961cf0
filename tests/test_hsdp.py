"""HSDP on CPU: 4 gloo processes under `accelerate launch --config_file accelerate_configs/cpu_hsdp.yaml`, laid out
as 2 replicas x 2 shards, train exactly like 1 process with the same global batch, and their checkpoints move
between HSDP, plain FSDP and 1 process.

The launch's parallelism_config gives Accelerate the mesh (dp_replicate=2, dp_shard=2); its fsdp2_prepare_model
hands fully_shard the 2-D mesh, so each parameter is sharded over the 2 processes of a replica and replicated
across the replicas (the gradients are reduce-scattered within a replica, then all-reduced across replicas).
On CPU workers build_accelerator attaches that mesh once they are FSDP (llmtrain/parallel/accelerator.py, _attach_mesh);
every launch here checks the start-up line names the mesh, so a silent fall back to plain FSDP fails.

Four processes on two cores are slow: these tests are few and small, and marked slow.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import (
    REPO,
    assert_same_steps,
    launch_finetune,
    load_weights,
    losses,
    max_abs_diff,
    open_port,
    records,
    run_train,
    write_recipe,
)

pytestmark = pytest.mark.slow

CONFIGS = {4: REPO / "accelerate_configs" / "cpu_hsdp.yaml", 2: REPO / "accelerate_configs" / "cpu_fsdp.yaml",
           1: REPO / "accelerate_configs" / "cpu_fsdp.yaml"}
MESH = {4: "4 processes (2 replicas x 2 shards)", 2: "2 processes", 1: "1 process"}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def _launch(recipe: Path, port: int, processes: int, *overrides: str, resume: str | None = None,
            accum: int = 1) -> str:
    """`accelerate launch` of `llmtrain finetune RECIPE`: HSDP 2x2 on 4 processes, plain FSDP2 on 2 or 1, each with
    the micro-batch that keeps the global micro-batch at 4 examples. Returns what the main process printed."""
    out = launch_finetune(CONFIGS[processes], processes, port, recipe, f"train.micro_batch_size={4 // processes}",
                          f"train.grad_accum_steps={accum}", *overrides, resume=resume)
    assert f"FSDP2 on CPU: {processes} process{'es' * (processes != 1)} over gloo" in out
    assert f"x {MESH[processes]} = {4 * accum} examples/step" in out, out
    return out


def _preempt(run: Path, step: int) -> Path:
    """As if the job died right after the checkpoint before `step`: that checkpoint and final/ are gone."""
    shutil.rmtree(run / "checkpoints" / f"step_{step:06d}")
    shutil.rmtree(run / "final")
    return run


def _same_run(run: Path, reference: Path, *, exact: bool) -> None:
    """The same steps over the same tokens, to round-off: 1e-6 on the same layout; across layouts the sums run in
    another order, 1e-5 in the losses and 3e-5 in the weights (Adam divides each update by the root of its own
    second moment, which magnifies a 1e-7 difference in a small gradient element; as in test_ddp)."""
    assert [r["step"] for r in records(run)] == [r["step"] for r in records(reference)]
    assert [r["tokens"] for r in records(run)] == [r["tokens"] for r in records(reference)]  # the same examples
    assert losses(run) == pytest.approx(losses(reference), abs=1e-6 if exact else 1e-5)
    assert max_abs_diff(load_weights(run / "final"), load_weights(reference / "final")) < (1e-6 if exact else 3e-5)


# The full fine-tune runs AdamW with eps 1 (the update is the gradient's momentum; see test_tp.py): at the default eps
# Adam divides a near-zero gradient element by its own root, and the final weights differed by 1.22e-5 here (torch
# 2.13 on this CPU) where losses and gradient norms agree to 1e-7. LoRA keeps the defaults at lr 1e-2.
TRAIN = {"full": {"lr": 0.1, "eps": 1.0}, "lora": {"lr": 1e-2}}


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory):
    """`straight(kind, processes)` -> (recipe, run): the straight run of 4 steps of 2 micro-batches (a checkpoint at
    step 2) on 1 process (in this process, micro-batch 4) or launched on 2 (FSDP) or 4 (HSDP 2x2), made once for the
    module and shared by the tests that compare with it or resume from a copy of it."""
    folder, made = tmp_path_factory.mktemp("hsdp-straight"), set()

    def get(kind: str, processes: int) -> tuple[Path, Path]:
        lora = {"lora": LORA} if kind == "lora" else {}
        recipe = write_recipe(tiny_assets, folder, name=f"recipe-{kind}.yaml", **lora,
                              train={"max_steps": 4, "micro_batch_size": 4, "max_grad_norm": 1e9, **TRAIN[kind]},
                              checkpoint={"every_steps": 2})
        run = folder / f"{kind}-{processes}"
        if (kind, processes) not in made:
            if processes == 1:
                run_train(recipe, f"output_dir={run}", "train.grad_accum_steps=2")
            else:
                _launch(recipe, open_port(), processes, f"output_dir={run}", accum=2)
            made.add((kind, processes))
        return recipe, run

    return get


# lora: extended (LoRA under FSDP: test_fsdp.py)
@pytest.mark.parametrize("kind", ["full", pytest.param("lora", marks=pytest.mark.extended)])
def test_hsdp_2x2_matches_one_process(straight, kind):
    """2 replicas x 2 shards x micro-batch 1 == 1 process x micro-batch 4, both accumulating 2 micro-batches a
    step: losses, gradient norms and final weights to 1e-5 in fp32, with the parameters really sharded in two (not
    four, not replicated whole). Between the micro-batches HSDP reduce-scatters within the replica and holds the
    shards, and all-reduces across the replicas once a step (train.fsdp_accumulate=sharded, the default).

    The gradient check: the norm is taken before clipping, and the loss of each process is its share of a sum
    normalised by the trained tokens of all ranks, so a reduction that summed the gradients over the 2 replicas
    or the 4 processes instead of averaging them (FSDP2 on gloo did, pytorch #162338) would log a norm 2 or 4
    times the single process's, and the 1e-5 match fails."""
    _, single = straight(kind, 1)
    _, hsdp = straight(kind, 4)
    lora = kind == "lora"
    assert_same_steps(hsdp, single, tol=1e-5)  # a sum over replicas would be 2x the norm, over all 4x
    assert losses(hsdp)[-1] < losses(hsdp)[0]
    if lora:
        from safetensors.torch import load_file

        adapters = [load_file(str(run / "final" / "adapter_model.safetensors")) for run in (hsdp, single)]
        assert max_abs_diff(*adapters) < 1e-5
    else:
        assert max_abs_diff(load_weights(hsdp / "final"), load_weights(single / "final")) < 1e-5

    # Sharded over a replica's 2 processes: each weight is stored as 2 dim-0 chunks, written once (the replicas
    # hold the same shards, and only one of them writes each).
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(hsdp / "checkpoints" / "step_000002" / "pytorch_model_fsdp_0")).read_metadata()
    name = next(k for k in meta.state_dict_metadata if k.endswith("layers.0.self_attn.q_proj.weight")
                or k.endswith("layers.0.self_attn.q_proj.base_layer.weight"))
    chunks = meta.state_dict_metadata[name].chunks
    assert sorted(c.offsets[0] for c in chunks) == [0, meta.state_dict_metadata[name].size[0] // 2]


@pytest.mark.extended  # main tier: test_fsdp.py's sharded resume and test_scaleout.py's DDP-to-one resume
def test_hsdp_checkpoints_move_between_hsdp_fsdp_and_one_process(straight, tmp_path, free_port):
    """An HSDP checkpoint resumes exactly on HSDP, on plain FSDP with 2 processes and on 1 process; and a 2-process
    FSDP checkpoint resumes on HSDP. The global batch is 8 examples everywhere (2 micro-batches of 4), so the data
    order is kept: every resumed run sees the tokens, and reaches the losses and weights, of the run that never
    stopped. The straight runs are the module's (4 steps, a checkpoint at step 2: 2 steps trained after each
    resume)."""
    recipe, hsdp = straight("full", 4)
    _, fsdp = straight("full", 2)
    _same_run(fsdp, hsdp, exact=False)  # the straight runs agree, so any of them is the reference

    cut = _preempt(Path(shutil.copytree(hsdp, tmp_path / "cut")), 4)
    for processes in (4, 2, 1):
        run = Path(shutil.copytree(cut, tmp_path / f"hsdp-on-{processes}"))
        out = _launch(recipe, free_port, processes, f"output_dir={run}", resume="auto", accum=2)
        assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 2" in out
        assert processes == 4 or "written by 4 data-parallel ranks, resumed on" in out
        _same_run(run, hsdp, exact=processes == 4)

    back = _preempt(Path(shutil.copytree(fsdp, tmp_path / "fsdp-on-4")), 4)
    out = _launch(recipe, free_port, 4, f"output_dir={back}", resume="auto", accum=2)
    assert "written by 2 data-parallel ranks, resumed on 4" in out
    _same_run(back, fsdp, exact=False)
