"""Where training is: a small explicit object, saved with every checkpoint (train_state.json) and restored on
resume, advanced once per optimizer step. Nothing in it depends on when metrics lines are written."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from llmtrain.errors import LLMTrainError


@dataclass
class TrainState:
    """Where training is. Saved with every checkpoint; resume continues from exactly here."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current epoch
    micro_in_epoch: int = 0  # global micro-batches of the current epoch already trained on
    examples_per_micro: int = 0  # micro_batch_size x processes when saved: fixes the data order
    processes: int = 0  # processes of the run that saved it
    tokens_seen: int = 0  # input tokens (all ranks) processed so far
    trained_tokens_seen: int = 0  # tokens that carried loss so far
    micro_batch_tokens: int = 0  # token budget of a micro-batch (train.micro_batch_tokens); 0: by examples
    bad_steps: int = 0  # steps skipped for a non-finite loss or gradient norm (train.max_bad_steps), in all
    elapsed_s: float = 0.0  # wall time of the run up to this state, over every resumed part (0 before it existed)
    # the local files the weights come from (preflight.input_files): a resume compares them ({}: written before)
    inputs: dict = field(default_factory=dict)
    eval_owed: bool = False  # a stop cut this step's eval short: the resumed run evaluates the step first
    tensor_parallel: int = 1  # the tensor-parallel degree it was written under (preflight.resume_launch names it)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)

    def advance(self, window, result) -> None:
        """Account for one optimizer step: its `window` (batching.Window) and its `result` (step.StepResult)."""
        self.step += 1
        # a count of the whole run (it survives a resume); fp16's loss scale skips an overflowed step itself
        self.bad_steps += result.skipped and not result.overflow
        self.tokens_seen += int(result.counts.tokens)
        self.trained_tokens_seen += int(result.counts.trained)
        # Roll the epoch over with the step that ends it, so a checkpoint saved now resumes at the next epoch's
        # start rather than "all micro-batches into" the finished one.
        self.epoch, self.micro_in_epoch = ((window.epoch + 1, 0) if window.epoch_done else (window.epoch, window.end))

    def check_layout(self, *, accum: int, micro_batch_tokens: int, processes: int) -> None:
        """Carry the epoch position over to this run's layout (what must match was checked before anything
        loaded: preflight.check_resume).

        By examples, micro_batch_size x processes is unchanged, so the position carries over as it is. By
        tokens, the bins do not depend on the process count: the position (bins trained so far this epoch)
        carries over to any number of processes that divides it, and is converted here.
        """
        if problem := position_problem(self.state_dict(), accum=accum, micro_batch_tokens=micro_batch_tokens,
                                       processes=processes):
            raise LLMTrainError(problem)
        if micro_batch_tokens:
            self.micro_in_epoch = self.micro_in_epoch * self.processes // processes


def position_problem(state: dict, *, accum: int, micro_batch_tokens: int, processes: int,
                     written_accum: int | None = None) -> str | None:
    """Why a checkpoint's place in its epoch (`state`, a train_state.json) cannot carry over to this layout, else None:
    by tokens, its bins must split over the processes; its micro-batches must be whole accumulation windows.
    preflight.check_resume asks before anything loads (it had been asked after the model was built; audit 55)."""
    micro, saved = state.get("micro_in_epoch", 0), state.get("processes") or processes
    if micro_batch_tokens:
        bins = micro * saved
        if bins % processes:
            return (f"the checkpoint stopped after {bins} token bins of its epoch, which {processes} processes cannot "
                    f"split evenly; resume on a number of processes that divides {bins} (it was written by {saved}).")
        micro = bins // processes
    if micro % accum:
        if written_accum and written_accum != accum:
            fix = (f"resume with train.grad_accum_steps={written_accum}, which it was written with, or from a "
                   "checkpoint whose place in the epoch the new value divides")
        elif micro_batch_tokens and saved != processes:  # the token bins a step (accumulation x processes) changed
            fix = (f"resume on the {saved} processes it was written by, or keep train.grad_accum_steps x processes "
                   f"= {(written_accum or accum) * saved} token bins a step")
        else:
            fix = "resume with the grad_accum_steps it was written with"
        return (f"the checkpoint stopped {micro} micro-batches into an epoch, which is not a whole number of "
                f"train.grad_accum_steps={accum} windows: {fix}.")
    return None


