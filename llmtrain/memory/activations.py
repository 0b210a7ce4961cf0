"""Bytes that a decoder's forward keeps for backward, as transformers and peft run it: Llama's layer, and where a
family's differs (params.FAMILIES: QK-norm, Gemma's four fp32 norms and two RoPEs, Phi's fused projections, a mixture
of experts' router and grouped experts), theirs.

Every function here is plain arithmetic on a `Pass` (the shapes and dtypes of one micro-batch), so
each can be checked by hand. The per-layer terms were read off transformers' LlamaDecoderLayer and
peft's lora.Linear, and they equal the bytes autograd actually saves on a tiny model (tests run the
real modules on the CPU and sum the saved tensors).

Notation used in the comments: T tokens in the micro-batch (b rows of s), H hidden, I intermediate,
Hq = heads*head_dim, Hkv = kv_heads*head_dim, V vocab; `resid` is the byte width of the residual
stream (the embeddings' dtype), `cd` the compute dtype (2 under bf16/fp16 autocast).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from llmtrain.memory.params import ModelShape
from llmtrain.memory.spec import sequence_kv_heads

Attn = Literal["varlen", "sdpa", "eager", "flash_attention_2"]
FP32 = 4
# CUDA's native_dropout keeps a bool mask; the CPU kernel keeps a noise tensor in the input dtype.
CUDA_DROPOUT_MASK_BYTES = 1


@dataclass(frozen=True)
class Pass:
    """One micro-batch through the model, as seen by each process."""

    rows: int  # b: rows in the batch (1 when packed)
    row_len: int  # s: tokens per row (micro_batch * seq_len when packed)
    resid: int  # bytes per element of the residual stream
    cd: int  # bytes per element of the matmul inputs (compute dtype)
    autocast: bool  # mixed precision is on (torch.autocast around the forward)
    attn: Attn
    mask: bool  # a 4-D attention mask is passed (padding, packing, or a sliding window shorter than s)
    trainable_base: bool  # full fine-tune: the base weights have gradients
    # Autocast casts the stream to the compute dtype once per linear that reads it (it caches casts of
    # weights, never of activations): true when the stream's dtype is not the compute dtype.
    separate_casts: bool = False
    lora_dropout: float = 0.0
    dropout_mask_bytes: int = CUDA_DROPOUT_MASK_BYTES
    # varlen only: torch 2.10's varlen_attn (no window_size) takes no GQA, so llmtrain.model.attention repeats K/V to
    # every query head first and the kernel saves them so.
    varlen_repeats_kv: bool = False
    examples: int = 1  # in the micro-batch (at least one, with a token budget)
    # LoRA adapters that run in the compute dtype on the layer's own tensors. peft casts an adapter's input to the
    # adapter's dtype (fp32 on a 16-bit base) and autocast casts it back: a copy per adapter. Not so where the
    # adapters are gathered in cd (FSDP's mixed-precision policy) or where peft skips the cast (its bitsandbytes
    # 4-bit layers under autocast): the adapters reading one input then save that one tensor (without dropout).
    adapters_in_cd: bool = False
    loss_positions: int | None = None  # N where only part of each sequence is trained (online RL: the completions)
    # LoRA on a mixture of experts' expert parameters (model/lora_experts.py): peft's rank of each (gate_up_proj at
    # twice lora.r), and whether its fp32 A and B are cast to the parameter's dtype to run (a 16-bit base outside
    # FSDP's mixed precision, which gathers them in it)
    expert_ranks: tuple[tuple[str, int], ...] = ()
    expert_factors_cast: bool = False
    # model.tiled_mlp: the MLP runs over shards of this many tokens, keeping only its input (model/tiled_mlp.py)
    mlp_shard: int | None = None
    # parallel.sequence_parallel: the GPUs of a sequence group (rows x row_len are then this GPU's 1/N of the group's
    # row); around attention an all-to-all turns each GPU's [T tokens x all heads] into [N T tokens x 1/N of the
    # heads], the same bytes, and back
    sequence_parallel: int = 1
    # Gemma 4's per-layer inputs get a gradient (the embeddings' projection trains, or an adapter on it)
    per_layer_inputs_train: bool = False
    # lora.dora (peft's DoRA, dora_bytes); with LoRA dropout, the bytes an element of the weight copy that DoRA's
    # second base matmul saves (0: its weight is the parameter itself)
    dora: bool = False
    dora_weight_copy: int = 0
    # tensor parallelism: llmtrain makes the row norms of each split layer's part itself (parallel/tensor._dora_forward)
    dora_split: bool = False

    @property
    def tokens(self) -> int:
        return self.rows * self.row_len

    @property
    def loss_tokens(self) -> int:
        """N, the positions the loss sends through the LM head: every token but each example's last (which
        predicts nothing), when all are trained (text data, data.train_on_prompt); masking prompts lowers it."""
        return self.loss_positions if self.loss_positions is not None else max(1, self.tokens - self.examples)


def norm_bytes(p: Pass, hidden: int, *, trainable: bool, gemma: bool = False, width: int | None = None,
               groups: int = 1) -> int:
    """RMSNorm: the fp32 input for pow/mul (x itself when the stream is fp32), rsqrt (T x groups fp32: one per
    token, or per head for QK-norm), and, when the weight trains, the normalised input for its gradient: in the
    input's dtype (`width`, the stream's unless given) for Llama's `w * x.to(dtype)`, in fp32 for Gemma's
    `(x * rsqrt) * (1 + w.float())`."""
    trained = (FP32 if gemma else width or p.resid) if trainable else 0
    return p.tokens * hidden * (FP32 + trained) + p.tokens * groups * FP32


def layer_norm_bytes(p: Pass, hidden: int, *, trainable: bool, gemma: bool = False) -> int:
    """A decoder layer's RMSNorm (before attention, before the MLP): norm_bytes, or under model.tiled_mlp, tiled with
    the MLP (model/tiled_mlp.TILED_NORMS), only its input (T x H, stream dtype): a shard's fp32 tensors exist in its
    backward only (norm_backward_temp)."""
    return p.tokens * hidden * p.resid if p.mlp_shard else norm_bytes(p, hidden, trainable=trainable, gemma=gemma)


def qk_norm_bytes(p: Pass, shape: ModelShape) -> int:
    """QK-norm (Qwen3, Gemma 3, 4): an RMSNorm over each head of q and of k, on q_proj's and k_proj's outputs (the
    compute dtype) before RoPE (Gemma 4's of v too, weightless); 0 for the families without it."""
    if not shape.qk_norm:
        return 0
    full, g = p.trainable_base, shape.gemma_norms
    # Gemma 4: a layer sharing an earlier layer's keys has no norm of its own; its V norm has no weight
    v = norm_bytes(p, shape.kv_heads * shape.head_dim, trainable=False, gemma=g, groups=shape.kv_heads) \
        if shape.v_norm else 0
    return v + sum(norm_bytes(p, heads * shape.head_dim, trainable=full, gemma=g, width=p.cd, groups=heads)
                   for heads in (shape.heads, 0 if shape.kv_shared else shape.kv_heads))


def post_norm_bytes(p: Pass, shape: ModelShape) -> int:
    """Gemma's norm of a half's output (of o_proj, of down_proj) before the residual add: T x H in fp32 from the
    compute dtype; 0 for the families without it."""
    return norm_bytes(p, shape.hidden, trainable=p.trainable_base, gemma=True) if shape.gemma_norms else 0


def kv_width(p: Pass, shape: ModelShape) -> int:
    """K/V heads as attention saves them: repeated to all heads by eager, by SDPA when a mask is passed
    (transformers only uses SDPA's enable_gqa without a mask), and by varlen on a torch without GQA. Under sequence
    parallelism, per token of this GPU's share: the heads that enter the all-to-all (sequence_kv_heads)."""
    return (shape.heads if kv_repeated(p) else sequence_kv_heads(p.sequence_parallel, shape.kv_heads)) * shape.head_dim


def kv_repeated(p: Pass) -> bool:
    """Attention gets K/V repeated to every query head (eager, SDPA with a mask, varlen on a torch without GQA)."""
    return p.attn == "eager" or (p.attn == "sdpa" and p.mask) or (p.attn == "varlen" and p.varlen_repeats_kv)


def own_kv(p: Pass, shape: ModelShape) -> bool:
    """Whether the K/V that attention saves are this layer's own tensors: not where it shares an earlier layer's
    (Gemma 4's kv sharing) and attention takes them as they are (SDPA without repeating them); the varlen attention
    and a repeat copy them."""
    return not shape.kv_shared or p.attn == "varlen" or (kv_repeated(p) and shape.heads != shape.kv_heads)


def fused_view_bytes(p: Pass, shape: ModelShape) -> int:
    """Phi's fused qkv_proj: v is a view of its output, so where attention saves v as it is (K/V not repeated, or
    as many K/V heads as query heads) the whole output stays alive, q's and k's parts beside v's."""
    if not shape.fused_qkv or (kv_repeated(p) and shape.heads != shape.kv_heads):
        return 0
    return p.tokens * (shape.heads + shape.kv_heads) * shape.head_dim * p.cd


def all_to_all_bytes(p: Pass, shape: ModelShape) -> int:
    """Sequence parallelism: what one layer's forward all-to-alls carry from this GPU (0 without): q, k, v (K/V
    repeated to the group's size where it has more GPUs than K/V heads) and the attention's output, [T/N tokens x
    all heads] each in cd; the gathered [T x heads/N] tensors are as large. Backward's carry their gradients, the
    same bytes."""
    if p.sequence_parallel == 1:
        return 0
    kv = sequence_kv_heads(p.sequence_parallel, shape.kv_heads)
    return p.tokens * 2 * (shape.heads + kv) * shape.head_dim * p.cd


def all_to_all_temp(p: Pass, shape: ModelShape) -> int:
    """The all-to-all buffers of one layer in flight: a second copy of q, k, v and the output (all_to_all_bytes: an
    all-to-all's input and output exist at once), and where K/V heads are repeated for the group, the K and V they
    were repeated from."""
    repeated = sequence_kv_heads(p.sequence_parallel, shape.kv_heads) != shape.kv_heads
    return all_to_all_bytes(p, shape) + (2 * p.tokens * shape.kv_heads * shape.head_dim * p.cd if repeated else 0)


def attention_bytes(p: Pass, shape: ModelShape, *, o_trainable: bool) -> int:
    """Saved by the attention core: q, k, v after RoPE (cast to cd), plus per kernel:
    eager: fp32 softmax output and its cd copy (b*heads*s*s each), and the transposed output for o_proj;
    sdpa/flash/varlen: the output (o_proj reads the same tensor) and logsumexp (heads x T fp32): memory
    linear in the tokens, whatever the examples' lengths;
    sdpa with a mask: the boolean mask converted to a cd bias, per layer (b*s*s: a packed row's square).
    Under sequence parallelism the kernel saves the gathered [N T x heads/N] q, k, v, output and logsumexp, as many
    bytes; o_proj's input is then the output's all-to-all back, a tensor of its own. o_trainable: that o_proj saves
    its input (o_input_saved: its weight trains, or its adapter reads that tensor)."""
    T, hq = p.tokens, shape.heads * shape.head_dim
    qkv = T * (hq + 2 * kv_width(p, shape) * own_kv(p, shape)) * p.cd
    scores = p.rows * shape.heads * p.row_len * p.row_len
    if p.attn == "eager":
        probs = scores * (FP32 + (p.cd if p.cd != FP32 else 0))
        if shape.sinks:  # GPT-OSS's: the softmax over each row and its sink, and the row max's indices
            probs = sink_softmax_bytes(p, shape)
        return qkv + probs + (T * hq * p.cd if o_trainable else 0) + fused_view_bytes(p, shape)
    lse = p.rows * shape.heads * p.row_len * FP32
    bias = p.rows * p.row_len * p.row_len * p.cd if (p.attn == "sdpa" and p.mask) else 0
    o_input = T * hq * p.cd if (o_trainable and p.sequence_parallel > 1) else 0
    return qkv + T * hq * p.cd + lse + bias + o_input + fused_view_bytes(p, shape) + sink_share_bytes(
        p, shape, o_trainable=o_trainable)


def sink_softmax_bytes(p: Pass, shape: ModelShape) -> int:
    """GPT-OSS's eager attention: the scores (cd) plus the mask (the stream's dtype) with each head's sink logit as
    one more column, less the row's max (its indices saved, int64), through a softmax in the dtype they were promoted
    to (the wider of cd and the stream's), saved; where that is not cd, its cast to cd without the sink column,
    which the product with v saves."""
    rows = p.rows * shape.heads * p.row_len
    wide = max(p.cd, p.resid)
    return rows * (p.row_len + 1) * wide + (rows * p.row_len * p.cd if wide != p.cd else 0) + rows * 8


def sampler_bytes(rows: int, vocab: int, cd: int, *, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                  repetition_penalty: float = 1.0, **_) -> int:
    """A decode step's logits and what the sampler (model/generate.next_tokens) holds over them at its peak, per row
    and vocabulary entry, op by op: the head's logits (cd bytes); logits / temperature and their fp32 softmax (8);
    top_k and min_p's mask and masked copy beside the probabilities (9); top_p's nucleus, the probabilities with their
    sort (values and int64 order), its cumulative sum, the mask and the masked and scattered copies (29); the
    cumulative distribution beside the probabilities (8). A repetition_penalty other than 1 keeps the rows' seen
    flags (bool, the whole rollout) and a penalised fp32 copy through the filters, made from the logits' fp32 copy
    (a bf16 model's), its mask, product and quotient (13, or 17). Each filter's peak, the largest counting. The
    sizes are the live tensor bytes of next_tokens on the CPU (tests/test_memory_sampling.py), as
    torch.cuda.memory_allocated counts them; a CUDA sort's own scratch is not among them."""
    penalty = repetition_penalty != 1.0
    held = FP32 if penalty else 0  # the penalised logits, through the filters
    peaks = [held + 2 * FP32]  # the tempered logits and their softmax; then the probabilities and their cdf
    if penalty:
        peaks.append((0 if cd == FP32 else FP32) + 1 + 3 * FP32)
    if 0 < top_k < vocab or min_p > 0:
        peaks.append(held + 2 * FP32 + 1)
    if top_p < 1.0:
        peaks.append(held + 5 * FP32 + 8 + 1)
    return rows * vocab * (cd + penalty + max(peaks))


def sink_sampling_bytes(shape: ModelShape, rows: int, queries: int, slots: int, cd: int) -> int:
    """GPT-OSS's attention in the fast sampler (model/fast_sample._with_sinks), a layer at a time: the scores of each
    query head's `queries` positions a row over `slots` cache slots in one fp32 tensor (the softmax made in place),
    and the probabilities' cast to cd; 0 without sinks."""
    if not shape.sinks:
        return 0
    return rows * shape.heads * queries * slots * (FP32 + (cd if cd != FP32 else 0))


def sink_share_bytes(p: Pass, shape: ModelShape, *, o_trainable: bool) -> int:
    """The varlen attention's sinks (GPT-OSS; model/attention._flash_varlen): its output times each row's share of
    the softmax that the sink leaves, sigmoid(lse - sink): the sigmoid (T x heads, fp32) and its cd cast, saved, and
    the product, o_proj's input, a tensor of its own that o_proj saves where o_trainable (0 without sinks or
    varlen)."""
    if not shape.sinks or p.attn != "varlen":
        return 0
    o_input = p.tokens * shape.heads * shape.head_dim * p.cd if (o_trainable and p.sequence_parallel == 1) else 0
    return p.tokens * shape.heads * (FP32 + p.cd) + o_input


def mlp_pass(p: Pass) -> Pass:
    """The pass one run of the MLP sees: the whole micro-batch, or under model.tiled_mlp one shard of its tokens."""
    if not p.mlp_shard:
        return p
    return replace(p, rows=1, row_len=min(p.mlp_shard, p.tokens), examples=1, loss_positions=None, mlp_shard=None)


def mlp_bytes(p: Pass, shape: ModelShape, *, down_trainable: bool) -> int:
    """SwiGLU: gate output (silu input), silu output, up output, and their product when down_proj trains."""
    return p.tokens * shape.intermediate * p.cd * (4 if down_trainable else 3)


def linear_input_bytes(p: Pass, fan_in: int, readers: int) -> int:
    """Inputs kept for the weight gradients of trained linears: one tensor shared by the `readers`
    linears reading it, or one cast copy each when autocast casts an fp32 stream."""
    copies = readers if p.separate_casts else min(readers, 1)
    return copies * p.tokens * fan_in * p.cd


def shares_adapter_inputs(p: Pass) -> bool:
    """The adapters reading one input save that very tensor (Pass.adapters_in_cd, and no dropout)."""
    return p.adapters_in_cd and p.lora_dropout == 0


def lora_bytes(p: Pass, fan_in: int, r: int) -> int:
    """peft lora.Linear: x -> dropout -> A -> B. Saved: the dropout mask, A's input (a cast copy under
    autocast, the fp32 dropout output otherwise; none of its own when the adapters share their input, counted
    once per input by the halves below), and A's output (T x r)."""
    width = p.cd if p.autocast else FP32
    mask = p.tokens * fan_in * p.dropout_mask_bytes if p.lora_dropout > 0 else 0
    return mask + p.tokens * ((0 if shares_adapter_inputs(p) else fan_in) + r) * width


def dora_bytes(p: Pass, fan_in: int, fan_out: int) -> int:
    """DoRA beside an adapter (peft's DoraLinearLayer): y = base + (m / n - 1) base + (m / n) s B A x, n the row
    norms of W + s B A (detached). Saved for the magnitude's gradient: the base output and the adapter's (T x out each;
    the base's in fp32 where dropout makes peft compute it again from the dropped fp32 input without autocast), m / n,
    m / n - 1 and n (fp32, out each); with dropout, that second matmul's weight where it is a copy (a cast or a 4-bit
    base's dequantized weight: Pass.dora_weight_copy). 0 without DoRA."""
    if not p.dora:
        return 0
    base = p.cd if (p.autocast or p.lora_dropout == 0 or p.adapters_in_cd) else FP32
    adapter = p.cd if p.autocast else FP32
    copy = fan_in * fan_out * p.dora_weight_copy if p.lora_dropout > 0 else 0
    return p.tokens * fan_out * (base + adapter) + 3 * fan_out * FP32 + copy


def adapters_bytes(p: Pass, adapted: dict[str, tuple[int, int]], half: str, r: int) -> int:
    """What the adapters of one half of a layer ('self_attn.' or 'mlp.') save: LoRA's and DoRA's."""
    return sum(lora_bytes(p, i, r) + dora_bytes(p, i, o) for name, (i, o) in adapted.items() if name.startswith(half))


def shared_adapter_inputs(p: Pass, adapted: dict[str, tuple[int, int]], inputs: dict[tuple[str, ...], int]) -> int:
    """The inputs that adapters share (shares_adapter_inputs), once each: `inputs` maps the linears reading one
    tensor that nothing else saves to its width (o_proj's input is attention's output, saved by the kernel)."""
    if not shares_adapter_inputs(p):
        return 0
    return sum(p.tokens * width * p.cd for names, width in inputs.items() if any(n in adapted for n in names))


def _adapters(adapted: dict[str, tuple[int, int]], half: str) -> list[int]:
    """Fan-ins of the adapted linears in one half of a layer ('self_attn.' or 'mlp.')."""
    return [fan_in for name, (fan_in, _) in adapted.items() if name.startswith(half)]


def attn_half_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], r: int) -> int:
    """Saved by the first half of a decoder layer: input norm, q/k/v inputs, QK-norm, attention, its adapters (and
    Gemma's norm of its output)."""
    full, H = p.trainable_base, shape.hidden
    readers = shape.input_linears[0]
    total = layer_norm_bytes(p, H, trainable=full, gemma=shape.gemma_norms) + qk_norm_bytes(p, shape) + \
        attention_bytes(p, shape, o_trainable=o_input_saved(p, adapted, full=full)) + post_norm_bytes(p, shape)
    if full:  # q, k and v (or qkv_proj) read one input; o_proj reads the attention output (counted above)
        total += linear_input_bytes(p, H, len(readers))
    total += shared_adapter_inputs(p, adapted, {readers: H})
    return total + adapters_bytes(p, adapted, "self_attn.", r)


def o_input_saved(p: Pass, adapted: dict[str, tuple[int, int]], *, full: bool) -> bool:
    """Whether o_proj's input is saved for the backward (attention_bytes' o_trainable): its weight trains, or its
    adapter reads that very tensor (shares_adapter_inputs). Where it is the kernel's output (sdpa, flash) the kernel
    saves it anyway; eager attention's transposed copy, the sinks' product and sequence parallelism's all-to-all back
    are tensors of their own, which an adapter without dropout saves as a trained o_proj does (so is the CPU's
    varlen attention's concatenated output: a 4-layer Llama's LoRA step on fp32 weights was estimated at 0.969 of its
    measured peak while this was left out, 0.9999 with it; on two pipeline stages 0.940-0.958, now 0.969-0.995)."""
    return full or ("self_attn.o_proj" in adapted and shares_adapter_inputs(p))


def mlp_half_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], r: int) -> int:
    """Saved by the second half: post-attention norm, gate/up inputs, the SwiGLU, its adapters. Tiled, the norm and
    the MLP keep only their inputs (T x H each, stream dtype); a shard's tensors exist in its backward only
    (tiled_shard_bytes, norm_backward_temp)."""
    full, H, g = p.trainable_base, shape.hidden, shape.gemma_norms
    if p.mlp_shard:
        return layer_norm_bytes(p, H, trainable=full, gemma=g) + p.tokens * H * p.resid + post_norm_bytes(p, shape)
    return norm_bytes(p, H, trainable=full, gemma=g) + mlp_tensors_bytes(p, shape, adapted, r) + \
        post_norm_bytes(p, shape)


def tiled_shard_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], r: int) -> int:
    """Tiled MLP: what one shard's recompute saves for its backward (the untiled MLP's tensors, at a shard's
    tokens); 0 untiled."""
    return mlp_tensors_bytes(mlp_pass(p), shape, adapted, r) if p.mlp_shard else 0


def mlp_tensors_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], r: int) -> int:
    """The MLP's own saved tensors (gate/up inputs, the SwiGLU, its adapters), the norm before it not counted. Gemma
    4's experts beside it: theirs too, the router's (and its adapter), and the three norms around them (of the MLP's
    output, of the residual into the experts, of their output)."""
    e = shape.experts
    if e and not e.beside:
        return router_bytes(p, shape, adapted) + experts_bytes(p, shape, adapted)
    full, H = p.trainable_base, shape.hidden
    moe = 0
    if e:
        moe = router_bytes(p, shape, adapted) + experts_bytes(p, shape, adapted) + \
            3 * norm_bytes(p, H, trainable=full, gemma=True) + \
            (lora_bytes(p, H, r) if e.router in adapted else 0)
    readers = shape.input_linears[1]
    total = mlp_bytes(p, shape, down_trainable=full)
    if full:  # gate and up (or gate_up_proj) read one input; down_proj reads the product (counted above)
        total += linear_input_bytes(p, H, len(readers))
    total += shared_adapter_inputs(p, adapted, {readers: H, ("mlp.down_proj",): shape.intermediate})
    return moe + total + adapters_bytes(p, adapted, "mlp.", r)


# --------------------------------------------------------------------------- a mixture of experts (params.Experts)
# transformers' router and grouped_mm experts (integrations/moe.py), on T tokens, S = T x top_k token-expert pairs,
# E experts of I columns. The experts run in their weights' dtype (the stream's, `resid`: autocast does not reach
# grouped_mm), the router's matmul in cd. LoRA on an expert parameter (peft's ParamWrapper) runs unmerged beside it,
# model/lora_experts.py: x W^T + s (x A^T) B^T in grouped matmuls over the pairs, never a merged W + B A.


def _trains(p: Pass, adapted: dict[str, tuple[int, int]], name: str) -> bool:
    return p.trainable_base or name in adapted


def expert_fans(shape: ModelShape) -> dict[str, tuple[int, int]]:
    e = shape.experts
    return {e.gate_up: (shape.hidden, 2 * e.intermediate), e.down: (e.intermediate, shape.hidden)}


def expert_rank(p: Pass, name: str) -> tuple[int, int]:
    """An adapted expert parameter's LoRA rank r, and the rank r' it runs at: padded with zero ranks so that a row of
    r' values in the experts' dtype is a multiple of 16 bytes, which torch's grouped matmul takes."""
    r = dict(p.expert_ranks)[name]
    return r, r + (-r % (16 // p.resid))


def expert_adapter_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], names=None) -> int:
    """What the adapters of the adapted expert parameters among `names` (all by default) save for backward, run
    unmerged: the rank-r' rows x A^T (S x r'), B^T copied with the experts outermost (E x r' x out), and A^T (E x in x
    r'): a view of peft's fp32 A, or its cast to a 16-bit base's dtype, or, padded, a copy; all in the experts' dtype
    (expert_rank)."""
    total, S, E, w = 0, shape.experts.pairs(p.tokens), shape.experts.local, p.resid
    for name, (i, o) in expert_fans(shape).items():
        if name in adapted and (names is None or name in names):
            r, padded = expert_rank(p, name)
            a = E * i * padded * w if (padded != r or p.expert_factors_cast) else 0
            total += S * padded * w + E * padded * o * w + a
    return total


def router_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> int:
    """The router: its input (T x H, cd) where its weight trains, the merged weight where LoRA adapts it (E x H, cd;
    an fp32 base's is autocast's copy, counted with the weights' casts), the fp32 softmax over the experts, the top_k
    indices (int64) and, where the top_k weights are normalised, their fp32 values and sum."""
    e, T = shape.experts, p.tokens
    if e.beside:  # Gemma 4's: a weightless norm of the residual, times a learned scale, then router.proj (a Linear)
        H, k = shape.hidden, e.top_k
        norm = norm_bytes(p, H, trainable=False, gemma=True) + (T * H * p.resid if p.trainable_base else 0)
        proj = linear_input_bytes(p, H, 1) if p.trainable_base else 0  # (its adapter: mlp_tensors_bytes)
        # the fp32 softmax over the experts; the top_k's indices, twice (their gather of per_expert_scale), the
        # renormalised weights and their sum, the scales gathered
        return norm + proj + T * e.count * FP32 + T * k * (2 * 8 + 3 * FP32) + T * FP32
    merged = e.count * shape.hidden * p.cd if (e.router in adapted and not p.separate_casts) else 0
    x = T * shape.hidden * p.cd if _trains(p, adapted, e.router) else 0
    if e.router == "mlp.router":  # GPT-OSS's: the softmax of the top_k logits (T x top_k, cd) and their indices
        return x + merged + T * e.top_k * (8 + p.cd)
    return x + merged + T * e.count * FP32 + T * e.top_k * 8 + (T * (e.top_k + 1) * FP32 if e.normalised else 0)


def experts_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> int:
    """The experts: the pairs' gathered input (S x H) where gate_up_proj trains, gate_up_proj's output (S x 2I: silu
    keeps the gate half, and with it the whole tensor), silu's output (S x I), their product (S x I) where
    down_proj trains, down_proj's output (S x H, for the routing weights' gradient) and the routing weights (S, fp32
    or cd), all in the experts' dtype; the sort's three int64 permutations (S each) and the groups' int32 offsets;
    and what the adapters of the adapted parameters save (expert_adapter_bytes)."""
    e, w = shape.experts, p.resid
    S, H, i = e.pairs(p.tokens), shape.hidden, e.intermediate
    gathered = S * H * w if _trains(p, adapted, e.gate_up) else 0
    product = S * i * w if _trains(p, adapted, e.down) else 0
    weights = S * (FP32 if e.fp32_weights else p.cd)
    # GPT-OSS's clamped gate saves, beside gate_up_proj's output (S x 2I, its clamps' input), the clamped gate, its
    # sigmoid, their product and clamp(up) + 1 (S x I each); a trained bias's gather keeps the sorted expert ids
    gate = S * (6 if e.clamped_gate else 3) * i * w
    bias_ids = S * 8 if (e.biases and p.trainable_base) else 0
    return (gathered + gate + product + S * H * w + weights + 3 * S * 8 + bias_ids + e.local * 4
            + expert_adapter_bytes(p, shape, adapted))


def _weighted_width(p: Pass, shape: ModelShape) -> int:
    """Bytes an element of the routing-weighted output: the experts' dtype times the routing weights' (fp32 where
    either is: Mixtral's weights, an fp32 model's experts)."""
    return max(p.resid, FP32 if shape.experts.fp32_weights else p.cd)


def _adapter_backward(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], name: str) -> int:
    """An adapted expert parameter's adapter in backward, beside the base's gradients: its input's gradient (S x in,
    summed into the base's after), the rank-r' rows' (S x r') and B^T's and A^T's (E x r' x (in + out))."""
    if name not in adapted:
        return 0
    i, o = expert_fans(shape)[name]
    _, padded = expert_rank(p, name)
    S = shape.experts.pairs(p.tokens)
    return p.resid * (S * i + S * padded + shape.experts.local * padded * (i + o))


def experts_backward_temp(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> int:
    """The experts' backward at its largest, step by step: the output's gradient cast to the weighted width
    (_weighted_width; T x H) beside the scattered gradient of the pairs (S x H); the routing weights' product's (its
    gradient, the routing weights' gradient temporary and the output's gradient cast to the experts' dtype); then in
    the experts' dtype, down_proj's (its output's gradient, S x H, its input's, S x I, and where LoRA adapts it the
    adapter's, _adapter_backward), the SwiGLU's (the gradients of the product, of silu's output and of up, S x I each,
    beside gate_up_proj's output gradient, S x 2I), gate_up_proj's (that gradient, its input's, S x H, and an
    adapter's), then the gather's (the pairs' input gradient beside the tokens'). (GPT-OSS's clamped gate, measured:
    the product's gradient and two more S x I at its largest.) Every moment before down_proj's
    backward has run also holds what down_proj saved (down_input_bytes), which the caller counts as freed."""
    e, w, ww = shape.experts, p.resid, _weighted_width(p, shape)
    S, T, H, i = e.pairs(p.tokens), p.tokens, shape.hidden, e.intermediate
    down = _adapter_backward(p, shape, adapted, e.down)
    gate_up = _adapter_backward(p, shape, adapted, e.gate_up)
    before_down = max(T * H * ww * (ww != w) + S * H * ww, S * H * (2 * ww + w * (ww != w)),
                      w * S * (H + i) + down) + down_input_bytes(p, shape, adapted, 0)
    gate = (3 if e.clamped_gate else 5) * i
    return max(before_down, w * S * gate, w * S * (2 * i + H) + gate_up, w * (S + T) * H)


def experts_forward_temp(p: Pass, shape: ModelShape) -> int:
    """Beside what the experts save, in their forward: the routing-weighted output (S x H at the weighted width) and
    its copy back in token order, or that copy and its sum over the top_k (T x H) with its cast."""
    S, T, H, ww = shape.experts.pairs(p.tokens), p.tokens, shape.hidden, _weighted_width(p, shape)
    return max(2 * S * H * ww, S * H * ww + T * H * (ww + p.resid))


def experts_eval_bytes(p: Pass, shape: ModelShape) -> int:
    """The experts' forward without a graph, at its largest: the pairs' input (S x H) beside gate_up_proj's output
    (S x 2I), silu's and the product (S x I each), or beside down_proj's output, the weighted one and its reordered
    copy (S x H each). (The adapters' rank-r' rows are small beside them.)"""
    S, H, i = shape.experts.pairs(p.tokens), shape.hidden, shape.experts.intermediate
    return p.resid * S * (H + max(4 * i, 3 * H))


def layer_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], r: int) -> int:
    """Everything one decoder layer saves for backward (gradient checkpointing off)."""
    return attn_half_bytes(p, shape, adapted, r) + mlp_half_bytes(p, shape, adapted, r) + \
        per_layer_input_bytes(p, shape, adapted, r)


# --------------------------------------------------------------------------- Gemma 4's per-layer inputs (PLE)
# Before the layers: the per-layer embeddings of the ids (a table of layers x D a token, in the weights' dtype) plus
# the embeddings' projection to as many (per_layer_model_projection, normed over each layer's D), summed: one
# [T, layers, D] tensor, each layer reading its slice. At the end of each layer: gate = gelu(per_layer_input_gate(h)),
# h + norm(per_layer_projection(gate * its slice)).


def ple_width(p: Pass) -> int:
    """The per-layer inputs' dtype: the table's (the stream's) and the projection's (cd) promoted."""
    return max(p.cd, p.resid)


def per_layer_input_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], r: int) -> int:
    """What a layer's per-layer input block saves: gelu's input (the gate's output, T x D in cd), its output (for
    the product's gradient towards the per-layer input, where that trains: Pass.per_layer_inputs_train), the gate's
    and the projection's inputs where their weights train (T x H, and the product cast to cd, T x D), their adapters,
    and the norm after the projection (Gemma's fp32 norm over T x H). The slice of the per-layer inputs it multiplies
    is a view of theirs (per_layer_inputs_bytes). 0 without per-layer inputs."""
    if not shape.per_layer_input:
        return 0
    full, H, D, T = p.trainable_base, shape.hidden, shape.per_layer_input, p.tokens
    total = T * D * p.cd * (1 + p.per_layer_inputs_train)
    if full:
        total += linear_input_bytes(p, H, 1) + T * D * p.cd
    total += shared_adapter_inputs(p, adapted, {("per_layer_input_gate",): H, ("per_layer_projection",): D})
    total += sum(lora_bytes(p, fan_in, r) + dora_bytes(p, fan_in, fan_out) for name, (fan_in, fan_out) in
                 adapted.items() if name in ("per_layer_input_gate", "per_layer_projection"))
    return total + norm_bytes(p, H, trainable=full, gemma=True)


def per_layer_inputs_bytes(p: Pass, shape: ModelShape, other_adapted: dict[str, tuple[int, int]], r: int) -> int:
    """Saved before the layers, alive until the first layer's backward: the per-layer inputs (T x layers x D, their
    dtype: ple_width), and where they train (Pass.per_layer_inputs_train: the projection's weight or an adapter on
    it), the norm over the projection's output (its fp32 input, the rsqrt per token and layer, the normed fp32 where
    its weight trains), the projection's input (the embeddings, cast to cd under autocast) where its weight trains,
    its adapter."""
    if not shape.per_layer_input:
        return 0
    n = p.tokens * shape.layers * shape.per_layer_input
    total = n * ple_width(p)
    if not p.per_layer_inputs_train:
        return total
    total += n * FP32 * (1 + p.trainable_base) + p.tokens * shape.layers * FP32
    if p.trainable_base:
        total += linear_input_bytes(p, shape.hidden, 1)
    if (lin := other_adapted.get("per_layer_model_projection")) is not None:
        total += lora_bytes(p, lin[0], r) + dora_bytes(p, *lin)
    return total


def per_layer_inputs_grad_bytes(p: Pass, shape: ModelShape) -> int:
    """The per-layer inputs' gradient through the layers' backward, where they train: autograd makes each layer's
    slice's gradient as a whole [T, layers, D] tensor and sums them into one, held from the last layer's backward to
    the projection's (one, and a second while a layer's is summed in)."""
    if not shape.per_layer_input or not p.per_layer_inputs_train:
        return 0
    return p.tokens * shape.layers * shape.per_layer_input * ple_width(p)


def down_input_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]], r: int) -> int:
    """What down_proj saved (freed once its backward has run): the product, or its adapter's inputs (tiled: a
    shard's, counted in tiled_shard_bytes)."""
    if p.mlp_shard:
        return 0
    e = shape.experts
    if e:  # the experts' product and what down_proj's adapter saved
        product = e.pairs(p.tokens) * e.intermediate * p.resid if _trains(p, adapted, e.down) else 0
        moe = product + expert_adapter_bytes(p, shape, adapted, (e.down,))
        if not e.beside:
            return moe
        return moe + down_input_bytes(p, replace(shape, experts=None), adapted, r)  # Gemma 4's MLP beside them
    if p.trainable_base:
        return p.tokens * shape.intermediate * p.cd
    if "mlp.down_proj" not in adapted:
        return 0
    return lora_bytes(p, shape.intermediate, r) + dora_bytes(p, *adapted["mlp.down_proj"]) + \
        shared_adapter_inputs(p, adapted, {("mlp.down_proj",): shape.intermediate})


def frozen_input_discount(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> int:
    """What the first layer does not save when the embeddings are frozen (LoRA): its input needs no
    gradient, so the input norm saves nothing and q/k/v adapters keep no dropout mask; under DoRA, their base
    outputs need none either: no m / n - 1 for it, nor the weight copy of the dropped input's matmul."""
    attn_in = {name: fans for name, fans in adapted.items() if name in shape.input_linears[0]}
    masks = sum(p.tokens * i * p.dropout_mask_bytes for i, _ in attn_in.values()) if p.lora_dropout > 0 else 0
    dora = sum(o * FP32 + (i * o * p.dora_weight_copy if p.lora_dropout > 0 else 0)
               for i, o in attn_in.values()) if p.dora else 0
    return layer_norm_bytes(p, shape.hidden, trainable=False, gemma=shape.gemma_norms) + masks + dora


def checkpoint_bytes(p: Pass, shape: ModelShape) -> int:
    """With gradient checkpointing a layer keeps only its input hidden states (T x H, stream dtype)."""
    return p.tokens * shape.hidden * p.resid


def rope_bytes(p: Pass, shape: ModelShape) -> int:
    """RoPE cos and sin, b x s x the rotated dims each in the stream dtype, made once and saved by every layer (Gemma
    3: a pair for its local layers and one for its global ones)."""
    return 2 * shape.rope_sets * p.rows * p.row_len * (shape.rope_width or shape.rotary_dim) * p.resid


def stream_inputs_bytes(p: Pass, shape: ModelShape, *, embed_trainable: bool) -> int:
    """Saved below the first layer, alive until the embedding's backward: the token ids for its gradient
    (int64, when it trains) and RoPE."""
    return (p.tokens * 8 if embed_trainable else 0) + rope_bytes(p, shape)


def outside_layers_bytes(p: Pass, shape: ModelShape, *, embed_trainable: bool, norm_trainable: bool,
                         other_adapted: dict[str, tuple[int, int]] | None = None, r: int = 0) -> int:
    """Saved outside the decoder layers: the stream's inputs, the final norm, and the loss's input (and Gemma 4's
    per-layer inputs: per_layer_inputs_bytes). The LM head saves nothing past the forward (trainable or not, adapted
    or not): it runs inside the chunks."""
    return (stream_inputs_bytes(p, shape, embed_trainable=embed_trainable)
            + norm_bytes(p, shape.hidden, trainable=norm_trainable, gemma=shape.gemma_norms)
            + loss_input_bytes(p, shape) + per_layer_inputs_bytes(p, shape, other_adapted or {}, r))


def mask_bytes(p: Pass, masks: int = 1) -> int:
    """The 4-D masks transformers builds once per forward (`masks`: Gemma 3 builds a causal and a sliding-window
    one): bool for SDPA, a stream-dtype additive mask for eager (always built); flash-attention needs none."""
    if p.attn == "eager":
        return masks * p.rows * p.row_len * p.row_len * p.resid
    return masks * p.rows * p.row_len * p.row_len if (p.attn == "sdpa" and p.mask) else 0


def lora_forward_temp(p: Pass, fan_in: int, fan_out: int) -> int:
    """peft casts an adapter's input to the adapter's fp32 (a copy unless it is fp32 already) and
    dropout makes another fp32 tensor; both live, beside the base layer's output, until lora_A has
    cast its input back."""
    copies = (p.cd != FP32 and not p.adapters_in_cd) + (p.lora_dropout > 0)
    return p.tokens * (fan_in * FP32 * copies + fan_out * p.cd)


def dora_forward_temp(p: Pass, fan_in: int, fan_out: int) -> int:
    """DoRA's row norms of W + s B A, made in each forward (peft's get_lora_weight and get_weight_norm): B A as B(A(I)),
    I the identity of fan_in rows in the adapters' dtype, then W and B A cast to the input's dtype (the adapters',
    fp32 unless they run in cd), s B A and the sum: the identity and four [out, in] tensors at once at most. Under
    tensor parallelism (dora_split), llmtrain's: B A made directly, W added in place: two [out, in] tensors of the
    GPU's part at most. 0 without DoRA."""
    if not p.dora:
        return 0
    width = p.cd if p.adapters_in_cd else FP32
    if p.dora_split:
        return 2 * fan_in * fan_out * width
    return fan_in * fan_in * width + 4 * fan_in * fan_out * width


def dora_norms_temp(p: Pass, adapted: dict[str, tuple[int, int]]) -> int:
    """The largest of a layer's dora_forward_temp (its adapters make their row norms one after another)."""
    return max((dora_forward_temp(p, i, o) for i, o in adapted.values()), default=0)


def lora_backward_temp(p: Pass, fan_in: int) -> int:
    """Backward through an adapter's casts and dropout: fp32 gradients of its input (cd where the adapter runs in
    cd), two at a time."""
    return p.tokens * fan_in * 2 * (p.cd if p.adapters_in_cd else FP32)


def layer_forward_temp(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> int:
    """Short-lived tensors inside one layer's forward, beside the residual (T x H) it carries: eager's
    cd scores and their fp32 softmax input, otherwise the fp32 RoPE outputs of q and k before they are
    cast; or an adapter's fp32 input copies (plus the SwiGLU product, which a frozen down_proj does
    not save, while down_proj's adapter runs; under DoRA, its row norms' tensors too: dora_forward_temp). Under
    sequence parallelism, plus the all-to-all buffers (all_to_all_temp)."""
    T = p.tokens
    if p.attn == "eager" and shape.sinks:  # GPT-OSS's, beside its softmax's output: the masked scores and the
        # softmax's input (those and the sink column, less the row max), in the dtype they were promoted to
        attn = p.rows * shape.heads * p.row_len * (2 * p.row_len + 1) * max(p.cd, p.resid)
    elif p.attn == "eager":
        attn = p.rows * shape.heads * p.row_len * p.row_len * (p.cd + FP32)
    else:
        attn = T * (shape.heads + shape.kv_heads) * shape.head_dim * FP32
    lora = adapter_forward_temps(p, shape, adapted)
    if shape.experts:
        lora.append(experts_forward_temp(p, shape))
    return T * shape.hidden * p.resid + max([attn] + lora) + all_to_all_temp(p, shape)


def adapter_forward_temps(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> list[int]:
    """Each adapter's moment in a layer's forward (layer_forward_temp): its input copies and base output
    (lora_forward_temp), DoRA's row norms (dora_forward_temp), and beside down_proj's the SwiGLU product it reads."""
    m = mlp_pass(p)
    temps = [lora_forward_temp(p, i, o) + dora_forward_temp(p, i, o) for name, (i, o) in adapted.items()
             if not name.startswith("mlp.")]
    if not shape.experts or shape.experts.beside:
        temps += [lora_forward_temp(m, i, o) + dora_forward_temp(m, i, o) + (
                  m.tokens * i * p.cd if name == "mlp.down_proj" and not p.trainable_base else 0)
                  for name, (i, o) in adapted.items() if name.startswith("mlp.")]
    return temps


def residual_grad_bytes(p: Pass, shape: ModelShape) -> int:
    """The gradient flowing down the residual stream (T x H, stream dtype), alive all through backward."""
    return p.tokens * shape.hidden * p.resid


def mlp_backward_temp(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> int:
    """Gradients alive in the MLP's backward: of the product, then of silu's output and up's output
    (three T x I at once), or an adapter's fp32 input gradients. Tiled: those of one shard, beside the tensors its
    recompute saved (tiled_shard_bytes)."""
    if shape.experts and not shape.experts.beside:
        return experts_backward_temp(p, shape, adapted)
    if shape.experts:  # Gemma 4's: the experts' backward or the MLP's beside them
        return max(experts_backward_temp(p, shape, adapted), mlp_backward_temp(p, replace(shape, experts=None),
                                                                                adapted))
    m = mlp_pass(p)
    mlp = 3 * m.tokens * shape.intermediate * p.cd
    dx = p.tokens * shape.hidden * p.resid if p.mlp_shard else 0  # tiled: the input's gradient, filled shard by shard
    return dx + max([mlp] + [lora_backward_temp(m, fan_in) for fan_in in _adapters(adapted, "mlp.")])


def norm_backward_temp(p: Pass, hidden: int) -> int:
    """RMSNorm's backward (transformers' LlamaRMSNorm, which computes in fp32) at its largest, in pow's backward:
    the input's gradient through x * rsqrt (held until pow's joins it), mean's expanded gradient, and pow's x**1,
    2 * x and their product with it: five fp32 T x H. It runs after the MLP's backward, with the MLP's tensors
    freed and attention's still saved: under model.tiled_mlp, whose MLP backward holds one shard's tensors only,
    the post-attention norm's backward was the layer's largest moment. Tiled with the MLP (layer_norm_bytes): the
    input's gradient (T x H, stream dtype, filled shard by shard) beside one shard's recompute (its fp32 input and
    rsqrt) and those five temporaries at a shard's tokens."""
    if p.mlp_shard:
        s = mlp_pass(p)
        return p.tokens * hidden * p.resid + norm_bytes(s, hidden, trainable=p.trainable_base) + \
            5 * s.tokens * hidden * FP32
    return 5 * p.tokens * hidden * FP32


def attn_backward_temp(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> int:
    """Gradients alive in attention's backward: eager's fp32 gradients of probabilities and scores
    (8 bytes per score); SDPA/flash's dq, dk, dv, the output gradient and the kernel's fp32 dq
    accumulator; or an adapter's fp32 input gradients. Under sequence parallelism, plus the all-to-all buffers of
    the gradients of the output, q, k and v (all_to_all_temp)."""
    T, hq = p.tokens, shape.heads * shape.head_dim
    if p.attn == "eager" and shape.sinks:  # GPT-OSS's: the gradients of the softmax's input with its sink column,
        # three at a time (its output's, its input's, and the row max's scattered back), in the softmax's dtype
        attn = p.rows * shape.heads * p.row_len * (p.row_len + 1) * 3 * max(p.cd, p.resid)
    elif p.attn == "eager":
        attn = p.rows * shape.heads * p.row_len * p.row_len * 2 * FP32
    else:
        attn = T * (hq * (2 * p.cd + FP32) + 2 * kv_width(p, shape) * p.cd)
    # QK-norm's backward, once the kernel's is done: dq, dk, dv held, and q's norm's five fp32 temporaries
    qk = T * ((hq + 2 * shape.kv_heads * shape.head_dim) * p.cd + 5 * hq * FP32) if shape.qk_norm else 0
    return max([attn, qk] + [lora_backward_temp(p, fan_in) for fan_in in _adapters(adapted, "self_attn.")]) + \
        all_to_all_temp(p, shape)


def eval_layer_bytes(p: Pass, shape: ModelShape, adapted: dict[str, tuple[int, int]]) -> int:
    """A layer's forward without a graph (evaluation), at its largest: the embeddings (held by the model's
    forward throughout), the layer's input, the residual after attention and the normalised input (4 x T x H,
    stream dtype) and RoPE, beside the MLP's largest moment or eager's scores. The MLP holds gate, up and
    their product (3 x T x I, cd), with eager's probabilities (the decoder layer keeps the attention weights
    it ignores until it returns); an adapted up_proj holds silu's output, its base output, lora_B's output
    and its scaled copy (in the adapter's fp32 without autocast), and the input's fp32 cast. Under DoRA, or an
    adapter's forward as in training (adapter_forward_temps: its row norms beside its input copies), beside the
    layer's stream."""
    T, I, m = p.tokens, shape.intermediate, mlp_pass(p).tokens  # m: the tokens the MLP runs at once
    scores = p.rows * shape.heads * p.row_len * p.row_len if p.attn == "eager" else 0
    mlp = 3 * m * I * p.cd
    if shape.experts and shape.experts.beside:  # Gemma 4's: the MLP's output (normed) held while the experts run
        mlp = max(mlp, 2 * T * shape.hidden * p.resid + experts_eval_bytes(p, shape))
    elif shape.experts:
        mlp = experts_eval_bytes(p, shape)
    elif any(name in adapted for name in shape.input_linears[1]):  # up_proj (Phi: gate_up_proj) adapted
        cast = m * shape.hidden * FP32 if p.resid != FP32 else 0
        mlp = max(mlp, m * I * (2 * p.cd + 2 * (p.cd if p.autocast else FP32)) + cast)
    dora = max(adapter_forward_temps(p, shape, adapted), default=0) if p.dora else 0
    return 4 * T * shape.hidden * p.resid + rope_bytes(p, shape) + max(mlp + scores * p.resid, scores * (p.cd + FP32),
                                                                      dora)


# --------------------------------------------------------------------------- the loss (llmtrain.model.loss)
# The loss gathers the trained positions' hidden states (N = Pass.loss_tokens) and sends them through the
# LM head and the cross-entropy C tokens at a time, each chunk under torch.utils.checkpoint: its logits are
# recomputed in backward, so one chunk's logits exist at any moment, never the micro-batch's.


def loss_chunk(p: Pass, chunk_tokens: int) -> int:
    """C: the tokens of the largest chunk."""
    return min(p.loss_tokens, chunk_tokens)


def loss_input_bytes(p: Pass, shape: ModelShape) -> int:
    """Kept by the loss from forward to backward: the gathered hidden states (N x H, stream dtype), which the
    checkpointed chunks are recomputed from, and the gather's index and the targets (int64, N each)."""
    return p.loss_tokens * (shape.hidden * p.resid + 2 * 8)


def chunk_forward_bytes(p: Pass, vocab: int, chunk: int) -> int:
    """One chunk's forward, C*V elements, none of it kept: the head's output in cd beside its fp32 copy,
    then the fp32 logits beside the log-softmax: max(cd + 4, 8) bytes a logit (with fp32 logits
    `.float()` is a no-op). Evaluation's is chunk_eval_bytes."""
    return chunk * vocab * max(p.cd + FP32, 2 * FP32)


def chunk_backward_bytes(vocab: int, chunk: int, cap: int = 0) -> int:
    """One chunk's backward once its forward is recomputed: the saved log-softmax, NLL's dense gradient and
    log-softmax's input gradient, all fp32 C x V: 12 bytes a logit. This is the loss's peak. A capped model's
    logits (cap tanh(x / cap), loss.logit_transform) also keep tanh's output, `cap` bytes a logit (cd)."""
    return chunk * vocab * (3 * FP32 + cap)


def chunk_logits_grad_bytes(p: Pass, vocab: int, chunk: int, *, fp32_head: bool = False) -> int:
    """The chunk logits' gradient in cd, entering the LM head's backward; in fp32 where the head makes fp32 logits
    (rl.cast_lm_head_to_fp32)."""
    return chunk * vocab * (FP32 if fp32_head else p.cd)


def chunk_eval_bytes(p: Pass, vocab: int, chunk: int, chunks: int) -> int:
    """Evaluation's chunk (no graph): the head output and its fp32 copy (the loop drops each chunk's logits
    before the next chunk's exist, so `chunks` does not add up)."""
    return max(chunk * vocab * (p.cd + FP32), chunk * vocab * 2 * FP32)
