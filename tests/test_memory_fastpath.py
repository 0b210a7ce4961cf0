"""estimate-memory for the fast path: the chunked loss, varlen attention, token budgets, and what the
command line says about them (the largest value of each part, LoRA's bf16 base, how many GPUs fit)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import estimate_memory

from llmtrain.errors import LLMTrainError
from llmtrain.memory import activations as act
from llmtrain.memory import estimate as estimate_module
from llmtrain.memory.estimate import estimate, make_pass
from llmtrain.memory.fit import _search, fit, more_gpus
from llmtrain.memory.params import load_model_shape
from llmtrain.memory.spec import GIB, MIB, TrainSpec, spec_from_recipe

A = 41_943_040  # LoRA r=16 on every linear of Mistral-7B


@pytest.fixture(scope="module")
def mistral():
    return load_model_shape("mistral-7b")


@pytest.fixture(autouse=True)
def torch_with_gqa(monkeypatch):
    """Numbers by hand take varlen's K/V at kv_heads (torch >= 2.12), whatever torch runs the tests."""
    monkeypatch.setattr(estimate_module, "varlen_repeats_kv", lambda: False)


# --------------------------------------------------------------------------- the loss, by hand


def test_chunked_loss_by_hand(mistral):
    # Mistral-7B LoRA, bf16 base under bf16 autocast: 8 examples of 2048 in one packed row. The head sees
    # 16384 - 8 = 16376 positions, in chunks of 4096: at most 4096 x 32768 logits at a time.
    p = make_pass(mistral, TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", micro_batch=8,
                                     seq_len=2048))
    assert (p.rows, p.row_len, p.examples, p.loss_tokens) == (1, 16384, 8, 16376)
    c = act.loss_chunk(p, 4096)
    assert c == 4096
    assert act.chunk_forward_bytes(p, 32768, c) == 4096 * 32768 * 8 == 1 * GIB  # fp32 logits + log-softmax
    assert act.chunk_backward_bytes(32768, c) == 4096 * 32768 * 12 == 1.5 * GIB
    assert act.chunk_logits_grad_bytes(p, 32768, c) == 4096 * 32768 * 2 == 256 * MIB
    # kept from forward to backward: 16376 gathered bf16 hidden states, their index and targets
    assert act.loss_input_bytes(p, mistral) == 16376 * (4096 * 2 + 16) == 134_414_208
    # the old loss held the whole micro-batch's fp32 logits: 16384 x 32768 x 12 bytes = 6 GiB
    est = estimate(mistral, TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", micro_batch=8,
                                      seq_len=2048))
    assert est.phase_parts["backward_loss"]["logits"] == 1.5 * GIB
    assert max(parts.get("logits", 0) for parts in est.phase_parts.values()) == 1.5 * GIB
    # a smaller chunk lowers the loss's backward by exactly its logits
    small = estimate(mistral, est.spec.but(loss_chunk_tokens=1024))
    assert est.phases["backward_loss"] - small.phases["backward_loss"] == 3 * 1024 * 32768 * 12


def reference_loss(head, hidden, index, targets, chunk: int) -> torch.Tensor:
    """The chunked loss in plain torch: gather the trained positions, then per chunk the LM head and an fp32
    cross-entropy under torch.utils.checkpoint, recomputed in backward."""
    from torch.utils.checkpoint import checkpoint

    gathered = hidden[index]
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, len(index), chunk):
        total = total + checkpoint(lambda h, t: F.cross_entropy(head(h).float(), t, reduction="sum"),
                                   gathered[s:s + chunk], targets[s:s + chunk], use_reentrant=False)
    return total


@pytest.mark.parametrize(("tokens", "hidden", "vocab", "chunk", "autocast"), [
    (512, 64, 8192, 128, False),  # a chunk's backward is the peak: 12 bytes a logit
    (512, 64, 8192, 4096, False),  # one chunk: the whole micro-batch's logits
    (256, 1024, 2048, 64, False),  # the head's gradients summed over chunks are the peak
    (512, 64, 8192, 128, True),  # fp32 head under bf16 autocast: cd logits, casts, cd gradients
])
@pytest.mark.parametrize("loss", ["reference", "llmtrain"])
def test_chunked_loss_peak_equals_the_formulas(tokens, hidden, vocab, chunk, autocast, loss):
    """Peak live bytes of the loss's forward and backward (torch's MemTracker), for the plain-torch reference
    and for llmtrain.model.loss.chunked_cross_entropy, against the estimate's loss phases worked out here."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    from llmtrain.model.loss import chunked_cross_entropy

    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden, requires_grad=True)
    states = torch.randn(tokens, hidden, requires_grad=True)

    def head(x):  # a function, not a module: the tracker refuses a module called once per chunk
        return F.linear(x, weight)  # as nn.Linear: autocast casts (and caches) the weight itself
    index = torch.arange(tokens)[torch.arange(tokens) % 64 != 63]  # each 64-token example's last is untrained
    targets = torch.randint(0, vocab, (len(index),))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if loss == "reference":
                total = reference_loss(head, states, index, targets, chunk)
            else:
                total = chunked_cross_entropy(states[index], head, targets, chunk=chunk)[0]
        total.backward()

    tracker = mem_tracker.MemTracker()
    tracker.track_external(weight, states, index, targets)
    with tracker:
        step()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    cd = 2 if autocast else 4
    p = act.Pass(rows=1, row_len=tokens, resid=4, cd=cd, autocast=autocast, attn="varlen", mask=False,
                 trainable_base=True, separate_casts=autocast, examples=tokens // 64)
    n, c = p.loss_tokens, act.loss_chunk(p, chunk)
    assert n == len(index)
    several = math.ceil(n / c) > 1
    G, Gw = vocab * hidden * 4, vocab * hidden * cd  # the head's fp32 gradient; as each chunk makes it
    cast, in_cast = (vocab * hidden * 2, c * hidden * 2) if autocast else (0, 0)  # autocast's copies
    h_grad = n * hidden * 4 if several else 0  # the gathered states' gradient, summed over chunks
    # the head's weight, the states, and the loss's input (gathered states, index and targets)
    fixed = vocab * hidden * 4 + tokens * hidden * 4 + act.loss_input_bytes(p, SimpleNamespace(hidden=hidden))
    moments = {
        "forward": cast + in_cast + act.chunk_forward_bytes(p, vocab, c),
        "backward_loss": (Gw if several else 0) + cast + in_cast + h_grad + act.chunk_backward_bytes(vocab, c),
        "head's backward": (2 * Gw if several else Gw) + cast + in_cast + act.chunk_logits_grad_bytes(p, vocab, c)
        + c * hidden * 4 + h_grad,
        "gradients summed": (max(3 * Gw, Gw + G * autocast) if several else Gw + G * autocast) + c * hidden * 4
        + h_grad,
    }
    predicted = fixed + max(moments.values())
    assert abs(predicted - measured) <= 16 * 1024, (moments, predicted, measured)


# --------------------------------------------------------------------------- attention, by hand


def test_attention_on_a_packed_row_by_hand(mistral):
    # Mistral-7B, bf16 compute, 8 x 2048 tokens in one row (T = 16384); Hq = 4096, Hkv = 1024, 32 heads.
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", micro_batch=8, seq_len=2048)
    T = 16384
    varlen = make_pass(mistral, spec)
    assert varlen.attn == "varlen" and not varlen.mask  # auto is varlen: no mask, ever
    # q, k, v, output and logsumexp: linear in the tokens
    flash = T * 4096 * 2 + 2 * T * 1024 * 2 + T * 4096 * 2 + 32 * T * 4
    assert act.attention_bytes(varlen, mistral, o_trainable=False) == flash == 322 * MIB
    assert act.mask_bytes(varlen) == 0
    # a torch without enable_gqa: K/V repeated to 32 heads, 2 x T x 3072 x 2 bytes more a layer
    repeated = replace(varlen, varlen_repeats_kv=True)
    assert act.attention_bytes(repeated, mistral, o_trainable=False) - flash == 2 * T * 3072 * 2 == 192 * MIB
    # sdpa on the same packed row: transformers' block-diagonal mask (T x T bool, once) and, per layer,
    # K/V repeated and the mask as a bf16 bias: the row's square, 512 MiB a layer
    sdpa = make_pass(mistral, spec.but(attn_implementation="sdpa", packing=True))
    assert sdpa.mask and (sdpa.rows, sdpa.row_len) == (1, T)
    assert act.mask_bytes(sdpa) == T * T == 256 * MIB
    assert act.attention_bytes(sdpa, mistral, o_trainable=False) == flash + 192 * MIB + T * T * 2
    # eager: fp32 probabilities and their bf16 copy, 32 x T x T each: 48 GiB a layer
    eager = make_pass(mistral, spec.but(attn_implementation="eager", packing=True))
    assert act.attention_bytes(eager, mistral, o_trainable=False) == 3 * T * 4096 * 2 + 32 * T * T * 6
    assert act.mask_bytes(eager) == T * T * 2  # an additive mask in the stream dtype
    # whole estimates: sdpa and eager on a packed row need more than varlen, by far
    peak = {a: estimate(mistral, spec.but(attn_implementation=a, packing=True)).per_gpu_peak_allocated_bytes
            for a in ("auto", "sdpa", "eager")}
    assert peak["auto"] < peak["sdpa"] - 32 * 512 * MIB < peak["eager"]


def test_padded_rows_without_varlen(mistral):
    """sdpa/eager without packing or a budget: one row per example, as before (a mask over padded rows)."""
    p = make_pass(mistral, TrainSpec(attn_implementation="sdpa", micro_batch=4, seq_len=512))
    assert (p.rows, p.row_len, p.examples, p.mask) == (4, 512, 4, True)
    one = make_pass(mistral, TrainSpec(attn_implementation="sdpa", micro_batch=1, seq_len=512))
    assert not one.mask and one.examples == 1


# --------------------------------------------------------------------------- token budgets


def test_token_budget_sets_the_tokens_of_a_micro_batch(mistral):
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", micro_batch_tokens=16384,
                     seq_len=2048)
    assert spec.packed and spec.tokens == 16384
    p = make_pass(mistral, spec)
    # one packed row of the budget, filled (the worst case) by as few examples as possible: one
    assert (p.rows, p.row_len, p.examples, p.loss_tokens) == (1, 16384, 1, 16383)
    by_count = estimate(mistral, spec.but(micro_batch_tokens=None, micro_batch=8))
    by_budget = estimate(mistral, spec)
    # the same tokens as 8 x 2048, and the same peak (the last layer's forward); only the loss's phases
    # differ, by the 7 positions more at the head: gathered (bf16, index, target) and their gradient
    assert by_budget.peak_phase == by_count.peak_phase == "forward"
    assert by_budget.per_gpu_peak_allocated_bytes == by_count.per_gpu_peak_allocated_bytes
    diff = {k: by_budget.phases[k] - by_count.phases[k] for k in by_budget.phases}
    assert diff["backward_loss"] == diff["backward_lm_head"] == 7 * (4096 * 2 + 16) + 7 * 4096 * 2
    assert diff["forward"] == diff["backward_layers"] == 0
    # a budget with sdpa still packs (batching.packs_rows): the mask is the budget's square
    assert act.mask_bytes(make_pass(mistral, spec.but(attn_implementation="sdpa"))) == 16384 ** 2
    with pytest.raises(LLMTrainError, match="micro-batch-tokens"):
        estimate(mistral, spec.but(micro_batch=4))


def _recipe(tmp_path, **train) -> dict:
    data = {"model": {"name_or_path": "mistral-7b", "dtype": "bfloat16"},
            "data": {"path": "d.jsonl", "format": "text", "max_seq_len": 2048, "eval_split": 0.1},
            "train": {"mixed_precision": "bf16", "eval_every_steps": 5, **train}, "lora": {"r": 16}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_spec_from_recipe_reads_the_fast_path_keys(tmp_path):
    from llmtrain.config import load_recipe

    spec = spec_from_recipe(load_recipe(_recipe(tmp_path, micro_batch_tokens=8192, loss_chunk_tokens=2048)))
    assert (spec.attn_implementation, spec.kernel, spec.micro_batch_tokens, spec.loss_chunk_tokens) == (
        "auto", "varlen", 8192, 2048)
    assert spec.tokens == 8192 and spec.eval_micro_batch_tokens == 8192  # eval batches by the same budget
    by_examples = spec_from_recipe(load_recipe(_recipe(tmp_path, micro_batch_size=4, eval_batch_size=16)))
    assert by_examples.micro_batch_tokens is None and by_examples.eval_micro_batch == 16
    assert by_examples.eval_micro_batch_tokens is None


# --------------------------------------------------------------------------- what a user reads


def test_cli_token_budget_and_chunk():
    res = estimate_memory("--model", "mistral-7b", "--method", "lora", "--mixed-precision", "bf16",
                          "--micro-batch-tokens", "16384", "--seq-len", "2048", "--loss-chunk-tokens", "2048", "--json")
    assert res.returncode == 4, res.stderr  # 156 GiB: does not fit
    out = json.loads(res.stdout)
    assert out["spec"]["micro_batch_tokens"] == 16384 and out["spec"]["loss_chunk_tokens"] == 2048
    assert out["largest"]["logits"]["bytes"] == 2048 * 32768 * 12  # one chunk's backward
    assert out["largest"]["logits"]["phase"] == "backward_loss"


def test_cli_offers_only_the_optimizers_the_trainer_runs():
    res = estimate_memory("--model", "mistral-7b", "--optimizer", "sgd", check=False)
    assert res.returncode == 2 and "--optimizer" in res.stderr
    out = json.loads(estimate_memory("--model", "mistral-7b", "--json").stdout)
    assert out["spec"]["optimizer"] == "adamw"
    eight = json.loads(estimate_memory("--model", "mistral-7b", "--optimizer", "adamw_8bit", "--json").stdout)
    assert eight["spec"]["optimizer"] == "adamw_8bit"  # fp32 weights: 8 bytes a parameter against 2.03
    P, E = 7_248_023_552, 32_768 * 4_096  # the embedding's moments in 32 bits (HF's adamw_bnb_8bit's choice)
    assert eight["breakdown"]["optimizer"] / out["breakdown"]["optimizer"] == pytest.approx(
        ((P - E) * 2 * (1 + 4 / 256) + 8 * E) / (8 * P))


def test_cli_lora_defaults_to_a_bf16_base_and_says_so():
    P = 7_248_023_552
    out = json.loads(estimate_memory("--model", "mistral-7b", "--method", "lora", "--json").stdout)
    assert out["spec"]["dtype"] == "bfloat16"
    assert out["breakdown"]["weights"] == 2 * P + 4 * A  # 13.66 GiB, not the fp32 base's 27
    assert any("LoRA base weights in bfloat16" in n for n in out["notes"])
    fp32 = json.loads(estimate_memory("--model", "mistral-7b", "--method", "lora", "--dtype", "float32",
                                      "--json").stdout)
    assert fp32["breakdown"]["weights"] == 4 * P + 4 * A
    assert not any("LoRA base" in n for n in fp32["notes"])
    full = json.loads(estimate_memory("--model", "mistral-7b", "--json").stdout)
    assert full["spec"]["dtype"] == "float32"  # a full fine-tune keeps the schema's default


def test_largest_value_of_each_part():
    """A full fine-tune peaks after every activation is freed, LoRA before most adapter gradients exist;
    the second column gives each part's own largest size, and where it is reached."""
    out = json.loads(estimate_memory("--model", "llama-2-7b", "--mixed-precision", "bf16", "--seq-len", "512",
                                     "--json").stdout)
    assert out["peak_phase"] == "backward_embedding" and out["breakdown"]["activations"] == 0
    assert out["largest"]["activations"]["phase"] == "loss"
    assert out["largest"]["activations"]["bytes"] == max(p.get("activations", 0) for p in out["phase_parts"].values())
    assert out["largest"]["activations"]["bytes"] > 3 * GIB
    lora = json.loads(estimate_memory("--model", "mistral-7b", "--method", "lora", "--mixed-precision", "bf16",
                                      "--micro-batch", "8", "--seq-len", "512", "--json").stdout)
    assert lora["breakdown"]["gradients"] == 0
    assert lora["largest"]["gradients"]["bytes"] == 4 * A  # the fp32 adapters' gradients, all of them
    for name, part in lora["largest"].items():
        assert part["bytes"] >= lora["breakdown"].get(name, 0)
    table = estimate_memory("--model", "llama-2-7b", "--mixed-precision", "bf16", "--seq-len", "512")
    assert table.returncode == 4 and "largest" in table.stdout and "(largest at loss)" in table.stdout  # 139 GiB


def test_fit_says_how_many_gpus_would_do(mistral):
    """Llama-2-7B full fine-tune (fp32 master weights, bf16 autocast) with AdamW fits no single 80 GiB GPU: --fit
    turns to 8-bit AdamW on it (since 2026-12-05, as LoRA turns to QLoRA); with AdamW FSDP on 2 does, and that is
    the fewest. On 40 GiB cards not even 8-bit AdamW fits one: FSDP on 4 is said."""
    shape = load_model_shape("llama-2-7b")
    spec = TrainSpec(mixed_precision="bf16", seq_len=2048)
    result = fit(shape, spec)
    assert result.best.spec.world == 1 and result.overrides[-1] == "train.optimizer=adamw_8bit"
    adamw = more_gpus(shape, spec)
    best = adamw.best
    assert best.estimate.fits and best.spec.strategy == "fsdp" and best.spec.world == 2
    assert adamw.launch_flags == ("--num_processes", "2")
    # 24 GiB cards: 8 GPUs (one node, the shipped fsdp.yaml as it is), and 4 would not do
    small = spec.but(gpu_memory_gib=24)
    found = more_gpus(shape, small)
    assert found.best.estimate.fits and (found.best.spec.num_gpus, found.best.spec.num_nodes) == (8, 1)
    assert (found.accelerate_config, found.launch_flags) == ("accelerate_configs/fsdp.yaml", ())
    assert _search(shape, small.but(strategy="fsdp", num_gpus=4), None).best is None
    # given 8 GPUs per node, more GPUs means more nodes of 8
    tiny = spec.but(gpu_memory_gib=12, strategy="fsdp", num_gpus=8)
    nodes = more_gpus(shape, tiny).best.spec
    assert nodes.num_gpus == 8 and nodes.num_nodes > 1
    assert _search(shape, tiny.but(num_nodes=nodes.num_nodes - 1), None).best is None
    forty = ("--model", "llama-2-7b", "--mixed-precision", "bf16", "--seq-len", "2048", "--gpu-memory", "40", "--fit")
    out = json.loads(estimate_memory(*forty, "--json", check=False).stdout)
    assert not out["fit"]["found"] and out["fit"]["more_gpus"]["num_gpus"] == 4
    assert "FSDP on 4 GPUs" in out["recommendation"]
    text = estimate_memory(*forty, check=False)
    assert "With FSDP on 4 GPUs" in text.stdout and "--num_processes 4" in text.stdout


def test_fit_with_a_token_budget_searches_the_budget(mistral):
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", micro_batch_tokens=4096, seq_len=1024,
                     gpu_memory_gib=24)
    result = fit(mistral, spec, global_batch=4096 * 8)
    s = result.best.spec
    assert s.micro_batch == 1 and s.micro_batch_tokens is not None and result.best.estimate.fits
    assert f"train.micro_batch_tokens={s.micro_batch_tokens}" in result.overrides
    accum = int(result.overrides[-1].split("=")[1])
    assert s.micro_batch_tokens * accum == 4096 * 8  # the tokens per step are kept
