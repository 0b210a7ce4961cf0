"""The capability table: what each training mode takes and which layouts it trains on, each refusal with its reason.

One row a mode (supervised fine-tuning, preference pairs, KTO, reward models, GRPO, RLOO, distillation): the data
formats it trains on, its batch unit, whether a token budget (train.micro_batch_tokens) makes its micro-batches,
what its evaluation reports, its model (a causal LM, or a score head), and, for each parallelism it does not train
on (layout.PARALLELISMS: one process, DDP, FSDP/HSDP, tensor, sequence, pipeline), the reason and what to use
instead. Beside the rows, what each parallelism refuses of any mode (`RULES`: a setting, e.g. LoRA under tensor
parallelism) and of the model (`model_problems`: heads, layers, a tied embedding).

`problems(recipe, layout, model=)` collects every problem of a recipe on a layout at once. Everything asks it: the
recipe's schema (`recipe_problems`, with the layout the recipe alone gives), `llmtrain launch` and `llmtrain
doctor` (the launch config's layout, before any process starts), and every process of `finetune` (its launch's, before
the process group exists; with the model's config, before anything is written). A cell the table supports trains;
a cell it does not is refused in one paragraph before any file is written (tests/test_capabilities.py walks them
all). A new mode, layout or model family is a row, a column or a rule here, never an `if` elsewhere. Where a mode's
reference comes from (`reference_kind`, `reference_copy`, `reference_sync`) is decided here too, for its rules and
for the loop, the objectives and the estimate; `sharding_problems` is what the estimate's --fit asks of FSDP.

May import: the schema (`config`, `errors`) and `layout` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.errors import LLMTrainError
from llmtrain.layout import NAMES, PARALLELISMS, Layout

# --------------------------------------------------------------------------- the reference a mode reads


def reference_copy(recipe) -> bool:
    """Whether the run holds a frozen copy of the starting weights as its reference (model/reference.py): a full
    fine-tune's KTO, preference pairs with preference.reference copy, online RL with rl.beta > 0."""
    if recipe.lora is not None:
        return False
    if recipe.preference is not None:
        return reference_kind(recipe) == "copy"
    return recipe.kto is not None or (recipe.rl is not None and recipe.rl.beta > 0)


def reference_sync(recipe) -> object | None:
    """The mode's sync_reference (TR-DPO: a config.ReferenceSync, which this module may not import), or None."""
    section = recipe.preference or recipe.kto or recipe.rl
    return getattr(section, "sync_reference", None)


def reference_kind(recipe) -> str:
    """Where a preference run's reference log-probabilities come from: adapter, precomputed, copy or none. On pipeline
    stages a LoRA run's is precomputed by default, with the adapter disabled, once and cached (an explicit adapter
    runs them through the stages before each step: preference.StagePairs.prepare)."""
    p = recipe.preference
    if p.reference != "auto":
        return p.reference
    if p.reference_free:
        return "none"
    if recipe.lora is None and p.sync_reference is not None:
        return "copy"
    if recipe.lora is not None and (recipe.parallel.pipeline_parallel == 1 or p.sync_reference is not None):
        return "adapter"  # (on stages LoRA's moving reference runs through them before each step, its snapshot in)
    return "precomputed"


# --------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Mode:
    key: str  # sft, preference, kto, reward_model, grpo, rloo, distill
    name: str  # in the messages: "KTO (kto:)"
    formats: tuple[str, ...]  # data.format values it trains on
    unit: str  # what train.micro_batch_size counts
    token_budget: bool  # train.micro_batch_tokens may make its micro-batches
    evals: str  # what its evaluation reports
    model: str  # "causal LM" or "score head"
    samples: bool = True  # train.eval_samples (greedy generations at each eval)
    refused: dict[str, str] = field(default_factory=dict)  # parallelism -> why, and what to use instead
    router_aux: bool = False  # model.router_aux_loss_coef (a mixture of experts' load-balancing loss) joins its loss
    neftune: bool = False  # train.neftune_alpha: noise on the input embeddings of its examples in training
    sft_loss: bool = False  # train.sft_loss: its summed token loss may be DFT's
    dropout_off: bool = False  # TRL's trainer for it turns every dropout off (disable_dropout's default there)


MODES: dict[str, Mode] = {m.key: m for m in (
    Mode("sft", "supervised fine-tuning", ("alpaca", "messages", "prompt_completion", "text"), "examples", True,
         "loss, samples", "causal LM", router_aux=True, neftune=True, sft_loss=True),
    Mode("preference", "preference pairs (preference:)", ("preference",), "pairs", True,
         "loss, reward margin and accuracy, samples", "causal LM", router_aux=True, dropout_off=True),
    Mode("kto", "KTO (kto:)", ("unpaired",), "examples", True, "loss, reward margin", "causal LM", router_aux=True,
         dropout_off=True),
    Mode("reward_model", "a reward model (reward_model:)", ("preference",), "pairs", True, "loss, accuracy, margin",
         "score head", samples=False, dropout_off=True),
    Mode("grpo", "online RL, GRPO (rl:)", ("prompt",), "prompts", False, "reward, answer accuracy", "causal LM"),
    Mode("rloo", "online RL, RLOO (rl: {algorithm: rloo})", ("prompt",), "prompts", False, "reward, answer accuracy",
         "causal LM"),
    Mode("distill", "distillation (distill:)", ("prompt_completion", "messages", "alpaca"), "prompts", False,
         "loss, answer accuracy, teacher agreement", "causal LM"),
)}

SECTIONS = {"preference": "preference:", "kto": "kto:", "reward_model": "reward_model:", "rl": "rl:",
            "distill": "distill:"}
# What a format's rows train with, for a recipe whose sections do not match its data.format
_FORMAT_HINT = {
    "preference": "data.format: preference and the preference: section go together: pairs train with a preference "
                  "loss (add preference: {loss: dpo}), and a preference loss needs pairs (a reward model also trains "
                  "on pairs: reward_model: {})",
    "unpaired": "data.format: unpaired and the kto: section go together: completions labelled desirable or not train "
                "with KTO (add kto: {beta: 0.1}), and kto: needs such rows",
    "prompt": "data.format: prompt and the rl: section go together: prompts alone train with rewards (add rl: "
              "{rewards: [{type: answer_match}]}), and rl: needs prompts",
}


# --------------------------------------------------------------------------- the model families (a third axis)

# GPT-OSS's own plan (config.base_model_tp_plan) splits only its embedding: llmtrain's splits its attention as Llama's
# (its q/k/v/o biases with their rows; its sinks, one logit a query head, with the heads) and its experts by expert
_GPT_OSS_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                 "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                 "layers.*.self_attn": "heads", "layers.*.mlp.experts": "moe_tp_experts"}


@dataclass(frozen=True)
class Family:
    key: str  # config.model_type
    name: str  # in the messages and docs/models.md
    refused: dict[str, str] = field(default_factory=dict)  # parallelism -> why, and what to use instead
    # It trains through transformers' own layer on every column it does not refuse; llmtrain also models its layer:
    # estimate-memory's bytes (memory/params.py, memory/activations.py) and online RL's fast sampler
    # (model/fast_sample.py, its own decoder layer). Where a flag is False: no estimate, or the reference sampler.
    estimate: bool = True
    fast_sampler: bool = True
    # A mixture of experts: whether peft's all-linear reaches its experts (as parameters: ParamWrapper, which takes no
    # LoRA dropout), or only lora.target_parameters does (GPT-OSS's, Gemma 4's)
    all_linear_experts: bool = True
    # A mixture of experts: whether transformers gives it a load-balancing loss (load_balancing_loss_func over its
    # router logits), which model.router_aux_loss_coef adds (Gemma 4's records its router's probabilities, and has none)
    load_balancing: bool = True
    # llmtrain's tensor-parallel plan where the family's own (config.base_model_tp_plan) does not split its layers
    tp_plan: dict[str, str] | None = None


# The families of the capability table: tests/test_families.py trains each on every column it does not refuse (and
# checks the estimate and the fast sampler of those whose layer llmtrain models). Another model_type trains where
# transformers builds it, with the checks every model gets (model_problems) and no estimate.
FAMILIES: dict[str, Family] = {f.key: f for f in (
    Family("llama", "Llama (2, 3, 3.1, 3.2)"),
    Family("mistral", "Mistral"),
    Family("qwen2", "Qwen2 / Qwen2.5"),
    Family("qwen3", "Qwen3"),
    Family("gemma3_text", "Gemma 3 (its text model)"),
    Family("phi3", "Phi-3 / Phi-4"),
    # mixtures of experts: the router and the experts as transformers runs them (grouped_mm)
    Family("qwen3_moe", "Qwen3-MoE"),
    Family("mixtral", "Mixtral"),
    # attention sinks (the varlen attention computes them), a window on every other layer, experts with biases (LoRA
    # adapts its attention: peft maps no all-linear onto its router or experts)
    Family("gpt_oss", "GPT-OSS", all_linear_experts=False, tp_plan=_GPT_OSS_PLAN),
    # per-layer embeddings (PLE), a learned scalar a layer (a persistent buffer), local and global layers with their
    # own head sizes
    Family("gemma4_text", "Gemma 4 (its text model)", all_linear_experts=False,
           load_balancing=False),
)}


def family_cell(model_type: str, parallelism: str) -> str | None:
    """Why a model of `model_type` does not train on `parallelism` (None: it does, or the family is not in the table
    and the generic checks decide)."""
    family = FAMILIES.get(model_type)
    return family.refused.get(parallelism) if family is not None else None


def section_of(recipe) -> str | None:
    """The recipe's objective section (preference, kto, reward_model, rl, distill; None: supervised fine-tuning), of a
    Recipe or of a recipe's dict (a saved one, run/preflight.py). Several sections: the first of them
    (recipe_problems refuses the recipe)."""
    get = recipe.get if isinstance(recipe, dict) else (lambda key: getattr(recipe, key))
    return next((section for section in SECTIONS if get(section) is not None), None)


def mode_of(recipe) -> str:
    """The recipe's training mode (a key of MODES), of a Recipe or of a recipe's dict: its objective section, online
    RL's by its algorithm (none: supervised fine-tuning)."""
    section = section_of(recipe)
    if section != "rl":
        return section or "sft"
    rl = recipe["rl"] if isinstance(recipe, dict) else recipe.rl
    return (rl.get("algorithm") if isinstance(rl, dict) else rl.algorithm) or "grpo"


def unit_of(recipe) -> str:
    """What a row and train.micro_batch_size count in the recipe's mode: examples, pairs (two sequences each), ..."""
    return MODES[mode_of(recipe)].unit


# --------------------------------------------------------------------------- what each parallelism refuses of any mode


@dataclass(frozen=True)
class Rule:
    parallelism: str  # the column it applies to
    applies: object  # recipe, layout -> bool
    reason: str  # why, and what to use instead; {key} is the parallelism's recipe key or the launch


def _pp_budget(r, _):
    return r.train.micro_batch_tokens is None and MODES[mode_of(r)].token_budget


def interleaved_rounds(stages: int, micro_batches: int) -> int:
    """torch's ScheduleInterleaved1F1B runs max(1, M // P) rounds and needs M to be a multiple of them."""
    return max(1, micro_batches // stages)


def too_few_micro_batches(schedule: str, micro_batches: int, stages: int) -> bool:
    """Whether a step's M micro-batches are fewer than the P stages where the schedule needs M >= P: 1F1B (torch's
    Schedule1F1B refuses it) and interleaved 1F1B (not trained so); GPipe takes any M. The table's rule and the
    estimate (memory/pipeline.py) both ask this."""
    return schedule != "gpipe" and micro_batches < stages


def uneven_rounds(schedule: str, micro_batches: int, stages: int) -> bool:
    """Whether interleaved 1F1B's rounds do not divide a step's M micro-batches (torch refuses it)."""
    return schedule == "interleaved_1f1b" and micro_batches % interleaved_rounds(stages, micro_batches) != 0


def _pp_accum(r, _):
    return too_few_micro_batches(r.parallel.pipeline_schedule, r.train.grad_accum_steps, r.parallel.pipeline_parallel)


def _pp_rounds(r, _):
    return uneven_rounds(r.parallel.pipeline_schedule, r.train.grad_accum_steps, r.parallel.pipeline_parallel)


def fp32_head(r, _=None) -> bool:
    """rl.cast_lm_head_to_fp32 of recipe `r` (False for any mode but online RL), for the rules, the layout
    (parallel/parallelize.py), the model's loss (loop/phases.py) and the estimate."""
    return r.rl is not None and r.rl.cast_lm_head_to_fp32


def _copy_unsharded(r, layout):
    return reference_copy(r) and not layout.fsdp


def _adapter_sync(r, _):
    return r.lora is not None and reference_sync(r) is not None


def reference_in_rollout(rl, *, moving_adapter: bool) -> bool:
    """Whether online RL (`rl`, the recipe's rl: section or None) takes its reference's log-probabilities in the
    rollout, once a round (TRL's ref_per_token_logps, taken where it generates), where FSDP holds the policy (and a
    full fine-tune's frozen copy) gathered: RLOO's KL (rl.beta > 0), and GRPO's with rl.num_iterations > 1 but for
    LoRA's moving reference (`moving_adapter`), whose swap GRPO runs in each update's passes. The one rule: the
    objective runs it so (grpo._reference_once), the estimate counts it (its rollout phases and extra forwards)."""
    if rl is None or not rl.beta:
        return False
    return rl.algorithm == "rloo" or (rl.num_iterations > 1 and not moving_adapter)


def rollout_reference(r) -> bool:
    """reference_in_rollout of recipe `r`."""
    return reference_in_rollout(r.rl, moving_adapter=_adapter_sync(r, None))


def rollout_adapter(r, _=None) -> bool:
    """LoRA's moving reference run in the rollout (RLOO's KL), where FSDP holds the policy gathered: the reference
    keeps its snapshot whole as well (model/reference.AdapterReference), and the estimate counts it."""
    return _adapter_sync(r, _) and rollout_reference(r)


def _rl(test):
    """A rule of online RL's rl: section (`test(rl)`), False for any other mode."""
    return lambda r, _: r.rl is not None and bool(test(r.rl))


# GRPO on pipeline stages: sampled through the stages (parallel/pipeline/sampling.py), its passes rows of one shape,
# its loss the last stage's (objectives/grpo.StageGRPO); what that does not carry
_STAGES_RL = "{key} samples online RL's completions through the stages (each its own layers' KV cache) and takes the "
RL_STAGE_RULES: tuple[Rule, ...] = (
    Rule("pp", _rl(lambda rl: rl.sampler != "reference"),
         _STAGES_RL + "loss on the last stage: the graph and static samplers hold the whole model's KV cache on one "
         "process. Set rl.sampler=reference (the stages decode with transformers' cache, as that sampler does)"),
    Rule("pp", _rl(lambda rl: rl.micro_batch_tokens is None),
         _STAGES_RL + "loss in rows of one fixed shape: set rl.micro_batch_tokens, the slots of each pass (at least "
         "the longest prompt plus rl.max_completion_tokens)"),
    Rule("pp", _rl(lambda rl: rl.merged_copy != "off"),
         _STAGES_RL + "loss with each stage's own weights: a merged generation copy (rl.merged_copy) is not built "
         "for stages. Unset it"),
)


# Distillation on pipeline stages: the student samples through them, the last stage's processes hold the teacher whole
DISTILL_STAGE_RULES: tuple[Rule, ...] = (
    Rule("pp", lambda r, _: r.distill is not None and r.distill.sampler != "reference",
         "{key} samples the student's completions through the stages (each its own layers' KV cache): the graph and "
         "static samplers hold the whole model's KV cache on one process. Set distill.sampler=reference"),
    Rule("pp", lambda r, _: r.distill is not None and r.distill.merged_copy != "off",
         "{key} samples with each stage's own weights: a merged generation copy (distill.merged_copy) is not built "
         "for stages. Unset it"),
)


RULES: tuple[Rule, ...] = (
    *RL_STAGE_RULES,
    *DISTILL_STAGE_RULES,
    Rule("tp", lambda r, _: r.model.quantize is not None,
         "{key} does not train a 4-bit base (model.quantize): bitsandbytes' packed 4-bit weights cannot be split "
         "by rows or columns. A QLoRA run of a 7B model fits one GPU: launch it with accelerate_configs/ddp.yaml "
         "(tp_size 1), or train LoRA on a 16-bit base under tensor parallelism"),
    Rule("tp", _copy_unsharded,
         "{key} without FSDP: a full fine-tune's reference ({reference}) is a frozen copy of the starting weights, "
         "sharded like the policy under FSDP only and otherwise whole on every process, undoing the split. Launch "
         "FSDP x TP (parallelism_config with dp_shard_size), add a lora: section, or launch one GPU or DDP"),
    Rule("sp", lambda r, _: not r.model.varlen,
         "{key} runs llmtrain's varlen attention on the gathered sequence; model.attn_implementation={attn} is "
         "refused. Set it to auto"),
    Rule("pp", lambda r, _: not r.model.varlen,
         "{key} attends within each packed row's examples with llmtrain's varlen attention (the boundaries travel to "
         "every stage); set model.attn_implementation=auto or varlen"),
    Rule("pp", _pp_budget,
         "{key} sends each micro-batch's hidden states between stages in buffers of one fixed shape: every "
         "micro-batch is one packed row of train.micro_batch_tokens slots (padded to it). Set "
         "train.micro_batch_tokens={budget} (the slots of train.micro_batch_size={size} {rows}) and "
         "train.micro_batch_size=1"),
    Rule("pp", _pp_accum,
         "{key} with pipeline_schedule={schedule}: torch's schedule needs at least as many micro-batches a step as "
         "stages, and train.grad_accum_steps={accum}. Set train.grad_accum_steps to {pp} or more (more shrink the "
         "bubble), or use gpipe"),
    Rule("pp", _pp_rounds,
         "{key} with interleaved_1f1b runs {rounds} rounds of micro-batches, which train.grad_accum_steps={accum} "
         "does not divide into: set it to a multiple of {pp}"),
    Rule("pp", lambda r, _: r.data.eval_split is not None and r.train.eval_batch_size is not None,
         "{key} evaluates through the stages in rows of the one shape it trains in (train.micro_batch_tokens slots): "
         "unset train.eval_batch_size"),
)


def _key(parallelism: str, recipe, layout: Layout) -> str:
    if parallelism == "sp":  # (the layout's degree: the recipe's, or the one a check asks of it)
        return f"parallel.sequence_parallel={layout.sp}"
    if parallelism == "pp":
        return f"parallel.pipeline_parallel={layout.pp}"
    if parallelism == "tp":
        return f"tensor parallelism (parallelism_config_tp_size: {layout.tp} in {layout.where})"
    return NAMES[parallelism]


def _reference_of(recipe) -> str:
    """The key that makes a recipe's reference a frozen copy, for the messages."""
    if recipe.kto is not None:
        return "kto: without lora:"
    if recipe.rl is not None:
        return f"rl.beta={recipe.rl.beta:g} without lora:"
    return "preference.reference: copy"


def _fill(text: str, parallelism: str, recipe, layout: Layout) -> str:
    m, p = recipe.train.grad_accum_steps, recipe.parallel.pipeline_parallel
    # a pair is two sequences of up to data.max_seq_len (the budget of one had been advised: audit 12)
    per = 2 if unit_of(recipe) == "pairs" else 1
    rows = "pairs of 2 sequences of data.max_seq_len" if per == 2 else "rows of data.max_seq_len"
    return text.format(key=_key(parallelism, recipe, layout), attn=recipe.model.attn_implementation,
                       reference=_reference_of(recipe),
                       schedule=recipe.parallel.pipeline_schedule, accum=m, pp=p, rounds=interleaved_rounds(p, m),
                       size=recipe.train.micro_batch_size, rows=rows,
                       budget=recipe.train.micro_batch_size * per * recipe.data.max_seq_len)


def cell(mode: str, parallelism: str) -> str | None:
    """Why `mode` does not train on `parallelism` (None: it does, where the rules and the model allow)."""
    return MODES[mode].refused.get(parallelism)


# --------------------------------------------------------------------------- collecting the problems


def recipe_problems(recipe) -> list[str]:
    """Every problem the recipe alone shows: its sections against its data and batch, the mode's own settings, and
    its sequence and pipeline degrees (the parts of a layout a recipe sets). The schema asks it (config.Recipe)."""
    if found := _section_problems(recipe):  # which mode it is, first: the rest depends on it
        return found
    return _mode_problems(recipe) + problems(recipe, Layout.from_recipe(recipe))


def problems(recipe, layout: Layout, *, model=None) -> list[str]:
    """Every problem of `recipe` on `layout` (and, given its config, `model`), each one sentence naming the key and
    what to use instead: the layout's degrees, the mode's cells, each parallelism's rules. A parallelism whose cell
    refuses the mode adds nothing more: its own demands would only send the user between refusals."""
    mode = mode_of(recipe)
    out = layout.problems()
    refused = set()
    for parallelism in layout.parallelisms:
        if (why := cell(mode, parallelism)) is not None:
            refused.add(parallelism)
            out.append(f"{_key(parallelism, recipe, layout)} trains {_trained_by(parallelism)}; "
                       f"{MODES[mode].name} is refused: {why}")
    for rule in RULES:
        if rule.parallelism in layout.parallelisms and rule.parallelism not in refused and rule.applies(recipe, layout):
            text = _fill(rule.reason, rule.parallelism, recipe, layout)
            if text not in out:
                out.append(text)
    if model is not None:
        out += [p for p in model_problems(recipe, layout, model) if p not in out]
    return out


def sharding_problems(recipe, *, pp: int | None = None) -> list[str]:
    """What the table refuses of the recipe under FSDP / HSDP that it does not under DDP (the mode's cell, the FSDP
    rules): the estimate's --fit proposes no FSDP, HSDP or offload for such a recipe (memory/fit.shardable). `pp`: on
    that many pipeline stages instead of the recipe's (1: the plain FSDP the pipeline is compared with)."""
    sp, pp = recipe.parallel.sequence_parallel, pp or recipe.parallel.pipeline_parallel
    ddp = problems(recipe, Layout(processes=2 * sp * pp, sp=sp, pp=pp))
    return [p for p in problems(recipe, Layout(processes=2 * sp * pp, fsdp=True, sp=sp, pp=pp)) if p not in ddp]


def _trained_by(parallelism: str) -> str:
    modes = [m.name for m in MODES.values() if parallelism not in m.refused]
    return " and ".join([", ".join(modes[:-1]), modes[-1]] if len(modes) > 1 else modes)


def sequence_config_problem(n: int, config, *, whose: str = "the model's") -> str | None:
    """sequence_heads_problem of a transformers config's heads (its K/V heads: all of them where it names none; each
    layer's where its layers differ, layer_values)."""
    heads = config.num_attention_heads
    for kv in dict.fromkeys(layer_values(config, "num_key_value_heads", heads)):
        if problem := sequence_heads_problem(n, heads, kv, whose=whose):
            return problem
    return None


def layer_values(config, name: str, default=None) -> list:
    """A transformers config's `name` for each decoder layer. A heterogeneous config (transformers' per_layer_config:
    Gemma 4's global layers have a head_dim and K/V heads of their own) raises where the value is read off the config
    itself; here each layer's is read off its own."""
    if getattr(config, "is_heterogeneous", False):
        layers = config.per_layer_config
        return [getattr(layers[i], name, None) or default for i in range(config.num_hidden_layers)]
    return [getattr(config, name, None) or default] * config.num_hidden_layers


def sequence_heads_problem(n: int, heads: int, kv_heads: int, *, whose: str = "the model's") -> str | None:
    """Why a sequence group of `n` cannot split a model's heads (None when it can): each process attends with heads / n
    query heads, and the K/V heads split into n groups or divide n (each then repeated n / kv_heads times). The one
    definition: the layout's model check here, the estimate and doctor's row ask it (`whose`: a distillation
    teacher's, "its")."""
    if n <= 1:
        return None
    key = f"parallel.sequence_parallel={n}"
    if heads % n:
        return (f"{key}: {whose} {heads} attention heads do not split into {n} equal groups; set "
                f"parallel.sequence_parallel to a divisor of {heads}")
    if kv_heads % n and n % kv_heads:
        return (f"{key}: {whose} {kv_heads} key/value heads neither split into {n} groups nor divide {n} (to be "
                f"replicated); set parallel.sequence_parallel to a divisor or a multiple of {kv_heads} that divides "
                f"{heads}")
    return None


def experts(config) -> int:
    """Experts of each layer's MLP (a mixture of experts: Qwen3-MoE's num_experts, Mixtral's num_local_experts,
    DeepSeek's n_routed_experts); 0 for a dense MLP."""
    return max(int(getattr(config, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def experts_held(config, tp: int) -> str:
    """What each process of a tensor-parallel group holds of a layer's experts (parallel/tensor._split_experts)."""
    return f"each process {experts(config) // tp} of each layer's {experts(config)}"


def experts_per_token(config) -> int:
    """The experts each token goes through (num_experts_per_tok; Gemma 4's top_k_experts); 0 for a dense MLP."""
    return max(int(getattr(config, k, 0) or 0) for k in ("num_experts_per_tok", "top_k_experts"))


def needs_model(recipe, layout: Layout) -> bool:
    """Whether the layout or a setting depends on the model's shape or kind (the layout splits it, or a setting is
    refused for some models): where its config cannot be read, doctor says that this is unchecked. (Every run checks
    the model's attention whatever the layout: model_problems.)"""
    return layout.splits_the_model or bool(recipe.model.tiled_mlp) or (
        recipe.lora is not None and (recipe.lora.dropout > 0 or recipe.lora.dora)) or \
        recipe.model.router_aux_loss_coef is not None


def experts_problems(model_type: str | None, n: int, *, tiled_mlp: bool, lora_dropout: float,
                     parameters_adapted: bool = True, flags: dict[str, str] | None = None,
                     dora: bool = False) -> list[str]:
    """What a mixture of `n` experts cannot run: the tiled MLP, LoRA dropout or DoRA where peft adapts parameters (its
    ParamWrapper, which takes neither: Qwen3-MoE's and Mixtral's experts and router under all-linear, any under
    lora.target_parameters; `parameters_adapted`, lora_adapts_parameters). `flags`: the command-line options beside the
    recipe keys (estimate-memory's)."""
    flags = flags or {}
    kind = f"{model_type or 'this model'}'s MLP is a mixture of {n} experts"
    out = []
    if tiled_mlp:
        out.append(f"model.tiled_mlp{flags.get('tiled_mlp', '')} tiles a dense MLP (gate, up and down projections) "
                   f"over the tokens, and {kind} (a router and its experts), which it does not split: set it to null "
                   "(the experts' activations are per routed token already)")
    if lora_dropout > 0 and parameters_adapted:
        out.append(f"lora.dropout={lora_dropout:g}{flags.get('lora_dropout', '')}: {kind}, whose weights peft adapts "
                   "as parameters (lora.ParamWrapper), and those take no dropout on their input: set it to 0")
    if dora and parameters_adapted:
        out.append(f"lora.dora{flags.get('dora', '')}: {kind}, whose weights peft adapts as parameters "
                   "(lora.ParamWrapper), and those take no DoRA magnitude: set lora.dora to false, or adapt the "
                   "attention alone (lora.target_modules: [q_proj, k_proj, v_proj, o_proj])")
    return out


def lora_adapts_parameters(model_type: str | None, lora) -> bool:
    """Whether peft adapts parameters of a mixture of experts as such (its ParamWrapper) under the `lora` section: any
    named by lora.target_parameters, and the experts of a family whose experts peft's all-linear reaches (Qwen3-MoE's,
    Mixtral's: Family.all_linear_experts; a model outside the table is taken to be such)."""
    if lora is None:
        return False
    family = FAMILIES.get(model_type)
    return bool(lora.target_parameters) or family is None or family.all_linear_experts


# --------------------------------------------------------------------------- what llmtrain's attention computes

# The layer kinds (config.layer_types) whose attention llmtrain's varlen attention computes, each example of a packed
# row on its own: full and sliding-window causal attention. Chunked attention (Llama 4) is attention too, refused below.
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
# Layers that are not attention, which transformers runs itself and keeps a packed row's examples apart in only with
# an optional kernel package (without it, it raises at the first step): kind -> (its module, its pip name)
KEEP_APART = {"linear_attention": ("fla", "flash-linear-attention")}


_OLD_CHUNKS = ("this transformers' chunked mask counts the chunks from the start of a packed row, not of each example "
               "(transformers 5.25 and later count them from each example's start)")


def chunks_each_example() -> bool:
    """Whether the installed transformers' chunked-attention mask counts a packed row's chunks from each example's
    start (masking_utils.remap_positions_for_packed_sequence, transformers 5.25 and later; 5.17's counts them from the
    row's start, so Llama 4's packed examples trained on other chunks than their own: tests/test_other_families.py)."""
    from transformers import masking_utils

    return hasattr(masking_utils, "remap_positions_for_packed_sequence")


# model_types whose attention has sinks in every layer, known from the config (doctor and launch, before any load,
# had passed GPT-OSS packed under eager attention, which finetune refused once the model was built; audit 53); any
# other model's are found on the loaded model (loaded_model_problems)
SINKS = ("gpt_oss",)


def attention_problems(recipe, config, *, sinks: bool = False, installed=None,
                       packed_chunks: bool | None = None) -> list[str]:
    """What llmtrain's varlen attention (model.attn_implementation auto or varlen) and packed rows (data.packing) would
    not compute of the model as the model does, so that it would train on other numbers than its own: layers that
    are not attention without the kernel that keeps packed examples apart, chunked attention, capped attention
    scores; attention sinks (`sinks`: the loaded model has them: loaded_model_problems), which the varlen attention
    computes, packed under transformers' masks; chunked attention packed under a transformers whose chunked mask
    counts chunks from a row's start. The table's families pass them (their packed rows equal each example alone:
    tests/test_fastpath.py, GPT-OSS's sinks tests/test_other_families.py); another model_type gets them, from its
    config. `installed(module)`: whether a package is installed (importlib's find_spec), `packed_chunks`: whether
    transformers' chunked mask counts each example's own chunks (chunks_each_example); the tests pass their own."""
    if installed is None:
        from importlib.util import find_spec

        def installed(module):
            return find_spec(module) is not None
    m = recipe.model
    # a token budget packs every micro-batch whatever data.packing says (batching.packs): it had passed unrefused
    budget = getattr(getattr(recipe, "train", None), "micro_batch_tokens", None)
    varlen, packing = m.varlen, bool(recipe.data.packing or budget)
    packed_by = (f"train.micro_batch_tokens={budget} (a token budget packs every micro-batch)" if budget and
                 not recipe.data.packing else "data.packing")
    no_packing = " and ".join(["data.packing=false"] * bool(recipe.data.packing) + [
        "train.micro_batch_tokens=null (micro-batches of train.micro_batch_size rows)"] * bool(budget))
    name = getattr(config, "model_type", None) or "this model"
    attn = f"model.attn_implementation={m.attn_implementation} (llmtrain's varlen attention)"

    def unpacked(attention: str) -> str:  # the settings that train each example as a padded row of its own
        return " and ".join([f"model.attn_implementation={attention}"] * varlen + [no_packing] * packing)

    out = []
    other = [k for k in dict.fromkeys(getattr(config, "layer_types", None) or ()) if k not in ATTENTION_KINDS]
    missing = [k for k in other if k not in KEEP_APART or not installed(KEEP_APART[k][0])]
    if missing and (varlen or packing):
        kernels = [KEEP_APART[k][1] for k in missing if k in KEEP_APART]
        need = (f"only with {' and '.join(kernels)} (CUDA kernels), which is not installed here: install it, or "
                if kernels else "with no kernel llmtrain knows of: ")
        out.append(f"{name} has {' and '.join(missing)} layers (config.layer_types), which are not attention "
                   f"(Qwen3.5's and Qwen3-Next's Gated DeltaNet are linear_attention): transformers runs them, and "
                   f"keeps the examples of a packed row ({packed_by}, and the varlen attention's padded rows, each "
                   f"pad an example of its own) apart in them {need}train each example as a padded row of its own: "
                   f"{unpacked('sdpa')}")
    if chunk := getattr(config, "attention_chunk_size", None):
        if packed_chunks is None:
            packed_chunks = chunks_each_example()
        if varlen:
            fix = ("model.attn_implementation=sdpa (transformers' chunked mask, which keeps a packed row's examples "
                   "apart too)" if packed_chunks or not packing else
                   f"model.attn_implementation=sdpa and {no_packing} ({_OLD_CHUNKS})")
            out.append(f"{attn} lets each token see its whole example, and {name} attends within chunks of {chunk} "
                       f"tokens (attention_chunk_size, Llama 4): set {fix}")
        elif packing and not packed_chunks:
            out.append(f"{packed_by} with model.attn_implementation={m.attn_implementation}: {name} attends within "
                       f"chunks of {chunk} tokens (attention_chunk_size, Llama 4), and {_OLD_CHUNKS}: set "
                       f"{no_packing}, or install transformers 5.25 or later")
    if varlen and (cap := getattr(config, "attn_logit_softcapping", None)):
        out.append(f"{attn} does not cap attention scores, and {name} caps them (attn_logit_softcapping={cap:g}): "
                   f"set model.attn_implementation=eager")
    kernel = m.attn_implementation
    if kernel in OWN_KERNELS and (cls := causal_lm_class(config)) is not None and not getattr(
            cls, OWN_KERNELS[kernel], True):
        out.append(f"model.attn_implementation={kernel}: transformers has no {kernel} attention for {name} "
                   f"({cls.__name__} sets {OWN_KERNELS[kernel]} False{': its sinks' if name == 'gpt_oss' else ''}), "
                   "and refuses to load it so: set model.attn_implementation=auto (llmtrain's varlen attention) or "
                   "eager")
    if sinks and packing and not varlen:
        out.append(f"{packed_by} with model.attn_implementation={m.attn_implementation}: {name}'s attention has "
                   f"sinks (GPT-OSS), and transformers builds its masks without a packed row's position ids, so a "
                   f"packed row's examples would attend to each other: set model.attn_implementation=auto "
                   f"(llmtrain's varlen attention computes the sinks, each example on its own), or {no_packing}")
    return out


# transformers' own attention kernels -> the class flag that says a model's attention has it (transformers refuses to
# load a model with one it lacks: GPT-OSS's sdpa)
OWN_KERNELS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}


def causal_lm_class(config):
    """The transformers class that loads `config` as a causal LM (AutoModelForCausalLM's), or None if it has none."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def loaded_model_problems(recipe, model) -> list[str]:
    """attention_problems of a loaded model, with what its config does not say: whether its attention has sinks (a
    parameter named `sinks`: GPT-OSS, MiMo-V2-Flash). Asked once the model is built, before anything is written."""
    return attention_problems(recipe, model.config, sinks=True) if has_sinks(model) else []


def has_sinks(model) -> bool:
    """Whether a loaded model's attention has sinks (a parameter named `sinks`: GPT-OSS, MiMo-V2-Flash)."""
    return any(n.rpartition(".")[2] == "sinks" for n, _ in model.named_parameters())


def stored_quantization(config) -> str | None:
    """How a checkpoint's weights are stored quantized, by its config's quantization_config (GPT-OSS's hub
    checkpoints: 'mxfp4'); None: not at all. `config`: transformers' config, or its config.json as a dict."""
    quantization = (config.get("quantization_config") if isinstance(config, dict) else
                    getattr(config, "quantization_config", None)) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization,
                                                                                              "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def stored_quantization_problem(quantize: str | None, config, *, key: str = "model.quantize") -> str | None:
    """A 4-bit base (`quantize`, set by `key`) asked of a checkpoint stored in MXFP4 (GPT-OSS's hub checkpoints)."""
    if not quantize or (stored := stored_quantization(config)) != "mxfp4":
        return None
    asked = f"{key}={quantize}" if not key.startswith("--") else f"{key} {quantize}"
    return (f"{asked}: the checkpoint is stored in {stored.upper()} (its config.json's quantization_config), "
            "which bitsandbytes cannot quantize again, and a mixture of experts' experts, most of its weights, are "
            f"3-D parameters that bitsandbytes leaves whole anyway. Unset {key}: llmtrain reads the checkpoint "
            "dequantized to model.dtype (bfloat16: 42 GB for gpt-oss-20b), which LoRA trains")


def untiled(recipe, shard: int, what: str) -> str | None:
    """The refusal of a model.tiled_mlp shard (`what` says it: a number given, or true's hidden_size) that no
    micro-batch reaches: the MLP would run in one shard, the recompute's cost for no memory saved."""
    local, held = recipe.tokens_a_process()
    if shard < local:
        return None
    return (f"{what}, but {held}: the MLP would run in one shard and nothing would be tiled. Give a shard shorter "
            f"than that (e.g. model.tiled_mlp={max(local // 4, 1)}), or leave model.tiled_mlp unset")


def model_problems(recipe, layout: Layout, config) -> list[str]:
    """What the recipe and the layout refuse of the model itself (`config`: its transformers config): its family's
    cells (FAMILIES), a mixture of experts under the tiled MLP or LoRA dropout, heads a sequence or a tensor-parallel
    group cannot split, a tensor-parallel plan llmtrain does not build, what the varlen attention and packed rows do
    not compute of it (attention_problems), fewer layers than stages. Every run asks it, with the model's config."""
    out = []
    model_type = getattr(config, "model_type", None)
    refused = set()
    for parallelism in layout.parallelisms:
        if (why := family_cell(model_type, parallelism)) is not None:
            refused.add(parallelism)
            out.append(f"{_key(parallelism, recipe, layout)} is refused for {FAMILIES[model_type].name} "
                       f"({model_type}): {why}")
    if n := experts(config):
        out += experts_problems(model_type, n, tiled_mlp=bool(recipe.model.tiled_mlp),
                                lora_dropout=recipe.lora.dropout if recipe.lora is not None else 0.0,
                                parameters_adapted=lora_adapts_parameters(model_type, recipe.lora),
                                dora=recipe.lora is not None and recipe.lora.dora)
        family = FAMILIES.get(model_type)
        if (coef := recipe.model.router_aux_loss_coef) is not None and family and not family.load_balancing:
            out.append(f"model.router_aux_loss_coef={coef:g} adds transformers' load-balancing loss of a mixture of "
                       f"experts, and {family.name} has none (its router records the routing probabilities, not "
                       "the logits that loss takes): unset it")
    elif (coef := recipe.model.router_aux_loss_coef) is not None:
        out.append(f"model.router_aux_loss_coef={coef:g} weighs a mixture of experts' load-balancing loss, and "
                   f"{model_type or 'this model'} has no experts (a dense MLP): unset it")
    if problem := sequence_config_problem(layout.sp, config):
        out.append(problem)
    hidden = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "hidden_size", None)
    if recipe.model.tiled_mlp is True and hidden and (  # (it had started, saying it tiled, and tiled nothing)
            problem := untiled(recipe, hidden, f"model.tiled_mlp: true tiles in shards of the model's hidden_size, "
                                               f"{hidden:,} tokens")):
        out.append(problem)
    if recipe.model.new_tokens and getattr(config, "vocab_size_per_layer_input", None):
        out.append("model.new_tokens grows the embeddings and the LM head, and this model also looks each token up in "
                   "its per-layer embeddings (vocab_size_per_layer_input: Gemma 4's), which are not grown: a new id "
                   "would index past them. Use the markers its tokenizer has (Gemma's <start_of_turn> and "
                   "<end_of_turn>), or unset model.new_tokens")
    if problem := stored_quantization_problem(recipe.model.quantize, config):
        out.append(problem)
    if fp32_head(recipe, layout) and getattr(
            config.get_text_config() if hasattr(config, "get_text_config") else config, "tie_word_embeddings", False):
        out.append(f"rl.cast_lm_head_to_fp32: this {model_type or ''} model's LM head is its input embeddings "
                   "(tie_word_embeddings), which would turn fp32 too and feed the decoder fp32 inputs. Unset "
                   "rl.cast_lm_head_to_fp32 (TRL supports it for untied heads only), or train a model with its own "
                   "head")
    if recipe.reward_model is None and (problem := scorer_problem(config, recipe.model.name_or_path,
                                                                   "model.name_or_path")):
        out.append(problem + ". Start from a causal LM: the policy or base model the reward model was trained from")
    if layout.tp > 1 and "tp" not in refused:
        out += tensor_plan_problems(config, layout.tp)
    out += attention_problems(recipe, config, sinks=getattr(config, "model_type", None) in SINKS)
    if (p := layout.pp) > 1:
        key, total = f"parallel.pipeline_parallel={p}", p * recipe.parallel.stages_per_rank
        if config.num_hidden_layers < total:
            out.append(f"{key}: {total} pipeline stages need at least one decoder layer each: the model has "
                       f"{config.num_hidden_layers}; lower parallel.pipeline_parallel (or pipeline_chunks)")
    return out


def scorer_problem(config, path: str, key: str) -> str | None:
    """A checkpoint saved as a sequence classifier (a reward model's final/: architectures XForSequenceClassification)
    given where a causal LM is read: its one-output score head is not an LM head, and the LM head transformers makes
    in its place is random where it is not the input embeddings (tie_word_embeddings). `config`: transformers' config
    or config.json's dict. The sentence, without its fix; None where the checkpoint is a causal LM's."""
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    architectures = get("architectures") or []
    if not architectures or not all(a.endswith("ForSequenceClassification") for a in architectures) or get(
            "tie_word_embeddings", False):
        return None
    return (f"'{path}' ({key}) is a sequence classifier ({architectures[0]}: a reward model's final/ is saved as one): "
            "it scores a whole sequence under a one-output head and has no LM head, so transformers would make a "
            "random one in its place, whose next-token probabilities mean nothing")


def tensor_plan(config) -> dict[str, str]:
    """The tensor-parallel plan llmtrain applies to a model (parallel/tensor.py) and estimates (memory/params.py): the
    model's own (config.base_model_tp_plan), or its family's (Family.tp_plan: GPT-OSS's)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    plan = dict((family and family.tp_plan) or getattr(config, "base_model_tp_plan", None) or {})
    # transformers 5.17 adds "embed_tokens": "embedding_rowwise" to a tied model's plan (5.24 does not): llmtrain keeps
    # the embedding whole on every TP rank (FSDP shards it), as it does for every model
    plan.pop("embed_tokens", None)
    # transformers 5.25 moves a mixture of experts' entries out of the tensor-parallel plan into
    # base_model_ep_plan (the experts module 'ep_dispatch_experts', its parameters 'grouped_gemm'); before, the plan
    # named the module moe_tp_experts. Either way llmtrain splits that module by expert (parallel/tensor._split_experts)
    if experts(config) and "moe_tp_experts" not in plan.values():
        plan.update({k: "moe_tp_experts" for k, v in (getattr(config, "base_model_ep_plan", None) or {}).items()
                     if v == "ep_dispatch_experts"})
    if not experts(config):  # a dense variant of a family with experts (Gemma 4's): their entries name nothing
        plan = {k: v for k, v in plan.items() if ".experts" not in k}
    return plan


def tensor_plan_source(config) -> str:
    """Whose tensor-parallel plan tensor_plan gives, for the start-up line: the family's (llmtrain's: GPT-OSS's own
    splits only its embedding) or the model's own (the line had said "the model's own" for GPT-OSS; audit 58)."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    return f"llmtrain's plan for {model_type}" if family and family.tp_plan else "the model's own plan"


def tensor_plan_problems(config, tp: int) -> list[str]:
    """What tensor parallelism over `tp` processes refuses of a model: a plan (tensor_plan) other than column- and
    row-wise linear layers, and heads, MLP columns or experts that `tp` does not divide."""
    plan = tensor_plan(config)
    if not plan or set(plan.values()) - set(TP_STYLES):
        return [f"tensor parallelism needs a model whose tensor-parallel plan (config.base_model_tp_plan) is column- "
                f"and row-wise linear layers (fused ones gathered, as Phi's; and whole modules whose gradients are "
                f"summed: Qwen3's QK-norm), as Llama's, Qwen3's and Phi's are; {getattr(config, 'model_type', 'this')} "
                f"has {sorted(set(plan.values())) or 'none'}. Set parallelism_config_tp_size: 1"]
    heads = config.num_attention_heads
    kvs = layer_values(config, "num_key_value_heads", heads)  # each layer's (Gemma 4's global layers have their own)
    kv = kvs[0]
    others: dict[int, list[str]] = {}
    for i, n in enumerate(kvs):
        if n != kv:
            others.setdefault(n, []).append(str(i))
    split = (("num_attention_heads", heads), ("num_key_value_heads", kv),
             *((f"key/value heads of layers {', '.join(layers)}", n) for n, layers in others.items()))
    if set(plan.values()) & {"colwise_gather_output", "rowwise_split_input"}:  # the weights split, the heads whole
        head_dim = layer_values(config, "head_dim", config.hidden_size // heads)[0]
        split = (("qkv_proj's outputs, (num_attention_heads + 2 x num_key_value_heads) x head_dim",
                  (heads + 2 * kv) * head_dim), ("o_proj's inputs, num_attention_heads x head_dim", heads * head_dim))
    if count := experts(config):  # split by expert (parallel/tensor._split_experts)
        split += (("experts of each layer", count),)
    if any(k.endswith(("mlp.gate_proj", "mlp.gate_up_proj", "mlp.down_proj")) for k in plan):  # a dense MLP's columns
        split += (("intermediate_size", getattr(config, "intermediate_size", tp)),)  # (Mixtral's is its experts')
    return [f"tensor parallelism over {tp} processes splits the model's {name} ({n}) evenly, and {n} is not a "
            f"multiple of {tp}: set parallelism_config_tp_size to a divisor of {n}" for name, n in split if n % tp]


# The tensor-parallel plan's styles llmtrain builds (parallel/tensor.py): linear layers column- and row-wise; a fused
# column-wise layer whose output is gathered whole and the row-wise layer after it, which takes its slice of the
# input (Phi's qkv_proj / gate_up_proj and o_proj / down_proj); a whole module whose gradient each rank has in part
# and sums (QK-norm); a mixture of experts' experts, split by expert (the plan's moe_tp_experts; its packed_colwise
# gate_up_proj and rowwise down_proj name the parameters of that module, which llmtrain splits whole); a module's own
# parameters of one value a query head, split with the heads (llmtrain's "heads": GPT-OSS's attention sinks)
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce",
             "packed_colwise", "moe_tp_experts", "heads")


def check_model(recipe, layout: Layout, config) -> None:
    """Refuse what the recipe and the layout, already checked (`check`), ask of the model itself (model_problems)."""
    if found := model_problems(recipe, layout, config):
        raise LLMTrainError(paragraph(found))


def check(recipe, layout: Layout, *, model=None) -> None:
    """Refuse the recipe on the layout with every problem in one paragraph (LLMTrainError, exit 2)."""
    if found := problems(recipe, layout, model=model):
        raise LLMTrainError(paragraph(found))


def paragraph(found: list[str]) -> str:
    """Problems as one paragraph: the one, or each numbered."""
    found = [p.rstrip(".") for p in found]
    if len(found) == 1:
        return found[0] + "."
    return f"{len(found)} problems: " + " ".join(f"({i}) {p}." for i, p in enumerate(found, 1))


# --------------------------------------------------------------------------- a mode's own settings


def _section_problems(recipe) -> list[str]:
    """The recipe's objective sections against each other and its data.format (the table's formats)."""
    given = [s for s in SECTIONS if getattr(recipe, s) is not None]
    fmt = recipe.data.format
    if "distill" in given and len(given) > 1:
        return ["distill: is a training objective of its own; remove the preference:, kto: or rl: section"]
    if "reward_model" in given and "preference" in given:
        return ["reward_model: trains a scoring head on the pairs and preference: a policy on them; one run does one "
                "of the two. Remove one section"]
    if len(given) > 1:
        return [f"one run trains one objective, and this recipe has {' and '.join(SECTIONS[s] for s in given)}: "
                "remove all but one"]
    mode = MODES[mode_of(recipe)]
    if fmt not in mode.formats:
        if mode.key == "distill":
            return [f"distill: needs rows with a prompt and a completion (data.format prompt_completion, messages or "
                    f"alpaca): the prompt is what the student completes, and the data's completion is what it trains "
                    f"on at off-policy steps; data.format={fmt} has none. Convert the rows, or set data.format"]
        return [_FORMAT_HINT.get(fmt if mode.key == "sft" else mode.formats[0])]
    others = [f"data.sources[{i}] ({s.format})" for i, s in enumerate(recipe.data.sources or ())
              if s.format not in mode.formats]
    if others:  # a mixture trains in one mode: its first source's format sets data.format
        return [f"the sources of a mixture train in one mode, and this recipe's is {mode.name} (data.sources[0]'s "
                f"format {fmt}), which trains on data.format {', '.join(mode.formats)}; {' and '.join(others)} "
                f"cannot train with it. Convert those rows, or train them in a run of their own"]
    return []


# The modes whose loss never reads a prompt token's label: data.train_on_prompt is refused, with why.
PROMPT_UNTRAINED = {
    "kto": "kto: compares the log-probabilities of the completions only",
    "distill": "distill: matches the teacher on completion tokens only",
    "reward_model": "reward_model: scores each sequence at its last token, and no token's label is trained",
    "grpo": "rl: the loss is the policy's on its sampled completions only, never on the prompts",
    "rloo": "rl: the loss is the policy's on its sampled completions only, never on the prompts",
}


def _mode_problems(recipe) -> list[str]:
    """The mode's batch unit and evaluation (the table's), and the settings each mode reads (moved here from the
    schema's validators, collected rather than stopping at the first)."""
    mode = MODES[mode_of(recipe)]
    out = []
    t = recipe.train
    if t.micro_batch_tokens is not None and not mode.token_budget:
        out.append({"distill": "distill: a micro-batch is train.micro_batch_size prompts, whose completions the "
                               "student samples; unset train.micro_batch_tokens"}.get(
            mode.key, "rl: a micro-batch is train.micro_batch_size prompts, each with rl.num_generations completions "
                      "packed padding-free into one row; unset train.micro_batch_tokens (a token budget for the "
                      "update's passes is rl.micro_batch_tokens)"))
    if fp32_head(recipe, None) and recipe.lora is not None and (
            trained := [k for k in ("target_modules", "modules_to_save")
                        if "lm_head" in (getattr(recipe.lora, k) or ())]):
        if recipe.model.new_tokens and trained[0] == "modules_to_save":  # put there by model.new_tokens, not the user
            out.append("rl.cast_lm_head_to_fp32 holds the LM head's weight in fp32, and model.new_tokens trains the "
                       "head's new rows under LoRA (lora.modules_to_save gets lm_head: a saved copy in the model's "
                       "dtype). Unset model.new_tokens (a tokenizer that already has the tokens) or "
                       "rl.cast_lm_head_to_fp32")
        else:
            out.append(f"rl.cast_lm_head_to_fp32 holds the LM head's weight in fp32, and lora.{trained[0]} names "
                       "lm_head (peft wraps it: an adapted or saved copy in the model's dtype). Remove lm_head from "
                       f"lora.{trained[0]}, or unset rl.cast_lm_head_to_fp32")
    if t.eval_samples and not mode.samples:
        out.append("reward_model: the model scores sequences and has no LM head to generate eval samples with; set "
                   "train.eval_samples=0")
    if recipe.data.train_on_prompt and (why := PROMPT_UNTRAINED.get(mode.key)):  # (RL's and a reward model's had
        out.append(f"{why}; unset data.train_on_prompt")  # been accepted and ignored without a word)
    if (coef := recipe.model.router_aux_loss_coef) is not None and not mode.router_aux:
        takes = ", ".join(m.name for m in MODES.values() if m.router_aux)
        out.append(f"model.router_aux_loss_coef={coef:g}: the load-balancing loss joins the loss of {takes}, and this "
                   f"recipe trains {mode.name}, whose loss llmtrain does not add it to. Unset it")
    if (alpha := t.neftune_alpha) is not None and not mode.neftune:
        takes = ", ".join(m.name for m in MODES.values() if m.neftune)
        out.append(f"train.neftune_alpha={alpha:g}: NEFTune's noise is for {takes}, and this recipe trains "
                   f"{mode.name}, whose every forward (a reference's, a sampler's, a teacher's) would have to tell a "
                   "trained pass from the rest. Unset it")
    if t.sft_loss != "nll" and not mode.sft_loss:
        takes = ", ".join(m.name for m in MODES.values() if m.sft_loss)
        out.append(f"train.sft_loss={t.sft_loss} weighs the token loss of {takes}, and this recipe trains "
                   f"{mode.name}, whose loss is its own. Unset it")
    if (p := recipe.preference) is not None and p.reference == "adapter" and recipe.lora is None:
        out.append("preference.reference: adapter disables the LoRA adapter, and this recipe has no lora: section; "
                   "use precomputed (or auto) for a full fine-tune")
    if p is not None and p.reference == "copy" and recipe.lora is not None:
        out.append("preference.reference: copy keeps a frozen copy of a full fine-tune's starting weights, and this "
                   "recipe trains LoRA, whose reference is the model with its adapter disabled (no copy): use adapter "
                   "(or auto)")
    if (sync := reference_sync(recipe)) is not None and recipe.lora is not None and sync.alpha != 1:
        section = "preference" if p is not None else "kto" if recipe.kto is not None else "rl"
        out.append(f"{section}.sync_reference.alpha={sync.alpha:g} with LoRA: a LoRA run's reference can follow the "
                   "policy only whole (alpha 1, TR-DPO's hard update: the adapter as it was at the sync), because a "
                   "mix of two adapters (a B1 A1 + (1 - a) B2 A2) is no adapter of their rank. Set "
                   f"{section}.sync_reference.alpha=1, or remove the lora: section to mix a full fine-tune's copy")
    if (k := recipe.kto) is not None and k.loss_type == "kto" and t.micro_batch_tokens is None and \
            t.micro_batch_size < 2:  # (under a token budget, data/checks.check_kl_pairs reads the lengths)
        out.append("kto.loss_type: kto estimates the KL term from mismatched pairs within a micro-batch, so it needs "
                   "train.micro_batch_size of at least 2 (with 1, the KL term would be the implied reward itself, as "
                   "TRL says), or a token budget (train.micro_batch_tokens) that holds two examples")
    if (k := recipe.kto) is not None and k.loss_type == "kto" and t.eval_batch_size == 1:  # (the eval had taken it)
        out.append("train.eval_batch_size=1 with kto.loss_type: kto: the eval estimates the KL term from mismatched "
                   "pairs within an eval micro-batch, and with 1 each example is paired with its own completion "
                   "(eval_kl its implied reward, eval_loss moved by it). Set train.eval_batch_size to 2 or more, or "
                   "unset it (the eval is then batched as training is)")
    if (rl := recipe.rl) is not None:
        if sync is not None and rl.beta == 0:
            out.append("rl.sync_reference moves the reference, which only the KL term reads, and rl.beta=0 turns it "
                       "off: set rl.beta above 0 (e.g. 0.04), or remove rl.sync_reference")
        if rl.micro_batch_tokens is not None and rl.micro_batch_tokens < recipe.data.max_seq_len:
            out.append(f"rl.micro_batch_tokens={rl.micro_batch_tokens} is below data.max_seq_len="
                       f"{recipe.data.max_seq_len}: a prompt and its completion are never split over two passes, so "
                       f"the budget must hold the longest. Set rl.micro_batch_tokens to at least "
                       f"{recipe.data.max_seq_len}")
    return out


# --------------------------------------------------------------------------- the table, as docs/scaling.md prints it


COPY_KEYS = "kto:, preference.reference: copy or rl.beta > 0, without lora:"  # the rules' {reference}, in the table


def table_markdown() -> str:
    """The mode x parallelism table: 'trains' or 'refused' with the reason's first clause; the rules below it."""
    head = "| mode | data formats | batch unit | token budget | " + " | ".join(NAMES[p] for p in PARALLELISMS) + " |"
    rows = [head, "|" + " --- |" * (4 + len(PARALLELISMS))]
    for m in MODES.values():
        cells = [("trains" if (why := m.refused.get(p)) is None else f"refused: {why.split('. ')[0]}")
                 for p in PARALLELISMS]
        rows.append(f"| {m.name} | {', '.join(m.formats)} | {m.unit} | {'yes' if m.token_budget else 'no'} | "
                    + " | ".join(cells) + " |")
    rules = [f"- {NAMES[r.parallelism]}: {r.reason.split('. ')[0].replace('{key}', 'it')}"
             .replace("{attn}", "other").replace("{schedule}", "1f1b").replace("{accum}", "m").replace("{pp}", "P")
             .replace("{rounds}", "m / P").replace("{reference}", COPY_KEYS) for r in RULES]
    return "\n".join(rows) + "\n\nWhat each parallelism refuses of any mode:\n\n" + "\n".join(rules) + "\n"


def families_markdown() -> str:
    """The family x parallelism table (docs/models.md): 'trains' or 'refused' with the reason's first clause, and
    whether llmtrain models the family's layer (the estimate, the fast sampler)."""
    columns = [p for p in PARALLELISMS if p != "single"]
    rows = ["| family (`model_type`) | " + " | ".join(NAMES[p] for p in columns) + " | estimate | fast sampler |",
            "|" + " --- |" * (3 + len(columns))]
    for f in FAMILIES.values():
        cells = [("trains" if (why := f.refused.get(p)) is None else f"refused: {why.split('. ')[0]}")
                 for p in columns]
        models = ("yes" if f.estimate else "no", "yes" if f.fast_sampler else "no: the reference sampler")
        rows.append(f"| {f.name} (`{f.key}`) | " + " | ".join(cells) + f" | {models[0]} | {models[1]} |")
    return "\n".join(rows) + "\n"
