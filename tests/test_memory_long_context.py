"""estimate-memory with model.activation_offload and model.tiled_mlp: the tiled layer's saved bytes against what
autograd keeps on a tiny model, the offload's GPU and host bytes by hand, and --longest-context."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import estimate_memory
from test_memory_saved import TINY, R, batch_for, saved_bytes

from llmtrain.memory import activations as act
from llmtrain.memory.estimate import estimate, make_pass
from llmtrain.memory.params import _shape_from_json, load_model_shape, lora_plan
from llmtrain.memory.spec import GIB, TrainSpec

SHARD = 5


def build_tiled(layers: int, dtype: torch.dtype, lora: float | None):
    """test_memory_saved's model with the MLP tiled (before LoRA, as training does)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmtrain.model.loss import attach_loss
    from llmtrain.model.tiled_mlp import tile_mlps

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, num_hidden_layers=layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    tile_mlps(model, SHARD)
    if lora is not None:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=8, lora_dropout=lora,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
    attach_loss(model, chunk=7)
    return model


@pytest.mark.parametrize(("dtype", "lora"), [("float32", None), ("bfloat16", None), ("float32", 0.05),
                                             ("bfloat16", 0.0)])
def test_a_tiled_layer_saves_what_the_estimate_says(dtype, lora):
    """One decoder layer with its MLP tiled keeps, besides its attention half, the post-attention norm's tensors and
    the MLP's input, nothing of the MLP's (T x I) tensors: the difference of a 2- and a 1-layer model."""
    shape = _shape_from_json(json.dumps({**TINY, "num_hidden_layers": 2}), "tiny")
    spec = TrainSpec(attn_implementation="sdpa", dtype=dtype, micro_batch=2, seq_len=16, tiled_mlp=SHARD,
                     method="full" if lora is None else "lora", lora_r=R, lora_dropout=lora or 0.0)
    p = replace(make_pass(shape, spec), mask=False, dropout_mask_bytes=4)
    assert p.mlp_shard == SHARD
    batch = batch_for([16, 16], packing=False)
    one = saved_bytes(build_tiled(1, getattr(torch, dtype), lora), batch, autocast=False)
    two = saved_bytes(build_tiled(2, getattr(torch, dtype), lora), batch, autocast=False)
    adapted = lora_plan(shape, r=R).adapted[0] if lora is not None else {}
    assert two - one == act.layer_bytes(p, shape, adapted, R)
    untiled = act.layer_bytes(replace(p, mlp_shard=None), shape, adapted, R)
    assert untiled - (two - one) >= 3 * p.tokens * shape.intermediate * p.cd  # the SwiGLU's tensors at least


# extended (80 s each on 2 busy cores); main tier: test_a_tiled_layer_saves_what_the_estimate_says (a layer's bytes)
@pytest.mark.extended
@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_tiled_step_allocates_what_the_estimate_says(tmp_path, monkeypatch, method):
    """A real training step (test_memory_step's model: 4 layers of hidden 256, intermediate 688; bf16 weights, bf16
    autocast, checkpointing, LoRA r 8 without dropout or a full fine-tune) on one row of 2,048 tokens, the MLP tiled in
    8 shards of 256, its peak of live tensor bytes against the estimate's allocated peak. Tiled, the MLP's backward
    holds one shard's tensors; with the MLP alone tiled, the post-attention RMSNorm's backward after it was the
    layer's largest moment (five fp32 T x H temporaries, 10 MiB here), and the norms are now tiled with it
    (model/tiled_mlp.TILED_NORMS): measured 26.59 and 34.69 MB (LoRA, full), the estimate 26.41 and 34.97, within half
    a T x H bf16 tensor (0.5 MiB). The tiled input norm keeps the layer's input, the checkpoint's own tensor: counted
    once."""
    from test_memory_step import CFG, measured_peak

    cfg = {**CFG, "vocab_size": 256}  # a small head: the layers make the peak
    kw = {"method": "lora", "lora_r": 8, "lora_dropout": 0.0} if method == "lora" else {}
    spec = TrainSpec(**kw, dtype="bfloat16", attn_implementation="sdpa", mixed_precision="bf16", micro_batch=1,
                     seq_len=2048,
                     gradient_checkpointing=True, tiled_mlp=True)
    shape = _shape_from_json(json.dumps(cfg), "tiny")
    p = make_pass(shape, spec)
    assert (p.tokens, p.mlp_shard, p.mask) == (2048, 256, False)
    est = estimate(shape, spec)
    assert est.peak_phase == "backward_layers"
    # the norms tiled with the MLP: their backward is no longer the layer's largest moment
    assert est.breakdown["temporaries"] > act.residual_grad_bytes(p, shape) + act.norm_backward_temp(p, shape.hidden)
    measured = measured_peak(tmp_path, monkeypatch, spec, cfg)  # live tensor bytes (tests/live_bytes.py)
    assert abs(est.per_gpu_peak_allocated_bytes - measured) <= p.tokens * shape.hidden, \
        (est.per_gpu_peak_allocated_bytes, measured)


def test_a_shard_is_the_untiled_mlp_at_a_shards_tokens():
    shape = load_model_shape("mistral-7b")
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", quantize="nf4", lora_dropout=0.0,
                     gradient_checkpointing=True, micro_batch_tokens=65536, seq_len=65536, tiled_mlp=True)
    p = make_pass(shape, spec)
    assert p.mlp_shard == 4096  # true: the hidden size, as ALST
    a = lora_plan(shape, r=16).adapted[0]
    shard = replace(p, rows=1, row_len=4096, mlp_shard=None)
    assert act.tiled_shard_bytes(p, shape, a, 16) == act.mlp_tensors_bytes(shard, shape, a, 16)
    # the post-attention norm tiled with it: its input and the MLP's, bf16 each (no fp32 copy of the norm's)
    assert act.mlp_half_bytes(p, shape, a, 16) == 2 * 65536 * 4096 * 2
    # a micro-batch of one shard or less runs untiled, as model/tiled_mlp.py does
    assert make_pass(shape, spec.but(micro_batch_tokens=4096, seq_len=4096)).mlp_shard is None


def test_the_offload_keeps_two_layer_inputs_on_the_gpu_and_the_rest_on_the_host():
    """Mistral-7B QLoRA at 64K tokens, bf16: each checkpointed input is 65536 x 4096 x 2 bytes = 512 MiB; the host
    takes 31 of the 32, the GPU is spared 30 (the last layer's stays, one is in flight); the peak drops by at least
    29 of them (at a layer's backward the GPU holds its own and the prefetched next one)."""
    shape = load_model_shape("mistral-7b")
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", quantize="nf4",
                     gradient_checkpointing=True,
                     micro_batch_tokens=65536, seq_len=65536)
    plain, off = estimate(shape, spec), estimate(shape, spec.but(activation_offload=True))
    one = 65536 * 4096 * 2
    assert off.long_context == {"offload_host_bytes": 31 * one, "offload_gpu_saved_bytes": 30 * one}
    assert plain.long_context == {}
    assert 29 * one <= plain.per_gpu_peak_allocated_bytes - off.per_gpu_peak_allocated_bytes <= 30 * one
    # 400K tokens: 3.125 GiB a layer input, which torch's pinned (caching host) allocator takes as a 4 GiB block
    at_400k = estimate(shape, spec.but(activation_offload=True, micro_batch_tokens=409600, seq_len=409600))
    assert at_400k.long_context["offload_host_bytes"] == 31 * 4 * GIB
    with pytest.raises(Exception, match="needs gradient checkpointing"):
        estimate(shape, spec.but(activation_offload=True, gradient_checkpointing=False))


def test_everything_on_a_7b_qlora_costs_about_100_kb_a_token():
    """With checkpointing, offload and the tiled MLP, a 7B QLoRA step (bf16, LoRA without dropout) allocates about 100 KB
    a token beyond the weights, at 128K and at 512K (102.9 and 100.0): the recomputed attention half (54 KB) and
    attention's backward (44 KB). It was ~170 KB while the layer's two RMSNorms ran untiled (their fp32 input copies,
    and five fp32 T x H temporaries in each backward: 100 KB a token, issue 53, item 13)."""
    shape = load_model_shape("mistral-7b")
    for n in (131072, 524288):
        spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", quantize="nf4", lora_dropout=0.0,
                         gradient_checkpointing=True, micro_batch_tokens=n, seq_len=n, activation_offload=True,
                         tiled_mlp=True)
        est = estimate(shape, spec)
        per_token = (est.per_gpu_peak_allocated_bytes - est.breakdown["weights"]) / n
        assert 95_000 < per_token < 110_000, per_token


def test_longest_context_finds_the_longest_that_fits_with_room():
    out = estimate_memory("--model", "mistral-7b", "--method", "lora", "--quantize", "nf4", "--mixed-precision",
                          "bf16", "--grad-checkpointing", "--activation-offload", "--tiled-mlp", "--longest-context",
                          "--json")
    got = json.loads(out.stdout)
    n = got["longest_context_tokens"]
    assert n % 1024 == 0 and n >= 300_000, n
    assert got["spec"]["micro_batch_tokens"] == got["spec"]["seq_len"] == n
    shape = load_model_shape("mistral-7b")
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", quantize="nf4",
                     gradient_checkpointing=True,
                     activation_offload=True, tiled_mlp=True, micro_batch_tokens=n, seq_len=n)
    assert estimate(shape, spec).per_gpu_peak_bytes <= 0.9 * 80 * GIB < \
        estimate(shape, spec.but(micro_batch_tokens=n + 1024, seq_len=n + 1024)).per_gpu_peak_bytes
    plain = json.loads(estimate_memory("--model", "mistral-7b", "--method", "lora", "--quantize", "nf4",
                                       "--mixed-precision", "bf16", "--grad-checkpointing", "--longest-context",
                                       "--json").stdout)["longest_context_tokens"]
    assert plain < n / 3  # checkpointing alone: under a third of the length


def test_the_docs_model_command_gives_the_docs_table():
    """docs/long-context.md's `--model` command (LoRA dropout 0, as its table and the long-context recipes) gives the
    table's Mistral-7B "+ both" row (654,336 tokens); without --lora-dropout it is the schema's 0.05 (each attention
    adapter keeps its own dropped copy of its input), a shorter context (issue 53, item 5)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "long-context.md").read_text()
    command = next(b for b in doc.split("```") if "--model mistral-7b" in b and "--longest-context" in b)
    args = command[command.index("--model"):].replace("\\\n", " ").split()
    assert "--lora-dropout" in args
    table = next(line for line in doc.splitlines() if line.startswith("| + both |"))
    documented = int(table.split("|")[-3].strip(" *").replace(",", ""))
    assert json.loads(estimate_memory(*args, "--json").stdout)["longest_context_tokens"] == documented == 654_336
    at = args.index("--lora-dropout")
    dropped = args[:at] + args[at + 2:]
    assert json.loads(estimate_memory(*dropped, "--json").stdout)["longest_context_tokens"] < documented


def test_overrides_after_model_name_the_options_that_set_them():
    """`--model ... lora.dropout=0` is not a recipe: the refusal says which option sets each key, not "give either a
    RECIPE.yaml or --model"."""
    out = estimate_memory("--model", "mistral-7b", "--method", "lora", "lora.dropout=0", "train.grad_accum_steps=4",
                          "model.gradient_checkpointing=true", "data.foo=1", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "not both" not in out.stderr
    for said in ("lora.dropout=0 is --lora-dropout 0", "train.grad_accum_steps=4 is --grad-accum 4",
                 "model.gradient_checkpointing=true is --grad-checkpointing", "data.foo=1 has no option"):
        assert said in " ".join(out.stderr.split()), out.stderr


def test_longest_context_that_nothing_reaches_exits_4():
    out = estimate_memory("--model", "mistral-7b", "--method", "full", "--longest-context", "--gpu-memory", "24",
                          check=False)
    assert out.returncode == 4 and "not even 1,024 tokens fit" in out.stdout


def test_doctor_checks_the_offloads_host_ram_against_the_machine():
    from llmtrain.doctor import check_host_offload

    shape = load_model_shape("mistral-7b")
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", quantize="nf4",
                     gradient_checkpointing=True,
                     micro_batch_tokens=262144, seq_len=262144, activation_offload=True, tiled_mlp=True)
    est = estimate(shape, spec)  # 31 x 262144 x 4096 x 2 bytes = 62 GiB
    (name, status, detail), = check_host_offload(est, host_memory=128 * GIB)
    assert (name, status) == ("host memory", "pass") and "62.0 GiB of pinned host RAM per node" in detail
    (name, status, detail), = check_host_offload(est, host_memory=32 * GIB)
    assert status == "warn" and "more than this machine's 32.0 GiB" in detail
    assert check_host_offload(estimate(shape, spec.but(activation_offload=False)), host_memory=32 * GIB) == []
    ddp = estimate(shape, spec.but(strategy="ddp", num_gpus=8))  # 8 processes a node, each its own
    assert "496.0 GiB of pinned host RAM per node" in check_host_offload(ddp, host_memory=None)[0][2]


def test_longest_context_past_the_models_positions_says_so():
    """Mistral-7B (max_position_embeddings 32,768) QLoRA with checkpointing reaches ~79K tokens: memory allows it,
    the model was not trained for it, and the answer says how to go there (model.rope_scaling); a length within the
    positions (24 GiB) says nothing of it."""
    args = ["--model", "mistral-7b", "--method", "lora", "--mixed-precision", "bf16", "--dtype", "bfloat16",
            "--grad-checkpointing", "--longest-context"]
    out = estimate_memory(*args).stdout
    flat = " ".join(out.split())
    assert "past the model's max_position_embeddings=32,768" in flat and "model.rope_scaling" in flat, flat
    assert max(map(len, out.splitlines())) <= 80  # wrapped as the tables are (it had been one line of 543)
    small = " ".join(estimate_memory(*args, "--gpu-memory", "24").stdout.split())
    assert "longest context that fits one 24 GiB GPU" in small and "max_position_embeddings" not in small, small


def test_a_bare_model_estimate_says_it_assumed_fp32_without_autocast():
    """--model with no dtype or precision is a recipe's defaults (fp32, no autocast): said, with the options of a
    bf16 run, so that 119 GiB for Mistral-7B is not read as what a full fine-tune needs; not said when one is given."""
    bare = " ".join(estimate_memory("--model", "mistral-7b", check=False).stdout.split())
    assert "float32 weights and no autocast, a recipe's defaults" in bare and "--mixed-precision bf16" in bare
    given = " ".join(estimate_memory("--model", "mistral-7b", "--mixed-precision", "bf16", check=False).stdout.split())
    assert "float32 weights and no autocast" not in given


def test_under_tensor_parallelism_a_tiled_shard_is_the_split_mlp_at_a_shards_tokens():
    """model.tiled_mlp under FSDP x TP (it trains: tests/test_tp.py): each GPU's shard recompute holds its own
    1/tp of the MLP's columns, so the estimate takes the tiled MLP on the tensor-parallel slice as it takes the
    untiled one (was: "the tiled MLP is refused under tensor parallelism")."""
    from llmtrain.memory.params import tensor_parallel_shape

    shape = load_model_shape("llama-3-8b")
    spec = TrainSpec(strategy="fsdp", num_gpus=8, tp=2, dtype="bfloat16", mixed_precision="bf16",
                     gradient_checkpointing=True, micro_batch=1, seq_len=65536, tiled_mlp=True)
    assert spec.validate() is spec  # no problem said
    split = tensor_parallel_shape(shape, 2)
    p = make_pass(split, spec)
    assert (p.mlp_shard, split.intermediate) == (4096, 14336 // 2)
    shard = replace(p, rows=1, row_len=4096, mlp_shard=None)
    assert act.tiled_shard_bytes(p, split, {}, 0) == act.mlp_tensors_bytes(shard, split, {}, 0)
    assert act.tiled_shard_bytes(p, split, {}, 0) < act.tiled_shard_bytes(make_pass(shape, spec), shape, {}, 0)
    def spared(tp: int) -> int:  # what tiling spares at the peak: the split MLP's (T x I/tp) tensors
        one = spec.but(tp=tp)
        return (estimate(shape, one.but(tiled_mlp=None)).per_gpu_peak_allocated_bytes
                - estimate(shape, one).per_gpu_peak_allocated_bytes)

    assert 0 < spared(2) < spared(1)
