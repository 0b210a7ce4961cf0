"""Sequence parallelism (Ulysses, parallel.sequence_parallel): the processes of a sequence group each hold a slice of
one packed row, and train what one process trains on the whole row.

In-process: each slice's tokens, positions and trained positions (a document boundary inside a slice, the padding
of a row that does not divide), and the refusals. Through `accelerate launch` on gloo: 2 processes with sequence
parallelism 2 equal 1 process (losses to 1e-6, weights to 1e-5) on packed rows of several documents of unequal
length, for Llama (full and LoRA, with an eval) and for a Mistral whose sliding window is shorter than its documents
and whose single K/V head is replicated to both processes; the window changes the result (so the equality is not
vacuous); kill -9 and a resume equal the uninterrupted run; 4 processes (sequence 2 x FSDP 2) equal 1. The modes whose
loss reads whole sequences (DPO with the disabled adapter or a precomputed reference, KTO with its KL sequences, a
reward model's scores) equal 1 process too: each sequence's sum is added over the group.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    REPO,
    kill_launch_mid_run,
    launch_finetune,
    load_weights,
    losses,
    max_abs_diff,
    records,
    run_train,
    same_length_task,
    tiny_gpt_oss,
    write_recipe,
)

from llmtrain import capabilities
from llmtrain.config import load_recipe
from llmtrain.data.batching import Counts, collate, with_loss_positions
from llmtrain.errors import LLMTrainError
from llmtrain.layout import Layout
from llmtrain.parallel.sequence.shards import shard_batch

CPU_DDP = REPO / "accelerate_configs" / "cpu_ddp.yaml"
CPU_FSDP = REPO / "accelerate_configs" / "cpu_fsdp.yaml"
# Rows of several documents (the tiny task's examples are 10 to 16 tokens): a budget of 64 holds 4 or 5 of them.
PACKED = {"model": {"attn_implementation": "auto"},
          "train": {"micro_batch_size": 1, "micro_batch_tokens": 64, "grad_accum_steps": 2, "max_steps": 4,
                    "lr": 1e-3}}


pytestmark = pytest.mark.long(100)  # tests/conftest.py


def _row(lengths: list[int], trained_from: int = 2) -> tuple[dict, Counts]:
    """A collated packed row of documents of these lengths (tokens 10, 11, ...), each trained from its
    `trained_from`-th token on."""
    examples, token = [], 10
    for n in lengths:
        ids = list(range(token, token + n))
        token += n
        examples.append({"input_ids": ids, "labels": [-100] * trained_from + ids[trained_from:]})
    batch = with_loss_positions(collate(examples, pad_id=0, packing=True))
    trained = float(len(batch["loss_index"]))
    return batch, Counts(units=trained, trained=trained, tokens=float(sum(lengths)),
                         squares=float(sum(n * n for n in lengths)))


def test_each_slice_holds_its_tokens_and_the_trained_positions_that_fall_in_it():
    batch, counts = _row([5, 9, 4])  # 18 tokens, documents 0-4, 5-13, 14-17: a boundary inside each slice
    shards = [shard_batch(batch, counts, size=2, rank=r, pad_id=0) for r in range(2)]
    for r, (part, _) in enumerate(shards):
        assert part["input_ids"].tolist() == [list(range(10 + 9 * r, 19 + 9 * r))]
        assert part["position_ids"].tolist() == [[[0, 1, 2, 3, 4, 0, 1, 2, 3]], [[4, 5, 6, 7, 8, 0, 1, 2, 3]]][r]
        assert part["cu_seq_lens"].tolist() == [0, 5, 14, 18]  # the whole row's boundaries: attention sees it all
        # the trained positions of the slice, renumbered from it, with their targets (the next token of the row)
        flat = (part["loss_index"] + 9 * r).tolist()
        assert part["loss_targets"].tolist() == [batch["loss_targets"][batch["loss_index"].tolist().index(i)].item()
                                                 for i in flat]
    together = torch.cat([p["loss_index"] + 9 * r for r, (p, _) in enumerate(shards)])
    assert together.tolist() == batch["loss_index"].tolist()  # every trained position once, none lost at the cut
    # any tensor of one value per trained position goes with it (GRPO's per-token advantages and weights)
    batch["loss_weights"] = torch.arange(len(batch["loss_index"]), dtype=torch.float32) / 10
    parts = [shard_batch(batch, counts, size=2, rank=r, pad_id=0)[0] for r in range(2)]
    assert torch.cat([p["loss_weights"] for p in parts]).tolist() == batch["loss_weights"].tolist()
    assert all(len(p["loss_weights"]) == len(p["loss_index"]) for p in parts)
    assert [c.tokens for _, c in shards] == [9.0, 9.0]
    assert sum(c.units for _, c in shards) == counts.units
    assert sum(c.squares for _, c in shards) == counts.squares


def test_a_row_that_does_not_divide_is_padded_with_an_example_of_its_own():
    batch, counts = _row([5, 6])  # 11 tokens over 4 processes: 1 pad token, its own example
    shards = [shard_batch(batch, counts, size=4, rank=r, pad_id=0) for r in range(4)]
    assert [p["input_ids"].shape[1] for p, _ in shards] == [3, 3, 3, 3]
    assert shards[3][0]["input_ids"].tolist() == [[19, 20, 0]]
    assert shards[0][0]["cu_seq_lens"].tolist() == [0, 5, 11, 12]
    assert shards[3][0]["position_ids"].tolist() == [[4, 5, 0]]
    assert [c.tokens for _, c in shards] == [3.0, 3.0, 3.0, 2.0]  # the pad is not a token
    assert sum(c.units for _, c in shards) == counts.units
    assert all(p["examples"] == 2 for p, _ in shards)


def test_a_reward_models_scored_tokens_and_ktos_kl_row_are_split_with_the_row():
    """A reward model's scored positions go to the slice that holds them (renumbered, with their sequence's number);
    KTO's second row of KL sequences is split as the first; a loss of whole sequences counts its units (pairs,
    examples) once, on the group's first process."""
    from llmtrain.objectives.kto import KTO
    from llmtrain.objectives.reward_model import RewardModel

    pairs = [{"chosen_ids": list(range(10, 16)), "rejected_ids": list(range(20, 27))},
             {"chosen_ids": list(range(30, 33)), "rejected_ids": list(range(40, 46))}]  # 22 tokens
    batch, counts = RewardModel(SimpleNamespace(), pad_id=0, score_pad_id=0, packing=True,
                                margin=False).collate(pairs)
    assert batch["score_index"].tolist() == [5, 12, 15, 21]  # each sequence's last token
    shards = [shard_batch(batch, counts, size=2, rank=r, pad_id=0, whole_sequences=True) for r in range(2)]
    assert [p["score_index"].tolist() for p, _ in shards] == [[5], [1, 4, 10]]
    assert [p["score_sequence"].tolist() for p, _ in shards] == [[0], [1, 2, 3]]
    assert all(p["sequences"] == 4 for p, _ in shards)
    assert [c.units for _, c in shards] == [2.0, 0.0] and [c.trained for _, c in shards] == [1.0, 3.0]

    rows = [{"input_ids": list(range(10, 10 + n)), "labels": [-100] * 3 + list(range(13, 10 + n)), "label": i % 2 == 0}
            for i, n in enumerate((6, 9, 5))]
    batch, counts = KTO(SimpleNamespace(loss_type="kto"), pad_id=0, packing=True, max_seq_len=32).collate(rows)
    shards = [shard_batch(batch, counts, size=2, rank=r, pad_id=0, whole_sequences=True) for r in range(2)]
    total = batch["kl:input_ids"].shape[1]
    assert [p["kl:input_ids"].shape[1] for p, _ in shards] == [(total + 1) // 2] * 2
    assert torch.cat([p["kl:input_ids"] for p, _ in shards], dim=1)[:, :total].tolist() == \
        batch["kl:input_ids"].tolist()
    kl_index = [p["kl:loss_index"] + r * shards[0][0]["kl:input_ids"].shape[1] for r, (p, _) in enumerate(shards)]
    assert torch.cat(kl_index).tolist() == batch["kl:loss_index"].tolist()  # every KL position once
    assert [c.units for _, c in shards] == [3.0, 0.0]
    assert sum(c.tokens for _, c in shards) == counts.tokens == 20  # the examples' tokens, once (not the KL row's)


def check(recipe, *, world: int, model) -> None:
    """The recipe on `world` DDP processes, as `llmtrain launch` and each process check it (model: its config)."""
    capabilities.check(recipe, Layout(processes=world, sp=recipe.parallel.sequence_parallel), model=model)


def _recipe(tiny_assets, tmp_path, **sections):
    sections.setdefault("model", {"attn_implementation": "auto"})
    return load_recipe(write_recipe(tiny_assets, tmp_path, **sections), [])


@pytest.mark.parametrize("world, heads, kv, sections, words", [
    (3, 4, 2, {}, "the launch has 3: launch a multiple of 2"),
    (4, 6, 2, {}, "6 attention heads do not split into 4"),
    (4, 12, 3, {}, "3 key/value heads neither split into 4 groups nor divide 4"),
    (2, 4, 2, {"model": {"attn_implementation": "sdpa"}}, "model.attn_implementation=sdpa is refused"),
])
def test_what_sequence_parallelism_does_not_train_is_refused(tiny_assets, tmp_path, world, heads, kv, sections, words):
    n = 4 if "into 4" in words or "divide 4" in words else 2
    model = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=2)
    with pytest.raises(LLMTrainError, match=words):  # the recipe alone, or on the layout
        check(_recipe(tiny_assets, tmp_path, parallel={"sequence_parallel": n}, **sections), world=world, model=model)
    check(_recipe(tiny_assets, tmp_path), world=3, model=SimpleNamespace(num_attention_heads=6, num_key_value_heads=3,
                                                                          num_hidden_layers=2))  # off: nothing


def _launch(config: Path, processes: int, port: int, recipe: Path, *overrides: str) -> str:
    return launch_finetune(config, processes, port, recipe, "parallel.sequence_parallel=2", *overrides)


def _assert_equal(run: Path, reference: Path, *, weights: float = 1e-5, loss: float = 1e-6) -> None:
    ours, theirs = records(run), records(reference)
    assert len(ours) == len(theirs) > 0
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], abs=loss)
    assert [r["grad_norm"] for r in ours] == pytest.approx([r["grad_norm"] for r in theirs], rel=1e-5)
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in theirs]  # the same rows, counted once
    assert [r["trained_tokens"] for r in ours] == [r["trained_tokens"] for r in theirs]
    assert max_abs_diff(_final(run), _final(reference)) < weights


def _final(run: Path) -> dict:
    """final/'s weights: the model, or a LoRA run's adapter."""
    adapter = run / "final" / "adapter_model.safetensors"
    return load_weights(adapter if adapter.is_file() else run / "final")


LORA = {"r": 4, "alpha": 8, "dropout": 0.0}
# QLoRA with the long-context switches: checkpointing with the layer inputs offloaded, the MLP tiled in shards of 8
LONG = ["model.quantize=nf4", "model.gradient_checkpointing=true", "model.activation_offload=true",
        "model.tiled_mlp=8"]


@pytest.mark.slow
# lora: in qlora-long
# extended (make test-portable runs them); main tier: the sliding window's test below (an eval too), the checkpoint's
# and the modes of whole sequences, each 2 processes of one sequence against 1
@pytest.mark.parametrize("lora, switches", [pytest.param(False, [], marks=pytest.mark.extended),
                                             pytest.param(True, [], marks=pytest.mark.extended),
                                             pytest.param(True, LONG, marks=[pytest.mark.precision,
                                                                             pytest.mark.extended])],
                         ids=["full", "lora", "qlora-long"])
def test_two_processes_of_one_sequence_train_what_one_process_trains(tiny_assets, tmp_path, free_port, lora,
                                                                      switches):
    recipe = write_recipe(tiny_assets, tmp_path, **PACKED, **({"lora": LORA} if lora else {}),
                          data={"eval_split": str(tiny_assets / "data" / "eval.jsonl")})
    overrides = ["train.eval_every_steps=2", *switches]
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={one}", *overrides)
    out = _launch(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", *overrides)
    assert "each sequence split over 2 processes" in out and "1 data-parallel rank (2 processes" in out
    if switches:
        # on a CPU the offload saves nothing, and the line says so (loop/phases.memory_line)
        assert "QLoRA" in out and "model.activation_offload" in out and "MLP tiled in shards of 8" in out
    _assert_equal(two, one)
    # the eval runs on the slices too, its per-example sums summed over the group
    evals, reference = records(two, "eval"), records(one, "eval")
    for key in ("eval_loss", "eval_token_accuracy", "eval_teacher_forced_match"):
        assert [e[key] for e in evals] == pytest.approx([e[key] for e in reference], abs=1e-6)


@pytest.mark.slow
def test_a_groups_later_processes_and_later_stages_draw_dropout_of_their_own(tiny_assets, tmp_path):
    """Every process of a sequence group had one random stream, so LoRA dropout dropped each slice of a row alike
    (token j of each half together), and stage 1 of a pipeline reused stage 0's masks layer for layer (audit 31:
    14 of 14 masks equal). After the model is built (its weights alike everywhere) the later processes of a group and
    the later stages each take a stream of their own; under NEFTune a group keeps its one stream (each process draws
    the whole row's noise and keeps its slice) and the start-up says its masks repeat."""
    from llmtrain.loop.phases import separate_draws
    from llmtrain.parallel.groups import Groups
    from llmtrain.parallel.sequence.group import SequenceGroup

    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, lora={"r": 4, "dropout": 0.1}))

    def draws(rank: int, *, stage=None, recipe=recipe) -> tuple[torch.Tensor, list[str]]:
        said = []
        accelerator = SimpleNamespace(llmtrain_groups=Groups(sequence=SequenceGroup(size=2, rank=rank)))
        trainable = SimpleNamespace(pipeline=SimpleNamespace(by_stage={stage: None}) if stage is not None else None)
        torch.manual_seed(recipe.train.seed)
        separate_draws(recipe, accelerator, trainable, say=said.append)
        return torch.rand(4), said

    first, _ = draws(0)
    assert torch.equal(first, draws(0, stage=0)[0])  # the first process of the first stage: the run's own stream
    others = [draws(1)[0], draws(0, stage=1)[0], draws(1, stage=1)[0]]
    assert all(not torch.equal(first, x) for x in others) and not torch.equal(others[0], others[1])
    noisy = recipe.model_copy(update={"train": recipe.train.model_copy(update={"neftune_alpha": 5.0})})
    kept, said = draws(1, recipe=noisy)
    assert torch.equal(kept, first) and "drops each process's slice of a row alike" in said[0]


def test_neftunes_noise_on_two_processes_of_one_sequence_is_one_process_noise(tiny_assets, tmp_path, free_port):
    """train.neftune_alpha: each process embeds its half of the row and draws the whole row's noise (each example
    scaled by its whole length), keeping its half's: the same losses, gradient norms and weights as one process,
    whose noise moves the loss (against the run without it). Rows of 3 examples of 21 tokens: 63, odd, so the group
    pads each row by one token, one more segment, for which each process had drawn noise too (audit 38: step 4's
    loss 4.6535 against 4.6180); the slices now say the row's real tokens."""
    data = same_length_task(tiny_assets, tmp_path)
    recipe = write_recipe(tiny_assets, tmp_path, **{**PACKED, "train": {**PACKED["train"], "micro_batch_tokens": 63}},
                          data={"path": str(data)})
    plain, one, two = tmp_path / "plain", tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={plain}")
    run_train(recipe, f"output_dir={one}", "train.neftune_alpha=15")
    out = _launch(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", "train.neftune_alpha=15")
    assert "NEFTune noise on the input embeddings in training (alpha 15)" in out
    assert all(r["tokens"] == 2 * 63 for r in records(one))  # full rows of an odd length: each padded by the group
    assert min(abs(a - b) for a, b in zip(losses(one), losses(plain))) > 1e-3
    _assert_equal(two, one)


def _tiny_mistral(tiny_assets: Path, out: Path, window: int | None) -> Path:
    """The tiny model as a Mistral with one K/V head (replicated to both processes) and a sliding window shorter than
    its documents (10 to 16 tokens); the same random weights for every window."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model("mistral", **{k: v for k, v in json.loads(
        (tiny_assets / "model" / "config.json").read_text()).items() if k not in ("model_type", "architectures")})
    config.num_key_value_heads, config.sliding_window = 1, window
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_assets / "model").save_pretrained(out)
    return out


@pytest.mark.slow
def test_a_sliding_window_and_a_replicated_kv_head_stay_exact(tiny_assets, tmp_path, free_port):
    model = _tiny_mistral(tiny_assets, tmp_path / "mistral", window=4)
    recipe = write_recipe(tiny_assets, tmp_path, **{**PACKED, "model": {"attn_implementation": "auto",
                                                                         "name_or_path": str(model)}},
                          data={"eval_split": str(tiny_assets / "data" / "eval.jsonl")})
    one, two, unwindowed = tmp_path / "one", tmp_path / "two", tmp_path / "unwindowed"
    run_train(recipe, f"output_dir={one}", "train.eval_every_steps=2")
    out = _launch(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", "train.eval_every_steps=2")
    assert "each sequence split over 2 processes" in out and "1 data-parallel rank (2 processes" in out
    _assert_equal(two, one)
    # the eval runs on the slices too, its per-example sums summed over the group
    evals, reference = records(two, "eval"), records(one, "eval")
    assert len(evals) == 2
    for key in ("eval_loss", "eval_token_accuracy", "eval_teacher_forced_match"):
        assert [e[key] for e in evals] == pytest.approx([e[key] for e in reference], abs=1e-6)
    # not vacuous: without the window the same weights train to other losses from the first step on
    wide = _tiny_mistral(tiny_assets, tmp_path / "mistral-wide", window=None)
    run_train(recipe, f"output_dir={unwindowed}", f"model.name_or_path={wide}")
    assert abs(records(unwindowed)[0]["loss"] - records(one)[0]["loss"]) > 1e-3


@pytest.mark.slow
def test_attention_sinks_split_with_the_heads_train_what_one_process_trains(tiny_assets, tmp_path, free_port):
    """GPT-OSS's sinks (one per query head) under sequence parallelism: each process attends with its share of the
    heads and takes those heads' sinks, their gradient summed over the group as every other one; a window shorter than
    the documents. Before, the whole sinks met half the heads (refused in the varlen attention)."""
    tiny_gpt_oss(tiny_assets, tmp_path / "gpt-oss", window=4, sinks=True)
    recipe = write_recipe(tiny_assets, tmp_path, **{**PACKED, "model": {"attn_implementation": "auto",
                                                                         "name_or_path": str(tmp_path / "gpt-oss")}})
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={one}")
    out = _launch(CPU_DDP, 2, free_port, recipe, f"output_dir={two}")
    assert "each sequence split over 2 processes" in out
    # k_proj: softmax ignores a shift shared by every key, so some of its gradient is rounding alone, which Adam scales
    # to a step of about lr (1e-3): 1.7e-5 after 4 steps on one host (under 1e-5 on others); the losses stay to 1e-6
    _assert_equal(two, one, weights=5e-5)
    sinks = [k for k in _final(one) if k.endswith("sinks")]
    assert sinks and max_abs_diff({k: _final(two)[k] for k in sinks}, {k: _final(one)[k] for k in sinks}) < 1e-6


# main tier: test_a_checkpoint_of_sequence_parallelism_resumes_on_one_process, kill -9 in test_preemption.py
@pytest.mark.extended
@pytest.mark.slow
def test_kill_9_and_a_resume_equal_the_uninterrupted_run_to_the_bit(tiny_assets, tmp_path, free_port):
    recipe = write_recipe(tiny_assets, tmp_path, **{**PACKED, "train": {**PACKED["train"], "max_steps": 300}},
                          checkpoint={"every_steps": 3, "save_final": True})
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    _launch(CPU_DDP, 2, free_port + 2, recipe, f"output_dir={straight}")  # the same layout, uninterrupted
    kill_launch_mid_run(CPU_DDP, 2, free_port, recipe, "parallel.sequence_parallel=2", out=cut)
    assert len(records(cut)) < 300
    launch_finetune(CPU_DDP, 2, free_port + 1, recipe, "parallel.sequence_parallel=2", f"output_dir={cut}",
                    resume="auto")
    ours = {r["step"]: r["loss"] for r in records(cut)}  # a step logged twice (after its checkpoint): the resume's
    assert [ours[s] for s in sorted(ours)] == [r["loss"] for r in records(straight)]  # to the bit
    assert max_abs_diff(_final(cut), _final(straight)) == 0.0


@pytest.mark.slow
@pytest.mark.extended  # main tier: two processes of one sequence (full), FSDP against one process (test_fsdp.py)
@pytest.mark.parametrize("mode", ["sft", "dpo-full"])
def test_four_processes_sequence_2_by_fsdp_2_equal_one(tiny_assets, tmp_path, free_port, mode):
    """SFT, and DPO's full fine-tune (its reference precomputed over the sharded model's slices, each pair's
    log-probabilities summed over its group): 2 data ranks of 2 processes of one sequence equal one process."""
    pairs = {"preference": {"loss": "dpo", "beta": 0.1},
             "data": {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference"}}
    recipe = write_recipe(tiny_assets, tmp_path, **{**PACKED, "train": {**PACKED["train"], "max_steps": 2},
                                                    **(pairs if mode == "dpo-full" else {})})
    one, four = tmp_path / "one", tmp_path / "four"
    run_train(recipe, f"output_dir={one}", "train.grad_accum_steps=4")  # 2 data ranks x 2 micro-batches
    out = _launch(CPU_FSDP, 4, free_port, recipe, f"output_dir={four}")
    assert "2 data-parallel ranks (4 processes, each sequence over 2)" in out
    _assert_equal(four, one)


@pytest.mark.slow
@pytest.mark.extended  # each process compiles its layers: 4 minutes on 2 cores
def test_compiled_layers_on_two_processes_of_one_sequence_train_what_one_compiled_process_trains(tiny_assets, tmp_path,
                                                                                                free_port):
    recipe = write_recipe(tiny_assets, tmp_path, **PACKED)
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={one}", "model.compile=true")
    out = _launch(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", "model.compile=true")
    assert "compile: 2 decoder layers" in out and "each sequence split over 2 processes" in out
    _assert_equal(two, one)


@pytest.mark.slow
def test_a_checkpoint_of_sequence_parallelism_resumes_on_one_process(tiny_assets, tmp_path, free_port):
    """The data position is kept per data-parallel rank, and a sequence group is one rank: a checkpoint written by 2
    processes sharing each sequence resumes on 1 process (the same bins a step), and trains on as the run that never
    split its sequences, to float rounding."""
    recipe = write_recipe(tiny_assets, tmp_path, **{**PACKED, "train": {**PACKED["train"], "schedule": "constant"}},
                          checkpoint={"every_steps": 2})
    one, cut = tmp_path / "one", tmp_path / "cut"
    run_train(recipe, f"output_dir={one}")
    _launch(CPU_DDP, 2, free_port, recipe, f"output_dir={cut}", "train.max_steps=2")
    run_train(recipe, f"output_dir={cut}", resume="auto", allow_recipe_change=True)
    assert "resumed from" in (cut / "train.log").read_text()
    _assert_equal(cut, one)


def _pairs_and_feedback(tiny_assets: Path, folder: Path) -> tuple[Path, Path]:
    """Preference pairs (prepare-tiny's) and unpaired feedback from the tiny task: the reversed string desirable (even
    rows), the string as given undesirable (odd rows)."""
    lines = (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[:64]
    feedback = [{"prompt": r["prompt"], "completion": r["completion"] if i % 2 == 0 else " " + r["prompt"].split()[1],
                 "label": i % 2 == 0} for i, r in enumerate(map(json.loads, lines))]
    (folder / "feedback.jsonl").write_text("".join(json.dumps(r) + "\n" for r in feedback))
    return tiny_assets / "data" / "train_pairs.jsonl", folder / "feedback.jsonl"


# Each mode whose loss reads whole sequences: the sections it trains with, a LoRA reference (DPO: the disabled adapter,
# with aot's sort of the micro-batch's margins; KTO: with its KL sequences) or a full fine-tune's (DPO: precomputed
# before the first step, LD-DPO's token weights on each slice's tokens, WPO's weights from every slice's; a reward
# model's head)
WHOLE_SEQUENCES = {
    "dpo-lora": ("pairs", {"preference": {"loss": "aot", "beta": 0.1}, "lora": LORA}),
    "dpo-full": ("pairs", {"preference": {"loss": "dpo", "beta": 0.1, "ld_alpha": 0.5, "wpo": True}}),
    "kto-lora": ("feedback", {"kto": {"beta": 0.1}, "lora": LORA}),
    "reward-model": ("pairs", {"reward_model": {}}),
}


@pytest.mark.slow
# dpo-lora and dpo-full extended (make test-portable runs them; dpo-full 62 s): the main tier's kto-lora runs the same
# policy and disabled-adapter passes through sequence_logps, and the reward model the pairs' sums over the slices
@pytest.mark.parametrize("mode", [pytest.param(m, marks=[pytest.mark.extended] * (m in ("dpo-lora", "dpo-full")))
                                  for m in WHOLE_SEQUENCES])
def test_modes_of_whole_sequences_train_on_two_processes_of_one_sequence_as_on_one(tiny_assets, tmp_path, free_port,
                                                                                   mode):
    """Preference pairs, KTO and a reward model read each sequence's whole log-probability (or its last token's score):
    under sequence parallelism 2 each sequence's sum (or score) is added over the group's slices, and the loss,
    its statistics, the eval and the weights equal one process's on the whole rows."""
    kind, sections = WHOLE_SEQUENCES[mode]
    pairs, feedback = _pairs_and_feedback(tiny_assets, tmp_path)
    data = {"path": str(pairs if kind == "pairs" else feedback), "format": "preference" if kind == "pairs" else
            "unpaired", "eval_split": 0.01 if kind == "pairs" else 0.1}  # 45 pairs, 6 examples
    budget = {"micro_batch_tokens": 96} if kind == "pairs" else {"micro_batch_size": 4}
    recipe = write_recipe(tiny_assets, tmp_path, data=data, model={"attn_implementation": "auto"},
                          train={"max_steps": 4, "grad_accum_steps": 2, "lr": 1e-2 if "lora" in mode else 1e-3,
                                 "eval_every_steps": 2,
                                 "micro_batch_size": 1, **budget}, **sections)
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={one}")
    out = _launch(CPU_DDP, 2, free_port, recipe, f"output_dir={two}")
    assert "each sequence split over 2 processes" in out
    ours, theirs = records(two), records(one)
    if "lora" in mode:
        _assert_equal(two, one, weights=5e-5)  # Adam at lr 1e-2 over rounding-size gradients: dpo-lora 1.2e-5
    else:
        # The first step's gradient to 1e-6 (a scale error would show here: Adam's update would hide it). Then Adam
        # moves every weight by about lr whatever its gradient's size, so a gradient of rounding size (1e-9 on one
        # side, -1e-9 on the other) moves it by lr either way: the later steps agree to 1e-4
        assert ours[0]["loss"] == pytest.approx(theirs[0]["loss"], abs=1e-6)
        assert ours[0]["grad_norm"] == pytest.approx(theirs[0]["grad_norm"], rel=1e-6)
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in ours] == pytest.approx([r[key] for r in theirs], rel=1e-4)
        assert [r["tokens"] for r in ours] == [r["tokens"] for r in theirs]
        assert max_abs_diff(_final(two), _final(one)) < 2e-4
    stat = {"pairs": "rewards/margins", "feedback": "kl"}[kind] if mode != "reward-model" else "margin"
    assert [r[stat] for r in ours] == pytest.approx([r[stat] for r in theirs], abs=1e-5)
    assert any(r[stat] != 0 for r in theirs)  # not vacuous: the policy moved from its reference
    evals, reference = records(two, "eval"), records(one, "eval")
    assert [e["eval_loss"] for e in evals] == pytest.approx([e["eval_loss"] for e in reference], abs=1e-6)
    if kind == "pairs" and mode != "reward-model":  # TRL's token metrics: each slice's tokens' sums, added up
        for key in ("entropy", "logits/chosen", "logits/rejected"):
            assert [r[key] for r in ours] == pytest.approx([r[key] for r in theirs], rel=1e-5, abs=1e-6), key
            assert [e[f"eval_{key}"] for e in evals] == pytest.approx([e[f"eval_{key}"] for e in reference],
                                                                       rel=1e-5, abs=1e-6), key


# Online RL: random-init tiny model, a vowel reward (groups whose rewards differ) and answer_match riding along; LoRA
# with beta > 0 (the reference is the disabled adapter: GRPO's per token in the loss, RLOO's summed into the reward
# during the rollout), the update in passes of a token budget, two updates a generation round (step 2 reuses step 1's
# completions against their old log-probabilities, taken on the first process over whole rows and sliced)
RL = {"num_generations": 4, "max_completion_tokens": 8, "temperature": 1.0, "beta": 0.1, "micro_batch_tokens": 96,
      "num_iterations": 2,
      "rewards": [{"type": "format", "pattern": "[aeiou]"}, {"type": "answer_match", "column": "completion"}]}
# grpo: GSPO's ratio a completion (its mean log-ratio summed over the slices, each slice's loss reading it),
# off-policy sequence masking (a completion's mean drift summed over the slices alike) at 1e-5, which binds in a
# round's second update (its policy loss -0.220 against -0.070 unmasked) and not in its first, whose drift is rounding
# noise (at 0 the mask followed that noise's sign, which one process's forward and the slices' need not share: step
# 3's policy loss halved under the entropy bonus below), and the adaptive entropy bonus (its mean over the step's
# tokens of every slice; the controller moved by the slices' summed entropy), and the sampler correction a
# completion (its ratio from whole rows on the group's first process, each slice's tokens weighed by it)
ONLINE = {"grpo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "off_policy_mask_threshold": 1e-5,
                   "use_adaptive_entropy": True, "entropy_target": 100.0, "entropy_coef": 0.1,
                   "entropy_coef_delta": 0.05, "sampler_correction": "sequence_truncate"},
          # rloo: 2 micro-batches a step (below), sampled in one call and shared over the group
          "rloo": {"algorithm": "rloo", "normalize_advantages": True, "generation_batch": "step"},
          # vespo: a completion's weight from its tokens' summed log-ratios over the slices; the entropy quantile
          # over every slice's tokens
          "vespo": {"loss_type": "vespo", "top_entropy_quantile": 0.2, "sampler_correction": "token_mask"}}


SUMS = """
import json, sys
import torch, torch.distributed as dist
from llmtrain.parallel.sequence.shards import sequence_sum, shared_sum
dist.init_process_group("gloo")
rank, out = dist.get_rank(), {}
for name, total in (("sequence_sum", sequence_sum), ("shared_sum", shared_sum)):
    part = torch.tensor([1.0 + rank, 2.0], requires_grad=True)  # this process's part of each of 2 sequences
    whole = total(part, group=dist.group.WORLD)
    loss = (rank + 1) * whole[0] if name == "shared_sum" else whole[0] * 3  # each its own loss / every one the same
    loss.backward()
    out[name] = [whole.tolist(), part.grad.tolist()]
open(sys.argv[1] + f"/rank{rank}.json", "w").write(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
from llmtrain.cli import exit_now  # as a launched run leaves: without the interpreter's teardown, where a gloo thread
exit_now(0)  # can abort the process ("terminate called without an active exception", twice in full suites)
"""


@pytest.mark.slow
def test_a_sum_over_the_slices_gives_each_part_the_gradient_of_the_loss_it_feeds(free_port, tmp_path):
    """Two processes, each a part of two sequences' sums. sequence_sum (RLOO's log-probability: every process computes
    the same loss from the sum) passes the gradient through, so each part gets the loss's gradient once: 3. shared_sum
    (GSPO's ratio: each process's loss reads it for its own slice's tokens, losses 1 x and 2 x the sum) sums the
    processes' gradients: each part gets the total loss's, 1 + 2 = 3, where passing through would give 1 and 2."""
    import os
    import subprocess
    import sys

    script = tmp_path / "sums.py"
    from helpers import open_port

    script.write_text(SUMS)
    for port in (free_port, open_port()):  # once more on another port where another test took this one first
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(port), str(script), str(tmp_path)], capture_output=True,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        if done.returncode == 0 or "address already in use" not in (done.stdout + done.stderr).lower():
            break
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["sequence_sum"] == [[3.0, 4.0], [3.0, 0.0]]
        assert got["shared_sum"] == [[3.0, 4.0], [3.0, 0.0]]


@pytest.mark.slow
# fsdp (extended): the rollout's gathered model, the first process sampling alone inside it, the slices' passes
# sharded over both processes; rloo-full-fsdp: a full fine-tune, its frozen copy sharded and gathered for the rollout
# (rollouts.held_whole), where the first process alone runs its KL passes; rloo-full (extended): the copy whole, which
# attended with the group's all-to-all there and hung before stop 98
@pytest.mark.parametrize("algorithm, config", [("grpo", CPU_DDP),
                                               ("rloo", CPU_DDP),
                                               ("vespo", CPU_DDP),
                                               pytest.param("rloo", CPU_FSDP, marks=pytest.mark.extended),
                                               ("rloo-full", CPU_FSDP),
                                               pytest.param("rloo-full", CPU_DDP, marks=pytest.mark.extended),
                                               pytest.param("rloo-sync", CPU_FSDP, marks=pytest.mark.extended)],
                         ids=["grpo", "rloo", "vespo", "rloo-fsdp", "rloo-full-fsdp", "rloo-full", "rloo-sync-fsdp"])
def test_online_rl_on_two_processes_of_one_sequence_samples_and_trains_what_one_process_does(tiny_assets, tmp_path,
                                                                                             free_port, algorithm,
                                                                                             config):
    """Each process of the group samples half of its micro-batch's completions (every other one) and gets the other
    half; the first scores them (once: the rewards, rollouts.jsonl and the eval's rewards count there); every process
    trains on its slice of each packed row: GRPO's per-token loss adds up over the slices, RLOO's per-completion
    log-probability is summed over the group. The completions, rewards, losses, KL, eval and adapter equal one
    process's. RLOO's runs 2 micro-batches a step, sampled in one call (rl.generation_batch=step): a slice of prompt
    tokens alone then gave its per-token loss as a 0-d zero, which RLOO's per-completion sum refused (IndexError).
    A full fine-tune (rloo-full, lr 1e-3): the reference is the frozen copy, which the first process alone runs in
    the rollout, so under FSDP it is held gathered there (without it: a hang)."""
    full, sync = algorithm.endswith("-full"), algorithm.endswith("-sync")
    algorithm = algorithm.removesuffix("-full").removesuffix("-sync")
    # rloo-sync: LoRA's moving reference, its whole snapshot swapped into the gathered weights by the first process
    # alone (model/reference.AdapterReference.held): taken after step 3, 5 steps (rollouts at steps 1, 3 and 5), so
    # step 5's KL runs through the swap against a moved policy
    moving = {"sync_reference": {"every_steps": 3, "alpha": 1.0}} if sync else {}
    recipe = write_recipe(tiny_assets, tmp_path, model={"attn_implementation": "auto"},
                          **({} if full else {"lora": LORA}),
                          data={"format": "prompt", "max_seq_len": 32, "eval_split": str(tiny_assets / "data" /
                                                                                         "eval.jsonl"),
                                "eval_max_examples": 4},
                          rl={**RL, **ONLINE[algorithm], **moving},
                          train={"max_steps": 5 if sync else 3, "micro_batch_size": 2,
                                 "lr": 1e-3 if full else 1e-2, "eval_every_steps": 5 if sync else 3,
                                 "eval_samples": 0, "grad_accum_steps": 2 if algorithm == "rloo" else 1})
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={one}")
    out = _launch(config, 2, free_port, recipe, f"output_dir={two}")
    assert "each sequence split over 2 processes" in out
    ours, theirs = ([json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
                    for run in (two, one))
    assert [(r["step"], r["row"], r["completion_ids"], r["reward"]) for r in ours] == [
        (r["step"], r["row"], r["completion_ids"], r["reward"]) for r in theirs]  # each completion once
    assert [r["advantage"] for r in ours] == pytest.approx([r["advantage"] for r in theirs], abs=1e-6)
    _assert_equal(two, one, weights=5e-5)  # Adam at lr 1e-2 over a rounding-size difference of the gradients
    mine, reference = records(two), records(one)
    for key in ("kl", "reward", "reward_std", "completions/mean_length", "clip_ratio/region_mean",
                "vespo/phi_seq_mean", "policy_loss", "entropy_coef", "sampling/importance_sampling_ratio/mean",
                "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean"):
        assert [r.get(key) for r in mine] == pytest.approx([r.get(key) for r in reference], abs=1e-6), key
    if algorithm == "grpo":  # the bonus applied from step 2 (0.15, 0.2): the loss is not the policy's
        assert [r["entropy_coef"] for r in reference] == pytest.approx([0.15, 0.2, 0.25])
        assert reference[1]["loss"] == pytest.approx(reference[1]["policy_loss"] - 0.15 * reference[1]["entropy"])
    if algorithm != "rloo":  # the sampler's log-probabilities came through the slices: fp32, the policy's own
        assert all(r["sampling/sampling_logp_difference/max"] < 1e-5 for r in mine if "reward" in r)
    if algorithm == "vespo":  # the round's second update weighs by a moved ratio, summed over the slices
        assert abs(reference[1]["vespo/phi_seq_mean"] - 1) > 1e-4
    # every slice's tokens' (RLOO's counted the first slice's alone before)
    assert [r["entropy"] for r in mine] == pytest.approx([r["entropy"] for r in reference], rel=1e-6)
    assert any(abs(r.get("kl", 0)) > 1e-6 for r in reference)  # not vacuous: the policy moved from its reference
    assert "reward" not in reference[1]  # step 2 updated on step 1's completions
    assert [e["eval_reward"] for e in records(two, "eval")] == [e["eval_reward"] for e in records(one, "eval")]
