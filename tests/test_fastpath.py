"""The fast path's parts against their plain references, in this process on the CPU (fast tier).

- varlen attention on a packed row equals each example run alone (logits and gradients, fp32, 1e-5),
  with GQA, with a Mistral sliding window, with and without the collator's boundaries;
- the chunked loss equals the full-logits cross-entropy (value and gradients) and needs less memory;
- token bins: deterministic, within budget, every example once per epoch, the same bins for any
  number of processes;
- FLOP counting by hand for a tiny model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtrain.data.batching import collate, global_micro_batches, token_bins, with_loss_positions
from llmtrain.model.attention import register
from llmtrain.model.loss import attach_loss, chunked_cross_entropy, compute_loss

LENGTHS = [5, 9, 3, 12, 1]


# What each family's tiny config needs besides the common shapes: Qwen3 and Gemma 3 their own head size (QK-norm);
# Gemma 3 a local window shorter than the longest example on its first layer and a global second layer (two RoPE
# bases); Phi-3 partial RoPE (Phi-4-mini's 0.75) and a pad id inside the vocabulary.
FAMILY = {"qwen2": {}, "qwen3": dict(head_dim=16),
          "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16,
                              layer_types=["sliding_attention", "full_attention"]),
          "phi3": dict(partial_rotary_factor=0.75, pad_token_id=0)}


def tiny_model(attn: str, *, model_type: str = "llama", sliding_window: int | None = None, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=97, attention_dropout=0.0)
    window = {"sliding_window": sliding_window} if model_type != "llama" else {}
    cfg = AutoConfig.for_model(model_type, **common, **window, **FAMILY.get(model_type, {}))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    with torch.no_grad():  # Gemma's norms start at zero (weight + 1): move them, so that a wrong one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape) * 0.1)
    return model


def examples(lengths=LENGTHS, vocab: int = 97, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
             "labels": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lengths]


def per_example_logits(model, exs):
    return torch.cat([model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in exs])


@pytest.mark.parametrize(("model_type", "window", "boundaries"), [
    ("llama", None, True), ("llama", None, False), ("mistral", 4, True), ("qwen2", None, True), ("qwen3", None, True),
    ("gemma3_text", 4, True), ("phi3", None, True)])
def test_varlen_attention_equals_unpacked(model_type, window, boundaries):
    """One packed row through the varlen attention gives each example's logits, and the gradients of a
    loss over them, as if every example ran alone with transformers' eager attention."""
    exs = examples()
    ref = tiny_model("eager", model_type=model_type, sliding_window=window)
    var = tiny_model(register(), model_type=model_type, sliding_window=window)
    var.load_state_dict(ref.state_dict())
    batch = collate(exs, pad_id=0, packing=True)
    kwargs = {}
    if boundaries:
        kwargs = dict(cu_seq_lens_q=batch["cu_seq_lens"], cu_seq_lens_k=batch["cu_seq_lens"],
                      max_length_q=batch["max_length"], max_length_k=batch["max_length"])
    packed = var(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **kwargs).logits[0]
    alone = per_example_logits(ref, exs)
    assert packed.shape == alone.shape == (sum(LENGTHS), 97)
    assert (packed - alone).abs().max() < 1e-5
    weights = torch.randn_like(alone) / alone.numel() ** 0.5  # a loss of order 1, so 1e-5 is fp32 round-off
    (packed * weights).sum().backward()
    (alone * weights).sum().backward()
    for (name, p), q in zip(var.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-5, name


def test_sliding_window_matters_in_the_varlen_test():
    """The converse of the window case above: without the window, an example longer than it differs."""
    exs = examples([12])
    windowed, full = tiny_model(register(), model_type="mistral", sliding_window=4), tiny_model("eager")
    full.load_state_dict(windowed.state_dict())
    assert (per_example_logits(windowed, exs) - per_example_logits(full, exs)).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text", "phi3"])
def test_packed_varlen_model_loss_equals_padded_eager_loss(model_type):
    """The model-level loss (compute_loss through attach_loss): a packed varlen row and a padded eager batch
    of the same examples give the same summed loss and the same gradients, for each family's layer (Gemma 3's
    scaled embeddings and tied head, Phi's fused projections, Qwen3's QK-norm, Qwen2's q/k/v biases)."""
    exs = examples()
    window = 4 if model_type == "gemma3_text" else None
    ref = tiny_model("eager", model_type=model_type, sliding_window=window)
    var = tiny_model(register(), model_type=model_type, sliding_window=window)
    var.load_state_dict(ref.state_dict())
    for m in (ref, var):
        attach_loss(m, chunk=7)
    padded = with_loss_positions(collate(exs, pad_id=0, packing=False))
    packed = with_loss_positions(collate(exs, pad_id=0, packing=True))
    a, b = compute_loss(ref, padded), compute_loss(var, packed)
    # the reference: full logits, fp32 cross-entropy over the shifted labels of each example
    logits = per_example_logits(ref, exs)
    targets = torch.tensor([t for e in exs for t in e["labels"][1:] + [-100]])
    expected = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    assert a.item() == pytest.approx(expected.item(), rel=1e-6)
    assert b.item() == pytest.approx(expected.item(), rel=1e-6)
    a.backward()
    b.backward()
    for (name, p), q in zip(var.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-5, name


def test_loss_hits_and_examples_for_evaluation():
    """return_hits gives one flag per trained token, each tagged with its example, in both layouts."""
    exs = examples()
    model = tiny_model(register())
    attach_loss(model, chunk=5)
    with torch.no_grad():
        batch = with_loss_positions(collate(exs, pad_id=0, packing=True))
        loss, hits = compute_loss(model, batch, return_hits=True)
        logits = per_example_logits(model, exs)
    targets = torch.tensor([t for e in exs for t in e["labels"][1:] + [-100]])
    keep = targets != -100
    assert torch.equal(hits, logits.argmax(-1)[keep] == targets[keep])
    assert batch["loss_example"].tolist() == [i for i, n in enumerate(LENGTHS) for _ in range(n - 1)]
    assert loss.item() == pytest.approx(F.cross_entropy(logits[keep], targets[keep], reduction="sum").item(), rel=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_loss_equals_full_loss(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 50, bias=False)
    hidden = torch.randn(64, 32, requires_grad=True)
    targets = torch.randint(0, 50, (64,))
    full = F.cross_entropy(head(hidden).float(), targets, reduction="sum")
    full.backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    chunked, _ = chunked_cross_entropy(hidden, head, targets, chunk=chunk)
    chunked.backward()
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)
    assert (hidden.grad - grads[0]).abs().max() < 1e-5
    assert (head.weight.grad - grads[1]).abs().max() < 1e-5


def test_per_token_entropies_across_chunks_and_row_blocks_equal_the_full_logits_and_carry_no_gradient():
    """online RL's entropy: 300 tokens in chunks of 128, each chunk's rows taken 64 at a time: every token's entropy
    of softmax(logits) as torch.distributions computes it from the full logits; the per-token losses and their
    gradient unchanged by asking for it."""
    torch.manual_seed(0)
    n, h, v = 300, 16, 97
    head = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    losses, entropies = chunked_cross_entropy(hidden, head, targets, chunk=128, per_token=True, stat="entropy")
    expected = torch.distributions.Categorical(logits=head(hidden).float()).entropy()
    assert entropies.shape == (n,) and not entropies.requires_grad
    assert (entropies - expected).abs().max() < 1e-5
    plain, _ = chunked_cross_entropy(hidden, head, targets, chunk=128, per_token=True)
    assert torch.equal(losses, plain)
    losses.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_per_token_log_sum_of_squares_equals_the_full_logits_in_float64_and_carries_no_gradient():
    """WPO's log sum_v p_v^2 of each token's distribution, 300 tokens in chunks of 128 and blocks of 64 rows, against
    float64 softmax of the full logits (logits up to about 30 apart: its exponentials of twice them stay finite); the
    per-token losses unchanged by asking for it."""
    torch.manual_seed(0)
    n, h, v = 300, 16, 97
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.mul_(8)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    losses, log_sum_sq = chunked_cross_entropy(hidden, head, targets, chunk=128, per_token=True, stat="log_sum_sq")
    p = torch.softmax(head(hidden).double(), -1)
    assert log_sum_sq.shape == (n,) and not log_sum_sq.requires_grad
    assert (log_sum_sq.double() - (p * p).sum(-1).log()).abs().max() < 1e-5
    assert log_sum_sq.min() < -2 and log_sum_sq.max() > -0.1  # spread and peaked rows both
    plain, _ = chunked_cross_entropy(hidden, head, targets, chunk=128, per_token=True)
    assert torch.equal(losses, plain)


def test_entropy_allocates_one_block_of_rows_for_a_whole_chunk():
    """The entropy's row blocks reuse one buffer: a fresh block-sized temporary per block (logsumexp's, the
    probabilities', their product's) fragmented the CPU allocator's heap and raised the GRPO benchmark's peak RSS by
    12% (docs/performance.md). Counted with torch's profiler: the leaf allocations of a block's size or more."""
    from torch.profiler import ProfilerActivity, profile

    from llmtrain.model.loss import ENTROPY_ROWS, _entropy

    torch.manual_seed(0)
    logits = torch.randn(8 * ENTROPY_ROWS + 5, 1000)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = _entropy(logits)
    block = ENTROPY_ROWS * 1000 * 4
    big = [e for e in prof.events() if not e.cpu_children and e.cpu_memory_usage >= block]
    assert len(big) == 1, [(e.name, e.cpu_memory_usage) for e in big]
    assert (got - torch.distributions.Categorical(logits=logits).entropy()).abs().max() < 1e-5


def test_chunked_loss_needs_a_fraction_of_the_memory():
    """Peak memory of loss + backward with torch's MemTracker: full fp32 logits (and their gradient) for 2048
    tokens x 32k vocabulary, against 256-token chunks recomputed in backward."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    n, h, v = 2048, 32, 32768
    weight = torch.randn(v, h, requires_grad=True)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))

    def head(x):  # a function, not a module: the tracker follows modules called once per step
        return x @ weight.T

    def peak(loss_fn) -> int:
        weight.grad = hidden.grad = None
        tracker = mem_tracker.MemTracker()
        tracker.track_external(weight, hidden)
        with tracker:
            loss_fn().backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    full = peak(lambda: F.cross_entropy(head(hidden).float(), targets, reduction="sum"))
    chunked = peak(lambda: chunked_cross_entropy(hidden, head, targets, chunk=256)[0])
    logits = n * v * 4
    assert full > 2 * logits  # logits and their gradient at once
    assert chunked < full / 4, (chunked, full)
    assert chunked < 0.5 * logits


# --------------------------------------------------------------------------- token bins


def lengths_for(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 300, (n,), generator=g).tolist()


def test_token_bins_are_a_pure_function_and_cover_the_epoch():
    lengths = lengths_for(500)
    a = token_bins(lengths, 1024, seed=3, epoch=0)
    assert a == token_bins(lengths, 1024, seed=3, epoch=0)  # deterministic
    assert a != token_bins(lengths, 1024, seed=3, epoch=1)  # a new order each epoch
    assert a != token_bins(lengths, 1024, seed=4, epoch=0)
    assert sorted(i for b in a for i in b) == list(range(500))  # every example exactly once
    assert all(sum(lengths[i] for i in b) <= 1024 for b in a)
    # best fit keeps the bins full: the total is within a few bins of the ideal
    assert len(a) <= sum(lengths) / 1024 + 2


def test_token_bins_refuse_an_example_longer_than_the_budget():
    with pytest.raises(ValueError, match="example 1 has 40 tokens"):
        token_bins([10, 40], 32, seed=0, epoch=0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_token_bins_are_the_same_for_any_number_of_processes(world):
    """Global micro-batches by tokens: rank r takes bin r of each group of `world` bins, so the bins in
    order are those of one process, and every rank gets the same number of micro-batches."""
    lengths = lengths_for(300)
    one = [g[0] for g in global_micro_batches(300, seed=1, epoch=2, world_size=1, micro_batch_tokens=700,
                                              lengths=lengths)]
    groups = global_micro_batches(300, seed=1, epoch=2, world_size=world, micro_batch_tokens=700, lengths=lengths)
    assert all(len(g) == world for g in groups)
    assert [b for g in groups for b in g if b] == one


def test_flop_model_by_hand():
    """6 FLOPs per trained matmul weight per token, 4 per frozen one; the head on trained tokens;
    attention 6 x layers x heads x head_dim per squared example length."""
    from llmtrain.run.metrics import flop_model

    model = tiny_model("eager")
    fm = flop_model(model)
    h, kv, inter, layers, vocab = 64, 2 * 16, 128, 2, 97
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k+v (2 kv heads of 16), o, gate/up/down
    assert fm.body_per_token == 6 * layers * per_layer
    assert fm.head_per_token == 6 * vocab * h
    assert fm.attn_per_square == 6 * layers * 64
    assert fm.step(tokens=10, trained=4, squares=50) == 10 * fm.body_per_token + 4 * fm.head_per_token + 50 * 6 * 128
    for p in model.parameters():
        p.requires_grad_(False)
    assert flop_model(model).body_per_token == 4 * layers * per_layer
    # a frozen model's forward alone (distillation's teacher): 2 a weight, attention a third; added to a step's
    forward = flop_model(model, forward_only=True)
    assert (forward.body_per_token, forward.head_per_token, forward.attn_per_square) == (
        2 * layers * per_layer, 2 * vocab * h, 2 * layers * 64)
    assert fm.plus(forward).step(tokens=10, trained=4, squares=50) == (
        fm.step(tokens=10, trained=4, squares=50) + forward.step(tokens=10, trained=4, squares=50))


def test_a_mixture_of_experts_counts_the_experts_a_token_goes_through():
    """Qwen3-MoE's model FLOPs: the router's weight for every token, and of its 8 experts the 2 a token is routed to,
    not all 8 (which would count 4x the experts' work; Qwen3-30B-A3B's 128 experts, 8 a token, 16x). The estimate's
    step FLOPs count the same weights (params.ModelShape.active_params_per_layer)."""
    import json

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from llmtrain.memory.params import _shape_from_json
    from llmtrain.run.metrics import flop_model

    cfg = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg))
    h, kv, layers = 64, 2 * 16, 2
    attention = h * h + 2 * h * kv + h * h
    routed = 2 * 3 * h * 32  # 2 experts' gate, up and down projections
    assert flop_model(model).body_per_token == 6 * layers * (attention + 8 * h + routed)
    shape = _shape_from_json(json.dumps({**cfg, "model_type": "qwen3_moe"}), "tiny")
    assert shape.active_params_per_layer == attention + 8 * h + routed
    assert shape.params_per_layer > attention + 8 * h + 4 * routed  # all 8 experts are held


def test_lora_wraps_the_projections_inside_liger_kernels(monkeypatch):
    """model.kernels=liger patches the model before peft: LoRA must still adapt every projection, now inside
    liger's SwiGLU MLP, and the norms and RoPE must be liger's. (Structure only: the kernels need CUDA.)"""
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    from llmtrain.config import LoraConfig
    from llmtrain.model.modeling import _apply_liger, apply_lora

    # liger swaps module-level functions (RoPE) of transformers: put them back after this test
    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    model = tiny_model("eager")
    _apply_liger(model)
    model = apply_lora(model, LoraConfig(r=4))
    layer = model.base_model.model.model.layers[0]
    assert layer.mlp.forward.__func__.__qualname__ == "LigerSwiGLUMLP.forward"
    assert layer.input_layernorm.forward.__func__.__qualname__ == "LigerRMSNorm.forward"
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _reference_varlen(q, k, v, cu, max_q, *, causal: bool, window=(-1, -1), scale=None, gqa=False):
    """A stand-in for torch's flash varlen_attn on the CPU: SDPA per example, (T, H, D) in and out."""
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qi, ki, vi = (t[s:e].transpose(0, 1) for t in (q, k, v))
        if ki.shape[0] != qi.shape[0]:
            assert gqa, "GQA without enable_gqa"
            ki, vi = (t.repeat_interleave(qi.shape[0] // t.shape[0], dim=0) for t in (ki, vi))
        i = torch.arange(e - s)
        mask = i[:, None] >= i[None, :] if causal else torch.ones(e - s, e - s, dtype=torch.bool)
        if window[0] >= 0:
            mask &= i[:, None] - i[None, :] <= window[0]
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature: is_causal, no GQA, no scale."""
    return _reference_varlen(query, key, value, cu_seq_q, max_q, causal=is_causal)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    """torch 2.11's: window_size (left, right) with (-1, 0) causal, scale; fewer K/V heads go to aten's flash
    kernel as they are (it groups the query heads itself)."""
    assert window_size[1] == 0, "not causal"
    return _reference_varlen(query, key, value, cu_seq_q, max_q, causal=True, window=window_size, scale=scale,
                             gqa=True)


def varlen_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.12+: as 2.11, and fewer K/V heads need enable_gqa."""
    assert window_size[1] == 0, "not causal"
    return _reference_varlen(query, key, value, cu_seq_q, max_q, causal=True, window=window_size, scale=scale,
                             gqa=enable_gqa)


@pytest.mark.parametrize("kernel", [varlen_2_10, varlen_2_11, varlen_2_12], ids=["torch-2.10", "torch-2.11",
                                                                               "torch-2.12+"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_flash_varlen_call_adapts_to_each_signature(monkeypatch, kernel, scale):
    """The CUDA path's call, checked on the CPU against the signatures of torch.nn.attention.varlen.varlen_attn
    (copied from each release's source): KV heads repeated only where the kernel cannot group them, a non-default
    scale folded into q where `scale` is missing, causal as is_causal or window_size=(-1, 0). tests/test_cuda.py
    checks the real kernel on a GPU."""
    import torch.nn.attention.varlen as varlen

    from llmtrain.model.attention import _flash_varlen, _sdpa_per_example

    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    torch.manual_seed(0)
    q, k, v = torch.randn(29, 4, 16), torch.randn(29, 2, 16), torch.randn(29, 2, 16)
    cu = torch.tensor([0, 5, 14, 17, 29], dtype=torch.int32)
    d = 16 ** -0.5 if scale is None else scale
    got = _flash_varlen(q, k, v, cu, 12, scale=d, window=None)
    want = _sdpa_per_example(q, k, v, cu.tolist(), scale=d, dropout=0.0, window=None, gqa=2)
    assert (got - want).abs().max() < 1e-5


def test_a_model_that_caps_its_logits_trains_on_its_capped_logits():
    """Gemma 2 (and Gemma 3n) compute cap tanh(logits / cap) before their loss: the chunked loss caps each chunk's
    logits as the model's forward does (loss.logit_transform finds the cap), so the summed loss and every gradient
    equal the full-logit cross-entropy of the model's own logits (it was refused before). A cap of 0.5 bends a random
    model's logits enough to matter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=97,
                               final_logit_softcapping=0.5, query_pre_attn_scalar=16, sliding_window=4)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    ours.load_state_dict(ref.state_dict())
    attach_loss(ours, chunk=7)
    exs = examples()
    logits = per_example_logits(ref, exs)  # the model's own, capped
    targets = torch.tensor([t for e in exs for t in e["labels"][1:] + [-100]])
    want = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    got = compute_loss(ours, with_loss_positions(collate(exs, pad_id=0, packing=False)))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    want.backward()
    got.backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-5, name


def _lse(q, k, cu, *, window=(-1, -1), scale=None) -> torch.Tensor:
    """Each row's log-sum-exp of its causal scores, (heads, tokens) as the flash kernel returns it, with no gradient
    (torch's varlen_attn takes none for it in backward)."""
    out = []
    with torch.no_grad():
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qi, ki = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1)
            ki = ki.repeat_interleave(qi.shape[0] // ki.shape[0], dim=0)
            scores = qi @ ki.transpose(1, 2) * (scale if scale is not None else qi.shape[-1] ** -0.5)
            i = torch.arange(e - s)
            mask = i[:, None] >= i[None, :]
            if window[0] >= 0:
                mask &= i[:, None] - i[None, :] <= window[0]
            out.append(torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1))
    return torch.cat(out, dim=1).float()


def varlen_2_12_lse(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.12+'s varlen_attn with return_aux: its output, and its log-sum-exp without a gradient."""
    out = varlen_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                      enable_gqa=enable_gqa)
    if return_aux is not None and return_aux.lse:
        return out, _lse(query, key, cu_seq_q, window=window_size, scale=scale)
    return out


@pytest.mark.parametrize("window", [None, 4])
def test_the_flash_path_computes_attention_sinks_and_their_gradients(monkeypatch, window):
    """GPT-OSS's sinks on the CUDA path, checked on the CPU against a stand-in for torch's varlen_attn whose
    log-sum-exp carries no gradient, as the real kernel's: the output rescaled by sigmoid(lse - sink) and the gradient
    the kernel leaves out restored (attention._SinkShare) give the output and every gradient (q, k, v, the sinks) of
    the per-example path, which computes the sinks in the softmax itself (and equals GPT-OSS's eager attention:
    tests/test_other_families.py). Without the restored gradient, q's is off by far more."""
    import torch.nn.attention.varlen as varlen

    from llmtrain.model.attention import _flash_varlen, _sdpa_per_example

    monkeypatch.setattr(varlen, "varlen_attn", varlen_2_12_lse)
    torch.manual_seed(0)
    leaves = [torch.randn(29, 4, 16), torch.randn(29, 2, 16), torch.randn(29, 2, 16), torch.randn(4)]
    cu = torch.tensor([0, 5, 14, 17, 29], dtype=torch.int32)
    weights = torch.randn(29, 4, 16)

    def run(fn):
        q, k, v, sinks = (t.clone().requires_grad_() for t in leaves)
        out = fn(q, k, v, sinks)
        (out * weights).sum().backward()
        return [out.detach()] + [t.grad for t in (q, k, v, sinks)]

    got = run(lambda q, k, v, sinks: _flash_varlen(q, k, v, cu, 12, scale=0.3, window=window, sinks=sinks))
    want = run(lambda q, k, v, sinks: _sdpa_per_example(q, k, v, cu.tolist(), scale=0.3, dropout=0.0, window=window,
                                                        gqa=2, sinks=sinks))
    for name, a, b in zip(["out", "q", "k", "v", "sinks"], got, want):
        assert (a - b).abs().max() < 1e-5, (name, (a - b).abs().max())

    def naive(q, k, v, sinks):  # the kernel's lse taken as it comes: no gradient through it
        from torch.nn.attention.varlen import AuxRequest

        out, lse = varlen_2_12_lse(q, k, v, cu, cu, 12, 12, return_aux=AuxRequest(lse=True), scale=0.3,
                                   window_size=(window - 1 if window else -1, 0), enable_gqa=True)
        return out * torch.sigmoid(lse.transpose(0, 1) - sinks).unsqueeze(-1)

    assert (run(naive)[1] - want[1]).abs().max() > 1e-3


def test_a_forward_the_logit_probe_cannot_run_is_said_and_refused_where_its_config_scales_the_logits():
    """The probe of what a model's forward does to its LM head's logits (loss._found_transform) had taken any failure
    as "nothing" without a word, so a model whose config scales its logits (Granite's logits_scaling, Cohere's
    logit_scale) would train on unscaled ones (audit 51): said where the config names no scale, refused where it
    does; Granite's and Cohere's forwards themselves are probed (their scale found)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from llmtrain.errors import LLMTrainError
    from llmtrain.model.loss import Logits, _found_transform

    class Unprobed(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            raise RuntimeError("a forward of its own")

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=1)
    with pytest.warns(UserWarning, match=r"failed \(RuntimeError: a forward of its own\).*takes them as the head's"):
        assert _found_transform(Unprobed(LlamaConfig(**small))) == Logits()
    with pytest.raises(LLMTrainError, match=r"config scales its logits \(logits_scaling=4.0\).*unscaled logits"):
        _found_transform(Unprobed(LlamaConfig(**small, logits_scaling=4.0)))
    for family, key in (("granite", "logits_scaling"), ("cohere", "logit_scale")):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **small, **{key: 4.0}, pad_token_id=0,
                                                                      bos_token_id=1, eos_token_id=2))
        assert _found_transform(model) == Logits(scale=0.25 if family == "granite" else 4.0)
