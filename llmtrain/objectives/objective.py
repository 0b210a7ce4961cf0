"""The objective: what a batch is and what is minimised. The one seam between the data and the training loop.

The loop (train.py), its metering (meter.py), the checkpoints and evaluation (step.py) call only the four methods
of `Objective`, so a second objective (preference pairs) is a second class beside `CausalLM`, not a change to
any of them.

Normalisation, the contract every objective keeps: `loss(model, batch)` is the SUM of the loss over the
batch's loss units (`Counts.units`: trained tokens for causal-LM cross-entropy), and the step divides by the
units of the whole accumulation window on all processes. So any split of a window over micro-batches and
processes gives the same loss and the same gradient.

What an objective may add, each read with getattr where it is used (absent: nothing happens): `rollout(window, step)`
(online RL: the window's completions, sampled before the counts); `per_trained` (the step puts the window's loss units
per trained token in every batch, `units_per_trained`, for a term averaged over tokens: GRPO's entropy bonus);
`after_window(stats)` (called after each step with the window's statistics summed over every process: GRPO's
adaptive entropy control); `checkpointed` (objects with state_dict / load_state_dict saved with every checkpoint:
that controller); and under sequence parallelism `whole_sequences`, `slice_stats` and `eval_rows`
(parallel/sequence/shards.py).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from llmtrain.capabilities import reference_kind
from llmtrain.data.batching import Counts, collate, to_device, with_loss_positions
from llmtrain.model.loss import compute_loss, eval_counts
from llmtrain.model.reference import adapter_off
from llmtrain.objectives.rollouts import here


class Objective(Protocol):
    columns: tuple[str, ...]  # the dataset columns a batch is built from

    def collate(self, examples: list[dict]) -> tuple[dict, Counts]:
        """CPU tensors of one micro-batch and its counts (an idle rank's stand-in is collated as any other:
        batching.windows sets its weight to 0 and its counts to none)."""

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed loss of a batch already on the device (a 0-dim tensor that backpropagates), and a vector of
        summed statistics for the metrics line (detached; empty when there are none)."""

    def step_metrics(self, stats: list[float], units: float) -> dict[str, float]:
        """Named numbers for a step's metrics line, from its statistics summed over the window and processes."""

    def eval_sums(self, model, batch: dict, device) -> torch.Tensor:
        """Under no_grad: a float64 vector of sums over a CPU batch (moved to `device` here), added over every
        batch and process before `eval_metrics`."""

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """The eval line's numbers from the summed `eval_sums`."""


class CausalLM:
    """Supervised fine-tuning: the cross-entropy of every trained token (prompt masked, reply and its end of
    turn trained), computed from the hidden states without full logits (loss.compute_loss)."""

    columns = ("input_ids", "labels")
    example_sum = None  # sequence parallelism: per-example sums over the sequence group (parallel/sequence/shards.py)

    def __init__(self, *, pad_id: int, packing: bool, router_aux: bool = False):
        # router_aux: the loss carries a mixture of experts' load-balancing loss (model.router_aux_loss_coef), logged
        self.pad_id, self.packing, self.router_aux = pad_id, packing, router_aux

    def collate(self, examples: list[dict]) -> tuple[dict, Counts]:
        batch = with_loss_positions(collate(examples, pad_id=self.pad_id, packing=self.packing))
        trained = len(batch["loss_index"])
        return batch, Counts.of(examples, units=trained, trained=trained)

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        loss, aux = compute_loss(model, batch, return_aux=True)
        # the load-balancing loss times the trained tokens: its token-weighted mean over the step
        return loss, (aux * len(batch["loss_index"])).reshape(1) if self.router_aux else loss.new_zeros(0)

    def step_metrics(self, stats: list[float], units: float) -> dict[str, float]:
        # the load-balancing loss, the micro-batches' mean weighted by their trained tokens (without its coefficient)
        return {"aux_loss": stats[0] / max(units, 1.0)} if self.router_aux else {}

    def eval_sums(self, model, batch: dict, device) -> torch.Tensor:
        """[loss, trained tokens, argmax hits, teacher-forced matches, examples]. An example is a teacher-forced match
        when every trained token is the argmax while the reference reply is fed: not an answer accuracy (a reply
        generated from its own tokens can go elsewhere after a first wrong token); that is eval_answer_accuracy,
        from generated samples."""
        cpu_example = batch["loss_example"]
        # examples with a trained token, from the CPU (a sequence-parallel slice: the whole row's, `examples`)
        n = batch.get("examples", int(cpu_example.max()) + 1 if cpu_example.numel() else 0)
        batch = to_device(batch, device)
        loss, hits = compute_loss(model, batch, return_hits=True)
        return eval_counts(loss, hits, batch["loss_example"], n, example_sum=self.example_sum)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, tokens, correct, exact, examples = sums
        mean = loss / max(tokens, 1)
        return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)),
                "eval_token_accuracy": correct / max(tokens, 1), "eval_teacher_forced_match": exact / max(examples, 1)}


@dataclass(frozen=True)
class Rewards:
    """An RL run's reward functions (name, function, weight), built against the data's columns and tried on its
    first rows (rl_rewards); with what they are called with: the trainer_state, and the run's event loop for async
    functions (a client one opens at the start-up check still works at step 1)."""

    functions: list
    sources: tuple[str, str | None]  # (train, eval): the files the errors name
    state: object
    runner: object


def rl_rewards(recipe, train, *, total_steps: int | None, device=None, once=here) -> Rewards | None:
    """An RL run's rewards, checked before the model is built: a wrong answer_match column, a function that cannot be
    imported, asks for a column the data lack, raises or returns the wrong values, a reward model folder without a
    one-output score head stops the run without loading the model. A reward model is loaded on `device`. `once`:
    where the check calls the functions (collectives.on_main: the main process alone, its error handed to the
    others, so a function's side effects happen once a run; default: here). None for other objectives."""
    if recipe.rl is None:
        return None
    from llmtrain.data.prepare import sources
    from llmtrain.objectives.rewards import AsyncRunner, build_rewards, check_rewards, trainer_state

    functions = build_rewards(recipe.rl, answer_pattern=recipe.train.eval_answer_pattern, columns=train.column_names,
                              data=recipe.data, device=device)
    rewards = Rewards(functions=functions, sources=sources(recipe.data),
                      state=trainer_state(recipe, total_steps=total_steps), runner=AsyncRunner())
    rows = list(train.select(range(min(2, len(train)))))
    once(lambda: check_rewards(functions, rows, where=rewards.sources[0], state=rewards.state, runner=rewards.runner))
    return rewards


def objective_for(recipe, *, pad_id: int, model=None, tokenizer=None, train=None, world: int = 1,
                  total_steps: int | None = None, rewards: Rewards | None = None, gather=None,
                  reduce=None, teacher=None, reference=None, user_code=None, stages=None) -> Objective:
    """The recipe's objective: GRPO or RLOO on prompts (rl:), distillation from a teacher (distill:), a preference loss
    on pairs (preference:), a reward model's loss on pairs (reward_model:), KTO on labelled completions (kto:), else
    causal-LM
    cross-entropy (supervised fine-tuning). `model`: the unwrapped model, whose disabled adapter is the reference
    of a LoRA preference run (and which samples an RL run's completions); `train`: the tokenised train set (RL: its
    columns go to the reward functions); `rewards`: rl_rewards' (None: checked here); `gather`: every process's list
    on every process (collectives.gathered; None: one process), for what reward functions log; `reduce`: a device
    tensor summed over every process (collectives.device_sum; None: one process), for KTO's KL estimate; `teacher`:
    distillation's teacher as the loop built it (phases.build_teacher: sharded under FSDP; None: loaded here, whole, on
    the model's device); `reference`: the loop's phases.build_reference (model/reference.py: a full fine-tune's frozen
    copy for KTO, preference.reference copy and online RL with rl.beta > 0, or LoRA's moving adapter under
    sync_reference; None: LoRA's adapter disabled); `user_code`:
    where RL's reward functions, tools and environment run (collectives.on_sampling_group_first; None: here);
    `stages`: pipeline stages (parallel/pipeline/schedule.Pipeline), through which online RL samples."""
    from llmtrain.data.batching import packs_rows

    if recipe.rl is not None:
        from llmtrain.data.chat import read_template
        from llmtrain.objectives.grpo import GRPO
        from llmtrain.objectives.rloo import RLOO

        rewards = rewards if rewards is not None else rl_rewards(recipe, train, total_steps=total_steps)
        online = RLOO if recipe.rl.algorithm == "rloo" else GRPO  # RLOO: GRPO's rollout, its own advantage and loss
        rl = online(recipe.rl, tokenizer=tokenizer, pad_id=pad_id, packing=packs_rows(recipe),
                    seed=recipe.train.seed, rewards=rewards.functions, model=model, columns=train.column_names,
                    stop_ids=stop_ids(recipe, model, tokenizer), world=world, sources=rewards.sources,
                    state=rewards.state, runner=rewards.runner, gather=gather,
                    template=read_template(recipe.data, tokenizer), render=prompt_renderer(recipe, tokenizer),
                    user_code=user_code, reference=reference, stages=stages)
        if stages is not None and online is GRPO:  # the last stage's loss: the run's entropy bonus, and the
            # quantile of rl.top_entropy_quantile over the pipelines' last stages
            from llmtrain.parallel.collectives import gathered_in

            stages.head_loss.entropy = rl.entropy
            if stages.group.replicas > 1:
                stages.head_loss.gather_tokens = partial(gathered_in, stages.group.data_group)
        return rl

    if recipe.distill is not None:
        from llmtrain.model.teacher import load_teacher
        from llmtrain.objectives.distill import Distill

        if teacher is None and stages is None:  # (on stages the last stage's processes alone hold it: build_teacher)
            teacher = load_teacher(recipe, tokenizer, device=next(model.parameters()).device)
        distill = Distill(recipe.distill, teacher=teacher, model=model, pad_id=pad_id, packing=packs_rows(recipe),
                          seed=recipe.train.seed, stop_ids=stop_ids(recipe, model, tokenizer), world=world,
                          stages=stages)
        if stages is not None:  # the last stage's loss runs the objective's teacher (distill.StageDistill)
            stages.head_loss.objective = distill
        return distill
    if recipe.kto is not None:
        from llmtrain.objectives.kto import KTO

        return KTO(recipe.kto, pad_id=pad_id, packing=packs_rows(recipe), max_seq_len=recipe.data.max_seq_len,
                   model=model, reference=reference, reduce=reduce, router_aux=recipe.model.router_aux_loss_coef)
    if recipe.reward_model is not None:
        from llmtrain.model.score import classifier
        from llmtrain.objectives.reward_model import RewardModel

        # TRL's RewardTrainer: the model's pad token is the tokenizer's (else EOS), so that final/ scores a padded
        # batch at the token the training read; the tokenizer saved beside it gets it too (a LoRA final/ keeps no
        # model config: a loader sets the pad from the tokenizer, and a pad-less one, Llama 3's or Mistral's, could
        # not pad at all)
        classifier(model).config.get_text_config().pad_token_id = pad_id
        if tokenizer is not None and tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_id)
        return RewardModel(recipe.reward_model, pad_id=pad_id, score_pad_id=pad_id, packing=packs_rows(recipe),
                           margin="margin" in train.column_names)
    if recipe.preference is not None:
        from llmtrain.objectives.preference import Preference

        return Preference(recipe.preference, pad_id=pad_id, packing=packs_rows(recipe),
                          reference=reference_kind(recipe), model=model, router_aux=recipe.model.router_aux_loss_coef,
                          copy=reference)
    return CausalLM(pad_id=pad_id, packing=packs_rows(recipe),
                    router_aux=recipe.model.router_aux_loss_coef is not None)


def prompt_renderer(recipe, tokenizer):
    """render(prompt, row) -> its tokens as data preparation renders an RL prompt (the chat template, the system
    prompt, the tools), for a prompt an rl.environment's reset added to; one that leaves no room for the completion is
    refused, naming its row."""
    from llmtrain.data.chat import read_template
    from llmtrain.data.formats import encode_prompt
    from llmtrain.data.tools import prompt_tools
    from llmtrain.errors import LLMTrainError

    data, template, tools = recipe.data, read_template(recipe.data, tokenizer), prompt_tools(recipe)

    def render(prompt, row: int) -> list[int]:
        ids = encode_prompt({data.fields.get("prompt", "prompt"): prompt}, tokenizer, data, template=template,
                            tools=tools)["input_ids"]
        if len(ids) + recipe.rl.max_completion_tokens > data.max_seq_len:
            raise LLMTrainError(f"row {row + 1}: rl.environment's reset made the prompt {len(ids)} tokens, which with "
                                f"rl.max_completion_tokens={recipe.rl.max_completion_tokens} passes data.max_seq_len="
                                f"{data.max_seq_len}. Raise data.max_seq_len, or return a shorter observation.")
        return ids

    return render


def stops_for(lm, tokenizer, end_of_turn: str | None = None):
    """Where a completion of `lm` ends (generate.Stops): its end tokens, EOS, and the template's end of turn, as one
    token or as the several the tokenizer splits it into (chat.turn_tokens)."""
    from llmtrain.data.chat import turn_tokens
    from llmtrain.model.generate import Stops, stop_tokens

    sequences = turn_tokens(tokenizer, end_of_turn)
    return Stops(stop_tokens(lm, tokenizer, end_of_turn), sequences, end_of_turn.strip() if sequences else "")


def run_end_of_turn(recipe, tokenizer) -> str | None:
    """The chat template's end of turn where a run's rows may be chats (data.chat_template, or a tokenizer with a
    template); None where there is none, or the template cannot render a reply (said: the completions then run on
    past a turn's end to EOS)."""
    from llmtrain.data.chat import end_of_turn, read_template

    if recipe.data.chat_template is False and tokenizer.chat_template is None:
        return None
    try:
        return end_of_turn(tokenizer, read_template(recipe.data, tokenizer)) or None
    except Exception as e:  # a template that cannot render a reply: stop at EOS and the configured ends only, said
        warnings.warn(f"the chat template could not render a two-message chat to find its end of turn "
                      f"({type(e).__name__}: {e}): sampled completions stop at the model's end-of-sequence token "
                      "(and its generation config's) only")
        return None


def stop_ids(recipe, model, tokenizer):
    """Where a sampled completion ends (online RL, distillation, eval samples): `stops_for` the model, with the chat
    template's end of turn where the rows are chats."""
    from llmtrain.model.loss import causal_lm

    return stops_for(causal_lm(model), tokenizer, run_end_of_turn(recipe, tokenizer))


def end_of_turn_ids(recipe, tokenizer) -> list[int]:
    """The template's end of turn where it is one token (`<|im_end|>`, `<|eot_id|>`): the id a model's
    generation_config.json must list among its eos_token_id for transformers' generate, pipelines and servers to
    stop where the run trained replies to end (a base model's lists only its EOS). [] where it is EOS already, text
    of several tokens (a stop string there: docs/data.md), or there is none."""
    turn = (run_end_of_turn(recipe, tokenizer) or "").strip()
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"] if turn else []
    return ids if len(ids) == 1 else []


def head_loss_for(recipe, *, model=None, reduce=None):
    """The objective's own loss on the last pipeline stage (parallel/pipeline/schedule.py): a reward model's score
    head and pairs' loss, preference pairs' log-probabilities and loss, KTO's (its reference `model` with the adapter
    disabled, its KL estimate summed over the processes by `reduce`: collectives.device_sum), GRPO's and RLOO's on
    their rollout's passes, distillation's divergence to the last stage's teacher; None: the LM head's cross-entropy,
    and for any run without stages."""
    if recipe.parallel.pipeline_parallel == 1:
        return None
    if recipe.kto is not None:  # (a full fine-tune's frozen copy: loop/phases.build_reference makes it `follow`)
        from llmtrain.objectives.kto import StageKTO

        return StageKTO(recipe.kto, adapter_off=partial(adapter_off, model) if recipe.lora is not None else None,
                        reduce=reduce)
    if recipe.reward_model is not None:
        from llmtrain.objectives.reward_model import StageScores

        return StageScores(recipe.reward_model)
    if recipe.preference is not None:
        from llmtrain.objectives.preference import StagePairs

        return StagePairs(recipe.preference, reference=reference_kind(recipe),
                          adapter_off=partial(adapter_off, model) if recipe.lora is not None else None)
    if recipe.distill is not None:
        from llmtrain.objectives.distill import StageDistill

        return StageDistill()
    if recipe.rl is not None:
        from llmtrain.objectives.grpo import ROLLOUT_STATS, StageGRPO
        from llmtrain.objectives.rloo import RLOO, StageRLOO

        rollout = len(ROLLOUT_STATS) + 2 * len(recipe.rl.rewards)
        if recipe.rl.algorithm == "rloo":
            return StageRLOO(recipe.rl, rollout_stats=rollout + len(RLOO.advantage_stats))
        return StageGRPO(recipe.rl, rollout_stats=rollout,
                         adapter_off=partial(adapter_off, model) if recipe.lora is not None else None)
    return None
