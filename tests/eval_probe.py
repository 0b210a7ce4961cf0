"""Run by tests/test_benchmarks.py under `accelerate launch`: `llmtrain eval ARGS...` with the harness's scoring of
loglikelihood requests counted, each process writing how many it scored to OUT_DIR/rank{N}.json.

    accelerate launch ... tests/eval_probe.py OUT_DIR eval RUN --tasks ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lm_eval.models.huggingface import HFLM

from llmtrain.cli import main


def counted(original, folder: Path):
    def run(self, requests, *args, **kwargs):
        out = folder / f"rank{os.environ.get('RANK', '0')}.json"
        done = json.loads(out.read_text()) if out.exists() else 0
        out.write_text(json.dumps(done + len(requests)))
        return original(self, requests, *args, **kwargs)

    return run


if __name__ == "__main__":
    HFLM._loglikelihood_tokens = counted(HFLM._loglikelihood_tokens, Path(sys.argv[1]))
    sys.argv = ["llmtrain", *sys.argv[2:]]
    main()
