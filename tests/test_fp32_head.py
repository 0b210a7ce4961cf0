"""rl.cast_lm_head_to_fp32 (TRL's, from the ScaleRL recipe): the LM head's weight in fp32 and its logits made in fp32
outside autocast, by every caller of the head: transformers' forward (the reference sampling loop), the fast sampler's
decode step, the chunked loss of the update. Refused where the head is not a plain module of this process's."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import REPO, load_weights, max_abs_diff, records, run_train
from test_grpo_run import grpo_recipe

from llmtrain.config import load_recipe
from llmtrain.errors import LLMTrainError

pytestmark = pytest.mark.long(40)  # tests/conftest.py


def _bf16_model(tiny_assets, *, fp32_head: bool):
    from transformers import AutoModelForCausalLM

    from llmtrain.model.loss import attach_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.bfloat16).eval()
    attach_loss(model, chunk=16, fp32_head=fp32_head)
    return model


@pytest.mark.parametrize("autocast", [False, True])
def test_the_heads_logits_are_fp32_from_the_fp32_weight_in_every_call(tiny_assets, autocast):
    """With the cast: the head's weight is fp32 (the decoder's stays bf16), transformers' forward and the chunked
    per-token loss both make the logits as fp32 hidden states times the fp32 weight (bitwise for the logits; the
    token log-probabilities to 1e-6), with autocast (bf16) on or off. Without it the logits are bf16, 1.9e-3 away."""
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 40]])
    targets = torch.tensor([5, 9, 14, 3, 7, 22, 40])
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad()
    out = {}
    for cast in (False, True):
        model = _bf16_model(tiny_assets, fp32_head=cast)
        assert model.lm_head.weight.dtype == (torch.float32 if cast else torch.bfloat16)
        assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        with torch.no_grad(), context:
            hidden = model.model(input_ids=ids).last_hidden_state
            logits = model(input_ids=ids).logits
            loss, _ = model(input_ids=ids, loss_index=torch.arange(7), loss_targets=targets, per_token=True).values()
        exact = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
        out[cast] = (logits, loss, exact)
    logits, loss, exact = out[True]
    assert logits.dtype == torch.float32 and torch.equal(logits, exact)
    nll = -torch.log_softmax(exact[0, :7], -1).gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(loss.float(), nll, atol=1e-6)
    plain, _, plain_exact = out[False]
    assert plain.dtype == torch.bfloat16 and (plain.float() - plain_exact).abs().max() > 1e-3


def test_the_fast_sampler_draws_from_the_fp32_logits(tiny_assets):
    """The fast sampler's decode step calls the same head: with the cast, its log-probability of each drawn token is
    the fp32 logits' (the reference loop over transformers' forward gives the same to 1e-5 in bf16)."""
    from llmtrain.model.fast_sample import sample_fast
    from llmtrain.model.generate import sample

    model = _bf16_model(tiny_assets, fp32_head=True)
    prompts = [[1, 5, 9, 14], [1, 7, 22]]
    kw = dict(seeds=[3, 4], max_new_tokens=6, temperature=1.0, top_p=1.0, stop_ids=set(), pad_id=0, logps=True)
    with torch.no_grad():
        fast, slow = sample_fast(model, prompts, **kw), sample(model, prompts, **kw)
    for f, s in zip(fast, slow):
        assert f.ids == s.ids
        assert torch.allclose(torch.tensor(f.logps), torch.tensor(s.logps), atol=1e-5)


def test_a_bf16_grpo_run_with_the_fp32_head_trains_and_logs_the_sampler_gap(tiny_assets, tmp_path):
    """3 GRPO steps of a bf16 LoRA policy with the correction's metrics: the run trains (the adapters move), the
    resolved recipe says the head is fp32, and the sampler's distance from the update is the decoder's rounding alone
    (under 1e-2 a token here); the run without the cast draws the same step-1 tokens up to the head's rounding."""
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    recipe = grpo_recipe(tiny_assets, tmp_path, lora=lora, model={"dtype": "bfloat16"},
                         train={"max_steps": 3, "lr": 1e-2, "eval_every_steps": None},
                         checkpoint={"every_steps": None})
    run = tmp_path / "fp32-head"
    run_train(recipe, f"output_dir={run}", "rl.sampler_correction=token_truncate", "rl.cast_lm_head_to_fp32=true")
    lines = records(run)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(0 < line["sampling/sampling_logp_difference/mean"] < 1e-2 for line in lines)
    assert "cast_lm_head_to_fp32: true" in (run / "recipe.yaml").read_text()
    adapter = load_weights(run / "final" / "adapter_model.safetensors")
    assert any(v.float().abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)
    assert not any("lm_head" in k for k in adapter)


def _launched_scalerl(tiny_assets, tmp_path, *, steps: int):
    """(recipe, env) of the launched fp32-head tests: a bf16 LoRA GRPO policy under bf16 autocast with ScaleRL's pair
    (the cast given by the test, top_p 0.8 and the truncated correction), 2 prompts a process, `steps` steps; the
    environment of the kernels whose bf16 rows give the same bits whatever their count (ONEDNN_AVX2 where this
    machine's do not)."""
    from helpers import ENV, ONEDNN_AVX2, bf16_rows_change_results

    recipe = grpo_recipe(tiny_assets, tmp_path, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                         model={"dtype": "bfloat16"}, rl={"top_p": 0.8, "sampler_correction": "token_truncate"},
                         train={"max_steps": steps, "lr": 1e-2, "mixed_precision": "bf16", "eval_every_steps": None,
                                "micro_batch_size": 2},
                         checkpoint={"every_steps": None})
    return recipe, ONEDNN_AVX2 if bf16_rows_change_results() else ENV


@pytest.mark.slow
def test_two_fsdp_processes_gather_the_head_in_fp32_and_train_what_two_ddp_processes_train(tiny_assets, tmp_path,
                                                                                          free_port):
    """Under FSDP with bf16 mixed precision the launch's policy would gather every weight in bf16, the fp32 head's
    too (refused before 2026-12-05; its fp32 input against a bf16 weight would not even multiply): the head is a
    unit of its own, gathered and reduced in fp32 (fsdp.head_in_fp32). A bf16 LoRA policy under bf16 autocast,
    ScaleRL's pair (the cast and the truncated correction, top_p 0.8), 2 prompts a process: a step of 2 FSDP
    processes equals 2 DDP processes' (the same rows a process, so the same bf16 sampling: one process's 4-prompt
    batches pad them otherwise), with the same rows' kernels (ONEDNN_AVX2 where bf16 rows change results): the
    completions token for token, rewards, losses, entropies and the correction's metrics to 1e-6, the gradient norm
    to 1e-6 relative (1e-7 measured: FSDP reduce-scatters, DDP all-reduces), the adapter to 1e-5. (A second step's
    samples may differ by a token: an adapter weight 1e-8 apart can round to another bf16 value.) DDP without the
    cast makes other entropies (1.3e-4 apart: its bf16 logits), which the FSDP run does not."""
    from helpers import launch_finetune
    from test_grpo_run import CPU_DDP, CPU_FSDP, rollouts

    recipe, env = _launched_scalerl(tiny_assets, tmp_path, steps=1)
    cast = "rl.cast_lm_head_to_fp32=true"
    runs = {"ddp": (CPU_DDP, [cast]), "plain": (CPU_DDP, []), "fsdp": (CPU_FSDP, [cast])}
    for i, (name, (config, extra)) in enumerate(runs.items()):
        launch_finetune(config, 2, free_port + i, recipe, *extra, f"output_dir={tmp_path / name}", env=env)
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    assert [(r["step"], r["row"], r["completion_ids"]) for r in rollouts(fsdp)] == [
        (r["step"], r["row"], r["completion_ids"]) for r in rollouts(ddp)]
    got, want, plain = records(fsdp), records(ddp), records(tmp_path / "plain")
    assert len(got) == len(want) == 1
    for key in ("reward", "loss", "entropy", "sampling/importance_sampling_ratio/mean",
                "sampling/sampling_logp_difference/max"):
        assert got[0][key] == pytest.approx(want[0][key], abs=1e-6), key
    assert got[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-6)
    assert abs(plain[0]["entropy"] - want[0]["entropy"]) > 5e-5
    adapter = "adapter_model.safetensors"
    assert max_abs_diff(load_weights(fsdp / "final" / adapter), load_weights(ddp / "final" / adapter)) < 1e-5


@pytest.mark.parametrize("overrides, says", [
    (["lora.r=4", "lora.target_modules=[q_proj,lm_head]"],
     "lora.target_modules names lm_head (peft wraps it: an adapted or saved copy in the model's dtype)"),
    (["lora.r=4", "lora.modules_to_save=[lm_head]"], "lora.modules_to_save names lm_head"),
    # the user wrote no modules_to_save: model.new_tokens put lm_head there, and the advice had been to remove it
    (["lora.r=4", "model.new_tokens=[<tool>]"], "model.new_tokens trains the head's new rows under LoRA"),
])
def test_a_trained_lm_head_under_lora_is_refused(overrides, says):
    with pytest.raises(LLMTrainError) as refused:
        load_recipe(REPO / "recipes" / "tiny-grpo.yaml", ["rl.cast_lm_head_to_fp32=true", *overrides])
    assert says in " ".join(str(refused.value).split())


def test_fsdp_hsdp_and_tensor_parallelism_take_it_and_tied_embeddings_are_refused(tiny_assets):
    from transformers import AutoConfig

    from llmtrain import capabilities
    from llmtrain.layout import Layout

    recipe = load_recipe(REPO / "recipes" / "tiny-grpo.yaml", ["rl.cast_lm_head_to_fp32=true",
                                                               f"model.name_or_path={tiny_assets / 'model'}"])
    for layout in (Layout(processes=2, fsdp=True), Layout(processes=4, fsdp=True, mesh=True, replicate=2, shard=2),
                   Layout(processes=4, fsdp=True, mesh=True, shard=2, tp=2)):
        assert capabilities.problems(recipe, layout) == [], layout  # FSDP, HSDP, FSDP x TP: the head a unit of its own
    assert capabilities.sharding_problems(recipe) == []  # --fit may propose FSDP for it
    single = Layout(processes=1)
    config = AutoConfig.from_pretrained(tiny_assets / "model")
    assert capabilities.model_problems(recipe, single, config) == []
    config.tie_word_embeddings = True
    (tied,) = capabilities.model_problems(recipe, single, config)
    assert tied.startswith("rl.cast_lm_head_to_fp32: this llama model's LM head is its input embeddings")


def test_the_estimate_holds_the_head_in_fp32(tmp_path):
    """estimate-memory counts the cast: a LoRA run on a bf16 base holds the frozen head's vocab x hidden weights at 4
    bytes instead of 2 (Mistral-7B: 32,768 x 4,096 x 2 = 256 MiB more in every phase); a bf16 full fine-tune trains
    the head in fp32 (its weight, gradient and AdamW's two moments at 4 bytes)."""
    from test_memory_calibration import calibration_recipe

    from llmtrain.config import Recipe
    from llmtrain.memory import estimate_for_recipe

    def allocated(method: str, cast: bool) -> int:
        recipe = calibration_recipe(tmp_path, method, 2048, False, 1, 1024, "auto").model_dump()
        recipe["data"].update(format="prompt", chat_template=False, max_seq_len=512)
        recipe["train"].update(micro_batch_tokens=None, micro_batch_size=2)
        recipe["model"].update(dtype="bfloat16")
        recipe["rl"] = {"num_generations": 2, "max_completion_tokens": 64, "cast_lm_head_to_fp32": cast,
                        "rewards": [{"type": "format", "pattern": "x"}]}
        return estimate_for_recipe(Recipe.model_validate(recipe), strategy="single").per_gpu_peak_allocated_bytes

    assert allocated("lora", True) - allocated("lora", False) == 32768 * 4096 * 2
    assert allocated("full", True) > allocated("full", False)
    # a bf16 full fine-tune's head: weight and gradient at 4 bytes, AdamW's moments at 2 x 4, 8-bit AdamW's at its
    # 8-bit size whatever the parameter's dtype (the same state for the same parameters)
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec
    from llmtrain.memory.states import states

    shape, head = load_model_shape("mistral-7b"), 32768 * 4096
    for optimizer, state in (("adamw", 2 * 2 * head), ("adamw_8bit", 0)):
        plain = TrainSpec(method="full", dtype="bfloat16", mixed_precision="no", optimizer=optimizer)
        cast = states(shape, plain.but(fp32_head=True), None)
        plain = states(shape, plain, None)
        assert (cast.weights - plain.weights, cast.grads - plain.grads) == (2 * head, 2 * head)
        assert cast.optimizer - plain.optimizer == state, optimizer


def test_under_fsdp_the_estimate_gathers_the_head_in_fp32():
    """FSDP (8 GPUs, bf16 mixed precision, LoRA on a bf16 Mistral-7B) gathers the fp32 head as a unit of its own in
    fp32 (fsdp.head_in_fp32): the loss's phases hold it at 4 bytes a weight instead of bf16's 2 (32,768 x 4,096 x 2
    more), beside the head's fp32 shards (the states, 1/8 of it each); sampling's gathered model too."""
    from llmtrain.memory import estimate_run
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec

    shape, head = load_model_shape("mistral-7b"), 32768 * 4096
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", strategy="fsdp", num_gpus=8,
                     seq_len=1024, micro_batch=2, num_generations=4, max_completion_tokens=256)
    plain, cast = (estimate_run(shape, spec.but(fp32_head=f)).phase_parts for f in (False, True))
    for phase in ("loss", "backward_lm_head"):
        assert cast[phase]["fsdp_buffers"] - plain[phase]["fsdp_buffers"] == 2 * head, phase
        assert cast[phase]["weights"] - plain[phase]["weights"] == 2 * head // 8, phase  # the frozen head's shard
    assert cast["generation"]["fsdp_buffers"] - plain["generation"]["fsdp_buffers"] == 2 * head


def test_the_estimate_prices_the_heads_fp32_logits_gradient_and_input():
    """The head's backward with rl.cast_lm_head_to_fp32 holds a chunk's logits gradient at 4 bytes a logit (the
    logits are fp32), not the compute dtype's 2, and the chunk's input cast to fp32 (C x H x 4) where autocast's
    copy was: Mistral-7B, bf16 LoRA, chunks of 4,096 tokens: 4,096 x 32,768 x 2 bytes (256 MiB) more logits in the
    LM head's backward, and the input's fp32 copy (64 MiB)."""
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec

    shape = load_model_shape("mistral-7b")
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", micro_batch=4, seq_len=2048,
                     loss_chunk_tokens=4096)
    plain, cast = estimate(shape, spec), estimate(shape, spec.but(fp32_head=True))
    head = "backward_lm_head"
    assert cast.phase_parts[head]["logits"] - plain.phase_parts[head]["logits"] == 4096 * 32768 * 2
    # (a bf16 base's hidden states are bf16 already: autocast made no copy of the chunk's input, the cast makes one)
    assert cast.phase_parts[head]["temporaries"] - plain.phase_parts[head]["temporaries"] == 4096 * 4096 * 4


@pytest.mark.parametrize("method", ["lora", "full"])
def test_on_pipeline_stages_the_last_stage_alone_holds_the_fp32_head(method):
    """2 stages of Mistral-7B on a bf16 base: the cast adds the head's vocab x hidden weights at 2 bytes more to the
    last stage's frozen base (LoRA), or its weight and gradient at 2 bytes more and AdamW's moments at 2 x 2 (a full
    fine-tune); the first stage, which has no head, holds what it held without the cast (before: the LoRA stage
    counted the head's fp32 copy on every stage)."""
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.pipeline import stage_states, stages_of
    from llmtrain.memory.spec import TrainSpec

    shape, head = load_model_shape("mistral-7b"), 32768 * 4096
    plain = TrainSpec(method=method, lora_r=16, dtype="bfloat16", mixed_precision="bf16", strategy="single",
                      num_gpus=2, pipeline_parallel=2, grad_accum_steps=2, micro_batch_tokens=4096, seq_len=4096)
    cast = plain.but(fp32_head=True)
    first, last = stages_of(shape, plain)
    assert stage_states(shape, cast, first) == stage_states(shape, plain, first)
    a, b = stage_states(shape, cast, last), stage_states(shape, plain, last)
    if method == "lora":
        assert (a.weights - b.weights, a.grads - b.grads, a.optimizer - b.optimizer) == (2 * head, 0, 0)
    else:
        assert (a.weights - b.weights, a.grads - b.grads, a.grads_head - b.grads_head) == (2 * head,) * 3
        assert a.optimizer - b.optimizer == 2 * 2 * head


@pytest.mark.slow
@pytest.mark.extended  # main tier: the head gathered in fp32 under FSDP (above) and FSDP x TP's training (test_tp.py)
def test_under_fsdp_x_tp_the_head_is_gathered_in_fp32_and_trains(tiny_assets, tmp_path, free_port):
    """FSDP x TP 2 x 2 (refused before 2026-12-05): tensor parallelism leaves the head whole on each rank of a pair and
    FSDP shards it over the pairs, so it is FSDP's unit of its own as under plain FSDP (fsdp.head_in_fp32). The bf16
    LoRA policy of the FSDP test above, 2 steps: it trains (the adapter moves, every step logged with the sampler's
    gap under the correction's truncation). Without the fp32 unit the launch's policy gathers the head in bf16 and
    the first forward stops: 'expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16' (measured
    with head_in_fp32 switched off). Not compared token for token: tensor parallelism's row-wise layers sum bf16
    partial products over the pair, so its samples are not one process's or DDP's (the step's mean reward 0.5 and
    loss -3.4e-4 here against DDP's 0.5 and -2.5e-4)."""
    from helpers import launch_finetune

    recipe, env = _launched_scalerl(tiny_assets, tmp_path, steps=2)
    run = tmp_path / "tp"
    said = launch_finetune(REPO / "accelerate_configs" / "cpu_tp.yaml", 4, free_port, recipe,
                           "rl.cast_lm_head_to_fp32=true", f"output_dir={run}", env=env)
    assert "2 shards x 2 tensor-parallel" in said
    lines = records(run)
    assert [line["step"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["loss"]) and line["grad_norm"] > 0 for line in lines)
    assert all(0 < line["sampling/sampling_logp_difference/max"] < 1 for line in lines)
    adapter = load_weights(run / "final" / "adapter_model.safetensors")
    assert any(v.float().abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)
