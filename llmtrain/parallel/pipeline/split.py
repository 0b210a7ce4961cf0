"""Pipeline stages split by hand from the Llama layout, and what torch's schedules make of them: which layers each
stage runs, which rank runs a (virtual) stage, the bubble, and how many micro-batches' activations a stage holds.

Pure arithmetic on counts, shared by the pipeline's set-up (the model split into stages) and the memory estimate
(llmtrain/memory/pipeline.py), so that the two can never disagree on a stage's layers.

The split balances cost, in units of one decoder layer: the input embeddings count EMBED_COST layers on the first
stage, the final norm, LM head and loss HEAD_COST on the last. Both are 1, as torchtitan's
`generate_llm_fqn_per_model_part` weighs them (input_weight=1, output_weight=1), and for a 7B Llama about right:
- the LM head is V x H = 131 M parameters for Llama-2-7B (0.65 of a 202 M decoder layer, in FLOPs and in
  weights, gradients and AdamW state alike), and the loss runs it twice (its chunks are recomputed in backward),
  beside an fp32 softmax over 32,000 logits a token: about one layer of time;
- the embeddings are a lookup (no FLOPs) but 131 M parameters of state (0.65 of a layer's memory), on the stage that
  also holds the most micro-batches in flight under 1F1B (P of them): one layer less there is room for those.
(Llama-3-8B's 128,256-token head is 2.4 layers of FLOPs; pass head_cost to weigh it so.)
"""

from __future__ import annotations

from functools import cache
from typing import Literal

from llmtrain.capabilities import interleaved_rounds

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
EMBED_COST = 1.0
HEAD_COST = 1.0


def stage_layers(num_layers: int, stages: int, *, embed_cost: float = EMBED_COST,
                 head_cost: float = HEAD_COST) -> list[range]:
    """The decoder layers of each stage, in order: contiguous, at least one each, the first stage also running the
    embeddings (weighed as `embed_cost` layers) and the last the final norm, LM head and loss (`head_cost`).

    Chosen, among all splits, to make the costliest stage as cheap as possible; then the most even (least sum of
    squared stage costs); then with the fewest layers on the earliest stages (under 1F1B stage i holds P - i
    micro-batches in flight, so an early stage's layer costs the most memory). Interleaved schedules split
    ranks x chunks virtual stages the same way (virtual_stage_rank maps them to ranks)."""
    if stages < 1 or num_layers < stages:
        raise ValueError(f"{stages} pipeline stages need at least one decoder layer each: the model has {num_layers}")
    counts = _split(num_layers, stages, float(embed_cost), float(head_cost))
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


@cache
def _split(layers: int, stages: int, embed: float, head: float) -> tuple[int, ...]:
    """Layer counts of the best split (stage_layers' order of preference), by two dynamic programmes over the stages:
    the least possible costliest stage first, then, among the splits under it, the least sum of squared costs with
    the fewest layers early (both add up stage by stage, so the best way to give the first s stages n layers is part
    of the best whole split)."""
    def cost(stage: int, n: int) -> float:
        return n + (embed if stage == 0 else 0.0) + (head if stage == stages - 1 else 0.0)

    def sizes(s: int, used: int) -> range:  # layers stage s may take after `used`, leaving one for each later stage
        room = layers - used - (stages - s - 1)
        return range(1, room + 1) if s < stages - 1 else range(room, room + 1)

    worst: dict[tuple[int, int], float] = {(0, 0): 0.0}  # (stages, layers) -> the least costliest stage
    for s in range(stages):
        for (done, used), w in [(k, v) for k, v in worst.items() if k[0] == s]:
            for n in sizes(s, used):
                key = (s + 1, used + n)
                worst[key] = min(worst.get(key, float("inf")), max(w, cost(s, n)))
    cap = worst[stages, layers]
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {(0, 0): (0.0, ())}
    for s in range(stages):
        for (done, used), (squares, counts) in [(k, v) for k, v in best.items() if k[0] == s]:
            for n in (n for n in sizes(s, used) if cost(s, n) <= cap):
                key, candidate = (s + 1, used + n), (squares + cost(s, n) ** 2, counts + (n,))
                if key not in best or candidate < best[key]:
                    best[key] = candidate
    return best[stages, layers][1]


def virtual_stage_rank(stage: int, ranks: int) -> int:
    """The rank that runs virtual stage `stage` of an interleaved pipeline: round robin, as torch's
    ScheduleInterleaved1F1B expects (rank r holds stages r, r + P, r + 2P, ...). With one chunk a rank, stage s is
    rank s."""
    return stage % ranks


def rank_stages(rank: int, ranks: int, chunks: int) -> list[int]:
    """The (virtual) stages rank `rank` runs, first to last: `chunks` of them, P apart."""
    return [rank + k * ranks for k in range(chunks)]


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The share of a step a rank idles while the pipeline fills and drains. A step of M micro-batches on P stages
    takes M + P - 1 stage-slots of which P - 1 are idle (GPipe and 1F1B alike): (P-1)/(M+P-1). Interleaved with V
    chunks a rank, a slot is a chunk's, 1/V of a stage's time, so the idle time is (P-1)/V stage-slots against M of
    work: (P-1)/(V M + P - 1), the bubble time divided by the chunks (Narayanan et al. 2021, section 2.2)."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def in_flight(schedule: Schedule, stages: int, micro_batches: int, rank: int, chunks: int = 1) -> list[int]:
    """Micro-batches whose activations rank `rank` holds at once, at its worst moment, for each of its chunks (one
    number for GPipe and 1F1B). Read off torch.distributed.pipelining's schedules (torch 2.13):
    - GPipe (ScheduleGPipe): every forward before any backward: all M on every stage.
    - 1F1B (Schedule1F1B): stage i runs min(M, P - i) warm-up forwards, then alternates one backward and one
      forward: min(M, P - i) held (P on the first stage, 1 on the last).
    - Interleaved 1F1B (ScheduleInterleaved1F1B, _get_warmup_ops): rank r runs w = min((V-1) m + 2 (P-1-r), V M)
      warm-up forwards, m = M / rounds micro-batches a round, op j on its chunk (j // m) % V; its first 1F1B step
      adds one forward before the first backward, so w + 1 chunk-forwards (at most V M) are held then, and the
      steady state keeps that many (one forward, one backward)."""
    if schedule == "gpipe":
        return [micro_batches]
    if schedule == "1f1b":
        return [min(micro_batches, stages - rank)]
    per_round = micro_batches // interleaved_rounds(stages, micro_batches)
    warmup = min((chunks - 1) * per_round + 2 * (stages - 1 - rank), chunks * micro_batches)
    held = [0] * chunks
    for op in range(min(warmup + 1, chunks * micro_batches)):
        held[(op // per_round) % chunks] += 1
    return held
