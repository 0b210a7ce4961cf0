"""Stop on request: SIGTERM (SLURM, Kubernetes, spot instances) or a first Ctrl-C asks the run to stop at the
next step boundary, after a checkpoint; a Ctrl-C after either stops at once (under a launcher, which passes a
second Ctrl-C on as SIGTERM: a SIGTERM after a Ctrl-C), and so does a SIGTERM before the training
loop (stop_at_once_on_sigterm: nothing to finish there). A process a launcher started is sent SIGTERM when its
launcher dies (stop_with_the_launcher).

The handler only records the signal; the training loop reads it at each step boundary. With several
processes the ranks agree through the step's one collective (train.train_step), so every rank stops after
the same step and none waits in a collective for a rank that left.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


class StopRequests:
    """Context manager that records SIGTERM / SIGINT instead of dying; `signum` is 0 until one arrives. `doing`: what
    the process does before it stops, said when the signal arrives."""

    def __init__(self, doing: str = "finishing this step (an eval: its batch), then saving a checkpoint and "
                 "stopping") -> None:
        self.signum = 0
        self.doing = doing
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signum:  # Ctrl-C after a first request (a Ctrl-C, or a SIGTERM, which had
            raise KeyboardInterrupt  # made it be ignored; audit 54): stop now, without a checkpoint
        if self.signum == signal.SIGINT and signum == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ:
            # under a launcher (own sessions: the terminal's Ctrl-C reaches the launcher alone), a second Ctrl-C
            # arrives as torchrun's SIGTERM to its processes, sent as it gives up waiting: the second Ctrl-C had done
            # nothing (audit 54)
            raise KeyboardInterrupt
        if not self.signum:
            self.signum = signum
            how = "again to stop at once" if signum == signal.SIGINT else ""
            if os.environ.get("LOCAL_RANK", "0") != "0":  # every process of a launch is signalled: said once a node
                return
            print(f"\n{signal.Signals(signum).name}: {self.doing}{' (Ctrl-C ' + how + ')' if how else ''}.",
                  file=sys.stderr, flush=True)


class StoppedAtOnce(KeyboardInterrupt):
    """A SIGTERM where no step runs that could finish first (the data's preparation, the model's load): the process
    stops at once, said as a second Ctrl-C is (cli.user_errors), with exit 143."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum


def stop_at_once_on_sigterm() -> None:
    """SIGTERM outside the training loop stops at once with one line and exit 143, as Ctrl-C does with 130 (it had
    ended the process with no word, -15; audit 54); the loop's StopRequests takes its place while steps run."""
    def stop(signum: int, frame) -> None:
        raise StoppedAtOnce(signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_the_launcher() -> bool:
    """In a process torchrun started (`accelerate launch`, `llmtrain launch`), ask the kernel for SIGTERM when the
    launcher dies. A launcher ended by SIGKILL (kill -9 of the job's first process, the OOM killer) passes nothing on,
    and torch's launcher does not ask for this itself: its processes would train on without it, orphaned, holding the
    GPUs and the run folder (the next --resume refused: in use by them), and finish unwatched. SIGTERM stops them as
    a preemption does: the step finishes, a checkpoint is written at it, and --resume auto continues it. Whether it
    was asked for (Linux, under torchrun)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if parent == 1 or os.getppid() != parent:  # the launcher died before the request: nothing will send it
        os.kill(os.getpid(), signal.SIGTERM)
    return True
