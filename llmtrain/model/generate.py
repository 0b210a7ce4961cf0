"""Sampling completions for online RL: batched, with the KV cache, and reproducible prompt by prompt.

`sample` decodes a batch of prompts (left-padded, with their attention mask and position ids) token by token with
the model's KV cache. Each completion draws its randomness from its own seed (`completion_seed`: the run's seed,
the step, the prompt's index in the epoch and which of its generations it is), all of its uniforms at once before
decoding, and picks each token by inverting the cumulative distribution with them. So a completion does not depend
on which other prompts share its batch, which process it runs on, or how many processes there are: 2 processes
sample what 1 does, and a resumed run samples what the uninterrupted one would have (up to rounding: a matmul rounds
a row differently with other rows beside it, so a uniform within about 1e-6 of a cumulative probability can draw
the neighbouring token in another batch; on the tiny model about one token in 1e5 to 1e6, audit 9). A completion ends
with the first stop token (the template's end of turn), which it keeps: it is trained as the reply's end.

llmtrain's varlen attention has no KV cache: generation attends with SDPA (`cached_attention`), the same math on
one unpacked sequence, and switches back afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch

_MIX = 1_000_003  # a prime: the seed's parts never collide for steps, prompts and generations below it


def completion_seed(seed: int, step: int, prompt_index: int, generation: int) -> int:
    """The seed of one completion: a pure function of the run's seed, the step, the prompt's index in the epoch and
    its generation number, never of the rank or the number of processes."""
    return (((seed * _MIX + step) * _MIX + prompt_index) * _MIX + generation) % (2**63 - 1)


def stop_tokens(lm, tokenizer, end_of_turn: str | None = None) -> list[int]:
    """Where a generation stops, as one token: the generation config's end tokens (which list a chat template's
    end-of-turn token), the tokenizer's EOS, and the template's end of turn (data.chat.end_of_turn) where it is one
    token. `objective.stops_for` adds an end of turn the tokenizer splits into several (Stops.sequences)."""
    configured = lm.generation_config.eos_token_id
    configured = configured if isinstance(configured, list) else [configured]
    turn = tokenizer(end_of_turn.strip(), add_special_tokens=False)["input_ids"] if end_of_turn else []
    return list(dict.fromkeys(t for t in (*configured, tokenizer.eos_token_id, *turn[:1] * (len(turn) == 1))
                              if t is not None))


class Stops(frozenset):
    """Where a completion ends: one of these ids drawn (a frozenset of ints, so `token in stops` reads as before), or
    the tokens of one of `sequences` drawn one after another. A sequence is a chat template's end of turn that the
    tokenizer does not know as a token: `<|im_end|>` written into a template for Mistral's tokenizer is 7 pieces
    (`<`, `|`, `im`, `_`, `end`, `|`, `>`), and a reply trained to end with it would otherwise run on to the limit."""

    sequences: tuple[tuple[int, ...], ...]
    text: str  # the end of turn the sequences spell ("" where there are none)

    def __new__(cls, ids=(), sequences=(), text: str = ""):
        self = super().__new__(cls, ids)
        self.sequences, self.text = tuple(tuple(s) for s in sequences), text
        return self

    @classmethod
    def of(cls, stops) -> Stops:
        """`stops` as Stops: itself, or a plain collection of stop ids with no sequences."""
        return stops if isinstance(stops, Stops) else cls(stops)

    def end(self, row) -> int | None:
        """The length of `row` up to and including its first stop (a stop id, or a sequence's last token); None
        where it has none."""
        for k, token in enumerate(row):
            if token in self or any(k + 1 >= len(s) and tuple(row[k + 1 - len(s):k + 1]) == s
                                    for s in self.sequences):
                return k + 1
        return None

    def ends(self, row) -> bool:
        """Whether `row` ends with a stop (a completion that was not cut at the limit)."""
        return bool(row) and (row[-1] in self or any(tuple(row[-len(s):]) == s for s in self.sequences))

    def reply(self, text: str) -> str:
        """A completion's text (decoded without special tokens) without the text end of turn it stopped at: what it
        reads as where the end of turn is a special token."""
        return text[: -len(self.text)] if self.text and text.endswith(self.text) else text


@contextmanager
def attention_as(config, implementation: str):
    """The model of `config` attends with `implementation` inside the block, with its own again after."""
    before = config._attn_implementation
    config._attn_implementation = implementation  # the setter applies it to the sub-configs too
    try:
        yield
    finally:
        config._attn_implementation = before


def cached_attention(lm):
    """SDPA instead of llmtrain's own attentions while generating (the varlen one, and sequence parallelism's around
    it, each registered under a name that starts with `llmtrain_`): they refuse a KV cache, and every process
    generates on its own. A model whose attention transformers' SDPA does not compute (_supports_sdpa False: GPT-OSS's
    sinks, Gemma 2's capped scores, which SDPA would leave out without a word) generates with its eager attention."""
    from llmtrain.model.attention import PREFIX
    from llmtrain.model.loss import causal_lm

    if not str(lm.config._attn_implementation).startswith(PREFIX):
        return nullcontext()
    return attention_as(lm.config, "sdpa" if getattr(causal_lm(lm), "_supports_sdpa", True) else "eager")


def filtered_probs(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0, top_k: int = 0,
                   min_p: float = 0.0) -> torch.Tensor:
    """softmax(logits / temperature) [rows, vocab] with the tokens the filters leave out set to 0 (not renormalised),
    the filters in transformers' order: top_k (the k most likely, and those tied with the k-th), then top_p (the
    smallest set of what is left whose probability passes top_p of what is left), then min_p (those at least min_p
    times the most likely). 0 / 1.0 / 0: off."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        probs = probs.masked_fill(probs < probs.topk(top_k, dim=-1).values[:, -1:], 0.0)
    if top_p < 1.0:
        # the nucleus: the most likely tokens whose probabilities before them add up to less than top_p
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        outside = (cumulative - sorted_probs) >= top_p * cumulative[:, -1:]
        outside[:, 0] = False  # the most likely token stays, as transformers' min_tokens_to_keep (top_p 0: greedy)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def repetition_penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """`logits` [rows, vocab] (fp32) with each row's seen tokens (`seen`, bool [rows, vocab]: its prompt's and what it
    drew) made less likely, as transformers' RepetitionPenaltyLogitsProcessor (CTRL, Keskar et al. 2019): a positive
    logit divided by `penalty`, a negative one multiplied by it (above 1: less likely; below 1: more)."""
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def seen_tokens(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """bool [len(rows), vocab]: the tokens each row holds (a prompt's, for repetition_penalized)."""
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        seen[i, torch.tensor(row, dtype=torch.long, device=device)] = True
    return seen


def next_tokens(logits: torch.Tensor, uniforms: torch.Tensor, *, temperature: float, top_p: float, top_k: int = 0,
                min_p: float = 0.0, repetition_penalty: float = 1.0, seen: torch.Tensor | None = None,
                logps: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab]: the argmax at temperature 0, else the token where the row's
    cumulative distribution (softmax(logits / temperature) cut by top_k, top_p and min_p: filtered_probs) passes the
    row's uniform; with a repetition_penalty other than 1, the row's `seen` tokens penalised first (transformers'
    order: the penalty is a logits processor, the filters its warpers after it). `logps` [rows] (float32), where
    given, is filled with each drawn token's log-probability under the distribution it was drawn from (vLLM's
    processed logprobs: penalised, tempered, filtered and renormalised; 0 at temperature 0, a point mass)."""
    if repetition_penalty != 1.0:
        logits = repetition_penalized(logits.float(), seen, repetition_penalty)
    if temperature == 0:
        if logps is not None:
            logps.zero_()
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    # kept below the total: a float32 uniform can be 1.0 (a float64 draw within 2^-25 of 1, about one in 3e7), and
    # its target at the total itself passed every token, so the clamp took the last id whatever its probability
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    picked = picked.clamp(max=logits.size(-1) - 1)
    if logps is not None:
        logps.copy_(probs.gather(1, picked[:, None]).squeeze(1).log() - cdf[:, -1].log())
    return picked


@torch.no_grad()
def sample(lm, prompts: list[list[int]], *, seeds: list[int], max_new_tokens: int, temperature: float,
           top_p: float, stop_ids: set[int], pad_id: int, top_k: int = 0, min_p: float = 0.0,
           repetition_penalty: float = 1.0, logps: bool = False) -> list[list[int]] | list[Drawn]:
    """Each prompt's completion: at most max_new_tokens ids, ending with a stop where one was drawn (a stop id, or
    the last token of one of `Stops.sequences`). repetition_penalty: over the tokens of the prompt (its padding left
    out) and of the completion so far. logps: each a `Drawn`, its tokens with the sampler's log-probability of each
    (next_tokens')."""
    device, rows = lm.device, len(prompts)
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # every uniform a completion will use, drawn from its own generator before decoding starts
    uniforms = torch.stack([torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                            for s in seeds]).to(device=device, dtype=torch.float32)
    stop_ids = Stops.of(stop_ids)
    stops = torch.tensor(sorted(stop_ids), device=device)
    out = [[] for _ in range(rows)]
    drawn_logps = [[] for _ in range(rows)]
    step_logps = torch.zeros(rows, device=device) if logps else None
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    # eager: compiled layers (model.compile) would recompile at every new length
    with cached_attention(lm), torch.compiler.set_stance("force_eager"):
        # the prompts' last position's logits only: [rows, vocab], not [rows, prompt length, vocab]
        result = lm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        seen = seen_tokens(prompts, result.logits.shape[-1], device) if repetition_penalty != 1.0 else None
        for t in range(max_new_tokens):
            token = next_tokens(result.logits[:, -1], uniforms[:, t], temperature=temperature, top_p=top_p,
                                top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seen=seen,
                                logps=step_logps)
            token = torch.where(done, torch.full_like(token, pad_id), token)
            if seen is not None:
                seen.scatter_(1, token[:, None], True)  # a finished row's pad: it draws no more
            values = step_logps.tolist() if logps else [0.0] * rows
            for i, (value, finished, logp) in enumerate(zip(token.tolist(), done.tolist(), values)):  # host syncs
                if not finished:
                    out[i].append(value)
                    drawn_logps[i].append(logp)
            done = done | torch.isin(token, stops)
            if stop_ids.sequences:  # an end of turn of several tokens: the rows that just drew its last
                done = done | torch.tensor([stop_ids.ends(row) for row in out], device=device)
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
            result = lm(input_ids=token.unsqueeze(-1), attention_mask=mask, position_ids=positions,
                        use_cache=True, **_cache_arg(result))
    return [Drawn(ids, lp) for ids, lp in zip(out, drawn_logps)] if logps else out


class Drawn(NamedTuple):
    """A sampled completion with the sampler's log-probability of each of its tokens (a sampler's output where
    asked for them: rl.sampler_correction compares them with the trained policy's)."""

    ids: list[int]
    logps: list[float]


def _cache_arg(result) -> dict:
    """The KV cache of a forward's output, as the next forward takes it: `cache` from transformers 5.2x on (which
    warns on past_key_values), past_key_values before."""
    if "cache" in result:
        return {"cache": result["cache"]}
    return {"past_key_values": result["past_key_values"]}
