"""Online RL's learned rewards (rl.rewards of type reward_model) in the estimate: what each adds to the step.

Each reward model is a frozen one-output sequence-classification model that every process reads whole onto its
device before the policy loads (model/score.load_reward_model: never sharded, in the dtype it was saved in; a LoRA
adapter on its base, loaded in the base's saved dtype, or in 4 bits where a QLoRA run trained it), so it is on every
GPU for the whole run. It scores each
micro-batch's completions right after they are sampled, inside the sampler's phase (objectives/grpo.rollout), in
batches of its batch_size, right-padded to the longest (objectives/learned_reward): one forward under no_grad, a
layer's transients at a time, as evaluation's (activations.eval_layer_bytes over batch_size x the sequence).
"""

from __future__ import annotations

from llmtrain.memory import activations as act
from llmtrain.memory.params import RewardModel
from llmtrain.memory.spec import DTYPE_BYTES, QUANT_BYTES_PER_WEIGHT, TrainSpec


def weight_bytes(r: RewardModel) -> int:
    """A reward model's weights on each GPU: the model in its saved dtype (a QLoRA run's: its linears in 4 bits, the
    rest in its model.dtype), and a LoRA adapter's file beside."""
    if r.shape is None:
        return 0
    quantized = r.shape.linear_params_total if r.quantize else 0
    return (round(quantized * QUANT_BYTES_PER_WEIGHT) + (r.shape.params_total - quantized) * DTYPE_BYTES[r.dtype]
            + r.adapter_bytes)


def add_reward_models(phases: dict[str, dict[str, int]], spec: TrainSpec, *, rows: int) -> None:
    """Each phase with the reward models' weights, and their scoring as a phase of its own: the sampler's phase
    (`phases["generation"]`) less its KV cache, logits and transients (what is alive once the sampler has returned),
    beside the reward models' weights and the largest one's forward over min(batch_size, `rows`) completions of the
    run's sequence length."""
    weights = sum(map(weight_bytes, spec.reward_models))
    for parts in phases.values():
        parts["reward_models"] = weights
    forward = 0
    for r in (r for r in spec.reward_models if r.shape is not None):
        b = DTYPE_BYTES[r.dtype]
        # right-padded rows with their mask, in the model's own dtype (no autocast around the scoring)
        p = act.Pass(rows=min(r.batch_size, rows), row_len=spec.seq_len, resid=b, cd=b, autocast=False, attn="sdpa",
                     mask=True, trainable_base=False)
        # a 4-bit base: bitsandbytes dequantises each linear's weight for its matmul, the largest one at a time
        dequantized = max(lin.numel for i in range(r.shape.layers) for lin in r.shape.layer(i).layer_linears) * b \
            if r.quantize else 0
        # the logits of transformers' own forward: one per token ([batch, width, 1]), and the final hidden states
        forward = max(forward, max(act.eval_layer_bytes(p, r.shape.layer(i), {}) for i in range(r.shape.layers))
                      + p.tokens * r.shape.hidden * b + dequantized)
    # the sampler's cache and its merged copy are freed when it returns; under FSDP the units stay gathered
    sampler = {k: v for k, v in phases["generation"].items() if k not in ("logits", "temporaries", "kv_cache")}
    phases["reward_scoring"] = {**sampler, "temporaries": forward}


def reward_model_notes(spec: TrainSpec) -> list[str]:
    """What the estimate counted of each reward model, or why it could not."""
    return [f"the reward model {r.source} (rl.rewards): {r.shape.params_total / 1e9:,.2f}B parameters in "
            + (f"4 bits ({r.quantize}, as its QLoRA run held them; the rest in {r.dtype})" if r.quantize else r.dtype)
            + ", "
            f"whole on every GPU (never sharded), scoring {r.batch_size} completions at once after each sampling"
            if r.shape is not None else
            f"the reward model {r.source} (rl.rewards) is not there to read: its weights and forward are not counted"
            for r in spec.reward_models]
