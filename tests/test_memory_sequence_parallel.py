"""estimate-memory with sequence parallelism (parallel.sequence_parallel N, Ulysses): a GPU of a sequence group holds
the estimate at T/N tokens plus one layer's all-to-all buffers; the all-to-alls' bytes and time by hand on a small
shape; the refusals; Llama-3.1-8B (Q)LoRA on 8 x 80 GB past 1M tokens in one sequence; doctor's row."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import REPO
from helpers import estimate_memory, write_recipe

from llmtrain.config import load_recipe
from llmtrain.doctor import check_batch, check_layout, check_sequence_parallel, run_doctor
from llmtrain.errors import LLMTrainError
from llmtrain.memory import activations as act
from llmtrain.memory.comms import Network, sequence_traffic, step_traffic
from llmtrain.memory.estimate import estimate, make_pass
from llmtrain.memory.params import _shape_from_json, load_model_shape
from llmtrain.memory.spec import GIB, TrainSpec, spec_from_recipe

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"  # 32 query heads, 8 K/V heads of 128, 32 layers
LONG = REPO / "recipes" / "llama3-8b-qlora-long.yaml"
MILLION = 1 << 20
# a small Llama: hidden 64 = 4 query heads of 16, 2 K/V heads, 2 layers
SMALL = json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128})


def long_context(**kw) -> TrainSpec:
    """Llama-3.1-8B LoRA (bf16 base, or nf4 with quantize) with the long-context switches, DDP on 8 GPUs."""
    return TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", lora_dropout=0.0,
                     gradient_checkpointing=True,
                     activation_offload=True, tiled_mlp=True, strategy="ddp", num_gpus=8, **kw)


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_a_gpu_of_a_sequence_group_holds_the_estimate_at_t_over_n_tokens(quantize):
    """N = 8 GPUs sharing 256K tokens: each GPU's pass is the 32K-token pass of N = 1 on the same 8 GPUs; the model's
    state is the same; what the micro-batch makes (activations, the loss's logits) is the same at 32K tokens, plus one
    layer's all-to-all buffers (q, k, v and the output, [T/N x all heads] in bf16) as temporaries, and where the o_proj
    adapter shares its input (QLoRA) the output's all-to-all back, which it saves, a tensor apart from the kernel's.
    At 32K tokens a GPU both peak in a loss chunk's backward, the same bytes."""
    shape, T, n = load_model_shape(LLAMA), 262144, 8
    sp = estimate(shape, long_context(quantize=quantize, micro_batch_tokens=T, seq_len=T, sequence_parallel=n))
    one = estimate(shape, long_context(quantize=quantize, micro_batch_tokens=T // n, seq_len=T // n))
    p = make_pass(shape, sp.spec)
    assert p == replace(make_pass(shape, one.spec), sequence_parallel=n) and p.tokens == T // n
    a2a = act.all_to_all_temp(p, shape)
    assert a2a == 32768 * (32 + 8 + 8 + 32) * 128 * 2  # 8 K/V heads split 1 a GPU: nothing repeated
    o_input = T // n * 4096 * 2 if quantize else 0
    for phase, parts in sp.phase_parts.items():
        other = one.phase_parts[phase]
        if phase == "forward":  # the last layer's forward, with its all-to-alls
            assert parts == {**other, "temporaries": other["temporaries"] + a2a}
        elif phase == "backward_layers":  # the worst moment of some layer's backward, with its all-to-alls
            # o_proj's all-to-all input (QLoRA) is saved until attention's backward, the worst moment here once the
            # norms are tiled with the MLP (its o_proj freed first: 0), and all moments before it (o_input)
            assert parts["activations"] - other["activations"] in (0, o_input)
            # the all-to-all buffers live in attention's part of the backward; where the worst moment is another
            # (the MLP's, LoRA on a bf16 base here), they add nothing
            assert 0 <= sum(parts.values()) - sum(other.values()) <= a2a + o_input
        else:  # the loss's chunks, the embedding's backward, the optimizer step (weights, gradients, AdamW, buckets)
            assert parts == other, phase
    assert sp.peak_phase == one.peak_phase == "backward_loss" and sp.per_gpu_peak_bytes == one.per_gpu_peak_bytes
    assert sp.long_context["offload_host_bytes"] == one.long_context["offload_host_bytes"] == 31 * 32768 * 4096 * 2


def test_the_all_to_all_bytes_by_hand_on_a_small_shape():
    """4 query heads of 16 and 2 K/V heads, 2 layers, bf16, 64 tokens a micro-batch, 2 micro-batches, checkpointing.
    N = 4 (a multiple of the 2 K/V heads: each repeated twice): a GPU holds 16 tokens; a layer's forward all-to-alls
    carry q, k, v, out of 16 x 4 x 16 each, 2 bytes: 8,192 bytes; 3 rounds (forward, backward, recompute) x 2 layers x
    2 micro-batches = 98,304 bytes, of which a GPU sends 3/4: 73,728. The buffers in flight add the K and V they were
    repeated from: 2 x 16 x 2 x 16 x 2 = 2,048."""
    shape = _shape_from_json(SMALL, "small")
    spec = TrainSpec(mixed_precision="bf16", dtype="bfloat16", micro_batch_tokens=64, seq_len=64, grad_accum_steps=2,
                     gradient_checkpointing=True, strategy="fsdp", num_gpus=4, sequence_parallel=4)
    p = make_pass(shape, spec)
    assert (p.tokens, act.all_to_all_bytes(p, shape), act.all_to_all_temp(p, shape)) == (16, 8192, 8192 + 2048)
    sq = sequence_traffic(shape, spec)
    assert (sq.per_layer, sq.passes, sq.payload, sq.intra, sq.inter) == (8192, 3, 98304, 73728, 0)
    net = Network()
    traffic = step_traffic(shape, spec, net)
    assert traffic.sequence == sq and ("all-to-all" in traffic.parts[-1][0]) and traffic.parts[-1][1:] == (73728, 0)
    assert sq.times(net) == {"seconds": 73728 * 8 / 3600e9, "nvlink_s": 73728 * 8 / 3600e9,
                             "infiniband_s": 73728 * 8 / 400e9}
    out = traffic.to_dict()["sequence_parallel"]
    assert (out["link"], out["sent_bytes"], out["nvlink_s"], out["infiniband_s"]) == \
        ("nvlink", 73728, 73728 * 8 / 3600e9, 73728 * 8 / 400e9)
    # N = 2 divides the 2 K/V heads (1 a GPU): 32 tokens x (64 + 16 + 16 + 64) x 2 = 12,288 a layer, nothing
    # repeated; without checkpointing 2 rounds x 2 layers x 1 micro-batch, half of it sent
    two = spec.but(sequence_parallel=2, grad_accum_steps=1, gradient_checkpointing=False)
    p2 = make_pass(shape, two)
    assert act.all_to_all_bytes(p2, shape) == act.all_to_all_temp(p2, shape) == 12288
    assert (sequence_traffic(shape, two).payload, sequence_traffic(shape, two).sent) == (49152, 24576)
    # a group of 4 over 2 nodes of 2: of its 3/4 sent, 2/4 goes to the other node (over InfiniBand), 1/4 within
    spans = sequence_traffic(shape, spec.but(num_gpus=2, num_nodes=2))
    assert (spans.intra, spans.inter, spans.spans_nodes) == (24576, 49152, True)
    assert spans.times(net)["seconds"] == 24576 * 8 / 3600e9 + 49152 * 8 / 400e9
    assert sequence_traffic(shape, spec.but(sequence_parallel=1)) is None


def test_the_step_compute_of_a_gpu_is_1_over_n_of_its_groups():
    shape = load_model_shape(LLAMA)
    spec = long_context(micro_batch_tokens=MILLION, seq_len=MILLION)
    alone = step_traffic(shape, spec.but(strategy="single", num_gpus=1))
    assert step_traffic(shape, spec.but(sequence_parallel=8)).compute_s == pytest.approx(alone.compute_s / 8)


@pytest.mark.parametrize(("spec", "message"), [
    ({"num_gpus": 6, "sequence_parallel": 4}, "must divide the GPUs: 6 (6 a node x 1) do not split into groups of 4"),
    ({"num_gpus": 6, "sequence_parallel": 3}, "the model's 32 attention heads do not split into 3 equal groups"),
    ({"num_gpus": 8, "sequence_parallel": 2, "attn_implementation": "sdpa"}, "varlen attention"),
    ({"num_gpus": 8, "sequence_parallel": 2, "strategy": "fsdp", "method": "full", "tp": 2}, "tensor parallelism"),
])
def test_the_refusals(spec, message):
    shape = load_model_shape(LLAMA)
    with pytest.raises(LLMTrainError, match="cannot estimate this run: .*" + message.replace("(", r"\(").replace(
            ")", r"\)")):
        estimate(shape, long_context(micro_batch_tokens=8192, seq_len=8192).but(tiled_mlp=None, **spec))


def test_k_v_heads_and_n_that_do_not_divide_one_another_are_refused_naming_the_heads():
    """12 query heads and 4 K/V heads: N = 6 divides the query heads, but neither 4 / 6 nor 6 / 4 is whole; N = 2
    splits the K/V heads, N = 12 repeats each 3 times."""
    shape = _shape_from_json(json.dumps({**json.loads(SMALL), "hidden_size": 96, "num_attention_heads": 12,
                                         "num_key_value_heads": 4}), "twelve")
    spec = TrainSpec(micro_batch_tokens=96, seq_len=96, strategy="ddp", num_gpus=12)
    with pytest.raises(LLMTrainError, match=r"parallel.sequence_parallel=6: the model's 4 key/value heads neither "
                                            r"split into 6 groups nor divide 6"):
        estimate(shape, spec.but(sequence_parallel=6))
    assert estimate(shape, spec.but(sequence_parallel=2)) and estimate(shape, spec.but(sequence_parallel=12))
    out = estimate_memory("--model", "llama-3-8b", "--strategy", "ddp", "--num-gpus", "6", "--sequence-parallel", "3",
                          check=False)
    assert out.returncode == 2 and "the model's 32 attention heads do not split into 3" in out.stdout + out.stderr


def test_the_recipe_key_sets_it_and_the_data_ranks_are_the_gpus_over_n():
    recipe = load_recipe(LONG, ["parallel.sequence_parallel=4"])
    spec = spec_from_recipe(recipe, strategy="ddp", num_gpus=8, num_nodes=2)
    assert (spec.sequence_parallel, spec.data_ranks, spec.gpu_tokens) == (4, 4, 131072 // 4)


@pytest.mark.parametrize("quantize", ["nf4", "null"])
def test_llama_3_1_8b_lora_and_qlora_on_8_x_80gb_train_1m_tokens_in_one_sequence(quantize):
    """recipes/llama3-8b-qlora-long.yaml (QLoRA, or LoRA on a bf16 base) with checkpointing, activation offload and the
    tiled MLP, DDP over 8 GPUs in one sequence group of 8: --longest-context reaches past 1,048,576 tokens, where
    without sequence parallelism the same 8 GPUs stop near 630K (QLoRA) and 410K (LoRA): each trains its own sequence. At 1M each GPU holds
    131,072 tokens; its all-to-alls send about 226 GB a step (one micro-batch), half a second of NVLink beside minutes
    of compute (attention over 1M tokens)."""
    args = (str(LONG), f"model.quantize={quantize}", "train.grad_accum_steps=1", "--strategy", "ddp", "--num-gpus",
            "8", "--json")
    got = json.loads(estimate_memory(*args, "parallel.sequence_parallel=8", "--longest-context").stdout)
    assert got["longest_context_tokens"] >= MILLION and got["spec"]["sequence_parallel"] == 8
    alone = json.loads(estimate_memory(*args, "--longest-context").stdout)["longest_context_tokens"]
    assert alone < MILLION * 2 // 3
    at = json.loads(estimate_memory(*args, "parallel.sequence_parallel=8", f"train.micro_batch_tokens={MILLION}",
                                    f"data.max_seq_len={MILLION}").stdout)
    assert at["per_gpu_peak_bytes"] <= 0.9 * 80 * GIB and at["long_context"]["offload_host_bytes"] == 31 * GIB
    sq, compute = at["communication"]["sequence_parallel"], at["communication"]["compute_s"]
    # 131072 tokens x (32 + 8 + 8 + 32) heads x 128 x 2 bytes a layer per round, 3 rounds x 32 layers, 7/8 sent
    assert sq["per_layer_forward_bytes"] == 131072 * 80 * 128 * 2
    assert sq["sent_bytes"] == 7 * 3 * 32 * 131072 * 80 * 128 * 2 // 8 and sq["link"] == "nvlink"
    assert sq["nvlink_s"] < 1 < sq["infiniband_s"] < 10 and compute > 100
    # without the group, 1M tokens a GPU does not fit, and the advice names the group (its search skips the layouts
    # the run cannot take, such as checkpointing off under the activation offload, instead of failing on them)
    out = estimate_memory(*args, f"train.micro_batch_tokens={MILLION}", f"data.max_seq_len={MILLION}", check=False)
    assert out.returncode == 4 and "a larger sequence group (parallel.sequence_parallel" in \
        json.loads(out.stdout)["recommendation"]


def test_the_text_says_the_link_and_both_times():
    out = estimate_memory("--model", "llama-3-8b", "--method", "lora", "--mixed-precision", "bf16",
                          "--grad-checkpointing", "--strategy", "ddp", "--num-gpus", "4", "--num-nodes", "2",
                          "--sequence-parallel", "8", "--micro-batch-tokens", "65536", "--seq-len", "65536").stdout
    text = " ".join(out.split())
    assert "split over sequence groups of 8 GPUs (8,192 tokens a GPU; 1 data-parallel rank)" in text
    assert "the group of 8 spans nodes of 4 GPUs" in text and "over InfiniBand" in text
    within = " ".join(estimate_memory("--model", "llama-3-8b", "--method", "lora", "--strategy", "ddp", "--num-gpus",
                                      "8", "--sequence-parallel", "8", "--micro-batch-tokens", "65536", "--seq-len",
                                      "65536").stdout.split())
    assert "the group of 8 is within a node, over NVLink" in within and "were it over InfiniBand" in within


def test_doctor_checks_the_heads_and_the_processes_against_n():
    recipe = load_recipe(LONG, ["parallel.sequence_parallel=8"])
    (name, status, detail), = check_sequence_parallel(recipe, {"num_processes": 16})
    assert (name, status) == ("sequence parallelism", "pass")
    assert "16 processes = 2 groups of 8" in detail and "4 of the 32 query heads and 1 K/V head(s)" in detail
    (name, status, detail), = check_layout(recipe, {"num_processes": 12})
    assert status == "fail" and "splits each sequence over 8 processes, but the launch has 12" in detail
    assert check_sequence_parallel(recipe, {"num_processes": 12}) == []  # the layout row says it
    assert check_batch(recipe, {"num_processes": 16})[0][2].startswith("2 data-parallel ranks x 131072 tokens")
    (name, status, detail), = check_layout(load_recipe(LONG, ["parallel.sequence_parallel=3"]), {"num_processes": 6})
    assert status == "fail" and "the model's 32 attention heads do not split into 3 equal groups" in detail
    sixteen = check_sequence_parallel(load_recipe(LONG, ["parallel.sequence_parallel=16"]), {"num_processes": 16})
    assert sixteen[0][1] == "pass" and "each of 8 repeated 2 times" in sixteen[0][2]
    assert check_sequence_parallel(load_recipe(LONG), {"num_processes": 8}) == []


def test_a_teacher_whose_heads_the_group_cannot_split_fails_doctors_row_and_the_run_before_it_writes(tiny_assets,
                                                                                                    tmp_path):
    """Distillation under sequence parallelism: the teacher attends through the group's all-to-all as the student
    does, so its heads must split too. A teacher of 3 heads under N = 2: doctor's row fails naming it, and the run
    refuses it as the teacher is built (before the run folder is claimed), naming it too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.loop.phases import _teacher_attention

    config = AutoConfig.from_pretrained(tiny_assets / "model", num_attention_heads=3, num_key_value_heads=3,
                                        head_dim=32, hidden_size=96)
    teacher = tmp_path / "teacher"
    AutoModelForCausalLM.from_config(config).save_pretrained(teacher)
    for f in (tiny_assets / "model").glob("*token*"):
        (teacher / f.name).write_bytes(f.read_bytes())
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, parallel={"sequence_parallel": 2},
                                      model={"attn_implementation": "auto"},
                                      distill={"teacher": str(teacher), "max_completion_tokens": 8}))
    (name, status, detail), = check_sequence_parallel(recipe, {"num_processes": 2})
    assert status == "fail" and f"the teacher {teacher}" in detail and "its 3 attention heads" in detail
    assert check_sequence_parallel(recipe.model_copy(update={"distill": None}), {"num_processes": 2})[0][1] == "pass"
    with pytest.raises(LLMTrainError, match=f"the teacher {teacher}: .*its 3 attention heads do not split into 2"):
        _teacher_attention(recipe, AutoModelForCausalLM.from_pretrained(teacher), trainable=None)


def test_doctor_runs_the_row_and_counts_the_groups_as_data_ranks(tiny_assets, tmp_path):
    """The tiny model (4 query heads, 2 K/V heads) with parallel.sequence_parallel=2 on ddp.yaml's 8 processes: 4
    groups, so 4 data-parallel ranks read the batches; 3 processes fail the row."""
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, parallel={"sequence_parallel": 2},
                                      model={"attn_implementation": "auto"}))
    got = {name: (status, detail) for name, status, detail in
           run_doctor(recipe, accelerate_config=REPO / "accelerate_configs" / "ddp.yaml", gpu_memory=80)}
    assert got["sequence parallelism"][0] == "pass" and "8 processes = 4 groups of 2" in got["sequence parallelism"][1]
    assert got["global batch"][1].startswith("4 data-parallel ranks x 4 examples")
    assert got["memory"][0] == "pass"
    assert check_layout(recipe, {"num_processes": 3})[0][1] == "fail"
