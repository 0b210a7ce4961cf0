"""Run by tests/test_families.py under `torch.distributed.run` (gloo, CPU): a tiny model in float64 (Gemma 4's text
model, or a mixture of experts: Qwen3-MoE, Mixtral, Gemma 4's, GPT-OSS; with LoRA on every linear layer and the
experts), its loss and every trained weight's gradient on one process against the same model under llmtrain's tensor
parallelism over all the ranks (parallel/tensor.apply_tensor_parallel). In float64 what fp32 leaves as rounding (the
split matmuls and the all-reduces sum in another order) is gone, so any difference is the split's. Each rank writes,
as JSON, the loss's difference, the largest gradient difference and its weight, the local and whole rows of every
layer's q_proj, the experts each layer holds of all (and GPT-OSS's sinks), and the weights it holds of a layer.

    python -m torch.distributed.run --nproc_per_node P tests/tp_probe.py OUT_DIR [MODEL] [lora|dora] [merged] [compile]

MODEL: gemma4 (the default), qwen3_moe, mixtral, gemma4_moe, gpt_oss, or the dense llama and phi3 (Phi's gathered
plan). dora: LoRA with DoRA's magnitudes (parallel/tensor._split_dora). merged: after the steps, the logits with the
merged generation copy (model/merged_copy.py; each policy, `kept` twice) against the adapters unmerged and against
one process's copy, and how many linears each merged, and the fast sampler's. compile: each decoder layer compiled on
both sides (model.compile), the split modules eager (parallel/tensor.eager_in_compile).
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
# The mixtures of experts: 4 experts of 32 columns a layer, 2 a token (Qwen3-MoE's QK-norm, Gemma 4's experts beside
# its dense MLP)
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, pad_token_id=0)
MODELS = {"gemma4": ("gemma4_text", CONFIG),
          "qwen3_moe": ("qwen3_moe", dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          intermediate_size=96, decoder_sparse_step=1, norm_topk_prob=True)),
          "mixtral": ("mixtral", dict(SMALL, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
          "gemma4_moe": ("gemma4_text", dict(CONFIG, enable_moe_block=True, num_experts=4, top_k_experts=2,
                                             moe_intermediate_size=32)),
          # GPT-OSS: attention sinks, biases on q/k/v/o, a window on every other layer, experts with biases
          "gpt_oss": ("gpt_oss", dict(SMALL, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                      sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
          "llama": ("llama", dict(SMALL, intermediate_size=96)),
          # Phi-3's fused qkv_proj and gate_up_proj: the gathered plan (colwise_gather_output, rowwise_split_input)
          "phi3": ("phi3", dict(SMALL, intermediate_size=96))}
DENSE = {"gemma4", "llama", "phi3"}
# their experts, which all-linear does not reach, by name
EXPERT_TARGETS = {"gemma4_moe": ["experts.gate_up_proj", "experts.down_proj"],
                  "gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def main(out: Path, name: str = "gemma4", lora: bool = False, dora: bool = False, merged: bool = False,
         compiled: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.parallel.tensor import apply_tensor_parallel

    from transformers.models.gemma4 import modeling_gemma4

    def norm_in_float64(self, x):  # Gemma 4's RMSNorm computes in fp32 whatever its input: here in the input's dtype
        normed = self._norm(x)
        return normed * self.weight if self.with_scale else normed

    modeling_gemma4.Gemma4RMSNorm.forward = norm_in_float64
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def llama_norm_in_float64(self, x):  # Llama's RMSNorm (Mixtral's, Qwen3-MoE's, GPT-OSS's) computes in fp32 too
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for norm in (modeling_mixtral.MixtralRMSNorm, modeling_qwen3_moe.Qwen3MoeRMSNorm, modeling_gpt_oss.GptOssRMSNorm):
        norm.forward = llama_norm_in_float64
    from transformers.integrations import moe

    can = moe._can_use_grouped_mm  # torch's grouped matmul takes no float64: transformers' own fallback op then does
    moe._can_use_grouped_mm = lambda x, weight, offsets: weight.dtype != torch.float64 and can(x, weight, offsets)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model_type, kwargs = MODELS[name]
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager" if model_type == "gpt_oss" else "sdpa"  # (GPT-OSS's sinks: no sdpa)
    one = AutoModelForCausalLM.from_config(config).double()
    with torch.no_grad():  # learned layer scalars, not their init's 1
        for i, (_, buffer) in enumerate((n, b) for n, b in one.named_buffers() if n.endswith("layer_scalar")):
            buffer.fill_(0.8 + 0.1 * i)
    if lora:  # every linear layer and the experts' 3-D parameters, the adapters unmerged beside them
        from peft import LoraConfig, get_peft_model

        from llmtrain.model import lora_experts

        targets = {"target_parameters": EXPERT_TARGETS[name]} if name in EXPERT_TARGETS else {}
        one = get_peft_model(one, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=dora,
                                             **targets))
        with torch.no_grad():  # B's init is 0: a random B so that the adapters change the output from the first step
            for n, p in one.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        assert lora_experts.install(one) == (0 if name in DENSE else config.num_hidden_layers)
    many = copy.deepcopy(one)
    if lora:
        lora_experts.install(many)  # (deepcopy copies the installed forward bound to the original module)
    ids = torch.randint(1, config.vocab_size, (2, 12))

    def loss(model):  # in float64 (transformers' own loss casts the logits to fp32)
        logits = model(input_ids=ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    sharded = sum(apply_tensor_parallel(many, init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))))
    if compiled:  # each decoder layer compiled, as model.compile does (parallel/parallelize.py)
        from llmtrain.model.modeling import compile_layers
        from llmtrain.parallel.tensor import eager_in_compile

        eager_in_compile(many)
        compile_layers(one)
        compile_layers(many)
    layers = (many.base_model.model if lora else many).model.layers
    q = [(whole(proj.weight).shape[0], proj.weight.to_local().shape[0])  # (Phi-3's fused qkv_proj)
         for proj in (getattr(layer.self_attn, "q_proj", None) or layer.self_attn.qkv_proj for layer in layers)]
    sinks = [(whole(layer.self_attn.sinks).shape[0], layer.self_attn.sinks.to_local().shape[0]) for layer in layers
             if hasattr(layer.self_attn, "sinks")]  # GPT-OSS's: one a query head, split with the heads
    experts = [(whole(p).shape[0], p.to_local().shape[0]) for n, p in many.named_parameters()
               if n.endswith("gate_up_proj") and p.ndim == 3]
    # the base weights this rank holds of the first decoder layer (what estimate-memory's tensor-parallel slice counts)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in layers[0].named_parameters()
               if "lora_" not in n)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, foreach=False)
                  for m in (one, many)]
    steps = []
    for _ in range(3):  # AdamW's updates too: each of the three steps' loss and gradients
        loss_one, loss_many = loss(one), loss(many)
        loss_one.backward()
        loss_many.backward()
        grads = {n: whole(p.grad) for n, p in many.named_parameters() if p.requires_grad}
        worst = max(((float((grads[n] - p.grad).abs().max()), n) for n, p in one.named_parameters()
                     if p.requires_grad))
        steps.append({"loss": loss_one.item(), "loss_diff": (whole(loss_many) - loss_one).abs().item(),
                      "grad_diff": worst[0], "grad_diff_at": worst[1],
                      "largest_grad": max(float(p.grad.abs().max()) for p in one.parameters() if p.requires_grad),
                      "trained": sum(p.requires_grad for p in one.parameters())})
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    copies = _merged_copies(one, many, ids) if merged else []
    (out / f"rank{rank}.json").write_text(json.dumps({"steps": steps, "sharded": sharded, "q_rows": q,
                                                          "experts": experts, "sinks": sinks, "merged": copies,
                                                          "layer_params": held, "config": config.to_json_string()}))
    dist.destroy_process_group()


@torch.no_grad()
def _merged_copies(one, many, ids) -> list[dict]:
    """For each merged-copy policy (rollout, then kept twice: built, then rewritten in place), the linears merged on
    one process and under tensor parallelism, and the largest logit differences of the tensor-parallel copy from its
    unmerged adapters and from one process's copy, and of the copy from the base model without the adapters (that the
    adapters count)."""
    from llmtrain.model.merged_copy import merged_for_sampling

    unmerged = many(input_ids=ids).logits
    with one.disable_adapter():
        base = one(input_ids=ids).logits
    out = []
    for policy in ("rollout", "kept", "kept"):
        with merged_for_sampling(one, policy) as merged_one, merged_for_sampling(many, policy) as merged_many:
            theirs, ours = one(input_ids=ids).logits, many(input_ids=ids).logits
        out.append({"policy": policy, "linears": [merged_one, merged_many],
                    "from_unmerged": float((ours - unmerged).abs().max()),
                    "from_one": float((ours - theirs).abs().max()), "from_base": float((ours - base).abs().max()),
                    **_sampled(one, many, ids, policy)})
    return out


def _sampled(one, many, ids, policy: str) -> dict:
    """The fast sampler (rl.sampler=static) asked for the copy (`policy`), as a run's rollouts ask (objectives/
    rollouts.sample): the linears it merged on one process and under tensor parallelism (merged_copy.merged_weight's
    calls), and whether the greedy tokens are the same."""
    from llmtrain.model import merged_copy
    from llmtrain.objectives.rollouts import sample

    real, calls = merged_copy.merged_weight, []

    def counted(module, *args, **kwargs):
        calls.append(module)
        return real(module, *args, **kwargs)

    merged_copy.merged_weight = counted
    try:
        drawn = []
        for lm in (one, many):
            drawn.append(sample(lm, "static", [ids[0, :6].tolist()], [0], max_new_tokens=4, temperature=0.0,
                                top_p=1.0, stop_ids=[], pad_id=0, copy=policy))
            drawn.append(len(calls))
    finally:
        merged_copy.merged_weight = real
    return {"sampled_linears": [drawn[1], drawn[3] - drawn[1]], "sampled_same": drawn[0] == drawn[2]}


if __name__ == "__main__":
    flags = sys.argv[3:]
    main(Path(sys.argv[1]), *sys.argv[2:3], lora="lora" in flags or "dora" in flags, dora="dora" in flags,
         merged="merged" in flags, compiled="compile" in flags)
    from llmtrain.cli import exit_now

    exit_now(0)  # as a launched run leaves: no interpreter teardown for a gloo thread to abort (pytorch#179291)
