"""The whole phase model against a real training step on the CPU, tensor by tensor.

A tiny Llama is loaded with llmtrain's own `load_model` (random init, LoRA, checkpointing), batched by
`collate`, and stepped with `compute_loss` and the fused AdamW of `build_optimizer`, with bf16 autocast
wrapped around the forward the way Accelerate does it. torch's MemTracker records the peak of live
tensor bytes during the second step (optimizer state already allocated), which is what
torch.cuda.max_memory_allocated reports on a GPU. The estimate's allocated peak must agree.

This checks the bookkeeping (which tensors are alive at which phase) with real kernels; CUDA kernels'
workspaces and the allocator's behaviour are what the GPU calibration in docs/memory.md is for.
"""

from __future__ import annotations

import json

import pytest
import torch

from llmtrain.memory import estimate as estimate_module
from llmtrain.memory.params import _shape_from_json
from llmtrain.memory.spec import TrainSpec

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")

CFG = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
           vocab_size=4096, num_hidden_layers=4)


class _NoHook:
    def remove(self) -> None:
        pass


def measured_peak(tmp_path, monkeypatch, spec: TrainSpec, cfg: dict) -> int:
    from accelerate.utils import convert_outputs_to_fp32
    from transformers import LlamaConfig

    from llmtrain.batching import collate
    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.modeling import build_optimizer, load_model
    from llmtrain.train import compute_loss

    LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}).save_pretrained(tmp_path / "m")
    torch.manual_seed(0)
    model = load_model(ModelConfig(name_or_path=str(tmp_path / "m"), random_init=True, dtype=spec.dtype,
                                   attn_implementation=spec.attn, gradient_checkpointing=spec.grad_checkpointing),
                       LoraConfig(r=spec.lora_r, dropout=spec.lora_dropout) if spec.method == "lora" else None)
    model.train()
    if spec.mixed_precision == "bf16":  # as Accelerator.prepare_model wraps the forward
        model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
    optimizer = build_optimizer(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=True)
    lengths = [spec.seq_len] * spec.micro_batch
    lengths[-1] -= 5 * (spec.micro_batch > 1)  # padded rows: one example is shorter
    examples = [{"input_ids": torch.randint(0, cfg["vocab_size"], (n,)).tolist(), "labels": list(range(n))}
                for n in lengths]
    batch = collate(examples, pad_id=0, packing=spec.packing)

    def step():
        compute_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # allocates the optimizer state
    # MemTracker hooks every parameter; frozen (LoRA base) ones cannot take hooks and need none.
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, fn, _o=original: _o(self, fn) if self.requires_grad
                            else _NoHook())
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


# Two shapes: with a 4096 vocabulary the loss is the step's peak (exact bookkeeping); with 256 a
# decoder layer's backward or forward is, where temporaries are modelled per op and land within 5%.
LOSS, LAYERS = 4096, 256
CASES = [  # (vocab, spec)
    (LOSS, TrainSpec(attn="eager", micro_batch=4, seq_len=128)),
    (LOSS, TrainSpec(attn="sdpa", micro_batch=4, seq_len=128, mixed_precision="bf16", grad_checkpointing=True)),
    (LOSS, TrainSpec(method="lora", lora_r=8, dtype="bfloat16", mixed_precision="bf16", micro_batch=4, seq_len=128)),
    (LOSS, TrainSpec(method="lora", lora_r=8, dtype="bfloat16", micro_batch=1, seq_len=256)),
    (LAYERS, TrainSpec(attn="eager", micro_batch=4, seq_len=128)),
    (LAYERS, TrainSpec(attn="sdpa", micro_batch=4, seq_len=128, mixed_precision="bf16")),
    (LAYERS, TrainSpec(attn="eager", micro_batch=4, seq_len=128, mixed_precision="bf16", grad_checkpointing=True)),
    (LAYERS, TrainSpec(attn="sdpa", micro_batch=4, seq_len=64, packing=True, mixed_precision="bf16")),
    (LAYERS, TrainSpec(method="lora", lora_r=8, dtype="bfloat16", mixed_precision="bf16", micro_batch=4, seq_len=128)),
    (LAYERS, TrainSpec(method="lora", lora_r=8, dtype="bfloat16", mixed_precision="bf16", micro_batch=4, seq_len=128,
                       grad_checkpointing=True)),
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
    cfg = {**CFG, "vocab_size": vocab}
    est = estimate_module.estimate(_shape_from_json(json.dumps(cfg), "tiny"), spec)
    predicted = est.per_gpu_peak_allocated_bytes
    measured = measured_peak(tmp_path, monkeypatch, spec, cfg)
    if vocab == LOSS:
        assert est.peak_phase == "backward_loss"
        assert abs(predicted - measured) <= SMALL, (predicted, measured)
    else:
        assert abs(predicted / measured - 1) <= 0.05, (predicted, measured, est.peak_phase)
