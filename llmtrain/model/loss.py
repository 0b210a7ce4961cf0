"""The loss, computed from the final hidden states without ever materialising full fp32 logits.

`compute_loss(model, batch)` is the one loss of training and evaluation: the sum (not the mean) of the
token cross-entropies of the trained tokens; the caller normalises. It runs inside the model's own
forward (see `attach_loss`), so under FSDP the LM head's parameters are gathered exactly as for an
ordinary forward.

How the memory stays small: only trained positions reach the LM head (their indices are computed by
the collator on the CPU), and they go through it `chunk` tokens at a time. Each chunk's logits, their
fp32 copy and the cross-entropy are recomputed in backward (torch.utils.checkpoint), so at any moment
one chunk's logits exist, not the whole micro-batch's: for 16k tokens and a 32k vocabulary, 2 GiB of
fp32 logits plus as much again for their gradient become 0.5 GiB + 0.5 GiB at chunk 4096.
"""

from __future__ import annotations

import types
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from llmtrain.errors import LLMTrainError


def _chunk_loss(head, hidden: torch.Tensor, targets: torch.Tensor, dft: bool = False) -> torch.Tensor:
    # Cross-entropy in fp32: bf16 log-softmax over a 32k vocabulary loses digits the loss needs.
    loss = F.cross_entropy(head(hidden).float(), targets, reduction="none" if dft else "sum")
    return (loss * torch.exp(-loss.detach())).sum() if dft else loss  # DFT: each -log p times its p, no gradient


def _chunk_token_loss(head, hidden: torch.Tensor, targets: torch.Tensor, stat: str | None = None):
    logits = head(hidden).float()
    if stat == ENTROPY_TRAINED:
        return _CrossEntropyAndEntropy.apply(logits, targets)
    loss = F.cross_entropy(logits, targets, reduction="none")
    return (loss, ROW_STATS[stat](logits, targets)) if stat else loss


ENTROPY_ROWS = 64  # rows of a chunk's logits whose entropy is taken at a time: 2 x 64 x vocab fp32 beside the chunk


def _row_blocks(logits: torch.Tensor, fill, *, targets: torch.Tensor | None = None, width: int = 0,
                buffers: int = 1) -> torch.Tensor:
    """Statistics of each row of `logits` ([rows], or [rows, width]), ENTROPY_ROWS rows at a time:
    `fill(z, targets, out, *buffers)` with z a block's logits, targets its rows' (or None), out the block's rows of
    the result and `buffers` buffers of the block's shape reused by every block. Reused buffers, not fresh
    temporaries per block: those fragmented the CPU allocator's heap (+12% peak RSS on benchmarks/grpo_vs_trl.py; +1%
    with the buffer)."""
    n = logits.shape[0]
    out = logits.new_empty((n, width) if width else n)
    reused = [logits.new_empty(min(ENTROPY_ROWS, n), logits.shape[-1]) for _ in range(buffers)]
    for s in range(0, n, ENTROPY_ROWS):
        e = min(s + ENTROPY_ROWS, n)
        fill(logits[s:e], None if targets is None else targets[s:e], out[s:e], *(b[: e - s] for b in reused))
    return out


def _exp_from_max(z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t = e^(z - max) of each row, so softmax(z) = t / total: (the rows' maxima, total), both [rows, 1]."""
    top = z.amax(-1, keepdim=True)
    return top, torch.sub(z, top, out=t).exp_().sum(-1, keepdim=True)


def _entropy_block(z: torch.Tensor, targets, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The block's entropies into `out`; returns their log-sum-exps. t ends as t x z."""
    top, total = _exp_from_max(z, t)
    lse = top + total.log()
    torch.sub(lse, t.mul_(z).sum(-1, keepdim=True) / total, out=out[:, None])
    return lse


@torch.no_grad()
def _entropy(logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's entropy of softmax(logits), in fp32, in blocks of rows (_row_blocks; the buffer holds the shifted
    exponentials, then their product with the logits): far below the chunk's own logits, under the loss's peak,
    which is its backward (activations.chunk_backward_bytes: 12 bytes a logit against the forward's 8)."""
    return _row_blocks(logits, _entropy_block)


def _log_sum_sq_of(t: torch.Tensor, total: torch.Tensor, out: torch.Tensor) -> None:
    """log sum p^2 of each row into `out`, from t = e^(z - max) and its sum (the maxima cancelling); t ends as t^2."""
    torch.sub(t.mul_(t).sum(-1).log_(), 2 * total.squeeze(-1).log(), out=out)


def _log_sum_sq_block(z: torch.Tensor, targets, out: torch.Tensor, t: torch.Tensor) -> None:
    _log_sum_sq_of(t, _exp_from_max(z, t)[1], out)


@torch.no_grad()
def _log_sum_sq(logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's log sum_v p_v^2 of softmax(logits) (WPO's alignment term: logsumexp(2z) - 2 logsumexp(z)), in fp32,
    in blocks of rows as _entropy (_row_blocks)."""
    return _row_blocks(logits, _log_sum_sq_block)


def _pair_block(z: torch.Tensor, targets: torch.Tensor, out: torch.Tensor, t: torch.Tensor,
                product: torch.Tensor) -> None:
    out[:, 2] = z.mean(-1)
    top, total = _exp_from_max(z, t)
    # the target is the argmax (a tie with another token counts: argmax's own pass cost more than the rest here)
    out[:, 3:] = (z.gather(1, targets[:, None]) >= top).to(out.dtype)
    # the entropy as _entropy_block's, its product in a second buffer: t is still needed for the sum of squares
    out[:, :1] = top + total.log() - torch.mul(t, z, out=product).sum(-1, keepdim=True) / total
    _log_sum_sq_of(t, total, out[:, 1])


@torch.no_grad()
def _pair_stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[rows, 4] of each row of `logits`: its entropy, its log sum_v p_v^2 (WPO's), its mean logit (over the
    vocabulary) and whether its target's logit is the largest (1.0 or 0.0; TRL's argmax == target but on exact ties):
    TRL's DPOTrainer metrics and WPO's weights from one pass over the chunk, in blocks of rows over two reused
    buffers (_row_blocks; the numbers of _entropy and _log_sum_sq to the bit). 169 ms for 2,048 x 32,768 logits on
    one CPU thread, where the cross-entropy's forward and backward take 367 ms."""
    return _row_blocks(logits, _pair_block, targets=targets, width=len(PAIR_STATS), buffers=2)


# per-token statistics of the distribution, taken beside the per-token loss without gradient (`stat`), each a function
# of a chunk's logits and its targets (which the entropy and the log sum of squares do not read)
ROW_STATS = {"entropy": _entropy, "log_sum_sq": _log_sum_sq, "pairs": _pair_stats}
PAIR_STATS = ("entropy", "log_sum_sq", "mean_logit", "top1")  # "pairs"' columns
ENTROPY_TRAINED = "entropy_trained"  # `stat`: the entropy with its gradient (online RL's entropy bonus)


def _lse_entropy_block(z: torch.Tensor, targets, out: torch.Tensor, t: torch.Tensor) -> None:
    """A block's log-sum-exp and entropy, side by side in `out` [rows, 2] (_entropy_block's)."""
    out[:, :1] = _entropy_block(z, targets, out[:, 1], t)


class _CrossEntropyAndEntropy(torch.autograd.Function):
    """Each row's cross-entropy against its target and its entropy, both differentiable, from one chunk's fp32 logits
    z (online RL's entropy bonus: TRL's fused head gives the entropy its gradient too). Forward and backward run in
    blocks of ENTROPY_ROWS rows over one reused buffer; backward writes the logits' gradient once, row block by row
    block: g_loss (p - onehot(target)) - g_entropy p (log p + H), p = softmax(z), log p = z - lse. Beside the saved
    logits (4 bytes a logit) it holds that gradient (4 more) and one block: below the plain cross-entropy's
    backward (activations.chunk_backward_bytes: 12)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, targets: torch.Tensor):
        both = _row_blocks(z, _lse_entropy_block, width=2)
        lse, entropy = both[:, 0], both[:, 1]
        ctx.save_for_backward(z, targets, lse, entropy)
        return lse - z.gather(1, targets[:, None]).squeeze(1), entropy.clone()

    @staticmethod
    def backward(ctx, g_loss, g_entropy):
        z, targets, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(z)
        g_loss = torch.zeros_like(lse) if g_loss is None else g_loss.to(z.dtype)
        buf = z.new_empty(min(ENTROPY_ROWS, z.shape[0]), z.shape[-1]) if g_entropy is not None else None
        for s in range(0, z.shape[0], ENTROPY_ROWS):
            e = min(s + ENTROPY_ROWS, z.shape[0])
            p = torch.sub(z[s:e], lse[s:e, None], out=grad[s:e]).exp_()
            if g_entropy is not None:  # d H / d z = -p (log p + H)
                t = torch.sub(z[s:e], (lse[s:e] - entropy[s:e])[:, None], out=buf[: e - s]).mul_(p)
                p.mul_(g_loss[s:e, None]).sub_(t.mul_(g_entropy[s:e, None].to(z.dtype)))
            else:
                p.mul_(g_loss[s:e, None])
        grad.scatter_add_(1, targets[:, None], -g_loss[:, None])
        return grad, None


def chunked_cross_entropy(hidden: torch.Tensor, head, targets: torch.Tensor, *, chunk: int,
                          with_hits: bool = False, per_token: bool = False, stat: str | None = None,
                          dft: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum of cross-entropies of `head(hidden)` against `targets` (N tokens, none ignored), `chunk` tokens at
    a time; with_hits also returns, per token, whether the argmax is the target (evaluation). per_token: the N
    cross-entropies themselves instead of their sum (preference losses sum them per sequence); with `stat` (a
    ROW_STATS name), and each token's statistic of its distribution, without gradient (entropy: online RL's
    `entropy` metric; log_sum_sq: WPO's weights). dft: the summed training loss is Dynamic Fine-Tuning's (each
    token's cross-entropy times its probability, without gradient: train.sft_loss); evaluation's stays the
    cross-entropy."""
    if per_token:
        parts = [checkpoint(_chunk_token_loss, head, hidden[s : s + chunk], targets[s : s + chunk], stat,
                            use_reentrant=False) if torch.is_grad_enabled() else
                 _chunk_token_loss(head, hidden[s : s + chunk], targets[s : s + chunk], stat)
                 for s in range(0, hidden.shape[0], chunk)]
        if not parts:
            empty = hidden.new_zeros(0, dtype=torch.float32)
            return empty, (empty if stat else None)
        if stat:  # (loss, statistic) a chunk; the statistics were taken without gradient (but ENTROPY_TRAINED)
            return torch.cat([loss for loss, _ in parts]), torch.cat([h for _, h in parts])
        return torch.cat(parts), None
    total = hidden.new_zeros((), dtype=torch.float32)
    hits = []
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s : s + chunk], targets[s : s + chunk]
        if with_hits:  # evaluation: no graph to keep, the logits are used twice
            logits = head(h).float()
            total = total + F.cross_entropy(logits, t, reduction="sum")
            hits.append(logits.argmax(-1) == t)
            del logits  # before the next chunk's logits exist
        elif torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, head, h, t, dft, use_reentrant=False)
        else:
            total = total + _chunk_loss(head, h, t, dft)
    return total, (torch.cat(hits) if with_hits else None)


def _apply_token_loss(head, token_loss, start: int, hidden: torch.Tensor, targets: torch.Tensor):
    return token_loss(head(hidden), targets, start)


def chunked_token_loss(hidden: torch.Tensor, head, targets: torch.Tensor, token_loss, *,
                       chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Another loss than the cross-entropy over the same chunks: `token_loss(logits, targets, start)` gets one chunk's
    logits (the tokens start:start + len) and returns its summed loss and a vector of summed statistics (detached).
    Each chunk is recomputed in backward as the cross-entropy's is, so one chunk's logits exist at a time (and those
    of whatever `token_loss` builds beside them: a teacher's, for distillation). Returns the loss and the statistics
    summed over the chunks."""
    total, stats = hidden.new_zeros((), dtype=torch.float32), None
    for s in range(0, hidden.shape[0], chunk):
        args = (head, token_loss, s, hidden[s : s + chunk], targets[s : s + chunk])
        loss, part = (checkpoint(_apply_token_loss, *args, use_reentrant=False) if torch.is_grad_enabled()
                      else _apply_token_loss(*args))
        total, stats = total + loss, part if stats is None else stats + part
    return total, stats


def decoder_name(lm) -> str:
    """The attribute of a *ForCausalLM that holds its decoder: `model`, or its base_model_prefix (GPT-NeoX's
    gpt_neox; Llama 4's prefix names no attribute, its decoder is `model`)."""
    return "model" if isinstance(getattr(lm, "model", None), torch.nn.Module) else lm.base_model_prefix


def decoder_layers(lm) -> torch.nn.ModuleList:
    """The decoder's list of layers: `layers` (Llama and most families), else its one list of
    config.num_hidden_layers modules (GPT-2's `h`, BLOOM's): what a step runs once per layer."""
    decoder = getattr(lm, decoder_name(lm))
    if isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        return decoder.layers
    n = getattr(lm.config, "num_hidden_layers", None)
    found = next((m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n), None)
    if found is None:  # (OPT's are model.decoder.layers: found above, as modules() walks the decoder's own modules)
        from llmtrain.errors import LLMTrainError

        raise LLMTrainError(f"llmtrain cannot find the decoder layers of this {lm.config.model_type} model (no list "
                            f"of its {n} layers in {type(decoder).__name__}): it does not train such a model. Use a "
                            "model of the capability table (docs/models.md).")
    return found


def causal_lm(model):
    """The transformers *ForCausalLM module inside `model` (which may be a peft model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def attach_loss(model, *, chunk: int, fused_linear_ce=None, router_aux: float | None = None,
                balance_sums=None, dft: bool = False, fp32_head: bool = False) -> None:
    """Give the *ForCausalLM module a forward that returns the summed loss when called with `loss_index`.

    Called with `loss_index` / `loss_targets` (batching.with_loss_positions), the forward runs the decoder,
    gathers the trained positions' hidden states and hands them to the LM head together with their
    targets; the LM head's own forward (patched too) then computes the chunked loss from its weight. So
    the LM head is called once per step, as FSDP2 requires of a sharded module (Accelerate shards it
    with the final norm: each call would unshard it and reduce its gradient again). Called without
    `loss_index`, both are transformers' own forwards (generation, export). The result is a dict, a
    pytree in which FSDP2 finds the loss to hook the root's backward.
    `fused_linear_ce`, when given (liger's fused linear cross-entropy on CUDA), replaces the chunked loop
    in training. `router_aux` (model.router_aux_loss_coef): a mixture of experts' load-balancing loss (router_aux_loss)
    joins the summed training loss with this weight, times the trained tokens; `with_aux` asks for it beside the
    per-token losses too (a preference or KTO objective weighs it itself). The result's "aux" is that loss, unweighted.
    `balance_sums`: under sequence parallelism, the load-balancing loss's per-expert sums added over the sequence group
    (parallel/sequence/shards.balance_sums; None: the micro-batch is whole on this process). dft (train.sft_loss):
    the summed training loss is Dynamic Fine-Tuning's (chunked_cross_entropy; liger's fused loss is not given then).
    fp32_head (rl.cast_lm_head_to_fp32, TRL's): the head's weight is made fp32 here, and every call of it (the
    samplers', transformers' forward, the chunked loss) makes its logits in fp32 outside autocast.
    """
    lm = causal_lm(model)
    logits = logit_transform(lm)
    vocab = lm.get_output_embeddings().weight.shape[0]
    # The LM head may be wrapped (peft's modules_to_save): patch every Linear in it that maps to the vocabulary (by its
    # weight: the copy peft ties to a tied model's embeddings' copy has its in and out features the other way round)
    for head in [m for m in lm.lm_head.modules() if isinstance(m, torch.nn.Linear) and m.weight.shape[0] == vocab]:
        if fp32_head:  # (capabilities refuse a tied or adapted head)
            head.float()
        head.forward = types.MethodType(_head_forward(chunk, fused_linear_ce, logits=logits, dft=dft,
                                                      fp32=fp32_head), head)
    original = type(lm).forward

    def forward(self, *args, loss_index=None, loss_targets=None, return_hits: bool = False, per_token: bool = False,
                temperature: float = 1.0, token_loss=None, with_aux: bool = False, real_tokens: int | None = None,
                row_tokens: int | None = None, stat: str | None = None, **kwargs):
        if loss_index is None:
            return original(self, *args, **kwargs)
        if (noise := getattr(self.get_input_embeddings(), "neftune", None)) is not None:
            noise.row_tokens = row_tokens  # a sequence slice's: its group row's tokens before the group's padding
        kwargs.pop("labels", None)  # peft passes labels=None through
        kwargs.pop("use_cache", None)
        # training's summed loss (not evaluation's, nor another objective's token_loss one), or where asked for
        summed = not (return_hits or per_token or token_loss is not None)
        aux = router_aux is not None and (summed or with_aux)
        decoder = getattr(self, decoder_name(self))
        outputs = decoder(*args, use_cache=False, **kwargs, **({"output_router_logits": True} if aux else {}))
        hidden = outputs.last_hidden_state.flatten(0, 1)
        if loss_index.numel() == 0:  # no trained position (a sequence-parallel slice of prompt tokens, a pipeline's
            # filler): a zero loss that still reaches every parameter, as DDP and FSDP reduce all their gradients
            loss, _ = self.lm_head(hidden[:1], targets=hidden.new_zeros(1, dtype=torch.long))
            empty = (0, len(PAIR_STATS)) if stat == "pairs" else (0,)
            zero = loss.sum() * 0.0  # per_token: no token's loss, as a pass with tokens gives one a token (RLOO sums
            # them per completion: a 0-d zero there failed its index_add under sequence parallelism)
            return {"loss": zero.reshape(1)[:0] if per_token else zero,
                    "hits": torch.zeros(empty, dtype=torch.float32 if stat else torch.bool, device=hidden.device),
                    **({"aux": loss.new_zeros(())} if aux else {})}
        # hits: with token_loss, its statistics instead; with per_token and stat, each token's statistic
        loss, hits = self.lm_head(hidden[loss_index], targets=loss_targets, with_hits=return_hits, per_token=per_token,
                                  temperature=temperature, token_loss=token_loss, **({"stat": stat} if stat else {}))
        if not aux:
            return {"loss": loss, "hits": hits}
        balance = router_aux_loss(self, outputs.router_logits, kwargs.get("attention_mask"), sums=balance_sums,
                                  real=real_tokens, whole=not summed)
        if summed:  # the micro-batch's share of the step's loss: the weight times the balance times its tokens
            return {"loss": loss + router_aux * balance * loss_index.numel(), "hits": hits, "aux": balance.detach()}
        return {"loss": loss, "hits": hits, "aux": balance}

    lm.forward = types.MethodType(forward, lm)


def router_aux_loss(lm, router_logits, attention_mask, *, sums=None, real: int | None = None,
                    whole: bool = False) -> torch.Tensor:
    """A mixture of experts' load-balancing loss on one micro-batch, as its transformers model computes it with
    output_router_logits (its module's load_balancing_loss_func: the experts' share of the routed tokens times their
    mean routing probability, summed, times the experts; padding left out). Supervised fine-tuning adds it to the
    summed cross-entropy times the micro-batch's trained tokens, so that the step's loss (divided by the window's
    trained tokens) is the cross-entropy's mean plus the coefficient times the micro-batches' token-weighted mean of
    it: on one micro-batch, transformers' own loss. Preference pairs and KTO add it times the micro-batch's pairs or
    examples, as TRL's DPOTrainer and KTOTrainer add it to their micro-batch's mean loss.

    Under sequence parallelism (`sums`: shards.balance_sums) this process holds a slice of the micro-batch's tokens,
    the first `real` of them real (the rest pad the row to a multiple of the group): the same function's sums (each
    expert's routed tokens and routing probability, and the rows) are taken over the slice's real tokens and added over
    the group before the product. `whole`: the caller's loss is the group's, computed alike on every process (a loss
    of whole sequences); else each process's loss is its own part of the group's (supervised fine-tuning)."""
    import sys

    from llmtrain.capabilities import experts, experts_per_token

    if sums is not None:
        return _group_balance(router_logits, experts(lm.config), experts_per_token(lm.config), sums=sums,
                              real=real, whole=whole)
    if attention_mask is None:  # a packed row: the same function's sums (balance_parts), as a sequence group's slices
        # and the pipeline stages' layers add them, so that every layout rounds alike
        return balance(*balance_parts(router_logits, experts(lm.config), experts_per_token(lm.config)),
                       experts(lm.config))

    # the model's own modeling module (under FSDP2 its class is a subclass that fully_shard made elsewhere)
    module = next(sys.modules[c.__module__] for c in type(lm).__mro__
                  if hasattr(sys.modules[c.__module__], "load_balancing_loss_func"))
    return module.load_balancing_loss_func(router_logits, experts(lm.config), experts_per_token(lm.config),
                                           attention_mask)


def _group_balance(router_logits, num_experts: int, top_k: int, *, sums, real: int | None,
                   whole: bool) -> torch.Tensor:
    """transformers' load_balancing_loss_func (no attention mask: packed rows) on a sequence group's slices: each
    expert's top-k assignments and summed routing probability over every layer, and the rows, from this slice's first
    `real` rows, summed over the group by `sums`, then the same product."""
    counts, probs, rows = balance_parts(router_logits, num_experts, top_k, real=real)
    return balance(*sums(counts, probs, rows, whole=whole), num_experts)


def balance_parts(router_logits, num_experts: int, top_k: int, *, real=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """load_balancing_loss_func's sums over some layers' router logits (each [tokens, experts]), their first `real`
    rows (the real tokens; None: all): each expert's top-k assignments (no gradient) and summed routing probability
    (fp32), and the rows. Added over the parts of a row (a sequence group's slices, parallel/sequence/shards.py; the
    pipeline stages' layers, parallel/pipeline/stage.py) they give the whole row's, which `balance` turns into the
    loss."""
    device = router_logits[0].device
    # histc, as transformers: no host sync; integers on CUDA (deterministic), floats on the CPU
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for gate in router_logits:
        gate = gate[:real] if real is not None else gate
        weights = torch.nn.functional.softmax(gate.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = counts + torch.histc(chosen.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts)
        probs = probs + weights.float().sum(dim=0)
        rows += gate.shape[0]
    return counts, probs, rows


def balance(counts: torch.Tensor, probs: torch.Tensor, rows, num_experts: int) -> torch.Tensor:
    """The load-balancing loss from a whole row's balance_parts: the experts' share of the routed tokens times their
    mean routing probability, summed, times the experts (0 for a row of no token: a pipeline's filler row)."""
    rows = rows.clamp(min=1) if isinstance(rows, torch.Tensor) else max(rows, 1)
    return torch.sum(counts / rows * probs / rows) * num_experts


@dataclass(frozen=True)
class Logits:
    """What a model's own forward does to its LM head's output before the loss: times `scale` (Cohere's logit_scale,
    Granite's 1 / logits_scaling, Falcon-H1's lm_head_multiplier), then capped at `cap` (cap tanh(x / cap): Gemma 2's
    and Gemma 3n's final_logit_softcapping). The chunked loss computes the head's logits itself, so it applies this too
    (logit_transform finds it)."""

    scale: float = 1.0
    cap: float | None = None

    @property
    def plain(self) -> bool:
        return self.scale == 1.0 and self.cap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap


def logit_transform(lm) -> Logits:
    """What the model's own forward does to its LM head's output (Logits), which the chunked loss, reading the LM head
    alone, must do too (and the fast sampler, model/fast_sample.py). Found once a model (_found_transform), when the
    loss is attached, and kept: the sampler asks at every rollout, of a model FSDP may have wrapped since."""
    if (known := _TRANSFORMS.get(lm)) is None:
        known = _TRANSFORMS[lm] = _found_transform(lm)
    return known


_TRANSFORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _found_transform(lm) -> Logits:
    """Found by running the model's forward on stand-ins: its decoder replaced by one that returns random hidden states
    and its head by a random 16-logit one, so no layer runs and nothing is read of the weights. A cap is the config's
    final_logit_softcapping; a scale, the constant ratio of the forward's logits to the head's. A forward that does
    anything else to them (a shift) is refused in one paragraph."""
    from transformers.modeling_outputs import MoeModelOutputWithPast

    config = lm.config.get_text_config()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 3, config.hidden_size, generator=g)
    stand_in = torch.nn.Linear(config.hidden_size, 16, bias=False)
    with torch.no_grad():  # logits of about +-10: a cap of 30 bends them measurably
        stand_in.weight.copy_(torch.randn(16, config.hidden_size, generator=g) * 3 / config.hidden_size ** 0.5)

    prefix = decoder_name(lm)
    decoder, head = getattr(lm, prefix), lm.lm_head

    class Output(MoeModelOutputWithPast):  # any other field the forward reads of it (Gemma 4's shared_kv_states): none
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    class Decoder(torch.nn.Module):  # what the forward reads of the decoder besides its output is the real one's
        def forward(self, *args, **kwargs):
            return Output(last_hidden_state=hidden)

        def __getattr__(self, name):  # (Falcon-H1's lm_head_multiplier)
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(decoder, name)

    try:
        setattr(lm, prefix, Decoder())
        lm.lm_head = stand_in
        with torch.no_grad():
            out = type(lm).forward(lm, input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False).logits
            plain = stand_in(hidden)
    except Exception as e:  # a forward the stand-ins do not fit: its logits taken as the head's, capped as its config
        return _unprobed(lm, config, e)  # says, where its config names no scale of them
    finally:
        setattr(lm, prefix, decoder)
        lm.lm_head = head
    out, plain = out.double(), plain.double()
    if cap := getattr(config, "final_logit_softcapping", None):
        found = Logits(cap=float(cap))
    else:
        ratio = (out / plain).flatten()
        scale = float(ratio.median())
        found = Logits(scale=1.0 if abs(scale - 1.0) < 1e-6 else scale)
    if not torch.allclose(found(plain), out, rtol=1e-5, atol=1e-6):
        raise LLMTrainError(
            f"model {lm.config.model_type}'s forward changes its LM head's logits in a way other than a scale or a "
            "cap (final_logit_softcapping), which llmtrain's chunked loss, reading the LM head alone, does not apply: "
            "it would train on other logits than the model's. Train a model whose logits are its LM head's (Llama, "
            "Qwen, Mistral, Phi, Gemma)")
    return found


SCALE_KEYS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")  # Cohere, Granite, Falcon-H1


def _unprobed(lm, config, error: Exception) -> Logits:
    """The logits of a model whose forward the stand-ins do not fit: its head's, capped as its config says, and said,
    unless its config names a scale of them (SCALE_KEYS: the probe had failed on Gemma 4 once and its cap gone
    unapplied, 3.7e-3 off): a scale the chunked loss cannot find is refused, not left out without a word."""
    model = lm.config.model_type
    scales = [k for k in vars(config) if any(word in k for word in SCALE_KEYS) and getattr(config, k) not in (None, 1)]
    if scales:
        raise LLMTrainError(
            f"model {model}'s config scales its logits ({', '.join(f'{k}={getattr(config, k)}' for k in scales)}), "
            f"and running its forward on stand-ins to find how failed ({type(error).__name__}: {error}): llmtrain's "
            "chunked loss, reading the LM head alone, would train on unscaled logits. Train a model whose logits are "
            "its LM head's (Llama, Qwen, Mistral, Phi, Gemma), or report the model's type to llmtrain")
    cap = getattr(config, "final_logit_softcapping", None)
    warnings.warn(f"model {model}: running its forward on stand-ins to find what it does to its LM head's logits "
                  f"failed ({type(error).__name__}: {error}); llmtrain's chunked loss takes them as the head's"
                  f"{f', capped at {cap:g}' if cap else ''}, as its config says")
    return Logits(cap=float(cap)) if cap else Logits()


def _head_forward(chunk: int, fused_linear_ce, *, logits: Logits = Logits(), dft: bool = False, fp32: bool = False):
    """The LM head's forward, patched: given targets, the chunked loss from its weight, of the logits the model's own
    forward makes (`logits`: logit_transform), over the sampling temperature. fp32: the logits in fp32 from fp32
    hidden states, autocast off (rl.cast_lm_head_to_fp32; the weight is fp32 already)."""
    def project(self, h):
        if not fp32:
            return torch.nn.functional.linear(h, self.weight, self.bias)
        with torch.autocast(h.device.type, enabled=False):
            return torch.nn.functional.linear(h.float(), self.weight, self.bias)

    def forward(self, hidden, targets=None, with_hits: bool = False, per_token: bool = False,
                temperature: float = 1.0, token_loss=None, stat: str | None = None):
        if targets is None:  # an ordinary call: logits (the model's own forward transforms them)
            return project(self, hidden)
        if token_loss is not None:  # another loss on the same chunks (distillation); it applies any temperature
            return chunked_token_loss(hidden, lambda h: logits(project(self, h)), targets, token_loss, chunk=chunk)
        if (fused_linear_ce is not None and not with_hits and not per_token and torch.is_grad_enabled()
                and self.bias is None and temperature == 1.0 and logits.plain and not fp32):
            return fused_linear_ce(self.weight, hidden, targets), None

        def head(h):  # self.weight is read when each chunk runs (and again when it is recomputed in backward)
            out = logits(project(self, h))
            return out if temperature == 1.0 else out / temperature  # online RL: the sampling's temperature

        return chunked_cross_entropy(hidden, head, targets, chunk=chunk, with_hits=with_hits, per_token=per_token,
                                     stat=stat, dft=dft)

    return forward


# What the patched forward takes from a collated batch (an objective may carry more: counts, reference values).
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "loss_index", "loss_targets")


def decoder_inputs(batch: dict) -> dict:
    """What a decoder's forward takes from a collated batch: the ids and positions (and padding's mask), and a packed
    row's boundaries under the names transformers forwards to the varlen attention."""
    inputs = {k: batch[k] for k in MODEL_INPUTS[:3] if k in batch}
    if "cu_seq_lens" in batch:
        inputs.update(cu_seq_lens_q=batch["cu_seq_lens"], cu_seq_lens_k=batch["cu_seq_lens"],
                      max_length_q=batch["max_length"], max_length_k=batch["max_length"])
    return inputs


def compute_loss(model, batch: dict, *, return_hits: bool = False, per_token: bool = False, temperature: float = 1.0,
                 token_loss=None, return_aux: bool = False, stat: str | None = None):
    """Summed token cross-entropy of one collated batch on the device (the one loss of train and eval).

    `batch` holds the model inputs plus `loss_index` / `loss_targets` (batching.with_loss_positions);
    `cu_seq_lens` / `max_length` (packed rows) are handed to the varlen attention under the names transformers
    forwards to it. per_token: the cross-entropy of every trained token instead of their sum (preference losses).
    temperature: of the logits (online RL takes the policy's log-probabilities at the sampling temperature, as TRL).
    token_loss: another loss on the same chunks of the LM head's logits (chunked_token_loss): returns (its summed
    loss, its summed statistics). return_aux: (the loss, the micro-batch's load-balancing loss, attach_loss's
    router_aux, or None without it); with per_token, the load-balancing loss is computed for the caller to weigh.
    stat (with per_token, a ROW_STATS name): (the per-token losses, each token's statistic of its distribution at
    the temperature, no gradient), and with return_aux the load-balancing loss third.
    """
    inputs = {**decoder_inputs(batch), **{k: batch[k] for k in MODEL_INPUTS[3:] if k in batch},
              **{k: batch[k] for k in ("real_tokens", "row_tokens") if k in batch}}  # a sequence slice's
    out = model(**inputs, return_hits=return_hits, per_token=per_token,
                **({"temperature": temperature} if temperature != 1.0 else {}),
                **({"token_loss": token_loss} if token_loss is not None else {}),
                **({"with_aux": True} if return_aux and per_token else {}),
                **({"stat": stat} if stat else {}))
    if stat:
        return (out["loss"], out["hits"], out.get("aux")) if return_aux else (out["loss"], out["hits"])
    if return_aux:
        return out["loss"], out.get("aux")
    return (out["loss"], out["hits"]) if return_hits or token_loss is not None else out["loss"]


def eval_counts(loss: torch.Tensor, hits: torch.Tensor, example: torch.Tensor, n: int, *,
                example_sum=None) -> torch.Tensor:
    """CausalLM's eval sums of one batch, float64: [loss, trained tokens, argmax hits, teacher-forced matches,
    examples], from the summed loss, each trained token's hit and its example (of `n`). `example_sum`: sequence
    parallelism's sum of per-example counts over the sequence group (an example's tokens are on several processes)."""
    trained = torch.bincount(example, minlength=n).double()
    # index_add, not bincount(weights=): CUDA's weighted bincount has no deterministic kernel (train.deterministic)
    right = torch.zeros(n, dtype=torch.float64, device=example.device).index_add(0, example, hits.double())
    if example_sum is not None:
        trained, right = example_sum(trained, right)
    return torch.stack([loss.double(), hits.new_tensor(hits.numel(), dtype=torch.float64), hits.double().sum(),
                        ((right == trained) & (trained > 0)).double().sum(), (trained > 0).double().sum()])
