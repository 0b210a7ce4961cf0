"""A weighted mixture of datasets (data.sources): which source each place of an epoch draws from, and which row.

The sources are prepared as one dataset, source 0's rows first (prepare.py adds their `source` column). An epoch is
`sum(quotas)` places: each source's quota is its weight's share of all the sources' rows (largest remainder, so the
quotas add up exactly), or its count. The places are dealt in order to the source furthest behind its share (a
smooth weighted round robin), so any run of n consecutive examples holds each source's share of n to within one
example with two sources (two with more): a step's micro-batches have the mixture's proportions, not only the
epoch. Each source hands out its rows in a seeded shuffle, reshuffled each time round (a source with fewer rows
than its quota repeats them; one with more is subsampled, and the next epoch goes on where this one stopped).

Everything is a pure function of (seed, epoch) and the sources' sizes and quotas: a resumed run, or one on another
number of processes, meets the same examples in the same order (the data plan splits the order as it splits a
single dataset's shuffle).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mixture:
    sizes: tuple[int, ...]  # rows of each source, in the prepared dataset's order
    quotas: tuple[int, ...]  # examples of each source an epoch

    @classmethod
    def of(cls, sources, sizes: list[int]) -> Mixture:
        """The mixture data.sources (SourceConfig's) describe over sources of `sizes` prepared rows."""
        if sources[0].count is not None:
            return cls(tuple(sizes), tuple(s.count for s in sources))
        return cls(tuple(sizes), shares([s.weight for s in sources], sum(sizes)))

    @property
    def examples(self) -> int:
        """Examples an epoch."""
        return sum(self.quotas)

    @property
    def reads(self) -> tuple[float, ...]:
        """How often an epoch reads each row of each source (its quota over its rows)."""
        return tuple(q / max(n, 1) for q, n in zip(self.quotas, self.sizes))

    def order(self, *, seed: int, epoch: int) -> list[int]:
        """The epoch's example indices into the prepared dataset, in the order the run trains them."""
        n, offsets = self.examples, [sum(self.sizes[:s]) for s in range(len(self.sizes))]
        taken = [0] * len(self.sizes)
        out = []
        for k in range(n):
            # the source furthest behind its share after k + 1 places (quota x (k + 1) / n), the first on a tie
            s = max(range(len(self.sizes)), key=lambda i: (self.quotas[i] * (k + 1) - taken[i] * n, -i))
            draw = epoch * self.quotas[s] + taken[s]  # this source's draws before, over the whole run
            turn, at = divmod(draw, self.sizes[s])
            out.append(offsets[s] + _shuffle(self.sizes[s], seed, s, turn)[at])
            taken[s] += 1
        return out


def shares(weights: list[float], total: int) -> tuple[int, ...]:
    """`total` split in proportion to `weights` by largest remainder (the parts add up to `total`; ties to the
    first source)."""
    exact = [w / sum(weights) * total for w in weights]
    parts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (parts[i] - exact[i], i))[: total - sum(parts)]:
        parts[i] += 1
    return tuple(parts)


@functools.lru_cache(maxsize=64)
def _shuffle(size: int, seed: int, source: int, turn: int) -> list[int]:
    """A source's rows in the seeded order of its `turn`-th time round."""
    g = torch.Generator().manual_seed(seed * 100_003 + 1_000_003 * (source + 1) + turn)
    return torch.randperm(size, generator=g).tolist()


def source_sizes(column) -> list[int]:
    """Rows of each source, from a prepared mixture's `source` column (source 0's first)."""
    values = list(column)
    return [values.count(s) for s in range(max(values) + 1)] if values else []


def label(source) -> str:
    """A source as its recipe names it: its path (or paths)."""
    return source.path if isinstance(source.path, str) else ", ".join(source.path)


def short_name(source) -> str:
    """A source in a table's header or an eval metric's name: its (first) file's name."""
    from pathlib import Path

    return Path(label(source).split(", ")[0]).name


def describe(data, stats: dict, sizes: list[int]) -> list[str]:
    """Each source of a mixture in a line: its rows and tokens, its share of every step and how often an epoch reads
    each of its rows (the start-up lines and inspect-data)."""
    mix = Mixture.of(data.sources, sizes)
    lines = []
    for i, (source, quota, reads) in enumerate(zip(data.sources, mix.quotas, mix.reads)):
        s = stats[f"source{i}"]
        amount = f"weight {source.weight:g}" if source.weight is not None else f"count {source.count:,}"
        rows = f"{s.examples:,} row{'s' * (s.examples != 1)}"
        lines.append(f"{label(source)} ({source.format}): {rows}, {s.tokens:,} tokens; "
                     f"{quota / mix.examples:.1%} of each step ({amount}: {quota:,} of the epoch's "
                     f"{mix.examples:,} examples, each row {reads:.2f} times)")
    return lines


def eval_parts(data, eval_ds) -> dict:
    """A mixture's eval rows by source ({its file's name: its rows}, the sources that have eval rows, in order)."""
    column = eval_ds["source"]
    parts = {}
    for i, source in enumerate(data.sources):
        rows = [k for k, s in enumerate(column) if s == i]
        name = short_name(source)
        if rows:
            parts[name if name not in parts else f"{name}#{i}"] = eval_ds.select(rows)
    return parts
