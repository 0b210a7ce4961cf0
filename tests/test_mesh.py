"""The launch's device mesh (accelerate's parallelism_config): what llmtrain accepts, refuses, and prints.

Pure checks on accelerate's own ParallelismConfig, built from the PARALLELISM_CONFIG_* variables exactly as
`accelerate launch` sets them; the 4-process HSDP runs are in test_hsdp.py.
"""

from __future__ import annotations

import pytest

from llmtrain.errors import LLMTrainError
from llmtrain.layout import Layout
from llmtrain.parallel.mesh import mesh_line, requested_mesh


def check_mesh(mesh, *, world: int, fsdp: bool) -> None:
    """The mesh's problems as a process of the launch finds them (Layout.from_environment: the variables
    `accelerate launch` sets, here from the ParallelismConfig that _mesh made of them)."""
    layout = Layout(processes=world, fsdp=fsdp, mesh=True, replicate=mesh.dp_replicate_size,
                    shard=mesh.dp_shard_size, tp=mesh.tp_size, cp=mesh.cp_size, accelerate_sp=mesh.sp_size)
    if found := layout.problems():
        raise LLMTrainError(" ".join(found))


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
    ({"dp_shard": 2, "cp": 2}, 4, True, ["context parallelism", "parallelism_config_cp_size", "parallel.sequence_parallel"]),
    ({"dp_shard": 2, "sp": 2}, 4, True, ["sequence parallelism", "parallelism_config_sp_size"]),
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 4, True, ["2 x 2 x 2 = 8", "4 processes",
                                                             "replicas x shards x tensor-parallel ranks"]),
    ({"tp": 4}, 4, True, ["at least 2 shards", "launch at least 8 processes (2 shards x 4 tensor-parallel ranks)",
                          "parallelism_config_dp_shard_size: 2", "fsdp_tp.yaml"]),
    # the fix is the shards the processes make (it had said "processes divided by 2" where that was the 1 given)
    ({"tp": 2}, 8, True, ["at least 2 shards", "set parallelism_config_dp_shard_size: 4 (the 8 processes over 2"]),
    ({"tp": 2}, 2, True, ["launch at least 4 processes (2 shards x 2 tensor-parallel ranks)"]),
    ({"dp_shard": 2, "tp": 2}, 8, True, ["2 x 2 = 4", "8 processes", "parallelism_config_tp_size",
                                          "--parallelism_config_dp_shard_size 4 --parallelism_config_tp_size 2"]),
    ({"dp_replicate": 2, "dp_shard": 2}, 4, False, ["distributed_type: FSDP", "ddp.yaml"]),
    # replicas alone under FSDP (2 nodes of 1 GPU): accelerate's ValueError in every process, audit 8
    ({"dp_replicate": 2, "dp_shard": 1}, 2, True, ["parallelism_config_dp_shard_size: 1", "at least 2 shards",
                                                    "accelerate_configs/ddp.yaml for replicas alone"]),
])
def test_meshes_llmtrain_does_not_train_are_refused_with_what_to_use(monkeypatch, sizes, world, fsdp, names):
    with pytest.raises(LLMTrainError) as refused:
        check_mesh(_mesh(monkeypatch, **sizes), world=world, fsdp=fsdp)
    for name in names:
        assert name in str(refused.value)


def test_fsdp_x_tp_with_the_offload_is_refused_as_the_estimate_refuses_it():
    """fsdp_offload_params with tensor parallelism: estimate-memory refused it (never trained or measured) while the
    launch let it through (audit 8); the layout refuses it for both, naming the fix. FSDP alone keeps the offload."""
    found = Layout(processes=4, fsdp=True, mesh=True, shard=2, tp=2, offload=True).problems()
    assert len(found) == 1 and "fsdp_offload_params: true with tensor parallelism" in found[0]
    assert Layout(processes=4, fsdp=True, offload=True).problems() == []


def test_fsdp_x_tp_is_accepted_and_named(monkeypatch):
    mesh = _mesh(monkeypatch, dp_shard=2, tp=2)
    check_mesh(mesh, world=4, fsdp=True)
    assert mesh_line(mesh) == "2 shards x 2 tensor-parallel"
    assert mesh_line(_mesh(monkeypatch, dp_shard=4, tp=2)) == "4 shards x 2 tensor-parallel"
    three_d = _mesh(monkeypatch, dp_replicate=2, dp_shard=2, tp=2)
    check_mesh(three_d, world=8, fsdp=True)
    assert mesh_line(three_d) == "2 replicas x 2 shards x 2 tensor-parallel"
    # Accelerate is handed the data-parallel part of the mesh (tp_size 1): the line takes TP from the device mesh
    assert mesh_line(_mesh(monkeypatch, dp_shard=2), tp=2) == "2 shards x 2 tensor-parallel"


@pytest.mark.parametrize("section, names", [
    ({"model": {"quantize": "nf4"}, "lora": {"r": 4}}, ["does not train a 4-bit base", "model.quantize", "ddp.yaml"]),
])  # model.tiled_mlp trains under FSDP x TP (test_tp.py::test_a_tiled_mlp_under_fsdp_x_tp_trains_like_one_process),
# model.compile too (test_tp.py::test_model_compile_under_fsdp_x_tp_trains_as_the_eager_split_model)
def test_what_tensor_parallelism_does_not_train_is_refused(monkeypatch, tmp_path, section, names):
    from llmtrain.config import Recipe

    base = {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl", "format": "prompt_completion"},
            "output_dir": str(tmp_path)}
    from llmtrain import capabilities

    recipe = Recipe.model_validate({**base, **{k: {**base.get(k, {}), **v} for k, v in section.items()}})
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    _mesh(monkeypatch, dp_shard=4)
    capabilities.check(recipe, Layout.from_environment(recipe))  # no TP: nothing to refuse
    _mesh(monkeypatch, dp_shard=2, tp=2)
    with pytest.raises(LLMTrainError) as refused:
        capabilities.check(recipe, Layout.from_environment(recipe))
    for name in names + ["parallelism_config_tp_size: 2"]:
        assert name in str(refused.value)


def test_tensor_parallel_plan_needs_heads_and_columns_that_divide(tiny_assets):
    """apply_tensor_parallel refuses, before it shards anything, a TP size that does not divide the KV heads
    (the tiny Llama has 4 query heads, 2 KV heads, an MLP of 512) or a plan with a style llmtrain does not build."""
    import types

    from llmtrain.config import ModelConfig
    from llmtrain.model.modeling import load_model
    from llmtrain.parallel.tensor import apply_tensor_parallel

    model = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), dtype="float32"), None)
    with pytest.raises(LLMTrainError, match=r"num_key_value_heads \(2\) .* not a multiple of 4"):
        apply_tensor_parallel(model, types.SimpleNamespace(size=lambda: 4))
    # a style llmtrain does not build (transformers' sequence-parallel norm)
    model.config.base_model_tp_plan = {"layers.*.input_layernorm": "sequence_parallel"}
    with pytest.raises(LLMTrainError, match="sequence_parallel"):
        apply_tensor_parallel(model, types.SimpleNamespace(size=lambda: 2))


def test_fsdp_param_groups_reads_both_torch_spellings():
    """FSDP2 keeps a unit's parameter groups in a private attribute spelt two ways: torch 2.13's list
    `_fsdp_param_groups` (this venv's FSDPState) and torch 2.11's single `_fsdp_param_group` or None (the GPU
    machine's; reading the list there was issue 41's AttributeError on every rank). `make test-dist` runs the
    FSDP launches on a torch 2.11 venv."""
    import types

    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from llmtrain.parallel.fsdp import fsdp_param_groups

    state, group = FSDPState(), object()  # a real state of this torch, its group where this torch keeps it
    assert fsdp_param_groups(state) == []
    if isinstance(getattr(state, "_fsdp_param_groups", None), list):
        state._fsdp_param_groups.append(group)
    else:
        state._fsdp_param_group = group
    assert fsdp_param_groups(state) == [group]
    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []
