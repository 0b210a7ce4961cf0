"""estimate-memory: exact parameter counts, each formula against a hand-worked number, the phase
model, the fit search, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import estimate_memory, invoke

from llmtrain.errors import LLMTrainError
from llmtrain.memory import activations as act
from llmtrain.memory import estimate as estimate_module
from llmtrain.memory import estimate_for_recipe, estimate_run
from llmtrain.memory.estimate import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES, NCCL_BYTES, estimate, optimizer_bytes
from llmtrain.memory.fit import FIT_SHARE, MAX_MICRO_BATCH, fit, throughput_score
from llmtrain.memory.launch import SHIPPED, read_accelerate_config, shipped_config
from llmtrain.memory.params import load_model_shape, lora_plan
from llmtrain.memory.spec import GIB, TrainSpec

REPO = Path(__file__).resolve().parents[1]
MISTRAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "models" / "mistral-7b-instruct-v0.3"
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            num_hidden_layers=2)


def tiny_dir(tmp_path: Path, kind: str = "llama", **changes) -> Path:
    """A config.json written by transformers itself, for a 2-layer model with GQA (4 heads, 2 KV heads)."""
    from transformers import LlamaConfig, MistralConfig

    cls = {"llama": LlamaConfig, "mistral": MistralConfig}[kind]
    out = tmp_path / f"{kind}-{'-'.join(f'{k}{v}' for k, v in changes.items())}"
    cls(**{**TINY, **changes}).save_pretrained(out)
    return out


def real_model(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


# --------------------------------------------------------------------------- parameter counts


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("llama", True), ("mistral", False), ("mistral", True)])
def test_param_count_equals_the_instantiated_model(tmp_path, kind, tied):
    path = tiny_dir(tmp_path, kind, tie_word_embeddings=tied)
    shape = load_model_shape(str(path))
    model = real_model(path)
    assert shape.params_total == sum(p.numel() for p in model.parameters())
    # By hand: embeddings 128*64 = 8192; a layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288,
    # gate/up/down 3*64*160 = 30720, two norms 128 -> 43136; final norm 64; untied head 8192.
    assert shape.params_per_layer == 43136
    assert shape.params_total == 8192 + 2 * 43136 + 64 + (0 if tied else 8192)
    assert (shape.kv_heads, shape.head_dim, shape.tied) == (2, 16, tied)


@pytest.mark.parametrize(("targets", "saved"),
                         [("all-linear", ()), (("q_proj", "v_proj"), ()), ("all-linear", ("lm_head",))])
def test_lora_counts_equal_peft(tmp_path, targets, saved):
    import peft

    path = tiny_dir(tmp_path)
    shape = load_model_shape(str(path))
    plan = lora_plan(shape, r=4, targets=targets, modules_to_save=saved)
    model = peft.get_peft_model(real_model(path), peft.LoraConfig(
        r=4, target_modules=list(targets) if isinstance(targets, tuple) else targets,
        modules_to_save=list(saved) or None, task_type="CAUSAL_LM"))
    assert plan.trainable(shape) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    est = estimate(shape, TrainSpec(method="lora", lora_r=4, lora_target_modules=targets, lora_modules_to_save=saved))
    assert est.params_total == sum(p.numel() for p in model.parameters())
    if targets == "all-linear" and not saved:
        # r*(in+out): q 4*(64+64) + k 4*(64+32) + v 4*(64+32) + o 4*(64+64) + 3 * 4*(64+160) = 4480 a layer
        assert plan.trainable(shape) == 2 * 4480


def test_lora_targets_that_match_nothing_are_an_error(tmp_path):
    shape = load_model_shape(str(tiny_dir(tmp_path)))
    with pytest.raises(LLMTrainError, match="matches no linear layer"):
        lora_plan(shape, r=4, targets=("query_key_value",))


@pytest.mark.skipif(not MISTRAL_DIR.exists(), reason=f"{MISTRAL_DIR} is not available")
def test_real_mistral_config_count():
    shape = load_model_shape(str(MISTRAL_DIR))
    assert shape.params_total == 7_248_023_552
    assert load_model_shape("mistral-7b").params_total == shape.params_total  # the preset is the same model


def test_presets_give_the_published_counts():
    assert load_model_shape("llama-2-7b").params_total == 6_738_415_616
    assert load_model_shape("llama-3-8b").params_total == 8_030_261_248
    assert load_model_shape("mistral-7b").params_total == 7_248_023_552
    # GPT-OSS: 20.9 B and 116.8 B, of which 3.6 B and 5.1 B active a token besides the embeddings (OpenAI's model card)
    for name, total, active in [("openai/gpt-oss-20b", 20_914_757_184, 3.61e9),
                                ("openai/gpt-oss-120b", 116_829_156_672, 5.13e9)]:
        oss = load_model_shape(name)
        assert oss.params_total == total and abs(oss.layers * oss.active_params_per_layer + oss.params_head
                                                 - active) < 0.01e9
    # LoRA r=16 on every linear of Mistral-7B: per layer 16*(4096+4096)*2 (q, o) + 16*(4096+1024)*2 (k, v)
    # + 16*(4096+14336)*3 (gate, up, down) = 1,310,720; 32 layers.
    shape = load_model_shape("mistral-7b")
    assert lora_plan(shape, r=16).trainable(shape) == 32 * 1_310_720 == 41_943_040


def test_mixtures_of_experts_count_their_experts_and_the_adapters_peft_gives_them():
    """Qwen3-30B-A3B and Mixtral 8x7B: the published totals; 3 of 128 experts' 768 columns x 2048 (and 2 of 8 x 14336 x
    4096) a token, the router beside them; peft's LoRA at r=16 on all-linear: attention's adapters, the router's
    (16 x (2048 + 128)) and every expert's, gate_up_proj at twice the rank (2 x 16 x (2048 + 1536) each) and
    down_proj (16 x (768 + 2048) each)."""
    qwen, mixtral = load_model_shape("Qwen/Qwen3-30B-A3B"), load_model_shape("mixtral-8x7b")
    assert qwen.params_total == 30_532_122_624 and mixtral.params_total == 46_702_792_704
    assert (qwen.experts.count, qwen.experts.top_k, qwen.experts.intermediate) == (128, 8, 768)
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048
    assert qwen.active_params_per_layer == attention + 128 * 2048 + 8 * 3 * 768 * 2048
    plan = lora_plan(qwen, r=16)
    assert plan.moe_params == {"mlp.gate": 16 * (2048 + 128), "mlp.experts.gate_up_proj": 128 * 32 * (2048 + 1536),
                               "mlp.experts.down_proj": 128 * 16 * (768 + 2048)}
    attention_adapters = 16 * ((2048 + 4096) * 2 + (2048 + 512) * 2)
    assert plan.trainable(qwen) == 48 * (attention_adapters + sum(plan.moe_params.values())) == 996_507_648
    assert lora_plan(qwen, r=16, targets=("q_proj", "k_proj", "v_proj", "o_proj")).moe_params == {}


def test_a_mixture_of_experts_estimate_refuses_what_its_training_refuses():
    """LoRA dropout (peft adapts the experts as parameters, which take none) and the tiled MLP are refused by the
    estimate as by the recipe, naming the fix; without dropout, LoRA on Qwen3-30B-A3B is estimated and says what the
    experts' adapters save, run unmerged: at 512 tokens, 4,096 pairs x (32 + 16) ranks (gate_up_proj at twice r), the
    B^T copies (128 experts x (32 x 1536 + 16 x 2048)) and A's casts to the bf16 base (128 x (2048 x 32 + 768 x 16)),
    2 bytes each: 39.4 MiB a layer, where peft's merge held 1.12 GiB."""
    shape = load_model_shape("qwen3-30b-a3b")
    with pytest.raises(LLMTrainError, match=r"lora.dropout=0.05 \(--lora-dropout\): qwen3_moe's MLP is a mixture of "
                       r"128 experts, whose weights peft adapts as parameters .*: set it to 0"):
        estimate(shape, TrainSpec(method="lora", lora_dropout=0.05))
    with pytest.raises(LLMTrainError, match=r"model.tiled_mlp \(--tiled-mlp\) tiles a dense MLP"):
        estimate(shape, TrainSpec(tiled_mlp=True, gradient_checkpointing=True))
    est = estimate(shape, TrainSpec(method="lora", lora_dropout=0.0, dtype="bfloat16", seq_len=512))
    note = next(n for n in est.notes if n.startswith("a mixture of 128 experts"))
    saved = 2 * (4096 * 48 + 128 * (32 * 1536 + 16 * 2048) + 128 * 2048 * 32 + 128 * 768 * 16)
    assert f"unmerged ({saved / 2**20:.1f} MiB a layer saved for backward)" in " ".join(note.split())
    assert f"{saved / 2**20:.1f}" == "39.4"
    # --model without --lora-dropout: the 0 a recipe for it must set, said (a new user's first try was refused)
    said = " ".join(estimate_memory("--model", "qwen3-30b-a3b", "--method", "lora").stdout.split())
    assert "note: LoRA dropout 0, as a recipe for a mixture of experts must set it" in said
    given = estimate_memory("--model", "qwen3-30b-a3b", "--method", "lora", "--lora-dropout", "0.05", check=False)
    assert given.returncode == 2 and "lora.dropout=0.05 (--lora-dropout)" in given.stderr  # asked for: refused


# --------------------------------------------------------------------------- formulas, by hand


@pytest.fixture(scope="module")
def tiny_shape(tmp_path_factory):
    return load_model_shape(str(tiny_dir(tmp_path_factory.mktemp("tiny"))))


def bf16_pass(**kw) -> act.Pass:
    # b=2 rows of s=8 -> T=16 tokens; fp32 stream, bf16 compute
    return act.Pass(**{**dict(rows=2, row_len=8, resid=4, cd=2, autocast=True, attn="sdpa", mask=False,
                              trainable_base=True, separate_casts=True), **kw})


def test_norm_attention_mlp_lora_by_hand(tiny_shape):
    p = bf16_pass()
    assert act.norm_bytes(p, 64, trainable=True) == 16 * 64 * (4 + 4) + 16 * 4 == 8256
    assert act.norm_bytes(p, 64, trainable=False) == 16 * 64 * 4 + 16 * 4 == 4160
    # sdpa, no mask: q 16*64*2 + k,v 2*16*32*2 (GQA kept) + out 16*64*2 + logsumexp 2*4*8*4 = 6400
    assert act.attention_bytes(p, tiny_shape, o_trainable=True) == 2048 + 2048 + 2048 + 256 == 6400
    # with a mask: K/V repeated to 4 heads (+2048) and a 2*8*8 bf16 bias (+256)
    assert act.attention_bytes(bf16_pass(mask=True), tiny_shape, o_trainable=True) == 6400 + 2048 + 256
    # eager: q,k,v at 4 heads 3*2048, probs 2*4*8*8=512 scores at 4+2 bytes, o_proj's input copy 2048
    assert act.attention_bytes(bf16_pass(attn="eager"), tiny_shape, o_trainable=True) == 6144 + 3072 + 2048
    assert act.mlp_bytes(p, tiny_shape, down_trainable=True) == 16 * 160 * 2 * 4 == 20480
    # separate casts: q,k,v each keep a bf16 copy of their fp32 input; shared without autocast
    assert act.linear_input_bytes(p, 64, 3) == 3 * 16 * 64 * 2
    assert act.linear_input_bytes(bf16_pass(separate_casts=False), 64, 3) == 16 * 64 * 2
    # LoRA on a 64-wide input, r=4, dropout: bool mask 16*64 + A's bf16 input 16*64*2 + A's output 16*4*2
    assert act.lora_bytes(bf16_pass(lora_dropout=0.05), 64, 4) == 1024 + 2048 + 128 == 3200
    assert act.checkpoint_bytes(p, tiny_shape) == 16 * 64 * 4


def test_optimizer_state_by_hand():
    assert optimizer_bytes(4000) == 8000  # AdamW: two moments in the parameters' dtype (fp32 here)


# --------------------------------------------------------------------------- the whole estimate


@pytest.fixture(scope="module")
def mistral():
    return load_model_shape("mistral-7b")


def test_full_finetune_states(mistral):
    P = 7_248_023_552
    est = estimate(mistral, TrainSpec(mixed_precision="bf16", micro_batch=1, seq_len=512))
    assert est.breakdown["weights"] == 4 * P and est.breakdown["optimizer"] == 8 * P  # fp32 master + AdamW
    assert est.phases["optimizer_step"] == 16 * P  # weights + moments + all gradients
    # bf16 autocast copies of every linear (all but embeddings and norms): held by the autocast cache
    # until the forward returns, which is after the loss (it runs inside the forward); in the loss's
    # backward the LM head's cast is made again by each chunk's recompute, and nothing else of the cache
    # is left under checkpointing.
    ckpt = estimate(mistral, TrainSpec(mixed_precision="bf16", seq_len=512, gradient_checkpointing=True)).phase_parts
    head = 32768 * 4096
    assert ckpt["loss"]["autocast_copies"] == 2 * (32 * mistral.linear_params_per_layer + head)
    assert ckpt["backward_loss"]["autocast_copies"] == 2 * head
    assert est.phase_parts["loss"]["autocast_copies"] == 2 * (32 * mistral.linear_params_per_layer + head)
    assert est.phase_parts["backward_loss"]["autocast_copies"] == 2 * (32 * mistral.linear_params_per_layer + head)
    ddp = estimate(mistral, TrainSpec(mixed_precision="bf16", strategy="ddp", num_gpus=8))
    assert ddp.breakdown["ddp_buckets"] == 4 * P  # a second copy of every gradient
    fsdp = estimate(mistral, TrainSpec(dtype="bfloat16", mixed_precision="bf16", strategy="fsdp", num_gpus=8))
    assert fsdp.breakdown["weights"] == 4 * P // 8  # upcast to fp32 master shards
    assert fsdp.breakdown.get("autocast_copies", 0) == 0  # gathered in bf16 by the FSDP policy


def test_lora_states(mistral):
    P, A = 7_248_023_552, 41_943_040
    est = estimate(mistral, TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16"))
    assert est.params_trainable == A and est.params_total == P + A
    assert est.breakdown["weights"] == 2 * P + 4 * A  # frozen bf16 base, fp32 adapters
    assert est.breakdown["optimizer"] == 8 * A
    assert est.phases["optimizer_step"] == 2 * P + 4 * A + 8 * A + 4 * A


def test_peak_is_the_largest_phase_and_breakdown_adds_up(mistral):
    spec = TrainSpec(mixed_precision="bf16", strategy="ddp", num_gpus=4, micro_batch=2, seq_len=1024,
                     eval_micro_batch=4, grad_accum_steps=2)
    est = estimate(mistral, spec)
    assert est.per_gpu_peak_allocated_bytes == max(est.phases.values())
    assert sum(est.breakdown.values()) == est.per_gpu_peak_bytes
    slack = int(est.per_gpu_peak_allocated_bytes * ALLOCATOR_SLACK)
    assert est.breakdown["overhead"] == slack + CUDA_CONTEXT_BYTES + NCCL_BYTES
    assert {"weights", "gradients", "optimizer", "activations", "logits", "overhead"} <= set(est.breakdown)


def test_levers_move_memory_the_right_way(mistral, monkeypatch):
    monkeypatch.setattr(estimate_module, "varlen_repeats_kv", lambda: False)  # torch >= 2.11: K/V not repeated
    base = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", micro_batch=4, seq_len=2048,
                     attn_implementation="sdpa")

    def peak(spec: TrainSpec) -> int:
        return estimate(mistral, spec).per_gpu_peak_allocated_bytes

    assert peak(base.but(gradient_checkpointing=True)) < peak(base)
    assert peak(base.but(attn_implementation="eager")) > peak(base)
    assert peak(base.but(micro_batch=8)) > peak(base)
    assert peak(base.but(attn_implementation="flash_attention_2")) < peak(base)
    assert peak(base.but(attn_implementation="varlen")) == peak(base.but(attn_implementation="flash_attention_2"))
    assert peak(base.but(attn_implementation="varlen")) == peak(base.but(attn_implementation="auto"))
    assert peak(base.but(loss_chunk_tokens=1024)) < peak(base)
    packed = estimate(mistral, base.but(packing=True))
    assert packed.per_gpu_peak_allocated_bytes > peak(base)  # an 8192 x 8192 mask and bias
    assert any("packed row of 8192 tokens" in n for n in packed.notes)


def test_host_ram(mistral):
    P = 7_248_023_552
    ddp = TrainSpec(method="lora", dtype="bfloat16", strategy="ddp", num_gpus=8)
    assert estimate(mistral, ddp).host_ram_bytes == 8 * 2 * P  # every process loads the bf16 model
    fsdp = TrainSpec(mixed_precision="bf16", strategy="fsdp", num_gpus=8, dtype="bfloat16")
    assert estimate(mistral, fsdp).host_ram_bytes == 4 * P  # rank 0 only, upcast to fp32
    assert estimate(mistral, ddp.but(random_init=True)).host_ram_bytes == 0


def test_invalid_specs_are_user_errors(mistral):
    for bad in (TrainSpec(strategy="single", num_gpus=2), TrainSpec(strategy="ddp"), TrainSpec(cpu_offload=True),
                TrainSpec(micro_batch=0)):
        with pytest.raises(LLMTrainError):
            estimate(mistral, bad)


def test_estimate_for_recipe(tmp_path):
    path = tiny_dir(tmp_path)
    recipe = _recipe(tmp_path, path, lora=True)
    from llmtrain.config import load_recipe

    est = estimate_for_recipe(load_recipe(recipe), num_processes=2, strategy="ddp")
    assert est.spec.method == "lora" and est.spec.world == 2 and est.spec.seq_len == 64
    assert est.per_gpu_peak_bytes > 0 and isinstance(est.breakdown, dict)
    assert "eval_loss" in est.phases  # the recipe evaluates
    # without train.eval_every_steps the run still evaluates at its end (loop/cadence.py): so does the estimate (its
    # eval phases had gone, and with a large eval batch the eval's forward is the run's peak); no eval data, none
    ended = estimate_for_recipe(load_recipe(recipe, ["train.eval_every_steps=null", "train.eval_batch_size=64"]))
    assert {"eval_forward", "eval_loss"} <= set(ended.phases) and ended.peak_phase == "eval_forward"
    assert "eval_loss" not in estimate_for_recipe(load_recipe(recipe, ["data.eval_split=null"])).phases
    # What train() passes for an FSDP launch with fsdp_offload_params: the offloaded state leaves the GPU.
    sharded = estimate_for_recipe(load_recipe(recipe), num_processes=2, strategy="fsdp")
    offloaded = estimate_for_recipe(load_recipe(recipe), num_processes=2, strategy="fsdp", cpu_offload=True)
    assert offloaded.spec.cpu_offload and offloaded.per_gpu_peak_bytes < sharded.per_gpu_peak_bytes


def _recipe(tmp_path: Path, model: Path, *, lora: bool) -> Path:
    data = {"model": {"name_or_path": str(model), "dtype": "bfloat16"},
            "data": {"path": "d.jsonl", "format": "text", "max_seq_len": 64, "eval_split": 0.1},
            "train": {"micro_batch_size": 2, "grad_accum_steps": 4, "mixed_precision": "bf16", "eval_every_steps": 5}}
    if lora:
        data["lora"] = {"r": 4}
    out = tmp_path / "r.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


# --------------------------------------------------------------------------- fit


SCENARIOS = [
    TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", seq_len=512, gpu_memory_gib=24),
    TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", seq_len=4096, gpu_memory_gib=24),
    TrainSpec(mixed_precision="bf16", seq_len=512, num_gpus=8, strategy="fsdp"),
    TrainSpec(mixed_precision="bf16", seq_len=2048, num_gpus=8, num_nodes=2, strategy="fsdp", gpu_memory_gib=40),
    TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", seq_len=1024, num_gpus=4, strategy="ddp",
              gpu_memory_gib=40),
    TrainSpec(mixed_precision="bf16", seq_len=512, num_gpus=1, cpu_offload=True, strategy="fsdp", gpu_memory_gib=40),
]


@pytest.mark.parametrize("spec", SCENARIOS)
@pytest.mark.parametrize("model", ["mistral-7b", "llama-2-7b"])
def test_fit_only_recommends_what_fits(model, spec):
    shape = load_model_shape(model)
    result = fit(shape, spec)
    assert result.best is not None
    room = FIT_SHARE * spec.gpu_memory_gib * GIB  # what --fit fills at most: the rest is for the estimate's error
    for c in result.candidates:
        assert c.estimate.fits and c.estimate.per_gpu_peak_bytes <= room
        again = estimate_run(shape, c.spec)  # its own estimate, recomputed, agrees
        assert again.per_gpu_peak_bytes == c.estimate.per_gpu_peak_bytes
        # and it is the largest micro-batch that fits in that room (a pipeline's: the fastest, test_memory_pipeline.py)
        if c.spec.micro_batch < MAX_MICRO_BATCH and c.spec.pipeline_parallel == 1:
            assert estimate(shape, c.spec.but(micro_batch=c.spec.micro_batch + 1)).per_gpu_peak_bytes > room
    if spec.num_nodes == 1:
        assert result.best.score == max(c.score for c in result.candidates)
    else:  # across nodes the mesh with the least network time per token, at its own best micro-batch
        from llmtrain.memory.fit import network_per_token, seconds_per_token

        meshes = [c for c in result.candidates if c.spec.pipeline_parallel == 1]
        best_of = {s: max((c for c in meshes if c.spec.strategy == s), key=lambda c: c.score)
                   for s in {c.spec.strategy for c in meshes}}
        mesh = min(best_of.values(), key=network_per_token)
        if result.best.spec.pipeline_parallel > 1:  # a pipeline only where the model's step time per token is less
            assert seconds_per_token(result.best) < seconds_per_token(mesh)
        else:
            assert network_per_token(result.best) == network_per_token(mesh)
            assert result.best.score == best_of[result.best.spec.strategy].score
    assert f"train.micro_batch_size={result.best.spec.micro_batch}" in result.overrides


def test_fit_finds_nothing_rather_than_something_too_big(mistral):
    result = fit(mistral, TrainSpec(mixed_precision="bf16", seq_len=512))  # full fine-tune on one 80 GiB GPU
    assert result.best is None and result.candidates == ()


def test_fit_keeps_the_global_batch(mistral):
    spec = TrainSpec(mixed_precision="bf16", seq_len=512, num_gpus=8, strategy="fsdp", gradient_checkpointing=True)
    result = fit(mistral, spec, global_batch=64)
    s = result.best.spec
    accum = int(result.overrides[-1].split("=")[1])
    assert s.micro_batch * accum * 8 == 64
    assert result.accelerate_config == "accelerate_configs/fsdp.yaml" and result.launch_flags == ()


def test_throughput_score_by_hand():
    s = TrainSpec(micro_batch=2, seq_len=128)  # 256 tokens: half-saturated; full fine-tune: 6 units
    assert throughput_score(s) == pytest.approx(1 * 0.5 * 1.0 / 6)
    assert throughput_score(s.but(gradient_checkpointing=True)) == pytest.approx(0.5 / 8)


def test_shipped_config_table_matches_the_files():
    for key, (path, procs, machines) in SHIPPED.items():
        cfg = yaml.safe_load((REPO / path).read_text())
        assert (cfg["num_processes"], cfg["num_machines"]) == (procs, machines), path
        layout = read_accelerate_config(REPO / path)
        assert layout.strategy == key.split("_")[0]
    assert shipped_config("fsdp", num_gpus=4, num_nodes=1) == ("accelerate_configs/fsdp.yaml", ("--num_processes", "4"))
    assert shipped_config("fsdp", num_gpus=8, num_nodes=2)[0] == "accelerate_configs/fsdp_multinode.yaml"
    with pytest.raises(LLMTrainError, match="use_cpu"):
        read_accelerate_config(REPO / "accelerate_configs" / "cpu_ddp.yaml")


def test_an_accelerate_config_the_estimate_cannot_read_is_said_as_doctor_and_launch_say_it(tmp_path):
    """estimate-memory read the launch file with a copy of its own (a bare "not valid YAML: <PyYAML's dump>", a folder
    a traceback): the reader doctor and launch share (audit 51)."""
    (bad := tmp_path / "bad.yaml").write_text("distributed_type: FSDP\n  num_processes: 2\n")
    with pytest.raises(LLMTrainError, match=r"--accelerate-config .*bad.yaml is not valid YAML at line 2, column"):
        read_accelerate_config(bad)
    with pytest.raises(LLMTrainError, match=r"cannot read --accelerate-config .*: Is a directory\. Give the path"):
        read_accelerate_config(tmp_path)
    (latin := tmp_path / "latin.yaml").write_bytes(b"distributed_type: FSDP # caf\xe9\n")
    with pytest.raises(LLMTrainError, match=r"--accelerate-config .*latin.yaml is not UTF-8 text: save it as UTF-8"):
        read_accelerate_config(latin)


def test_launch_config_offload_reads_as_accelerate_does(tmp_path):
    """fsdp_offload_params as accelerate reads it (str_to_bool of the value): the string "false" that a hand-edited
    config may hold is no offload (bool("false") had priced one), and an HSDP config's offload is priced as the
    in-run estimate prices it (it had been dropped for HSDP)."""
    base = yaml.safe_load((REPO / "accelerate_configs" / "hsdp_multinode.yaml").read_text())
    fsdp = yaml.safe_load((REPO / "accelerate_configs" / "fsdp.yaml").read_text())
    for cfg, strategy in ((fsdp, "fsdp"), (base, "hsdp")):
        for value, offload in ((True, True), ("true", True), ("True", True), (False, False), ("false", False)):
            cfg["fsdp_config"]["fsdp_offload_params"] = value
            path = tmp_path / f"{strategy}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            layout = read_accelerate_config(path)
            assert (layout.strategy, layout.offload) == (strategy, offload), (strategy, value)


def test_fsdp_reshard_after_forward_false_keeps_every_layer_gathered_to_its_backward(tmp_path):
    """fsdp_reshard_after_forward: false (a launch setting the run honours) keeps each layer's gathered parameters
    from its forward to its backward: from the last layer's forward to the first backward every layer is gathered (L
    units where two are in flight), and the layers are gathered once a micro-batch, not twice. The estimate had
    priced the default for it (audit 8): Llama-2-7B full on 8 GPUs 19.16 GiB where 31.60 are needed."""
    from llmtrain.memory import estimate_run
    from llmtrain.memory.comms import Network, step_traffic
    from llmtrain.memory.params import load_model_shape

    cfg = yaml.safe_load((REPO / "accelerate_configs" / "fsdp.yaml").read_text())
    cfg["fsdp_config"]["fsdp_reshard_after_forward"] = False
    path = tmp_path / "noreshard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert read_accelerate_config(path).reshard is False
    assert read_accelerate_config(REPO / "accelerate_configs" / "fsdp.yaml").reshard is True
    shape = load_model_shape("llama-2-7b")
    spec = TrainSpec(strategy="fsdp", num_gpus=8, mixed_precision="bf16", gradient_checkpointing=True, seq_len=4096)
    default, kept = estimate_run(shape, spec), estimate_run(shape, spec.but(reshard_after_forward=False))
    unit = shape.layer(0).params_per_layer * 2  # a layer gathered in bf16
    assert kept.breakdown["fsdp_buffers"] - default.breakdown["fsdp_buffers"] == (shape.layers - 2) * unit
    gathers = [step_traffic(shape, s, Network()) for s in (spec, spec.but(reshard_after_forward=False))]
    assert gathers[1].intra_bytes < gathers[0].intra_bytes  # one all-gather of the layers a micro-batch
    peaks = [json.loads(estimate_memory("recipes/llama7b.yaml", "--accelerate-config", str(c), "--json",
                                        check=False).stdout)["breakdown"]["fsdp_buffers"]
             for c in (REPO / "accelerate_configs" / "fsdp.yaml", path)]
    assert peaks[1] - peaks[0] > 10 * GIB  # the command reads it from the launch config


# --------------------------------------------------------------------------- command line


def test_cli_counts_lora_on_gpt_oss_experts_by_target_parameters(tmp_path):
    """--lora-target-parameters (lora.target_parameters, once each) adds GPT-OSS's experts' adapters to the ones
    all-linear gives (its attention alone): peft's own count, each expert its own A and B; with a recipe the recipe
    says it."""
    base = ("--model", "openai/gpt-oss-20b", "--method", "lora", "--lora-r", "8", "--seq-len", "1024", "--json")
    attention = json.loads(estimate_memory(*base).stdout)
    experts = json.loads(estimate_memory(*base, "--lora-target-parameters", "mlp.experts.gate_up_proj",
                                         "--lora-target-parameters", "mlp.experts.down_proj").stdout)
    # r 8 a layer: q, k, v, o (8 x (2,880 + 4,096) + 2 x 8 x (2,880 + 512) + 8 x (4,096 + 2,880)) = 165,888; the
    # experts: 32 x 8 x ((2,880 + 5,760) + (2,880 + 2,880)) = 3,686,400 (an A and a B an expert); 24 layers
    assert attention["params_trainable"] == 24 * 165_888 == 3_981_312
    assert experts["params_trainable"] == 24 * (165_888 + 3_686_400) == 92_454_912
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name_or_path: openai/gpt-oss-20b}\nlora: {r: 8, dropout: 0.0}\n"
                      "data: {path: x.jsonl}\n")
    refused = estimate_memory(str(recipe), "--lora-target-parameters", "mlp.experts.down_proj", check=False)
    assert refused.returncode == 2 and "--lora-target-parameters (set lora.target_parameters)" in refused.stderr


def test_cli_json_has_the_required_keys():
    res = estimate_memory("--model", "mistral-7b", "--method", "lora", "--dtype", "bfloat16", "--mixed-precision",
                          "bf16", "--micro-batch", "4", "--seq-len", "512", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for key in ("params_total", "params_trainable", "per_gpu_peak_bytes", "fits", "breakdown", "recommendation"):
        assert key in out
    assert isinstance(out["fits"], bool) and out["fits"]
    assert {"weights", "gradients", "optimizer", "activations", "logits", "overhead"} <= set(out["breakdown"])
    assert out["params_trainable"] == 41_943_040


def test_cli_bad_model_path_is_a_clear_error():
    res = estimate_memory("--model", "/no/such/model/dir", "--json", check=False)
    assert res.returncode == 2
    assert "no model config at '/no/such/model/dir'" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_folder_without_a_config_or_a_runs_folder_says_which_it_is(tmp_path):
    """A folder without config.json had been "no such directory or file"; a run's folder given as the model (its
    model is its final/) the same."""
    (tmp_path / "notes").mkdir()
    res = estimate_memory("--model", str(tmp_path / "notes"), check=False)
    assert res.returncode == 2 and f"no model config at '{tmp_path / 'notes'}' (--model): the folder has no " \
        "config.json" in " ".join(res.stderr.split())
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "recipe.yaml").write_text("output_dir: run\n")
    res = estimate_memory(str(REPO / "recipes" / "tiny.yaml"), f"model.name_or_path={run}", check=False)
    assert res.returncode == 2 and f"'{run}' (model.name_or_path) is a run's folder, not a model: set " \
        f"model.name_or_path={run / 'final'}." in " ".join(res.stderr.split()), res.stderr
    res = estimate_memory("--model", str(run), check=False)
    assert f"set --model {run / 'final'}." in " ".join(res.stderr.split()), res.stderr


def test_cli_recipe_with_overrides_and_accelerate_config(tmp_path):
    recipe = _recipe(tmp_path, tiny_dir(tmp_path), lora=False)
    res = estimate_memory(str(recipe), "train.micro_batch_size=3", "--accelerate-config",
                          str(REPO / "accelerate_configs" / "fsdp.yaml"), "--json", "--fit")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["spec"]["micro_batch"] == 3 and out["spec"]["strategy"] == "fsdp" and out["spec"]["world_size"] == 8
    assert out["fit"]["found"] and out["fit"]["best"]["fits"]


def test_cli_run_options_with_a_recipe_point_to_the_override(tmp_path):
    recipe = _recipe(tmp_path, tiny_dir(tmp_path), lora=False)
    res = estimate_memory(str(recipe), "--micro-batch", "4", check=False)
    assert res.returncode == 2 and "train.micro_batch_size" in res.stderr


def test_cli_table_and_fit_output():
    res = estimate_memory("--model", "llama-2-7b", "--mixed-precision", "bf16", "--num-gpus", "8", "--fit")
    assert res.returncode == 0, res.stderr
    assert "total per GPU" in res.stdout and "overrides: train.micro_batch_size=" in res.stdout
    assert "accelerate_configs/" in res.stdout


def test_cli_module_imports_no_torch():
    code = ("import sys, llmtrain.cli; "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'torch imported by llmtrain --help'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_fit_says_which_global_batch_it_keeps_on_the_gpus_given():
    """llama7b.yaml's header launch is 8 GPUs (4 x 2 x 8 = 64 examples a step); on 2 nodes x 8 --fit keeps the
    per-GPU batch, so 128 a step: it says so instead of changing the global batch in silence."""
    res = estimate_memory("recipes/llama7b.yaml", "--num-gpus", "8", "--num-nodes", "2", "--fit")
    assert res.returncode == 0, res.stderr
    assert ("--fit keeps the global batch at 128 examples a step: the recipe's 4 x 2 accumulation per GPU on 16 "
            "data-parallel GPUs; set train.grad_accum_steps for another") in " ".join(res.stdout.split())


@pytest.mark.parametrize("gpus, given", [(["--num-gpus", "8"], []), (["--num-gpus", "8", "--num-nodes", "2"], []),
                                         (["--num-gpus", "8"], ["train.grad_accum_steps=2", "data.max_seq_len=1024"])])
def test_the_fits_command_is_one_llmtrain_launch_accepts(gpus, given):
    """--fit's last line is a command to run: `llmtrain launch` (which checks the recipe and the launch before any
    process starts; it had printed a plain `accelerate launch ... -m llmtrain finetune`), and its arguments pass
    llmtrain launch's checks of the recipe, the launch config and the layout. The recipe's own overrides are kept,
    less those of a key --fit sets: each key once (it had printed train.grad_accum_steps=2 and, after it, --fit's
    own value)."""
    import contextlib
    import shlex

    from llmtrain.launcher import accelerate_command

    res = estimate_memory("recipes/llama7b.yaml", *given, *gpus, "--fit")
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip().splitlines()[-1].strip()
    assert line.startswith("llmtrain launch --config_file accelerate_configs/") and " -m " not in line, line
    words = shlex.split(line)
    with contextlib.chdir(REPO):
        command = accelerate_command(words[2:], machine=False)
    recipe = words.index("recipes/llama7b.yaml")
    assert command[command.index("finetune") + 1:] == words[recipe:]  # the recipe and the overrides, as printed
    keys = [w.split("=", 1)[0] for w in words[recipe + 1:]]
    assert len(keys) == len(set(keys)) and "train.grad_accum_steps" in keys, keys
    assert ("data.max_seq_len=1024" in words) == bool(given)


def test_the_fit_table_keeps_whole_headers_at_80_columns():
    """At 80 columns rich cut the --fit table's long headers ("checkpo…", "throughp…", issue 53): short headers, said
    in full in the caption, and no line past 80."""
    import contextlib

    from typer.testing import CliRunner

    from llmtrain.cli import app

    with contextlib.chdir(REPO):
        out = CliRunner().invoke(app, ["estimate-memory", "recipes/llama7b.yaml", "--fit", "--gpu-memory", "80"],
                                 env={"COLUMNS": "80"}).stdout
    table = out.split("Configurations that fit")[1].split("use:")[0]
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= 80, table
    assert "ckpt: model.gradient_checkpointing; grads: the gradients held" in " ".join(out.split())


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-30b-a3b"])
def test_the_parameter_counts_are_the_models_under_tensor_parallelism(model):
    """The header's parameter counts describe the model, whatever the layout: under FSDP x TP they had been one GPU's
    tensor-parallel slice of the adapters (Qwen3-8B LoRA: 30,081,024 trainable on TP 2 against 43,646,976), while
    each GPU's memory is still its slice's."""
    shape = load_model_shape(model)
    spec = TrainSpec(method="lora", lora_r=16, lora_dropout=0.0, strategy="fsdp", num_gpus=4, seq_len=4096,
                     micro_batch=1, dtype="bfloat16")
    one, two = estimate(shape, spec), estimate(shape, spec.but(tp=2))
    assert (two.params_total, two.params_trainable) == (one.params_total, one.params_trainable)
    assert one.params_trainable > 1e7 and two.per_gpu_peak_allocated_bytes != one.per_gpu_peak_allocated_bytes


def test_method_qlora_is_named_with_its_two_flags():
    """`--method qlora` (QLoRA is one of the README's three methods) had been refused as "Value error, 'qlora' is not
    one of 'full', 'lora'": it names --method lora --quantize nf4, which estimates it."""
    refused = invoke("estimate-memory", "--model", "mistral-7b", "--method", "qlora", check=False)
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2 and "'qlora' is not one of 'full', 'lora': QLoRA is --method lora --quantize nf4" \
        in said and "Value error" not in said
    assert "4-bit" in invoke("estimate-memory", "--model", "mistral-7b", "--method", "lora", "--quantize", "nf4").stdout


def test_a_model_estimate_refuses_the_attention_its_training_refuses():
    """--model gpt-oss-20b --attn sdpa had estimated (and fitted) a run that training, doctor and a recipe's
    estimate refuse: transformers has no SDPA attention for GPT-OSS. Refused in one paragraph, exit 2, naming the
    option's key; the model's own attention (auto) is estimated."""
    refused = invoke("estimate-memory", "--model", "gpt-oss-20b", "--attn", "sdpa", check=False)
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2 and "gpt-oss-20b would be refused with these options (--attn is " \
        "model.attn_implementation, --packing data.packing, --micro-batch-tokens train.micro_batch_tokens), so " \
        "there is no run to estimate: " \
        "model.attn_implementation=sdpa: transformers has no sdpa attention for gpt_oss" in said
    assert "Traceback" not in said
    assert "varlen (auto) attention" in " ".join(invoke("estimate-memory", "--model", "gpt-oss-20b", "--method",
                                                        "lora", check=False).stdout.split())
