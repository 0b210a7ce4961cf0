"""When the loop logs, evaluates and saves: one pure rule of the step number, so the loop decides nothing itself.

Why every save step and every eval step is also a logged step: a metrics line reports the steps since the
previous line (their tokens/s, and the loss of the last one), read back from the device when it is written.
A resume drops the lines after the checkpoint's step and starts metering afresh, so the last line before a
checkpoint must end exactly at its step, or the steps between that line and the checkpoint would never be
reported. And an eval line follows the train line of its own step, so the two are read side by side. A step
whose update was skipped is logged too, so the bad step is on record before the divergence guard can stop
the run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Due:
    log: bool  # write a metrics line (read the loss back from the device)
    eval: bool  # evaluate (and generate samples)
    save: bool  # write a checkpoint


@dataclass(frozen=True)
class Cadence:
    total_steps: int
    log_every: int  # logging.every_steps
    eval_every: int | None  # train.eval_every_steps (None: at the end only)
    save_every: int | None  # checkpoint.every_steps (None: only on a stop request)
    has_eval: bool  # there is eval data: then it is always evaluated at the last step

    @classmethod
    def from_recipe(cls, recipe, *, total_steps: int, has_eval: bool) -> Cadence:
        return cls(total_steps=total_steps, log_every=recipe.logging.every_steps,
                   eval_every=recipe.train.eval_every_steps, save_every=recipe.checkpoint.every_steps,
                   has_eval=has_eval)

    def at(self, step: int, *, stop: bool = False, skipped: bool = False) -> Due:
        """What is due after optimizer step `step` (1-based). `stop`: a stop was requested (save, then stop);
        `skipped`: the step's update was skipped."""
        last = step == self.total_steps
        evaluate = self.has_eval and (last or _every(step, self.eval_every))
        save = stop or _every(step, self.save_every)
        log = _every(step, self.log_every) or last or evaluate or save or skipped
        return Due(log=log, eval=evaluate, save=save)


def _every(step: int, every: int | None) -> bool:
    return bool(every) and step % every == 0
