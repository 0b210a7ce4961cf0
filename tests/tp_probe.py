"""Run by tests/test_families.py under `torch.distributed.run` (gloo, CPU): a tiny Gemma 4 text model in float64, its
loss and every weight's gradient on one process against the same model under llmtrain's tensor parallelism over all
the ranks (parallel/tensor.apply_tensor_parallel). In float64 what fp32 leaves as rounding (the split matmuls and the
all-reduces sum in another order) is gone, so any difference is the split's. Each rank writes, as JSON, the loss's
difference, the largest gradient difference and its weight, and the local and whole rows of every layer's q_proj.

    python -m torch.distributed.run --nproc_per_node P tests/tp_probe.py OUT_DIR
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Every part of Gemma 4's text layer that tensor parallelism meets: local layers of one head size and global ones of
# another with their own (fewer) K/V heads and keys that are the values (attention_k_eq_v), the last two layers
# sharing the keys and values of the layers before them (kv sharing; their MLP double-wide), per-layer embeddings
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
              attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"] * 2, vocab_size_per_layer_input=96,
              hidden_size_per_layer_input=8, final_logit_softcapping=30.0, pad_token_id=0)


def main(out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from llmtrain.parallel.tensor import apply_tensor_parallel

    from transformers.models.gemma4 import modeling_gemma4

    def norm_in_float64(self, x):  # Gemma 4's RMSNorm computes in fp32 whatever its input: here in the input's dtype
        normed = self._norm(x)
        return normed * self.weight if self.with_scale else normed

    modeling_gemma4.Gemma4RMSNorm.forward = norm_in_float64
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = Gemma4TextConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    one = AutoModelForCausalLM.from_config(config).double()
    with torch.no_grad():  # learned layer scalars, not their init's 1
        for i, (_, buffer) in enumerate((n, b) for n, b in one.named_buffers() if n.endswith("layer_scalar")):
            buffer.fill_(0.8 + 0.1 * i)
    many = copy.deepcopy(one)
    ids = torch.randint(1, CONFIG["vocab_size"], (2, 12))

    def loss(model):  # in float64 (transformers' own loss casts the logits to fp32)
        logits = model(input_ids=ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    sharded = apply_tensor_parallel(many, init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",)))
    q = [(whole(layer.self_attn.q_proj.weight).shape[0], layer.self_attn.q_proj.weight.to_local().shape[0])
         for layer in many.model.layers]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for m in (one, many)]
    steps = []
    for _ in range(3):  # AdamW's updates too: each of the three steps' loss and gradients
        loss_one, loss_many = loss(one), loss(many)
        loss_one.backward()
        loss_many.backward()
        grads = {name: whole(p.grad) for name, p in many.named_parameters()}
        worst = max(((float((grads[name] - p.grad).abs().max()), name) for name, p in one.named_parameters()))
        steps.append({"loss": loss_one.item(), "loss_diff": (whole(loss_many) - loss_one).abs().item(),
                      "grad_diff": worst[0], "grad_diff_at": worst[1],
                      "largest_grad": max(float(p.grad.abs().max()) for p in one.parameters())})
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    (out / f"rank{rank}.json").write_text(json.dumps({"steps": steps, "sharded": sharded, "q_rows": q}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
