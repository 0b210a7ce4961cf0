"""KTO runs through the CLI: a crash mid-run and a resume end as the uninterrupted run (LoRA, and a full fine-tune,
whose frozen reference must be the starting weights again, not the checkpoint's), 2 DDP processes train as 1
(TRL's KL estimate averaged over the processes), and so do 2 pipeline stages under a token budget (their reference
and KL passes run through the stages before each step)."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO, crash_at_step, launch_finetune, load_weights, max_abs_diff, records, run_train, write_recipe
from test_kto import reversal_feedback, write_jsonl

from llmtrain.data.batching import epoch_order


def final_weights(run):
    """The exported model's weights: the adapter of a LoRA run, the model of a full fine-tune."""
    adapter = run / "final" / "adapter_model.safetensors"
    return load_weights(adapter if adapter.is_file() else run / "final")


def kto_recipe(tiny_assets, folder, *, lora: bool):
    data = write_jsonl(folder / "kto.jsonl", reversal_feedback(tiny_assets, 200))
    return write_recipe(tiny_assets, folder, data={"path": str(data), "format": "unpaired", "max_seq_len": 32},
                        kto={"beta": 0.5}, **({"lora": {"r": 4, "alpha": 8, "dropout": 0.0}} if lora else {}),
                        train={"max_steps": 6, "micro_batch_size": 8, "lr": 5e-3 if lora else 1e-3,
                               "warmup_steps": 0, "seed": 7},
                        checkpoint={"every_steps": 3})


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_crash_and_resume_end_as_the_uninterrupted_run(tiny_assets, tmp_path, monkeypatch, lora):
    """Died during step 5 (after the step-3 checkpoint), resumed: the same losses, KL estimates and final weights,
    bit for bit. A full fine-tune's reference is a frozen copy made from the starting weights before the checkpoint
    is loaded: a copy of the checkpoint would change steps 4-6."""
    recipe = kto_recipe(tiny_assets, tmp_path, lora=lora)
    run_train(recipe, f"output_dir={tmp_path / 'straight'}")
    crash_at_step(monkeypatch, recipe, 5, f"output_dir={tmp_path / 'cut'}")
    assert len(records(tmp_path / "cut")) == 4
    run_train(recipe, f"output_dir={tmp_path / 'cut'}", resume="auto")
    straight, cut = records(tmp_path / "straight"), records(tmp_path / "cut")
    assert straight[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # step 1: the policy is its reference
    assert straight[-1]["loss"] < 0.45 and max(r["kl"] for r in straight) > 0  # it trained; the KL term is live
    assert [(r["step"], r["loss"], r["kl"]) for r in cut] == [(r["step"], r["loss"], r["kl"]) for r in straight]
    assert max_abs_diff(final_weights(tmp_path / "cut"), final_weights(tmp_path / "straight")) == 0


PER_RANK = 2  # examples of one process's micro-batch; one process takes both shares: 2 x PER_RANK


def same_kl_pairs(rows: list[dict], order: list[int]) -> list[dict]:
    """The rows with the last example of each process's share of every global micro-batch (in `order`) given the
    same completion (labelled undesirable: it answers another prompt), so that the KL sequences of 1 process and of 2
    are the same set (see the test)."""
    rows = [dict(r) for r in rows]
    width = 2 * PER_RANK
    for start in range(0, len(order) - width + 1, width):
        first, second = order[start + PER_RANK - 1], order[start + width - 1]
        rows[second].update(completion=rows[first]["completion"], label=False)
    return rows


@pytest.mark.slow
# LoRA's: extended (main tier: FSDP's full fine-tune, its reference sharded, with the same KL average and idle rank;
# the disabled adapter as the reference on several processes: test_preference.py's FSDP LoRA DPO)
@pytest.mark.parametrize("launch, lora, sync", [pytest.param("cpu_ddp", True, False, marks=pytest.mark.extended),
                                                pytest.param("cpu_fsdp", True, False, marks=pytest.mark.extended),
                                                pytest.param("cpu_fsdp", False, False, marks=pytest.mark.extended),
                                                ("cpu_fsdp", False, True),
                                                ("cpu_fsdp", True, True)],
                         ids=["ddp-lora", "fsdp-lora", "fsdp-full", "fsdp-full-sync", "fsdp-lora-sync"])
def test_two_processes_train_as_one(tiny_assets, tmp_path, free_port, launch, lora, sync):
    """2 processes (gloo, accelerate launch; DDP, or FSDP2 sharding every layer: LoRA's reference the disabled adapter
    of the sharded model, a full fine-tune's the starting weights read again and sharded like the policy) x
    micro-batch 2 against 1 process x micro-batch 4 (whose full fine-tune's reference is a copy of the policy),
    accumulation 2: the same examples per step, the same losses, KL estimates and metrics (1e-6), the same adapter
    (1e-5), in training and in the eval.

    TRL's KL estimate on 2 processes is the mean of each process's own mean over its micro-batch's KL sequences
    (gather_for_metrics(kl).mean()), each process rotating the completions within its own share: with x1..x4 and
    y1..y4 the global micro-batch's prompts and completions, process 0 has (x1, y2), (x2, y1) and process 1 (x3, y4),
    (x4, y3). One process with the whole micro-batch rotates over all four: (x1, y4), (x2, y1), (x3, y2), (x4, y3).
    The two are the same set where y2 = y4, the last completion of each process's share: the data are arranged so
    (`same_kl_pairs`, on the seeded epoch order that both runs draw), and then the mean over the four equals the
    mean of the two means over two. A process that kept its own estimate (no all-reduce) would differ. 21 rows: the
    last global micro-batch has one example, so process 1 idles there: it still takes part in the average, and under
FSDP it runs as many forwards as process 0 (each gathers every layer from both), else the run hangs.

    fsdp-full-sync (main tier; fsdp-full, the same launch without it, extended): kto.sync_reference every step at
    alpha 0.6 (TR-DPO), the sharded reference mixed with the sharded policy (its untied head whole, from the
    policy's gathered embeddings) against one process's copy: the same run, and the checkpoints' references (one
    written by 2 processes' shards, one whole) equal to 1e-5. fsdp-lora-sync (main tier): LoRA's moving reference
    (alpha 1, AdapterReference) with the adapters sharded and a trained copy of the LM head (lora.modules_to_save) in
    FSDP's root unit: each process swaps its shards in for the reference's forward, every 2 steps; the same run (step
    3 and the eval through the swap: with the root left gathered by the eval's policy forward, the eval's reference
    ran the policy's head, eval loss 0.4718 against 0.5018: checked), and the checkpoints' snapshots (2 processes'
    shards, one whole) equal to 1e-5."""
    seed, n = 7, 21
    # Mostly desirable completions: training raises completions' log-probabilities broadly, mismatched ones too, so
    # the KL estimate is positive (not clamped to 0) at the steps after the first and the average matters.
    desirable = [{**r, "completion": r["completion"].removesuffix("zz"), "label": True}
                 for r in reversal_feedback(tiny_assets, n + 9)]
    rows = same_kl_pairs(desirable[:n], epoch_order(n, seed=seed, epoch=0))
    held = same_kl_pairs(desirable[n:], list(range(9)))  # eval: in file order
    data, held_path = write_jsonl(tmp_path / "kto.jsonl", rows), write_jsonl(tmp_path / "held.jsonl", held)
    # with sync, a trained copy of the head in FSDP's root unit, which FSDP keeps gathered after a forward (the
    # eval's policy forward before the reference's)
    head = {"modules_to_save": ["lm_head"]} if sync else {}
    # Adam's eps 1e-6: Adam scales each gradient element by its own size, so an element that is rounding alone would
    # move its weight by a fair part of lr in one run and not the other (1.6e-5 at lr 5e-3 with eps 1e-8, measured)
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data), "format": "unpaired", "max_seq_len": 32,
                                                       "eval_split": str(held_path)},
                          kto={"beta": 0.5}, **({"lora": {"r": 4, "alpha": 8, "dropout": 0.0, **head}} if lora else {}),
                          train={"max_steps": 3, "micro_batch_size": 2 * PER_RANK, "grad_accum_steps": 2,
                                 "lr": 1e-2 if lora else 1e-3,
                                 "eps": 1e-6, "warmup_steps": 0, "seed": seed, "eval_every_steps": 3,
                                 "eval_samples": 0},
                          **({"checkpoint": {"every_steps": 2, "save_final": True}} if sync else {}))
    if sync:
        import yaml

        text = yaml.safe_load(recipe.read_text())
        # LoRA every 2 steps: at alpha 1 every step the reference is each step's starting policy (KL 0 throughout);
        # so step 2's KL is live, step 3's 0 through the swap, and the eval's (the snapshot against step 3's policy)
        text["kto"]["sync_reference"] = {"every_steps": 2, "alpha": 1.0} if lora else {"every_steps": 1, "alpha": 0.6}
        recipe.write_text(yaml.safe_dump(text))
    run_train(recipe, f"output_dir={tmp_path / 'one'}")
    out = launch_finetune(REPO / "accelerate_configs" / f"{launch}.yaml", 2, free_port, recipe,
                          f"output_dir={tmp_path / 'two'}", f"train.micro_batch_size={PER_RANK}",
                          f"train.eval_batch_size={PER_RANK}")
    assert ("reference: the starting weights, sharded like the policy" in out) == (launch == "cpu_fsdp" and not lora)
    assert_same_runs(tmp_path / "two", tmp_path / "one")
    if sync:
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import load_file

        assert ("every 2 steps the adapter as it was then" if lora else
                "every 1 steps it takes alpha=0.6 of the policy (TR-DPO)") in out
        saved = []
        for run in ("one", "two"):
            folder = tmp_path / run / "checkpoints" / "step_000002" / "reference"
            shapes = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
            state = {k: torch.empty(tuple(m.size)) for k, m in shapes.items()}
            dcp.load(state, checkpoint_id=str(folder))
            saved.append(state)
        assert saved[0].keys() == saved[1].keys()
        if lora:  # the reference: step 3's starting policy in step 3 (KL 0, loss 0.5), step 2's in the eval after it
            trained, (evaluated,) = records(tmp_path / "two")[2], records(tmp_path / "two", "eval")
            assert trained["kl"] == 0 and trained["loss"] == pytest.approx(0.5, abs=1e-7)
            assert evaluated["eval_kl"] > 0.01 and abs(evaluated["eval_rewards/margins"]) > 1e-3  # 0 without the swap
            # the adapters at step 2: B started at 0
            assert max(v.abs().max().item() for k, v in saved[0].items() if "lora_B" in k) > 1e-4
        else:
            start = load_file(tiny_assets / "model" / "model.safetensors")
            assert saved[0].keys() == start.keys()
            assert max((saved[0][k] - start[k]).abs().max().item() for k in start) > 1e-4  # moved
        assert max((saved[0][k] - saved[1][k]).abs().max().item() for k in saved[0]) < 1e-5


def assert_same_runs(run, one):
    """3 steps and an eval of `run` as `one` trained them: losses to 1e-6, the KL estimates, log-probabilities and
    rewards to an ulp of a summed log-probability, the adapter or model to 1e-5; the KL term live after step 1.
    A summed log-probability near -40 is held in fp32 to 64 x 2^-24 = 3.8e-6 (one ulp, summed in another order by
    another batch shape); a reward is beta x the difference of two such sums: within beta x 2 ulp; the KL estimate
    is a mean of such differences: within an ulp (1.4e-6 measured, at KL 3.5)."""
    got, want = records(run), records(one)
    assert len(got) == len(want) == 3 and max(r["kl"] for r in want[1:]) > 0.01
    ulp = 64 * 2.0**-24
    tol = {"loss": 1e-6, "kl": ulp, "logps": ulp, "rewards": 0.5 * 2 * ulp}
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=tol[key.split("/")[0]]), key
    (eval_want,), (eval_got,) = records(one, "eval"), records(run, "eval")
    for key in ("eval_loss", "eval_kl", "eval_rewards/margins"):
        assert eval_got[key] == pytest.approx(eval_want[key], abs=tol[key[5:].split("/")[0]]), key
    assert max_abs_diff(final_weights(run), final_weights(one)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("replicas, sync, lora", [(1, False, True), pytest.param(2, False, True,
                                                                              marks=pytest.mark.extended),
                                                  pytest.param(1, True, True, marks=pytest.mark.extended),
                                                  (1, False, False)],
                         ids=["pp", "pp-ddp", "pp-lora-sync", "pp-full"])
def test_pipeline_stages_train_as_without_them(tiny_assets, tmp_path, free_port, replicas, sync, lora):
    """KTO with LoRA on a pipeline of 2 stages (1F1B, 2 micro-batches a step, each a bin of the token budget, one row
    of its 128 slots): before each step (and each eval) the stages run the micro-batches' KL sequences with the
    policy, then with the adapter disabled those and the completions (the reference), forward only, and the KL
    estimate and the reference log-probabilities reach the last stage with the targets (objectives/kto.StageKTO).
    Against one process (assert_same_runs; measured: every figure equal to the bit). `pp-ddp`: 2 pipelines of 2
    stages (4 processes) against 2 DDP processes under the same budget: the KL estimates of the two pipelines' last
    stages are averaged (the first stages add nothing), as the DDP processes' are. `pp-lora-sync`: LoRA's moving
    reference (kto.sync_reference every 2 steps, alpha 1), each stage's snapshot of its part of the adapter swapped in
    for the completions' and the KL sequences' reference passes (StagePairs.follow); extended (main tier: DPO's in
    test_pipeline.py). `pp-full`: a full fine-tune, whose reference is each stage's frozen copy of its starting
    weights, exchanged into them for the reference and KL passes (model/reference.StageCopy)."""
    seed, n = 7, 24
    rows = [{**r, "completion": r["completion"].removesuffix("zz"), "label": True}
            for r in reversal_feedback(tiny_assets, n + 8)]
    for r in rows[::3]:  # some undesirable ones: both sides' rewards and their margin
        r["label"] = False
    data, held = write_jsonl(tmp_path / "kto.jsonl", rows[:n]), write_jsonl(tmp_path / "held.jsonl", rows[n:])
    recipe = write_recipe(tiny_assets, tmp_path, model={"attn_implementation": "auto"},
                          data={"path": str(data), "format": "unpaired", "max_seq_len": 32, "eval_split": str(held)},
                          kto={"beta": 0.5, **({"sync_reference": {"every_steps": 2, "alpha": 1.0}} if sync else {})},
                          **({"lora": {"r": 4, "alpha": 8, "dropout": 0.0}} if lora else {}),
                          train={"max_steps": 3, "micro_batch_size": 1, "micro_batch_tokens": 128,
                                 "grad_accum_steps": 2, "lr": 1e-2 if lora else 1e-3, "eps": 1e-6,
                                 "warmup_steps": 0, "seed": seed,
                                 "eval_every_steps": 3, "eval_samples": 0})
    ddp = REPO / "accelerate_configs" / "cpu_ddp.yaml"
    if replicas == 1:
        run_train(recipe, f"output_dir={tmp_path / 'one'}")
    else:
        launch_finetune(ddp, 2, free_port, recipe, f"output_dir={tmp_path / 'one'}")
    out = launch_finetune(ddp, 2 * replicas, free_port, recipe, "parallel.pipeline_parallel=2",
                          f"output_dir={tmp_path / 'pp'}")
    assert "2 micro-batches of 128 slots a step" in out, out
    assert_same_runs(tmp_path / "pp", tmp_path / "one")


@pytest.mark.extended  # main tier: a quality check of the demo recipe; KTO's exactness: test_kto.py against TRL
@pytest.mark.slow
def test_the_tiny_recipe_separates_reversals_from_copies(tiny_assets, tmp_path):
    """recipes/tiny-kto.yaml as `make demo-kto` runs it, on this session's tiny assets: the short SFT run, then KTO
    (a full fine-tune on prepare-tiny's unpaired rows): the held-out margin between the reversals' and the copies'
    rewards opens (0 at the start: the policy is the reference), the copies lose log-probability and the eval loss
    falls below the starting 0.5."""
    sft = tmp_path / "sft"
    data = tiny_assets / "data"
    run_train(REPO / "recipes" / "tiny.yaml", f"model.name_or_path={tiny_assets / 'model'}",
              f"data.path={data / 'train.jsonl'}", f"data.eval_split={data / 'eval.jsonl'}",
              f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=150", f"output_dir={sft}")
    run_train(REPO / "recipes" / "tiny-kto.yaml", f"model.name_or_path={sft / 'final'}",
              f"data.path={data / 'train_unpaired.jsonl'}", f"data.eval_split={data / 'eval_unpaired.jsonl'}",
              f"data.cache_dir={tmp_path / 'cache'}",
              f"output_dir={tmp_path / 'kto'}")
    evals = records(tmp_path / "kto", "eval")
    assert [e["step"] for e in evals] == [50, 100]
    assert evals[-1]["eval_rewards/margins"] > 0.3 > evals[0]["eval_rewards/margins"] > 0.1  # 0.23, 0.44 measured
    assert evals[-1]["eval_rewards/rejected"] < -0.5 and evals[-1]["eval_loss"] < 0.47  # -0.78, 0.452 measured


def test_eval_samples_of_kto_expect_the_desirable_completions_and_the_summary_keeps_its_margin(tiny_assets, tmp_path):
    """train.eval_samples under KTO decodes the first N desirable eval rows: an undesirable row's completion is what
    not to write, and had been taken as the expected reply (audit 4: 15.0% said where 30 of 102 desirable rows, 29%,
    were right). The run's summary gives KTO's kl and margin beside the answer accuracy (it had given the accuracy
    alone)."""
    import json

    from llmtrain.run.console import summary_table

    rows = reversal_feedback(tiny_assets, 40)  # even rows desirable, odd undesirable ("zz" run on)
    held = write_jsonl(tmp_path / "held.jsonl", reversal_feedback(tiny_assets, 10, start=100))
    recipe = kto_recipe(tiny_assets, tmp_path, lora=False)
    summary = run_train(recipe, f"data.path={write_jsonl(tmp_path / 'kto40.jsonl', rows)}", f"data.eval_split={held}",
              "train.max_steps=1", "train.eval_every_steps=1", "train.eval_samples=3",
              "train.eval_max_new_tokens=8", f"output_dir={tmp_path / 'run'}")
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    desirable = [r["completion"] for r in map(json.loads, held.read_text().splitlines()) if r["label"]]
    assert [s["expected"] for s in samples] == desirable[:3]
    (ev,) = [r for r in records(tmp_path / "run", kind="eval")]
    assert ev["eval_answer_accuracy"] == pytest.approx(sum(s["match"] for s in samples) / 3)
    table = summary_table(summary, out=tmp_path / "run", evals=[ev])
    text = " ".join(str(c) for col in table.columns for c in col._cells)
    assert f"kl {ev['eval_kl']:.3f}, reward margin {ev['eval_rewards/margins']:.3f}, answer accuracy" in text, text
