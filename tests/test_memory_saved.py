"""The activation formulas against what autograd really keeps, on tiny Llama models on the CPU.

Each case runs the real transformers (and peft) modules through llmtrain's own loss (`attach_loss`,
`compute_loss`) and adds up every distinct tensor storage that autograd saves for backward and that is
not a parameter: every saved tensor passes through `saved_tensors_hooks`, except those saved inside the
loss's checkpointed chunks, whose own hooks keep nothing (they are recomputed in backward). Two models
that differ by one decoder layer give one layer's bytes exactly; the one-layer model gives the rest.

Two CPU/CUDA differences are on these paths, and each is written out here:
- dropout: the CPU kernel saves a noise tensor in the input's dtype (fp32 in LoRA: peft casts the input to
  the adapter's dtype) where CUDA saves a bool mask;
- varlen attention: on CUDA, torch's flash varlen kernel saves q, k, v, its output and logsumexp (the
  estimate's formula); on the CPU, llmtrain.model.attention runs SDPA per example on 3-D tensors, which takes
  SDPA's math path (see `cpu_varlen_attention_bytes`).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from llmtrain.memory import activations as act
from llmtrain.memory.estimate import make_pass
from llmtrain.memory.params import ModelShape, _shape_from_json, lora_plan
from llmtrain.memory.spec import TrainSpec

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, attention_dropout=0.0)
B, S, R, PAD = 2, 16, 4, 3


def cpu_varlen_attention_bytes(p: act.Pass, shape: ModelShape, lengths: list[int], *, o_trainable: bool) -> int:
    """What llmtrain's varlen attention saves on the CPU: SDPA per example on (heads, l, head_dim) tensors
    takes SDPA's math path, which upcasts to fp32 and saves q and k scaled (K repeated to every head),
    V repeated, and the softmax (heads x l x l per example: sum(l_i^2), never the row's square); then the
    examples' outputs are concatenated in cd, the tensor o_proj saves where o_trainable (its weight trains, or its
    adapter reads that tensor: activations.o_input_saved)."""
    hq = shape.heads * shape.head_dim
    return (3 * p.tokens * hq * act.FP32 + shape.heads * sum(n * n for n in lengths) * act.FP32
            + (p.tokens * hq * p.cd if o_trainable else 0))


def build(layers: int, attn: str, dtype: torch.dtype, lora: float | None, adapters_in: torch.dtype | None = None,
          dora: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmtrain.model.loss import attach_loss

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, num_hidden_layers=layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    if lora is not None:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=8, lora_dropout=lora, use_dora=dora,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
        if adapters_in is not None:  # as FSDP's mixed-precision policy gathers them for the forward
            model.to(adapters_in)
    attach_loss(model, chunk=7)  # several chunks: none of their tensors may outlive the forward
    return model


def batch_for(lengths: list[int], *, packing: bool) -> dict:
    from llmtrain.data.batching import collate, with_loss_positions

    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist(),
                 "labels": torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()} for n in lengths]
    return with_loss_positions(collate(examples, pad_id=0, packing=packing))


def saved_bytes(model, batch: dict, *, autocast: bool) -> int:
    """Bytes of distinct non-parameter storages saved for backward by one call of the training loss and still held
    by its graph when it returns (DoRA's B A is made through autograd and then detached: what its graph saved is
    freed in the forward)."""
    import weakref

    from llmtrain.model.loss import compute_loss

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []  # weak: a tensor whose graph was dropped in the forward is gone by the count

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = compute_loss(model, batch)
    alive = [t for ref in kept if (t := ref()) is not None]
    del loss
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values())


CASES = [  # attn, storage dtype, mixed precision, padded batch, lora dropout (None: full fine-tune)
    ("eager", "float32", "no", False, None),
    ("eager", "float32", "bf16", True, None),
    ("eager", "bfloat16", "bf16", False, None),
    ("sdpa", "float32", "no", False, None),
    ("sdpa", "float32", "bf16", False, None),
    ("sdpa", "float32", "bf16", True, None),
    ("sdpa", "bfloat16", "no", True, None),
    ("sdpa", "bfloat16", "bf16", False, 0.05),
    ("sdpa", "bfloat16", "bf16", True, 0.05),
    ("sdpa", "float32", "no", False, 0.05),
    ("eager", "float32", "bf16", False, 0.05),
    # LoRA without dropout on weights in the compute dtype: the adapters save the very tensors they read, o_proj's
    # adapter eager attention's output (a tensor of its own there: the kernel does not save it)
    ("eager", "float32", "no", False, 0.0),
    ("eager", "bfloat16", "no", True, 0.0),
    ("sdpa", "float32", "no", False, 0.0),
    # varlen: one packed row, examples of different lengths (the padded flag does not apply)
    ("varlen", "float32", "no", False, None),
    ("varlen", "float32", "bf16", False, None),
    ("varlen", "bfloat16", "no", False, None),
    ("varlen", "bfloat16", "bf16", False, 0.05),
    ("varlen", "float32", "no", False, 0.05),
    ("varlen", "float32", "no", False, 0.0),
]


@pytest.mark.parametrize(("attn", "dtype", "mp", "padded", "lora"), CASES)
def test_layer_and_outside_bytes_equal_what_autograd_saves(attn, dtype, mp, padded, lora):
    check_layer_and_outside(attn, dtype, mp, padded, lora)


DORA_CASES = [  # lora.dora: attn, storage dtype, mixed precision, padded batch, lora dropout
    ("sdpa", "float32", "no", False, 0.0),
    ("sdpa", "float32", "no", True, 0.05),
    ("sdpa", "float32", "bf16", False, 0.0),
    ("sdpa", "float32", "bf16", True, 0.05),  # the second base matmul's weight: autocast's cast, saved
    ("sdpa", "bfloat16", "bf16", False, 0.05),  # the bf16 weight cast to the adapters' fp32, then back by autocast
    ("sdpa", "bfloat16", "no", False, 0.05),  # the bf16 weight cast to fp32 and an fp32 base output
    ("varlen", "bfloat16", "bf16", False, 0.0),
]


@pytest.mark.parametrize(("attn", "dtype", "mp", "padded", "lora"), DORA_CASES)
def test_dora_layers_save_what_the_estimate_says(attn, dtype, mp, padded, lora):
    check_layer_and_outside(attn, dtype, mp, padded, lora, dora=True)


def check_layer_and_outside(attn, dtype, mp, padded, lora, *, dora=False):
    from llmtrain.model.attention import register

    shape = _shape_from_json(json.dumps({**TINY, "num_hidden_layers": 2}), "tiny")
    varlen = attn == "varlen"
    spec = TrainSpec(attn_implementation=attn, dtype=dtype, mixed_precision=mp, micro_batch=B, seq_len=S,
                     method="full" if lora is None else "lora", lora_r=R, lora_dropout=lora or 0.0, lora_dora=dora)
    p = make_pass(shape, spec)
    assert p.mask == (not varlen)  # padded rows are assumed whenever a micro-batch has more than one row
    assert (p.rows, p.row_len, p.examples) == ((1, B * S, B) if varlen else (B, S, B))
    # The CPU's dropout noise is fp32; varlen's K/V are taken at kv_heads (torch >= 2.11).
    p = replace(p, mask=padded, dropout_mask_bytes=4, varlen_repeats_kv=False)
    lengths = [S + 6, S - 6] if varlen else [S] * (B - 1) + [S - PAD * padded]
    batch = batch_for(lengths, packing=varlen)
    torch_dtype, autocast = getattr(torch, dtype), mp != "no"
    impl = register() if varlen else attn
    one = saved_bytes(build(1, impl, torch_dtype, lora, dora=dora), batch, autocast=autocast)
    two = saved_bytes(build(2, impl, torch_dtype, lora, dora=dora), batch, autocast=autocast)

    full = lora is None
    adapted = lora_plan(shape, r=R).adapted[0] if lora is not None else {}
    cpu = 0
    if varlen:  # the CPU's per-example attention in place of the flash kernel's
        o_saved = act.o_input_saved(p, adapted, full=full)
        cpu = (cpu_varlen_attention_bytes(p, shape, lengths, o_trainable=o_saved)
               - act.attention_bytes(p, shape, o_trainable=o_saved))
    # Autocast's weight casts are saved too: every fp32 linear's, and the fp32 adapters'.
    copies = shape.linear_params_per_layer * 2 if (autocast and dtype == "float32") else 0
    copies += sum(R * (i + o) for i, o in adapted.values()) * 2 if autocast else 0
    layer = act.layer_bytes(p, shape, adapted, R) + copies + cpu
    assert two - one == layer

    # Outside the layers: the stream's inputs, the final norm and the loss's input (the gathered hidden
    # states of the trained positions, their index and targets: every token but each example's last and
    # the pads). Nothing of the LM head or the logits is kept: the chunks are recomputed in backward.
    trained = replace(p, examples=B + PAD * padded)
    assert trained.loss_tokens == sum(lengths) - B == len(batch["loss_index"])
    outside = act.outside_layers_bytes(trained, shape, embed_trainable=full, norm_trainable=full)
    first = layer
    if not full:  # frozen embeddings: the first layer's input needs no gradient
        first -= act.frozen_input_discount(p, shape, adapted)
        # ... nor the casts of its q/k/v weights and A weights (saved only for the input's gradient)
        qkv = [x for x in shape.layer_linears if x.name.endswith(("q_proj", "k_proj", "v_proj"))]
        first -= sum(R * x.fan_in * 2 for x in qkv) * autocast
        first -= sum(x.numel * 2 for x in qkv) * (autocast and dtype == "float32")
    assert one == first + outside


def test_cpu_varlen_attention_by_hand():
    """The CPU formula above, worked out for the tiny shape: T=32 tokens in examples of 22 and 10, 4 heads
    of 16 (Hq 64): q, k, v at 32*64*4 = 8192 bytes each, softmax 4*(22^2 + 10^2)*4 = 9344, and o_proj's
    input 32*64*2 = 4096 in bf16; the flash kernel's would be 4096 + 2*2048 + 4096 + logsumexp 512."""
    shape = _shape_from_json(json.dumps({**TINY, "num_hidden_layers": 2}), "tiny")
    p = make_pass(shape, TrainSpec(micro_batch=B, seq_len=S, mixed_precision="bf16"))
    p = replace(p, varlen_repeats_kv=False)
    assert cpu_varlen_attention_bytes(p, shape, [22, 10], o_trainable=True) == 3 * 8192 + 9344 + 4096
    assert act.attention_bytes(p, shape, o_trainable=True) == 4096 + 2 * 2048 + 4096 + 512
    # torch 2.10 repeats K/V to the 4 heads: twice as wide
    assert act.attention_bytes(replace(p, varlen_repeats_kv=True), shape, o_trainable=True) == 4096 * 4 + 512


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
@pytest.mark.parametrize("in_cd", [False, True])
def test_adapters_without_dropout_share_their_input_only_in_the_compute_dtype(attn, in_cd):
    """LoRA without dropout on a bf16 base under bf16 autocast. fp32 adapters (peft's default there): peft casts each
    adapter's input to fp32 and autocast casts it back, so each of the 7 adapters saves its own copy. Adapters in
    bf16 (what FSDP's mixed-precision policy gathers, and what peft's 4-bit layers see: they skip the cast under
    autocast): q/k/v's adapters save the one normalised input, gate/up's the other, o_proj's the attention output
    (already saved by attention), down_proj's the SwiGLU product: per token 2 x H + I elements instead of
    3 x H + Hq + 2 x H + I, here (64 + 64 + 160) x 2 bytes against (4 x 64 + 2 x 64 + 160) x 2."""
    from llmtrain.model.attention import register

    shape = _shape_from_json(json.dumps({**TINY, "num_hidden_layers": 2}), "tiny")
    varlen = attn == "varlen"
    spec = TrainSpec(attn_implementation=attn, dtype="bfloat16", mixed_precision="bf16", micro_batch=B, seq_len=S,
                     method="lora",
                     lora_r=R, lora_dropout=0.0)
    p = replace(make_pass(shape, spec), mask=False, varlen_repeats_kv=False, adapters_in_cd=in_cd)
    lengths = [S + 6, S - 6] if varlen else [S] * B
    batch = batch_for(lengths, packing=varlen)
    impl = register() if varlen else attn
    adapters_in = torch.bfloat16 if in_cd else None
    one = saved_bytes(build(1, impl, torch.bfloat16, 0.0, adapters_in), batch, autocast=True)
    two = saved_bytes(build(2, impl, torch.bfloat16, 0.0, adapters_in), batch, autocast=True)
    adapted = lora_plan(shape, r=R).adapted[0]
    # o_proj's adapter saves the CPU's concatenated output (in_cd), which the CPU's SDPA does not save itself
    o_saved = act.o_input_saved(p, adapted, full=False)
    assert o_saved == in_cd
    cpu = (cpu_varlen_attention_bytes(p, shape, lengths, o_trainable=o_saved)
           - act.attention_bytes(p, shape, o_trainable=o_saved)) if varlen else 0
    casts = 0 if in_cd else sum(R * (i + o) for i, o in adapted.values()) * 2  # autocast's casts of fp32 adapters
    layer = act.layer_bytes(p, shape, adapted, R)
    assert two - one == layer + casts + cpu
    T, H, I = p.tokens, shape.hidden, shape.intermediate
    inputs = (2 * H + I) if in_cd else (5 * H + shape.heads * shape.head_dim + I)
    assert layer == act.layer_bytes(replace(p, adapters_in_cd=False, lora_dropout=0.0), shape, {}, R) + T * (
        inputs + 7 * R) * 2


# A mixture of experts (memory/activations.py: router_bytes, experts_bytes): the tiny shape's attention, 8 experts of
# 48 columns, 2 a token. LoRA: peft's all-linear adapts the router and both expert parameters (run unmerged beside
# them, model/lora_experts.py: the rank-r rows and the factors saved); q_proj + down_proj adapts one of them
# (Qwen3-MoE's names; Mixtral's down_proj is w2, so there it adapts q_proj alone); q_proj + v_proj none (the experts
# save no input).
MOE = {"qwen3_moe": dict(moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, head_dim=16,
                         norm_topk_prob=True),
       "mixtral": dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)}
MOE_CASES = [  # storage dtype, mixed precision, lora.target_modules (None: full fine-tune)
    ("float32", "no", None), ("float32", "bf16", None), ("bfloat16", "no", None),
    ("bfloat16", "bf16", "all-linear"), ("float32", "bf16", "all-linear"), ("bfloat16", "bf16", ("q_proj", "v_proj")),
    ("bfloat16", "bf16", ("q_proj", "down_proj")),
]


def build_moe(family: str, layers: int, dtype: torch.dtype, targets):
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model.loss import attach_loss

    torch.manual_seed(0)
    tiny = {k: v for k, v in TINY.items() if k != "model_type"}
    cfg = AutoConfig.for_model(family, **{**tiny, **MOE[family]}, num_hidden_layers=layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    if targets is not None:
        import peft

        from llmtrain.model import lora_experts

        model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                           target_modules=targets))
        lora_experts.install(model)  # as model/modeling.apply_lora does
    attach_loss(model, chunk=7)
    return model


@pytest.mark.parametrize("family", sorted(MOE))
@pytest.mark.parametrize(("dtype", "mp", "targets"), MOE_CASES)
def test_a_mixture_of_experts_layer_saves_what_the_estimate_says(family, dtype, mp, targets):
    """One decoder layer of Qwen3-MoE and of Mixtral, to the byte: attention as any family's, then the router and the
    grouped_mm experts (in their weights' dtype, whatever the autocast), and under LoRA the experts' adapters run
    beside them, unmerged (model/lora_experts.py, installed as apply_lora does; their factors, and peft's casts of
    them to a 16-bit base's dtype, in act.expert_adapter_bytes). Autocast's casts of the weights are counted apart, as
    the estimate's autocast_copies: an fp32 model's router weight, the router's and the attention's adapters. The
    LoRA plan's adapter weights are peft's, one layer's counted."""
    shape = _shape_from_json(json.dumps({**TINY, **MOE[family], "model_type": family, "num_hidden_layers": 2}), "tiny")
    spec = TrainSpec(attn_implementation="sdpa", dtype=dtype, mixed_precision=mp, micro_batch=B, seq_len=S,
                     method="full" if targets is None else "lora", lora_r=R, lora_dropout=0.0,
                     lora_target_modules=targets or "all-linear")
    p = replace(make_pass(shape, spec), mask=False)
    batch = batch_for([S] * B, packing=False)
    autocast = mp != "no"
    one = saved_bytes(build_moe(family, 1, getattr(torch, dtype), targets), batch, autocast=autocast)
    model = build_moe(family, 2, getattr(torch, dtype), targets)
    two = saved_bytes(model, batch, autocast=autocast)

    plan = lora_plan(shape, r=R, targets=targets) if targets else None
    adapted = plan.adapted[0] if plan else {}
    copies = (shape.linear_params_per_layer + 8 * TINY["hidden_size"]) * 2 if (autocast and dtype == "float32") else 0
    if plan:  # (the experts' A and B are cast by peft, not autocast: counted in act.expert_adapter_bytes)
        factors = sum(n for name, n in plan.moe_params.items() if name.startswith("mlp.experts."))
        copies += (plan.layer_params(0) - factors) * 2 * autocast
        trained = sum(t.numel() for n, t in model.named_parameters() if t.requires_grad and ".layers.0." in n)
        assert plan.layer_params(0) == trained
    # transformers 5.17's experts forward (the GPU machine's; unadapted experts run it, adapted ones llmtrain's) masks
    # the routed pairs for expert parallelism whether or not it is used, and saves the mask, a byte a pair (token x
    # expert chosen); 5.25's masks only under expert parallelism, as the estimate counts. 5.17's experts have no
    # _is_expert_parallel.
    experts = next(m for n, m in model.named_modules() if n.endswith("layers.1.mlp.experts"))
    adapted_experts = any("lora_" in n and "layers.1.mlp.experts" in n for n, _ in model.named_parameters())
    own = adapted_experts or hasattr(experts, "_is_expert_parallel")
    sentinel = 0 if own else B * S * MOE[family]["num_experts_per_tok"]
    assert two - one == act.layer_bytes(p, shape, adapted, R) + copies + sentinel
    if targets == "all-linear" and dtype == "bfloat16":  # unmerged: no copy of an expert (8 x 3 x 48 x 64 x 2 bytes)
        # gate_up_proj at rank 8: x A^T (64 pairs x 8), B^T (8 experts x 8 x 96) and A's cast (8 x 64 x 8);
        # down_proj at rank 4, padded to 8 for 16-byte rows: x A^T (64 x 8), B^T (8 x 8 x 64), A^T padded (8 x 48 x 8)
        assert dict(p.expert_ranks) == {"mlp.experts.gate_up_proj": 8, "mlp.experts.down_proj": 4}
        assert act.expert_adapter_bytes(p, shape, adapted) == 2 * (64 * 8 + 8 * 8 * 96 + 8 * 64 * 8 + 64 * 8 +
                                                                    8 * 8 * 64 + 8 * 48 * 8) == 36_864


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_dora_on_a_4bit_base_saves_what_the_estimate_says(tmp_path, dropout):
    """QLoRA with DoRA (bf16 autocast): DoRA's bytes beyond LoRA's a layer equal dora_bytes; with dropout, the
    re-run base matmul keeps the dequantized weight (in bf16) of every adapted linear."""
    pytest.importorskip("bitsandbytes")
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    from llmtrain.model.loss import attach_loss

    def layer(dora: bool) -> int:
        saved = []
        for layers in (1, 2):
            torch.manual_seed(0)
            cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, num_hidden_layers=layers)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / str(layers))
            quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_compute_dtype=torch.bfloat16)
            model = AutoModelForCausalLM.from_pretrained(tmp_path / str(layers), quantization_config=quantized,
                                                         dtype=torch.bfloat16, attn_implementation="sdpa")
            model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=8, lora_dropout=dropout, use_dora=dora,
                                                               target_modules="all-linear", task_type="CAUSAL_LM"))
            attach_loss(model, chunk=7)
            saved.append(saved_bytes(model.train(), batch_for([S] * B, packing=False), autocast=True))
        return saved[1] - saved[0]

    shape = _shape_from_json(json.dumps({**TINY, "num_hidden_layers": 2}), "tiny")
    spec = TrainSpec(dtype="bfloat16", mixed_precision="bf16", quantize="nf4", micro_batch=B, seq_len=S,
                     method="lora", lora_r=R, lora_dropout=dropout, lora_dora=True, attn_implementation="sdpa")
    p = make_pass(shape, spec)
    assert p.dora_weight_copy == (2 if dropout else 0)
    adapted = lora_plan(shape, r=R).adapted[0]
    assert layer(True) - layer(False) == sum(act.dora_bytes(p, i, o) for i, o in adapted.values())
