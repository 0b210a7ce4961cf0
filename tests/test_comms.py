"""What each GPU sends per optimizer step (llmtrain/memory/comms.py), against numbers worked out by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import estimate_memory

from llmtrain.memory.comms import (
    Gathered,
    Network,
    all_gather,
    all_reduce,
    data_parallel,
    reduce_scatter,
    tensor_parallel_activations,
)
from llmtrain.config import load_recipe
from llmtrain.memory.spec import TrainSpec

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "accelerate_configs"


def test_ring_collectives():
    assert all_reduce(100, 4) == 150  # 2 (n-1)/n S
    assert all_gather(100, 4) == 75 == reduce_scatter(100, 4)  # (n-1)/n S
    assert all_reduce(100, 1) == 0


def _parts(strategy: str, gpus: int, nodes: int, accum: int = 1, tail: float = 0, **tp):
    spec = TrainSpec(strategy=strategy, num_gpus=gpus, num_nodes=nodes, grad_accum_steps=accum, **tp)
    parts = data_parallel(spec, trainable_bytes=3200, gathered=Gathered(1600, tail), activations=100)
    return sum(p[1] for p in parts), sum(p[2] for p in parts)


def test_ddp_all_reduces_the_gradients_once_per_step():
    # 1 node x 8: 2 x 7/8 x 3200 = 5600, all over NVLink; accumulation does not add any (no_sync)
    assert _parts("ddp", 8, 1) == _parts("ddp", 8, 1, accum=4) == (5600, 0)
    # 2 nodes x 8: 2 x 15/16 x 3200 = 6000 sent, 1/8 of it (750) over the GPU's own network card
    assert _parts("ddp", 8, 2) == (5250, 750)


def test_fsdp_gathers_parameters_twice_per_micro_batch_and_reduce_scatters_each_micro_batch_or_once():
    # 1 node x 8, 2 micro-batches: all-gathers 2 x 2 x 7/8 x 1600 = 5600; the gradients reduce-scattered every
    # micro-batch (fsdp_accumulate sharded, the default) 2 x 7/8 x 3200 = 5600, or once a step (unsharded) 2800
    assert _parts("fsdp", 8, 1, accum=2) == (11200, 0)
    assert _parts("fsdp", 8, 1, accum=2, fsdp_accumulate="unsharded") == (8400, 0)
    # 2 nodes x 8: (2 x 15/16 x 1600 + 15/16 x 3200) = 6000 sent, 750 of it across nodes
    assert _parts("fsdp", 8, 2) == _parts("fsdp", 8, 2, fsdp_accumulate="unsharded") == (5250, 750)
    # with 4 micro-batches the all-gathers cross the network every time, and the reduce-scatters every time
    # (8 x 1500 + 4 x 3000) / 8 = 3000, or once: (8 x 1500 + 3000) / 8 = 1875
    assert _parts("fsdp", 8, 2, accum=4)[1] == 3000
    assert _parts("fsdp", 8, 2, accum=4, fsdp_accumulate="unsharded")[1] == 1875
    # the tail (final norm, LM head) stays gathered from forward to backward: once a micro-batch, 7/8 x 800 = 700
    assert _parts("fsdp", 8, 1, accum=2, tail=800) == (11200 + 2 * 700, 0)


def test_hsdp_keeps_the_gathers_in_the_node_and_all_reduces_one_shard_across():
    # within the node as FSDP over 8: 2 x 7/8 x 1600 + 7/8 x 3200 = 5600; across: 2 x 1/2 x 3200/8 = 400
    assert _parts("hsdp", 8, 2) == (5600, 400)
    # accumulation adds gathers and (sharded) reduce-scatters within the node; across, one all-reduce a step either way
    assert _parts("hsdp", 8, 2, accum=4) == (2 * 4 * 1400 + 4 * 2800, 400)
    assert _parts("hsdp", 8, 2, accum=4, fsdp_accumulate="unsharded") == (2 * 4 * 1400 + 2800, 400)
    # 4 nodes: 2 x 3/4 x 400 = 600 across, less than flat FSDP's 1/8 x (2 x 31/32 x 1600 + 31/32 x 3200) = 775
    assert _parts("hsdp", 8, 4)[1] == 600 and _parts("fsdp", 8, 4)[1] == 775


def test_one_gpu_sends_nothing():
    assert _parts("single", 1, 1) == (0, 0)


def test_fsdp_x_tp_shards_the_slice_over_the_groups_and_all_reduces_activations_in_the_group():
    # 1 node x 8 as 4 shards x 2 TP (the payloads are one GPU's slice): all-gathers 2 x 3/4 x 1600 = 2400,
    # reduce-scatter 3/4 x 3200 = 2400, and 4 all-reduces of the activations (100 bytes over the layers) over 2:
    # 4 x 2 x 1/2 x 100 = 400
    assert _parts("fsdp", 8, 1, tp=2) == (5200, 0)
    # gradient checkpointing repeats attention's (its recompute stops before the MLP's all-reduce): 5 x 100 = 500
    assert _parts("fsdp", 8, 1, tp=2, gradient_checkpointing=True) == (5300, 0)
    # 2 nodes x 8 as 8 shards x 2 TP: the FSDP rings have 4 members a node, so 1/4 of 2 x 7/8 x 1600 + 7/8 x 3200
    # = 5600 crosses the network (1400), more than flat FSDP's 1/8 (750); the TP groups stay in the node
    assert _parts("fsdp", 8, 2, tp=2) == (5600 - 1400 + 400, 1400)
    assert _parts("fsdp", 8, 2)[1] == 750
    # HSDP x TP, 2 nodes x (4 shards x 2 TP): FSDP's traffic over the node's 4 shards (2400 + 2400) and the TP
    # all-reduces (400) stay in the node; across, the all-reduce of a shard of the slice's gradients: 2 x 1/2 x 3200/4
    assert _parts("hsdp", 8, 2, tp=2) == (5200, 800)


def test_tensor_parallel_activations_are_tokens_x_hidden_per_layer_in_the_compute_dtype():
    from types import SimpleNamespace

    shape = SimpleNamespace(layers=2, hidden=8)
    spec = TrainSpec(strategy="fsdp", num_gpus=4, tp=2, micro_batch=1, seq_len=10, mixed_precision="bf16")
    assert tensor_parallel_activations(shape, spec) == 2 * 10 * 8 * 2  # layers x tokens x hidden x bf16
    assert tensor_parallel_activations(shape, spec.but(mixed_precision="no")) == 2 * 10 * 8 * 4  # float32
    assert tensor_parallel_activations(shape, spec.but(tp=1)) == 0


def test_the_tensor_parallel_slice_of_llama_2_7b():
    """What one GPU of a TP pair holds of Llama-2-7B: half of q/k/v/gate/up's outputs and of o/down's inputs (16 of
    32 heads, 5504 of 11008 MLP columns); norms, embeddings and the LM head whole."""
    from llmtrain.memory.params import load_model_shape, tensor_parallel_shape

    whole = load_model_shape("llama-2-7b")
    half = tensor_parallel_shape(whole, 2)
    assert (half.heads, half.kv_heads, half.intermediate, half.hidden) == (16, 16, 5504, 4096)
    linears = {lin.name: (lin.fan_in, lin.fan_out) for lin in half.layer_linears}
    assert linears["self_attn.q_proj"] == (4096, 2048) and linears["self_attn.o_proj"] == (2048, 4096)
    assert linears["mlp.up_proj"] == (4096, 5504) and linears["mlp.down_proj"] == (5504, 4096)
    # a layer: 4 x 4096 x 2048 + 3 x 4096 x 5504 = 101,187,584 linear weights, and its 2 norms of 4096
    assert half.params_per_layer == 101_187_584 + 2 * 4096
    assert half.params_total == whole.params_total - 32 * 101_187_584


def test_the_tensor_parallel_slice_of_phi_4_splits_its_weights_and_keeps_its_heads():
    """Phi-4's gathered plan on a TP pair: the fused qkv_proj keeps half its output rows and gate_up_proj half, o_proj
    and down_proj half their inputs (the same weights a GPU as a Llama plan), but attention and the MLP run whole
    (40 query and 10 K/V heads, 17,920 MLP columns), so the estimate's activations are one process's; a token
    all-gathers (40 + 2 x 10) x 128 + 2 x 17,920 elements a layer in forward and 40 x 128 + 17,920 in backward."""
    from llmtrain.memory.comms import tensor_parallel_gathers
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.params import load_model_shape, tensor_parallel_shape

    whole = load_model_shape("phi-4")
    half = tensor_parallel_shape(whole, 2)
    assert (half.heads, half.kv_heads, half.intermediate) == (whole.heads, whole.kv_heads, whole.intermediate)
    linears = {lin.name: (lin.fan_in, lin.fan_out) for lin in half.layer_linears}
    assert linears["self_attn.qkv_proj"] == (5120, 3840) and linears["self_attn.o_proj"] == (2560, 5120)
    assert linears["mlp.gate_up_proj"] == (5120, 17920) and linears["mlp.down_proj"] == (8960, 5120)
    assert half.params_total == whole.params_total - 40 * whole.linear_params_per_layer // 2
    assert half.tp_gathers == (7680 + 35840, 5120 + 17920) and whole.tp_gathers == (0, 0)
    spec = TrainSpec(strategy="fsdp", num_gpus=8, tp=2, micro_batch=1, seq_len=2048, mixed_precision="bf16")
    assert tensor_parallel_gathers(half, spec) == (40 * 2048 * 43520 * 2, 40 * 2048 * 23040 * 2)
    assert tensor_parallel_gathers(load_model_shape("llama-2-7b"), spec) == (0.0, 0.0)
    def activations(shape, spec) -> int:  # the saved activations' largest, over the step's phases
        return max(part.get("activations", 0) for part in estimate(shape, spec).phase_parts.values())

    # the same activations as FSDP alone over the 8 GPUs; a Llama plan's are 0.68 of its own (the heads' and the MLP's
    # halved, the residual stream's and the norms' whole)
    assert activations(whole, spec) == activations(whole, spec.but(tp=1))
    llama = load_model_shape("llama-2-7b")
    assert activations(llama, spec) < 0.7 * activations(llama, spec.but(tp=1))


def test_times_at_the_stated_bandwidth_and_when_the_network_binds():
    from llmtrain.memory.comms import Traffic

    net = Network(intra_gbps=800, inter_gbps=8, peak_tflops=100, mfu=0.5)
    t = Traffic(parts=(("x", 1e9, 1e8),), compute_s=0.05, network=net)
    assert t.intra_s == pytest.approx(0.01)  # 8e9 bits at 800e9 bits/s
    assert t.inter_s == pytest.approx(0.1)
    assert t.network_bound  # 0.11 s of collectives against 0.05 s of compute


def test_the_scaling_doc_shows_what_the_model_computes():
    """docs/scaling.md's tables are benchmarks/scaling_table.py's output for the estimator as it is now."""
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("scaling_table", repo / "benchmarks" / "scaling_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    doc = (repo / "docs" / "scaling.md").read_text()
    for line in table.rows() + table.rows(25, multi_node_only=True):
        assert line in doc, f"docs/scaling.md is out of date (python benchmarks/scaling_table.py): {line}"


def test_the_sample_line_of_docs_scaling_is_what_its_command_prints():
    """docs/scaling.md shows what `estimate-memory recipes/llama7b.yaml --accelerate-config hsdp_multinode.yaml`
    prints of the network: it had shown 70.29 GB within the node where the command (and the page's own table) said
    93.88, a figure from before the model of FSDP's traffic was corrected (a new user's finding)."""
    import re
    from pathlib import Path

    out = " ".join(estimate_memory("recipes/llama7b.yaml", "--accelerate-config",
                                   "accelerate_configs/hsdp_multinode.yaml").stdout.split())
    said = re.search(r"network per GPU per step: .*? compute [0-9.]+ s", out).group(0)
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "scaling.md").read_text().split())
    assert said in doc, said


def test_estimate_memory_reads_the_hsdp_launch_and_says_what_crosses_the_network(tmp_path):
    """hsdp_multinode.yaml (2 nodes x 8, 2 replicas x 8 shards): the memory of FSDP over 8, and across nodes the
    all-reduce of each GPU's shard of the fp32 gradients: 2 x 1/2 x 6,738,415,616 x 4 / 8 bytes."""
    import json

    out = json.loads(estimate_memory("recipes/llama7b.yaml", "--accelerate-config",
                                     "accelerate_configs/hsdp_multinode.yaml", "--json").stdout)
    assert out["spec"]["strategy"] == "hsdp" and out["spec"]["world_size"] == 16
    assert out["communication"]["inter_node_bytes"] == 6_738_415_616 * 4 // 8
    assert out["communication"]["assumed"]["inter_gbps"] == 400
    fsdp8 = json.loads(estimate_memory("recipes/llama7b.yaml", "--accelerate-config",
                                       "accelerate_configs/fsdp.yaml", "--json").stdout)
    assert out["per_gpu_peak_bytes"] == fsdp8["per_gpu_peak_bytes"]  # sharded over a node's 8, as FSDP on 8

    text = estimate_memory("recipes/llama7b.yaml", "--accelerate-config",
                           "accelerate_configs/hsdp_multinode.yaml", "--inter-gbps", "8").stdout
    assert "3.37 GB across nodes (3.369 s at 8 Gb/s)" in " ".join(text.split()) and "network-bound" in text

    tp = tmp_path / "tp.yaml"
    tp.write_text((REPO_CONFIGS / "hsdp_multinode.yaml").read_text().replace(
        "parallelism_config_tp_size: 1", "parallelism_config_tp_size: 2"))
    refused = estimate_memory("recipes/llama7b.yaml", "--accelerate-config", str(tp), check=False)
    assert refused.returncode == 2 and "HSDP of 2 replicas x 8 shards x 2 TP on 2 node(s) of 8 GPUs" in refused.stderr
    odd = tmp_path / "odd.yaml"
    odd.write_text((REPO_CONFIGS / "hsdp_multinode.yaml").read_text().replace(
        "parallelism_config_dp_replicate_size: 2", "parallelism_config_dp_replicate_size: 4").replace(
        "parallelism_config_dp_shard_size: 8", "parallelism_config_dp_shard_size: 4"))
    refused = estimate_memory("recipes/llama7b.yaml", "--accelerate-config", str(odd), check=False)
    assert refused.returncode == 2 and "replicas = nodes and shards = GPUs per node" in refused.stderr


def test_estimate_memory_reads_the_fsdp_x_tp_launch(tmp_path):
    """fsdp_tp.yaml (8 GPUs as 4 shards x 2 TP): recipes/llama7b.yaml (2 micro-batches of 4 x 512 tokens, gradient
    checkpointing) all-reduces 2 x 5 x 32 layers x 2048 tokens x 4096 x 2 bytes (bf16) within each TP pair, and
    every process reads the whole fp32 model to load it: 8 x 6,738,415,616 x 4 bytes of host RAM."""
    import json

    out = json.loads(estimate_memory("recipes/llama7b.yaml", "--accelerate-config",
                                     "accelerate_configs/fsdp_tp.yaml", "--json").stdout)
    assert (out["spec"]["strategy"], out["spec"]["tp"], out["spec"]["world_size"]) == ("fsdp", 2, 8)
    parts = {p["what"].split(",")[0]: p["intra_node_bytes"] for p in out["communication"]["parts"]}
    assert parts["all-reduce of the activations in the TP group"] == 2 * 5 * 32 * 2048 * 4096 * 2
    assert out["communication"]["inter_node_bytes"] == 0
    assert out["host_ram_bytes"] == 8 * 6_738_415_616 * 4
    assert out["params_total"] == 6_738_415_616  # the model's, not a slice's
    fsdp4 = json.loads(estimate_memory("recipes/llama7b.yaml", "--strategy", "fsdp", "--num-gpus", "4",
                                       "--json").stdout)
    assert out["per_gpu_peak_bytes"] < fsdp4["per_gpu_peak_bytes"]  # half of each layer, over as many shards


def test_estimate_memory_models_hsdp_x_tp_from_the_hsdp_launch_and_tp(tmp_path):
    """hsdp_multinode.yaml (2 nodes x 8) with --tp 2: 2 replicas x 4 shards x 2 TP, the memory of FSDP x TP over a
    node (fsdp_tp.yaml), and across nodes only the replicas' all-reduce of each GPU's shard of its slice's fp32
    gradients."""
    import json

    out = json.loads(estimate_memory("recipes/llama7b.yaml", "--accelerate-config",
                                     "accelerate_configs/hsdp_multinode.yaml", "--tp", "2", "--json").stdout)
    assert (out["spec"]["strategy"], out["spec"]["tp"], out["spec"]["world_size"]) == ("hsdp", 2, 16)
    node = json.loads(estimate_memory("recipes/llama7b.yaml", "--accelerate-config",
                                      "accelerate_configs/fsdp_tp.yaml", "--json").stdout)
    assert out["per_gpu_peak_bytes"] == node["per_gpu_peak_bytes"]
    across = [p for p in out["communication"]["parts"] if p["inter_node_bytes"]]
    assert [p["what"] for p in across] == ["all-reduce of the gradient shard across the replicas"]
    accum = load_recipe("recipes/llama7b.yaml").train.grad_accum_steps  # the reduce-scatter runs each micro-batch
    slice_params = node["communication"]["parts"][1]["intra_node_bytes"] / accum / (3 / 4) / 4
    assert across[0]["inter_node_bytes"] == pytest.approx(slice_params * 4 / 4, rel=1e-9)  # 2 x 1/2 x W / 4 shards


@pytest.mark.parametrize("spec, says", [
    (dict(strategy="ddp", num_gpus=8, tp=2), "use strategy fsdp or hsdp, no --quantize"),
    (dict(strategy="fsdp", num_gpus=8, tp=2, method="lora", quantize="nf4"),
     "use strategy fsdp or hsdp, no --quantize"),
    (dict(strategy="fsdp", num_gpus=8, tp=3), "tp 3 must divide the GPUs of a node (8)"),
    (dict(strategy="fsdp", num_gpus=2, tp=2), "leave at least 2 FSDP shards"),
])
def test_tensor_parallel_layouts_llmtrain_does_not_train_are_not_estimated(spec, says):
    from llmtrain.errors import LLMTrainError

    with pytest.raises(LLMTrainError, match=re.escape(says)):
        TrainSpec(**spec).validate()


def test_lora_under_tensor_parallelism_counts_each_gpus_adapters():
    """LoRA r 16 under FSDP x TP 2 on Llama-2-7B (tensor.ADAPTER_SPLIT): a column-wise layer's A is whole and its B
    half (r x (in + out/2)), a row-wise layer's A half and its B whole (r x (in/2 + out)); 32 layers of that, before
    FSDP shards them over the 4 data-parallel ranks. The header's count stays the model's (the whole adapters)."""
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.params import load_model_shape, run_lora_plan, tensor_parallel_shape

    shape = load_model_shape("llama-2-7b")
    h, i, r = 4096, 11008, 16
    layer = 3 * r * (h + h // 2) + 2 * r * (h + i // 2) + r * (h // 2 + h) + r * (i // 2 + h)
    spec = TrainSpec(method="lora", lora_r=r, dtype="bfloat16", mixed_precision="bf16", strategy="fsdp", num_gpus=8,
                     tp=2, micro_batch=1, seq_len=1024)
    assert run_lora_plan(tensor_parallel_shape(shape, 2), spec).trainable(shape) == 32 * layer  # what a GPU holds
    # the model's: q, k, v, o r x (h + h) each, gate, up and down r x (h + i): 39,976,960 (it had been a GPU's)
    assert estimate(shape, spec).params_trainable == 32 * r * (4 * 2 * h + 3 * (h + i)) == 39_976_960
