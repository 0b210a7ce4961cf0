"""KTO (data.format: unpaired, the kto: section): the loss and its gradient against TRL 1.16's KTOTrainer on the
same batch; the rows TRL reads (plain and conversational) encoded as SFT encodes them; bad data refused naming the
file and row; TRL's desirable/undesirable balance warning; and a short LoRA run whose loss falls."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from helpers import REPO, load_weights, max_abs_diff, records, run_train, write_recipe

from llmtrain.config import DataConfig, KTOConfig, LoraConfig, ModelConfig
from llmtrain.data.formats import encode_example
from llmtrain.data.prepare import prepare_datasets
from llmtrain.data.unpaired import balance_warning, encode_unpaired
from llmtrain.errors import LLMTrainError, RecipeError
from llmtrain.objectives.kto import KTO, kl_sequences, kto_losses

ROWS = [  # desirable and undesirable mixed, as one micro-batch
    {"prompt": "reverse abc =", "completion": " cba", "label": True},
    {"prompt": "reverse hello =", "completion": " hello", "label": False},
    {"prompt": "reverse xy =", "completion": " yx", "label": True},
    {"prompt": "reverse stop =", "completion": " spot", "label": False},
    {"prompt": "reverse pin =", "completion": " nip", "label": True},
    {"prompt": "reverse ab =", "completion": " abb", "label": False},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reversal_feedback(tiny_assets, n: int, *, start: int = 0) -> list[dict]:
    """Unpaired rows from the tiny reversal task, balanced: the reversed string desirable (even rows), the reversed
    string run on with "zz" undesirable (odd rows): something a tiny random model learns to avoid in a few steps."""
    lines = (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[start:start + n]
    return [{"prompt": r["prompt"], "completion": r["completion"] + ("" if i % 2 == 0 else "zz"), "label": i % 2 == 0}
            for i, r in enumerate(map(json.loads, lines))]


# --------------------------------------------------------------------------- the loss, by hand


def test_losses_equal_values_worked_out_by_hand():
    t = torch.tensor
    logps, ref, desirable = t([-10.0, -12.0]), t([-11.0, -11.0]), t([True, False])
    losses, rewards = kto_losses("kto", logps, ref, desirable, t(0.5), beta=0.1, desirable_weight=2.0,
                                 undesirable_weight=1.0)
    sig = lambda x: 1 / (1 + math.exp(-x))
    assert losses.tolist() == pytest.approx([2 * (1 - sig(0.1 * (1 - 0.5))), 1 - sig(0.1 * (0.5 + 1))], abs=1e-7)
    assert rewards.tolist() == pytest.approx([0.1, -0.1])
    losses, _ = kto_losses("apo_zero_unpaired", logps, ref, desirable, None, beta=0.1, desirable_weight=1.0,
                           undesirable_weight=1.0)
    assert losses.tolist() == pytest.approx([1 - sig(0.1), sig(-0.1)], abs=1e-7)


def test_the_stage_targets_keep_the_pairs_columns_and_add_the_label_and_kl_after_them(tiny_tok):
    """StageKTO's targets: StagePairs' columns as they are (each trained token's weight 1: KTO has no LD-DPO weights;
    the label must not land in that column, where a trained token among the first slots would lose its weight),
    then each completion's label at its slot and the KL estimate at every slot."""
    from contextlib import nullcontext

    from llmtrain.objectives.kto import StageKTO

    cfg = DataConfig(path="x.jsonl", format="unpaired")
    objective = KTO(KTOConfig(beta=0.1), pad_id=tiny_tok.pad_token_id, packing=True, max_seq_len=2048)
    encoded = [encode_unpaired(r, tiny_tok, cfg) for r in ROWS]
    batch, counts = objective.collate(encoded)
    assert batch["kl:input_ids"].numel() > 0  # the KL sequences are built and forwarded, but they are not data:
    lengths = [len(e["input_ids"]) for e in encoded]  # tokens and tokens_seen count the rows' own (TRL's num_tokens)
    assert (counts.tokens, counts.squares) == (sum(lengths), sum(n * n for n in lengths))  # had been twice as many
    stage = StageKTO(objective.cfg, adapter_off=nullcontext)
    slots = batch["input_ids"].numel() + 3
    target = stage.targets({**batch, "kl": 0.25}, slots)[0]
    assert target.shape == (slots, stage.WIDTH + 2)
    assert torch.equal(target[:, 4], torch.ones(slots))  # every weight 1
    n = len(ROWS)
    assert target[:n, stage.WIDTH].tolist() == [float(r["label"]) for r in ROWS]
    assert torch.equal(target[:, stage.WIDTH + 1], torch.full((slots,), 0.25))
    assert stage.stats == 7 and stage.eval_size == 9  # KTO's sums, not the pairs' statistics


def test_kl_sequences_are_each_prompt_with_the_previous_completion():
    examples = [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
                {"input_ids": [1, 5, 6], "labels": [-100, -100, 6]},
                {"input_ids": [1, 7, 8, 9, 9], "labels": [-100, -100, -100, 9, 9]}]
    kl = kl_sequences(examples, max_seq_len=5)
    assert [k["input_ids"] for k in kl] == [[1, 2, 9, 9], [1, 5, 3, 4], [1, 7, 8, 6]]
    assert [k["labels"] for k in kl] == [[-100, -100, 9, 9], [-100, -100, 3, 4], [-100, -100, -100, 6]]
    assert kl_sequences(examples, max_seq_len=3)[0]["input_ids"] == [1, 2, 9]  # cut to max_seq_len, as TRL


# --------------------------------------------------------------------------- data


def test_plain_and_conversational_rows_encode_as_sft_and_keep_the_label(tiny_tok):
    cfg = DataConfig(path="x.jsonl", format="unpaired", chat_template=True)
    sft = DataConfig(path="x.jsonl", format="prompt_completion", chat_template=True)
    plain = {"prompt": "Hi?", "completion": "Hello.", "label": False}
    chat = {"prompt": [{"role": "user", "content": "Hi?"}],
            "completion": [{"role": "assistant", "content": "Hello."}], "label": False}
    a, b = encode_unpaired(plain, tiny_tok, cfg), encode_unpaired(chat, tiny_tok, cfg)
    assert a == b and a["label"] is False
    row = encode_example({"prompt": "Hi?", "completion": "Hello."}, tiny_tok, sft)
    assert a["input_ids"] == row["input_ids"] and a["labels"] == row["labels"]


@pytest.mark.parametrize("label, problem", [
    ("yes", "row 2: 'label' (label) is 'yes' (str), not a boolean"),
    (1, "row 2: 'label' (label) is 1 (int), not a boolean"),
    (None, "row 2: 'label' (label) is missing, not a boolean"),
])
def test_a_label_that_is_not_a_boolean_is_refused_naming_file_and_row(tiny_tok, tmp_path, label, problem):
    rows = [ROWS[0], {**ROWS[1], "label": label}]
    path = tmp_path / "k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path), format="unpaired", max_seq_len=16, cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match="^" + re.escape(f"{path}, {problem}")):
        prepare_datasets(cfg, tiny_tok, seed=0)


def test_a_pair_file_is_refused_pointing_to_preference(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " c"}])
    cfg = DataConfig(path=str(path), format="unpaired", max_seq_len=16, cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match=r"look like preference pairs.*preference: section and data.format: "
                                            r"preference instead"):
        prepare_datasets(cfg, tiny_tok, seed=0)


def test_sft_given_a_pair_file_points_to_preference_and_says_what_the_mapping_trains(tiny_tok, tmp_path):
    """Supervised fine-tuning on pairs: the data.fields mapping it advised alone (completion=chosen) trains the chosen
    replies only; the refusal names the modes that learn from both (audit 11)."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " c"}])
    cfg = DataConfig(path=str(path), format="prompt_completion", max_seq_len=16, cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match=r"look like preference pairs.*preference: section and data.format: "
                                            r"preference.*data.fields.completion=chosen fine-tunes on the chosen"):
        prepare_datasets(cfg, tiny_tok, seed=0)


def test_sft_given_kto_rows_points_to_kto(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", ROWS)
    cfg = DataConfig(path=str(path), format="prompt_completion", max_seq_len=16, cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match="use KTO: data.format: unpaired with a kto: section"):
        prepare_datasets(cfg, tiny_tok, seed=0)


def test_balance_warning_follows_trl():
    assert balance_warning([True, False] * 5, desirable_weight=1.0, undesirable_weight=1.0) is None
    # 2 desirable, 8 undesirable: TRL advises desirable_weight in [4.0, 5.32] or undesirable_weight in [0.19, 0.25]
    warn = balance_warning([True] * 2 + [False] * 8, desirable_weight=1.0, undesirable_weight=1.0)
    assert "Set EITHER kto.desirable_weight in [4.0, 5.32] or kto.undesirable_weight in [0.19, 0.25]" in warn
    assert balance_warning([True] * 2 + [False] * 8, desirable_weight=4.5, undesirable_weight=1.0) is None
    assert balance_warning([True] * 2 + [False] * 8, desirable_weight=1.0, undesirable_weight=0.2) is None


def test_kto_section_and_format_go_together(tiny_assets, tmp_path):
    from llmtrain.config import load_recipe

    data = write_jsonl(tmp_path / "k.jsonl", ROWS)
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data), "format": "unpaired"}, kto={"beta": 0.1},
                          lora={"r": 4, "alpha": 8})
    assert load_recipe(recipe).kto.loss_type == "kto"
    with pytest.raises(RecipeError, match="data.format: unpaired and the kto: section go together"):
        load_recipe(recipe, ["kto=null"])
    assert load_recipe(recipe, ["lora=null"]).lora is None  # a full fine-tune: a frozen copy is the reference
    with pytest.raises(RecipeError, match="needs train.micro_batch_size of at least 2"):
        load_recipe(recipe, ["train.micro_batch_size=1"])
    # the eval's KL pairs rotate within an eval micro-batch: 1 paired each example with itself, silently
    with pytest.raises(RecipeError, match="train.eval_batch_size=1 with kto.loss_type: kto: .* paired with its own"):
        load_recipe(recipe, ["train.eval_batch_size=1"])
    apo = load_recipe(recipe, ["train.eval_batch_size=1", "kto.loss_type=apo_zero_unpaired"])
    assert apo.train.eval_batch_size == 1  # no KL term: nothing to pair


# --------------------------------------------------------------------------- against TRL


@pytest.fixture
def fresh_accelerate_state():
    """TRL's Trainer sets up Accelerate's process-wide state its own way (cpu=True); put it back afterwards."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("loss_type, weights, lora, family", [
    ("kto", (1.0, 1.0), True, "llama"), ("kto", (1.3, 0.7), True, "llama"),
    ("apo_zero_unpaired", (1.0, 1.0), True, "llama"), ("kto", (1.3, 0.7), False, "llama"),
    ("apo_zero_unpaired", (1.0, 1.0), False, "llama"), ("kto", (1.0, 1.0), True, "qwen3_moe")])
def test_loss_and_gradient_match_trl_kto_trainer(tiny_assets, tiny_tok, tmp_path, loss_type, weights, lora, family,
                                                 fresh_accelerate_state):
    """TRL's KTOTrainer (padded, its own tokenisation, KL completions rotated within the batch) against llmtrain's
    padding-free KTO on one mixed batch, fp32: the same mean loss, metrics and gradients. LoRA: the reference is the
    disabled adapter (TRL's copy of the fresh adapter, B = 0), LoRA B perturbed so the policy differs from it. Full
    fine-tune: TRL loads its ref_model from the model's folder, llmtrain keeps a frozen copy of the starting
    weights (model/reference.frozen_copy); every weight of both policies is then moved off it by the same noise. A
    tiny Qwen3-MoE under LoRA with the load-balancing loss at 0.25 (TRL's router_aux_loss_coef, llmtrain's
    model.router_aux_loss_coef), added to the mean loss from the completions' pass by both; TRL's copy runs peft's
    own merged experts, llmtrain's run them unmerged (model/lora_experts.py)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from test_families import family_model

    from llmtrain.model.loss import attach_loss
    from llmtrain.model.modeling import load_model
    from llmtrain.model.reference import Reference, frozen_copy

    coef = 0.25 if family == "qwen3_moe" else None
    folder = tiny_assets / "model" if family == "llama" else family_model(tiny_assets, tmp_path / family, family)
    torch.manual_seed(0)
    model = load_model(ModelConfig(name_or_path=str(folder), attn_implementation="eager"),
                       LoraConfig(r=4, alpha=8, dropout=0.0) if lora else None, device=torch.device("cpu"),
                       empty=False)
    reference = None if lora else frozen_copy(model, whose="kto")
    theirs_model, ours = copy.deepcopy(model), model  # before TRL patches its own copy
    for m in theirs_model.modules():  # peft's own forward for TRL's experts
        if hasattr(m, "parameter_name"):
            m.__dict__.pop("forward", None)
    # the parameters moved off the reference: LoRA's (TRL's policy adapter is "default", beside its "ref" copy)
    moved = (lambda n: "lora_" in n) if lora else (lambda n: True)
    theirs_moved = (lambda n: ".default." in n) if lora else (lambda n: True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if moved(name):
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if lora else 0.02))
    args = trl.KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(ROWS), report_to="none",
                         beta=0.1, loss_type=loss_type, desirable_weight=weights[0], undesirable_weight=weights[1],
                         max_length=None, use_cpu=True, bf16=False, fp16=False, router_aux_loss_coef=coef)
    trainer = trl.KTOTrainer(model=theirs_model, args=args, train_dataset=Dataset.from_list(ROWS),
                             processing_class=tiny_tok)
    with torch.no_grad():
        mine = dict(ours.named_parameters())
        copied = [p.copy_(mine[n]) for n, p in trainer.model.named_parameters() if theirs_moved(n)]
    assert copied and len(copied) == sum(moved(n) for n in mine)
    trainer.model.train()
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    theirs = trainer.compute_loss(trainer.model, inputs)
    theirs.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    their_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    cfg = DataConfig(path="x.jsonl", format="unpaired")
    rows = [encode_unpaired(r, tiny_tok, cfg) for r in ROWS]
    for i, row in enumerate(rows):  # the same tokens as TRL's (prompt, completion + EOS)
        tr = trainer.train_dataset[i]
        assert row["input_ids"] == tr["prompt_ids"] + tr["completion_ids"]
    for m in (ours, reference) if reference is not None else (ours,):  # as the loop's build_model does
        attach_loss(m, chunk=8, router_aux=coef)
    ours.train()
    objective = KTO(KTOConfig(loss_type=loss_type, beta=0.1, desirable_weight=weights[0],
                              undesirable_weight=weights[1]),
                    pad_id=tiny_tok.pad_token_id, packing=True, max_seq_len=2048, model=ours,
                    reference=Reference(reference) if reference is not None else None,
                    router_aux=coef)
    batch, counts = objective.collate(rows)
    assert counts.units == len(ROWS)
    loss, stats = objective.loss(ours, batch)
    (loss / counts.units).backward()
    got = objective.step_metrics(stats.tolist(), counts.units)
    our_grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}

    assert (loss.item() / counts.units) == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    if loss_type == "kto" and family == "llama":  # (the tiny MoE's estimate is clamped to 0)
        assert metrics["kl"] > 0  # the KL term is live (not clamped to 0), so it is compared too
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected") + (
            ("aux_loss",) if coef else ()):
        assert got[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    assert ("aux_loss" in got) is (coef is not None) and trainer.aux_loss_enabled is (coef is not None)
    assert their_grads and set(our_grads) == set(their_grads)
    diff = max((our_grads[n] - their_grads[n]).abs().max().item() for n in their_grads)
    scale = max(g.abs().max().item() for g in their_grads.values())
    print(f"loss ours {loss.item() / counts.units:.9f} theirs {theirs.item():.9f}; kl {metrics['kl']:.6f}; "
          f"max |grad diff| {diff:.3e} of max |grad| {scale:.3e}")
    assert diff <= 1e-6


def test_kl_sequences_take_the_whole_completion_of_a_row_max_seq_len_cut_as_trls(tiny_assets, tiny_tok, tmp_path,
                                                                                    fresh_accelerate_state):
    """Rows cut by max_seq_len (24 tokens; completions of 31): TRL rotates the uncut completions and cuts the
    assembled (prompt, other completion) sequence, so a shorter prompt takes more of a cut row's completion. The KL
    sequences had taken the cut row's (10 completion tokens for TRL's 12): a KL estimate of 0.011 for TRL's 0.196.
    The same ids as TRL's collator's, the same KL and loss (LoRA perturbed off the disabled-adapter reference)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from llmtrain.model.loss import attach_loss
    from llmtrain.model.modeling import load_model
    rows = [{"prompt": "reverse a =", "completion": " " + "abcdefghij" * 3, "label": True},
            {"prompt": "reverse bcd =", "completion": " kjihgfedcb", "label": False},
            {"prompt": "reverse c =", "completion": " " + "zyxwvutsrq" * 3, "label": False},
            {"prompt": "reverse de =", "completion": " ed", "label": True}]
    length = 24
    torch.manual_seed(0)
    ours = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"),
                      LoraConfig(r=4, alpha=8, dropout=0.0), device=torch.device("cpu"), empty=False)
    theirs_model = copy.deepcopy(ours)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    args = trl.KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to="none", beta=0.1,
                         max_length=length, use_cpu=True, bf16=False, fp16=False)
    trainer = trl.KTOTrainer(model=theirs_model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tiny_tok)
    with torch.no_grad():
        mine = dict(ours.named_parameters())
        for name, p in trainer.model.named_parameters():
            if ".default." in name:
                p.copy_(mine[name])
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    encoded = [encode_unpaired(r, tiny_tok, DataConfig(path="x.jsonl", format="unpaired", max_seq_len=length))
               for r in rows]
    assert [e["truncated"] for e in encoded] == [True, True, True, False]
    for theirs_ids, mask, kl in zip(inputs["KL_input_ids"], inputs["KL_attention_mask"],
                                    kl_sequences(encoded, length)):
        assert kl["input_ids"] == theirs_ids[mask.bool()].tolist()
    attach_loss(ours, chunk=8)
    objective = KTO(KTOConfig(beta=0.1), pad_id=tiny_tok.pad_token_id, packing=True, max_seq_len=length, model=ours)
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, inputs)
        batch, counts = objective.collate(encoded)
        loss, stats = objective.loss(ours, batch)
    assert objective.step_metrics(stats.tolist(), counts.units)["kl"] == pytest.approx(
        trainer._metrics["train"]["kl"][-1], rel=1e-5)
    assert trainer._metrics["train"]["kl"][-1] > 0.1 and loss.item() / counts.units == pytest.approx(theirs.item(),
                                                                                                     rel=1e-6)


# --------------------------------------------------------------------------- training


def _kto_recipe(tiny_assets, folder, **train):
    data = write_jsonl(folder / "kto.jsonl", reversal_feedback(tiny_assets, 400))
    return write_recipe(tiny_assets, folder, data={"path": str(data), "format": "unpaired", "max_seq_len": 32,
                                                   "eval_split": 0.1},
                        kto={"beta": 0.5}, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                        train={"max_steps": 20, "micro_batch_size": 16, "lr": 5e-3, "warmup_steps": 0, "seed": 7,
                               "eval_every_steps": 20, **train})


def test_a_short_lora_run_lowers_the_loss_and_logs_trls_metrics(tiny_assets, tmp_path):
    recipe = _kto_recipe(tiny_assets, tmp_path)
    run_train(recipe)
    lines = records(tmp_path / "run")
    # the first step's policy is the reference (LoRA B is zero): every log-ratio and the KL are 0, each loss 1/2
    assert lines[0]["loss"] == pytest.approx(0.5, abs=1e-6) and lines[0]["kl"] == 0
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"} <= lines[0].keys()
    assert sum(r["loss"] for r in lines[-3:]) / 3 < 0.3  # 0.19 measured
    assert lines[-1]["rewards/margins"] > 0
    (last_eval,) = records(tmp_path / "run", "eval")
    assert last_eval["eval_rewards/margins"] > 0 and last_eval["eval_loss"] < 0.5


def test_doctor_checks_the_data_and_warns_of_an_unbalanced_file_as_trl(tiny_assets, tmp_path):
    from llmtrain.config import load_recipe
    from llmtrain.doctor import run_doctor

    rows = reversal_feedback(tiny_assets, 60)
    recipe = _kto_recipe(tiny_assets, tmp_path)
    checks = {name: (status, detail) for name, status, detail in run_doctor(load_recipe(recipe), gpu_memory=80)}
    assert checks["desirable balance"][0] == "pass" and checks["loss mask"][0] == "pass"
    assert "fail" not in {status for status, _ in checks.values()}
    unbalanced = write_jsonl(tmp_path / "unbalanced.jsonl", [r for r in rows if r["label"]] + rows[1:10:2])
    checks = {name: (status, detail) for name, status, detail in
              run_doctor(load_recipe(recipe, [f"data.path={unbalanced}", "data.eval_split=null",
                                              "train.eval_every_steps=null"]), gpu_memory=80)}
    status, detail = checks["desirable balance"]
    assert status == "warn" and "30 desirable and 5 undesirable completions" in detail
    assert "Set EITHER kto.desirable_weight in [0.17, 0.22] or kto.undesirable_weight in [4.51, 6.0]" in detail


@pytest.mark.parametrize("label", [True, False])
def test_a_file_of_one_label_is_refused_before_anything_is_written(tiny_assets, tmp_path, label):
    """All rows desirable (or all undesirable): nothing to set them against, said in one paragraph with the counts
    (TRL's balance warning, copied, counted 1 undesirable completion and advised weights for it; issue 53)."""
    rows = [r for r in reversal_feedback(tiny_assets, 30) if r["label"] is label]
    only = write_jsonl(tmp_path / "only.jsonl", rows)
    recipe = _kto_recipe(tiny_assets, tmp_path)
    other = "undesirable \\(false\\)" if label else "desirable \\(true\\)"
    with pytest.raises(LLMTrainError, match=rf"every one of the {len(rows)} training rows of .*only.jsonl has 'label' "
                                            rf"{str(label).lower()}: .* no {other} row to set against"):
        run_train(recipe, f"data.path={only}", "data.eval_split=null", "train.eval_every_steps=null")
    assert not (tmp_path / "run").exists()


def test_inspect_data_shows_the_labels_and_their_balance(tiny_assets, tmp_path):
    """`llmtrain inspect-data` on unpaired rows: each example says whether it is desirable, and each split's counts
    follow the statistics, with TRL's advice where the balance and the weights are off."""
    from typer.testing import CliRunner

    from llmtrain.cli import app

    rows = reversal_feedback(tiny_assets, 40)
    data, held = write_jsonl(tmp_path / "k.jsonl", rows[:30]), write_jsonl(tmp_path / "e.jsonl", rows[30:])
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data), "format": "unpaired", "eval_split": str(held),
                                                       "cache_dir": str(tmp_path / "cache")},
                          kto={"beta": 0.1}, lora={"r": 4, "alpha": 8})

    def shown(*overrides: str) -> str:
        result = CliRunner().invoke(app, ["inspect-data", str(recipe), "--n", "2", *overrides],
                                    env={"COLUMNS": "240", "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    out = shown()
    assert re.search(r"example 1, (un)?desirable: \d+ tokens", out)
    assert "train: 15 desirable and 15 undesirable completions (50.0% desirable)" in out
    assert "eval: 5 desirable and 5 undesirable completions" in out
    assert "desirable balance: kto.desirable_weight=1 and kto.undesirable_weight=1 suit these counts" in out
    unbalanced = write_jsonl(tmp_path / "u.jsonl", [r for r in rows if r["label"]] + rows[1:10:2])
    out = shown(f"data.path={unbalanced}", "data.eval_split=null", "train.eval_every_steps=null")
    assert "train: 20 desirable and 5 undesirable completions (80.0% desirable)" in out
    assert "warning (desirable balance): 20 desirable and 5 undesirable completions" in out


# --------------------------------------------------------------------------- a token budget


def _equal_length_rows(tiny_assets, tiny_tok, n: int) -> tuple[list[dict], int]:
    """n rows of the reversal task that encode to one length (the commonest), mostly desirable (some undesirable):
    a token budget of k times that length packs them k to a bin, in the epoch's order."""
    rows = [{**r, "completion": r["completion"].removesuffix("zz"), "label": True}
            for r in reversal_feedback(tiny_assets, 2000)]
    cfg = DataConfig(path="x.jsonl", format="unpaired")
    lengths = [len(encode_unpaired(r, tiny_tok, cfg)["input_ids"]) for r in rows]
    common = max(set(lengths), key=lengths.count)
    same = [r for r, n_ in zip(rows, lengths) if n_ == common][:n]
    assert len(same) == n
    for r in same[::3]:
        r["label"] = False
    return same, common


def test_a_token_budget_trains_its_bins_as_micro_batches_of_examples(tiny_assets, tiny_tok, tmp_path):
    """KTO under train.micro_batch_tokens: a micro-batch is the examples its bin holds, each with its KL sequence. On
    24 rows of one length L, a budget of 4L packs them 4 to a bin in the epoch's order (best-fit decreasing keeps
    equal lengths in order), the very micro-batches train.micro_batch_size=4 makes, in another order: with the
    epoch's 6 micro-batches accumulated into one step, 2 steps of each are the same loss, KL estimate, rewards (1e-6)
    and adapter (1e-5; the window's sum in another order). The KL term is live (positive) at step 2, so a bin whose
    KL pairs were made across bins, or the budget's micro-batch taken as one example, would differ."""
    rows, length = _equal_length_rows(tiny_assets, tiny_tok, 24)
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    recipe = write_recipe(tiny_assets, tmp_path, model={"attn_implementation": "auto"},
                          data={"path": str(data), "format": "unpaired", "max_seq_len": 32},
                          kto={"beta": 0.5}, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                          train={"max_steps": 2, "micro_batch_size": 4, "grad_accum_steps": 6, "lr": 1e-2,
                                 "eps": 1e-6, "warmup_steps": 0, "seed": 7})
    run_train(recipe, f"output_dir={tmp_path / 'examples'}")
    run_train(recipe, "train.micro_batch_size=1", f"train.micro_batch_tokens={4 * length}",
              f"output_dir={tmp_path / 'tokens'}")
    assert f"bins of <= {4 * length} tokens" in (tmp_path / "tokens" / "train.log").read_text()
    got, want = records(tmp_path / "tokens"), records(tmp_path / "examples")
    assert len(got) == len(want) == 2 and want[1]["kl"] > 0.01
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=1e-5 if "/" in key else 1e-6), key
    adapter = "final/adapter_model.safetensors"
    # 1e-5: 2.7e-6 on 2026-12-02's host at the parent commit too (1e-6 held on earlier hosts); the losses, KL and
    # rewards above stay at 1e-6
    assert max_abs_diff(load_weights(tmp_path / "tokens" / adapter), load_weights(tmp_path / "examples" / adapter)) \
        < 1e-5


def test_a_budget_that_two_examples_fit_leaves_at_most_one_example_alone_an_epoch():
    """check_kl_pairs' claim about the budget's bins (batching.token_bins, best-fit decreasing): where the two longest
    examples fit the budget together, at most one bin of an epoch holds a single example; where they do not, many
    may (so the check is needed, not only prudent)."""
    from llmtrain.data.batching import token_bins

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        lengths = torch.randint(1, 200, (int(torch.randint(2, 300, (1,), generator=g)),), generator=g).tolist()
        a, b = sorted(lengths)[-2:]
        bins = token_bins(lengths, a + b + trial % 7, seed=trial, epoch=trial % 3)
        assert sorted(i for b_ in bins for i in b_) == list(range(len(lengths)))
        assert sum(len(b_) == 1 for b_ in bins) <= 1, (trial, lengths)
    lengths = [150] * 10 + [10] * 4  # two long ones exceed the budget 200: the four short ones share one long
    alone = sum(len(b_) == 1 for b_ in token_bins(lengths, 200, seed=0, epoch=0))  # one's bin (best fit), 9 alone
    assert alone == 9


def test_a_budget_that_two_examples_do_not_fit_is_refused_before_anything_is_written(tiny_assets, tiny_tok,
                                                                                    tmp_path):
    """Under a budget below the two longest examples together, a micro-batch may hold one example alone, whose KL
    term is its own implied reward: finetune stops with the `KL pairs` check (doctor's too), naming the budget that
    fits; apo_zero_unpaired (no KL term) trains under the same budget."""
    rows, length = _equal_length_rows(tiny_assets, tiny_tok, 12)
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    recipe = write_recipe(tiny_assets, tmp_path, model={"attn_implementation": "auto"},
                          data={"path": str(data), "format": "unpaired", "max_seq_len": 32},
                          kto={"beta": 0.5}, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                          train={"max_steps": 1, "micro_batch_size": 1, "micro_batch_tokens": 2 * length - 1})
    with pytest.raises(LLMTrainError) as refused:
        run_train(recipe)
    said = " ".join(str(refused.value).split())
    assert (f"the two longest training examples ({length} and {length} tokens) do not fit "
            f"train.micro_batch_tokens={2 * length - 1} together" in said), said
    assert f"Raise train.micro_batch_tokens to at least {2 * length}" in said
    assert not (tmp_path / "run").exists()
    run_train(recipe, "kto.loss_type=apo_zero_unpaired")
    assert records(tmp_path / "run")[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # the adapter's B is 0 at step 1


def test_a_resume_on_other_ranks_says_ktos_kl_estimate_is_another():
    """Audit 57: a 1-process KTO run resumed on 2 was told only dropout's streams differ, but the KL term pairs each
    rank's completions within its own micro-batch (its value at step 12: 0.0048 on 1 process, 0.0016 on 2, as an
    uninterrupted 2-process run's): the note says so; SFT's is as before."""
    from llmtrain.config import load_recipe
    from llmtrain.loop.phases import ranks_note

    kto = ranks_note(load_recipe(REPO / "recipes" / "tiny-kto.yaml"), 1, 2)
    assert kto.endswith("do not replay the original run's, and KTO's KL estimate, taken over each rank's micro-batch, "
                        "is another one (as on 2 ranks from the start).")
    assert ranks_note(load_recipe(REPO / "recipes" / "tiny.yaml"), 2, 1) == (
        "note: written by 2 data-parallel ranks, resumed on 1 (a tensor-parallel group is one rank): the same examples "
        "per step, but per-rank random streams (dropout) do not replay the original run's.")
