"""Online RL's learned rewards (rl.rewards of type reward_model) in the estimate: what each adds to the step.

Each reward model is a frozen one-output sequence-classification model that every process reads whole onto its
device before the policy loads (model/score.load_reward_model: never sharded, in the dtype it was saved in; a LoRA
adapter on its base, loaded in the base's saved dtype), so it is on every GPU for the whole run. It scores each
micro-batch's completions right after they are sampled, inside the sampler's phase (objectives/grpo.rollout), in
batches of its batch_size, right-padded to the longest (objectives/learned_reward): one forward under no_grad, a
layer's transients at a time, as evaluation's (activations.eval_layer_bytes over batch_size x the sequence).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmtrain.memory import activations as act
from llmtrain.memory.params import ModelShape, load_model_shape, read_config, score_head_shape
from llmtrain.memory.spec import DTYPE_BYTES, TrainSpec


@dataclass(frozen=True)
class RewardModel:
    """A reward_model reward as the estimate counts it: its shape (under its score head), its weights' bytes on
    each GPU, their dtype and the completions it scores at once. shape None: the folder is not there to read (not
    counted, and said)."""

    source: str
    shape: ModelShape | None
    weight_bytes: int
    dtype: str
    batch_size: int


def _saved_dtype(config: dict) -> str:
    """The dtype `from_pretrained(dtype="auto")` loads a model in: its config's (float32 where it names none)."""
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return dtype if dtype in DTYPE_BYTES else "float32"


def reward_models_of(recipe) -> tuple[RewardModel, ...]:
    """The recipe's reward models, read from their folders (config.json, or a LoRA adapter's base config and its
    adapter's file); a folder that is not there to read (the estimate made before it is trained) with no shape."""
    from llmtrain.config import adapter_base

    found = []
    for reward in (recipe.rl.rewards if recipe.rl is not None else []):
        if reward.type != "reward_model" or reward.path is None:
            continue
        folder = Path(reward.path).expanduser()
        adapter = folder / "adapter_config.json"
        config = folder / "config.json"
        if not adapter.is_file() and not config.is_file():
            found.append(RewardModel(reward.path, None, 0, "float32", reward.batch_size))
            continue
        extra = 0
        if adapter.is_file():  # its base as saved, and the adapter's own weights (the score head among them)
            base = adapter_base(folder)
            shape, dtype = load_model_shape(base), _saved_dtype(read_config(base)[0])
            extra = sum(f.stat().st_size for f in folder.glob("adapter_model*.safetensors"))
        else:
            shape, dtype = load_model_shape(str(folder)), _saved_dtype(json.loads(config.read_text()))
        shape = shape if shape.score_head else score_head_shape(shape)
        found.append(RewardModel(reward.path, shape, shape.params_total * DTYPE_BYTES[dtype] + extra, dtype,
                                 reward.batch_size))
    return tuple(found)


def add_reward_models(phases: dict[str, dict[str, int]], spec: TrainSpec, *, rows: int) -> None:
    """Each phase with the reward models' weights, and their scoring as a phase of its own: the sampler's phase
    (`phases["generation"]`) less its KV cache, logits and transients (what is alive once the sampler has returned),
    beside the reward models' weights and the largest one's forward over min(batch_size, `rows`) completions of the
    run's sequence length."""
    weights = sum(r.weight_bytes for r in spec.reward_models)
    for parts in phases.values():
        parts["reward_models"] = weights
    forward = 0
    for r in (r for r in spec.reward_models if r.shape is not None):
        b = DTYPE_BYTES[r.dtype]
        # right-padded rows with their mask, in the model's own dtype (no autocast around the scoring)
        p = act.Pass(rows=min(r.batch_size, rows), row_len=spec.seq_len, resid=b, cd=b, autocast=False, attn="sdpa",
                     mask=True, trainable_base=False)
        # the logits of transformers' own forward: one per token ([batch, width, 1]), and the final hidden states
        forward = max(forward, max(act.eval_layer_bytes(p, r.shape.layer(i), {}) for i in range(r.shape.layers))
                      + p.tokens * r.shape.hidden * b)
    # the sampler's cache and its merged copy are freed when it returns; under FSDP the units stay gathered
    sampler = {k: v for k, v in phases["generation"].items() if k not in ("logits", "temporaries", "kv_cache")}
    phases["reward_scoring"] = {**sampler, "temporaries": forward}


def reward_model_notes(spec: TrainSpec) -> list[str]:
    """What the estimate counted of each reward model, or why it could not."""
    return [f"the reward model {r.source} (rl.rewards): {r.shape.params_total / 1e9:,.2f}B parameters in {r.dtype}, "
            f"whole on every GPU (never sharded), scoring {r.batch_size} completions at once after each sampling"
            if r.shape is not None else
            f"the reward model {r.source} (rl.rewards) is not there to read: its weights and forward are not counted"
            for r in spec.reward_models]
