"""Run by tests/test_preemption.py under `accelerate launch`: `llmtrain ARGS...` with a SIGTERM sent to rank 1 alone
as the first eval begins its second batch, as a signal that reached one process of a job: the processes vote before
each eval batch, so both end the eval there.

    accelerate launch ... tests/stop_probe.py finetune RECIPE ...
"""

from __future__ import annotations

import os
import signal
import sys

import llmtrain.loop.train as loop
from llmtrain.cli import main


def signalled(real):
    sent = []

    def evaluate(*args, on_batch, **kwargs):
        def batch(done, total):
            if done == 1 and not sent and os.environ.get("RANK") == "1":
                sent.append(done)
                os.kill(os.getpid(), signal.SIGTERM)
            on_batch(done, total)

        return real(*args, on_batch=batch, **kwargs)

    return evaluate


if __name__ == "__main__":
    loop.evaluate = signalled(loop.evaluate)
    sys.argv = ["llmtrain", *sys.argv[1:]]
    main()
