"""The launch's device mesh (accelerate's parallelism_config): what llmtrain accepts, refuses, and prints.

Pure checks on accelerate's own ParallelismConfig, built from the PARALLELISM_CONFIG_* variables exactly as
`accelerate launch` sets them; the 4-process HSDP runs are in test_hsdp.py.
"""

from __future__ import annotations

import pytest

from llmtrain.distributed import check_mesh, mesh_line, requested_mesh
from llmtrain.errors import LLMTrainError


def _mesh(monkeypatch, **sizes: int):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", str(sizes.get(name, 1)))
    return requested_mesh()


def test_no_parallelism_config_means_no_mesh(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    assert requested_mesh() is None
    assert mesh_line(None) is None


def test_hsdp_is_accepted_and_named(monkeypatch):
    mesh = _mesh(monkeypatch, dp_replicate=2, dp_shard=2)
    check_mesh(mesh, world=4, fsdp=True)
    assert mesh_line(mesh) == "2 replicas x 2 shards"
    assert mesh_line(_mesh(monkeypatch, dp_replicate=4, dp_shard=8)) == "4 replicas x 8 shards"
    assert mesh_line(_mesh(monkeypatch, dp_shard=8)) == "8 shards"


@pytest.mark.parametrize("sizes, world, fsdp, names", [
    ({"dp_replicate": 2, "dp_shard": 2}, 8, True, ["2 x 2 = 4", "8 processes", "parallelism_config_dp_shard_size"]),
    ({"dp_shard": 2, "cp": 2}, 4, True, ["context parallelism", "parallelism_config_cp_size", "micro_batch_tokens"]),
    ({"dp_shard": 2, "sp": 2}, 4, True, ["sequence parallelism", "parallelism_config_sp_size"]),
    ({"dp_shard": 2, "tp": 2}, 4, True, ["tensor parallelism", "parallelism_config_tp_size: 1",
                                          "hsdp_multinode.yaml"]),
    ({"dp_replicate": 2, "dp_shard": 2}, 4, False, ["distributed_type: FSDP", "ddp.yaml"]),
])
def test_meshes_llmtrain_does_not_train_are_refused_with_what_to_use(monkeypatch, sizes, world, fsdp, names):
    with pytest.raises(LLMTrainError) as refused:
        check_mesh(_mesh(monkeypatch, **sizes), world=world, fsdp=fsdp)
    for name in names:
        assert name in str(refused.value)
