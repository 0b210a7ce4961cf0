"""The communication model (llmtrain/memory/comms.py) against what really crosses the process group: the tiny model
trained 2 steps of 2 micro-batches under DDP (2 processes), FSDP2 (2) and HSDP (2 replicas x 2 shards, 4), with
every collective of each step recorded (tests/count_collectives.py). The payloads the model predicts per step (the
bytes all-reduced, all-gathered and reduce-scattered, and the group each runs in) must be what each rank sent
through torch.distributed. What a payload costs on the wire (the ring factors) is tested by hand in test_comms.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from helpers import ENV, REPO, write_recipe

pytestmark = pytest.mark.slow

CONFIGS = {"ddp": ("cpu_ddp.yaml", 2), "fsdp": ("cpu_fsdp.yaml", 2), "hsdp": ("cpu_hsdp.yaml", 4)}
STEPS, ACCUM = 2, 2


def _measured(tiny, tmp_path, port, strategy: str) -> list[dict]:
    config, processes = CONFIGS[strategy]
    recipe = write_recipe(tiny, tmp_path, train={"max_steps": STEPS, "grad_accum_steps": ACCUM, "micro_batch_size": 2},
                          checkpoint={"save_final": False})
    out = tmp_path / f"counts-{strategy}"
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / config),
         "--num_processes", str(processes), "--main_process_port", str(port),
         str(REPO / "tests" / "count_collectives.py"), str(out), "finetune", str(recipe),
         f"output_dir={tmp_path / strategy}"],
        env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = []
    for rank in range(processes):
        sums = defaultdict(int)
        for kind, nbytes, group in json.loads((out / f"rank{rank}.json").read_text()):
            sums[(kind, group)] += nbytes
        per_rank.append({k: v / STEPS for k, v in sums.items()})
    return per_rank


def _predicted(tiny, strategy: str) -> dict:
    from llmtrain.memory.comms import collectives, gathered_bytes
    from llmtrain.memory.estimate import states
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec

    shape = load_model_shape(str(tiny / "model"))
    gpus, nodes = {"ddp": (2, 1), "fsdp": (2, 1), "hsdp": (2, 2)}[strategy]
    spec = TrainSpec(strategy=strategy, num_gpus=gpus, num_nodes=nodes, grad_accum=ACCUM, dtype="float32")
    gradients = states(shape, spec, None).grads * spec.shards
    predicted = defaultdict(float)
    for c in collectives(spec, trainable_bytes=gradients, gathered=gathered_bytes(shape, spec,
                                                                                 trained_params=shape.params_total)):
        predicted[(c.kind, c.group)] += c.nbytes
    return dict(predicted)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hsdp"])
def test_predicted_payloads_are_what_crosses_the_process_group(tiny_assets, tmp_path, free_port, strategy):
    predicted = _predicted(tiny_assets, strategy)
    for rank, measured in enumerate(_measured(tiny_assets, tmp_path, free_port, strategy)):
        assert measured.keys() == predicted.keys(), (rank, measured, predicted)
        for key, nbytes in predicted.items():
            # FSDP2 pads each parameter's first dimension to a multiple of the shard count: at most a row each
            assert measured[key] == pytest.approx(nbytes, rel=0.01), (rank, key, measured[key], nbytes)
