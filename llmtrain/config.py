"""The recipe: one typed pydantic schema, the only home of defaults.

A recipe is a YAML file plus dotted `key=value` overrides (`train.lr=1e-4`). Both go through the same
validation, and every problem is reported at once with the key, what was expected and, for a typo,
the nearest valid key.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmtrain.errors import RecipeError
from llmtrain.overrides import apply_overrides, read_yaml


def _takes(annotation, kinds: tuple[type, ...]) -> bool:
    """Whether a field's annotation (through Optional, unions and Annotated, not into lists) takes one of `kinds`."""
    import typing

    if annotation in kinds:
        return True
    return typing.get_origin(annotation) not in (list, tuple, dict, Literal) and any(
        _takes(a, kinds) for a in typing.get_args(annotation))


UNBOUNDED = {"sampler_correction_max"}  # the number keys where .inf means "no bound"


class Section(BaseModel):
    # Unknown keys are errors, never silently ignored: a typo must not change a run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, v: Any, info) -> Any:
        """YAML's true (yes, on) is not a number, which pydantic would read as 1: `train.lr=yes` trained at 1.0."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(v, bool) and _takes(annotation, (int, float)) and not _takes(annotation, (bool,)):
            raise ValueError(f"is a number, not {str(v).lower()} (YAML reads true, yes and on as true)")
        if isinstance(v, (float, str)) and _takes(annotation, (float,)) and not _takes(annotation, (str,)):
            try:
                number = float(v)
            except ValueError:
                return v
            if not math.isfinite(number) and not (number == math.inf and info.field_name in UNBOUNDED):
                # an infinite beta, weight or temperature trained on an infinite or a zero loss (audit 49)
                raise ValueError("must be a finite number (not inf or nan)")
        return v

    def off_default(self, key: str) -> bool:
        """Whether `key` holds another value than its default: what a refusal or a warning of a key set where it is
        unread asks (a run's recipe.yaml spells every default out, and is read back by eval, generate, --resume)."""
        return getattr(self, key) != type(self).model_fields[key].default


class RopeScaling(BaseModel):
    """RoPE scaling as transformers reads it (config.rope_parameters); keys of a type's own (llama3's
    low_freq_factor and high_freq_factor, yarn's beta_fast, ...) pass through as given."""

    model_config = ConfigDict(extra="allow")
    rope_type: Literal["linear", "dynamic", "yarn", "llama3", "longrope"] = Field(
        description="linear: positions divided by factor (needs fine-tuning); dynamic: NTK-aware, grows with the "
        "length; yarn: NTK-by-parts with attention temperature (Qwen, Mistral long-context); llama3: Llama 3.1's.")
    factor: float = Field(gt=1, allow_inf_nan=False,
                          description="How many times the original context the model reaches.")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, description="The context the model was trained at; unset: the model's max_position_embeddings.")

    @model_validator(mode="after")
    def _own_fields(self) -> RopeScaling:
        """The fields transformers requires of a type beyond the factor (modeling_rope_utils' _validate_*), asked for
        here rather than met as a KeyError when the model is built; a key the type does not read is refused (yarn's
        beta_fst had passed through and changed nothing)."""
        for k in self.model_extra or {}:
            if k not in ROPE_KEYS[self.rope_type]:
                near = difflib.get_close_matches(k, sorted(ROPE_KEYS[self.rope_type]), n=1, cutoff=0.6)
                reads = ", ".join(sorted(ROPE_KEYS[self.rope_type])) or "nothing beyond the factor"
                raise ValueError(f"rope_type {self.rope_type} reads no {k}"
                                 + (f" (did you mean {near[0]}?)" if near else "")
                                 + f"; its keys beyond rope_type, factor and original_max_position_embeddings: {reads}")
        missing = [k for k in ROPE_FIELDS.get(self.rope_type, {}) if getattr(self, k, None) is None]
        if missing:
            example = ", ".join(f"{k}: {v}" for k, v in ROPE_FIELDS[self.rope_type].items())
            raise ValueError(f"rope_type {self.rope_type} also needs {' and '.join(missing)} (e.g. {{rope_type: "
                             f"{self.rope_type}, factor: {self.factor:g}, {example}}}; the values of the model's own "
                             "config.json where it was trained with this scaling)")
        for k in ROPE_FIELDS.get(self.rope_type, {}):
            v = getattr(self, k)
            if self.rope_type == "longrope" and not (isinstance(v, list) and v and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
                raise ValueError(f"rope_type longrope's {k} is a list of numbers, one a rotary frequency (head_dim / 2 "
                                 f"of them), as in Phi-3's config.json; got {v!r}")
            if self.rope_type == "llama3" and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"rope_type llama3's {k} is a positive number (Llama 3.1: "
                                 f"{ROPE_FIELDS['llama3'][k]}); got {v!r}")
        return self


# The fields each rope_type needs beyond the factor (transformers' required keys), with Llama 3.1's and a short example
ROPE_FIELDS = {"llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
               "longrope": {"short_factor": "[1.0, ...]", "long_factor": "[1.0, ...]"}}
# Every key a rope_type reads beyond rope_type, factor and original_max_position_embeddings (transformers 5's
# modeling_rope_utils: each _validate_*_rope_parameters' required and optional keys, and every type's
# partial_rotary_factor and rope_theta, which default to the model's own)
ROPE_KEYS = {"linear": set(), "dynamic": set(), "llama3": {"low_freq_factor", "high_freq_factor"},
             "yarn": {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
             "longrope": {"short_factor", "long_factor", "attention_factor"}}
ROPE_KEYS = {t: keys | {"partial_rotary_factor", "rope_theta"} for t, keys in ROPE_KEYS.items()}  # every type's


def tiled_mlp_shard(setting: bool | int | None, hidden_size: int) -> int | None:
    """Tokens per shard of model.tiled_mlp: its number, or (true) the hidden size, as ALST chooses; None when off."""
    if not setting:
        return None
    return hidden_size if setting is True else int(setting)


VARLEN_SETTINGS = ("auto", "varlen")  # the model.attn_implementation values that run llmtrain's varlen attention


class ModelConfig(Section):
    name_or_path: str = Field(description="Local directory or hub id passed to AutoModelForCausalLM.from_pretrained.")
    tokenizer: str | None = Field(None, description="Tokenizer directory or hub id; defaults to name_or_path.")
    new_tokens: list[str] = Field(
        default_factory=list, description="Tokens to add to the tokenizer as special tokens (each one id, never "
        "split, skipped when replies are decoded): a chat template's markers a base model lacks, such as ChatML's "
        "<|im_start|> and <|im_end|>. The embeddings and the LM head grow by their rows, each new row starting at "
        "the mean of the model's own rows (a model with spare rows past its tokenizer, as Qwen's, gives the new "
        "tokens those). A full fine-tune trains them with the rest; under LoRA, lora.modules_to_save gains "
        "embed_tokens and lm_head (a reward model: embed_tokens), which train in full and are saved with the "
        "adapter. final/ holds the grown tokenizer. A token the tokenizer already has keeps its id and its row.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Storage dtype of the weights. Keep float32 for full fine-tunes under mixed precision "
        "(fp32 master weights); bfloat16 halves a frozen LoRA base.",
    )
    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto",
        description="Attention kernel. 'varlen' attends per example inside a padding-free row (cost sum of "
        "l_i^2): PyTorch's flash varlen_attn on CUDA, SDPA per example elsewhere. 'auto' picks varlen. 'sdpa' / "
        "'eager' / 'flash_attention_2' are transformers' own (a packed row then uses a block-diagonal mask). A model "
        "whose attention varlen does not compute (sinks, chunks, capped scores, layers that are not attention) is "
        "refused with the setting to use (docs/models.md).",
    )
    kernels: Literal["auto", "liger", "none"] = Field(
        "auto",
        description="Fused kernels: 'liger' patches RMSNorm, RoPE and SwiGLU with liger-kernel and uses its fused "
        "linear cross-entropy (CUDA; pip install 'llmtrain[gpu]'); 'auto' does so where it is installed and the "
        "device is CUDA; 'none' keeps plain torch.",
    )
    compile: bool = Field(False, description="torch.compile each decoder layer (regional compilation).")
    gradient_checkpointing: bool = Field(False, description="Recompute layer activations in backward to save memory.")
    activation_offload: bool = Field(
        False, description="Keep each checkpointed decoder layer's input in host memory instead of on the GPU (pinned, "
        "copied on a side CUDA stream, prefetched in backward; the last layer's stays): frees (layers - 2) x tokens x "
        "hidden_size x 2 bytes (bf16) of GPU memory and takes as much host RAM. Needs gradient_checkpointing. Exact: "
        "the same numbers as without it.",
    )
    tiled_mlp: bool | int | None = Field(
        None, description="Run each decoder layer's MLP over shards of the tokens, keeping only its input and "
        "recomputing shard by shard in backward: the (tokens x intermediate_size) tensors exist for one shard. true: "
        "shards of hidden_size tokens (as ALST); a number: that many tokens (at least 2, fewer than a micro-batch "
        "holds; either is refused where no micro-batch reaches it); null or false: off. Full fine-tune, LoRA and "
        "QLoRA, on one process, DDP, FSDP or FSDP x TP.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub to run. Off unless set.")
    random_init: bool = Field(
        False, description="Build the architecture from config.json with random weights, reading no weights "
        "(throughput benchmarks and memory calibration)."
    )
    rope_scaling: RopeScaling | None = Field(
        None, description="Extend the context past the model's max_position_embeddings by rescaling RoPE (transformers "
        "applies it): e.g. {rope_type: yarn, factor: 4} turns a 32K model into a 128K one. Unset: the model's own.")
    quantize: Literal["nf4", "fp4"] | None = Field(
        None, description="QLoRA: store the frozen base's linear layers in 4 bits with bitsandbytes (nf4, or fp4), "
        "double quantisation on, computing in train.mixed_precision's dtype; the quantised weights are stored in "
        "model.dtype so that FSDP2 can shard them. Needs a lora: section (pip install 'llmtrain[qlora]').",
    )
    router_aux_loss_coef: float | None = Field(
        None, ge=0, description="A mixture of experts (Qwen3-MoE, Mixtral): add its routers' load-balancing loss "
        "(Switch Transformer's, transformers' load_balancing_loss_func over every layer) with this weight, as "
        "transformers does with output_router_logits (router_aux_loss_coef: 0.001 in Qwen3-MoE's config, 0.02 in "
        "Mixtral's). Supervised fine-tuning, preference pairs and KTO (as TRL adds it); logged as aux_loss. Unset: "
        "off, transformers' default (TRL's trainers default to the config's own weight).")

    @field_validator("tiled_mlp")
    @classmethod
    def _shard_size(cls, v: bool | int | None) -> bool | int | None:
        if v is not None and not isinstance(v, bool) and v < 2:
            raise ValueError("1 is read as the tokens of one shard of the MLP (every token's MLP run alone, hundreds "
                             "of times slower), not as 'on'. Write true (shards of hidden_size tokens, as ALST), or a "
                             "shard of at least 2 tokens" if v == 1 else "a shard of the MLP is a number of tokens, at "
                             "least 2 (or true: hidden_size tokens; false or null: off)")
        return v

    @field_validator("new_tokens")
    @classmethod
    def _distinct_tokens(cls, v: list[str]) -> list[str]:
        if blank := [t for t in v if not t.strip()]:
            raise ValueError(f"{blank[0]!r} is blank: a new token is a non-empty string such as <|im_end|>")
        if twice := sorted({t for t in v if v.count(t) > 1}):
            raise ValueError(f"{', '.join(twice)} is listed more than once")
        return v

    @property
    def varlen(self) -> bool:
        """Whether llmtrain's varlen attention runs ('auto' picks it)."""
        return self.attn_implementation in VARLEN_SETTINGS

    @model_validator(mode="after")
    def _check_long_context(self) -> ModelConfig:
        if self.activation_offload and not self.gradient_checkpointing:
            raise ValueError("model.activation_offload moves the input each checkpointed layer keeps for its "
                             "backward to host memory; without model.gradient_checkpointing a layer keeps all its "
                             "activations on the GPU and there is nothing to offload. Set "
                             "model.gradient_checkpointing=true (it is what makes the offload worthwhile), or "
                             "model.activation_offload=false")
        if self.compile and (self.activation_offload or self.tiled_mlp):
            raise ValueError("model.compile with model.activation_offload or model.tiled_mlp is not supported: "
                             "their saved-tensor hooks and autograd Function inside a compiled layer are untested. "
                             "Set model.compile=false, or turn them off")
        return self


# Modules at the top of a model, whose whole path is their name: text that names one is peft's match of it
TOP_LEVEL_MODULES = ("lm_head", "score", "embed_out", "output")


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, allow_inf_nan=False, description="LoRA scaling numerator (scale = alpha / r; "
                         "alpha / sqrt(r) with lora.rslora).")
    rslora: bool = Field(False, description="Rank-stabilised LoRA (Kalajdzievski 2023; peft's use_rslora): the "
                         "adapter's scale is alpha / sqrt(r) instead of alpha / r, so that a higher rank does not "
                         "learn more slowly at the same alpha and lr.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    dora: bool = Field(False, description="DoRA (Liu et al. 2024; peft's use_dora, axolotl's peft_use_dora, "
                       "LLaMA-Factory's use_dora): each adapted weight is split into a trained magnitude per output "
                       "row and a direction W + s B A normed row by row, so every forward also computes each adapted "
                       "weight's row norms. With lora.dropout > 0 peft runs each adapted linear's base matmul a "
                       "second time on the dropped-out input (and keeps a copy of its weight for backward under "
                       "autocast or a 4-bit base): lora.dropout 0 is cheaper.")
    lr_ratio: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="LoRA+ (Hayou et al. 2024): the B matrices (and every trained "
        "1-D parameter) learn at train.lr x this ratio, the A matrices at train.lr, at the rates peft's "
        "create_loraplus_optimizer gives them (weight decay on no 1-D parameter, where peft decays RMSNorm weights "
        "and DoRA's magnitudes; axolotl's and LLaMA-Factory's loraplus_lr_ratio; the paper suggests "
        "16, with train.lr about half plain LoRA's). None: one rate for all.")
    lr_embedding: float = Field(1e-6, gt=0, allow_inf_nan=False, description="With lora.lr_ratio: the learning rate "
                                "of LoRA's matrices on an embedding layer (peft's loraplus_lr_embedding).")
    target_modules: str | list[str] = Field(
        "all-linear", description="A list of module names to adapt ([q_proj, v_proj]), 'all-linear' for every linear "
        "layer but the LM head, or (text) peft's regular expression of the whole module path."
    )
    modules_to_save: list[str] | None = Field(None, description="Modules trained in full and saved with the adapter.")
    target_parameters: list[str] | None = Field(
        None, description="Parameters to adapt besides the modules, by name (a suffix: mlp.experts.gate_up_proj): a "
        "mixture of experts' 3-D expert weights where all-linear does not reach them (GPT-OSS's), as peft's "
        "target_parameters. Each expert gets its own A and B; lora.dropout must be 0.")

    @field_validator("target_modules")
    @classmethod
    def _names_are_a_list(cls, v: str | list[str]) -> str | list[str]:
        """peft reads text as a regular expression of the whole module path (model.layers.0.self_attn.q_proj), so a
        plain name (q_proj, q_proj,v_proj) matches no layer: it had been refused at the model's load by a message
        that listed q_proj among the layers (audit 47)."""
        if isinstance(v, str) and v != "all-linear" and v not in TOP_LEVEL_MODULES and re.fullmatch(r"[\w,\s-]+", v):
            names = [n.strip() for n in v.split(",") if n.strip()]
            hint = ("'all-linear' for every linear layer" if v.replace("_", "-").lower() == "all-linear" else
                    f"a list: lora.target_modules=[{','.join(names)}] ({names!r} in YAML)")
            raise ValueError(f"text here is peft's regular expression of the whole module path "
                             f"(model.layers.0.self_attn.q_proj), which {v!r} matches in no layer of a decoder; give "
                             f"{hint}")
        if isinstance(v, str) and v != "all-linear":
            try:
                re.compile(v)
            except re.error as e:  # (a traceback in peft, and in doctor's count: audit 49)
                raise ValueError(f"{v!r} is not a regular expression ({e}); give one of the whole module path, or "
                                 "a list of module names") from None
        return v


Paths = Annotated[list[str], Field(min_length=1)]  # files: one or more (an empty list had been an IndexError)
DataFormat = Literal["alpaca", "messages", "prompt_completion", "text", "preference", "unpaired", "prompt"]


class SourceConfig(Section):
    """One dataset of a mixture (data.sources): where it is, how its rows are laid out, and its part of each step."""

    path: str | Paths = Field(description="As data.path: local file(s), a dataset folder or a hub dataset name.")
    name: str | None = Field(None, description="Hub dataset configuration name, as data.name.")
    split: str = Field("train", description="Split to train on, as data.split.")
    format: DataFormat = Field(description="How this source's rows are laid out, as data.format; every source must "
                               "train in the recipe's mode (alpaca, messages, prompt_completion and text together).")
    fields: dict[str, str] = Field(default_factory=dict, description="As data.fields, for this source's rows.")
    roles: dict[str, str] = Field(default_factory=dict, description="As data.roles, for this source's rows.")
    eval_split: float | str | Paths | None = Field(
        None, description="This source's held-out eval data, as data.eval_split (unset: data.eval_split's, where "
        "that is a fraction).")
    weight: float | None = Field(
        None, gt=0, description="This source's share of the examples of every step, relative to the other sources' "
        "weights (0.7 and 0.3: 70% and 30%). An epoch is as many examples as all sources have rows: a source with "
        "fewer rows than its share repeats them, one with more is subsampled, reshuffled each time round.")
    count: int | None = Field(
        None, gt=0, description="Instead of a weight: this many of this source's examples an epoch (its rows "
        "repeated or subsampled as for a weight); the epoch is the counts' sum.")

    @model_validator(mode="after")
    def _one_amount(self) -> SourceConfig:
        if (self.weight is None) == (self.count is None):
            raise ValueError("give this source either a weight (its share of each step, e.g. weight: 0.3) or a "
                             "count (its examples an epoch, e.g. count: 5000), not both and not neither")
        return self


class DataConfig(Section):
    path: str | Paths | None = Field(
        None, description="One or several local files (.jsonl, .json, .parquet, .csv), a dataset folder (its files "
        "named by split, as on the hub) or a hub dataset name. Or data.sources, for a weighted mixture."
    )
    sources: list[SourceConfig] | None = Field(
        None, description="A weighted mixture of datasets instead of data.path: each with its own path, format, "
        "fields and roles, and a weight (its share of the examples of every step) or a count (its examples an "
        "epoch). Which source an example comes from depends only on the seed and its place in the run, so resume "
        "and a change of process count keep the order; data.max_seq_len, chat_template and the rest apply to all.")
    name: str | None = Field(None, description="Hub dataset configuration name (e.g. 'main' for gsm8k).")
    split: str = Field("train", description="Split to train on, of a hub dataset or a dataset folder.")
    format: DataFormat | None = Field(
        None, description="How examples are laid out: alpaca, messages, prompt_completion, text, preference (prompt, "
        "chosen, rejected: pairs for the preference: section), unpaired (prompt, completion, label: a boolean, "
        "desirable or not, for the kto: section), or prompt (prompts alone, for online RL: the rl: section; every "
        "other column goes to the reward functions). With data.sources: each source's.")
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="Names in the data for the format's names: columns (prompt, completion, instruction, input, "
        "output, messages, text) and, in a list of messages, the keys role and content (e.g. {prompt: question, "
        "completion: answer}; ShareGPT: {messages: conversations, role: from, content: value}).",
    )
    roles: dict[str, str] = Field(
        default_factory=dict,
        description="Role names in the data mapped to the chat template's (ShareGPT: {human: user, gpt: assistant}).",
    )
    chat_template: bool | str = Field(
        False,
        description="Render prompt_completion rows as a chat through a chat template: the prompt as the user turn, "
        "the completion as the assistant turn. true: the tokenizer's own template; a path: a Jinja template file "
        "(for a tokenizer without one, or to override it; messages rows use it too). A prompt that is a list of "
        "messages is always rendered as a chat.",
    )
    system_prompt: str | None = Field(
        None, description="System message put first in every chat that has none (chat-rendered rows only)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Variables the chat template reads (TRL's chat_template_kwargs), e.g. {enable_thinking: "
        "false} for Qwen3's: set at the top of the template wherever this run renders a chat (the training rows, RL "
        "prompts, the reward models' rows, `llmtrain generate` of its run folder). Chat-rendered rows only.")
    eval_split: float | str | Paths | None = Field(
        None, description="Held-out eval data: a fraction in (0, 1) of the training data, eval file(s), or the name "
        "of a split of the data.path dataset (hub or dataset folder), e.g. 'test'."
    )
    eval_max_examples: int | None = Field(
        None, gt=0, description="Evaluate on at most this many eval examples: the first N in the seeded order "
        "(with data.sources, the first N of each source's)."
    )
    max_seq_len: int = Field(2048, gt=1, description="The longest example in tokens: a longer one is truncated (a "
                             "preference pair's prompt is cut from the left first, down to its last quarter, then "
                             "the answers' ends); an online-RL prompt that leaves no room for "
                             "rl.max_completion_tokens is refused, never cut.")
    train_on_prompt: bool = Field(False, description="Also put loss on prompt/user tokens (default: completion only). "
                                  "Supervised fine-tuning and preference pairs; refused where no prompt token is "
                                  "trained (KTO, online RL, reward models, distillation).")
    packing: bool = Field(
        False,
        description="Padding-free packing: a micro-batch is one row of concatenated examples whose "
        "position ids restart, so no example attends to another. With model.attn_implementation auto or varlen (the "
        "default) or a token budget (train.micro_batch_tokens) every micro-batch is packed whatever this says; "
        "false keeps examples in padded rows under sdpa, eager or flash_attention_2 only.",
    )
    cache_dir: str = Field(".cache/llmtrain/data", description="Where tokenised datasets are cached between runs.")
    num_proc: int = Field(1, ge=1, description="Processes used for tokenisation.")

    @field_validator("eval_split")
    @classmethod
    def _check_eval_split(cls, v: float | str | list[str] | None) -> float | str | list[str] | None:
        if isinstance(v, float) and not 0.0 < v < 1.0:
            raise ValueError("as a fraction it must be in (0, 1); or give eval file(s) or a split name")
        return v

    @model_validator(mode="before")
    @classmethod
    def _mixture_format(cls, values: Any) -> Any:
        """A mixture's format is its first source's (the mode's checks read data.format; capabilities checks that
        every source trains in that mode)."""
        if isinstance(values, dict) and isinstance(values.get("sources"), list) and values["sources"] and \
                values.get("format") is None and isinstance(values["sources"][0], dict):
            values = {**values, "format": values["sources"][0].get("format")}
        return values

    @model_validator(mode="after")
    def _check_chat(self) -> DataConfig:
        if self.sources is not None:
            # set to anything but their defaults (a saved recipe.yaml writes every key, the defaults too)
            own = [k for k in ("path", "name", "split", "fields", "roles")
                   if getattr(self, k) != DataConfig.model_fields[k].get_default(call_default_factory=True)]
            if own:
                raise ValueError(f"data.sources gives each dataset's own {', '.join(own)}; remove data."
                                 f"{own[0]} and set it on its source (data.sources[N].{own[0]})")
            if not self.sources:
                raise ValueError("data.sources is empty: give at least one dataset, or use data.path")
            if len({s.weight is None for s in self.sources}) > 1:
                raise ValueError("data.sources mixes weights and counts: give every source a weight (its share of "
                                 "each step) or every source a count (its examples an epoch)")
            if self.eval_split is not None and not isinstance(self.eval_split, float):
                raise ValueError("with data.sources, data.eval_split is a fraction of every source (e.g. 0.05); eval "
                                 "files or a split name belong to their source: data.sources[N].eval_split")
            if self.format != self.sources[0].format:
                raise ValueError(f"data.format is {self.format} but the first source's format is "
                                 f"{self.sources[0].format}: with data.sources remove data.format (each source has "
                                 "its own)")
        elif self.path is None or self.format is None:
            missing = " and ".join(k for k in ("path", "format") if getattr(self, k) is None)
            raise ValueError(f"missing data.{missing.replace(' and ', ' and data.')}: give data.path (file(s), a "
                             "dataset folder or a hub dataset) and data.format (how its rows are laid out), or "
                             "data.sources (a mixture, each source with both)")
        if self.chat_template is not False and self.format not in ("messages", *CHAT_TEMPLATED):
            raise ValueError(f"data.chat_template applies to formats prompt_completion, messages, preference, "
                             f"unpaired and prompt, not {self.format}")
        # one rule for both keys (the kwargs had been taken and ignored for RL's plain-text prompts, and the system
        # prompt refused with advice an RL recipe cannot follow): the recipe says its rows are chats
        for key, what in (("system_prompt", "puts a system message in each chat the template renders"),
                          ("chat_template_kwargs", "are variables the chat template reads")):
            if getattr(self, key) and self.format != "messages" and self.chat_template is False:
                fix = ("set data.chat_template: true (or a template file; a prompt that is a list of messages is "
                       "rendered as a chat either way)" if self.format in CHAT_TEMPLATED else
                       f"data.format {self.format} is never rendered through it; use data.format: messages")
                raise ValueError(f"data.{key} {what}, and nothing says these rows are rendered through the chat "
                                 f"template: {fix}, or remove data.{key}")
        for key, source in [("data.roles", self)] + [(f"data.sources[{i}].roles", s)
                                                     for i, s in enumerate(self.sources or [])]:
            if source.roles and source.format in ("text", "alpaca"):  # rows without messages: nothing to rename
                rows = "plain text" if source.format == "text" else "instruction, input and output"
                raise ValueError(f"{key} maps the roles of messages, and data.format {source.format} has none (its "
                                 f"rows are {rows}): remove {key}, or use data.format: messages for rows that are "
                                 "conversations")
        bad = [k for k in self.chat_template_kwargs or {} if not str(k).isidentifier()]
        if bad:
            raise ValueError(f"data.chat_template_kwargs: {bad[0]!r} is not a name a template can read (letters, "
                             "digits and _, not starting with a digit)")
        return self


# The formats whose rows are rendered through the chat template where data.chat_template says so (messages always)
CHAT_TEMPLATED = ("prompt_completion", "preference", "unpaired", "prompt")


def source_configs(d: DataConfig) -> list[DataConfig]:
    """A data section as one DataConfig per dataset: data.path's alone, or each of data.sources' with the shared
    settings (max_seq_len, chat_template, ...) and its own path, format, fields, roles and eval split."""
    if d.sources is None:
        return [d]
    out = []
    for i, s in enumerate(d.sources):
        own = s.model_dump(exclude={"weight", "count"})
        if own["eval_split"] is None:  # data.eval_split, a fraction, applies to every source without its own
            own["eval_split"] = d.eval_split
        if own["eval_split"] is None:
            own["eval_max_examples"] = None  # data.eval_max_examples caps each source's eval rows, where it has some
        try:
            out.append(DataConfig.model_validate({**d.model_dump(exclude={"sources", "path", "format", "name", "split",
                                                                          "fields", "roles", "eval_split"}), **own}))
        except ValidationError as e:
            raise RecipeError(f"data.sources[{i}] ({s.path}): " + "; ".join(
                err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
    return out


class TrainConfig(Section):
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to run; overrides epochs when set.")
    epochs: int = Field(1, gt=0, description="Passes over the training data when max_steps is not set.")
    micro_batch_size: int = Field(1, gt=0, description="Examples per forward pass on each process.")
    micro_batch_tokens: int | None = Field(
        None, gt=1,
        description="Token budget of a micro-batch on each process. When set, a micro-batch is a bin of whole "
        "examples whose total length stays within the budget (packed padding-free), instead of "
        "micro_batch_size examples; leave micro_batch_size at 1.",
    )
    grad_accum_steps: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    fsdp_accumulate: Literal["sharded", "unsharded"] = Field(
        "sharded",
        description="How FSDP and HSDP accumulate gradients over a step's micro-batches. sharded: every micro-batch's "
        "gradients are reduce-scattered into the shards, so each GPU holds only its shard (HSDP: the all-reduce "
        "across the nodes still runs once a step). unsharded: each GPU holds the whole fp32 gradient until the "
        "last micro-batch (4 bytes per trainable parameter more per GPU: ~25 GiB on a 7B full fine-tune) and "
        "reduce-scatters once a step, sending grad_accum_steps times less within the node. No effect without FSDP "
        "or with grad_accum_steps 1.",
    )
    lr: float = Field(2e-5, gt=0, allow_inf_nan=False, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="The lr the schedule ends at, as a fraction of the "
                                "peak (linear, cosine): reached after the last step, which updates one step above "
                                "it (HF's schedules alike).")
    schedule: Literal["linear", "cosine", "constant"] = Field("cosine", description="Learning-rate decay after warmup.")
    warmup_steps: int = Field(
        0, ge=0, description="Linear warm-up to lr over this many steps: update k (1 to warmup_steps) takes lr x k / "
        "warmup_steps, so the first update is not spent at lr 0. Hugging Face's schedules (and TRL) give update k lr x "
        "(k - 1) / warmup_steps: under warm-up, a run compared with theirs is one step ahead of it until the peak.")
    optimizer: Literal["adamw", "adamw_8bit"] = Field(
        "adamw", description="adamw: torch's AdamW (fused on CUDA), its two moments in the parameters' dtype (8 "
        "bytes a trainable parameter in fp32). adamw_8bit: bitsandbytes' AdamW8bit (Dettmers et al. 2022; HF "
        "Trainer's adamw_bnb_8bit), both moments blockwise-quantised to 8 bits (about 2 bytes a parameter), an "
        "embedding's kept in 32 bits as HF Trainer and peft keep them: Mistral-7B's optimizer state 14.5 GiB instead "
        "of 54.0 (fp32 weights) or 27.0 (bf16). Needs bitsandbytes "
        "(pip install 'llmtrain[qlora]'). Under FSDP, HSDP, FSDP x TP and FSDP-sharded pipeline stages each process "
        "updates its own shard (the moments resume on the same shards, or any that split whole rows into whole blocks "
        "of 256).")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="AdamW decoupled weight decay (not "
                                "applied to any 1-D parameter: norms, biases, DoRA's magnitudes).")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False, description="AdamW epsilon.")
    neftune_alpha: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="NEFTune (Jain et al. 2023; Hugging Face's and TRL's "
        "neftune_noise_alpha, LLaMA-Factory's neftune_alpha): supervised fine-tuning's input embeddings gain uniform "
        "noise in [-1, 1] x alpha / sqrt(L d) in training (L the example's tokens, d the hidden size; the paper uses "
        "5 to 15). None: no noise.")
    disable_dropout: bool | None = Field(
        None, description="Turn every dropout off in training (lora.dropout's too), as TRL's disable_dropout. None: as "
        "TRL's trainer of the run's mode does: on for preference pairs, KTO and reward models (TRL's DPOTrainer, "
        "KTOTrainer and RewardTrainer default it on), off for supervised fine-tuning, GRPO, RLOO and distillation.")
    sft_loss: Literal["nll", "dft"] = Field(
        "nll", description="Supervised fine-tuning's loss (TRL's SFTTrainer loss_type): nll, each trained token's "
        "-log p; dft (Dynamic Fine-Tuning, Wu et al. 2025), each token's -log p times p without gradient, so tokens "
        "the model finds unlikely pull less (the paper's remedy for SFT's implicit 1/p reward weighting; it needs a "
        "model that already predicts the answers: docs/recipes.md). The logged train loss is the chosen one; the "
        "eval's loss stays the cross-entropy (nll), comparable across runs.")
    max_grad_norm: float | None = Field(1.0, gt=0, allow_inf_nan=False,
                                        description="Clip the global gradient norm to this; null disables.")
    max_bad_steps: int = Field(
        0, ge=0,
        description="Steps with a non-finite loss or gradient norm to skip (no update, logged) before the run "
        "stops; 0 stops at the first.",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="Autocast precision. The recipe wins over a launch config that disagrees. Under FSDP the "
        "weights are gathered in it for the forward and backward (FSDP's param_dtype; the gradients reduced and the "
        "master shards kept in fp32), where one process and DDP cast each op's inputs under autocast: fp16's loss "
        "scale may then overflow a step or two more (2 in 10 on the tiny model). fp16 is Accelerate's on GPUs only."
    )
    seed: int = Field(42, ge=0, lt=2**32, description="Seed for model init, data order and dropout (0 to 2**32 - 1, "
                      "as torch and numpy take it).")
    deterministic: bool = Field(
        False,
        description="torch.use_deterministic_algorithms, strict (an op with no deterministic kernel raises; RL "
        "sampling only warns), so flash attention's backward is deterministic, and CUBLAS_WORKSPACE_CONFIG=:4096:8: "
        "a run and its resume give bit-identical losses on one GPU; slower (docs/checkpoints.md).",
    )
    eval_every_steps: int | None = Field(
        None, gt=0, description="Evaluate every N optimizer steps; with eval data, the end of training is always evaluated.")
    eval_batch_size: int | None = Field(
        None, gt=0, description="Eval micro-batch size in examples; unset, evaluation is batched as training is "
        "(micro_batch_size, or the micro_batch_tokens budget).")
    eval_samples: int = Field(
        0, ge=0,
        description="At each eval, greedily decode the first N eval prompts (up to eval_max_new_tokens tokens) and "
        "append prompt, expected and generated text to <output_dir>/samples.jsonl; the first is shown in the "
        "console. 0: none. KTO: the first N desirable rows (an undesirable completion is not a reply to expect).",
    )
    eval_max_new_tokens: int = Field(128, gt=0, description="Most tokens generated for each eval sample.")
    eval_answer_pattern: str | None = Field(
        None, description="With eval_samples: a regular expression whose first group is the answer to compare in the "
        "generated and the expected reply (GSM8K: '#### (\\S+)'); without it the whole replies are compared.")

    @field_validator("eval_answer_pattern")
    @classmethod
    def _check_pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                groups = re.compile(v).groups
            except re.error as e:
                raise ValueError(f"is not a regular expression ({e})") from None
            if groups < 1:
                raise ValueError("needs a group around the answer, e.g. '#### (\\S+)'")
        return v
    loss_chunk_tokens: int = Field(
        4096, gt=0,
        description="The loss runs the LM head and cross-entropy over this many tokens at a time (recomputed in "
        "backward), so full fp32 logits never exist at once.",
    )
    timeout_s: int = Field(1800, gt=0, description="Collective-communication timeout for multi-process runs.")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v: Any) -> Any:
        return "no" if v is False else v  # YAML 1.1 reads an unquoted `no` as false

    @model_validator(mode="after")
    def _one_batch_unit(self) -> "TrainConfig":
        if self.micro_batch_tokens is not None and self.micro_batch_size != 1:
            raise ValueError(
                "set train.micro_batch_size (examples per micro-batch) or train.micro_batch_tokens (a token budget "
                "per micro-batch), not both: with micro_batch_tokens, set train.micro_batch_size=1 (its default)"
            )
        return self

    @property
    def eval_rows(self) -> int:
        """Examples of an eval micro-batch (the cap of its rows where it is batched by tokens)."""
        return self.eval_batch_size or self.micro_batch_size

    @property
    def eval_tokens(self) -> int | None:
        """The token budget of an eval micro-batch: the train budget unless eval_batch_size sets the examples."""
        return self.micro_batch_tokens if self.eval_batch_size is None else None


class ParallelConfig(Section):
    sequence_parallel: int = Field(
        1, ge=1, description="Processes that share one sequence (Ulysses, docs/sequence-parallel.md): each holds "
        "1/N of every packed micro-batch's tokens, and around attention an all-to-all gives each the whole sequence "
        "for 1/N of the heads. Consecutive ranks form a group (keep it inside a node); the data is split over "
        "processes / N groups. 1: off.")
    pipeline_parallel: int = Field(
        1, ge=1, description="Pipeline stages (torch.distributed.pipelining, docs/pipeline-parallel.md): the decoder "
        "layers are split into P stages on P processes, and each optimizer step's train.grad_accum_steps micro-batches "
        "flow through them. The stage is the outer dimension (ranks r and r + processes/P are neighbouring stages: "
        "put stages across nodes); the processes of one stage replicate it (data parallel). 1: off.")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="The pipeline schedule: gpipe (every forward, then every backward: all micro-batches' "
        "activations held), 1f1b (one forward one backward: at most P in flight), interleaved_1f1b (each process "
        "holds pipeline_chunks stages, shrinking the bubble by that factor).")
    pipeline_chunks: int | None = Field(
        None, ge=1, description="Stages each process holds (interleaved_1f1b: default 2; gpipe and 1f1b: 1).")

    @property
    def stages_per_rank(self) -> int:
        return self.chunks_of(self.pipeline_schedule, self.pipeline_chunks)

    @staticmethod
    def chunks_of(schedule: str, chunks: int | None) -> int:
        """Stages a process holds: pipeline_chunks, or 2 interleaved and 1 otherwise (the estimate's TrainSpec too)."""
        return chunks or (2 if schedule == "interleaved_1f1b" else 1)

    @model_validator(mode="after")
    def _check_pipeline(self) -> ParallelConfig:
        if self.pipeline_chunks not in (None, 1) and self.pipeline_schedule != "interleaved_1f1b":
            raise ValueError(f"parallel.pipeline_chunks={self.pipeline_chunks} gives each process several stages, "
                             "which only interleaved_1f1b schedules; set parallel.pipeline_schedule=interleaved_1f1b "
                             "or unset pipeline_chunks")
        unused = [k for k, off in (("pipeline_schedule", "1f1b"), ("pipeline_chunks", None)) if getattr(self, k) != off]
        if self.pipeline_parallel == 1 and unused:
            raise ValueError(f"parallel.{unused[0]} is read by pipeline stages, and parallel.pipeline_parallel is 1 "
                             "(no stages): set parallel.pipeline_parallel to the stages (e.g. 2), or remove "
                             f"{' and '.join('parallel.' + k for k in unused)}")
        return self

    @field_validator("sequence_parallel", "pipeline_parallel", "pipeline_chunks", mode="before")
    @classmethod
    def _a_count(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML's true is not a number of processes (pydantic would read it as 1)
            raise ValueError(f"is a number of processes (or stages), not {str(v).lower()}: e.g. 2")
        return v


class CheckpointConfig(Section):
    every_steps: int | None = Field(None, gt=0, description="Save resumable state every N optimizer steps.")
    keep_last: int = Field(2, gt=0, description="Keep only the newest N step checkpoints.")
    save_final: bool = Field(True, description="Export the trained model (or adapter) to <output_dir>/final.")


class LoggingConfig(Section):
    progress: bool = Field(True, description="Show a rich progress bar.")
    plot: bool = Field(True, description="Rewrite <output_dir>/loss.png at each eval and at the end (matplotlib, about "
                       "half a second of CPU each time); `llmtrain plot RUN` draws it from metrics.jsonl at any time.")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers that also get every metrics line, and the resolved recipe as their config: "
        "tensorboard (<output_dir>/tb), wandb (<output_dir>/wandb; WANDB_MODE=offline needs no account), mlflow "
        "(MLFLOW_TRACKING_URI). Each needs its extra, e.g. pip install 'llmtrain[wandb]'.",
    )
    project: str | None = Field(
        None, description="wandb project / mlflow experiment; default WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else "
        "'llmtrain'.")
    run_name: str | None = Field(None, description="The trackers' run name; default the output_dir folder name.")
    tensorboard: bool = Field(False, description="Older spelling of report_to: [tensorboard] (added to report_to).")
    every_steps: int = Field(
        1, gt=0,
        description="Write a train line to metrics.jsonl every N steps. Loss and grad norm are read from the "
        "device (a host sync) only on those steps.",
    )
    peak_tflops: float | None = Field(
        None, gt=0,
        description="Peak dense TFLOP/s of one device, for MFU; by default looked up from the device name.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # report_to: wandb, or logging.report_to=wandb

    @model_validator(mode="after")
    def _tensorboard_key(self) -> "LoggingConfig":
        if self.tensorboard and "tensorboard" not in self.report_to:
            self.report_to = [*self.report_to, "tensorboard"]
        return self


REFERENCE_FREE = ("simpo", "orpo")  # the preference losses with no reference model
# f-DPO (Wang et al. 2024): the losses built on the chosen-rejected difference, where the other divergences' log Z(x)
# cancels (TRL 1.16's set; the others keep the reverse KL)
F_DIVERGENCE_LOSSES = ("dpo", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop")
SMOOTHED = ("robust", "exo_pair", "aot", "aot_unpaired")  # the losses that read preference.label_smoothing


PREFERENCE_LOSSES = ("dpo", "ipo", "simpo", "orpo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair",
                     "sppo_hard", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "aot", "aot_unpaired")


class ReferenceSync(Section):
    """A reference that follows the policy (TR-DPO, Gorbatovski et al. 2024; TRL's sync_ref_model): every
    every_steps optimizer steps each reference weight becomes alpha x the policy's + (1 - alpha) x its own."""

    every_steps: int = Field(512, ge=1, description="Optimizer steps between two updates of the reference (TRL's "
                             "ref_model_sync_steps; the paper's tau).")
    alpha: float = Field(0.6, gt=0, le=1, description="The policy's share in the reference after an update (TRL's "
                         "ref_model_mixup_alpha): 1 replaces the reference with the policy (the paper's hard update).")


def _sync_shorthand(v: Any) -> Any:
    """sync_reference: true is TRL's defaults (every 512 steps, alpha 0.6); false is off."""
    if v is True:
        return {}
    return None if v is False else v


SYNC_REFERENCE = ("A reference that follows the policy (TR-DPO; TRL's sync_ref_model): {every_steps: 512, alpha: 0.6}"
                  " (true: those) mixes alpha x the policy into a full fine-tune's frozen copy every every_steps "
                  "steps. With LoRA (which TRL refuses) alpha 1 only: the reference becomes the adapter as it was at "
                  "the last sync (the base model, the adapter disabled, before the first). Checkpoints keep the "
                  "reference, so a resume goes on with it.")


class PreferenceConfig(Section):
    loss: str | list[str] = Field(
        "dpo", description="A loss, or a list of losses summed with loss_weights (MPO's mix, TRL's list of loss_types; "
        "preference.sft_weight is its sft). dpo: the sigmoid loss of Rafailov et al. 2023; ipo: Azar et al. 2023, on "
        "per-token log-ratios (as TRL); simpo: Meng et al. 2024, reference-free, on per-token log-probabilities; "
        "orpo: Hong et al. 2024, reference-free, the chosen answers' NLL plus beta x an odds-ratio loss (one stage "
        "from a base model, no SFT before it). TRL's DPOTrainer loss_types by their names, each on the log-ratios to "
        "the reference: hinge (SLiC), robust (Chowdhury et al. 2024, with label_smoothing: the share of flipped "
        "labels), exo_pair (Ji et al. 2024, label_smoothing > 0), nca_pair (Chen et al. 2024), bco_pair (Jung et al. "
        "2024), sppo_hard (Wu et al. 2024), apo_zero and apo_down (D'Oosterlinck et al. 2024: chosen answers better, "
        "or worse, than the model's own), discopop (Chris Lu et al. 2024, discopop_tau), sigmoid_norm (dpo on per-"
        "token log-ratios), aot and aot_unpaired (Melnyk et al. 2024: dpo on the micro-batch's sorted margins, or its"
        " sorted chosen against its sorted rejected log-ratios; label_smoothing cDPO's conservative smoothing).")
    beta: float = Field(0.1, gt=0, description="Strength of the reference (dpo, ipo: the KL weight), reward scale "
                        "(simpo, where the paper uses about 2.0) or the odds-ratio term's weight (orpo: the paper's "
                        "lambda, 0.1 as TRL's default).")
    loss_weights: list[float] | None = Field(
        None, description="With a list of losses (TRL's loss_weights): each one's weight in the sum, in order; "
        "default 1 each. MPO (Wang et al. 2024): loss [dpo, bco_pair], loss_weights [0.8, 0.2], sft_weight 1.")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin (gamma).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="robust, exo_pair, aot and aot_unpaired (TRL's): "
                                   "the assumed share of pairs whose labels are flipped (robust: 0 is dpo; exo_pair "
                                   "needs it above 0, e.g. 1e-3).")
    discopop_tau: float = Field(0.05, gt=0, allow_inf_nan=False, description="discopop (TRL's): the temperature of "
                                "the mix of its logistic and exponential parts (the paper's 0.05).")
    f_divergence: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = Field(
        "reverse_kl", description="f-DPO (Wang et al. 2024, TRL's f_divergence_type): the divergence from the "
        "reference that regularises the policy; each answer's log-ratio u enters the loss as f'(e^u): reverse_kl u "
        "(DPO's), forward_kl 1 - e^-u, js_divergence log 2 + log sigmoid(u), alpha_divergence (e^((a-1) u) - 1) / "
        "(a - 1) with a = f_alpha. Only the losses built on the chosen-rejected difference take another than "
        "reverse_kl: " + ", ".join(F_DIVERGENCE_LOSSES) + ".")
    f_alpha: float | None = Field(
        None, allow_inf_nan=False, description="f_divergence alpha_divergence only (TRL's f_alpha_divergence_coef, "
        "default 0.5): its alpha; 0 is the forward KL, 1 the reverse KL (refused: set f_divergence reverse_kl).")
    ld_alpha: float | None = Field(
        None, ge=0, le=1, description="LD-DPO (Liu et al. 2024, TRL's ld_alpha): each pair's answer tokens beyond "
        "the shorter answer's length count ld_alpha times in both answers' log-probabilities (policy and reference), "
        "so that a longer answer's extra tokens weigh less in the margin: 1 is the plain sum, 0 compares the answers' "
        "first tokens only. Unset: the plain sum.")
    wpo: bool = Field(False, description="WPO (Zhou et al. 2024, TRL's use_weighting): each pair's loss weighted by "
                      "how likely the policy is to produce both its answers now, exp of each answer's mean per-token "
                      "log p - log sum_v p_v^2 (its probability against the distribution's own self-agreement), the "
                      "two multiplied, without gradient: off-policy pairs the model would never sample weigh less. "
                      "Not with aot or aot_unpaired (their sort pairs no weight with a pair).")
    sft_weight: float = Field(0.0, ge=0, description="Weight of a negative log-likelihood term on the chosen "
                              "answers (RPO, Pang et al. 2024; Llama 3's DPO used 0.2): each pair adds weight x "
                              "-log p(chosen) / its answer tokens, so the chosen answers keep their probability while "
                              "the margin opens. 0: the loss alone.")
    reference: Literal["auto", "adapter", "precomputed", "copy", "none"] = Field(
        "auto", description="The reference model's log-probabilities. auto: adapter for LoRA, precomputed for a "
        "full fine-tune (copy with sync_reference), none for simpo and orpo. adapter: the same model with the LoRA "
        "adapter disabled (no second copy); precomputed: one no-grad pass over the data with the initial weights "
        "before training, cached with the tokenised data; copy: a full fine-tune's frozen copy of the starting "
        "weights (TRL's ref_model), run before each micro-batch.")
    sync_reference: ReferenceSync | None = Field(None, description=SYNC_REFERENCE)

    _sync = field_validator("sync_reference", mode="before")(_sync_shorthand)

    @model_validator(mode="before")
    @classmethod
    def _alpha_default(cls, data: Any) -> Any:
        """alpha_divergence's alpha, TRL's 0.5 unless given (filled here so the resolved recipe states it)."""
        if isinstance(data, dict) and data.get("f_divergence") == "alpha_divergence" and data.get("f_alpha") is None:
            data = {**data, "f_alpha": 0.5}
        return data

    @property
    def weighted(self) -> list[tuple[str, float]]:
        """The losses and their weights: [(loss, 1.0)] for one loss."""
        if isinstance(self.loss, str):
            return [(self.loss, 1.0)]
        return list(zip(self.loss, self.loss_weights or [1.0] * len(self.loss)))

    @property
    def names(self) -> set[str]:
        return {name for name, _ in self.weighted}

    @property
    def reference_free(self) -> bool:
        """simpo and orpo: no reference model (a list of losses holds neither: _check_mix)."""
        return self.loss in REFERENCE_FREE

    @field_validator("loss")
    @classmethod
    def _known_losses(cls, v: str | list[str]) -> str | list[str]:
        for name in [v] if isinstance(v, str) else v:
            if name not in PREFERENCE_LOSSES:
                close = difflib.get_close_matches(name, PREFERENCE_LOSSES, n=1, cutoff=0.6)
                raise ValueError(f"unknown loss {name!r}{f' (did you mean {close[0]}?)' if close else ''}: one of "
                                 f"{', '.join(PREFERENCE_LOSSES)}, or a list of them")
        return v

    @model_validator(mode="before")
    @classmethod
    def _one_loss(cls, data: Any) -> Any:
        """A list of one loss is that loss."""
        if isinstance(data, dict) and isinstance(data.get("loss"), list) and len(data["loss"]) == 1:
            data = {**data, "loss": data["loss"][0]}
        return data

    @model_validator(mode="after")
    def _check_mix(self) -> PreferenceConfig:
        if isinstance(self.loss, str):
            if self.loss_weights is not None:
                raise ValueError("preference.loss_weights weighs the losses of a list (preference.loss: [dpo, "
                                 "bco_pair]), and this recipe names one loss: remove preference.loss_weights (a "
                                 "single loss's scale is the learning rate's)")
            return self
        if not self.loss:
            raise ValueError("preference.loss is an empty list: name a loss (dpo) or several")
        if len(set(self.loss)) != len(self.loss):
            raise ValueError(f"preference.loss names a loss twice ({self.loss}): give each once, with its weight in "
                             f"preference.loss_weights")
        if mixed := [name for name in self.loss if name in REFERENCE_FREE]:
            raise ValueError(f"preference.loss {mixed[0]} is reference-free and trains alone: a list mixes losses on "
                             f"the log-ratios to the reference (remove {mixed[0]} from it)")
        if self.loss_weights is not None:
            if len(self.loss_weights) != len(self.loss):
                raise ValueError(f"preference.loss_weights gives {len(self.loss_weights)} weights for the "
                                 f"{len(self.loss)} losses of preference.loss: one each, in order")
            if not all(math.isfinite(w) and w > 0 for w in self.loss_weights):
                raise ValueError(f"preference.loss_weights must be finite and above 0 (got {self.loss_weights}): "
                                 f"leave a loss out of preference.loss rather than weigh it 0")
        return self

    @model_validator(mode="after")
    def _check_reference(self) -> PreferenceConfig:
        if self.loss in REFERENCE_FREE and self.reference not in ("auto", "none"):
            raise ValueError(f"{self.loss} is reference-free; leave preference.reference at auto (got "
                             f"{self.reference})")
        if self.loss not in REFERENCE_FREE and self.reference == "none":
            raise ValueError(f"preference.loss={self.loss} needs a reference: use auto, adapter or precomputed")
        if self.sync_reference is not None and self.loss in REFERENCE_FREE:  # (reference auto: it had done nothing)
            raise ValueError(f"preference.sync_reference moves the reference as the policy trains, and "
                             f"preference.loss={self.loss} has no reference: remove preference.sync_reference")
        if self.sync_reference is not None and self.reference in ("precomputed", "none"):
            raise ValueError(f"preference.sync_reference moves the reference as the policy trains, and "
                             f"preference.reference={self.reference} "
                             + ("is computed once before training" if self.reference == "precomputed" else
                                "is no reference")
                             + ": set preference.reference=copy (or auto), or remove preference.sync_reference")
        # TRL's DPOTrainer knobs, which its ORPO and CPO (SimPO) trainers do not have: they had changed those losses
        # (ORPO's logged nll_loss too) without a word
        knobs = ["ld_alpha"] * (self.ld_alpha is not None) + ["wpo"] * self.wpo
        if self.loss in REFERENCE_FREE and knobs:
            raise ValueError(f"preference.{' and preference.'.join(knobs)} weigh DPO's log-probabilities (TRL's "
                             f"DPOTrainer), and preference.loss={self.loss} is TRL's "
                             f"{'ORPOTrainer' if self.loss == 'orpo' else 'CPOTrainer'}'s, which has none: remove "
                             f"{' and '.join('preference.' + k for k in knobs)}")
        if self.ld_alpha is not None and self.sft_weight:  # TRL's sft term reads the unweighted log-probabilities
            raise ValueError("preference.sft_weight with preference.ld_alpha: TRL's sft term takes the chosen "
                             "answers' unweighted log-probabilities, which llmtrain's pass does not keep beside the "
                             "LD-weighted ones (it had taken the weighted, 9% off TRL's loss on longer chosen "
                             "answers): remove one of them")
        # (a DPO run's own recipe.yaml had been refused for its simpo_gamma: 0.5, the default it spells out)
        unread = [k for k, reader in (("simpo_gamma", "simpo"), ("discopop_tau", "discopop"))
                  if self.off_default(k) and reader not in self.names]
        if unread:  # (ignored without a word, where label_smoothing and f_alpha are refused)
            raise ValueError(f"preference.{unread[0]} is read by preference.loss={unread[0].split('_')[0]}, and this "
                             f"recipe's loss is {self.loss}: remove it")
        if self.label_smoothing and not self.names & set(SMOOTHED):
            raise ValueError(f"preference.label_smoothing is read by preference.loss {', '.join(SMOOTHED)}, and this "
                             f"recipe's loss is {self.loss}: remove it (or set preference.loss=robust)")
        if self.f_divergence != "reverse_kl" and not self.names <= set(F_DIVERGENCE_LOSSES):
            raise ValueError(f"preference.f_divergence={self.f_divergence} regularises the losses built on the "
                             f"chosen-rejected difference ({', '.join(F_DIVERGENCE_LOSSES)}), where its log Z(x) "
                             f"cancels; this recipe's loss is {self.loss}: remove preference.f_divergence (or set "
                             f"preference.loss=dpo)")
        if self.wpo and (sorting := sorted(self.names & {"aot", "aot_unpaired"})):
            raise ValueError(f"preference.wpo weighs each pair's loss, and {sorting[0]} sorts the micro-batch's "
                             f"log-ratios so that no loss belongs to a pair: remove preference.wpo (or use another "
                             f"preference.loss)")
        if self.f_alpha is not None and self.f_divergence != "alpha_divergence":
            raise ValueError(f"preference.f_alpha is alpha_divergence's alpha, and this recipe's f_divergence is "
                             f"{self.f_divergence}: remove it (or set preference.f_divergence=alpha_divergence)")
        if self.f_divergence == "alpha_divergence":
            if abs(self.f_alpha - 1) < 1e-6:
                raise ValueError("preference.f_alpha=1 makes the alpha divergence the reverse KL: set "
                                 "preference.f_divergence=reverse_kl and remove preference.f_alpha")
        if "exo_pair" in self.names and not self.label_smoothing:
            raise ValueError("preference.loss=exo_pair takes log(label_smoothing): set preference.label_smoothing "
                             "above 0 (the paper's 1e-3)")
        if self.loss == "orpo" and self.sft_weight:
            raise ValueError("orpo's loss holds the chosen answers' negative log-likelihood already (weight 1, beta "
                             "weighs the odds-ratio term against it): leave preference.sft_weight at 0, or raise "
                             "preference.beta to weigh the preference more")
        return self


class KTOConfig(Section):
    loss_type: Literal["kto", "apo_zero_unpaired"] = Field(
        "kto", description="kto: Ethayarajh et al. 2024 (eq. 7), against a KL estimate from the micro-batch's "
        "mismatched prompt/completion pairs; apo_zero_unpaired: D'Oosterlinck et al. 2024, unpaired, no KL term.")
    beta: float = Field(0.1, gt=0, description="Strength of the reference: the implicit reward is beta x the "
                        "log-ratio of policy to reference.")
    desirable_weight: float = Field(1.0, gt=0, description="Weight of the loss of desirable (label: true) "
                                    "completions.")
    undesirable_weight: float = Field(1.0, gt=0, description="Weight of the loss of undesirable (label: false) "
                                      "completions.")
    sync_reference: ReferenceSync | None = Field(None, description=SYNC_REFERENCE)

    _sync = field_validator("sync_reference", mode="before")(_sync_shorthand)


class RewardModelConfig(Section):
    """A reward model (TRL 1.16's RewardTrainer): a one-output sequence-classification head on the model, trained on
    preference pairs with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin)."""

    center_rewards_coefficient: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="Adds this times mean((r_chosen + r_rejected)^2) to the loss, "
        "keeping the rewards near zero mean (Eisenstein et al. 2023, eq. 2; TRL recommends 0.01). null: off (TRL's "
        "default).")


class RewardConfig(Section):
    type: Literal["answer_match", "format", "function", "reward_model"] = Field(
        description="answer_match: 1 where the completion's answer (the first group of `pattern`) equals the "
        "`column`'s; format: 1 where the completion matches `pattern`; function: the user's `function`; "
        "reward_model: the score of a trained reward model (`path`) on prompt + completion.")
    weight: float = Field(1.0, allow_inf_nan=False, description="The reward's weight in the summed reward.")
    pattern: str | None = Field(
        None, description="answer_match: a regular expression whose first group is the answer (default "
        "train.eval_answer_pattern; none: the whole stripped reply); format: the pattern a completion must match.")
    column: str = Field("answer", description="answer_match: the dataset column holding the expected answer.")
    function: str | None = Field(
        None, description="function: module:function with TRL's signature f(prompts, completions, completion_ids, "
        "trainer_state, **columns) -> list[float | None] (or an async one); the module is imported from PYTHONPATH "
        "or the working directory.")
    path: str | None = Field(
        None, description="reward_model: a folder with a one-output sequence-classification model (a reward-model "
        "run's final/, or its LoRA adapter), scored in batches on the run's device under no_grad.")
    batch_size: int = Field(64, gt=0, description="reward_model: completions scored in one forward pass.")
    name: str | None = Field(
        None, min_length=1, pattern=r"^[^/\s]+$",
        description="The reward's name in the metrics (rewards/<name>/mean) and rollouts.jsonl; default: the "
        "function's name, or the type (answer_match, format). Two rewards need two names.")

    @model_validator(mode="after")
    def _check_kind(self) -> RewardConfig:
        if self.type == "function" and not self.function:
            raise ValueError("a reward of type function needs function: module:function")
        if self.type != "function" and self.function:
            raise ValueError(f"function: is read by rewards of type function, not {self.type}")
        if (self.type == "reward_model") != (self.path is not None):
            raise ValueError("path: goes with type: reward_model (the reward model's folder), and a reward_model "
                             "needs it" if self.type == "reward_model" else
                             f"path: is read by rewards of type reward_model, not {self.type}")
        if self.type == "format" and not self.pattern:
            raise ValueError("a reward of type format needs pattern: the regular expression a completion must match")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as e:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression ({e})") from None
            if self.type == "answer_match" and groups < 1:
                raise ValueError("an answer_match pattern needs a group around the answer, e.g. '#### (\\S+)'")
        return self

    @property
    def label(self) -> str:
        """The reward's name in the metrics (rewards/<name>/mean) and rollouts.jsonl: `name`, else the function's
        name or the type."""
        if self.name is not None:
            return self.name
        return self.function.rpartition(":")[2] if self.type == "function" else self.type


# The fast sampler's prefill forwards at most this many prompt positions at once (model/fast_sample.py: a longer
# prompt goes in chunks, each attending to the ones before it through the cache); the estimate's prefill phase too.
PREFILL_CHUNK = 1024
# The smallest sampling temperature (vLLM's _SAMPLING_EPS, below which vLLM samples greedily): logits divided by much
# less overflow float32 (a logit of 10 over 1e-38) and every draw is NaN. 0 is greedy where a sampler allows it.
MIN_TEMPERATURE = 1e-5
TOP_K = ("Sampling: only the top_k most likely tokens (and any tied with the k-th) may be drawn, before top_p "
         "(transformers' order; TRL's top_k); 0: all of them. The log-probabilities the loss takes are of the whole "
         "distribution at the temperature, as TRL's.")
MIN_P = ("Sampling: a token may be drawn only if its probability is at least min_p times the most likely one's, after "
         "top_k and top_p (TRL's min_p); 0: off.")
REPETITION_PENALTY = ("Sampling (TRL's repetition_penalty, transformers' processor): each token already in the prompt "
                      "or the completion so far has its logit divided by this where positive, multiplied where "
                      "negative, before the temperature and the filters; 1: off, above 1 repeats less. Only the "
                      "sampling sees it: the loss's log-probabilities are the policy's own, as TRL's, and the eval's "
                      "greedy completions are unpenalised.")
# the sampling settings an rl: or distill: section holds, by the names the samplers take (objectives/rollouts.sample)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_of(section) -> dict:
    """An rl: or distill: section's sampling settings (SAMPLING), as the samplers take them (and the memory
    estimate prices their filters)."""
    return {name: getattr(section, name) for name in SAMPLING}


MergedCopy = Literal["rollout", "kept", "off"]
# adaptive entropy control's keys (rl.use_adaptive_entropy), and TRL's defaults for them
ADAPTIVE_ENTROPY = {"entropy_target": 0.2, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0,
                    "entropy_coef_delta": 0.005}
# rl.sampler_correction's own keys, TRL's defaults (vllm_importance_sampling_clip_max and _min)
SAMPLER_CORRECTION = {"sampler_correction_max": 3.0, "sampler_correction_min": None}
# online RL's losses with keys of their own, and TRL's defaults for them (rl.loss_type sapo, vespo)
LOSS_KEYS = {"sapo": {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05},
             "vespo": {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}}
MERGED_COPY = (
    "LoRA and QLoRA: what the fast sampler (static, graph) forwards each adapted linear through (docs/rl.md): off (the "
    "default), the adapters unmerged beside the base, exactly the trained policy; rollout, a merged generation copy "
    "(base + scaled adapter product, in the compute dtype; a 4-bit base dequantized) built from the current weights "
    "for each rollout and freed after it: fewer kernels a token, but in bf16 the copy rounds each weight to bf16, so "
    "an adapter change under half a bf16 step of its weight (|w| / 512) does not reach the samples (most of a young "
    "adapter); kept, the same copy kept between rollouts (rebuilt in place: no allocation, its memory held through "
    "the update too). A copy that does not fit beside the KV cache samples unmerged, with a warning.")


def _as_bool(value: Any) -> bool | None:
    """A switch's value as its bool field reads it (true, 'yes', 0, ...), None where that field refuses it."""
    from pydantic import TypeAdapter

    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return None


def _switched(data: dict, keys: dict, *, on: bool, reader: str, fix: str) -> None:
    """A switch's own keys in an rl: section (`data`): their defaults (`keys`) filled in where it is on; where it is
    off, any given is refused, naming what reads them (`reader`) and how to turn it on (`fix`)."""
    if on:
        data.update({k: v for k, v in keys.items() if data.get(k) is None})
    elif given := [k for k in keys if data.get(k) is not None]:
        raise ValueError(f"rl.{given[0]} is read by {reader}: {fix}, or remove {', '.join('rl.' + k for k in given)}")


class RLConfig(Section):
    algorithm: Literal["grpo", "rloo"] = Field(
        "grpo", description="grpo: TRL's GRPOTrainer (group-normalised advantages, per-token loss, k3 KL in the "
        "loss); rloo: TRL's RLOOTrainer (each completion's reward minus the mean of its group's other completions, "
        "the k1 KL subtracted from the reward, one ratio per sequence). docs/rl.md says what else differs.")
    num_generations: int | None = Field(
        None, ge=2, description="Completions sampled per prompt: a group, whose rewards are compared with each other "
        "(GRPO's advantages, RLOO's leave-one-out baseline). Unset: TRL's for the algorithm, 8 for grpo, 2 for rloo.")
    num_generations_eval: int | None = Field(
        None, ge=1, description="The eval's completions per prompt (TRL's num_generations_eval). None (the default): "
        "one greedy completion per eval prompt, deterministic; N: N completions per prompt sampled as the rollouts "
        "are (rl.temperature and the filters), from the same seeds at every eval (so two evals differ by the policy, "
        "not by the draws): eval_reward and eval_answer_accuracy are their means, and with N > 1 "
        "eval_answer_pass@N the share of prompts with an answer_match among their N.")
    max_completion_tokens: int = Field(256, gt=0, description="Most tokens of a completion; one that reaches it "
                                       "without a stop token is clipped (completions/clipped_ratio). 256, where TRL's "
                                       "max_completion_length is 512: set 512 to compare a run with TRL's defaults.")
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, allow_inf_nan=False, description="Sampling temperature; the "
                               "policy's log-probabilities are taken at the same temperature (as TRL).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose "
                         "probabilities add up to top_p.")
    top_k: int = Field(0, ge=0, description=TOP_K)
    min_p: float = Field(0.0, ge=0, lt=1, description=MIN_P)
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False, description=REPETITION_PENALTY)
    loss_type: Literal["dapo", "grpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"] | None = Field(
        None, description="grpo only, the loss and how it is normalised, as TRL 1.16: dapo (the default, TRL's), "
        "every completion token of the step weighs the same; grpo, each completion's mean over its tokens, then the "
        "mean over completions; dr_grpo, the token sum over completions x max_completion_tokens; cispo (MiniMax-M1), "
        "normalised as dapo, each token's policy gradient weighted by its ratio capped at rl.epsilon_high (required: "
        "the cap itself, ScaleRL's 5.0), the weight without gradient, so no token's gradient is dropped; sapo (Soft "
        "Adaptive Policy Optimization), normalised as grpo, PPO's clip replaced by a smooth gate of the ratio "
        "(rl.sapo_temperature_pos/_neg); luspo (Length-Unbiased Sequence Policy Optimization), GSPO's clipped "
        "sequence ratio with each completion's token sum, then the mean over completions (importance_sampling_level "
        "defaults to sequence with it); vespo (Variational Sequence-Level Soft Policy Optimization), normalised as "
        "dapo, each token's policy gradient weighted by a gamma function of its completion's whole ratio "
        "(rl.vespo_k_pos/_lambda_pos/_k_neg/_lambda_neg), the weight without gradient. rloo: unset (its loss is the "
        "mean over completions of a per-sequence loss).")
    sapo_temperature_pos: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="loss_type sapo only (TRL's, default 1.0): the gate's "
        "temperature for tokens with a positive advantage (higher: the gradient fades sooner as the ratio moves).")
    sapo_temperature_neg: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="loss_type sapo only (TRL's, default 1.05): the gate's "
        "temperature for tokens with an advantage of 0 or below.")
    vespo_k_pos: float | None = Field(
        None, allow_inf_nan=False, description="loss_type vespo only (TRL's, default 2.0): k of the weight "
        "e^lambda w^k e^(-lambda w) (w: the completion's ratio) for completions with an advantage of 0 or more.")
    vespo_lambda_pos: float | None = Field(
        None, allow_inf_nan=False, description="loss_type vespo only (TRL's, default 3.0): its lambda for them.")
    vespo_k_neg: float | None = Field(
        None, allow_inf_nan=False, description="loss_type vespo only (TRL's, default 3.0): k for completions with "
        "a negative advantage.")
    vespo_lambda_neg: float | None = Field(
        None, allow_inf_nan=False, description="loss_type vespo only (TRL's, default 2.0): lambda for them.")
    importance_sampling_level: Literal["token", "sequence"] | None = Field(
        None, description="grpo only (TRL's importance_sampling_level): token (the default), a ratio per completion "
        "token; sequence, GSPO's (Zheng et al. 2025): one ratio per completion, exp of the mean of its tokens' "
        "log-ratios, clipped as a whole and given to each of its tokens (GSPO's setup: loss_type grpo; dapo and "
        "dr_grpo weigh each completion by its length). It differs from token only where the ratio is not 1: with "
        "rl.num_iterations > 1. rloo: unset (its ratio is per sequence already).")
    beta: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="Weight of the KL to the reference (the starting model; LoRA: "
        "the adapter disabled). Default TRL's for the algorithm: 0 for grpo (no reference needed), 0.05 for rloo "
        "(which subtracts beta x the completion's summed k1 log-ratio from its reward).")
    sync_reference: ReferenceSync | None = Field(
        None, description=SYNC_REFERENCE[:-1] + "; with rl.beta > 0 (the reference is read by the KL term only).")

    _sync = field_validator("sync_reference", mode="before")(_sync_shorthand)
    num_iterations: int = Field(
        1, ge=1, description="Updates per generation round (TRL's num_iterations, the GRPO paper's mu): the step that "
        "samples a window's completions is followed by num_iterations - 1 more optimizer steps on the same "
        "completions and advantages, each against the log-probabilities of the policy that sampled them (taken "
        "once, without gradient, after sampling), so the ratio moves away from 1 and rl.epsilon's clip binds. Every "
        "update is a step (train.max_steps, the schedule, logging and checkpoints count updates; new prompts every "
        "num_iterations steps, an epoch num_iterations times as many steps). 1: sample before every update.")
    epsilon: float = Field(0.2, gt=0, lt=1, description="The clipped surrogate's lower (and upper) bound: ratios "
                           "outside [1 - epsilon, 1 + epsilon] are clipped (with rl.num_iterations 1 the ratio is "
                           "always 1: the clip never binds).")
    epsilon_high: float | None = Field(None, gt=0, description="DAPO's separate upper bound (e.g. 0.28); default "
                                       "epsilon.")
    delta: float | None = Field(
        None, gt=1, allow_inf_nan=False, description="grpo only (TRL's; INTELLECT-2's two-sided clipping): the "
        "unclipped ratio is capped at delta too, so a completion with a negative advantage whose ratio grew large "
        "cannot make the loss unbounded (INTELLECT-2 uses 4; it should exceed 1 + epsilon_high). Only a ratio "
        "away from 1 meets it: rl.num_iterations > 1. None: no cap.")
    scale_rewards: Literal["group", "batch", "none"] | None = Field(
        None, description="grpo only (TRL's): group (the default), advantages are (reward - group mean) / group std; "
        "batch, (reward - group mean) / the std of the step's rewards over every process (PPO Lite); none, reward - "
        "group mean (Dr. GRPO). rloo: unset (see normalize_advantages).")
    use_bias_correction_kl: bool | None = Field(
        None, description="grpo only (TRL's, default true): the KL term times the ratio to the policy that sampled (1 "
        "in value, not in gradient), so that its gradient is the unbiased reverse KL's (DeepSeek-V3.2); false: the "
        "k3 term alone, as TRL before 1.16 and most papers. Acts only with rl.beta > 0.")
    off_policy_mask_threshold: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="grpo only (TRL's; DeepSeek-V3.2's off-policy sequence "
        "masking): a completion with a negative advantage whose policy has drifted from the one that sampled it by "
        "more than this (the mean over its tokens of the old minus the current log-probability) trains no policy "
        "term (its KL term stays). Only a round's later updates drift: rl.num_iterations > 1. None: off.")
    top_entropy_quantile: float | None = Field(
        None, ge=0, le=1, allow_inf_nan=False, description="grpo only (TRL's, default 1; rho of 'Beyond the 80/20 "
        "Rule', which recommends 0.2): only the tokens whose entropy (the policy's, at rl.temperature) is in the top "
        "rho share of a forward pass's trained tokens on every process train their policy term (the quantile over "
        "the pass's completion tokens, TRL's over its micro-batch's; the KL term counts for all); 0 keeps the "
        "highest alone, 1 every token.")
    entropy_coef: float | None = Field(
        None, allow_inf_nan=False, description="grpo only (TRL's, default 0): the weight of an entropy bonus, the "
        "loss minus entropy_coef x the policy's mean entropy (at rl.temperature) over the step's trained completion "
        "tokens on every process, with its gradient; positive keeps the policy from collapsing onto one answer "
        "(logged: entropy, entropy_coef, policy_loss). Not with rl.top_entropy_quantile below 1. With "
        "rl.use_adaptive_entropy, the starting coefficient.")
    use_adaptive_entropy: bool | None = Field(
        None, description="grpo only (TRL's, Skywork-OR1's adaptive entropy control; default off): after each step "
        "the coefficient rises by rl.entropy_coef_delta while the step's mean entropy is at or below "
        "rl.entropy_target and falls by it otherwise, within [rl.entropy_coef_min, rl.entropy_coef_max]; a step "
        "applies it only when the previous step's entropy was at or below the target (the first step: never). Its "
        "state is saved with each checkpoint.")
    entropy_target: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="rl.use_adaptive_entropy only (TRL's, default 0.2 nats, which "
        "almost never engages): the mean entropy below which the bonus applies; set it near the `entropy` an early "
        "step logs.")
    entropy_coef_min: float | None = Field(None, allow_inf_nan=False, description="rl.use_adaptive_entropy only "
                                           "(TRL's, default 0): the lowest coefficient.")
    entropy_coef_max: float | None = Field(None, allow_inf_nan=False, description="rl.use_adaptive_entropy only "
                                           "(TRL's, default 1): the highest coefficient.")
    entropy_coef_delta: float | None = Field(None, ge=0, allow_inf_nan=False, description="rl.use_adaptive_entropy "
                                             "only (TRL's, default 0.005): the coefficient's change a step.")
    sampler_correction: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] | None = Field(
        None, description="grpo only (TRL's vllm_importance_sampling_correction and _mode, which TRL turns on with "
        "vLLM; default off): corrects for the sampler drawing from a slightly different distribution than the policy "
        "trains (its kernels, its KV cache, rl.merged_copy's bf16 copy, top_p's cut): each trained token's policy "
        "term is weighted by the importance ratio of the policy as it sampled (one more forward a rollout where "
        "rl.num_iterations is 1) to the sampler's own log-probability of that token. token_*: a ratio a token; "
        "sequence_*: a completion's, the product over its tokens; *_truncate clamps the ratio to [rl."
        "sampler_correction_min, rl.sampler_correction_max], *_mask trains no policy term (its KL term stays) where "
        "the ratio is outside them. Logged: sampling/sampling_logp_difference/mean and max (|policy - sampler| per "
        "token), sampling/importance_sampling_ratio/min, mean and max.")
    sampler_correction_max: float | None = Field(
        None, gt=0, description="rl.sampler_correction only (TRL's vllm_importance_sampling_clip_max, "
        "default 3): the ratio's upper bound (.inf: none).")
    sampler_correction_min: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="rl.sampler_correction only (TRL's "
        "vllm_importance_sampling_clip_min, default none): the ratio's lower bound.")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] | None = Field(
        None, description="grpo only (TRL's): how several rewards become advantages. sum_then_normalize (the "
        "default): their weighted sum, then scale_rewards; normalize_then_sum (GDPO, Liu et al. 2026): each reward "
        "function's rewards normalised in their group first (so a reward with a wide range does not drown the "
        "others), then the weighted sum, shifted to mean 0 and divided by its std over the step's completions on "
        "every process (scale_rewards is not read: leave it unset).")
    normalize_advantages: bool = Field(
        False, description="rloo only (TRL's, default off): the step's leave-one-out advantages, over every "
        "process, shifted to mean 0 and divided by their std (+ 1e-4).")
    reward_clip_range: tuple[float, float] | None = Field(
        None, description="rloo only (TRL's): each completion's summed reward clamped to [min, max] before the KL "
        "penalty and the baseline; default no clipping.")
    mask_truncated_completions: bool = Field(
        False, description="TRL's (DAPO's overlong filtering): a completion that reached max_completion_tokens without "
        "a stop token trains none of its tokens (its reward still counts in its group's advantages; loss_type dapo "
        "then divides by the other completions' tokens, grpo and dr_grpo by every completion, as TRL).")
    rewards: list[RewardConfig] = Field(min_length=1, description="The reward functions, summed with their weights.")
    tools: list[str] = Field(
        default_factory=list, description="Python functions the model may call mid-completion, each named "
        "module:function (TRL's contract: type hints and a docstring with an Args section; sync or async; "
        "deterministic, so a resumed run samples the same). Their schemas are rendered into the prompts by the chat "
        "template; a turn that ends with calls (as the template writes them) has them run, their results appended "
        "as the template renders tool messages, and the completion goes on. Tool results are not trained "
        "(docs/tools.md).")
    environment: str | None = Field(
        None, description="A class module:Class (TRL's environment_factory), one instance per completion: "
        "reset(**row) before it is sampled (the row's prompt and columns; text it returns is appended to the "
        "prompt's last message), its public methods tools as rl.tools are (on that instance), and get_reward(), "
        "where it has one, a reward named after the class (weight 1) beside rl.rewards.")
    max_tool_calls: int | None = Field(
        None, ge=0, description="The most rounds of tool calls a completion makes (TRL's max_tool_calling_iterations; "
        "a round runs every call of one turn); default no limit but max_completion_tokens, which counts the tools' "
        "results too.")
    tool_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False, description="A tool call running longer gets "
                                  "an error as its result (and counts as a failure).")
    sampler: Literal["static", "graph", "reference"] = Field(
        "graph", description="How completions are sampled (the same tokens up to rounding, docs/rl.md): graph, a "
        "preallocated KV cache and a fixed-shape decode step with no host sync per token, replayed as a CUDA graph "
        "(on CUDA; static elsewhere); static, that step run eagerly; reference, the plain loop over transformers' "
        "growing cache (the oracle).")
    merged_copy: MergedCopy = Field("off", description=MERGED_COPY)
    generation_batch: Literal["micro_batch", "step"] = Field(
        "micro_batch", description="What the sampler draws at once. micro_batch: each micro-batch's prompts x "
        "rl.num_generations as it comes (one micro-batch's KV cache); step: every micro-batch of the step's "
        "(train.grad_accum_steps of them) in one call, as TRL's steps_per_generation does at its default "
        "(gradient_accumulation_steps). On a GPU a decode step costs about the same for more rows, so the step's "
        "sampling takes little more than one micro-batch's did, for train.grad_accum_steps times the KV cache "
        "(estimate-memory counts it). The same completions either way: each completion's seed is its own. Not with "
        "rl.tools or rl.environment (their loop runs a micro-batch at a time).")
    cast_lm_head_to_fp32: bool = Field(
        False, description="TRL's (the ScaleRL recipe): the LM head's weight held in fp32 and the logits made in fp32 "
        "outside autocast, by the samplers and the update alike, so that the sampler's log-probabilities and the "
        "policy's differ by the decoder's rounding only, not by 16-bit logits' too. Costs the head's weight once "
        "more at 16 bits (256 MiB for Mistral-7B). Not with a trained LM head under LoRA (lm_head in "
        "lora.target_modules or modules_to_save, model.new_tokens) or tied embeddings; under FSDP, HSDP and tensor "
        "parallelism the head is a unit of its own, gathered in fp32.")
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="The update's token budget: a micro-batch's prompt + completion sequences go "
        "through the forward and backward in passes of at most this many tokens (a sequence is never split, so at "
        "least data.max_seq_len), with the same loss and gradient as one pass. Default: one pass per micro-batch.")

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """The defaults that depend on rl.algorithm (TRL's for each trainer), filled in here so the resolved recipe
        states them; the other algorithm's knobs are refused rather than ignored."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        rloo = data.get("algorithm", "grpo") == "rloo"
        if data.get("beta") is None:
            data["beta"] = 0.05 if rloo else 0.0
        if data.get("num_generations") is None:  # (RLOO's had been GRPO's 8)
            data["num_generations"] = 2 if rloo else 8
        grpo_only = ("loss_type", "scale_rewards", "importance_sampling_level", "delta", "multi_objective_aggregation",
                     "off_policy_mask_threshold", "use_bias_correction_kl", "top_entropy_quantile", "entropy_coef",
                     "use_adaptive_entropy", *ADAPTIVE_ENTROPY, "sampler_correction", *SAMPLER_CORRECTION,
                     *(k for keys in LOSS_KEYS.values() for k in keys))
        given = ([k for k in grpo_only if data.get(k) is not None] if rloo else  # every grpo key's default is None
                 [k for k in ("normalize_advantages", "reward_clip_range") if data.get(k) not in (None, False)])
        if given:
            mine, theirs = ("rloo", "grpo") if rloo else ("grpo", "rloo")
            raise ValueError(f"rl.{given[0]} is read by rl.algorithm: {theirs}, and this recipe runs {mine}: remove "
                             f"{', '.join('rl.' + k for k in given)} (or set rl.algorithm={theirs})")
        if not rloo:
            if data.get("loss_type") is None:
                data["loss_type"] = "dapo"
            for loss, keys in LOSS_KEYS.items():  # a loss's own keys: TRL's defaults with it, refused without
                _switched(data, keys, on=data["loss_type"] == loss,
                          reader=f"rl.loss_type {loss}, and this recipe runs {data['loss_type']}",
                          fix=f"set rl.loss_type={loss}")
            if data.get("multi_objective_aggregation") == "normalize_then_sum" and data.get("scale_rewards"):
                raise ValueError(f"rl.scale_rewards={data['scale_rewards']} is not read with "
                                 "rl.multi_objective_aggregation=normalize_then_sum (each reward is normalised in its "
                                 "group, and their sum over the step): remove rl.scale_rewards")
            if data.get("multi_objective_aggregation") is None:
                data["multi_objective_aggregation"] = "sum_then_normalize"
            if data.get("use_bias_correction_kl") is None:
                data["use_bias_correction_kl"] = True
            if data.get("top_entropy_quantile") is None:
                data["top_entropy_quantile"] = 1.0
            if data.get("entropy_coef") is None:
                data["entropy_coef"] = 0.0
            switch = _as_bool(data.get("use_adaptive_entropy"))  # not Python's truth: 'fasle' had turned it on
            _switched(data, ADAPTIVE_ENTROPY, on=switch is True,
                      reader="adaptive entropy control, which is off", fix="set rl.use_adaptive_entropy=true")
            if switch is not None or data.get("use_adaptive_entropy") is None:  # else the field's check refuses it
                data["use_adaptive_entropy"] = bool(switch)
            _switched(data, SAMPLER_CORRECTION, on=data.get("sampler_correction") is not None,
                      reader="rl.sampler_correction, which is off",
                      fix="set rl.sampler_correction (e.g. sequence_mask, TRL's with vLLM)")
            if data.get("scale_rewards") is None:
                data["scale_rewards"] = "group"
            if data.get("importance_sampling_level") is None:  # luspo is GSPO's (TRL warns where it is not)
                data["importance_sampling_level"] = "sequence" if data["loss_type"] == "luspo" else "token"
        return data

    @field_validator("tools")
    @classmethod
    def _named_tools(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if ":" not in t]
        if bad:
            raise ValueError(f"rl.tools names functions as module:function; '{bad[0]}' has no ':' (e.g. "
                             "my_tools:lookup, with my_tools.py on the Python path)")
        return v

    @model_validator(mode="after")
    def _cispo(self) -> RLConfig:
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ValueError("rl.loss_type cispo caps each token's ratio at rl.epsilon_high, the cap itself (not 1 + "
                             "it), and none is given: set rl.epsilon_high (ScaleRL's is 5.0; TRL would cap at "
                             "rl.epsilon, 0.2, which scales every step down to a fifth)")
        if self.loss_type == "cispo" and self.epsilon_high < 1:  # (DAPO's 0.28, copied over, scaled every step)
            raise ValueError(f"rl.loss_type cispo caps each token's ratio at rl.epsilon_high, the cap itself (not 1 + "
                             f"it): {self.epsilon_high:g} caps the ratio of 1 every first update has, so every "
                             f"token's gradient is scaled by {self.epsilon_high:g}. Give a cap of 1 or more "
                             "(ScaleRL's is 5.0)")
        if self.loss_type == "cispo" and self.delta is not None:
            raise ValueError("rl.delta caps PPO's unclipped ratio, which rl.loss_type cispo has not (its weight is the "
                             "ratio capped at rl.epsilon_high already): remove rl.delta")
        if self.loss_type in LOSS_KEYS:
            given = [k for k in ("epsilon_high", "delta") if getattr(self, k) is not None]
            if given:
                raise ValueError(f"rl.{given[0]} bounds PPO's clip, which rl.loss_type {self.loss_type} replaces by a "
                                 f"smooth weight (rl.{', rl.'.join(LOSS_KEYS[self.loss_type])}): remove "
                                 f"{', '.join('rl.' + k for k in given)}")
        if self.loss_type == "vespo" and self.importance_sampling_level == "sequence":
            raise ValueError("rl.loss_type vespo weighs each completion by its whole ratio already, from its tokens' "
                             "log-ratios: remove rl.importance_sampling_level (TRL warns it should be token)")
        return self

    @model_validator(mode="after")
    def _entropy_bonus(self) -> RLConfig:
        if self.entropy_bonus and self.top_entropy_quantile < 1.0:
            raise ValueError(f"rl.entropy_coef with rl.top_entropy_quantile={self.top_entropy_quantile:g}: the bonus "
                             "is the mean entropy over the step's trained tokens, divided by their count before the "
                             "first pass, and which tokens the quantile keeps is known only pass by pass. Remove "
                             "one of the two (TRL's bonus is each micro-batch's own mean: docs/rl.md)")
        if self.use_adaptive_entropy and self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"rl.entropy_coef_min={self.entropy_coef_min:g} is above rl.entropy_coef_max="
                             f"{self.entropy_coef_max:g}: swap them")
        return self

    @model_validator(mode="after")
    def _sampler_correction(self) -> RLConfig:
        if self.sampler_correction is None:
            return self
        low, high = self.sampler_correction_min, self.sampler_correction_max
        if low is not None and low > high:
            raise ValueError(f"rl.sampler_correction_min={low:g} is above rl.sampler_correction_max={high:g}: swap "
                             "them")
        if low is None and high == math.inf:
            raise ValueError(f"rl.sampler_correction={self.sampler_correction} with no bound (rl."
                             "sampler_correction_max is .inf and rl.sampler_correction_min unset) changes no ratio: "
                             "set a bound, or remove rl.sampler_correction")
        if self.loss_type == "vespo" and self.sampler_correction.startswith("sequence"):
            raise ValueError(f"rl.loss_type vespo adds each token's sampler ratio to its completion's log-weight, and "
                             f"rl.sampler_correction={self.sampler_correction} gives one a completion: use "
                             "token_truncate or token_mask (TRL's rule)")
        return self

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss carries the entropy bonus (a coefficient, or the controller that may raise one)."""
        return bool(self.entropy_coef) or bool(self.use_adaptive_entropy)

    @model_validator(mode="after")
    def _tool_settings(self) -> RLConfig:
        if self.max_tool_calls == 0:
            raise ValueError("rl.max_tool_calls 0 runs no call while the prompts still show the tools and the model "
                             "writes calls (their results never come): give 1 or more, or leave rl.tools and "
                             "rl.environment out to train without tools")
        if self.max_tool_calls is not None and not (self.tools or self.environment):
            raise ValueError("rl.max_tool_calls limits the calls to rl.tools, and no tools are given: add rl.tools "
                             "(module:function names) or remove rl.max_tool_calls")
        if self.environment is not None and ":" not in self.environment:
            raise ValueError(f"rl.environment names a class as module:Class; '{self.environment}' has no ':'")
        if self.generation_batch == "step" and (self.tools or self.environment):
            raise ValueError("rl.generation_batch=step samples the step's micro-batches in one call, and the tool "
                             "loop (rl.tools, rl.environment) runs one micro-batch at a time, its calls between the "
                             "turns: set rl.generation_batch=micro_batch")
        return self

    @field_validator("reward_clip_range")
    @classmethod
    def _ordered(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not v[0] <= v[1]:
            raise ValueError(f"rl.reward_clip_range is [min, max], and {v[0]} > {v[1]}: swap them")
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> RLConfig:
        names = [r.label for r in self.rewards]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            k = len(names) - 1 - names[::-1].index(twice)
            raise ValueError(f"two rewards share the name '{twice}' ({names}): give one its own name, e.g. "
                             f"rl.rewards.{k}.name={twice}_2 (in YAML, `name: {twice}_2` under that reward)")
        return self


class DistillConfig(Section):
    """On-policy distillation (TRL 1.16's DistillationTrainer; lmbda < 1: GKD's mixed batches)."""

    teacher: str = Field(description="The teacher: a local model folder or hub id, loaded as model.name_or_path is "
                         "(model.dtype, or the mixed-precision dtype under train.mixed_precision; frozen, in eval "
                         "mode). Its vocabulary must be the student's, token for token.")
    beta: float = Field(1.0, ge=0, le=1, description="The generalised JSD's interpolation, as TRL's beta: 0 is the "
                        "forward KL(teacher || student), 1 the reverse KL(student || teacher) (TRL's default), 0.5 "
                        "the symmetric JSD.")
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, allow_inf_nan=False, description="Both models' logits are "
                               "divided by it before the divergence, and the student samples at it (as TRL).")
    lmbda: float = Field(1.0, ge=0, le=1, description="The fraction of steps whose completions the student samples "
                         "(a coin per step, from the run's seed); the other steps train on the data's completions. "
                         "1 (TRL's DistillationTrainer): always on-policy; GKD's default is 0.5.")
    max_completion_tokens: int = Field(512, gt=0, description="Most tokens the student samples for a completion "
                                       "(TRL's max_completion_length).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling for the student's completions.")
    top_k: int = Field(0, ge=0, description=TOP_K)
    min_p: float = Field(0.0, ge=0, lt=1, description=MIN_P)
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False, description=REPETITION_PENALTY)
    sampler: Literal["static", "graph", "reference"] = Field(
        "graph", description="How the student samples, as rl.sampler: graph (CUDA graphs; static elsewhere), static, "
        "or reference (the plain loop).")
    merged_copy: MergedCopy = Field("off", description=MERGED_COPY)


class BenchmarkConfig(Section):
    """Benchmarks scored on final/ when training ends, through lm-evaluation-harness (`llmtrain eval`'s settings)."""

    tasks: list[str] = Field(min_length=1, description="The harness's task names (gsm8k, mmlu, or a task of "
                             "include_path).")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples; unset: each task's own.")
    limit: float | None = Field(None, gt=0, description="At most this many examples a task (below 1: a share).")
    batch_size: int | Literal["auto"] = Field(1, description="Examples a forward pass, or "
                                                                       "auto.")
    include_path: list[str] = Field(default_factory=list, description="Folders of task YAML files (local data).")
    apply_chat_template: bool = Field(False, description="Render each request through the model's chat template.")

    @field_validator("batch_size")
    @classmethod
    def _examples(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:  # (one line; a bound inside the union was two in pydantic's words)
            raise ValueError("expected a whole number above 0, or auto")
        return v


class Recipe(Section):
    model: ModelConfig = Field(description="The model to fine-tune and how to load it.")
    data: DataConfig = Field(description="Training (and eval) data, its format and tokenisation.")
    lora: LoraConfig | None = Field(None, description="LoRA settings; absent means full fine-tune.")
    preference: PreferenceConfig | None = Field(
        None, description="Preference tuning on pairs (data.format: preference); absent means supervised fine-tuning.")
    kto: KTOConfig | None = Field(
        None, description="KTO on unpaired feedback (data.format: unpaired); absent means no KTO.")
    reward_model: RewardModelConfig | None = Field(
        None, description="Train a reward model on pairs (data.format: preference): a one-output sequence-"
        "classification head, TRL's RewardTrainer loss; absent means no reward model.")
    rl: RLConfig | None = Field(
        None, description="Online RL with verifiable rewards, GRPO or RLOO (data.format: prompt); absent means no RL.")
    distill: DistillConfig | None = Field(
        None, description="On-policy distillation from a teacher model (data.format: prompt_completion, messages "
        "or alpaca); absent means no teacher.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation, schedule and batch.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig,
                                     description="What the launch's processes split beyond the data: sequences "
                                     "and pipeline stages.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Resumable state and export.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="The console, metrics.jsonl, the "
                                   "loss plot and the trackers (TensorBoard, wandb, mlflow).")
    eval: BenchmarkConfig | None = Field(
        None, description="Benchmarks scored with lm-evaluation-harness on final/ when training ends, as `llmtrain "
        "eval RUN` would (results in RUN/lm_eval/; docs/eval.md); absent: none.")
    output_dir: str = Field(description="Where metrics, checkpoints and the final model go (default runs/<stem>).")

    @field_validator("output_dir")
    @classmethod
    def _a_folder_name(cls, v: str) -> str:
        """A NUL byte or a line break is no folder name (a ValueError's traceback in doctor and finetune; audit 49)."""
        if "\0" in v or "\n" in v or "\r" in v:
            raise ValueError(f"{v!r} holds a NUL byte or a line break, which no folder name can: give a path")
        return v

    @model_validator(mode="after")
    def _check_quantize(self) -> Recipe:
        if self.model.quantize is not None and self.lora is None:
            raise ValueError(f"model.quantize={self.model.quantize} trains LoRA adapters on a frozen 4-bit base; a "
                             "full fine-tune of a quantised base is not possible (its 4-bit weights take no gradient "
                             "step). Add a lora: section, or set model.quantize=null")
        if self.model.quantize is not None and self.model.random_init:
            raise ValueError("model.quantize quantises weights read from model.name_or_path; model.random_init reads "
                             "none. Set one of them")
        return self

    @model_validator(mode="after")
    def _check_merged_copy(self) -> Recipe:
        """rl.merged_copy / distill.merged_copy: what the fast sampler runs a LoRA policy's adapted linears through. A
        full fine-tune has no adapter to merge, and the reference sampler runs the training model as it is: either
        took the key and did nothing."""
        for key, section in (("rl", self.rl), ("distill", self.distill)):
            if section is None or section.merged_copy == "off":
                continue
            if self.lora is None:
                raise ValueError(f"{key}.merged_copy={section.merged_copy} merges LoRA adapters into a generation copy "
                                 "of their base layers; a full fine-tune samples from its own weights, with nothing "
                                 f"to merge. Unset {key}.merged_copy, or add a lora: section")
            if section.sampler == "reference":
                raise ValueError(f"{key}.merged_copy={section.merged_copy} is what the fast sampler ({key}.sampler "
                                 f"static or graph) runs the adapted linears through; {key}.sampler=reference runs the "
                                 f"training model as it is and would ignore it. Set {key}.sampler=graph (the default) "
                                 f"or static, or unset {key}.merged_copy")
        return self

    @model_validator(mode="after")
    def _train_new_rows(self) -> Recipe:
        """model.new_tokens under LoRA: their embedding rows (and the LM head's) are new and must train, so
        lora.modules_to_save holds the embeddings and the head (a reward model's score head peft saves itself)."""
        if self.model.new_tokens and self.lora is not None:
            need = ["embed_tokens"] + ([] if self.reward_model is not None else ["lm_head"])
            have = self.lora.modules_to_save or []
            if missing := [m for m in need if m not in have]:
                self.lora.modules_to_save = [*have, *missing]
        return self

    @model_validator(mode="after")
    def _check_tiled_mlp(self) -> Recipe:
        shard = self.model.tiled_mlp
        if shard is None or isinstance(shard, bool):  # true (hidden_size tokens): capabilities.model_problems
            return self
        from llmtrain.capabilities import untiled

        if problem := untiled(self, shard, f"model.tiled_mlp={shard} tokens a shard"):
            raise ValueError(problem)
        return self

    def tokens_a_process(self) -> tuple[int, str]:
        """The most tokens of a micro-batch one process's MLP runs at once, and what sets it: the MLP tiles a
        micro-batch's tokens together (packed or padded rows alike), a budget's or up to micro_batch_size rows of
        max_seq_len (the longest row alone had been taken: a shard that tiles refused), over sequence_parallel."""
        budget, t = self.train.micro_batch_tokens, self.train
        row, key = (budget, f"train.micro_batch_tokens={budget}") if budget else \
            (t.micro_batch_size * self.data.max_seq_len,
             f"train.micro_batch_size={t.micro_batch_size} x data.max_seq_len={self.data.max_seq_len}")
        degree = self.parallel.sequence_parallel
        local = -(-row // degree)
        held = f"a process holds at most {local:,} tokens of a micro-batch ({key}, sequence_parallel={degree})" \
            if degree > 1 else f"a micro-batch holds at most {local:,} tokens ({key})"
        return local, held

    @model_validator(mode="after")
    def _resolve_dropout(self) -> Recipe:
        """train.disable_dropout None: the capability table's for the recipe's mode (TRL's trainer's default)."""
        if self.train.disable_dropout is None:
            from llmtrain.capabilities import MODES, mode_of

            self.train.disable_dropout = MODES[mode_of(self)].dropout_off
        return self

    @model_validator(mode="after")
    def _check_modes(self) -> Recipe:
        """The training mode against the data, the batch and the recipe's own layout (sequence and pipeline degrees):
        the capability table's (capabilities.py), every problem at once, one line each."""
        from llmtrain.capabilities import recipe_problems

        if found := recipe_problems(self):
            raise ValueError("\n  - ".join(p.rstrip(".") for p in found))
        return self

    def to_yaml(self, *, working_dir: str | None = None) -> str:
        """The recipe as YAML; `working_dir`: a run's, named in a first comment line (rundir.run_recipe reads a
        relative model path from there)."""
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
        return f"# {WRITTEN_FROM}{working_dir}\n{text}" if working_dir else text


# A run's recipe.yaml starts with this and the working directory it ran in: relative paths in it are from there
WRITTEN_FROM = "the relative paths below are from the directory this run was started in: "


def started_in(recipe: Path) -> Path | None:
    """The directory a run was started in, where `recipe` is that run's own saved recipe.yaml (or one of its
    checkpoints') and that directory is not this one: the recipe's relative paths (output_dir, data, model, reward
    functions' modules) are from there, so `llmtrain finetune runs/x/recipe.yaml --resume auto` from another
    directory had found no checkpoint in ./runs/x and started again from step 0. None for any other recipe, a copy of
    a saved one elsewhere included (its paths are from here, as every recipe's)."""
    if (started := written_from(recipe)) is None:
        return None
    try:
        body = yaml.safe_load(Path(recipe).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # load_recipe says why
    output_dir = body.get("output_dir") if isinstance(body, dict) else None
    if not isinstance(output_dir, str) or not started.is_dir() or started.resolve() == Path.cwd().resolve():
        return None
    out = (started / Path(output_dir).expanduser()).resolve()
    folder = recipe.resolve().parent
    ours = folder == out or (folder.parent.name == "checkpoints" and folder.parent.parent == out)
    return started if ours else None


def working_there(recipe, started: Path) -> str:
    """The line said where a run's saved recipe is run from the directory its run was started in (started_in)."""
    return (f"{recipe} is its run's saved recipe: its relative paths are from {started}, where the run was started, "
            "so llmtrain works there (relative paths in the overrides too)")


def from_the_run(folder: Path, value: str | None) -> str | None:
    """`value`, a relative path in the recipe a run saved in `folder` (its recipe.yaml), from the directory that run
    was started in (the file's first line) where it is not found from here but is from there; else as given."""
    if not value or Path(value).expanduser().is_absolute() or Path(value).exists():
        return value
    started = written_from(Path(folder) / "recipe.yaml")
    return str(started / value) if started is not None and (started / value).exists() else value


def written_from(recipe: Path) -> Path | None:
    """The directory a run was started in, as the recipe.yaml it saved names it on its first line (None: a recipe
    that names none, or no file)."""
    try:
        with open(recipe) as f:
            first = f.readline().rstrip("\n")
    except (OSError, UnicodeDecodeError):
        return None
    return Path(first[len(f"# {WRITTEN_FROM}"):]) if first.startswith(f"# {WRITTEN_FROM}") else None


def adapter_base(folder) -> str:
    """The base model of the LoRA adapter saved in `folder` (its adapter_config.json's base_model_name_or_path): a
    relative base not found from here is read from where the adapter's run was started (`folder` a run's final/ or
    checkpoint: from_the_run), so an RL run started elsewhere finds its reward model's base."""
    import json

    folder = Path(folder).expanduser()
    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    for run in (folder.parent, folder):  # a run's final/, or one of its checkpoints (which holds its recipe.yaml)
        if (found := from_the_run(run, base)) != base:
            return found
    return base


def adapter_quantization(folder) -> tuple[str, str, str] | None:
    """How the run that saved the LoRA adapter in `folder` (a run's final/ or one of its checkpoints, its recipe.yaml
    beside) held its base when it was a 4-bit one: (model.quantize, model.dtype, train.mixed_precision); None for a
    16-bit base or an adapter from elsewhere (no recipe.yaml), whose base is read as saved."""
    import yaml

    folder = Path(folder).expanduser()
    for recipe in (folder.parent / "recipe.yaml", folder / "recipe.yaml"):
        if recipe.is_file():
            try:
                saved = yaml.safe_load(recipe.read_text()) or {}
            except yaml.YAMLError:
                return None
            model, train = saved.get("model") or {}, saved.get("train") or {}
            if not model.get("quantize"):
                return None
            return (model["quantize"], model.get("dtype") or ModelConfig.model_fields["dtype"].default,
                    train.get("mixed_precision") or TrainConfig.model_fields["mixed_precision"].default)
    return None


def run_folder_problem(path: str, key: str) -> str | None:
    """Where `path` is an llmtrain run's folder rather than a model (`model.name_or_path=runs/sft`, the SFT run a
    distillation or a next run starts from): which folder of it holds the model, and what to set `key` to."""
    folder = Path(path).expanduser()
    set_ = " " if key.startswith("--") else "="  # a key, or an option (--model)
    def merge_then_set(shown, run: Path) -> str:
        return (f"`llmtrain export {shown} --merge` writes the whole model to {run / 'final-merged'}; then set "
                f"{key}{set_}{run / 'final-merged'}")

    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").exists():
        run = folder.parent if (folder.parent / "recipe.yaml").is_file() else None
        how = merge_then_set(run, run) if run is not None else \
            "merge it into its base (peft's merge_and_unload) and name the merged folder"
        return f"'{path}' ({key}) is a LoRA adapter, not a whole model: {how}."
    if not ((folder / "recipe.yaml").is_file() and (folder / "final").is_dir()) or (folder / "config.json").exists():
        return None
    final = folder / "final"
    if (final / "adapter_config.json").is_file():
        how = f"its final/ is a LoRA adapter: {merge_then_set(path, folder)}"
    else:
        how = f"set {key}{set_}{final}"
    return f"'{path}' ({key}) is a run's folder, not a model: {how}."


# --------------------------------------------------------------------------- loading and overrides


def _sections(field) -> list[type[BaseModel]]:
    """The sections a field holds: its annotation's BaseModel classes (LoraConfig of `LoraConfig | None`)."""
    return [a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
            if isinstance(a, type) and issubclass(a, BaseModel)]


def all_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every valid dotted key of the schema, e.g. 'train.lr'."""
    keys = []
    for name, field in model.model_fields.items():
        key = prefix + name
        keys.append(key)
        for section in _sections(field):
            keys.extend(all_keys(section, key + "."))
    return keys


def _default(key: str, model: type[BaseModel] = Recipe, *, missing=None):
    """The schema's default of a dotted key (`missing`: the key has none, or is not a key)."""
    from pydantic_core import PydanticUndefined

    head, _, rest = key.partition(".")
    if head.isdigit() and rest:  # a list's item (rl.rewards.0.column): the item's own keys
        head, _, rest = rest.partition(".")
    field = model.model_fields.get(head)
    if field is None:
        return missing
    if not rest:
        if field.default_factory is not None:  # model.new_tokens: []
            return field.get_default(call_default_factory=True)
        return missing if field.default is PydanticUndefined else field.default
    sections = _sections(field)
    return _default(rest, sections[0], missing=missing) if sections else missing


# Names people bring from other tools, mapped to ours.
_ALIASES = {
    "learning_rate": "lr", "batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum_steps", "num_epochs": "epochs", "num_train_epochs": "epochs",
    "save_steps": "every_steps", "save_total_limit": "keep_last", "lora_r": "r", "lora_alpha": "alpha",
    "sequence_len": "max_seq_len", "max_length": "max_seq_len", "torch_dtype": "dtype",
    "sync_ref_model": "sync_reference", "ref_model_sync_steps": ("every_steps", "sync_reference.every_steps"),
    "ref_model_mixup_alpha": ("alpha", "sync_reference.alpha"), "kl_coef": "beta",
    "vllm_importance_sampling_correction": "sampler_correction",
}


def _suggest(key: str) -> str:
    """' (did you mean KEY?)' for an unknown key, or ''. A list item's index (rl.rewards.0.colum) is kept in the
    suggestion (rl.rewards.0.column), the keys being matched without it."""
    parts = key.split(".")
    words = [p for p in parts if not p.isdigit()]
    names = _nearest(".".join(words))
    if len(words) < len(parts) and all(n.count(".") == len(words) - 1 for n in names):
        # each name's words with the key's indices between them
        names = [".".join(p if p.isdigit() else next(w) for p in parts) for w in (iter(n.split(".")) for n in names)]
    if not names:
        return ""
    return f" (did you mean {', '.join(names[:-1]) + ' or ' if len(names) > 1 else ''}{names[-1]}?)"


def _nearest(key: str) -> list[str]:
    """The schema's keys nearest an unknown dotted key (no list indices): its alias, every sibling it begins
    (parallel.pipeline: each pipeline_* key), or the closest spelling."""
    keys = all_keys()
    if key.lower() != key and (lower := key.lower()) in keys:  # keys are lower case (`TRAIN.LR`: train.lr)
        return [lower]
    section, _, leaf = key.rpartition(".")
    prefix = section + "." if section else ""
    siblings = [k.rsplit(".", 1)[-1] for k in keys if k.startswith(prefix) and k.count(".") == key.count(".")]
    named = [prefix + k for k in siblings if k.startswith(leaf + "_")]  # parallel.pipeline: each pipeline_* key
    targets = _ALIASES.get(leaf, ())  # one key, or where it is by level (ref_model_sync_steps: TRL's DPOConfig's)
    for target in (targets,) if isinstance(targets, str) else targets:
        if prefix + target in keys:
            return [prefix + target]
    if len(named) > 1:
        return named
    # a misspelt alias counts as the alias (train.lerning_rate: train.lr)
    aliases = {prefix + a: prefix + ours for a, ours in _ALIASES.items() if isinstance(ours, str) and ours in siblings}
    close = [aliases.get(k, k) for k in difflib.get_close_matches(key, keys + list(aliases), n=1, cutoff=0.75)]
    return close or [prefix + m for m in difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.5)]


# pydantic's names for the members of a union (model.tiled_mlp: bool | int), as a reader would say them
_KINDS = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "text",
          "list[str]": "a list of text", "list[float]": "a list of numbers", "list[int]": "a list of whole numbers"}


def _kind(member: str) -> str:
    """A union member as a reader would say it: literal['auto'] is auto."""
    if member.startswith("literal[") and member.endswith("]"):
        return " or ".join(c.strip().strip("'\"") for c in member[len("literal["):-1].split(","))
    return _KINDS.get(member, member)


def _said(value: Any) -> str:
    """A value as the recipe writes it: null, not Python's None."""
    return "null" if value is None else repr(value)


def _field(key: str):
    """The schema's field of a dotted key (list items' indices skipped), or None."""
    model: Any = Recipe
    field = None
    for part in key.split("."):
        if part.isdigit():
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = next(iter(_sections(field)), None)
    return field


def _items(key: str) -> int | None:
    """The items a pair-like key takes (train.betas: 2), None where it is not a fixed-length tuple."""
    import typing

    annotation = getattr(_field(key), "annotation", None)
    return len(typing.get_args(annotation)) if typing.get_origin(annotation) is tuple else None


def _union_member(part) -> bool:
    """A union member's name in an error's location (bool, int, list[str], literal[...], a section's class), which
    is pydantic's, not a key of the recipe."""
    return isinstance(part, str) and (part in _KINDS or "[" in part or part in _SECTION_CLASSES)


def _section_classes() -> set[str]:
    """The schema's section classes by name (pydantic names a union's section member so): a key spelt with a capital
    (`Train:`) is a key, not one of them (it had been cut from its message: "- : unknown key"; audit 49)."""
    found, todo = set(), [Recipe]
    while todo:
        model = todo.pop()
        if model.__name__ not in found:
            found.add(model.__name__)
            todo += [m for f in model.model_fields.values() for m in _sections(f)]
    return found


def recipe_errors(err: ValidationError, source: str, overrides: list[str] | None = None,
                   made: set[str] = frozenset()) -> str:
    """One line a bad key; a key set on the command line says so (`train.lr=abc`), not only the file. A value no
    member of a union takes is one line naming what each accepts; pydantic's own names never show. `made`: the
    sections only the overrides name: one made by a misspelt key (`eval.every_steps=5`) does not also report the
    keys it lacks (`eval.tasks: required key is missing`)."""
    given = {o.split("=", 1)[0].strip(): o for o in overrides or [] if "=" in o}
    errors = err.errors()
    unknown = {".".join(map(str, e["loc"][:-1])) for e in errors if e["type"] == "extra_forbidden"}
    lines, unions = [], {}
    for e in errors:
        loc = [p for p in e["loc"] if not str(p).startswith("function-after")]
        member = next((i for i, p in enumerate(loc) if _union_member(p)), None)
        key = ".".join(str(p) for p in loc[:member])
        if e["type"] == "missing" and (section := key.rpartition(".")[0]) in made and section in unknown:
            continue
        # the override shows the value; an unknown section shows the override that made it (`trian.max_steps=5`)
        whole, _, index = key.rpartition(".")  # a list's item: the override of its list (rl.rewards=[...])
        override = given.get(key) or (given.get(whole) if index.isdigit() else None) or (
            next((o for k, o in given.items() if k.startswith(f"{key}.")), None)
            if e["type"] == "extra_forbidden" else None)
        label = f"{key} (the override {override})" if override and key else key
        if member is not None and e.get("input") is None and (default := _default(key)) is not None:
            if key not in unions:  # `eval.batch_size=null`: said once, as a key outside a union is
                unions[key] = None
                lines.append(f"  - {label}: cannot be null (the key has no unset state; its default is {default!r}): "
                             "set a value")
            continue
        if member is not None and e["type"] not in ("extra_forbidden", "missing"):
            if key not in unions:
                unions[key] = []
                lines.append((key, label))
            unions[key].append((_kind(loc[member]), e.get("input"), len(loc) == member + 1, e))
            continue
        if e["type"] == "extra_forbidden":
            lines.append(f"  - {label}: unknown key{_suggest(key)}")
        elif e["type"] == "missing" and isinstance(e["loc"][-1], int) and (n := _items(key.rpartition(".")[0])):
            # a pair's second item (train.betas=[0.9]) is not a key
            whole = key.rpartition(".")[0]
            label = f"{whole} (the override {given[whole]})" if whole in given else whole
            lines.append(f"  - {label}: expected {n} items, got {len(e.get('input') or [])}")
        elif e["type"] == "missing":
            lines.append(f"  - {label}: required key is missing")
        elif e["type"] in ("model_type", "dict_type") and key.rpartition(".")[2].isdigit():  # a list's item
            first = next(iter(_sections(_field(key.rpartition(".")[0]))[0].model_fields), "KEY")
            lines.append(f"  - {label}: is a mapping of keys ({{{first}: {e.get('input')}, ...}} as the list's item), "
                         f"not {_said(e.get('input'))}")
        elif e["type"] in ("model_type", "dict_type"):
            lines.append(f"  - {label}: is a section of keys ({key}.KEY=VALUE on the command line, an indented block "
                         f"under {key.rsplit('.', 1)[-1]}: in YAML), not {_said(e.get('input'))}")
        elif e["type"] == "list_type" and e.get("input") is not None:
            got = e.get("input")
            lines.append(f"  - {label}: expected a list, not {got!r} ({key}=[a, b] on the command line, [a, b] or "
                         "one item a line under it in YAML)")
        elif e.get("input") is None and (e["type"].endswith("_type") or e["type"] == "literal_error") \
                and (default := _default(key)) is not None:
            # `train.micro_batch_size=null`: pydantic's 'Input should be a valid integer' reads as a typo
            lines.append(f"  - {label}: cannot be null (the key has no unset state; its default is {default!r}): "
                         "set a value")
        elif e.get("input") is None and e["type"].endswith("_type") and _default(key, missing=...) is ...:
            lines.append(f"  - {label}: cannot be null (the key is required): set a value")
        else:
            got = e.get("input")
            got_text = f" (got {got!r})" if not isinstance(got, dict) and key not in given else ""
            # a check of the whole recipe (several sections) has no key of its own: its message names the keys
            # `train.eval_every_steps=0` to turn it off: a bound on a key whose default is null says null is the off
            unset = (" (or null, its default, which leaves it unset)" if e["type"].startswith(("greater_than",
                     "less_than")) and key and _default(key, missing=...) is None else "")
            lines.append(f"  - {label + ': ' if key else ''}{_in_words(e)}{unset}{got_text}")
    for i, line in enumerate(lines):
        if isinstance(line, tuple):
            key, label = line
            kinds = list(dict.fromkeys(kind for kind, _, _, _ in unions[key]))
            got = next((value for _, value, whole, _ in unions[key] if whole), unions[key][0][1])
            if short := next((e for *_, e in unions[key] if e["type"] == "too_short"), None):  # `data.path=[]`
                lines[i] = f"  - {label}: {_in_words(short)}"
                continue
            lines[i] = f"  - {label}: expected {', '.join(kinds[:-1]) + ', or ' if len(kinds) > 1 else ''}" \
                       f"{kinds[-1]}{f' (got {got!r})' if key not in given else ''}"
    return f"Invalid recipe {source}:\n" + "\n".join(lines) + "\nFix these keys in the YAML or the key=value overrides."


def _in_words(e: dict) -> str:
    """A pydantic error's message in the recipe's words ("Input should be greater than 0" had shown as written; audit
    49): bounds, choices (with the nearest), kinds and lengths; any other as pydantic says it."""
    import difflib

    kind, ctx, got = e["type"], e.get("ctx") or {}, e.get("input")
    bounds = {"greater_than": "more than {gt}", "greater_than_equal": "{ge} or more", "less_than": "less than {lt}",
              "less_than_equal": "{le} or less"}
    if kind in bounds:
        return "must be " + bounds[kind].format(**{k: f"{v:g}" if isinstance(v, float) else v for k, v in ctx.items()})
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        near = difflib.get_close_matches(str(got), choices, n=1) if isinstance(got, str) else []
        return (f"must be one of {', '.join(choices)}" + (f" (did you mean {near[0]}?)" if near else "")
                if choices else e["msg"])
    words = {"int_parsing": "must be a whole number", "int_type": "must be a whole number",
             "int_from_float": "must be a whole number", "float_parsing": "must be a number",
             "float_type": "must be a number", "bool_parsing": "must be true or false", "bool_type": "must be true or "
             "false", "finite_number": "must be a finite number (not inf or nan)",
             "string_type": "must be text (quote it in YAML: a date or a number is read as one)"}
    if kind in words:
        return words[kind]
    if kind == "too_long":  # `train.betas=[0.9,0.99,0.9]`
        return f"must have at most {ctx.get('max_length')} items"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return (f"is an empty list: give at least {n} item{'s' if n != 1 else ''}" if got in ([], ()) else
                f"must have at least {n} item{'s' if n != 1 else ''}")
    return e["msg"].removeprefix("Value error, ")


_SECTION_CLASSES = _section_classes()


def updates_per_window(recipe: Recipe) -> int:
    """Optimizer steps a window of the data trains: online RL's rl.num_iterations (its completions sampled once,
    updated on that many times), else 1."""
    return recipe.rl.num_iterations if recipe.rl is not None else 1


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe, apply dotted overrides and validate the result."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"Recipe '{path}' is a folder. Pass the path to a YAML recipe file, e.g. recipes/tiny.yaml.")
    if not path.is_file():
        raise RecipeError(f"Recipe file '{path}' does not exist. Pass the path to a YAML recipe, e.g. recipes/tiny.yaml.")
    try:
        data = read_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:  # (a traceback: audit 49)
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise RecipeError(f"Recipe '{path}' is not UTF-8 text (byte {e.object[e.start]:#04x} at line {line}): save "
                          "it as UTF-8.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"Recipe '{path}' is not valid YAML{where}: {getattr(e, 'problem', e)}.") from None
    if not isinstance(data, dict):
        raise RecipeError(f"Recipe '{path}' must be a mapping of sections (model, data, train, ...).")
    _no_empty_section(path, overrides or [])
    made = _sections_made(data, overrides or [])
    data = apply_overrides(data, overrides or [], Recipe)
    data.setdefault("output_dir", f"runs/{path.stem}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(recipe_errors(e, f"'{path}'", overrides, made)) from None


def _no_empty_section(path: Path, overrides: list[str]) -> None:
    """An optional section written with nothing under it (`lora:` with its keys commented out) is YAML's null, which
    means no such section: a full fine-tune, plain SFT. Refused, naming its line, unless an override decides it;
    `lora: null` written out and `lora: {}` (the defaults) mean what they say."""
    try:
        root = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return
    if not isinstance(root, yaml.MappingNode):
        return
    optional = {name for name, field in Recipe.model_fields.items() if _sections(field) and field.default is None}
    for key, value in root.value:
        name = getattr(key, "value", None)
        if name in optional and isinstance(value, yaml.ScalarNode) and value.tag.endswith(":null") and \
                value.value == "" and not any(o.split("=", 1)[0].strip().split(".")[0] == name for o in overrides):
            without = "a full fine-tune" if name == "lora" else f"a run without {name}"
            raise RecipeError(f"{name}: (line {key.start_mark.line + 1} of '{path}') is empty, which YAML reads as "
                              f"null: no {name} section, {without}. Write `{name}: {{}}` for the section at its "
                              f"defaults, give it keys, or remove it (or write `{name}: null`) for {without}.")


def _sections_made(data: dict, overrides: list[str]) -> set[str]:
    """The sections (dotted) that only the overrides name: not in the file's `data`."""
    made = set()
    for o in overrides:
        parts = o.split("=", 1)[0].strip().split(".")[:-1]
        node = data
        for i, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                made |= {".".join(parts[:j + 1]) for j in range(i, len(parts))}
                break
            node = node[part]
    return made


