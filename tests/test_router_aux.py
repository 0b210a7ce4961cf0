"""model.router_aux_loss_coef: a mixture of experts' load-balancing loss in the training loss, as transformers adds it
with output_router_logits (the model module's own load_balancing_loss_func), on tiny random Qwen3-MoE and Mixtral.

- One micro-batch: llmtrain's loss (summed cross-entropy + coefficient x the load-balancing loss x the trained tokens,
  over the trained tokens) is transformers' `model(..., labels=, output_router_logits=True).loss`, and so are the
  routers' gradients (fp32, to 1e-6); the same examples packed in one row (no mask) give the padded batch's.
- A run: the step's logged loss is the cross-entropy of the run without it plus the coefficient times the logged
  aux_loss; its routers then train differently; checkpointed layers give the same losses.
- Preference pairs (DPO) and KTO add it as TRL's DPOTrainer and KTOTrainer do: their micro-batch's mean loss plus the
  coefficient times the load-balancing loss of the policy's pass (to 1e-6 against TRL).
- A sequence group (parallel.sequence_parallel 2) adds its sums over the slices: one process's losses and aux_loss.
- Pipeline stages (parallel.pipeline_parallel 2) hand the sums on beside the hidden states, each adding its layers':
  one process's losses, aux_loss and weights (supervised, DPO and KTO).
- Where it cannot apply (a dense model, a mode whose loss llmtrain does not add it to) it is refused in one paragraph
  before anything is written.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import records, run_train, write_recipe
from test_families import family_model

from llmtrain.config import load_recipe
from llmtrain.errors import LLMTrainError

TINY = dict(hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=97)
MOE = {"qwen3_moe": dict(head_dim=16, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2),
       "mixtral": dict(num_local_experts=8, num_experts_per_tok=2)}
COEF = 0.25


def moe_model(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **TINY, **MOE[family], router_aux_loss_coef=COEF)  # transformers' weight
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def batch_of(lengths: list[int], *, packing: bool) -> dict:
    from llmtrain.data.batching import collate, with_loss_positions

    g = torch.Generator().manual_seed(1)
    examples = [{"input_ids": (ids := torch.randint(3, 97, (n,), generator=g).tolist()), "labels": ids}
                for n in lengths]
    return with_loss_positions(collate(examples, pad_id=0, packing=packing))


def router_grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]


@pytest.mark.parametrize("family", sorted(MOE))
def test_one_micro_batch_is_transformers_loss_with_output_router_logits(family):
    from llmtrain.model.attention import register
    from llmtrain.model.loss import attach_loss, compute_loss

    theirs = moe_model(family)
    padded = batch_of([12, 7, 9], packing=False)
    labels = padded["input_ids"].masked_fill(padded["attention_mask"] == 0, -100)  # every real token trained
    out = theirs(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], labels=labels,
                 output_router_logits=True)
    out.loss.backward()

    ours = copy.deepcopy(theirs)
    ours.zero_grad(set_to_none=True)
    attach_loss(ours, chunk=5, router_aux=COEF)
    loss, aux = compute_loss(ours, padded, return_aux=True)
    n = len(padded["loss_index"])
    (loss / n).backward()
    assert (loss / n).item() == pytest.approx(out.loss.item(), abs=1e-6)
    assert aux.item() == pytest.approx(out.aux_loss.item(), abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(router_grads(ours), router_grads(theirs)))
    assert len(router_grads(ours)) == 2 and out.aux_loss.item() > 1.0  # top_k 2: at least ~2, balanced or not

    # the same examples in one packed row (varlen attention, no mask): the same real tokens, the same loss
    ours.config._attn_implementation = register()
    loss_packed, aux_packed = compute_loss(ours, batch_of([12, 7, 9], packing=True), return_aux=True)
    assert loss_packed.item() == pytest.approx(loss.item(), rel=1e-6)
    assert aux_packed.item() == pytest.approx(aux.item(), rel=1e-6)
    # evaluation's loss (return_hits) is the cross-entropy alone
    with torch.no_grad():
        ce, _ = compute_loss(ours, padded, return_hits=True)
    assert ce.item() == pytest.approx(loss.item() - COEF * aux.item() * n, rel=1e-6)


def test_a_sharded_models_class_still_finds_its_load_balancing_loss():
    """FSDP2's fully_shard swaps the model's class for a subclass defined in torch's own module (found on 2 processes:
    an AttributeError on that module); the loss is looked up along the class's bases."""
    from llmtrain.model.loss import router_aux_loss

    model = moe_model("qwen3_moe")
    out = model(input_ids=torch.arange(3, 19).reshape(2, 8), output_router_logits=True)
    want = router_aux_loss(model, out.router_logits, None)
    model.__class__ = type("FSDPQwen3MoeForCausalLM", (type(model),),
                           {"__module__": "torch.distributed.fsdp._fully_shard._fsdp_init"})
    assert router_aux_loss(model, out.router_logits, None).item() == want.item() > 1.0


@pytest.mark.extended  # 2 processes; main tier: the one-process run below and the sharded class above
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ddp_and_fsdp_train_the_same_with_it(tiny_assets, tmp_path, free_port, lora):
    """2 processes of 2 examples under DDP and under FSDP: the same losses and aux_loss (each process's micro-batch
    has its own load-balancing loss, so these are the halves' token-weighted mean, not one process's 4 examples').
    Full, and under LoRA on all-linear (recipes/qwen3-30b-a3b-lora.yaml's: the router's and the experts' adapters, the
    experts' run unmerged beside them inside FSDP's gathered layers, model/lora_experts.py)."""
    from helpers import REPO, launch_finetune

    model = family_model(tiny_assets, tmp_path / "qwen3_moe", "qwen3_moe")
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(model)}, data={"eval_split": None},
                          train={"max_steps": 3, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 0},
                          **({"lora": {"r": 8, "dropout": 0.0}} if lora else {}))
    logged = {}
    for config in ("cpu_ddp.yaml", "cpu_fsdp.yaml"):
        launch_finetune(REPO / "accelerate_configs" / config, 2, free_port, recipe, f"output_dir={tmp_path / config}",
                        f"model.router_aux_loss_coef={COEF}")
        logged[config] = [v for r in records(tmp_path / config) for v in (r["loss"], r["aux_loss"])]
    assert logged["cpu_fsdp.yaml"] == pytest.approx(logged["cpu_ddp.yaml"], abs=1e-5)


def test_a_slices_sums_added_over_the_group_give_the_whole_rows_loss():
    """Under sequence parallelism each process takes transformers' sums (routed tokens and routing probability per
    expert, and the rows) over its slice's real tokens; added, they give load_balancing_loss_func of the whole row.
    The pad tokens that fill the last slice are left out (counted, they change it)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from llmtrain.model.loss import _group_balance

    torch.manual_seed(0)
    experts, top_k = 8, 2
    row = tuple(torch.randn(13, experts) for _ in range(2))  # 2 layers' router logits over a row of 13 tokens
    want = load_balancing_loss_func(row, experts, top_k, None)
    pad = torch.randn(1, experts) * 5
    slices = [(tuple(g[:7] for g in row), 7), (tuple(torch.cat([g[7:], pad]) for g in row), 6)]  # 7 + 6 real, 1 pad
    parts = []

    def kept(counts, probs, rows, *, whole):  # one process's own sums, as it hands them to the all-reduce
        parts.append((counts, probs, float(rows)))
        return counts, probs, torch.tensor(float(rows))

    for logits, real in slices:
        _group_balance(logits, experts, top_k, sums=kept, real=real, whole=False)
    total = [sum(x) for x in zip(*parts)]
    assert total[2] == 2 * 13  # each layer's real rows
    for logits, real in slices:  # every process of the group: the same loss
        got = _group_balance(logits, experts, top_k, sums=lambda *_, whole: (total[0], total[1],
                                                                              torch.tensor(total[2])), real=real,
                             whole=False)
        assert got.item() == pytest.approx(want.item(), abs=1e-6)
    with_pad = _group_balance(slices[1][0], experts, top_k, sums=kept, real=None, whole=False)  # the pad counted
    assert with_pad.item() != pytest.approx(_group_balance(slices[1][0], experts, top_k, sums=kept, real=6,
                                                           whole=False).item(), abs=1e-4)


def _two_as_one(recipe, tmp_path, port: int, layout: str) -> str:
    """The recipe under the load-balancing loss on one process (one/) and on 2 (two/, `layout`): the same tokens,
    losses and aux_loss to 1e-6 (above top_k's 2: the routers unbalanced), gradient norms to 1e-5. The launch's
    output."""
    from helpers import REPO, launch_finetune

    run_train(recipe, f"output_dir={tmp_path / 'one'}", f"model.router_aux_loss_coef={COEF}")
    out = launch_finetune(REPO / "accelerate_configs" / "cpu_ddp.yaml", 2, port, recipe,
                          f"output_dir={tmp_path / 'two'}", f"model.router_aux_loss_coef={COEF}", layout)
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert len(two) == 3 and [r["tokens"] for r in two] == [r["tokens"] for r in one]
    assert all(r["aux_loss"] > 1.0 for r in one)
    for key in ("loss", "aux_loss"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], abs=1e-6), key
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)
    return out


@pytest.mark.slow
@pytest.mark.extended  # 2 processes; main tier: the slices' sums above, and test_sequence_parallel.py's whole sequences
@pytest.mark.parametrize("mode", ["sft", "dpo-lora"])
def test_a_sequence_group_adds_it_over_its_slices_as_one_process_does(tiny_assets, tmp_path, free_port, mode):
    """Sequence parallelism 2: each process routes its slice of the packed row; the experts' routed tokens, their
    routing probabilities and the rows are added over the group before the product (the slices' padding left out),
    so the loss, aux_loss and gradient norm equal one process's on the whole row. Supervised fine-tuning (each
    process's loss its part of the group's) and DPO under LoRA (one loss, computed alike on both)."""
    model = family_model(tiny_assets, tmp_path / "qwen3_moe", "qwen3_moe")
    sections = {"preference": {"loss": "dpo", "beta": 0.1}, "lora": {"r": 4, "dropout": 0.0},
                "data": {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference",
                         "eval_split": None}} if mode == "dpo-lora" else {"data": {"eval_split": None}}
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(model), "attn_implementation": "auto"},
                          train={"max_steps": 3, "micro_batch_size": 1, "micro_batch_tokens": 90,
                                 "grad_accum_steps": 2, "lr": 1e-2 if "lora" in mode else 3e-3, "warmup_steps": 0},
                          **sections)
    out = _two_as_one(recipe, tmp_path, free_port, "parallel.sequence_parallel=2")
    assert "each sequence split over 2 processes" in out


@pytest.mark.slow
# dpo-lora extended for CI time (36 s): main tier, sft's sums through the same stages (the pair's objective on stages:
# test_pipeline.py's preference rows)
@pytest.mark.parametrize("mode", ["sft", pytest.param("sft-lora", marks=pytest.mark.extended),
                                  pytest.param("dpo-lora", marks=pytest.mark.extended),
                                  pytest.param("kto-lora", marks=pytest.mark.extended)])
def test_two_pipeline_stages_hand_on_its_sums_and_train_as_one_process(tiny_assets, tmp_path, free_port, mode):
    """parallel.pipeline_parallel 2 (one MoE layer a stage): each stage adds its layers' sums (routed tokens, routing
    probabilities, rows over the row's real tokens, its padding left out) to the earlier stage's and hands them on
    beside the hidden states; the last stage's loss adds the row's load-balancing loss (times its trained tokens,
    pairs or examples), whose gradient reaches the first stage's router back through the schedule. Supervised (full
    and LoRA), DPO and KTO under LoRA: losses, aux_loss, grad norms and final/ equal one process's; the evals through
    the stages are the objective's loss alone, as one process's. (train.eps 1e-3: where the load-balancing loss's
    gradient joins the cross-entropy's differs between one graph and two stages', and with Adam's default 1e-8 its
    first steps divide each element's gradient by its own size, so that an expert's or embedding row's near-zero
    elements carry that fp32 rounding to lr-sized moves: final/ 1.2e-5 apart after 3 steps of the full fine-tune,
    1.3e-3 under LoRA on the experts at lr 1e-2, 4e-8 with eps 1e-3, measured.)"""
    from helpers import load_weights, max_abs_diff

    lora = mode.endswith("lora")
    model = family_model(tiny_assets, tmp_path / "qwen3_moe", "qwen3_moe")
    data = {"preference": "train_pairs.jsonl", "unpaired": "train_unpaired.jsonl"}
    kind = {"dpo-lora": "preference", "kto-lora": "unpaired"}.get(mode)
    sections = {"data": {"eval_split": 0.1}, **({"lora": {"r": 4, "dropout": 0.0}} if lora else {})}
    if kind is not None:
        sections["data"].update(path=str(tiny_assets / "data" / data[kind]), format=kind)
        sections.update({"preference": {"loss": "dpo", "beta": 0.1}} if kind == "preference" else
                        {"kto": {"beta": 0.1}})
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(model), "attn_implementation": "auto"},
                          train={"max_steps": 3, "micro_batch_size": 1, "micro_batch_tokens": 90, "grad_accum_steps": 2,
                                 "lr": 1e-2 if lora else 3e-3, "warmup_steps": 0, "eval_batch_size": None,
                                 "eval_every_steps": 2, "eps": 1e-3}, **sections)
    out = _two_as_one(recipe, tmp_path, free_port, "parallel.pipeline_parallel=2")
    assert "pipeline parallelism: 2 stages" in out
    evals = [records(tmp_path / run, "eval") for run in ("one", "two")]
    assert len(evals[0]) == 2 and [r["eval_loss"] for r in evals[1]] == pytest.approx(
        [r["eval_loss"] for r in evals[0]], abs=1e-6)
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    a, b = load_weights(tmp_path / "two" / "final" / name), load_weights(tmp_path / "one" / "final" / name)
    assert max_abs_diff(a, b) < 1e-6


def test_a_runs_loss_adds_the_logged_aux_loss_and_its_routers_train_by_it(tiny_assets, tmp_path):
    model = family_model(tiny_assets, tmp_path / "qwen3_moe", "qwen3_moe")
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(model)},
                          data={"eval_split": None}, train={"max_steps": 3, "micro_batch_size": 4, "lr": 3e-3,
                                                            "warmup_steps": 0})
    run_train(recipe, f"output_dir={tmp_path / 'plain'}")
    run_train(recipe, f"output_dir={tmp_path / 'aux'}", f"model.router_aux_loss_coef={COEF}")
    run_train(recipe, f"output_dir={tmp_path / 'ckpt'}", f"model.router_aux_loss_coef={COEF}",
              "model.gradient_checkpointing=true")
    plain, aux = records(tmp_path / "plain"), records(tmp_path / "aux")
    # checkpointed layers (their routers run again in backward) give the same losses
    assert [v for r in records(tmp_path / "ckpt") for v in (r["loss"], r["aux_loss"])] == pytest.approx(
        [v for r in aux for v in (r["loss"], r["aux_loss"])], abs=1e-6)
    assert "aux_loss" not in plain[0] and all(r["aux_loss"] > 1.0 for r in aux)
    # step 1: the same weights and batch, so the same cross-entropy; the loss adds the coefficient x aux_loss
    assert aux[0]["loss"] == pytest.approx(plain[0]["loss"] + COEF * aux[0]["aux_loss"], abs=1e-5)
    assert aux[-1]["loss"] - COEF * aux[-1]["aux_loss"] != pytest.approx(plain[-1]["loss"], abs=1e-6)
    from safetensors.torch import load_file

    routers = [{k: v for k, v in load_file(tmp_path / run / "final" / "model.safetensors").items()
                if k.endswith("mlp.gate.weight")} for run in ("plain", "aux")]
    assert routers[0].keys() == routers[1].keys() and any(
        not torch.equal(routers[0][k], routers[1][k]) for k in routers[0])


@pytest.mark.parametrize("recipe, overrides, says", [
    ("tiny.yaml", [], "has no experts (a dense MLP): unset it"),
    ("tiny-reward", [], "whose loss llmtrain does not add it to"),
])
def test_where_it_cannot_apply_it_is_refused_in_one_paragraph(tiny_assets, tmp_path, recipe, overrides, says):
    if recipe == "tiny-reward":
        path = write_recipe(tiny_assets, tmp_path, reward_model={"center_rewards_coefficient": None},
                            data={"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference"})
    else:
        path = write_recipe(tiny_assets, tmp_path)
    overrides = [*overrides, f"model.router_aux_loss_coef={COEF}", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(LLMTrainError, match=re.escape(says)):
        run_train(path, *overrides)
    assert not (tmp_path / "run").exists()
    if recipe != "tiny.yaml":  # the recipe alone says it (the schema's check), before any model is read
        with pytest.raises(LLMTrainError, match=re.escape(says)):
            load_recipe(path, overrides)
