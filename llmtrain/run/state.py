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
        if micro_batch_tokens:
            bins = self.micro_in_epoch * self.processes
            if bins % processes:
                raise LLMTrainError(
                    f"the checkpoint stopped after {bins} token bins of its epoch, which {processes} processes cannot "
                    f"split evenly; resume on a number of processes that divides {bins} (it was written by "
                    f"{self.processes})."
                )
            self.micro_in_epoch = bins // processes
        if self.micro_in_epoch % accum:
            raise LLMTrainError(
                f"the checkpoint stopped {self.micro_in_epoch} micro-batches into an epoch, which is not a whole "
                f"number of train.grad_accum_steps={accum} windows; resume with the grad_accum_steps it was "
                "written with."
            )


