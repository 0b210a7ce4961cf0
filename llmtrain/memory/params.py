"""The model side of the estimate: read a config.json, count parameters exactly, and count LoRA's.

Counts come from the real architecture built on the meta device (no memory, no weights), so tied
embeddings, the LM head and grouped-query attention are counted as transformers builds them. The
few shapes the activation formulas need are read off the same meta model, and so is what sets each family's
decoder layer apart from Llama's (FAMILIES): QK-norm (Qwen3, Gemma 3), Gemma's fp32 (1 + w) RMSNorm, four of them a
layer and a second RoPE (Gemma 3), fused q/k/v and gate/up projections and partial RoPE (Phi-3, Phi-4).
"""

from __future__ import annotations

import functools
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llmtrain import capabilities
from llmtrain.errors import LLMTrainError
from llmtrain.hub import is_local_path

# The decoder families the estimate models, each by its real layer (activations.py), and what a user calls them.
# the capability table's families whose decoder layer llmtrain models
FAMILIES = {key: family.name for key, family in capabilities.FAMILIES.items() if family.layer}
SUPPORTED_TYPES = tuple(FAMILIES)

_LLAMA_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
                 "eos_token_id": 2}
# What Gemma 3's text models (4B, 12B) share: their head size, vocabulary, local window and norms.
_GEMMA3_COMMON = {"model_type": "gemma3_text", "head_dim": 256, "vocab_size": 262208,
                  "max_position_embeddings": 131072, "sliding_window": 1024, "query_pre_attn_scalar": 256,
                  "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
                  "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 106}
# Built-in configs (as in the models' config.json), so the well-known models work offline.
PRESETS: dict[str, dict] = {
    "llama-2-7b": {**_LLAMA_COMMON, "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                   "vocab_size": 32000, "max_position_embeddings": 4096, "rope_theta": 10000.0},
    "llama-3-8b": {**_LLAMA_COMMON, "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
                   "bos_token_id": 128000, "eos_token_id": 128001},
    "mistral-7b": {**_LLAMA_COMMON, "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "vocab_size": 32768, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                   "sliding_window": None},
    # The families people start from in 2026, as their hub config.json has them (the shapes; RoPE scaling, which
    # changes no byte, left out: the context a model was trained at is max_position_embeddings).
    "llama-3.2-3b": {**_LLAMA_COMMON, "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
                     "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
                     "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
                     "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128009},
    "qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
                 "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False,
                   "bos_token_id": 151643, "eos_token_id": 151645},
    "gemma-3-4b": {**_GEMMA3_COMMON, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                   "num_attention_heads": 8, "num_key_value_heads": 4},
    "gemma-3-12b": {**_GEMMA3_COMMON, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
                    "num_attention_heads": 16, "num_key_value_heads": 8},
    "phi-4": {"model_type": "phi3", "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40,
              "num_attention_heads": 40, "num_key_value_heads": 10, "vocab_size": 100352,
              "max_position_embeddings": 16384, "rope_theta": 250000.0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "hidden_act": "silu", "sliding_window": None,
              "bos_token_id": 100257, "eos_token_id": 100265, "pad_token_id": 100349},
    "phi-4-mini": {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
                   "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
                   "max_position_embeddings": 131072, "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
                   "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
                   "sliding_window": 262144, "bos_token_id": 199999, "eos_token_id": 199999,
                   "pad_token_id": 199999},
}
# Hub ids whose config.json is exactly a preset's (for the shapes that matter here), so the shipped
# recipes can be estimated without network access.
HUB_ALIASES = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b", "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b",
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    # Llama 3.1 8B: Llama 3 8B's shapes (its longer context changes no estimate; doctor reads it: ALIAS_CONTEXT)
    "meta-llama/Llama-3.1-8B": "llama-3-8b", "meta-llama/Llama-3.1-8B-Instruct": "llama-3-8b",
    "mistralai/Mistral-7B-v0.3": "mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3": "mistral-7b",
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
    "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen3-8B-Base": "qwen3-8b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
    "google/gemma-3-4b-it": "gemma-3-4b", "google/gemma-3-4b-pt": "gemma-3-4b",
    "google/gemma-3-12b-it": "gemma-3-12b", "google/gemma-3-12b-pt": "gemma-3-12b",
    "microsoft/phi-4": "phi-4", "microsoft/Phi-4-mini-instruct": "phi-4-mini",
}
# An alias's max_position_embeddings where it is not its preset's (Llama 3.1: 131072 with llama3 rope scaling).
ALIAS_CONTEXT = {"meta-llama/Llama-3.1-8B": 131072, "meta-llama/Llama-3.1-8B-Instruct": 131072}


@dataclass(frozen=True)
class Linear:
    """One linear layer of a decoder layer, e.g. name='self_attn.q_proj'."""

    name: str
    fan_in: int
    fan_out: int
    bias: bool

    @property
    def numel(self) -> int:
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """What the estimator needs to know about a model; counts are exact (meta-device model)."""

    source: str  # what was asked for: a path, a preset or a hub id, and where its config came from
    model_type: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    sliding_window: int | None
    layer_linears: tuple[Linear, ...]
    params_per_layer: int
    params_embed: int
    params_head: int  # 0 when the LM head is tied to the embeddings
    params_final_norm: int
    score_head: bool = False  # a reward model's one-output score head in place of the LM head (score_head_shape)
    max_positions: int | None = None  # config.json's max_position_embeddings: the context it was trained at
    # What sets a family's layer apart from Llama's (read off the meta model in _shape_from_json):
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # Gemma's RMSNorm: all in fp32, (1 + w), and four a layer (around attention and MLP)
    rope_sets: int = 1  # cos/sin pairs a forward makes and every layer of its kind saves (Gemma 3: local, global)
    rope_dim: int | None = None  # the rotated part of a head (Phi-4-mini's partial RoPE); None: the whole head
    masks: int = 1  # 4-D masks sdpa/eager get (Gemma 3 builds a causal one and a sliding-window one)
    # Under tensor parallelism by a gathered plan (Phi's fused layers; tensor_parallel_shape): the elements a token
    # all-gathers in one layer's forward and in its backward
    tp_gathers: tuple[int, int] = (0, 0)

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def input_linears(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The linears reading the attention's input and the MLP's: q/k/v and gate/up, or Phi's fused qkv_proj and
        gate_up_proj."""
        attn = tuple(x.name for x in self.layer_linears if x.name.startswith("self_attn.") and
                     not x.name.endswith("o_proj"))
        mlp = tuple(x.name for x in self.layer_linears if x.name.startswith("mlp.") and
                    not x.name.endswith("down_proj"))
        return attn, mlp

    @property
    def fused_qkv(self) -> bool:
        return self.input_linears[0] == ("self_attn.qkv_proj",)

    @property
    def head_outputs(self) -> int:
        """Outputs of the head the loss runs: the vocabulary (the LM head), or 1 (a reward model's score head)."""
        return 1 if self.score_head else self.vocab

    @property
    def params_total(self) -> int:
        return self.params_embed + self.params_head + self.params_final_norm + self.layers * self.params_per_layer

    @property
    def linear_params_per_layer(self) -> int:
        return sum(lin.numel for lin in self.layer_linears)


def score_head_shape(shape: ModelShape) -> ModelShape:
    """A reward model of `shape` (the reward_model: section; AutoModelForSequenceClassification, num_labels=1): the
    same decoder under a `score` Linear of hidden size x 1, no bias, in place of the LM head, and read at one token a
    sequence (model/score.py); embeddings tied to the LM head are then the embeddings alone."""
    from dataclasses import replace

    return replace(shape, source=f"{shape.source}, under a one-output score head", score_head=True, tied=False,
                   params_head=shape.hidden)


def tensor_parallel_shape(shape: ModelShape, tp: int) -> ModelShape:
    """What one GPU of a tensor-parallel group holds and runs: every decoder layer with the model's TP plan applied
    (transformers' base_model_tp_plan, as llmtrain's tensor.apply_tensor_parallel applies it): the column-wise
    layers (q/k/v, gate/up) keep fan_out / tp outputs, the row-wise ones (o, down) fan_in / tp inputs, so a layer has
    heads / tp query and KV heads and intermediate / tp MLP columns. The embeddings, norms and LM head stay whole.

    Phi's plan gathers its fused qkv_proj's and gate_up_proj's outputs (colwise_gather_output, rowwise_split_input
    after them): the weights are split the same way, but attention and the MLP run whole on every GPU (its heads and
    intermediate stay the model's), and `tp_gathers` counts the elements a token all-gathers a layer."""
    if tp == 1:
        return shape
    from dataclasses import replace

    from transformers import CONFIG_MAPPING

    plan = CONFIG_MAPPING[shape.model_type].base_model_tp_plan
    style = {pattern.rsplit("*.", 1)[-1]: how for pattern, how in plan.items()}  # 'self_attn.q_proj' -> 'colwise'
    cut = {"colwise": "out", "colwise_gather_output": "out", "rowwise": "in", "rowwise_split_input": "in"}
    local = tuple(Linear(lin.name, lin.fan_in, lin.fan_out // tp, lin.bias) if cut.get(style.get(lin.name)) == "out"
                  else Linear(lin.name, lin.fan_in // tp, lin.fan_out, lin.bias) if cut.get(style.get(lin.name)) == "in"
                  else lin for lin in shape.layer_linears)
    linear = sum(lin.numel for lin in local)
    sliced = replace(shape, source=f"{shape.source}, 1/{tp} tensor-parallel slice", layer_linears=local,
                     params_per_layer=shape.params_per_layer - shape.linear_params_per_layer + linear)
    if "colwise_gather_output" in style.values():  # forward: the fused outputs; backward: the gradients of the inputs
        # the row-wise layers sliced (their input's gradient is gathered whole again)
        return replace(sliced, tp_gathers=(
            sum(lin.fan_out for lin in shape.layer_linears if style.get(lin.name) == "colwise_gather_output"),
            sum(lin.fan_in for lin in shape.layer_linears if style.get(lin.name) == "rowwise_split_input")))
    return replace(sliced, intermediate=shape.intermediate // tp, heads=shape.heads // tp,
                   kv_heads=shape.kv_heads // tp)


@dataclass(frozen=True)
class LoraPlan:
    """Where LoRA adapters go: adapted[i] maps linear name -> (fan_in, fan_out) in decoder layer i."""

    r: int
    adapted: tuple[dict[str, tuple[int, int]], ...]
    adapted_head: bool  # an adapter on lm_head (only when targeted by name)
    saved_copies: tuple[str, ...]  # modules_to_save: trained in full as a copy beside the frozen original

    def adapter_params(self, shape: ModelShape) -> int:
        per_layers = sum(self.r * (i + o) for layer in self.adapted for i, o in layer.values())
        return per_layers + (self.r * (shape.hidden + shape.vocab) if self.adapted_head else 0)

    def copy_params(self, shape: ModelShape) -> int:
        return sum(shape.hidden * shape.vocab for _ in self.saved_copies)

    def trainable(self, shape: ModelShape) -> int:
        return self.adapter_params(shape) + self.copy_params(shape)


def _matches(full_name: str, targets: str | tuple[str, ...]) -> bool:
    """peft's rule: a list matches a module whose name ends in '.<target>'; a string is a full regex."""
    if isinstance(targets, str):
        return re.fullmatch(targets, full_name) is not None
    return any(full_name == t or full_name.endswith("." + t) for t in targets)


def lora_plan(shape: ModelShape, *, r: int, targets: str | tuple[str, ...] = "all-linear",
              modules_to_save: tuple[str, ...] = ()) -> LoraPlan:
    """Which linears get adapters, as peft decides; 'all-linear' is every linear but the LM head."""
    adapted = []
    for i in range(shape.layers):
        names = {lin.name: (lin.fan_in, lin.fan_out) for lin in shape.layer_linears
                 if targets == "all-linear" or _matches(f"model.layers.{i}.{lin.name}", targets)}
        adapted.append(names)
    head = targets != "all-linear" and _matches("lm_head", targets)
    if not head and not any(adapted):
        raise LLMTrainError(f"lora.target_modules {targets!r} matches no linear layer of this model; "
                            f"its decoder layers have {', '.join(lin.name for lin in shape.layer_linears)}.")
    unknown = [m for m in modules_to_save if m not in ("lm_head", "embed_tokens")]
    if unknown:
        raise LLMTrainError(f"estimate-memory handles lora.modules_to_save of lm_head and embed_tokens only "
                            f"(got {unknown}).")
    return LoraPlan(r=r, adapted=tuple(adapted), adapted_head=head, saved_copies=tuple(modules_to_save))


# --------------------------------------------------------------------------- reading a config


def reads_hub(name_or_path: str) -> bool:
    """Whether read_config asks the hub (or its local cache) for this name: not a local directory or file, a
    preset, a built-in config, or a path that is missing."""
    return not (Path(name_or_path).expanduser().exists() or name_or_path.lower() in PRESETS
                or name_or_path in HUB_ALIASES or is_local_path(name_or_path))


def read_config(name_or_path: str) -> tuple[dict, str]:
    """The config.json dict and where it came from: a local dir/file, a preset, or the hub (or its cache)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text()), str(path)
        except (OSError, ValueError) as e:
            raise LLMTrainError(f"'{path}' is not a readable config.json: {e}.") from None
    key = name_or_path.lower()
    if key in PRESETS:
        return dict(PRESETS[key]), f"built-in preset {key}"
    if name_or_path in HUB_ALIASES:
        context = {"max_position_embeddings": ALIAS_CONTEXT[name_or_path]} if name_or_path in ALIAS_CONTEXT else {}
        return {**PRESETS[HUB_ALIASES[name_or_path]], **context}, f"built-in config of {name_or_path}"
    hint = (f"Give a directory with config.json, a config.json file, a preset ({', '.join(PRESETS)}) "
            "or a hub id in the local Hugging Face cache.")
    if is_local_path(name_or_path):
        raise LLMTrainError(f"no model config at '{name_or_path}': no such directory or file. {hint}")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name_or_path).to_dict(), f"hub {name_or_path}"
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LLMTrainError(f"could not read a model config for '{name_or_path}' ({first}). {hint}") from None


def hf_config(model_type: str, cfg_dict: dict, source: str):
    """transformers' config of model_type from a config.json's fields; one it cannot build is refused naming
    `source`."""
    from transformers import AutoConfig

    kwargs = {k: v for k, v in cfg_dict.items() if k not in ("model_type", "architectures", "transformers_version")}
    with _transformers_quiet():
        try:
            return AutoConfig.for_model(model_type, **kwargs)
        except (TypeError, ValueError) as e:
            raise LLMTrainError(f"the config from {source} does not build a model: {e}") from None


def meta_model(config, source: str):
    """The causal LM `config` describes, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with _transformers_quiet(), torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except (TypeError, ValueError) as e:
            raise LLMTrainError(f"the config from {source} does not build a model: {e}") from None


@contextmanager
def _transformers_quiet():
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


@functools.lru_cache(maxsize=32)
def _shape_from_json(config_json: str, source: str) -> ModelShape:
    from torch import nn

    cfg_dict = json.loads(config_json)
    model_type = cfg_dict.get("model_type")
    if model_type == "gemma3" and isinstance(cfg_dict.get("text_config"), dict):  # the multimodal checkpoint's text
        cfg_dict, model_type = {**cfg_dict["text_config"], "model_type": "gemma3_text"}, "gemma3_text"
    if model_type not in SUPPORTED_TYPES:
        raise LLMTrainError(f"estimate-memory models the decoder layers of {', '.join(FAMILIES.values())}; {source} "
                            f"has model_type {model_type!r}, whose layer it does not know, so it makes no estimate "
                            "(training it may still work: `llmtrain doctor` and a short run say).")
    config = hf_config(model_type, cfg_dict, source)
    model = meta_model(config, source)
    layers = model.model.layers
    layer0 = layers[0]
    linears = tuple(Linear(n, m.in_features, m.out_features, m.bias is not None)
                    for n, m in layer0.named_modules() if isinstance(m, nn.Linear))
    per_layer = sum(p.numel() for p in layer0.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = head is embed
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rotary = int(head_dim * getattr(config, "partial_rotary_factor", 1.0) or head_dim)
    kinds = set(getattr(config, "layer_types", None) or ())
    gemma = model_type == "gemma3_text"
    shape = ModelShape(
        source=source, model_type=model_type, vocab=embed.shape[0], hidden=embed.shape[1],
        intermediate=config.intermediate_size, layers=len(layers), heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim, tied=tied,
        # a window where some layer applies one (Qwen2's config names one its layers do not use)
        sliding_window=None if kinds == {"full_attention"} and model_type != "mistral" else
        getattr(config, "sliding_window", None),
        layer_linears=linears, params_per_layer=per_layer, params_embed=embed.numel(),
        params_head=0 if tied else head.numel(),
        params_final_norm=sum(p.numel() for p in model.model.norm.parameters()),
        max_positions=getattr(config, "max_position_embeddings", None),
        qk_norm=hasattr(layer0.self_attn, "q_norm"), gemma_norms=gemma,
        rope_sets=max(1, len(kinds)) if gemma else 1, rope_dim=rotary if rotary != head_dim else None,
        masks=2 if gemma else 1,
    )
    total = sum(p.numel() for p in model.parameters())
    uniform = all(sum(p.numel() for p in layer.parameters()) == per_layer for layer in layers)
    if total != shape.params_total or not uniform:  # a layout the per-layer formulas would get wrong
        raise LLMTrainError(f"{source}: unexpected parameter layout ({total:,} parameters counted, "
                            f"{shape.params_total:,} from embeddings + layers + head).")
    return shape


def load_model_shape(name_or_path: str) -> ModelShape:
    """Read a model's config (path, preset or hub id) and count it exactly on the meta device."""
    cfg, source = read_config(name_or_path)
    return _shape_from_json(json.dumps(cfg, sort_keys=True, default=str), f"{name_or_path} ({source})")


def recipe_model_shape(recipe) -> ModelShape:
    """The model a recipe trains: model.name_or_path's, under a score head where it trains a reward model."""
    shape = load_model_shape(recipe.model.name_or_path)
    return score_head_shape(shape) if recipe.reward_model is not None else shape
