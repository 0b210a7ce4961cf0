"""The model side of the estimate: read a config.json, count parameters exactly, and count LoRA's.

Counts come from the real architecture built on the meta device (no memory, no weights), so tied
embeddings, the LM head and grouped-query attention are counted as transformers builds them. The
few shapes the activation formulas need are read off the same meta model, and so is what sets each family's
decoder layer apart from Llama's (FAMILIES): QK-norm (Qwen3, Gemma 3), Gemma's fp32 (1 + w) RMSNorm, four of them a
layer and a second RoPE (Gemma 3), fused q/k/v and gate/up projections and partial RoPE (Phi-3, Phi-4), a router and
experts in place of the MLP (Qwen3-MoE, Mixtral: `Experts`), layers that are not all alike and per-layer inputs (Gemma
4: `ModelShape.layer_shapes`, `per_layer_input`). What LoRA adapts of a mixture of experts is peft's own
answer, read off peft applied to one layer on the meta device (`_peft_adapted`).
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from llmtrain import capabilities
from llmtrain.errors import LLMTrainError
from llmtrain.hub import is_local_path

# The decoder families the estimate models, each by its real layer (activations.py), and what a user calls them.
# the capability table's families whose decoder layer llmtrain models
FAMILIES = {key: family.name for key, family in capabilities.FAMILIES.items() if family.estimate}
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
    # mixtures of experts: the router and its experts in place of the MLP (Experts)
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                      "bos_token_id": 151643, "eos_token_id": 151645},
    "mixtral-8x7b": {**_LLAMA_COMMON, "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None},
    # GPT-OSS (its config.json less the MXFP4 quantization_config: the estimate counts the experts in model.dtype,
    # as they train, dequantized): attention sinks, a window of 128 on every other layer, 32 or 128 experts, 4 a token
    "gpt-oss-20b": {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
                    "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
                    "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                             "beta_slow": 1.0, "truncate": False,
                                                             "original_max_position_embeddings": 4096},
                    "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
                    "hidden_act": "silu", "eos_token_id": 200002, "pad_token_id": 199999},
}
PRESETS["gpt-oss-120b"] = {**PRESETS["gpt-oss-20b"], "num_hidden_layers": 36, "num_local_experts": 128,
                           "layer_types": ["sliding_attention", "full_attention"] * 18}
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
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B-Base": "qwen3-30b-a3b",
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
    "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
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
class Experts:
    """A mixture of experts' MLP (Qwen3-MoE, Mixtral), as transformers runs it: a router (`mlp.gate`, an experts x
    hidden weight) scores every expert, keeps the top_k a token, and the token-expert pairs, sorted by expert, run
    through all experts' SwiGLUs at once (grouped_mm over two 3-D parameters: gate_up_proj, experts x 2I x H, and
    down_proj, experts x H x I)."""

    count: int
    top_k: int
    intermediate: int  # I: one expert's MLP columns
    normalised: bool  # the top_k weights are divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    fp32_weights: bool  # the routing weights stay fp32 (Mixtral), or are cast to the router's dtype (Qwen3-MoE)
    # GPT-OSS's: its router (`mlp.router`) has a bias and takes the softmax of the top_k logits only; each expert's
    # gate_up_proj and down_proj have a bias; its gate is a clamped SwiGLU, (clamp(up) + 1) * g * sigmoid(1.702 g)
    # with g = clamp(gate), on the interleaved halves of gate_up_proj's output
    router: str = "mlp.gate"
    biases: bool = False
    clamped_gate: bool = False
    # Gemma 4's (enable_moe_block): the experts at `experts.*` beside each layer's dense MLP, on the layer's residual
    # normed again, their output normed and added to the MLP's (normed too); its router a linear of the layer
    # (router.proj, in layer_linears) after a weightless norm and a learned scale, the top_k of the softmax renormalised
    # and scaled per expert; gelu on the gate
    prefix: str = "mlp.experts"
    beside: bool = False
    # Under tensor parallelism, the experts a GPU holds (parallel/tensor._split_experts splits them by expert; the
    # router stays whole): 0, all of them
    held: int = 0

    @property
    def local(self) -> int:
        """The experts whose weights this GPU holds and runs."""
        return self.held or self.count

    @property
    def gate_up(self) -> str:
        return f"{self.prefix}.gate_up_proj"

    @property
    def down(self) -> str:
        return f"{self.prefix}.down_proj"

    def pairs(self, tokens: int) -> int:
        """S: the token-expert pairs the experts run for `tokens` tokens."""
        return tokens * self.top_k

    def params(self, hidden: int) -> dict[str, int]:
        """Weights of one layer's router and experts, by parameter (their biases with them)."""
        e, i, b = self.count, self.intermediate, self.biases
        return {self.router: e * hidden + e * b, self.gate_up: self.local * 2 * i * (hidden + b),
                self.down: self.local * hidden * (i + b)}


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
    rope_width: int | None = None  # cos and sin's last dimension where it is not rotary_dim (GPT-OSS: half of it)
    masks: int = 1  # 4-D masks sdpa/eager get (Gemma 3, GPT-OSS build a causal one and a sliding-window one)
    sinks: bool = False  # a learned logit per head in every softmax of attention (GPT-OSS)
    logit_cap: bool = False  # the logits capped, cap tanh(x / cap) (final_logit_softcapping: Gemma 4's checkpoints)
    # Under tensor parallelism by a gathered plan (Phi's fused layers; tensor_parallel_shape): the elements a token
    # all-gathers in one layer's forward and in its backward
    tp_gathers: tuple[int, int] = (0, 0)
    experts: Experts | None = None  # a mixture of experts in place of the MLP (its layer_linears: attention's)
    config_json: str = field(default="", repr=False, compare=False)  # what it was read from (for peft, _peft_adapted)
    # Layers that are not all alike (Gemma 4): each layer's own shape (heads, kv_heads, head_dim, intermediate,
    # layer_linears, params_per_layer and the flags below), `layer(i)`; () where every layer is this shape's
    layer_shapes: tuple[ModelShape, ...] = field(default=(), repr=False)
    # Gemma 4's layer: its keys and values are an earlier layer's (kv sharing: no k/v projections or norms of its own)
    kv_shared: bool = False
    k_eq_v: bool = False  # its values are its keys' projection (attention_k_eq_v's global layers: no v_proj)
    v_norm: bool = False  # an RMSNorm without a weight over each head of v (Gemma 4)
    # Gemma 4's per-layer embeddings (PLE): per_layer_input values a token a layer, from a second embedding table and a
    # projection of the embeddings (made once, for all layers: `other_linears`), gated into each layer's output
    per_layer_input: int = 0
    params_other: int = 0  # weights outside the decoder layers, the embeddings, the final norm and the head (PLE's)
    other_linears: tuple[Linear, ...] = ()  # linears among them (peft's all-linear reaches them)
    # Gemma 4's KV sharing on pipeline stages: the key and value elements a token that cross the boundary before
    # decoder layer b (b = 0 .. layers), those its store layers made for sharing layers after it (stage.kv_handoffs)
    kv_handed: tuple[int, ...] = ()

    def layer(self, i: int) -> ModelShape:
        """Decoder layer i's shape: its own where the layers differ (layer_shapes), else this one."""
        return self.layer_shapes[i] if self.layer_shapes else self

    def summed(self, per_layer) -> int:
        """per_layer(layer shape), summed over the decoder layers (each its own where they differ)."""
        return sum(per_layer(self.layer(i)) for i in range(self.layers))

    @property
    def layer_params_total(self) -> int:
        """Weights of all decoder layers."""
        return self.summed(lambda layer: layer.params_per_layer)

    @property
    def layer_linear_params_total(self) -> int:
        """Weights of the decoder layers' linears."""
        return self.summed(lambda layer: layer.linear_params_per_layer)

    @property
    def linear_params_total(self) -> int:
        """Weights of every linear layer but the head: the decoder layers' and those outside them (other_linears)."""
        return self.layer_linear_params_total + sum(lin.numel for lin in self.other_linears)

    @property
    def active_params_total(self) -> int:
        """The matrix weights a token goes through in the decoder layers (active_params_per_layer, summed)."""
        return self.summed(lambda layer: layer.active_params_per_layer)

    @property
    def attention_width_total(self) -> int:
        """Query heads x head size, summed over the decoder layers (attention's FLOPs a query-key pair, / 6)."""
        return self.summed(lambda layer: layer.heads * layer.head_dim)

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
        return self.params_embed + self.params_head + self.params_final_norm + self.params_other + \
            self.layer_params_total

    @property
    def linear_params_per_layer(self) -> int:
        return sum(lin.numel for lin in self.layer_linears)

    @property
    def active_params_per_layer(self) -> int:
        """The matrix weights a token goes through in a decoder layer: its linears, and a mixture of experts' router
        and top_k of its experts."""
        if self.experts is None:
            return self.linear_params_per_layer
        e = self.experts
        moe = e.params(self.hidden)
        router = 0 if e.beside else moe[e.router]  # (Gemma 4's router is one of the layer's linears)
        return self.linear_params_per_layer + router + (moe[e.gate_up] + moe[e.down]) * e.top_k // e.count


def score_head_shape(shape: ModelShape) -> ModelShape:
    """A reward model of `shape` (the reward_model: section; AutoModelForSequenceClassification, num_labels=1): the
    same decoder under a `score` Linear of hidden size x 1, no bias, in place of the LM head, and read at one token a
    sequence (model/score.py); embeddings tied to the LM head are then the embeddings alone."""
    from dataclasses import replace

    return replace(shape, source=f"{shape.source}, under a one-output score head", score_head=True, tied=False,
                   params_head=shape.hidden)


def tensor_parallel_shape(shape: ModelShape, tp: int) -> ModelShape:
    """What one GPU of a tensor-parallel group holds and runs: every decoder layer with the model's TP plan applied
    (capabilities.tensor_plan, as llmtrain's tensor.apply_tensor_parallel applies it): the column-wise
    layers (q/k/v, gate/up) keep fan_out / tp outputs, the row-wise ones (o, down) fan_in / tp inputs, so a layer has
    heads / tp query and KV heads and intermediate / tp MLP columns. The embeddings, norms and LM head stay whole.

    Phi's plan gathers its fused qkv_proj's and gate_up_proj's outputs (colwise_gather_output, rowwise_split_input
    after them): the weights are split the same way, but attention and the MLP run whole on every GPU (its heads and
    intermediate stay the model's), and `tp_gathers` counts the elements a token all-gathers a layer."""
    if tp == 1:
        return shape
    from dataclasses import replace

    if shape.layer_shapes:  # each layer's own slice (Gemma 4), from its own heads and columns
        layers = tuple(tensor_parallel_shape(replace(layer, layer_shapes=()), tp) for layer in shape.layer_shapes)
        return replace(layers[0], layer_shapes=layers, params_other=shape.params_other,
                       other_linears=shape.other_linears, per_layer_input=shape.per_layer_input)

    style = _tp_styles(shape.model_type)
    cut = {"colwise": "out", "colwise_gather_output": "out", "rowwise": "in", "rowwise_split_input": "in"}
    local = tuple(Linear(lin.name, lin.fan_in, lin.fan_out // tp, lin.bias) if cut.get(style.get(lin.name)) == "out"
                  else Linear(lin.name, lin.fan_in // tp, lin.fan_out, lin.bias) if cut.get(style.get(lin.name)) == "in"
                  else lin for lin in shape.layer_linears)
    linear = sum(lin.numel for lin in local)
    experts, moe = shape.experts, 0
    if experts is not None:  # split by expert: each GPU holds count / tp of them whole, the router whole, and runs
        # every token-expert pair's rows (another GPU's expert's are zeros: the activations keep their size)
        experts = replace(experts, held=experts.count // tp)
        moe = sum(shape.experts.params(shape.hidden).values()) - sum(experts.params(shape.hidden).values())
    sinks = shape.heads - shape.heads // tp if shape.sinks else 0  # GPT-OSS's: one a query head, split with them
    sliced = replace(shape, source=f"{shape.source}, 1/{tp} tensor-parallel slice", layer_linears=local,
                     params_per_layer=shape.params_per_layer - shape.linear_params_per_layer + linear - moe - sinks,
                     experts=experts)
    if "colwise_gather_output" in style.values():  # forward: the fused outputs; backward: the gradients of the inputs
        # the row-wise layers sliced (their input's gradient is gathered whole again)
        return replace(sliced, tp_gathers=(
            sum(lin.fan_out for lin in shape.layer_linears if style.get(lin.name) == "colwise_gather_output"),
            sum(lin.fan_in for lin in shape.layer_linears if style.get(lin.name) == "rowwise_split_input")))
    return replace(sliced, intermediate=shape.intermediate // tp, heads=shape.heads // tp,
                   kv_heads=shape.kv_heads // tp)


@functools.cache
def _tp_styles(model_type: str) -> dict[str, str]:
    """The tensor-parallel style of each layer module of a model type (capabilities.tensor_plan, read once a type:
    tensor_parallel_shape runs for every estimate, once a layer of Gemma 4's): 'self_attn.q_proj' -> 'colwise'."""
    from transformers import CONFIG_MAPPING

    plan = capabilities.tensor_plan(CONFIG_MAPPING[model_type]())
    return {pattern.rsplit("*.", 1)[-1]: how for pattern, how in plan.items()}


@dataclass(frozen=True)
class LoraPlan:
    """Where LoRA adapters go: adapted[i] maps linear name -> (fan_in, fan_out) in decoder layer i. A mixture of
    experts' adapted parameters are there too, by their names in Experts.params, with one expert's (fan_in, fan_out)
    (the router's: hidden, experts); peft adapts them as parameters (its ParamWrapper: every expert's A and B at a
    rank of its own), whose adapter weights a layer are in `moe_params`."""

    r: int
    adapted: tuple[dict[str, tuple[int, int]], ...]
    adapted_head: bool  # an adapter on lm_head (only when targeted by name)
    saved_copies: tuple[str, ...]  # modules_to_save: trained in full as a copy beside the frozen original
    moe_params: dict[str, int] = field(default_factory=dict)
    # adapted linears outside the decoder layers (ModelShape.other_linears: Gemma 4's per_layer_model_projection)
    adapted_other: dict[str, tuple[int, int]] = field(default_factory=dict)
    dora: bool = False  # lora.dora: each adapted linear also trains a magnitude per output row (peft's fp32 vector)

    def linear_size(self, fan_in: int, fan_out: int) -> int:
        """One adapted linear's adapter weights: A and B, and DoRA's magnitude vector."""
        return self.r * (fan_in + fan_out) + (fan_out if self.dora else 0)

    def layer_sizes(self, k: int) -> dict[str, int]:
        """Adapter weights of decoder layer k, by adapted linear or parameter."""
        return {name: self.moe_params.get(name, self.linear_size(i, o)) for name, (i, o) in self.adapted[k].items()}

    def layer_params(self, k: int) -> int:
        return sum(self.layer_sizes(k).values())

    def magnitudes(self, k: int | None = None) -> int:
        """DoRA's magnitude weights in decoder layer k (None: on the linears outside the layers). They scale outputs
        elementwise, so autocast makes no copy of them, where it does of A and B."""
        fans = self.adapted_other if k is None else self.adapted[k]
        return sum(o for name, (_, o) in fans.items() if name not in self.moe_params) if self.dora else 0

    def adapter_params(self, shape: ModelShape) -> int:
        per_layers = sum(self.layer_params(k) for k in range(len(self.adapted)))
        return per_layers + (self.linear_size(shape.hidden, shape.vocab) if self.adapted_head else 0) + \
            self.other_params

    @property
    def other_params(self) -> int:
        """Adapter weights on the linears outside the decoder layers."""
        return sum(self.linear_size(i, o) for i, o in self.adapted_other.values())

    def copy_params(self, shape: ModelShape) -> int:
        return shape.hidden * shape.vocab * (len(self.saved_copies) - self.tied_copies(shape))

    def tied_copies(self, shape: ModelShape) -> bool:
        """The embeddings' and the head's copies are one (a tied model: modeling.apply_lora ties them, as the model
        ties its own)."""
        return shape.tied and {"embed_tokens", "lm_head"} <= set(self.saved_copies)

    def trainable(self, shape: ModelShape) -> int:
        return self.adapter_params(shape) + self.copy_params(shape)


def run_lora_plan(shape: ModelShape, spec) -> LoraPlan | None:
    """lora_plan for the run `spec` (a memory.spec.TrainSpec) describes: its rank, targets, target_parameters and
    modules_to_save; None for a full fine-tune."""
    if spec.method != "lora":
        return None
    return lora_plan(shape, r=spec.lora_r, targets=spec.lora_target_modules, parameters=spec.lora_target_parameters,
                     modules_to_save=spec.lora_modules_to_save, dora=spec.lora_dora)


def _matches(full_name: str, targets: str | tuple[str, ...]) -> bool:
    """peft's rule: a list matches a module whose name ends in '.<target>'; a string is a full regex."""
    if isinstance(targets, str):
        return re.fullmatch(targets, full_name) is not None
    return any(full_name == t or full_name.endswith("." + t) for t in targets)


def lora_plan(shape: ModelShape, *, r: int, targets: str | tuple[str, ...] = "all-linear",
              modules_to_save: tuple[str, ...] = (), parameters: tuple[str, ...] = (), dora: bool = False) -> LoraPlan:
    """Which linears get adapters, as peft decides; 'all-linear' is every linear but the LM head. A mixture of
    experts: peft's own answer (_peft_adapted), the same in every layer, with the parameters lora.target_parameters
    names (GPT-OSS's experts). `dora`: DoRA's magnitude vectors too (lora.dora)."""
    if shape.experts is not None:
        return replace(_moe_lora_plan(shape, r=r, targets=targets, modules_to_save=modules_to_save,
                                      parameters=parameters), dora=dora)
    if parameters:
        raise LLMTrainError(f"estimate-memory counts lora.target_parameters ({list(parameters)}) on a mixture of "
                            f"experts' experts; this {shape.model_type} model has none.")
    adapted = []
    for i in range(shape.layers):
        names = {lin.name: (lin.fan_in, lin.fan_out) for lin in shape.layer(i).layer_linears
                 if targets == "all-linear" or _matches(f"model.layers.{i}.{lin.name}", targets)}
        adapted.append(names)
    other = {lin.name: (lin.fan_in, lin.fan_out) for lin in shape.other_linears
             if targets == "all-linear" or _matches(f"model.{lin.name}", targets)}
    head = targets != "all-linear" and _matches("lm_head", targets)
    if not head and not any(adapted) and not other:
        names = dict.fromkeys(lin.name for i in range(shape.layers) for lin in shape.layer(i).layer_linears)
        raise LLMTrainError(f"lora.target_modules {targets!r} matches no linear layer of this model; "
                            f"its decoder layers have {', '.join(names)}.")
    unknown = [m for m in modules_to_save if m not in ("lm_head", "embed_tokens")]
    if unknown:
        raise LLMTrainError(f"estimate-memory handles lora.modules_to_save of lm_head and embed_tokens only "
                            f"(got {unknown}).")
    return LoraPlan(r=r, adapted=tuple(adapted), adapted_head=head, saved_copies=tuple(modules_to_save),
                    adapted_other=other, dora=dora)


def _moe_lora_plan(shape: ModelShape, *, r: int, targets: str | tuple[str, ...],
                   modules_to_save: tuple[str, ...], parameters: tuple[str, ...] = ()) -> LoraPlan:
    linears, params = _peft_adapted(shape.config_json, shape.model_type, r, targets, tuple(parameters))
    e, i, h = shape.experts, shape.experts.intermediate, shape.hidden
    adapted = []
    for k in range(shape.layers):  # each layer's own linears (Gemma 4's differ), peft's names from the first
        fans = {lin.name: (lin.fan_in, lin.fan_out) for lin in shape.layer(k).layer_linears}
        fans.update({e.router: (h, e.count), e.gate_up: (h, 2 * i), e.down: (i, h)})
        adapted.append({name: fans[name] for name in (*linears, *params) if name in fans})
    if not adapted[0]:
        raise LLMTrainError(f"lora.target_modules {targets!r} matches no linear layer or expert of this model; its "
                            f"decoder layers have {', '.join(fans)}.")
    if unknown := [m for m in modules_to_save if m not in ("lm_head", "embed_tokens")]:
        raise LLMTrainError(f"estimate-memory handles lora.modules_to_save of lm_head and embed_tokens only "
                            f"(got {unknown}).")
    other = {lin.name: (lin.fan_in, lin.fan_out) for lin in shape.other_linears
             if targets == "all-linear" or _matches(f"model.{lin.name}", targets)}
    return LoraPlan(r=r, adapted=tuple(adapted), adapted_head=False, saved_copies=tuple(modules_to_save),
                    moe_params=params, adapted_other=other)


@functools.lru_cache(maxsize=32)
def _peft_adapted(config_json: str, model_type: str, r: int, targets: str | tuple[str, ...],
                  parameters: tuple[str, ...] = ()) -> tuple[tuple[str, ...], dict[str, int]]:
    """What peft adapts in a mixture of experts' decoder layer for lora.target_modules `targets` (and
    lora.target_parameters `parameters`): the linear layers (lora.Linear), and the parameters it adapts as such
    (ParamWrapper: the router's weight, the experts' gate_up_proj at twice the rank, down_proj), with their adapter
    weights. peft decides by the model's own names (all-linear and gate_proj/up_proj map onto the experts, w1/w3 do
    for Mixtral; GPT-OSS's experts only by target_parameters), so it is asked: one layer of the model, built on the
    meta device, under peft's LoraConfig."""
    import peft

    cfg = {**json.loads(config_json), "num_hidden_layers": 1}
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:1]
    if isinstance(cfg.get("per_layer_config"), dict):  # Gemma 4's overrides of later layers: none left
        cfg["per_layer_config"] = {k: v for k, v in cfg["per_layer_config"].items() if str(k) == "0"}
    if cfg.get("num_kv_shared_layers"):  # nor its later layers sharing keys and values
        cfg["num_kv_shared_layers"] = 0
    model = meta_model(hf_config(model_type, cfg, model_type), model_type)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=list(targets) if isinstance(targets, tuple) else targets,
                             target_parameters=list(parameters) or None)
    try:
        with _transformers_quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's notes on its own patterns for the fused gate_up_proj
            model = peft.get_peft_model(model, config, low_cpu_mem_usage=True)
    except ValueError as e:
        raise LLMTrainError(f"lora.target_modules {targets!r}: peft adapts nothing of this model ({e}).") from None
    linears, params = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer) or ".layers.0." not in name:
            continue
        local = name.split(".layers.0.", 1)[1]
        size = module.lora_A["default"].weight.numel() + module.lora_B["default"].weight.numel()
        if hasattr(module, "parameter_name"):  # ParamWrapper: mlp.gate's weight, mlp.experts(.base_layer)'s
            params[f"{local.removesuffix('.base_layer')}.{module.parameter_name}".replace(".weight", "")] = size
        else:
            linears.append(local)
    return tuple(linears), params


# --------------------------------------------------------------------------- reading a config


def reads_hub(name_or_path: str) -> bool:
    """Whether read_config asks the hub (or its local cache) for this name: not a local directory or file, a
    preset, a built-in config, or a path that is missing."""
    return not (Path(name_or_path).expanduser().exists() or name_or_path.lower() in PRESETS
                or name_or_path in HUB_ALIASES or is_local_path(name_or_path))


def read_config(name_or_path: str, field: str = "model.name_or_path") -> tuple[dict, str]:
    """The config.json dict and where it came from: a local dir/file, a preset, or the hub (or its cache). `field`:
    the recipe key it came from, for the paragraph where it cannot be read."""
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
    from llmtrain.config import run_folder_problem

    if problem := run_folder_problem(name_or_path, field):
        raise LLMTrainError(problem)
    if Path(name_or_path).expanduser().is_dir():  # it had said "no such directory or file" of a folder
        raise LLMTrainError(f"no model config at '{name_or_path}' ({field}): the folder has no config.json. {hint}")
    if is_local_path(name_or_path):
        raise LLMTrainError(f"no model config at '{name_or_path}' ({field}): no such directory or file. {hint}")
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
    from llmtrain.model.modeling import TEXT_MODELS

    cfg_dict = json.loads(config_json)
    model_type = cfg_dict.get("model_type")
    if model_type in TEXT_MODELS and isinstance(cfg_dict.get("text_config"), dict):  # a multimodal checkpoint (Gemma
        # 3's, 4's): its text model, the one llmtrain trains (modeling.text_model)
        model_type = cfg_dict["text_config"].get("model_type", f"{model_type}_text")
        cfg_dict = {**cfg_dict["text_config"], "model_type": model_type}
    if model_type not in SUPPORTED_TYPES:
        if (family := capabilities.FAMILIES.get(model_type)) is not None:  # a row of the table, its layer unmodelled
            raise LLMTrainError(f"{source} is {family.name} ({model_type}), which llmtrain trains (a row of the "
                                "family table, docs/models.md) and whose layer estimate-memory does not model yet, so "
                                "it makes no estimate: a short run on the GPU measures it (its peak is in the run's "
                                f"summary). estimate-memory models {', '.join(FAMILIES.values())}.")
        raise LLMTrainError(f"estimate-memory models the decoder layers of {', '.join(FAMILIES.values())}; {source} "
                            f"has model_type {model_type!r}, whose layer it does not know, so it makes no estimate "
                            "(training it may still work: `llmtrain doctor` checks the rest, and a short run "
                            "measures it).")
    config = hf_config(model_type, cfg_dict, source)
    model = meta_model(config, source)
    layers = model.model.layers
    layer0 = layers[0]
    linears = _linears(layer0)
    per_layer = sum(p.numel() for p in layer0.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = head is embed
    heads = config.num_attention_heads
    head_dim = getattr(layer0.self_attn, "head_dim", None) or capabilities.layer_values(
        config, "head_dim", config.hidden_size // heads)[0]
    rotary = int(head_dim * getattr(config, "partial_rotary_factor", 1.0) or head_dim)
    kinds = set(getattr(config, "layer_types", None) or ())
    gemma = model_type in ("gemma3_text", "gemma4_text")
    experts = _experts(layers, source)
    sinks = hasattr(layer0.self_attn, "sinks")
    shape = ModelShape(
        source=source, model_type=model_type, vocab=embed.shape[0], hidden=embed.shape[1],
        intermediate=experts.intermediate if experts else config.intermediate_size, layers=len(layers), heads=heads,
        kv_heads=capabilities.layer_values(config, "num_key_value_heads", heads)[0], head_dim=head_dim, tied=tied,
        # a window where some layer applies one (Qwen2's config names one its layers do not use)
        sliding_window=None if kinds == {"full_attention"} and model_type != "mistral" else
        getattr(config, "sliding_window", None),
        layer_linears=linears, params_per_layer=per_layer, params_embed=embed.numel(),
        params_head=0 if tied else head.numel(),
        params_final_norm=sum(p.numel() for p in model.model.norm.parameters()),
        max_positions=getattr(config, "max_position_embeddings", None),
        qk_norm=hasattr(layer0.self_attn, "q_norm"), gemma_norms=gemma,
        rope_sets=max(1, len(kinds)) if model_type == "gemma3_text" else 1,
        rope_dim=rotary if rotary != head_dim else None,
        # transformers builds a mask for each kind of layer (a causal and a sliding-window one)
        masks=max(1, len(kinds)), experts=experts, config_json=json.dumps(cfg_dict, sort_keys=True, default=str),
        # GPT-OSS rotates by halves with one frequency table, not two copies of it; its sinks
        rope_width=rotary // 2 if sinks else None, sinks=sinks,
        logit_cap=bool(getattr(config, "final_logit_softcapping", None)),
    )
    if model_type == "gemma4_text":
        shape = _gemma4_shape(shape, model, config)
    total = sum(p.numel() for p in model.parameters())
    uniform = shape.layer_shapes or all(sum(p.numel() for p in layer.parameters()) == per_layer for layer in layers)
    if total != shape.params_total or not uniform:  # a layout the per-layer formulas would get wrong
        raise LLMTrainError(f"{source}: unexpected parameter layout ({total:,} parameters counted, "
                            f"{shape.params_total:,} from embeddings + layers + head).")
    return shape


def _linears(module) -> tuple[Linear, ...]:
    from torch import nn

    return tuple(Linear(n, m.in_features, m.out_features, m.bias is not None)
                 for n, m in module.named_modules() if isinstance(m, nn.Linear))


def _gemma4_shape(shape: ModelShape, model, config) -> ModelShape:
    """Gemma 4's text model: each layer's own shape (layer_shapes: its head size and K/V heads, its keys as its values
    on attention_k_eq_v's global layers, no keys or values of its own where it shares an earlier layer's, a double-wide
    MLP there, the per-layer input's gate and projection), the per-layer embeddings outside the layers (params_other:
    the table of vocab_size_per_layer_input x layers x hidden_size_per_layer_input, the projection of the embeddings
    to as many, a norm), and RoPE's cos and sin at each kind of layer's head size."""
    from dataclasses import replace

    kv = capabilities.layer_values(config, "num_key_value_heads", config.num_attention_heads)
    ple = config.hidden_size_per_layer_input or 0
    if getattr(config, "enable_moe_block", False):  # experts beside each layer's dense MLP
        shape = replace(shape, experts=Experts(
            count=config.num_experts, top_k=config.top_k_experts, intermediate=config.moe_intermediate_size,
            normalised=True, fp32_weights=True, router="router.proj", prefix="experts", beside=True))
    layers = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        layers.append(replace(shape, kv_heads=kv[i], head_dim=attn.head_dim, intermediate=layer.mlp.intermediate_size,
                              layer_linears=_linears(layer),
                              params_per_layer=sum(p.numel() for p in layer.parameters()),
                              kv_shared=attn.is_kv_shared_layer, v_norm=hasattr(attn, "v_norm"),
                              k_eq_v=not attn.is_kv_shared_layer and attn.v_proj is None, per_layer_input=ple))
    inner = model.model
    others = [getattr(inner, name) for name in ("embed_tokens_per_layer", "per_layer_model_projection",
                                                "per_layer_projection_norm") if hasattr(inner, name)]
    projection = getattr(inner, "per_layer_model_projection", None)
    widths = {}  # each kind of layer's head size: its cos and sin
    for kind, layer in zip(config.layer_types, layers):
        widths.setdefault(kind, layer.head_dim)
    layers = [replace(layer, rope_width=sum(widths.values())) for layer in layers]
    from llmtrain.parallel.pipeline.stage import kv_handoffs, kv_sharing

    store = {config.layer_types[i]: layers[i] for i, mode in enumerate(kv_sharing(config)) if mode == "store"}
    handed = tuple(sum(2 * store[kind].kv_heads * store[kind].head_dim for kind in kv_handoffs(config, b))
                   for b in range(len(layers) + 1))
    return replace(layers[0], layer_shapes=tuple(layers), per_layer_input=ple, kv_handed=handed,
                   params_other=sum(p.numel() for m in others for p in m.parameters()),
                   other_linears=(Linear("per_layer_model_projection", projection.in_features, projection.out_features,
                                         False),) if projection is not None else ())


def _experts(layers, source: str) -> Experts | None:
    """The mixture of experts every decoder layer has in place of its MLP (None: a dense model). One whose layers
    differ (Qwen3-MoE's mlp_only_layers, decoder_sparse_step) is refused: the estimate walks one kind of layer."""
    blocks = [getattr(layer.mlp, "experts", None) for layer in layers]
    if blocks[0] is None and not any(blocks):
        return None
    if not all(blocks):
        raise LLMTrainError(f"{source}: some decoder layers have a dense MLP and others experts (mlp_only_layers or "
                            "decoder_sparse_step); estimate-memory models models whose layers are all alike.")
    from transformers.integrations.moe import _default_apply_gate

    block = blocks[0]
    if hasattr(layers[0].mlp, "router"):  # GPT-OSS's: a bias, the softmax of the top_k logits, in the router's dtype
        router = layers[0].mlp.router
        return Experts(count=block.num_experts, top_k=router.top_k, intermediate=block.intermediate_size,
                       normalised=False, fp32_weights=False, router="mlp.router", biases=block.has_bias,
                       clamped_gate=type(block)._apply_gate is not _default_apply_gate)
    router = layers[0].mlp.gate
    return Experts(count=block.num_experts, top_k=router.top_k, intermediate=block.intermediate_dim,
                   normalised=getattr(router, "norm_topk_prob", True), fp32_weights=not hasattr(router,
                                                                                             "norm_topk_prob"))


@functools.lru_cache(maxsize=64)
def tensor_problems(config_json: str, model_type: str, tp: int) -> tuple[str, ...]:
    """What tensor parallelism over `tp` GPUs refuses of the model (capabilities.tensor_plan_problems, which training
    asks): its plan's styles, heads or MLP columns `tp` does not divide (each layer's)."""
    return tuple(capabilities.tensor_plan_problems(hf_config(model_type, json.loads(config_json), model_type), tp))


def load_model_shape(name_or_path: str, field: str = "model.name_or_path") -> ModelShape:
    """Read a model's config (path, preset or hub id; `field` the recipe key it came from) and count it exactly on
    the meta device."""
    cfg, source = read_config(name_or_path, field)
    return _shape_from_json(json.dumps(cfg, sort_keys=True, default=str), f"{name_or_path} ({source})")


# --------------------------------------------------------------------------- a learned reward's model


@dataclass(frozen=True)
class RewardModel:
    """A reward_model reward (rl.rewards) as the estimate counts it (memory/reward_models.py): its shape under its
    score head, its saved dtype, a LoRA adapter's bytes and the completions it scores at once. shape None: the
    folder is not there to read (not counted, and said)."""

    source: str
    shape: ModelShape | None
    dtype: str
    adapter_bytes: int  # a LoRA adapter's file beside its base (0: a whole model)
    batch_size: int
    quantize: str | None = None  # a QLoRA run's adapter: its base in 4 bits, as the run held it (model/score.py)


def _saved_dtype(config: dict) -> str:
    """The dtype `from_pretrained(dtype="auto")` loads a model in: its config's (float32 where it names none)."""
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def reward_models_of(recipe) -> tuple[RewardModel, ...]:
    """The recipe's reward models, read from their folders (config.json, or a LoRA adapter's base config and its
    adapter's file); a folder that is not there to read (the estimate made before it is trained) with no shape."""
    from llmtrain.config import adapter_base, adapter_quantization

    found = []
    for reward in (recipe.rl.rewards if recipe.rl is not None else []):
        if reward.type != "reward_model" or reward.path is None:
            continue
        folder = Path(reward.path).expanduser()
        adapter = folder / "adapter_config.json"
        config = folder / "config.json"
        if not adapter.is_file() and not config.is_file():
            found.append(RewardModel(reward.path, None, "float32", 0, reward.batch_size))
            continue
        # a LoRA adapter: its base as saved, and the adapter's own weights (the score head among them)
        name = adapter_base(folder) if adapter.is_file() else str(folder)
        extra = sum(f.stat().st_size for f in folder.glob("adapter_model*.safetensors")) if adapter.is_file() else 0
        cfg, source = read_config(name)  # read once: the shape and the saved dtype
        shape = _shape_from_json(json.dumps(cfg, sort_keys=True, default=str), f"{name} ({source})")
        dtype, quantize = _saved_dtype(cfg), None
        if adapter.is_file() and (held := adapter_quantization(folder)) is not None:  # as the QLoRA run held it
            quantize, dtype = held[0], held[1]
        shape = shape if shape.score_head else score_head_shape(shape)
        found.append(RewardModel(reward.path, shape, dtype, extra, reward.batch_size, quantize))
    return tuple(found)


def transformers_config(name_or_path: str):
    """read_config's config as transformers builds it (the text model's of a multimodal one), for what training
    refuses of the model (capabilities.model_problems); None where transformers has no class for its model_type."""
    from transformers import AutoConfig

    from llmtrain.model.modeling import text_model

    config = dict(read_config(name_or_path)[0])
    try:
        return text_model(AutoConfig.for_model(config.pop("model_type", None), **config))[0]
    except (ValueError, KeyError, TypeError):
        return None


def recipe_model_shape(recipe) -> ModelShape:
    """The model a recipe trains: model.name_or_path's, its vocabulary grown by model.new_tokens, under a score head
    where it trains a reward model."""
    shape = grown_shape(load_model_shape(recipe.model.name_or_path), len(recipe.model.new_tokens))
    return score_head_shape(shape) if recipe.reward_model is not None else shape


def grown_shape(shape: ModelShape, new: int) -> ModelShape:
    """`shape` with `new` rows more in its embeddings and its untied LM head (model.new_tokens, as
    modeling.grow_vocabulary grows them): an upper bound, counting no token the tokenizer already has and no spare
    row a model has past its tokenizer (Qwen's), which take no new row."""
    from dataclasses import replace

    if not new:
        return shape
    return replace(shape, vocab=shape.vocab + new, params_embed=shape.params_embed + new * shape.hidden,
                   params_head=shape.params_head + (new * shape.hidden if shape.params_head else 0))
