"""The run being estimated (`TrainSpec`) and the answer (`Estimate`).

TrainSpec's defaults are the recipe schema's, so `--model` without options estimates what a recipe
with only `model.name_or_path` set would run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from llmtrain.capabilities import (fp32_head, reference_copy, reference_kind, reference_sync, rollout_adapter,
                                   rollout_reference, sharding_problems)
from llmtrain.config import (DataConfig, LoraConfig, ModelConfig, ParallelConfig, Recipe, TrainConfig, sampling_of,
                             VARLEN_SETTINGS, updates_per_window)
from llmtrain.errors import LLMTrainError
from llmtrain.parallel.pipeline.split import SCHEDULES

Method = Literal["full", "lora"]
Strategy = Literal["single", "ddp", "fsdp", "hsdp"]
Dtype = Literal["float32", "bfloat16", "float16"]
Precision = Literal["no", "bf16", "fp16"]
Attn = Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2"]

GIB = 1024**3
MIB = 1024**2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PRECISION_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}
# bitsandbytes 4-bit with double quantisation (QLoRA, Dettmers et al. 2023): 4 bits a weight, one 8-bit absmax per
# block of 64 weights, and one fp32 absmax per block of 256 of those: 0.5 + 1/64 + 4/(64 x 256) bytes a weight.
QUANT_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)
# Every component a breakdown reports, in display order; the first six are always present.
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "overhead",
              "autocast_copies", "ddp_buckets", "fsdp_buffers", "temporaries", "kv_cache", "generation_copy",
              "pipeline_buffers", "teacher", "reward_models")
# Online RL without readable data: each prompt is taken at its longest, data.max_seq_len - rl.max_completion_tokens (a
# longer prompt is refused before training: data.checks.check_prompt_room), so every sequence is max_seq_len long.
# With data, the micro-batches of prompts the run will sample (its data plan: a pure function of the seed): the
# heaviest one's prompt tokens (the update's packed row), and the longest prompt among them (the KV cache's width, to
# which the sampler left-pads); without the plan, the prompts' PROMPT_QUANTILE for both.
PROMPT_QUANTILE = 0.9


def _default(section, name: str):
    return section.model_fields[name].default


def _targets(value) -> str | tuple[str, ...]:
    return value if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class TrainSpec:
    """Everything the estimate depends on besides the model. Per-process values (micro_batch is per GPU)."""

    method: Method = "full"
    lora_r: int = _default(LoraConfig, "r")
    lora_target_modules: str | tuple[str, ...] = _targets(_default(LoraConfig, "target_modules"))
    lora_dropout: float = _default(LoraConfig, "dropout")
    lora_dora: bool = _default(LoraConfig, "dora")
    lora_modules_to_save: tuple[str, ...] = ()
    lora_target_parameters: tuple[str, ...] = ()  # peft's parameter adapters (GPT-OSS's experts)
    dtype: Dtype = _default(ModelConfig, "dtype")  # storage dtype of the weights
    quantize: str | None = _default(ModelConfig, "quantize")  # QLoRA: the decoder layers' linears in 4 bits
    mixed_precision: Precision = _default(TrainConfig, "mixed_precision")
    attn_implementation: Attn = _default(ModelConfig, "attn_implementation")  # 'auto' is 'varlen', as in training
    gradient_checkpointing: bool = _default(ModelConfig, "gradient_checkpointing")
    # long context: the checkpointed layers' inputs in host memory; the MLP over shards of tokens (True: hidden size)
    activation_offload: bool = _default(ModelConfig, "activation_offload")
    tiled_mlp: bool | int | None = _default(ModelConfig, "tiled_mlp")
    random_init: bool = _default(ModelConfig, "random_init")  # weights made on the GPU: none read on the host
    micro_batch: int = _default(TrainConfig, "micro_batch_size")
    micro_batch_tokens: int | None = _default(TrainConfig, "micro_batch_tokens")  # a token budget instead
    grad_accum_steps: int = _default(TrainConfig, "grad_accum_steps")
    # FSDP/HSDP between micro-batches: sharded (reduce-scatter each) or unsharded (whole fp32 gradient, sent once)
    fsdp_accumulate: str = _default(TrainConfig, "fsdp_accumulate")
    seq_len: int = _default(DataConfig, "max_seq_len")
    packing: bool = _default(DataConfig, "packing")
    loss_chunk_tokens: int = _default(TrainConfig, "loss_chunk_tokens")
    optimizer: str = _default(TrainConfig, "optimizer")  # adamw, or adamw_8bit (bitsandbytes' 8-bit moments)
    eval_micro_batch: int | None = None  # None: no evaluation during training
    eval_micro_batch_tokens: int | None = None  # eval micro-batches by token budget (train's, no eval_batch_size)
    strategy: Strategy = "single"
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    cpu_offload: bool = False  # FSDP's offload_params: sharded weights, grads and optimizer state on the host
    # FSDP's fsdp_reshard_after_forward (accelerate's default true): false keeps every layer's gathered parameters
    # from its forward to its backward, gathering them once a micro-batch instead of twice
    reshard_after_forward: bool = True
    gpu_memory_gib: float = 80.0
    tp: int = 1  # tensor-parallel GPUs per group, within a node (FSDP or HSDP x TP: FSDP shards over the groups)
    # Ulysses sequence parallelism (parallel.sequence_parallel): N consecutive GPUs share each micro-batch, a packed
    # row of `tokens` (the group's), ceil(tokens / N) of them on each; around attention an all-to-all gives each GPU
    # the whole row for 1/N of the heads. Weights, gradients and optimizer state are the strategy's over every GPU.
    sequence_parallel: int = _default(ParallelConfig, "sequence_parallel")
    # Pipeline parallelism (parallel.pipeline_parallel P): the GPUs form P stage groups of world / P consecutive GPUs
    # (stage s: GPUs [s W/P, (s+1) W/P), so with P = nodes a stage is a node), each running the decoder layers
    # parallel.pipeline.split.stage_layers gives it, the strategy (fsdp or ddp) inside the group; grad_accum_steps
    # micro-batches a step go through the stages by pipeline_schedule; pipeline_chunks: (virtual) stages a GPU runs,
    # interleaved only (None: 1, or 2 interleaved). memory/pipeline.py estimates it.
    pipeline_parallel: int = _default(ParallelConfig, "pipeline_parallel")
    pipeline_schedule: str = _default(ParallelConfig, "pipeline_schedule")
    pipeline_chunks: int | None = _default(ParallelConfig, "pipeline_chunks")
    # online RL: the micro-batch's sequences are sampled together first (micro_batch = prompts x num_generations), each
    # up to seq_len with its KV cache; 0: no sampling
    num_generations: int = 0
    # online RL: a sequence is a prompt of prompt_tokens and a completion of up to max_completion_tokens (seq_len is
    # their sum), of which only the completion goes through the loss; prompt_cap is the longest prompt the trainer
    # takes, data.max_seq_len - max_completion_tokens (the worst case's prompt_tokens); prompt_basis says where
    # prompt_tokens came from; prompt_longest: the longest prompt one micro-batch samples (the KV cache and the
    # prefill are that wide), 0: prompt_tokens
    max_completion_tokens: int = 0
    prompt_tokens: int = 0
    prompt_longest: int = 0
    prompt_cap: int = 0
    prompt_basis: str = ""
    # online RL: the update's token budget (rl.micro_batch_tokens): the micro-batch's sequences go through forward and
    # backward in passes of at most this many tokens, whole sequences each; None: one pass
    rl_micro_batch_tokens: int | None = None
    # online RL and distillation with LoRA: the fast sampler's merged generation copy of the adapted linears
    # (rl.merged_copy): "rollout", held while it samples; "kept", held throughout; "off", none
    merged_copy: str = "off"
    # online RL: the completions its eval samples at once (eval prompts x rl.num_generations_eval, or one each)
    eval_rows: int = 0
    # online RL and distillation: the sampler's settings (rl: or distill:, config.SAMPLING), as (name, value) pairs:
    # its filters' temporaries (activations.sampler_bytes)
    sampling: tuple = ()
    # online RL and distillation: rl.sampler (distill.sampler) reference, generate.sample's loop (pipeline stages
    # sample with it): every row's whole prompt prefilled at once, transformers' cache growing a token at a time
    reference_sampler: bool = False
    # online RL with rl.tools or rl.environment: after a tool's result every live row is sampled again from its own
    # prompt + completion so far (tool_calls.sample_with_tools): a prefill per row, not per prompt, and a cache as
    # wide as the longest such prefix and the most room left, up to the longest prompt + 2 x max_completion_tokens;
    # under sequence parallelism the group's first GPU samples every row (shards.shared_sampling)
    tool_rounds: bool = False
    # sequences one recipe example makes (micro_batch counts sequences): 2 for a preference pair (chosen and
    # rejected), num_generations for an online-RL prompt; --fit sizes micro-batches in whole examples
    per_example: int = 1
    # the fewest examples a micro-batch may hold: 2 for KTO's KL estimate (kto.loss_type kto), which pairs each prompt
    # with another example's completion; --fit and --longest-context keep at least that many
    min_examples: int = 1
    # KTO: before each micro-batch's training forward, no-grad forwards of as many sequences (its KL sequences, by the
    # policy and the reference, and the reference's pass over the micro-batch), with the window's gradients so far held
    no_grad_forwards: bool = False
    # online RL: no-grad forwards of the update's passes within the rollout (rl.num_iterations > 1's old
    # log-probabilities, rl.sampler_correction's; RLOO's with beta > 0 for its KL), FSDP's units still gathered
    rollout_forwards: bool = False
    # online RL: optimizer steps a generation round trains (rl.num_iterations): a step samples 1 / num_iterations
    # of the time
    num_iterations: int = 1
    # online RL: micro-batches the sampler draws at once (rl.generation_batch=step: the step's grad_accum_steps)
    sampled_batches: int = 1
    # no-grad forwards of the trained model's shape over the step's sequences, per optimizer step (the step's time, not
    # its peak: comms.no_grad_flops; extra_forwards_of says which): a reference's (LoRA's adapter disabled, or KTO's
    # frozen copy), KTO's KL sequences by the policy, online RL's log-probabilities once a round (1 / num_iterations)
    extra_forwards: float = 0.0
    extra_forwards_what: str = ""  # whose, in words
    # a full fine-tune's frozen copy of the starting weights as its reference (capabilities.reference_copy: KTO,
    # preference.reference copy, online RL with rl.beta > 0), in the storage dtype, whole on every GPU, or under FSDP
    # sharded like the policy with its head whole (model/reference.py, loop/phases.build_reference)
    frozen_reference: bool = False
    # RLOO's KL with that copy (and GRPO's reference log-probabilities with rl.num_iterations > 1, taken once a
    # round): under FSDP held gathered through the rollout (rollouts.held_whole), the whole decoder in the storage dtype
    # beside its shards while it samples and runs its passes
    rollout_reference: bool = False
    # why the capability table refuses the recipe under FSDP / HSDP (capabilities.sharding_problems' first; None:
    # FSDP trains it), so that --fit proposes no FSDP, HSDP or offload for it (fit.shardable)
    unshardable: str | None = None
    # the same of the recipe without pipeline stages (sharding_problems(pp=1)): the FSDP and HSDP the pipeline is
    # compared with (pipeline.compared); a stage copies its own reference, where plain FSDP reads it again
    unshardable_unstaged: str | None = None
    # LoRA under sync_reference: the adapter's snapshot and the spare that holds the trained weights during the
    # reference's forward, each the trained weights once more (model/reference.AdapterReference)
    adapter_reference: bool = False
    # and run in RLOO's rollout (capabilities.rollout_adapter): under FSDP the snapshot whole and a whole spare too
    adapter_reference_whole: bool = False
    # rl.cast_lm_head_to_fp32: the LM head's weight held in fp32 whatever the storage dtype (a trained head's
    # gradient and optimizer state in fp32 with it)
    fp32_head: bool = False
    # distillation (distill:): the teacher's shape and storage dtype, a second frozen model on every GPU (memory/
    # teacher.py); None: no teacher
    teacher: object = None  # params.ModelShape
    teacher_dtype: Dtype = "float32"
    # online RL's learned rewards (rl.rewards of type reward_model): each a frozen model whole on every GPU
    # (memory/reward_models.py); () where there are none
    reward_models: tuple = ()  # params.RewardModel

    @property
    def world(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def compute_dtype(self) -> str:
        """The dtype the matmuls run in: train.mixed_precision's where set, else the weights' (model.dtype)."""
        return PRECISION_DTYPE.get(self.mixed_precision, self.dtype)

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the model: over every GPU (fsdp), or over the GPUs of a node with the nodes as replicas
        (hsdp: the memory of FSDP over one node)."""
        return self.strategy in ("fsdp", "hsdp")

    @property
    def shards(self) -> int:
        """Processes FSDP shards each parameter over: under FSDP x TP, the data-parallel ranks (each GPU's TP slice is
        sharded among the GPUs holding the same slice); under a pipeline, the GPUs of a stage (its parameters only)."""
        return {"fsdp": self.world // self.tp // self.pipeline_parallel,
                "hsdp": self.num_gpus // self.tp}.get(self.strategy, 1)

    @property
    def data_ranks(self) -> int:
        """Processes that read different batches: a tensor-parallel group reads one, and so does a sequence group and a
        pipeline (its first stage reads for it)."""
        return self.world // self.tp // self.sequence_parallel // self.pipeline_parallel

    @property
    def chunks(self) -> int:
        """(Virtual) pipeline stages a GPU runs: pipeline_chunks, or 2 interleaved and 1 otherwise."""
        return ParallelConfig.chunks_of(self.pipeline_schedule, self.pipeline_chunks)

    @property
    def kernel(self) -> str:
        """The attention that runs: 'auto' is llmtrain's varlen attention."""
        return "varlen" if self.attn_implementation in VARLEN_SETTINGS else self.attn_implementation

    @property
    def packed(self) -> bool:
        """A micro-batch is one padding-free row, as training decides it (batching.packs)."""
        from llmtrain.data.batching import packs

        return packs(packing=self.packing, micro_batch_tokens=self.micro_batch_tokens,
                     attn_implementation=self.attn_implementation)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch at most: the budget, or every example seq_len long (under sequence parallelism
        the group's row, which its GPUs share)."""
        return self.micro_batch_tokens or self.micro_batch * self.seq_len

    @property
    def gpu_tokens(self) -> int:
        """Tokens of one micro-batch that one GPU holds: all of them, or its ceil(1/N) share of the sequence
        group's row."""
        return -(-self.tokens // self.sequence_parallel)

    def but(self, **changes) -> TrainSpec:
        return replace(self, **changes)

    def validate(self) -> TrainSpec:
        problems = []
        for name in ("micro_batch", "grad_accum_steps", "num_gpus", "num_nodes", "lora_r", "loss_chunk_tokens",
                     "sequence_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 2:
            problems.append(f"micro_batch_tokens must be at least 2 (got {self.micro_batch_tokens})")
        if self.micro_batch_tokens is not None and self.micro_batch != 1:
            problems.append("give a micro-batch in examples (--micro-batch, train.micro_batch_size) or in tokens "
                            "(--micro-batch-tokens, train.micro_batch_tokens), not both")
        if self.seq_len < 2:
            problems.append(f"seq_len must be at least 2 (got {self.seq_len})")
        if self.gpu_memory_gib <= 0:
            problems.append(f"gpu memory must be positive (got {self.gpu_memory_gib} GiB)")
        if self.strategy == "single" and self.world > self.pipeline_parallel:  # (a pipeline: one GPU a stage)
            problems.append(f"strategy single runs one process, but {self.world} GPUs were given: use ddp or fsdp")
        if self.strategy == "ddp" and self.world < 2:
            problems.append("strategy ddp needs at least 2 GPUs (--num-gpus / --num-nodes)")
        if self.activation_offload and not self.gradient_checkpointing:
            problems.append("activation offload moves the checkpointed layers' inputs to the host: it needs "
                            "gradient checkpointing")
        if self.quantize and self.method != "lora":
            problems.append("a 4-bit base (quantize) trains LoRA adapters only: use method lora")
        if self.strategy == "hsdp" and (self.num_nodes < 2 or self.num_gpus < 2):
            problems.append("strategy hsdp replicates over nodes and shards over each node's GPUs: it needs at least "
                            "2 nodes (--num-nodes) of at least 2 GPUs (--num-gpus)")
        if self.cpu_offload and not self.sharded:
            problems.append("cpu offload is FSDP's (fsdp_offload_params): use strategy fsdp")
        if self.tp > 1:
            if not self.sharded or self.quantize or self.cpu_offload:
                problems.append("tensor parallelism (tp > 1) is trained as FSDP (or HSDP) x TP, a full fine-tune or "
                                "LoRA on a 16-bit base, without cpu offload: use strategy fsdp or hsdp, no --quantize")
            elif self.num_gpus % self.tp or self.shards < 2:
                problems.append(f"tp {self.tp} must divide the GPUs of a node ({self.num_gpus}) and leave at least 2 "
                                "FSDP shards")
        if self.sequence_parallel > 1:
            problems += self._sequence_problems()
        problems += self._pipeline_problems()
        if problems:
            raise LLMTrainError("cannot estimate this run: " + "; ".join(problems) + ".")
        return self

    def _pipeline_problems(self) -> list[str]:
        """The pipeline's schedule and chunks (what a pipeline itself needs: pipeline.pipeline_problems)."""
        v, problems = self.chunks, []
        if self.pipeline_parallel > 1 and self.kernel != "varlen":  # (capabilities.RULES, as a recipe is refused)
            problems.append("pipeline stages attend within each packed row's examples with llmtrain's varlen "
                            "attention (model.attn_implementation auto or varlen), not "
                            f"{self.attn_implementation}")
        if self.pipeline_schedule not in SCHEDULES:
            problems.append(f"pipeline schedule {self.pipeline_schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.pipeline_chunks is not None and self.pipeline_chunks < 1:
            problems.append(f"pipeline chunks must be at least 1 (got {self.pipeline_chunks})")
        elif self.pipeline_schedule == "interleaved_1f1b" and v < 2:
            problems.append("the interleaved schedule runs at least 2 stages a GPU (parallel.pipeline_chunks / "
                            "--pipeline-chunks 2 or more); with 1 use 1f1b")
        elif self.pipeline_schedule != "interleaved_1f1b" and v != 1:
            problems.append(f"{v} pipeline chunks (stages a GPU) need the interleaved schedule (--pipeline-schedule "
                            f"interleaved_1f1b); {self.pipeline_schedule} runs one stage a GPU")
        return problems

    def _sequence_problems(self) -> list[str]:
        """What the estimate refuses with sequence parallelism, besides the heads (capabilities.sequence_heads_problem:
        they need the model)."""
        n, problems = self.sequence_parallel, []
        if self.world % n:
            problems.append(f"sequence parallelism {n} (parallel.sequence_parallel) must divide the GPUs: {self.world} "
                            f"({self.num_gpus} a node x {self.num_nodes}) do not split into groups of {n}")
        if self.tp > 1:
            problems.append("sequence parallelism with tensor parallelism (tp > 1) is not modelled")
        if self.kernel != "varlen":
            problems.append(f"sequence parallelism runs llmtrain's varlen attention on the whole packed row "
                            f"(model.attn_implementation auto or varlen), not {self.attn_implementation}")
        return problems


def sequence_kv_heads(n: int, kv_heads: int) -> int:
    """K/V heads on each GPU's tokens as they enter the all-to-all of a sequence group of `n`: the model's when n
    divides them (each GPU gets kv_heads / n), else n (n a multiple of kv_heads: each head is repeated n / kv_heads
    times first, so that every GPU gets the K/V head its query heads read)."""
    return kv_heads if kv_heads % n == 0 else n


def rl_prompt_tokens(lengths, *, cap: int, batches=None, prompts: int = 1) -> tuple[int, int, str]:
    """An online-RL run's prompts for the estimate: (tokens a prompt, the longest prompt, what they are). `lengths`:
    the prompts' lengths in tokens, tokenised as training does (each at most `cap`, the longest prompt the trainer
    takes); `batches`: the micro-batches of example indices the run will sample (one rank's, each up to `prompts`
    prompts). With them, the heaviest micro-batch's prompt tokens over `prompts` (rounded up: its packed update is
    that many tokens a prompt) and the longest prompt any of them holds. Without: the data's PROMPT_QUANTILE for both;
    without data, `cap`."""
    if not lengths:
        return cap, cap, f"worst case: every prompt at its longest, data.max_seq_len - rl.max_completion_tokens ({cap})"
    clipped = [min(n, cap) for n in lengths]
    data = f"the data's prompts: mean {sum(clipped) / len(clipped):.0f} tokens, longest {max(clipped)}"
    if over := sum(n > cap for n in lengths):  # (audit 35: the clipped lengths had been said as the data's)
        data += (f" ({over:,} of them longer than the {cap} that data.max_seq_len leaves beside "
                 f"rl.max_completion_tokens, taken at {cap} here; finetune refuses them: prompt room, up to "
                 f"{max(lengths)} tokens)")
    if batches:
        heaviest = max(sum(clipped[i] for i in b) for b in batches)
        longest = max(clipped[i] for b in batches for i in b)
        per_prompt = -(-heaviest // prompts)
        runs = f"{len(batches):,} micro-batch{'es' * (len(batches) > 1)} of {prompts} prompt{'s' * (prompts > 1)}"
        return per_prompt, longest, (f"the run's {runs}: the heaviest {heaviest:,} prompt tokens ({per_prompt} a "
                                     f"prompt), the longest prompt {longest}; {data}")
    ordered = sorted(clipped)
    at = ordered[max(0, math.ceil(PROMPT_QUANTILE * len(ordered)) - 1)]
    return at, at, f"{data}; {PROMPT_QUANTILE:.0%} have at most {at} tokens"


def rl_batches(recipe: Recipe, lengths: list[int], *, data_ranks: int) -> list[list[int]]:
    """The micro-batches of prompts (example indices) one rank samples over the run `recipe` describes on
    `data_ranks` data-parallel ranks: its data plan, as finetune builds it (each rank's share of every global one)."""
    from llmtrain.data.checks import data_plan, total_steps

    plan = data_plan(recipe, lengths, world=data_ranks)
    steps = total_steps(recipe, lengths, world=data_ranks, plan=plan)
    return [share for batch in plan.global_batches_in(steps, recipe.train.grad_accum_steps) for share in batch
            if share]


def spec_from_recipe(recipe: Recipe, *, strategy: Strategy = "single", num_gpus: int = 1, num_nodes: int = 1,
                     prompt_lengths=None, **launch) -> TrainSpec:
    """The run a recipe describes, on the given GPUs (launch: cpu_offload, gpu_memory_gib). `prompt_lengths`: an
    online-RL recipe's prompt lengths in tokens, where its data was read (else its prompts are taken at their
    longest, data.max_seq_len - rl.max_completion_tokens: every sequence max_seq_len long)."""
    m, d, t, lora = recipe.model, recipe.data, recipe.train, recipe.lora
    evaluates = d.eval_split is not None  # with eval data the end of training is evaluated, eval_every_steps or not
    # A preference micro-batch of N pairs is 2N sequences (chosen and rejected, each up to max_seq_len). Its
    # reference forward (the disabled adapter) runs under no_grad and keeps nothing for backward, so the
    # training forward and backward of the 2N sequences stay the peak; a precomputed reference costs nothing.
    # An online-RL micro-batch of N prompts is N x num_generations sequences: sampled together with their KV cache,
    # then one packed forward and backward (its eval samples greedily: no loss pass).
    # A token budget bounds a micro-batch's tokens, whatever the sequences per example (micro_batch_size stays 1).
    # KTO: N sequences with backward; its KL sequences (another N) and the reference pass run under no_grad first
    # (no_grad_forwards), and a full fine-tune holds a frozen copy of the weights (frozen_reference). A reward model's
    # pairs are 2N sequences too (its score head reads one token each: less than an LM head's chunk)
    pairs = recipe.preference is not None or recipe.reward_model is not None
    per_example = 2 if pairs else recipe.rl.num_generations if recipe.rl is not None else 1
    # online RL's eval samples its prompts' completions (one greedy each, or rl.num_generations_eval) as a rollout
    eval_rows = (t.eval_rows * (recipe.rl.num_generations_eval or 1)
                 if evaluates and recipe.rl is not None else 0)
    evaluates = evaluates and recipe.rl is None
    rl, teacher = {}, {}
    if recipe.distill is not None:
        # The student samples one completion a prompt (a generation of 1), sequences taken at data.max_seq_len: a
        # prompt at its longest below it and max_completion_tokens; the teacher, read from its config.json
        from llmtrain.memory.params import load_model_shape

        most = min(recipe.distill.max_completion_tokens, d.max_seq_len - 1)
        cap = d.max_seq_len - most
        rl = dict(max_completion_tokens=most, prompt_tokens=cap, prompt_cap=cap, prompt_basis="every prompt at its "
                  f"longest, data.max_seq_len - distill.max_completion_tokens ({cap})", rl_micro_batch_tokens=None,
                  sampling=tuple(sampling_of(recipe.distill).items()),
                  reference_sampler=recipe.distill.sampler == "reference")
        dtype = PRECISION_DTYPE.get(t.mixed_precision, m.dtype) if m.dtype == "float32" else m.dtype
        teacher = dict(teacher=load_model_shape(recipe.distill.teacher, "distill.teacher"), teacher_dtype=dtype)
    if recipe.rl is not None:
        from llmtrain.memory.params import reward_models_of

        teacher = dict(reward_models=reward_models_of(recipe))  # the learned rewards' models, frozen as a teacher is
        most = recipe.rl.max_completion_tokens
        cap = max(1, d.max_seq_len - most)  # data.checks.check_prompt_room refuses a longer prompt
        prompt, _, basis = rl_prompt_tokens(prompt_lengths, cap=cap)  # the run's micro-batches, below, where known
        rl = dict(max_completion_tokens=most, prompt_tokens=prompt, prompt_cap=cap, prompt_basis=basis,
                  rl_micro_batch_tokens=recipe.rl.micro_batch_tokens, sampling=tuple(sampling_of(recipe.rl).items()),
                  reference_sampler=recipe.rl.sampler == "reference",
                  tool_rounds=bool(recipe.rl.tools or recipe.rl.environment))
    spec = TrainSpec(
        method="lora" if lora else "full",
        lora_r=lora.r if lora else _default(LoraConfig, "r"),
        lora_target_modules=_targets(lora.target_modules) if lora else "all-linear",
        lora_dropout=lora.dropout if lora and not t.disable_dropout else 0.0,  # (off: no mask, inputs shared)
        lora_dora=lora.dora if lora else False,
        lora_modules_to_save=tuple(lora.modules_to_save or ()) if lora else (),
        lora_target_parameters=tuple(lora.target_parameters or ()) if lora else (),
        dtype=m.dtype, quantize=m.quantize, mixed_precision=t.mixed_precision,
        attn_implementation=m.attn_implementation,
        gradient_checkpointing=m.gradient_checkpointing, random_init=m.random_init,
        activation_offload=m.activation_offload, tiled_mlp=m.tiled_mlp,
        micro_batch=1 if t.micro_batch_tokens else t.micro_batch_size * per_example,
        micro_batch_tokens=t.micro_batch_tokens,
        grad_accum_steps=t.grad_accum_steps, fsdp_accumulate=t.fsdp_accumulate,
        seq_len=rl["prompt_tokens"] + rl["max_completion_tokens"] if rl else d.max_seq_len, packing=d.packing,
        loss_chunk_tokens=t.loss_chunk_tokens, optimizer=t.optimizer,
        # evaluate() batches by the train budget unless eval_batch_size is set
        eval_micro_batch=t.eval_rows * per_example if evaluates else None,
        eval_micro_batch_tokens=t.eval_tokens if evaluates else None,
        strategy=strategy, num_gpus=num_gpus, num_nodes=num_nodes,
        sequence_parallel=recipe.parallel.sequence_parallel,
        num_generations=recipe.rl.num_generations if recipe.rl is not None else int(
            recipe.distill is not None and recipe.distill.lmbda > 0), per_example=per_example, **rl, **teacher,
        no_grad_forwards=recipe.kto is not None, frozen_reference=reference_copy(recipe),
        rollout_reference=reference_copy(recipe) and rollout_reference(recipe),
        unshardable=next(iter(sharding_problems(recipe)), None),
        unshardable_unstaged=next(iter(sharding_problems(recipe, pp=1)), None),
        adapter_reference=lora is not None and reference_sync(recipe) is not None,
        adapter_reference_whole=rollout_adapter(recipe),
        num_iterations=updates_per_window(recipe), **extra_forwards_of(recipe),
        rollout_forwards=rollout_logps(recipe),
        fp32_head=fp32_head(recipe),
        sampled_batches=t.grad_accum_steps if recipe.rl is not None and recipe.rl.generation_batch == "step" else 1,
        min_examples=2 if recipe.kto is not None and recipe.kto.loss_type == "kto" else 1,
        merged_copy=_merged_copy(recipe), eval_rows=eval_rows,
        **{**pipeline_keys(recipe), **launch},  # --pipeline-* options (in launch) win over the recipe's keys
    )
    if recipe.rl is not None and prompt_lengths and recipe.data.sources is None:  # the micro-batches of prompts
        # this layout's ranks will sample (a mixture's plan needs its rows' sources: the percentile, below)
        batches = rl_batches(recipe, list(prompt_lengths), data_ranks=spec.data_ranks)
        prompt, longest, basis = rl_prompt_tokens(prompt_lengths, cap=spec.prompt_cap, batches=batches,
                                                  prompts=t.micro_batch_size)
        # the update packs the sequences into one row (or pads each to the micro-batch's longest)
        spec = spec.but(prompt_tokens=prompt, prompt_longest=longest, prompt_basis=basis,
                        seq_len=(prompt if spec.packed else longest) + spec.max_completion_tokens)
    return spec


def rollout_logps(recipe: Recipe) -> bool:
    """Whether online RL's rollout takes the sampling policy's log-probabilities (a no-grad forward of the update's
    passes): for a round's later updates (rl.num_iterations > 1), rl.sampler_correction's ratios, and RLOO's KL with
    rl.beta > 0."""
    rl = recipe.rl
    return rl is not None and (rl.num_iterations > 1 or rl.sampler_correction is not None
                               or (rl.algorithm == "rloo" and bool(rl.beta)))


def extra_forwards_of(recipe: Recipe) -> dict:
    """The no-grad forwards of the trained model's shape a step runs over its sequences, beside its forward and
    backward (TrainSpec.extra_forwards, and what they are), as the objectives run them:
    - preference pairs: the reference (LoRA's adapter disabled, or a full fine-tune's frozen copy) before each
      micro-batch (preference.reference adapter, LoRA's auto, or copy); none where it is precomputed (one pass
      before training) or there is no reference;
    - KTO: the reference over the micro-batch (adapter disabled, or the frozen copy), and with loss_type kto its KL
      sequences (as many again) by the policy and by the reference: 3;
    - GRPO: with rl.beta > 0 the reference in every update's loss, or with rl.num_iterations N > 1 once a round in
      the rollout (1 / N a step; LoRA's moving reference stays in each update); with N > 1 or rl.sampler_correction
      the policy's log-probabilities once a round, 1 / N a step;
    - RLOO: the policy's log-probabilities once a round where beta > 0 or N > 1, and with beta > 0 the reference's
      (its KL goes into the reward), 1 / N a step each.
    A distillation teacher's and learned rewards' forwards are of other shapes (comms.no_grad_flops counts them)."""
    passes: list[tuple[float, str]] = []
    kind = reference_kind(recipe) if recipe.preference is not None else None
    if kind in ("adapter", "copy"):
        how = "the adapter disabled" if kind == "adapter" else "the frozen copy"
        passes.append((1.0, f"the reference's, {how}, each micro-batch"))
    elif recipe.kto is not None:
        passes.append((1.0, "the reference's over each micro-batch"))
        if recipe.kto.loss_type == "kto":
            passes.append((2.0, "the KL sequences' by the policy and the reference"))
    elif recipe.rl is not None:
        rl, n = recipe.rl, recipe.rl.num_iterations
        if rl.beta and rl.algorithm == "grpo":  # once a round where a round has more updates (not LoRA's moving one)
            passes.append((1.0 / n, "the reference's once a round (rl.beta)") if rollout_reference(recipe) else
                          (1.0, "the reference's in each update (rl.beta)"))
        if rollout_logps(recipe):
            passes.append((1.0 / n, "the policy's log-probabilities once a round"))
        if rl.beta and rl.algorithm == "rloo":
            passes.append((1.0 / n, "the reference's once a round (rl.beta)"))
    return dict(extra_forwards=sum(k for k, _ in passes),
                extra_forwards_what="; ".join(f"{k:.3g} x {what}" for k, what in passes))


def _merged_copy(recipe: Recipe) -> str:
    """rl.merged_copy (distill.merged_copy) where the fast sampler samples a LoRA policy, else "off"."""
    sampling = recipe.rl or recipe.distill
    if sampling is None or recipe.lora is None or sampling.sampler == "reference":
        return "off"
    return sampling.merged_copy


def pipeline_keys(recipe: Recipe) -> dict:
    """The recipe's parallel.pipeline_* keys."""
    parallel = recipe.parallel
    return dict(pipeline_parallel=parallel.pipeline_parallel, pipeline_schedule=parallel.pipeline_schedule,
                pipeline_chunks=parallel.pipeline_chunks)


@dataclass(frozen=True)
class Estimate:
    """Per-GPU memory of one training process. All sizes are bytes.

    per_gpu_peak_allocated_bytes is comparable with torch.cuda.max_memory_allocated(),
    per_gpu_peak_reserved_bytes with max_memory_reserved(), and per_gpu_peak_bytes (reserved plus the
    CUDA context and NCCL buffers, which PyTorch's allocator does not see) with what nvidia-smi shows
    and with the card's memory.
    """

    model: str
    spec: TrainSpec
    params_total: int
    params_trainable: int
    per_gpu_peak_allocated_bytes: int
    per_gpu_peak_reserved_bytes: int
    per_gpu_peak_bytes: int
    peak_phase: str
    breakdown: dict[str, int]  # components at the peak phase, overhead included; sums to per_gpu_peak_bytes
    phases: dict[str, int]  # allocated bytes at each phase of a step
    host_ram_bytes: int  # per node, while loading (plus offloaded state)
    phase_parts: dict[str, dict[str, int]] = field(default_factory=dict)  # components of every phase
    notes: tuple[str, ...] = field(default=())
    # online RL estimated at the data's prompt lengths: per_gpu_peak_bytes with every prompt at data.max_seq_len
    worst_case_bytes: int | None = None
    # long context (model.activation_offload, model.tiled_mlp): offload_host_bytes of layer inputs in pinned host
    # memory per process, offload_gpu_saved_bytes kept off the GPU by it, mlp_shard_tokens, and tiled_mlp_saved_bytes:
    # the peak without tiling minus the peak with it
    long_context: dict[str, int] = field(default_factory=dict)
    # pipeline parallelism: the stage this estimate is ({"stage": ...}), and once the worst is chosen every stage's
    # summary, the schedule and the bubble (memory/pipeline.py)
    pipeline: dict = field(default_factory=dict)

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.spec.gpu_memory_gib * GIB)

    @property
    def fits(self) -> bool:
        return self.per_gpu_peak_bytes <= self.gpu_memory_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_memory_bytes - self.per_gpu_peak_bytes

    def largest(self) -> dict[str, tuple[int, str]]:
        """Each component's largest size over the step's phases, and the phase it is reached in. The breakdown
        is one moment (the peak), where some parts are not alive at all: a full fine-tune peaks when the
        optimizer state and every gradient exist but no activation does; LoRA peaks in a layer's backward,
        before most adapter gradients exist."""
        out: dict[str, tuple[int, str]] = {}
        for phase, parts in self.phase_parts.items():
            for name, size in parts.items():
                if size > out.get(name, (0, ""))[0]:
                    out[name] = (size, phase)
        return out

    def to_dict(self) -> dict:
        spec = asdict(self.spec)
        spec["world_size"] = self.spec.world
        return {
            "model": self.model, "params_total": self.params_total, "params_trainable": self.params_trainable,
            "per_gpu_peak_bytes": self.per_gpu_peak_bytes,
            "per_gpu_peak_allocated_bytes": self.per_gpu_peak_allocated_bytes,
            "per_gpu_peak_reserved_bytes": self.per_gpu_peak_reserved_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes, "fits": self.fits, "peak_phase": self.peak_phase,
            "breakdown": dict(self.breakdown), "phases": dict(self.phases),
            "phase_parts": {k: dict(v) for k, v in self.phase_parts.items()},
            "largest": {k: {"bytes": n, "phase": ph} for k, (n, ph) in self.largest().items()},
            "host_ram_bytes": self.host_ram_bytes, "worst_case_per_gpu_peak_bytes": self.worst_case_bytes,
            "long_context": dict(self.long_context), "pipeline": self.pipeline or None,
            "spec": spec, "notes": list(self.notes),
        }
