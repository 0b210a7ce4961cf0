"""The side-by-side benchmark's CI smoke check: `benchmarks/vs_hf.py --smoke` runs llmtrain (fast path and
baseline) and HF Trainer (padded and flattening collators) for 2 steps of the CPU shape on GSM8K through the real
Mistral chat template, and this test asserts on the JSON it prints, never on timings."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import GSM8K, MISTRAL, REPO, needs
from helpers import ENV

SYSTEMS = {"llmtrain", "llmtrain-baseline", "hf-padded", "hf-flatten"}


@pytest.mark.extended  # main tier: a benchmark's smoke check; its systems' tokens are counted by test_loop_run.py
@pytest.mark.slow
@needs(MISTRAL)
@needs(GSM8K)
def test_smoke_every_system_trains_the_same_tokens(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/vs_hf.py", "--smoke", "--workdir", str(tmp_path)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"vs_hf.py --smoke exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    rows = {r["system"]: r for r in lines if "system" in r}
    final = lines[-1]
    assert set(rows) == SYSTEMS
    assert final["smoke"] == "ok", final["problems"]

    ours = rows["llmtrain"]
    for name, row in rows.items():
        # One epoch of the same 8 examples in 2 steps: the same real tokens in total and per step, exactly.
        assert row["steps"] == 2, name
        assert row["real_tokens_total"] == ours["real_tokens_total"], name
        assert row["real_tokens_per_step"] == pytest.approx(ours["real_tokens_per_step"],
                                                            rel=final["tolerance_tokens_per_step"]), name
        assert row["trained_tokens_per_step"] == ours["trained_tokens_per_step"], name
        assert math.isfinite(row["first_loss"]) and math.isfinite(row["final_loss"]), name
        # A random init of the real 32k vocabulary starts near ln(32768) = 10.4 for every system.
        assert abs(row["first_loss"] - math.log(32768)) < 0.5, name
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0, name
    assert ours["micro_batch"].startswith("bins of <=") and ours["attention"].startswith("varlen")
    assert rows["llmtrain-baseline"]["attention"].startswith("sdpa")
    # The two HF runs see the same examples in the same order from the same init: padding and flattening must
    # give the same training, which checks that the harness feeds both collators the same labels.
    assert rows["hf-flatten"]["final_loss"] == pytest.approx(rows["hf-padded"]["final_loss"], rel=1e-4)
    assert set(final["ratios"]["tokens_per_s"]) == {f"llmtrain/{s}" for s in SYSTEMS - {"llmtrain"}}
