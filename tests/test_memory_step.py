"""The whole phase model against a real training step on the CPU, tensor by tensor.

A tiny Llama is loaded with llmtrain's own `load_model` (random init, LoRA, checkpointing), given the
training loss with `attach_loss` (the LM head and cross-entropy in chunks recomputed in backward),
batched by `collate` and `with_loss_positions` (padded rows, or one packed row), and stepped with
`compute_loss` and the fused AdamW of `build_optimizer`, with bf16 autocast wrapped around the forward the
way Accelerate does it. torch's MemTracker records the peak of live tensor bytes during the second step
(optimizer state already allocated), which is what torch.cuda.max_memory_allocated reports on a GPU. The
estimate's allocated peak must agree.

This checks the bookkeeping (which tensors are alive at which phase) with real kernels; CUDA kernels'
workspaces and the allocator's behaviour are what the GPU calibration in docs/memory.md is for. Where the
CPU runs another kernel than CUDA (dropout's noise, the varlen attention's per-example SDPA), the estimate
is given the CPU's numbers, written out in test_memory_saved.
"""

from __future__ import annotations

import json

import pytest
import torch
from live_bytes import LiveBytes
from test_memory_saved import cpu_varlen_attention_bytes

from llmtrain.memory import activations as act
from llmtrain.memory import estimate as estimate_module
from llmtrain.memory.params import _shape_from_json
from llmtrain.memory.spec import TrainSpec

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")

CFG = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
           vocab_size=4096, num_hidden_layers=4)
PAD = 5  # padded batches: the last example is this much shorter


pytestmark = pytest.mark.long(160)  # tests/conftest.py


class _NoHook:
    def remove(self) -> None:
        pass


def lengths_of(spec: TrainSpec) -> list[int]:
    """The examples of the measured micro-batch: a token budget filled exactly by four examples of
    different lengths; otherwise micro_batch examples of seq_len, the last one shorter when rows are padded."""
    if spec.micro_batch_tokens:
        n = spec.micro_batch_tokens
        return [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
    lengths = [spec.seq_len] * spec.micro_batch
    if not spec.packed and spec.micro_batch > 1:
        lengths[-1] -= PAD
    return lengths


def build_model(tmp_path, spec: TrainSpec, cfg: dict, *, reward_head: bool = False):
    """The model as train() builds it for `spec`: its loss attached (a reward model's score), under bf16 autocast
    as Accelerator.prepare_model wraps the forward."""
    from accelerate.utils import convert_outputs_to_fp32
    from transformers import AutoConfig

    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model.loss import attach_loss
    from llmtrain.model.modeling import load_model
    from llmtrain.model.score import attach_score

    AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}).save_pretrained(
        tmp_path / "m")
    torch.manual_seed(0)
    model = load_model(ModelConfig(name_or_path=str(tmp_path / "m"), random_init=True, dtype=spec.dtype,
                                   attn_implementation=spec.attn_implementation,
                                   gradient_checkpointing=spec.gradient_checkpointing,
                                   kernels="none", tiled_mlp=spec.tiled_mlp),
                       LoraConfig(r=spec.lora_r, dropout=spec.lora_dropout, dora=spec.lora_dora,
                                  target_modules=spec.lora_target_modules if isinstance(spec.lora_target_modules, str)
                                  else list(spec.lora_target_modules),
                                  target_parameters=list(spec.lora_target_parameters) or None)
                       if spec.method == "lora" else None,
                       reward_head=reward_head)
    if reward_head:
        attach_score(model)
    else:
        attach_loss(model, chunk=spec.loss_chunk_tokens)
    if spec.mixed_precision == "bf16":
        model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
    return model


def build(tmp_path, spec: TrainSpec, cfg: dict):
    """The model as train() builds it for `spec`, and one micro-batch of `lengths_of(spec)` examples."""
    from llmtrain.data.batching import collate, with_loss_positions

    model = build_model(tmp_path, spec, cfg)
    vocab = cfg["vocab_size"]
    examples = [{"input_ids": torch.randint(0, vocab, (n,)).tolist(), "labels": torch.randint(0, vocab, (n,)).tolist()}
                for n in lengths_of(spec)]
    return model, with_loss_positions(collate(examples, pad_id=0, packing=spec.packed))


def tracked_peak(monkeypatch, run, *tracked) -> int:
    """Peak live tensor bytes while `run()` runs, counting the tracked modules' and optimizers' state too."""
    # MemTracker hooks every parameter; frozen (LoRA base) ones cannot take hooks and need none.
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, fn, _o=original: _o(self, fn) if self.requires_grad
                            else _NoHook())
    tracker = mem_tracker.MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        run()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def step_peak(monkeypatch, spec: TrainSpec, model, batch: dict, loss) -> int:
    """Peak live tensor bytes of the second of two training steps (`loss()`, backward, fused AdamW): the optimizer
    state exists by then."""
    from llmtrain.model.modeling import build_optimizer

    model.train()
    optimizer = build_optimizer(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=True)

    def step():
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # allocates the optimizer state
    if spec.tiled_mlp:  # MemTracker's module hooks fail inside an autograd Function's forward, the tiled MLP's
        with LiveBytes() as live:
            live.track(*model.parameters(), *model.buffers(), *batch.values(),
                       *(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)))
            step()
        return live.peak
    return tracked_peak(monkeypatch, step, model, optimizer)


def measured_peak(tmp_path, monkeypatch, spec: TrainSpec, cfg: dict) -> int:
    from llmtrain.model.loss import compute_loss

    model, batch = build(tmp_path, spec, cfg)
    return step_peak(monkeypatch, spec, model, batch, lambda: compute_loss(model, batch))


# Three shapes: with a 4096 vocabulary and one loss chunk, or 16384 and chunks of 128, the loss is the
# step's peak (exact bookkeeping); with 256 a decoder layer's backward or forward is, where temporaries
# are modelled per op and land within 5%. `attn_implementation="auto"` is the trainer's default: varlen on one packed
# row.
LOSS, CHUNKED, LAYERS = 4096, 16384, 256
LORA = dict(method="lora", lora_r=8, dtype="bfloat16")
CASES = [  # (vocab, spec)
    (LOSS, TrainSpec(attn_implementation="eager", micro_batch=4, seq_len=128)),
    # extended: the LAYERS cases of these two, below
    pytest.param(LOSS, TrainSpec(attn_implementation="sdpa", micro_batch=4, seq_len=128, mixed_precision="bf16",
                                 gradient_checkpointing=True), marks=pytest.mark.extended),
    pytest.param(LOSS, TrainSpec(**LORA, attn_implementation="sdpa", mixed_precision="bf16", micro_batch=4,
                                 seq_len=128), marks=pytest.mark.extended),
    (LOSS, TrainSpec(**LORA, attn_implementation="sdpa", micro_batch=1, seq_len=256)),
    (LOSS, TrainSpec(micro_batch=4, seq_len=128)),
    (LOSS, TrainSpec(**LORA, mixed_precision="bf16", micro_batch=4, seq_len=128)),
    (LOSS, TrainSpec(micro_batch_tokens=512, seq_len=256, mixed_precision="bf16", gradient_checkpointing=True)),
    (CHUNKED, TrainSpec(attn_implementation="eager", micro_batch=4, seq_len=128, loss_chunk_tokens=128)),
    # extended (the slowest, 25 s each): the chunked loss's bytes are the eager and token-budget cases' beside them
    pytest.param(CHUNKED, TrainSpec(attn_implementation="sdpa", micro_batch=4, seq_len=128, mixed_precision="bf16",
                                    gradient_checkpointing=True, loss_chunk_tokens=128), marks=pytest.mark.extended),
    pytest.param(CHUNKED, TrainSpec(**LORA, attn_implementation="sdpa", mixed_precision="bf16", micro_batch=4,
                                    seq_len=128, loss_chunk_tokens=128), marks=pytest.mark.extended),
    (CHUNKED, TrainSpec(micro_batch_tokens=512, seq_len=256, loss_chunk_tokens=100)),
    (LAYERS, TrainSpec(attn_implementation="eager", micro_batch=4, seq_len=128)),
    (LAYERS, TrainSpec(attn_implementation="sdpa", micro_batch=4, seq_len=128, mixed_precision="bf16")),
    # extended: eager attention's bytes (the first LAYERS case) and checkpointing's (the LoRA case below)
    pytest.param(LAYERS, TrainSpec(attn_implementation="eager", micro_batch=4, seq_len=128, mixed_precision="bf16",
                                   gradient_checkpointing=True), marks=pytest.mark.extended),
    (LAYERS, TrainSpec(attn_implementation="sdpa", micro_batch=4, seq_len=64, packing=True, mixed_precision="bf16")),
    (LAYERS, TrainSpec(**LORA, attn_implementation="sdpa", mixed_precision="bf16", micro_batch=4, seq_len=128)),
    (LAYERS, TrainSpec(**LORA, attn_implementation="sdpa", mixed_precision="bf16", micro_batch=4, seq_len=128,
                       gradient_checkpointing=True)),
    (LAYERS, TrainSpec(micro_batch=4, seq_len=128, mixed_precision="bf16")),
    # LoRA on fp32 weights without autocast, no dropout: the adapters reading one input save that very tensor (peft's
    # cast to their fp32 is no copy); counted once per adapter, the estimate was 9% over (found by the stages' check)
    (LAYERS, TrainSpec(method="lora", lora_r=8, lora_dropout=0.0, attn_implementation="sdpa", micro_batch=4,
                       seq_len=128)),
    # lora.dora: the base and adapter outputs each adapter keeps, the weight copy of dropout's second base matmul, the
    # row norms' [out, in] temporaries in every forward (and in checkpointing's recompute)
    pytest.param(LAYERS, TrainSpec(**LORA, attn_implementation="sdpa", mixed_precision="bf16", micro_batch=4,
                                   seq_len=128, lora_dora=True), id="dora"),
    pytest.param(LAYERS, TrainSpec(**LORA, attn_implementation="sdpa", mixed_precision="bf16", micro_batch=4,
                                   seq_len=128, lora_dora=True, gradient_checkpointing=True), id="dora-checkpointed",
                 marks=pytest.mark.extended),  # extended: the LoRA checkpointed case's recompute, DoRA's bytes above
    # extended: a token budget's varlen rows (the full fine-tune's budget case above) with LoRA's bytes (the LoRA cases)
    pytest.param(LAYERS, TrainSpec(**LORA, mixed_precision="bf16", micro_batch_tokens=512, seq_len=256),
                 marks=pytest.mark.extended),
]


SMALL = 64 * 1024  # scalars and small buffers the estimate leaves out (the loss, step counters, ...)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("vocab", "spec"), CASES)
def test_estimate_matches_a_real_step(tmp_path, monkeypatch, one_thread, vocab, spec):
    # The CPU's dropout saves a noise tensor in the (fp32) input dtype where CUDA saves a bool mask.
    monkeypatch.setattr(estimate_module, "DROPOUT_MASK_BYTES", 4)
    lengths = lengths_of(spec)
    if spec.kernel == "varlen":  # the CPU's per-example SDPA in place of the flash kernel (test_memory_saved)
        monkeypatch.setattr(estimate_module, "varlen_repeats_kv", lambda: False)
        monkeypatch.setattr(act, "attention_bytes", lambda p, shape, *, o_trainable: cpu_varlen_attention_bytes(
            p, shape, lengths, o_trainable=o_trainable))
    cfg = {**CFG, "vocab_size": vocab}
    shape = _shape_from_json(json.dumps(cfg), "tiny")
    est = estimate_module.estimate(shape, spec)
    predicted = est.per_gpu_peak_allocated_bytes
    measured = measured_peak(tmp_path, monkeypatch, spec, cfg)
    if vocab == LAYERS:
        assert abs(predicted / measured - 1) <= 0.05, (predicted, measured, est.peak_phase)
        return
    p = estimate_module.make_pass(shape, spec)
    chunk = act.loss_chunk(p, spec.loss_chunk_tokens)
    assert est.peak_phase in ("backward_loss", "backward_lm_head")  # a chunk's backward, or the head's
    if est.peak_phase == "backward_loss":  # one chunk's logits at 12 bytes each, never the micro-batch's
        assert est.breakdown["logits"] == chunk * vocab * 12
    # The estimate takes every row full and a token budget filled by one example; here the padded row is
    # PAD short and the budget holds four examples, each one's last token untrained. The LM head gets
    # `short` positions fewer: with a single chunk, that chunk is smaller (12 bytes a logit), and the
    # gathered hidden states (with their index and target) are in any case.
    short = p.loss_tokens - (sum(lengths) - len(lengths))
    single = chunk == p.loss_tokens
    overestimate = short * ((vocab * 12 if single else 0) + shape.hidden * p.resid + 16)
    assert abs(predicted - overestimate - measured) <= SMALL, (predicted, overestimate, measured)


def test_disable_dropout_leaves_dora_no_dropout_branch_as_its_estimate_prices_it(tmp_path, monkeypatch, one_thread):
    """train.disable_dropout (on for DPO, KTO and reward models) had set lora.dropout's module to p 0, and peft's
    DoRA takes its dropout branch for any module but nn.Identity: a second base matmul saving a copy of every adapted
    weight, the step 10% over the estimate (which prices a dropout of 0; audit 35). modeling.dropout_off makes them
    nn.Identity, and the step is the estimate's, the same loss."""
    from dataclasses import replace

    from llmtrain.model.loss import compute_loss
    from llmtrain.model.modeling import dropout_off

    spec = TrainSpec(**LORA, lora_dropout=0.05, attn_implementation="sdpa", mixed_precision="bf16", micro_batch=4,
                     seq_len=128, lora_dora=True)
    cfg = {**CFG, "vocab_size": LAYERS}
    model, batch = build(tmp_path, spec, cfg)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = compute_loss(model, batch)
    for module in model.modules():  # TRL's disable_dropout_in_model, what it had been
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        at_zero = compute_loss(model, batch)
    dropout_off(model)
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_loss(model, batch).item() == at_zero.item() != before.item()
    measured = step_peak(monkeypatch, spec, model, batch, lambda: compute_loss(model, batch))
    estimated = estimate_module.estimate(_shape_from_json(json.dumps(cfg), "tiny"),
                                         replace(spec, lora_dropout=0.0)).per_gpu_peak_allocated_bytes
    assert abs(estimated / measured - 1) <= 0.05, (estimated, measured)


EVAL_CASES = [  # (vocab, spec): evaluate() runs compute_loss(return_hits=True) under no_grad
    (LOSS, TrainSpec(micro_batch=4, seq_len=128, eval_micro_batch=4)),
    (LOSS, TrainSpec(micro_batch=4, seq_len=128, eval_micro_batch=4, mixed_precision="bf16", loss_chunk_tokens=100)),
    (LOSS, TrainSpec(attn_implementation="eager", micro_batch=4, seq_len=128, eval_micro_batch=4,
                     loss_chunk_tokens=100)),
    (LAYERS, TrainSpec(**LORA, mixed_precision="bf16", micro_batch=4, seq_len=128, eval_micro_batch=4)),
    (LAYERS, TrainSpec(**LORA, micro_batch=4, seq_len=128, eval_micro_batch=4)),
    # DoRA's row norms in each forward: down_proj's (688^2 + 4 x 688 x 256 fp32) is this layer's largest moment
    pytest.param(LAYERS, TrainSpec(**LORA, mixed_precision="bf16", micro_batch=4, seq_len=128, eval_micro_batch=4,
                                   lora_dora=True), id="dora"),
]


@pytest.mark.parametrize(("vocab", "spec"), EVAL_CASES)
def test_eval_phases_match_a_real_evaluation(tmp_path, monkeypatch, one_thread, vocab, spec):
    from llmtrain.model.loss import compute_loss

    cfg = {**CFG, "vocab_size": vocab}
    est = estimate_module.estimate(_shape_from_json(json.dumps(cfg), "tiny"), spec)
    model, batch = build(tmp_path, spec, cfg)
    model.eval()
    with torch.no_grad():
        measured = tracked_peak(monkeypatch, lambda: compute_loss(model, batch, return_hits=True), model)
    # No optimizer here: the phases without its state.
    eval_phases = {k: est.phases[k] - est.phase_parts[k]["optimizer"] for k in ("eval_forward", "eval_loss")}
    predicted = max(eval_phases.values())
    if vocab == LOSS:  # a loss chunk's logits (or eager's scores) are the peak: exact
        assert abs(predicted - measured) <= SMALL, (predicted, measured)
    else:  # a layer's transients with LoRA's casts: within 5%
        assert predicted == eval_phases["eval_forward"]
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)


# A reward model (reward_model:): the decoder under a one-output score head read at one token a sequence, packed
# pairs (chosen then rejected), the Bradley-Terry loss. With a 16384 vocabulary an LM head and its loss chunk would be
# a third of the step; the estimate leaves both out (params.score_head_shape).
RM_CASES = [
    TrainSpec(micro_batch=4, seq_len=128, packing=True),
    TrainSpec(**LORA, mixed_precision="bf16", micro_batch=4, seq_len=128, packing=True),
]


@pytest.mark.parametrize("spec", RM_CASES)
def test_reward_model_estimate_matches_a_real_step(tmp_path, monkeypatch, one_thread, spec):
    from llmtrain.config import RewardModelConfig
    from llmtrain.memory.params import score_head_shape
    from llmtrain.objectives.reward_model import RewardModel

    monkeypatch.setattr(estimate_module, "DROPOUT_MASK_BYTES", 4)
    lengths = [spec.seq_len] * spec.micro_batch  # two pairs filling the row: the estimate's full-length sequences
    monkeypatch.setattr(estimate_module, "varlen_repeats_kv", lambda: False)
    monkeypatch.setattr(act, "attention_bytes", lambda p, shape, *, o_trainable: cpu_varlen_attention_bytes(
        p, shape, lengths, o_trainable=o_trainable))
    cfg = {**CFG, "vocab_size": CHUNKED}
    model = build_model(tmp_path, spec, cfg, reward_head=True)
    objective = RewardModel(RewardModelConfig(), pad_id=0, score_pad_id=None, packing=True, margin=False)
    ids = [torch.randint(4, CHUNKED, (n,)).tolist() for n in lengths]
    batch, _ = objective.collate([{"chosen_ids": ids[i], "rejected_ids": ids[i + 1]} for i in range(0, len(ids), 2)])
    measured = step_peak(monkeypatch, spec, model, batch, lambda: objective.loss(model, batch)[0])
    lm = _shape_from_json(json.dumps(cfg), "tiny")
    predicted = estimate_module.estimate(score_head_shape(lm), spec).per_gpu_peak_allocated_bytes
    as_lm = estimate_module.estimate(lm, spec).per_gpu_peak_allocated_bytes
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)
    assert as_lm / measured - 1 > 0.25, (as_lm, measured)  # what the estimate said before: an LM head's step
