"""What a plot draws of a run (`Curves`, read by plot.read_curves) and the arithmetic both plot.py and rl_plot.py
draw with: the moving average and its weight, gaps for missing values."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The moving average drawn over the raw train loss spans about this fraction of the run's logged steps, so a
# 100-step and a 10,000-step run look equally smooth (see smoothing_weight).
SMOOTHING_SPAN = 0.05

@dataclass
class Curves:
    """What is drawn for one run, read from its metrics.jsonl. `loss` is None where an update was skipped;
    `tokens` / `eval_tokens` are None where the lines carry no tokens_seen."""

    name: str
    step: list[int] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    lr: list[float | None] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_tokens: list[float | None] = field(default_factory=list)
    eval_loss: list[float | None] = field(default_factory=list)
    # online RL: the RL_TRAIN / RL_EVAL metrics by name, one value per train / eval line (None where absent)
    rl: dict[str, list[float | None]] = field(default_factory=dict)
    eval_rl: dict[str, list[float | None]] = field(default_factory=dict)
    # the other modes' own measures (plot.MEASURES: a preference margin, a reward model's accuracy, the teacher's
    # agreement), by name, one value per train / eval line (None where absent)
    measures: dict[str, list[float | None]] = field(default_factory=dict)
    eval_measures: dict[str, list[float | None]] = field(default_factory=dict)

    @property
    def is_rl(self) -> bool:
        return "reward" in self.rl


def smoothing_weight(points: int) -> float:
    """EMA weight for a curve of `points` values: an average over about SMOOTHING_SPAN of them (0: no smoothing
    for 20 points or fewer; 0.8 for 100; 0.98 for 1,000)."""
    return max(0.0, 1.0 - 1.0 / (SMOOTHING_SPAN * max(points, 1)))


def ema(values: list[float | None], weight: float) -> list[float | None]:
    """Debiased exponential moving average (TensorBoard's smoothing: the first points are not pulled towards
    zero); None (a skipped step) stays None and does not enter the average."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(None)
            continue
        avg, norm = weight * avg + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(avg / norm)
    return out


def _nan(values: list) -> list[float]:
    """None becomes NaN, which matplotlib leaves as a gap in the line."""
    return [math.nan if v is None else v for v in values]


def _points(x: list, y: list) -> tuple[list, list]:
    """The (x, y) pairs where both are known."""
    pairs = [(a, b) for a, b in zip(x, y) if a is not None and b is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]
