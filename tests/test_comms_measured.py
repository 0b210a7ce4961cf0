"""The communication model (llmtrain/memory/comms.py) against what really crosses the process group: the tiny model
trained 2 steps of 2 micro-batches under DDP (2 processes), FSDP2 (2), HSDP (2 replicas x 2 shards, 4) and FSDP x
TP (2 shards x 2 tensor-parallel, 4), with every collective of each step recorded (tests/count_collectives.py). The
payloads the model predicts per step (the bytes all-reduced, all-gathered and reduce-scattered, and the group each
runs in) must be what each rank sent through torch.distributed. What a payload costs on the wire (the ring factors)
is tested by hand in test_comms.py.

Under TP the activations' all-reduces carry each micro-batch's real tokens (the model assumes full-length examples),
so they are checked against the tokens the run logged: 4 all-reduces of tokens x hidden a layer per micro-batch
(5 with gradient checkpointing: the recompute stops before the MLP's), each TP group all-reducing its own data
rank's tokens. Phi-3's gathered plan (its fused qkv_proj and gate_up_proj) all-gathers too: their outputs in forward
(again in a checkpointed layer's recompute), o_proj's and down_proj's input gradients in backward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from helpers import ENV, REPO, records, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.long(80)]

CONFIGS = {"ddp": ("cpu_ddp.yaml", 2), "fsdp": ("cpu_fsdp.yaml", 2), "fsdp-noreshard": ("cpu_fsdp.yaml", 2),
           "hsdp": ("cpu_hsdp.yaml", 4),
           "tp": ("cpu_tp.yaml", 4), "tp-ckpt": ("cpu_tp.yaml", 4), "tp-phi3": ("cpu_tp.yaml", 4),
           "tp-phi3-ckpt": ("cpu_tp.yaml", 4)}
STEPS, ACCUM = 2, 2


def _model(tiny, tmp_path, strategy: str):
    """The tiny Llama, or for the tp-phi3 cases the same shapes in Phi-3's layer (tests/test_families.py's)."""
    from test_families import family_model

    return family_model(tiny, tmp_path / "phi3", "phi3") if "phi3" in strategy else tiny / "model"


def _measured(tiny, tmp_path, port, strategy: str) -> list[dict]:
    config, processes = CONFIGS[strategy]
    recipe = write_recipe(tiny, tmp_path, train={"max_steps": STEPS, "grad_accum_steps": ACCUM, "micro_batch_size": 2},
                          checkpoint={"save_final": False},
                          model={"gradient_checkpointing": strategy.endswith("-ckpt"),
                                 "name_or_path": str(_model(tiny, tmp_path, strategy))},
                          # packed rows: the activations all-reduced are the real tokens the run logs, no padding
                          data={"packing": strategy.startswith("tp")})
    out = tmp_path / f"counts-{strategy}"
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / config),
         "--num_processes", str(processes), "--main_process_port", str(port),
         *(["--fsdp_reshard_after_forward", "false"] if strategy == "fsdp-noreshard" else []),
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


def _predicted(tiny, tmp_path, strategy: str) -> dict:
    from llmtrain.memory.comms import collectives, gathered_bytes, tensor_parallel_activations, tensor_parallel_gathers
    from llmtrain.memory.estimate import states
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec

    from llmtrain.memory.params import tensor_parallel_shape

    gpus, nodes, tp = {"ddp": (2, 1, 1), "fsdp": (2, 1, 1), "fsdp-noreshard": (2, 1, 1),
                       "hsdp": (2, 2, 1)}.get(strategy, (4, 1, 2))
    spec = TrainSpec(strategy="fsdp" if tp > 1 else strategy.split("-")[0], num_gpus=gpus,
                     reshard_after_forward=strategy != "fsdp-noreshard", num_nodes=nodes, grad_accum_steps=ACCUM,
                     dtype="float32", tp=tp, micro_batch=2, seq_len=32,
                     gradient_checkpointing=strategy.endswith("-ckpt"))
    shape = tensor_parallel_shape(load_model_shape(str(_model(tiny, tmp_path, strategy))), tp)  # one GPU's slice
    gradients = states(shape, spec, None).grads * spec.shards
    predicted = defaultdict(float)
    gathered = gathered_bytes(shape, spec, trained_params=shape.params_total)
    for c in collectives(spec, trainable_bytes=gradients, gathered=gathered,
                         activations=tensor_parallel_activations(shape, spec),
                         gathers=tensor_parallel_gathers(shape, spec)):
        predicted[(c.kind, c.group)] += c.nbytes
    return dict(predicted), shape


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", pytest.param("hsdp", marks=pytest.mark.extended),
                                      # fsdp_reshard_after_forward: false, the layers gathered once a micro-batch
                                      # (the estimate had counted twice: audit 8)
                                      pytest.param("fsdp-noreshard", marks=pytest.mark.extended),
                                      # extended: their parts are FSDP's and TP's (TP's own collectives: test_tp.py)
                                      *(pytest.param(s, marks=pytest.mark.extended)
                                        for s in ("tp", "tp-ckpt", "tp-phi3", "tp-phi3-ckpt"))])
def test_predicted_payloads_are_what_crosses_the_process_group(tiny_assets, tmp_path, free_port, strategy):
    predicted, shape = _predicted(tiny_assets, tmp_path, strategy)
    measured_all = _measured(tiny_assets, tmp_path, free_port, strategy)
    if strategy.startswith("tp"):  # the activations' all-reduces: the logged tokens, not full-length examples
        per_layer = 5 if strategy.endswith("-ckpt") else 4
        tokens = sum(r["tokens"] for r in records(tmp_path / strategy)) / STEPS  # both data ranks, per step
        layers, hidden = 2, 128  # the tiny Llama's
        # the model: every example of a micro-batch 2 x 32 tokens long, an upper bound
        bound = predicted.pop(("all_reduce", 2))
        assert bound == ACCUM * per_layer * layers * 2 * 32 * hidden * 4
        activations = [m.pop(("all_reduce", 2)) for m in measured_all]
        assert activations[0] == activations[1] and activations[2] == activations[3]  # a TP pair: one batch
        assert activations[0] + activations[2] == per_layer * layers * tokens * hidden * 4
        assert max(activations) <= bound
        # Phi-3's gathers, in the TP group of 2 beside FSDP's parameter all-gathers in its group of 2: the fused
        # outputs (qkv 4 x 32 + 2 x 2 x 32, gate_up 2 x 512 a token; twice when checkpointed) and o_proj's and
        # down_proj's input gradients (128 + 512), of the TP pair's own tokens
        forward, backward = shape.tp_gathers
        assert (forward, backward) == ((256 + 1024, 128 + 512) if "phi3" in strategy else (0, 0))
        each = layers * ((2 if strategy.endswith("-ckpt") else 1) * forward + backward) * 4
        predicted[("all_gather", 2)] -= ACCUM * 2 * 32 * each  # the bound: full-length examples
        for rank, measured in enumerate(measured_all):
            measured[("all_gather", 2)] -= activations[rank] / (per_layer * layers * hidden * 4) * each
    for rank, measured in enumerate(measured_all):
        assert measured.keys() == predicted.keys(), (rank, measured, predicted)
        for key, nbytes in predicted.items():
            # FSDP2 pads each parameter's first dimension to a multiple of the shard count: at most a row each
            assert measured[key] == pytest.approx(nbytes, rel=0.01), (rank, key, measured[key], nbytes)
