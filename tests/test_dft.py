"""Dynamic Fine-Tuning (train.sft_loss: dft): against TRL's SFTTrainer (loss_type dft), the eval's loss left the
cross-entropy, a run whose loss is DFT's, and the modes that refuse it."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import records, run_train, write_recipe

from llmtrain.data.batching import collate, with_loss_positions
from llmtrain.data.formats import IGNORE
from llmtrain.errors import RecipeError
from llmtrain.model.loss import attach_loss, compute_loss

pytestmark = pytest.mark.long(60)  # tests/conftest.py

# (prompt, completion) token ids of unequal lengths: TRL pads them, llmtrain packs them
ROWS = [([1, 5, 9, 12], [30, 31, 32, 2]), ([1, 7], [40, 41, 42, 43, 44, 2]), ([1, 8, 8, 8, 8, 9], [50, 2])]


def _model(tiny_assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32,
                                                 attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from the init, so that tokens' probabilities differ
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _batch(tiny_tok):
    rows = [{"input_ids": p + c, "labels": [IGNORE] * len(p) + c} for p, c in ROWS]
    return with_loss_positions(collate(rows, pad_id=tiny_tok.pad_token_id, packing=True))


@pytest.fixture
def fresh_accelerate_state():
    """TRL's Trainer sets up Accelerate's process-wide state its own way (cpu=True); put it back afterwards."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def test_dft_matches_trls_sft_trainer_and_is_below_the_cross_entropy(tiny_assets, tiny_tok, tmp_path,
                                                                    fresh_accelerate_state):
    """TRL's SFTTrainer with loss_type dft (padded rows, its fused LM head) against llmtrain's packed row with dft
    attached: the mean loss to 1e-6 and every gradient within 1e-6. DFT weighs each token's -log p by p < 1, so it is
    below the cross-entropy of the same tokens."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    theirs_model = _model(tiny_assets)
    ours = copy.deepcopy(theirs_model)
    data = Dataset.from_list([{"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)} for p, c in ROWS])
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(ROWS), report_to="none",
                         loss_type="dft", use_cpu=True, bf16=False, fp16=False, max_length=None,
                         completion_only_loss=True)
    trainer = trl.SFTTrainer(model=theirs_model, args=args, train_dataset=data, processing_class=tiny_tok)
    inputs = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))]))
    theirs = trainer.compute_loss(trainer.model, inputs)

    attach_loss(ours, chunk=4, dft=True)
    batch = _batch(tiny_tok)
    tokens = len(batch["loss_index"])
    assert tokens == sum(len(c) for _, c in ROWS)
    loss = compute_loss(ours, batch) / tokens
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    with torch.no_grad():
        nll = compute_loss(ours, batch, return_hits=True)[0] / tokens  # the eval's loss: the cross-entropy
    assert loss.item() < nll.item() - 0.1
    theirs.backward()
    loss.backward()
    mine = dict(ours.named_parameters())
    assert max(p.grad.abs().max().item() for p in trainer.model.parameters()) > 1e-4
    assert max((mine[n].grad - p.grad).abs().max().item() for n, p in trainer.model.named_parameters()) < 1e-6


def test_dft_is_the_cross_entropy_weighted_by_each_tokens_probability_and_the_eval_keeps_the_cross_entropy(
        tiny_assets, tiny_tok):
    """By hand from the per-token cross-entropies of the same batch: DFT's summed loss is sum(ce x e^-ce), with the
    gradient of sum(ce x stop_gradient(e^-ce)); the same model without dft gives sum(ce); evaluation (return_hits)
    gives sum(ce) either way."""
    plain, dft = _model(tiny_assets), _model(tiny_assets)
    attach_loss(plain, chunk=4)
    attach_loss(dft, chunk=4, dft=True)
    batch = _batch(tiny_tok)
    ce = compute_loss(plain, batch, per_token=True)
    weighted = (ce * torch.exp(-ce.detach())).sum()
    got = compute_loss(dft, batch)
    assert got.item() == pytest.approx(weighted.item(), rel=1e-6)
    assert compute_loss(plain, batch).item() == pytest.approx(ce.sum().item(), rel=1e-6)
    weighted.backward()
    got.backward()
    mine = dict(dft.named_parameters())
    assert max((mine[n].grad - p.grad).abs().max().item() for n, p in plain.named_parameters()) < 1e-6
    with torch.no_grad():
        assert compute_loss(dft, batch, return_hits=True)[0].item() == pytest.approx(ce.sum().item(), rel=1e-6)


def test_a_run_trains_with_dft_and_other_modes_refuse_it(tiny_assets, tmp_path):
    """A tiny SFT run with train.sft_loss=dft: its first logged loss is below the plain run's from the same start (DFT
    is below the cross-entropy), its eval loss is the cross-entropy's scale, and it learns (the eval loss falls). A
    preference run refuses the setting, naming it."""
    data = {"path": str(tiny_assets / "data" / "train.jsonl"), "format": "prompt_completion", "max_seq_len": 32,
            "eval_split": str(tiny_assets / "data" / "eval.jsonl"), "eval_max_examples": 32,
            "cache_dir": str(tiny_assets.parent / "data-cache")}
    recipe = write_recipe(tiny_assets, tmp_path, data=data, train={"max_steps": 20, "eval_every_steps": 10})
    dft = run_train(recipe, f"output_dir={tmp_path / 'dft'}", "train.sft_loss=dft")
    plain = run_train(recipe, f"output_dir={tmp_path / 'nll'}")
    assert dft["steps"] == plain["steps"] == 20
    first = records(tmp_path / "dft")[0]["loss"], records(tmp_path / "nll")[0]["loss"]
    assert first[0] < first[1]
    evals = [r["eval_loss"] for r in records(tmp_path / "dft", "eval")]
    assert len(evals) == 2 and evals[-1] < evals[0]
    pairs = {"preference": {"loss": "dpo"},
             "data": {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference"}}
    with pytest.raises(RecipeError, match="train.sft_loss=dft weighs the token loss of supervised fine-tuning, and "
                                          "this recipe trains preference pairs"):
        from llmtrain.config import load_recipe

        load_recipe(write_recipe(tiny_assets, tmp_path, name="pairs.yaml", **pairs), ["train.sft_loss=dft"])
