"""Online RL (GRPO) through the training loop: prompts in, completions sampled, scored, trained; what is logged
(TRL's names, rollouts.jsonl); a run killed like kill -9 resumes to the same completions, losses and weights; two
DDP processes equal one; bad rows and bad reward functions are refused before anything is written.

The tiny model is random-init, so a `format` reward (the completion holds a vowel) gives groups whose rewards
differ, and the update is not zero; answer_match (against the data's completion column) rides along.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ENV,
    REPO,
    cli,
    invoke,
    launch_finetune,
    load_weights,
    losses,
    max_abs_diff,
    records,
    run_train,
    write_recipe,
)

CPU_DDP = REPO / "accelerate_configs" / "cpu_ddp.yaml"
CPU_FSDP = REPO / "accelerate_configs" / "cpu_fsdp.yaml"
G = 4  # completions per prompt


pytestmark = pytest.mark.long(190)  # tests/conftest.py


def grpo_recipe(tiny: Path, tmp: Path, **sections) -> Path:
    rl = {"num_generations": G, "max_completion_tokens": 8, "temperature": 1.0,
          "rewards": [{"type": "format", "pattern": "[aeiou]"}, {"type": "answer_match", "column": "completion",
                                                                   "weight": 2.0}]}
    data = {"format": "prompt", "max_seq_len": 32, "eval_split": str(tiny / "data" / "eval.jsonl"),
            "eval_max_examples": 8, **sections.pop("data", {})}
    return write_recipe(tiny, tmp, data=data,
                        rl={**rl, **sections.pop("rl", {})},
                        train={"max_steps": 4, "micro_batch_size": 4, "lr": 1e-3, "eval_every_steps": 4,
                               "eval_samples": 2, "eval_max_new_tokens": 8, **sections.pop("train", {})},
                        checkpoint={"every_steps": 2, "keep_last": 3, **sections.pop("checkpoint", {})}, **sections)


def rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory):
    """4 steps of 4 prompts x 4 completions, in this process: (recipe, run folder, summary)."""
    tmp = tmp_path_factory.mktemp("grpo")
    recipe = grpo_recipe(tiny_assets, tmp)
    summary = run_train(recipe, f"output_dir={tmp / 'straight'}")
    return recipe, tmp / "straight", summary


def test_a_step_logs_trls_names_and_every_completion(straight, tiny_assets):
    from transformers import AutoTokenizer

    _, run, summary = straight
    lines = records(run)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    for name in ("reward", "reward_std", "rewards/format/mean", "rewards/answer_match/mean", "frac_reward_zero_std",
                 "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean",
                 "generation_tokens_per_s", "policy_tokens_per_s", "entropy"):
        assert all(name in r for r in lines), name
    assert all(0 < r["entropy"] < math.log(104) for r in lines)  # in nats: below a uniform one over the 104 tokens
    assert "kl" not in lines[0]  # beta 0: no reference, no kl

    rolled = rollouts(run)
    assert len(rolled) == 4 * 4 * G  # steps x prompts x completions
    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    eval_rows = {json.loads(r)["prompt"] for r in (tiny_assets / "data" / "eval.jsonl").read_text().splitlines()}
    for step, line in enumerate(lines, start=1):
        mine = [r for r in rolled if r["step"] == step]
        assert len(mine) == 4 * G
        rewards = torch.tensor([r["reward"] for r in mine], dtype=torch.float64)
        # the metrics line is the mean of the step's completions, the reward their weighted sum
        assert line["reward"] == pytest.approx(float(rewards.mean()), abs=1e-6)
        assert line["reward_std"] == pytest.approx(float(rewards.std()), abs=1e-5)  # TRL's: over the step
        assert line["rewards/format/mean"] == pytest.approx(sum(r["format"] for r in mine) / len(mine), abs=1e-6)
        assert all(r["reward"] == pytest.approx(r["format"] + 2.0 * r["answer_match"]) for r in mine)
        assert line["completions/mean_length"] == pytest.approx(sum(len(r["completion_ids"]) for r in mine)
                                                                / len(mine))
        cut = sum(r["completion_ids"][-1:] != [tok.eos_token_id] for r in mine)  # ended by max_completion_tokens
        assert line["completions/clipped_ratio"] == pytest.approx(cut / len(mine)), step  # (had read PPO's clip: 0)
        for k in range(0, len(mine), G):  # a group: its prompt's G completions, advantages as group_advantages
            group = mine[k:k + G]
            assert len({r["row"] for r in group}) == 1 and [r["generation"] for r in group] == list(range(G))
            r = torch.tensor([x["reward"] for x in group], dtype=torch.float64)
            expected = (r - r.mean()) / (r.std() + 1e-4)
            assert [x["advantage"] for x in group] == pytest.approx(expected.tolist(), abs=1e-5)
        for r in mine:
            assert r["completion"] == tok.decode(r["completion_ids"], skip_special_tokens=True)
            assert r["prompt"].endswith(tok.decode(r["prompt_ids"][-3:]))
            assert len(r["completion_ids"]) <= 8 and r["prompt"] not in eval_rows  # train prompts only
    assert sum(line["reward_std"] > 0 for line in lines) >= 2  # groups that teach something
    assert any(0 < line["completions/clipped_ratio"] < 1 for line in lines)
    assert any(abs(line["loss"]) > 0 for line in lines)

    evals = records(run, "eval")
    assert [e["step"] for e in evals] == [0, 4]  # the starting policy first, then the end
    assert {"eval_reward", "eval_rewards/format/mean", "eval_answer_accuracy"} <= set(evals[0])
    assert summary["steps"] == 4
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    eval_file = [json.loads(x) for x in (tiny_assets / "data" / "eval.jsonl").read_text().splitlines()]
    assert {s["expected"] for s in samples} <= {r["completion"] for r in eval_file}  # the answer column, as text
    # why the train reward (sampled) sits below the eval's (greedy), said in the run's log
    assert ("the train reward is of 4 completions a prompt sampled at rl.temperature=1; eval_reward and "
            "eval_answer_accuracy are of one greedy completion of each of the 8 eval prompts"
            in (run / "train.log").read_text().replace("\n", " "))


def test_the_fast_sampler_trains_what_the_reference_loop_trains(straight, tmp_path):
    """rl.sampler graph (the default, the run above: static's step, eager on a CPU) against reference: the same completions, rewards and
    advantages in rollouts.jsonl, the same losses and eval rewards, the same weights."""
    recipe, fast, _ = straight
    assert "sampler" not in recipe.read_text()  # the straight run samples with the default
    reference = tmp_path / "reference"
    run_train(recipe, f"output_dir={reference}", "rl.sampler=reference")
    assert "(rl.sampler=reference)" in (reference / "train.log").read_text()  # the run's header says which
    assert "(rl.sampler=graph: static off CUDA)" in (fast / "train.log").read_text()
    assert rollouts(fast) == rollouts(reference)
    assert losses(fast) == losses(reference)
    assert [e["eval_reward"] for e in records(fast, "eval")] == [e["eval_reward"] for e in records(reference, "eval")]
    assert max_abs_diff(load_weights(fast / "final"), load_weights(reference / "final")) == 0.0
    generation_s = [r["generation_s"] for r in records(fast)]
    assert len(generation_s) == 4 and all(s > 0 for s in generation_s)


def test_a_token_budget_splits_the_update_into_passes_with_the_same_losses_and_weights(straight, tmp_path,
                                                                                       monkeypatch):
    """rl.micro_batch_tokens=32 (data.max_seq_len): each micro-batch's 16 sequences go through the forward and
    backward in passes of at most 32 tokens, and the run is the unbudgeted one's: the same completions, losses,
    gradient norms and weights (to float rounding: the gradient is summed in another order)."""
    from llmtrain.objectives.grpo import GRPO

    recipe, one, _ = straight
    passes = []
    loss = GRPO.loss
    monkeypatch.setattr(GRPO, "loss", lambda self, model, batch: passes.append(batch["input_ids"].numel())
                        or loss(self, model, batch))
    budget = tmp_path / "budget"
    run_train(recipe, f"output_dir={budget}", "rl.micro_batch_tokens=32")
    assert len(passes) >= 4 * 4 and max(passes) <= 32  # 4 steps of several passes each, none over the budget
    assert rollouts(budget) == rollouts(one)
    assert losses(budget) == pytest.approx(losses(one), abs=1e-6)
    assert [r["grad_norm"] for r in records(budget)] == pytest.approx([r["grad_norm"] for r in records(one)],
                                                                      rel=1e-5)
    # Adam divides by the gradient's running scale, so rounding differences of its tiny entries show in the weights
    # as they do between 1 and 2 processes (test_two_ddp_processes_...)
    assert max_abs_diff(load_weights(budget / "final"), load_weights(one / "final")) < 1e-5
    from llmtrain.config import load_recipe
    from llmtrain.errors import RecipeError

    with pytest.raises(RecipeError, match="rl.micro_batch_tokens=16 is below data.max_seq_len=32"):
        load_recipe(recipe, ["rl.micro_batch_tokens=16"])


# Finished rows leave the decode batch at its looks at the end-of-turn flags (every 16 tokens), which these 8-token
# completions never reach: the runs below look every 2 tokens and drop rows as soon as one ends, in this process
# (monkeypatched) and in the launched ones (a sitecustomize module sets the same in every Python process).
COMPACTING = """import os
import llmtrain.model.fast_sample as f
f.CHECK_EVERY, f.COMPACT_AT = 2, 0.99
compact = f._Decode.compact
def counted(self, live, filled):  # each compaction, a line in the file the test reads
    with open(os.environ["COMPACTIONS"], "a") as out:
        out.write(f"{len(self.rows)} {live.numel()}\\n")
    return compact(self, live, filled)
f._Decode.compact = counted
"""


@pytest.fixture(scope="module")
def compacting(tiny_assets, tmp_path_factory):
    """A LoRA policy on a merged copy (rl.merged_copy=rollout; fp32: exact to ~1e-7), 4 steps in this process, rows
    dropped at every look: (recipe, run folder, rows dropped over its rollouts, env for launched processes that do
    the same)."""
    from llmtrain.model import fast_sample

    tmp = tmp_path_factory.mktemp("compacting")
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(COMPACTING)
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp / "site"), ENV.get("PYTHONPATH")])),
           "COMPACTIONS": str(tmp / "compactions.txt")}
    dropped = []
    compact = fast_sample._Decode.compact
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_sample, "CHECK_EVERY", 2)
        mp.setattr(fast_sample, "COMPACT_AT", 0.99)
        mp.setattr(fast_sample._Decode, "compact", lambda self, live, filled: dropped.append(
            len(self.rows) - live.numel()) or compact(self, live, filled))
        recipe = grpo_recipe(tiny_assets, tmp, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                             rl={"merged_copy": "rollout"})
        run_train(recipe, f"output_dir={tmp / 'one'}")
    return recipe, tmp / "one", sum(dropped), env


ADAPTER = "adapter_model.safetensors"


@pytest.mark.slow
def test_lora_samples_on_a_merged_copy_with_finished_rows_dropped_what_the_reference_loop_samples(compacting,
                                                                                                  tmp_path):
    """Each rollout on a merged generation copy (fp32), finished rows leaving the batch: the reference loop over the
    unmerged adapters draws the same completions (fp32: the two paths round apart by ~1e-7, test_fast_sample
    measures it), so the losses and the final adapters are the same; the trained weights were never merged in
    place."""
    recipe, one, dropped, _ = compacting
    run_train(recipe, f"output_dir={tmp_path / 'reference'}", "rl.sampler=reference", "rl.merged_copy=off")
    assert "(rl.sampler=graph: static off CUDA, LoRA on a merged copy built each rollout)" in (
        one / "train.log").read_text()
    assert dropped > 0  # rows left the batch
    assert rollouts(one) == rollouts(tmp_path / "reference")
    assert losses(one) == losses(tmp_path / "reference")
    fast, reference = (load_weights(run / "final" / ADAPTER) for run in (one, tmp_path / "reference"))
    assert max_abs_diff(fast, reference) == 0.0 and any(v.abs().max() > 0 for k, v in fast.items() if "lora_B" in k)


@pytest.mark.slow
@pytest.mark.extended  # main tier: test_fast_sample's rows dropped in each micro-batch alone (what a rank samples),
# test_two_ddp_processes_sample_and_train_what_one_does (rows kept), and the in-process run against the reference loop
@pytest.mark.parametrize("config", [CPU_DDP, CPU_FSDP], ids=["ddp", "fsdp"])
def test_two_processes_dropping_rows_on_a_merged_copy_sample_and_train_what_one_does(compacting, tmp_path,
                                                                                     free_port, config):
    """Each rank samples its 2 prompts' completions (a batch of 8 rows, compacted at its own times): the same
    completions as the one process's batches of 16, the same losses, the same adapters. Under FSDP each rank
    builds the copy from the layers the rollout gathers."""
    recipe, one, _, env = compacting
    two = tmp_path / "two"
    launch_finetune(config, 2, free_port, recipe, f"output_dir={two}", "train.micro_batch_size=2",
                    env={**env, "COMPACTIONS": str(tmp_path / "compactions.txt")})
    assert len((tmp_path / "compactions.txt").read_text().splitlines()) > 1  # rows left both ranks' batches
    assert [(r["step"], r["row"], r["completion_ids"]) for r in rollouts(two)] == [
        (r["step"], r["row"], r["completion_ids"]) for r in rollouts(one)]
    assert losses(two) == pytest.approx(losses(one), abs=1e-6)
    assert max_abs_diff(load_weights(two / "final" / ADAPTER), load_weights(one / "final" / ADAPTER)) < 1e-5


@pytest.mark.slow
@pytest.mark.extended  # main tier: the two processes above, and test_killed_mid_run_resumes_... (rows kept)
def test_a_run_dropping_rows_on_a_merged_copy_killed_mid_run_resumes_to_the_same_completions(compacting, tmp_path):
    recipe, one, _, env = compacting
    killed_and_resumed(recipe, one, tmp_path / "cut", env={**env, "COMPACTIONS": str(tmp_path / "compactions.txt")},
                       weights=ADAPTER)
    assert (tmp_path / "compactions.txt").read_text()  # rows left the batches, before the kill and after


def test_lora_with_beta_takes_the_disabled_adapter_as_reference(tiny_assets, tmp_path):
    """beta > 0 with LoRA: the reference is the same model with its adapter off, so the KL starts at 0 (lora_B is
    zero at init) and grows once the adapter has moved; it is logged as TRL's `kl`."""
    recipe = grpo_recipe(tiny_assets, tmp_path, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                         rl={"beta": 0.1}, train={"max_steps": 3, "lr": 5e-2})
    run_train(recipe, f"output_dir={tmp_path / 'run'}")
    kl = [r["kl"] for r in records(tmp_path / "run")]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 1e-6 and all(k >= 0 for k in kl)


def test_a_lora_run_whose_rewards_have_not_varied_yet_checkpoints_and_goes_on(tiny_assets, tmp_path):
    """A reward that no completion has earned yet (every group's rewards equal, every advantage 0): LoRA's B
    matrices are still 0 at the first checkpoint, which is saved as it is (the save had been refused as broken,
    "every LoRA B matrix is zero", and the run had stopped with no checkpoint; audit 12), and the run goes on."""
    recipe = grpo_recipe(tiny_assets, tmp_path, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                         rl={"rewards": [{"type": "format", "pattern": "^never this$"}]},
                         data={"eval_split": None}, train={"max_steps": 4, "eval_every_steps": None})
    summary = run_train(recipe, f"output_dir={tmp_path / 'run'}")
    assert summary["steps"] == 4 and all(r["frac_reward_zero_std"] == 1.0 for r in records(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (ckpt / "train_state.json").is_file()
    assert all(not t.any() for k, t in load_weights(ckpt).items() if "lora_B" in k)  # nothing learned yet


def test_conversational_prompts_render_the_generation_prompt_and_rewards_get_messages(tiny_assets, tmp_path,
                                                                                          monkeypatch):
    from transformers import AutoTokenizer

    data = tmp_path / "chats.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"reverse {w} ="}], "completion": " " + w[::-1]}
            for w in ("abc", "dog", "tree", "stone")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "chat_rewards.py").write_text(
        "def as_messages(prompts, completions, **kwargs):\n"
        "    assert all(p[0]['role'] == 'user' for p in prompts)\n"
        "    return [float(c[0]['role'] == 'assistant' and len(c[0]['content']) % 2) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, data={"path": str(data), "cache_dir": str(tmp_path / "cache")},
                         rl={"rewards": [{"type": "function", "function": "chat_rewards:as_messages"}]},
                         train={"max_steps": 1})
    run_train(recipe, f"output_dir={tmp_path / 'run'}", "data.eval_split=null", "data.eval_max_examples=null",
              "train.eval_every_steps=null", "train.eval_samples=0")
    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    rendered = {tuple(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                              return_dict=False)) for r in rows}
    rolled = rollouts(tmp_path / "run")
    assert {tuple(r["prompt_ids"]) for r in rolled} == rendered  # ends with <|ASSISTANT|>, as at inference
    assert all(r["as_messages"] == float(len(r["completion"]) % 2) for r in rolled)


def test_the_update_moves_the_weights_toward_the_rewarded_completions(straight, tiny_assets):
    _, run, _ = straight
    before, after = load_weights(tiny_assets / "model"), load_weights(run / "final")
    assert max_abs_diff(before, after) > 1e-4


KILL_AT_STEP_3 = """
import os, sys
import llmtrain.loop.step as step
real = step.train_step
def dying(*args, **kwargs):  # mid step 3, after the step-2 checkpoint: die as kill -9 would (no clean-up at all)
    if kwargs["step"] == 2:
        os._exit(137)
    return real(*args, **kwargs)
import llmtrain.loop.train as train
train.train_step = dying
sys.argv = ["llmtrain", *sys.argv[1:]]
from llmtrain.cli import main
main()
"""


@pytest.mark.slow
def test_killed_mid_run_resumes_to_the_same_completions_losses_and_weights(straight, tmp_path):
    recipe, full, _ = straight
    killed_and_resumed(recipe, full, tmp_path / "cut")


def killed_and_resumed(recipe: Path, full: Path, cut: Path, *, env: dict | None = None,
                       weights: str = "model.safetensors") -> None:
    """The run of `recipe` killed like kill -9 mid step 3 into `cut`, resumed: `full`'s completions, losses and
    weights (tests/test_rloo.py runs it for RLOO)."""
    killed = subprocess.run([sys.executable, "-c", KILL_AT_STEP_3, "finetune", str(recipe), f"output_dir={cut}"],
                            env=env or ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert {r["step"] for r in rollouts(cut)} == {1, 2}
    proc = cli("finetune", str(cut / "recipe.yaml"), "--resume", "auto", env=env or ENV)
    assert "at step 2" in proc.stdout
    assert rollouts(cut) == rollouts(full)  # the same completions, rewards and advantages, line for line
    assert losses(cut) == pytest.approx(losses(full), abs=1e-6)
    assert max_abs_diff(load_weights(cut / "final" / weights), load_weights(full / "final" / weights)) == 0.0


def test_masked_truncated_completions_train_only_the_completions_that_ended(straight, tmp_path):
    """rl.mask_truncated_completions: of step 1's completions (those of the plain run: the same seeds), the ones
    that reached max_completion_tokens without EOS train no token (trained_tokens counts the others'), while their
    rewards, advantages and lengths are logged as before; the loss differs from the plain run's."""
    recipe, plain, _ = straight
    run = tmp_path / "masked"
    run_train(recipe, f"output_dir={run}", "train.max_steps=1", "rl.mask_truncated_completions=true")
    eos = 2  # the tiny tokenizer's
    first = [r for r in rollouts(plain) if r["step"] == 1]
    assert rollouts(run) == first  # the same completions, rewards and advantages
    ended = [r for r in first if r["completion_ids"][-1] == eos]
    assert 0 < len(ended) < len(first)  # some end, some are clipped
    line, before = records(run)[0], records(plain)[0]
    assert line["trained_tokens"] == sum(len(r["completion_ids"]) for r in ended)
    assert before["trained_tokens"] == sum(len(r["completion_ids"]) for r in first)
    assert line["completions/mean_length"] == before["completions/mean_length"]
    assert line["loss"] != pytest.approx(before["loss"], abs=1e-6)


def test_top_entropy_quantile_trains_the_high_entropy_tokens_alone(straight, tmp_path):
    """rl.top_entropy_quantile 0.2: step 1 samples and scores what the plain run does (the same seeds) and logs the
    same entropy (over every completion token), but only its highest-entropy fifth trains a policy term: another
    loss and other weights."""
    recipe, plain, _ = straight
    run = tmp_path / "top"
    run_train(recipe, f"output_dir={run}", "train.max_steps=1", "rl.top_entropy_quantile=0.2")
    assert rollouts(run) == [r for r in rollouts(plain) if r["step"] == 1]
    line, before = records(run)[0], records(plain)[0]
    assert line["entropy"] == pytest.approx(before["entropy"], abs=1e-6)
    assert line["trained_tokens"] == before["trained_tokens"]
    assert line["loss"] != pytest.approx(before["loss"], abs=1e-4)


@pytest.mark.slow
def test_two_ddp_processes_pool_the_entropy_quantile_and_train_what_one_does(straight, tmp_path, free_port):
    """rl.top_entropy_quantile 0.2 over 2 DDP processes of 2 prompts each: the quantile is over both processes'
    tokens of the pass (TRL's gather), so the losses and weights are one process's of 4 prompts (each process's own
    quantile would keep other tokens)."""
    recipe, _, _ = straight
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={one}", "train.max_steps=2", "rl.top_entropy_quantile=0.2")
    launch_finetune(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", "train.micro_batch_size=2",
                    "train.max_steps=2", "rl.top_entropy_quantile=0.2")
    assert [r["completion_ids"] for r in rollouts(two)] == [r["completion_ids"] for r in rollouts(one)]
    assert losses(two) == pytest.approx(losses(one), abs=1e-6)
    assert max_abs_diff(load_weights(two / "final"), load_weights(one / "final")) < 1e-5


# rl.use_adaptive_entropy with a target no step reaches: each step after the first applies the coefficient, raised
# by the delta after every step up to the cap (0.5, 0.75, 1.0, 1.0): a run whose losses depend on the controller
ADAPTIVE = {"use_adaptive_entropy": True, "entropy_target": 100.0, "entropy_coef": 0.5, "entropy_coef_delta": 0.25}


@pytest.fixture(scope="module")
def adaptive(tiny_assets, tmp_path_factory):
    """The straight run's 4 steps under ADAPTIVE entropy control, in this process: (recipe, run folder)."""
    tmp = tmp_path_factory.mktemp("adaptive")
    recipe = grpo_recipe(tiny_assets, tmp, rl=ADAPTIVE)
    run_train(recipe, f"output_dir={tmp / 'run'}")
    return recipe, tmp / "run"


def test_the_entropy_bonus_keeps_the_entropy_up_and_logs_trls_names(straight, adaptive, tmp_path):
    """rl.entropy_coef 1: step 1 samples what the plain run does (the same seeds); each step's loss is its
    policy_loss minus the coefficient x its entropy (TRL's names), and the bonus's gradient holds the entropy above
    the plain run's, which falls. Adaptive: step 1 applies nothing (no entropy measured yet), then the controller's
    coefficient from the step before."""
    recipe, plain, _ = straight
    run = tmp_path / "bonus"
    run_train(recipe, f"output_dir={run}", "rl.entropy_coef=1.0")
    assert [r for r in rollouts(run) if r["step"] == 1] == [r for r in rollouts(plain) if r["step"] == 1]
    lines, before = records(run), records(plain)
    for line in lines:
        assert line["entropy_coef"] == 1.0
        assert line["loss"] == pytest.approx(line["policy_loss"] - line["entropy"], abs=1e-6)
    assert before[-1]["entropy"] < before[0]["entropy"] - 0.02  # the plain run's entropy falls
    assert lines[-1]["entropy"] > before[-1]["entropy"] + 0.01
    assert "entropy_coef" not in before[0] and "policy_loss" not in before[0]
    lines = records(adaptive[1])
    assert [line["entropy_coef"] for line in lines] == [0.75, 1.0, 1.0, 1.0]  # after each step's update
    applied = [0.0, 0.75, 1.0, 1.0]
    for line, coef in zip(lines, applied):
        assert line["loss"] == pytest.approx(line["policy_loss"] - coef * line["entropy"], abs=1e-6)


def test_the_entropy_bonus_is_the_windows_token_mean_under_any_split_into_passes(adaptive, tmp_path):
    """The bonus is the mean entropy over the step's trained tokens whatever passes carry them: rl.micro_batch_tokens
    32 (several passes a micro-batch) trains what one pass does, the controller included."""
    recipe, one = adaptive
    budget = tmp_path / "budget"
    run_train(recipe, f"output_dir={budget}", "rl.micro_batch_tokens=32")
    assert rollouts(budget) == rollouts(one)
    assert losses(budget) == pytest.approx(losses(one), abs=1e-6)
    assert [r["entropy_coef"] for r in records(budget)] == [r["entropy_coef"] for r in records(one)]
    assert max_abs_diff(load_weights(budget / "final"), load_weights(one / "final")) < 1e-5


@pytest.mark.slow
def test_adaptive_entropy_control_resumes_where_it_was_killed(adaptive, tmp_path):
    """The controller's coefficient and last entropy are saved with each checkpoint: killed mid step 3 and resumed
    from step 2, the run applies what the uninterrupted one did (a controller started afresh would apply nothing at
    step 3 and 0.5 after)."""
    recipe, full = adaptive
    killed_and_resumed(recipe, full, tmp_path / "cut")


@pytest.mark.slow
@pytest.mark.extended  # main tier: the entropy bonus on two pipeline stages equal to one process (test_pipeline.py),
# and two DDP processes pooling the entropy quantile (above)
def test_two_ddp_processes_apply_the_entropy_bonus_one_process_applies(adaptive, tmp_path, free_port):
    """The bonus's token count is the step's on every process (the counts' one collective): 2 DDP processes of 2
    prompts each train what one process of 4 does, and their controllers move alike."""
    recipe, _ = adaptive
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={one}", "train.max_steps=2")
    launch_finetune(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", "train.micro_batch_size=2",
                    "train.max_steps=2")
    assert [r["completion_ids"] for r in rollouts(two)] == [r["completion_ids"] for r in rollouts(one)]
    assert losses(two) == pytest.approx(losses(one), abs=1e-6)
    assert [r["entropy_coef"] for r in records(two)] == [r["entropy_coef"] for r in records(one)] == [0.75, 1.0]
    assert max_abs_diff(load_weights(two / "final"), load_weights(one / "final")) < 1e-5


def test_top_k_one_samples_each_groups_greedy_completion_and_min_p_cuts_what_is_drawn(straight, tmp_path):
    """rl.top_k reaches the rollout's sampler: with 1, each prompt's completions at temperature 1 are all its greedy
    one (one completion a group, no advantage: nothing to learn, the loss 0); rl.min_p changes what is drawn."""
    recipe, plain, _ = straight
    run = tmp_path / "top_k"
    run_train(recipe, f"output_dir={run}", "train.max_steps=1", "rl.top_k=1")
    first = [r for r in rollouts(run) if r["step"] == 1]
    groups = {}
    for r in first:
        groups.setdefault(tuple(r["prompt_ids"]), set()).add(tuple(r["completion_ids"]))
    assert len(groups) == 4 and all(len(g) == 1 for g in groups.values())
    assert all(r["advantage"] == 0 for r in first) and records(run)[0]["loss"] == 0
    cut = tmp_path / "min_p"
    run_train(recipe, f"output_dir={cut}", "train.max_steps=1", "rl.min_p=0.5")
    drawn = [r["completion_ids"] for r in rollouts(cut)]
    assert drawn != [r["completion_ids"] for r in rollouts(plain) if r["step"] == 1]


def test_the_repetition_penalty_reaches_the_rollouts_sampler_and_not_the_evals(straight, tmp_path, monkeypatch):
    """rl.repetition_penalty: every rollout's sampler call carries it with the rl: section's temperature; the eval's
    greedy completions (temperature 0) are unpenalised; what is drawn changes."""
    import llmtrain.objectives.grpo as grpo

    recipe, plain, _ = straight
    calls, original = [], grpo.sample
    monkeypatch.setattr(grpo, "sample", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    run = tmp_path / "penalty"
    run_train(recipe, f"output_dir={run}", "train.max_steps=1", "train.eval_every_steps=1", "rl.repetition_penalty=1.4")
    rollout = [kw for kw in calls if kw["temperature"] > 0]
    evals = [kw for kw in calls if kw["temperature"] == 0]
    assert rollout and all(kw["repetition_penalty"] == 1.4 for kw in rollout)
    assert evals and all(kw.get("repetition_penalty", 1.0) == 1.0 for kw in evals)
    drawn = [r["completion_ids"] for r in rollouts(run)]
    assert drawn != [r["completion_ids"] for r in rollouts(plain) if r["step"] == 1]


def test_batch_scaled_advantages_divide_by_the_std_of_every_micro_batchs_rewards(straight, tmp_path):
    """rl.scale_rewards batch over 2 micro-batches a step: each completion's advantage is its reward minus its
    group's mean, over the std of all 32 rewards of the step (both micro-batches') + 1e-4, worked out here from
    rollouts.jsonl; the group-scaled run's differ."""
    recipe, _, _ = straight
    run = tmp_path / "batch"
    run_train(recipe, f"output_dir={run}", "train.max_steps=1", "train.grad_accum_steps=2", "rl.scale_rewards=batch")
    first = [r for r in rollouts(run) if r["step"] == 1]
    assert len(first) == 2 * 4 * G
    rewards = torch.tensor([r["reward"] for r in first])
    means = rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
    expected = (rewards - means) / (rewards.std() + 1e-4)
    assert [r["advantage"] for r in first] == pytest.approx(expected.tolist(), abs=1e-6)
    group = tmp_path / "group"
    run_train(recipe, f"output_dir={group}", "train.max_steps=1", "train.grad_accum_steps=2")
    assert [r["advantage"] for r in rollouts(group)] != pytest.approx(expected.tolist(), abs=1e-3)


def test_sampling_the_whole_step_at_once_draws_and_trains_what_each_micro_batch_does(straight, tmp_path,
                                                                                       monkeypatch):
    """rl.generation_batch=step over 2 micro-batches a step: one sampler call for the step's 32 completions, split
    back to its micro-batches: the same completions (each completion's seed is its own), the same losses and gradient
    norms to 1e-6, and each step's generation_s the call's; the tool loop refuses it."""
    from llmtrain.config import load_recipe
    from llmtrain.errors import LLMTrainError

    recipe, _, _ = straight
    from llmtrain.objectives.grpo import GRPO

    draw, calls = GRPO._draw, {}
    runs = {name: tmp_path / name for name in ("micro_batch", "step")}
    for name, run in runs.items():
        calls[name] = []
        monkeypatch.setattr(GRPO, "_draw", lambda self, examples, step, name=name: (
            calls[name].append(len(examples)), draw(self, examples, step))[1])
        run_train(recipe, f"output_dir={run}", "train.max_steps=2", "train.grad_accum_steps=2",
                  f"rl.generation_batch={name}", "train.eval_every_steps=null")
    assert calls == {"micro_batch": [4, 4, 4, 4], "step": [8, 8]}  # the sampler's calls: prompts each
    drawn = {name: [(r["step"], r["completion_ids"]) for r in rollouts(run)] for name, run in runs.items()}
    assert len(drawn["step"]) == 2 * 2 * 4 * G and drawn["step"] == drawn["micro_batch"]
    lines = {name: records(run) for name, run in runs.items()}
    for key in ("loss", "grad_norm", "reward"):
        assert [r[key] for r in lines["step"]] == pytest.approx([r[key] for r in lines["micro_batch"]], abs=1e-6)
    assert all(r["generation_s"] > 0 for r in lines["step"])
    with pytest.raises(LLMTrainError) as refused:
        load_recipe(recipe, ["rl.generation_batch=step", "rl.tools=[math:sqrt]"])
    assert "the tool loop (rl.tools, rl.environment) runs one micro-batch at a time" in str(refused.value)


def test_normalize_then_sum_normalises_each_reward_in_its_group_then_the_sum_over_the_step(tiny_assets, tmp_path):
    """rl.multi_objective_aggregation normalize_then_sum over 2 micro-batches: each completion's advantage worked out
    from rollouts.jsonl's per-function rewards (two format rewards, weights 1 and 2): each function's rewards
    normalised in their group, summed with the weights, then shifted and scaled over all 32 completions;
    scale_rewards beside it is refused."""
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [
        {"type": "format", "pattern": "[aeiou]"}, {"type": "format", "pattern": "[a-f][a-f]", "weight": 2.0,
                                                   "name": "pairs"}]})
    run = tmp_path / "gdpo"
    run_train(recipe, f"output_dir={run}", "train.max_steps=1", "train.grad_accum_steps=2",
              "rl.multi_objective_aggregation=normalize_then_sum")
    first = [r for r in rollouts(run) if r["step"] == 1]
    names = ["format", "pairs"]
    per = torch.tensor([[r[n] for n in names] for r in first]).view(-1, G, len(names))
    assert len(first) == 32 and len(names) == 2 and per[..., 0].std() > 0 and per[..., 1].std() > 0
    summed = (((per - per.mean(1, keepdim=True)) / (per.std(1, keepdim=True) + 1e-4)).nan_to_num()
              * torch.tensor([1.0, 2.0])).sum(-1).flatten()
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert [r["advantage"] for r in first] == pytest.approx(expected.tolist(), abs=1e-5)
    refused = invoke("doctor", str(recipe), "rl.multi_objective_aggregation=normalize_then_sum",
                     "rl.scale_rewards=none", check=False)
    assert refused.returncode != 0 and "remove rl.scale_rewards" in refused.stdout + refused.stderr


def test_off_policy_masking_drops_what_the_round_pushed_down(straight, tmp_path):
    """rl.off_policy_mask_threshold 0 in rounds of 2: the round's first update pushed its negative-advantage
    completions down, so at the second their drift (old minus current log-probability) is above 0 and their policy
    term is dropped: the second update's loss differs from the unmasked run's, the first's is the same."""
    recipe, _, _ = straight
    runs = {}
    for name, extra in (("plain", []), ("masked", ["rl.off_policy_mask_threshold=0"])):
        runs[name] = tmp_path / name
        run_train(recipe, f"output_dir={runs[name]}", "train.max_steps=2", "rl.num_iterations=2", "train.lr=0.01",
                  *extra)
    plain, masked = records(runs["plain"]), records(runs["masked"])
    assert masked[0]["loss"] == pytest.approx(plain[0]["loss"], abs=1e-7)
    assert abs(masked[1]["loss"] - plain[1]["loss"]) > 1e-4


SAMPLING_METRICS = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                    "sampling/importance_sampling_ratio/max"]


def test_the_sampler_correction_in_fp32_finds_the_sampler_exact_and_trains_the_same(straight, tmp_path):
    """rl.sampler_correction with the fast sampler in fp32: its log-probabilities are the policy's (each step's
    largest |difference| under 1e-5, every ratio 1 to 1e-4), so the run samples and trains what the run without it
    does (the same completions, losses to 1e-6); TRL's sampling/* names on every line; the eval has none."""
    recipe, plain, _ = straight
    run = tmp_path / "corrected"
    run_train(recipe, f"output_dir={run}", "rl.sampler_correction=token_truncate")
    lines = records(run)
    for line in lines:
        assert all(name in line for name in SAMPLING_METRICS)
        assert 0 <= line["sampling/sampling_logp_difference/mean"] <= line["sampling/sampling_logp_difference/max"]
        assert line["sampling/sampling_logp_difference/max"] < 1e-5
        low, high = (line[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "max"))
        assert 1 - 1e-4 < low <= high < 1 + 1e-4
    assert [r["completion_ids"] for r in rollouts(run)] == [r["completion_ids"] for r in rollouts(plain)]
    assert losses(run) == pytest.approx(losses(plain), abs=1e-6)
    assert not any(k.startswith("sampling/") for e in records(run, "eval") for k in e)


def test_the_sampler_correction_weighs_a_bf16_merged_copys_tokens(tiny_assets, tmp_path):
    """A bf16 LoRA policy sampling from a merged bf16 copy (rl.merged_copy=rollout: W + sBA rounded once, where the
    update computes W x + s B A x): the sampler's distribution is not the policy's, and the correction sees it (the
    mean |difference| 1.0e-3 to 1.4e-3 a step here, the ratios 0.996 to 1.004), truncating at 1.002 (the largest
    ratio logged is the bound); the run trains (the adapters move) and the loss is not the uncorrected run's."""
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    recipe = grpo_recipe(tiny_assets, tmp_path, lora=lora, model={"dtype": "bfloat16"},
                         rl={"merged_copy": "rollout"}, train={"max_steps": 3, "lr": 1e-2, "eval_every_steps": None},
                         checkpoint={"every_steps": None})
    runs = {name: tmp_path / name for name in ("plain", "corrected")}
    run_train(recipe, f"output_dir={runs['plain']}")
    run_train(recipe, f"output_dir={runs['corrected']}", "rl.sampler_correction=token_truncate",
              "rl.sampler_correction_max=1.002")
    lines = records(runs["corrected"])
    assert all(line["sampling/sampling_logp_difference/mean"] > 5e-4 for line in lines)
    assert all(line["sampling/importance_sampling_ratio/min"] < 1 for line in lines)
    assert all(line["sampling/importance_sampling_ratio/max"] == pytest.approx(1.002) for line in lines)
    assert [r["completion_ids"] for r in rollouts(runs["corrected"]) if r["step"] == 1] == [
        r["completion_ids"] for r in rollouts(runs["plain"]) if r["step"] == 1]  # the same draws, weighed otherwise
    assert abs(losses(runs["corrected"])[0] - losses(runs["plain"])[0]) > 1e-5
    adapter = load_weights(runs["corrected"] / "final" / ADAPTER)
    assert any(v.float().abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)


def test_ratio_keys_that_cannot_bind_with_one_update_a_round_are_said(tiny_assets, tmp_path):
    """rl.epsilon_high, rl.delta and GSPO act on the ratio, which rl.num_iterations 1 keeps at 1: a warning (doctor's
    and the run's start) naming them and the fix; none with rounds of 2, none for the defaults."""
    from llmtrain.config import load_recipe
    from llmtrain.data.checks import check_ratio_keys

    recipe = grpo_recipe(tiny_assets, tmp_path)
    assert check_ratio_keys(load_recipe(recipe)) == []
    said = check_ratio_keys(load_recipe(recipe, ["rl.epsilon_high=0.28", "rl.delta=4",
                                                 "rl.importance_sampling_level=sequence"]))
    assert [(name, status) for name, status, _ in said] == [("ratio", "warn")]
    assert said[0][2].startswith("rl.epsilon_high=0.28 and rl.delta=4.0 and rl.importance_sampling_level=sequence "
                                 "act on the ratio") and "Set rl.num_iterations 2 or more" in said[0][2]
    assert check_ratio_keys(load_recipe(recipe, ["rl.epsilon_high=0.28", "rl.num_iterations=2"])) == []
    assert check_ratio_keys(load_recipe(recipe, ["rl.loss_type=cispo", "rl.epsilon_high=5"])) == []  # its cap
    # luspo's sequence level is the schema's filling-in, no key the recipe could remove (it had been told to)
    assert check_ratio_keys(load_recipe(recipe, ["rl.loss_type=luspo"])) == []
    alone = check_ratio_keys(load_recipe(recipe, ["rl.off_policy_mask_threshold=0.1"]))[0][2]
    assert alone.startswith("rl.off_policy_mask_threshold=0.1 acts on the ratio") and "it changes nothing" in alone
    # with the sampler correction it reads the sampler's log-probabilities: it binds on the first update too; and the
    # update divides by the policy's log-probabilities as it sampled (no LoRA dropout), so the clip binds as well
    assert check_ratio_keys(load_recipe(recipe, ["rl.off_policy_mask_threshold=0.1",
                                                 "rl.sampler_correction=sequence_mask"])) == []
    assert check_ratio_keys(load_recipe(recipe, ["rl.epsilon_high=0.28", "rl.delta=4",
                                                 "rl.sampler_correction=token_truncate"])) == []


def test_cispo_trains_every_token_and_logs_the_share_above_its_cap(straight, tmp_path):
    """rl.loss_type cispo in rounds of 2 with the cap just above 1: step 2 (the round's second update) logs TRL's
    cispo_clip_ratio, tokens above the cap with a positive advantage, and not PPO's clip_ratio; the weights move at
    each update; without epsilon_high the recipe is refused, naming ScaleRL's 5.0. sapo and vespo in rounds of 2 log
    no clip share; vespo its mean weight, 1 until the ratio moves."""
    recipe, _, _ = straight
    run = tmp_path / "cispo"
    run_train(recipe, f"output_dir={run}", "train.max_steps=2", "rl.loss_type=cispo", "rl.epsilon_high=1.0001",
              "rl.num_iterations=2", "train.lr=0.01")
    first, second = records(run)
    assert first["cispo_clip_ratio"] == 0 and 0 < second["cispo_clip_ratio"] < 1
    assert "clip_ratio/region_mean" not in second and second["grad_norm"] > 0
    refused = invoke("doctor", str(recipe), "rl.loss_type=cispo", check=False)
    assert refused.returncode != 0 and "set rl.epsilon_high (ScaleRL's is 5.0" in refused.stdout + refused.stderr
    # sapo, in rounds of 2: its gate clips nothing, so no clip share is logged (as TRL); its loss is another
    soft = tmp_path / "sapo"
    run_train(recipe, f"output_dir={soft}", "train.max_steps=2", "rl.loss_type=sapo", "rl.num_iterations=2",
              "train.lr=0.01")
    lines = records(soft)
    assert all("clip_ratio/region_mean" not in r and "cispo_clip_ratio" not in r for r in lines)
    assert lines[1]["grad_norm"] > 0 and lines[1]["loss"] != pytest.approx(second["loss"], abs=1e-6)
    # vespo, in rounds of 2: TRL's vespo/phi_seq_mean, 1 where the ratio is (the round's first update), then not
    gamma = tmp_path / "vespo"
    run_train(recipe, f"output_dir={gamma}", "train.max_steps=2", "rl.loss_type=vespo", "rl.num_iterations=2",
              "train.lr=0.01")
    first_v, second_v = records(gamma)
    assert first_v["vespo/phi_seq_mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(second_v["vespo/phi_seq_mean"] - 1.0) > 1e-4 and "clip_ratio/region_mean" not in second_v


def killed_and_resumed_within_a_round(recipe: Path, full: Path, cut: Path) -> None:
    """rl.num_iterations 3 (rounds of steps 1-3 and 4), checkpoints every 2 steps: killed like kill -9 mid step 3,
    the step-2 checkpoint is within the first round, and the resume finishes that round on the completions it
    kept (none sampled again) and gives `full`'s losses, rollouts and weights to the bit."""
    killed = subprocess.run([sys.executable, "-c", KILL_AT_STEP_3, "finetune", str(recipe), f"output_dir={cut}"],
                            env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert {r["step"] for r in rollouts(cut)} == {1}
    assert (cut / "checkpoints" / "step_000002" / "rounds" / "process_0.pt").is_file()
    proc = cli("finetune", str(cut / "recipe.yaml"), "--resume", "auto")
    assert "at step 2" in proc.stdout
    assert {r["step"] for r in rollouts(cut)} == {1, 4}  # step 3 reused round 1's completions; step 4 sampled
    assert rollouts(cut) == rollouts(full)
    assert losses(cut) == pytest.approx(losses(full), abs=1e-6)
    assert max_abs_diff(load_weights(cut / "final"), load_weights(full / "final")) == 0.0


def sequence_logps(model, records_: list[dict]) -> list[torch.Tensor]:
    """Each record's completion tokens' log-probabilities under `model` (a plain transformers forward, full
    logits, one sequence at a time)."""
    out = []
    with torch.no_grad():
        for r in records_:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            n = len(r["completion_ids"])
            out.append(logp[-n:].gather(1, targets[-n:, None])[:, 0])
    return out


def round_run(tiny: Path, tmp: Path, **rl) -> tuple[Path, Path]:
    """rl.num_iterations 2, 3 steps, a checkpoint after every step: (recipe's folder, run folder)."""
    recipe = grpo_recipe(tiny, tmp, rl={"num_iterations": 2, **rl}, data={"eval_split": None,
                                                                         "eval_max_examples": None},
                         train={"max_steps": 3, "eval_every_steps": None, "eval_samples": 0},
                         checkpoint={"every_steps": 1, "keep_last": 3}, logging={"every_steps": 1})
    run_train(recipe, f"output_dir={tmp / 'run'}")
    return tmp, tmp / "run"


@pytest.fixture(scope="module")
def rounds(tiny_assets, tmp_path_factory):
    return round_run(tiny_assets, tmp_path_factory.mktemp("rounds"))


@pytest.fixture(scope="module")
def gspo_rounds(tiny_assets, tmp_path_factory):
    """The same with GSPO's ratio a completion and its normalisation (importance_sampling_level sequence, grpo)."""
    return round_run(tiny_assets, tmp_path_factory.mktemp("gspo"), importance_sampling_level="sequence",
                     loss_type="grpo")


@pytest.fixture(scope="module")
def capped_rounds(tiny_assets, tmp_path_factory):
    """The same with rl.delta 1.01: the unclipped ratio capped (INTELLECT-2's two-sided clipping)."""
    return round_run(tiny_assets, tmp_path_factory.mktemp("capped"), delta=1.01)


@pytest.mark.parametrize("level", ["token", "sequence", "capped"])
def test_a_rounds_second_update_reuses_its_completions_against_the_policy_that_sampled_them(
        rounds, gspo_rounds, capped_rounds, tiny_assets, level):
    """rl.num_iterations 2: step 1 samples (rollouts.jsonl's step 1), step 2 updates on the same completions and
    advantages, step 3 samples again. Step 2's loss, worked by hand from rollouts.jsonl with plain transformers
    forwards: per token, the DAPO sum of -min(r A, clip(r, 0.8, 1.2) A) over every completion token / the tokens,
    r the ratio of the step-1 checkpoint's policy to the starting one's (which sampled); its clipped share too.
    Per completion (GSPO, loss_type grpo): r = exp(the mean log-ratio of its tokens), the mean over completions, the
    clipped share of completions. With rl.delta the unclipped term's ratio capped at it. A checkpoint within a
    round keeps it (rounds/), one at its end does not."""
    from transformers import AutoModelForCausalLM

    _, run = {"token": rounds, "sequence": gspo_rounds, "capped": capped_rounds}[level]
    done = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in done}) == [1, 3]
    first = [r for r in done if r["step"] == 1]
    lines = records(run)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert "reward" in lines[0] and "reward" in lines[2] and "reward" not in lines[1]  # step 2 sampled nothing
    assert lines[0]["clip_ratio/region_mean"] == 0.0  # the first update's ratio is 1

    sampler = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
    updated = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
    updated.load_state_dict(load_weights(run / "checkpoints" / "step_000001"))
    old, new = sequence_logps(sampler, first), sequence_logps(updated, first)
    total, units, clipped = 0.0, 0, 0
    for r, o, n in zip(first, old, new):
        ratio, a = torch.exp((n - o).mean() if level == "sequence" else n - o), r["advantage"]
        capped = ratio.clamp(max=1.01) if level == "capped" else ratio
        losses_ = -torch.min(capped * a, ratio.clamp(0.8, 1.2) * a)
        clip = ((capped < 0.8) & (a < 0)) | ((capped > 1.2) & (a > 0))  # as TRL counts it: the capped ratio
        total += float(losses_.sum())
        clipped += int(clip.sum())
        units += 1 if level == "sequence" else len(r["completion_ids"])
    assert lines[1]["loss"] == pytest.approx(total / units, abs=1e-5)
    assert lines[1]["loss"] != pytest.approx(lines[0]["loss"], abs=1e-4)  # not the first update's loss again
    if level == "capped":  # the cap binds: the loss is not the uncapped round's
        assert lines[1]["loss"] != pytest.approx(records(rounds[1])[1]["loss"], abs=1e-5)
    assert clipped > 0 and lines[1]["clip_ratio/region_mean"] == pytest.approx(clipped / units, abs=1e-6)
    checkpoints = run / "checkpoints"
    assert (checkpoints / "step_000001" / "rounds" / "process_0.pt").is_file()
    assert not (checkpoints / "step_000002" / "rounds").exists()


def test_a_checkpoint_within_a_round_is_refused_where_the_round_cannot_go_on(rounds):
    """Before anything is written: another rl.num_iterations or another number of processes, with the fix."""
    from llmtrain.loop.rounds import round_problem

    _, run = rounds
    within, end = run / "checkpoints" / "step_000001", run / "checkpoints" / "step_000002"
    assert round_problem(within, every=2, processes=1) is None and round_problem(end, every=2, processes=1) is None
    says = round_problem(within, every=3, processes=1)
    assert "rl.num_iterations=2 (step 1)" in says and "Resume with rl.num_iterations=2" in says
    says = round_problem(within, every=2, processes=2)
    assert "by 1 process, each keeping its own completions, and this launch has 2: resume it on 1 process," in says
    assert "holds no round" in round_problem(end, every=4, processes=1)  # step 2 is within a round of 4


@pytest.mark.slow
def test_killed_within_a_round_resumes_to_the_same_completions_losses_and_weights(tiny_assets, tmp_path):
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"num_iterations": 3}, data={"eval_split": None,
                                                                                  "eval_max_examples": None},
                         train={"eval_every_steps": None, "eval_samples": 0})
    full = tmp_path / "full"
    run_train(recipe, f"output_dir={full}")
    killed_and_resumed_within_a_round(recipe, full, tmp_path / "cut")


@pytest.mark.slow
@pytest.mark.extended  # 24 s; main tier: two FSDP processes sample (the fast sampler) and train what one does
def test_two_ddp_processes_sample_and_train_what_one_does(straight, tiny_assets, tmp_path, free_port):
    """Each rank samples its own 2 prompts' completions from their own seeds: the same completions as one process
    with 4 prompts, the same losses, the same weights."""
    recipe, one, _ = straight
    two = tmp_path / "two"
    launch_finetune(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", "train.micro_batch_size=2")
    ours, theirs = rollouts(two), rollouts(one)
    assert [(r["step"], r["row"], r["completion_ids"]) for r in ours] == [
        (r["step"], r["row"], r["completion_ids"]) for r in theirs]
    assert [r["reward"] for r in ours] == [r["reward"] for r in theirs]
    assert losses(two) == pytest.approx(losses(one), abs=1e-6)
    assert [e["eval_reward"] for e in records(two, "eval")] == pytest.approx(
        [e["eval_reward"] for e in records(one, "eval")])
    assert max_abs_diff(load_weights(two / "final"), load_weights(one / "final")) < 1e-5


@pytest.mark.slow
def test_two_fsdp_processes_gather_the_layers_to_sample_and_train_what_one_does(straight, tmp_path, free_port):
    """FSDP2 over 2 processes: each rank gathers the whole model once for its rollout (gathered_for_generation),
    samples its own 2 prompts with the fast sampler, reshards and trains: the completions of one process, its losses
    and, within FSDP's reduction order, its weights."""
    recipe, one, _ = straight
    fsdp = tmp_path / "fsdp"
    printed = launch_finetune(CPU_FSDP, 2, free_port, recipe, f"output_dir={fsdp}", "train.micro_batch_size=2")
    assert "samples with the reference loop" not in printed  # whole parameters: the fast sampler ran
    ours, theirs = rollouts(fsdp), rollouts(one)
    assert [(r["step"], r["row"], r["completion_ids"], r["reward"]) for r in ours] == [
        (r["step"], r["row"], r["completion_ids"], r["reward"]) for r in theirs]
    assert losses(fsdp) == pytest.approx(losses(one), abs=1e-6)
    assert [e["eval_reward"] for e in records(fsdp, "eval")] == [e["eval_reward"] for e in records(one, "eval")]
    assert max_abs_diff(load_weights(fsdp / "final"), load_weights(one / "final")) < 1e-5


@pytest.mark.slow
@pytest.mark.extended  # main tier: rounds under sequence parallelism (test_sequence_parallel.py), each process's
# rollout under FSDP (the test above) and its old log-probabilities' forward there (RLOO's KL, test_rloo.py)
def test_two_fsdp_processes_with_rounds_of_two_updates_train_what_one_does(rounds, free_port):
    """rl.num_iterations 2 under FSDP2: each rank takes its completions' old log-probabilities while the model is
    gathered for the rollout, and updates on them twice: one process's completions, losses and clipped shares."""
    tmp, one = rounds
    fsdp = tmp / "fsdp"
    launch_finetune(CPU_FSDP, 2, free_port, tmp / "recipe.yaml", f"output_dir={fsdp}", "train.micro_batch_size=2",
                    "checkpoint.every_steps=null")
    assert [(r["step"], r["row"], r["completion_ids"]) for r in rollouts(fsdp)] == [
        (r["step"], r["row"], r["completion_ids"]) for r in rollouts(one)]
    assert losses(fsdp) == pytest.approx(losses(one), abs=1e-6)
    assert [r["clip_ratio/region_mean"] for r in records(fsdp)] == pytest.approx(
        [r["clip_ratio/region_mean"] for r in records(one)], abs=1e-6)


@pytest.mark.extended  # main tier: two DDP processes sample and train what one does
@pytest.mark.slow
def test_log_metric_is_averaged_over_both_processes(tiny_assets, tmp_path, free_port, monkeypatch):
    """A reward function logging each completion's length: 2 DDP processes write the mean over all 16 completions
    of a step, as one process does (completions/mean_length), not the main process's 8 alone."""
    import os

    (tmp_path / "length_log.py").write_text("def lengths(completions, completion_ids, log_metric, **kwargs):\n"
                                            "    for ids in completion_ids:\n"
                                            "        log_metric('completion_len', len(ids))\n"
                                            "    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ENV, "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), ENV.get("PYTHONPATH")])))
    rewards = [{"type": "format", "pattern": "[aeiou]"}, {"type": "function", "function": "length_log:lengths"}]
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": rewards},
                         train={"max_steps": 2, "eval_every_steps": None}, logging={"every_steps": 1},
                         data={"eval_split": None, "eval_max_examples": None})
    run_train(recipe, f"output_dir={tmp_path / 'one'}")
    launch_finetune(CPU_DDP, 2, free_port, recipe, f"output_dir={tmp_path / 'two'}", "train.micro_batch_size=2")
    for run in ("one", "two"):
        lines = records(tmp_path / run)
        assert [r["completion_len"] for r in lines] == pytest.approx([r["completions/mean_length"] for r in lines])
    assert [r["completion_len"] for r in records(tmp_path / "two")] == pytest.approx(
        [r["completion_len"] for r in records(tmp_path / "one")])


@pytest.mark.extended  # main tier: two FSDP processes gather the layers to sample and train what one does
@pytest.mark.slow
def test_two_fsdp_processes_with_a_token_budget_pass_alike_and_train_what_one_does(straight, tmp_path, free_port):
    """rl.micro_batch_tokens=48 under FSDP (which gathers and reduce-scatters in every pass): a rank whose
    completions fit fewer passes runs its last again with weight 0, so both run as many (here 4 against 5 to 7 at 3
    of the 4 steps, measured); the run is still the one-process, unbudgeted one."""
    recipe, one, _ = straight
    fsdp = tmp_path / "fsdp"
    launch_finetune(CPU_FSDP, 2, free_port, recipe, f"output_dir={fsdp}", "train.micro_batch_size=2",
                    "rl.micro_batch_tokens=48")
    assert [(r["step"], r["row"], r["completion_ids"]) for r in rollouts(fsdp)] == [
        (r["step"], r["row"], r["completion_ids"]) for r in rollouts(one)]
    assert losses(fsdp) == pytest.approx(losses(one), abs=1e-6)
    assert max_abs_diff(load_weights(fsdp / "final"), load_weights(one / "final")) < 1e-5


@pytest.mark.slow
def test_a_kl_anchor_under_fsdp_with_weight_0_passes_trains_what_one_process_does(tiny_assets, tmp_path, free_port):
    """LoRA with rl.beta > 0 under FSDP and a token budget: a working pass runs the reference's no-grad forward (the
    adapter off) before the policy's, and a rank's weight-0 pass must run both too, since each forward gathers
    every layer from every rank (the normal path does; without it: gloo's "Received data size doesn't match expected
    size", a hang on NCCL). The run is still the one-process, unbudgeted one."""
    recipe = grpo_recipe(tiny_assets, tmp_path, lora={"r": 4, "alpha": 8, "dropout": 0.0}, rl={"beta": 0.1},
                         train={"max_steps": 3, "lr": 5e-2, "eval_every_steps": None})
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    run_train(recipe, f"output_dir={one}")
    launch_finetune(CPU_FSDP, 2, free_port, recipe, f"output_dir={fsdp}", "train.micro_batch_size=2",
                    "rl.micro_batch_tokens=48")
    assert [(r["step"], r["row"], r["completion_ids"]) for r in rollouts(fsdp)] == [
        (r["step"], r["row"], r["completion_ids"]) for r in rollouts(one)]
    assert losses(fsdp) == pytest.approx(losses(one), abs=1e-6)
    assert [r["kl"] for r in records(fsdp)] == pytest.approx([r["kl"] for r in records(one)], abs=1e-6)
    assert records(one)[-1]["kl"] > 1e-6  # the anchor is live: the adapter moved


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_with_rounds_the_reference_runs_once_a_round_and_trains_what_a_pass_each_update_does(tiny_assets, tmp_path,
                                                                                          monkeypatch, lora):
    """rl.beta > 0 with rl.num_iterations 2 (TRL's ref_per_token_logps, taken where it generates): the rollout takes
    the reference's log-probabilities of the update's passes once a round, so a round of 2 updates runs half the
    reference passes of one in each update's loss (the path before stop 98, forced here), and trains the same: the
    losses and KLs to 1e-6, the same final weights. Full fine-tune (the frozen copy) and LoRA (the adapter off)."""
    from llmtrain.objectives.grpo import GRPO

    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"beta": 0.1, "num_iterations": 2},
                         train={"max_steps": 4, "lr": 1e-2 if lora else 1e-3, "eval_every_steps": None},
                         checkpoint={"every_steps": None, "save_final": True},
                         **({"lora": {"r": 4, "alpha": 8, "dropout": 0.0}} if lora else {}))
    calls = {"once": 0, "each": 0}
    taken = GRPO._reference_logps
    for way in ("once", "each"):
        def counted(self, batches, way=way):  # the passes it takes them of
            calls[way] += len(batches)
            return taken(self, batches)

        monkeypatch.setattr(GRPO, "_reference_logps", counted)
        if way == "each":
            monkeypatch.setattr(GRPO, "_reference_once", lambda self: False)
        run_train(recipe, f"output_dir={tmp_path / way}")
    once, each = tmp_path / "once", tmp_path / "each"
    assert calls["once"] > 0 and 2 * calls["once"] == calls["each"]
    assert losses(once) == pytest.approx(losses(each), abs=1e-6)
    assert [r["kl"] for r in records(once)] == pytest.approx([r["kl"] for r in records(each)], abs=1e-6)
    assert records(each)[-1]["kl"] > 1e-5  # live
    saved = "final/adapter_model.safetensors" if lora else "final"
    assert max_abs_diff(load_weights(once / saved), load_weights(each / saved)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("rounds", [1, 2], ids=["each-step", "rounds-of-2"])
def test_a_full_fine_tune_kl_under_fsdp_with_a_moving_sharded_copy_trains_what_one_process_does(tiny_assets, tmp_path,
                                                                                                 free_port, rounds):
    """A full fine-tune with rl.beta > 0 under FSDP (refused before 2026-12-04: the copy was whole on every process):
    the reference is the starting weights read again and sharded like the policy, run in each update's passes (a
    rank's weight-0 passes too, under a token budget), and rl.sync_reference mixes the sharded policy into it after
    every step. 2 FSDP processes give one process's completions, losses, KLs and final weights, with a live KL (at lr
    1e-3: at 1e-2 the final weights part by 5.3e-5, AdamW moving weights whose gradients are round-off by ~lr).
    rounds-of-2 (rl.num_iterations 2): the copy's log-probabilities are taken once a round in the rollout, the copy
    gathered whole there (rollouts.held_whole), each rank running as many passes as its completions fill."""
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"beta": 0.1, "sync_reference": {"every_steps": 1, "alpha": 0.6},
                                                    "num_iterations": rounds},
                         train={"max_steps": 3, "lr": 1e-3, "eval_every_steps": None},
                         checkpoint={"save_final": True})
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    run_train(recipe, f"output_dir={one}")
    printed = launch_finetune(CPU_FSDP, 2, free_port, recipe, f"output_dir={fsdp}", "train.micro_batch_size=2",
                              "rl.micro_batch_tokens=48")
    assert "reference: the starting weights, sharded like the policy" in printed
    assert [(r["step"], r["row"], r["completion_ids"]) for r in rollouts(fsdp)] == [
        (r["step"], r["row"], r["completion_ids"]) for r in rollouts(one)]
    assert losses(fsdp) == pytest.approx(losses(one), abs=1e-6)
    assert [r["kl"] for r in records(fsdp)] == pytest.approx([r["kl"] for r in records(one)], abs=1e-6)
    assert records(one)[-1]["kl"] > 1e-4  # the policy has moved from the reference (1.06e-3 at step 3)
    assert (fsdp / "checkpoints" / "step_000002" / "reference").is_dir()  # the moved reference, in 2 shards
    assert max_abs_diff(load_weights(fsdp / "final"), load_weights(one / "final")) < 1e-5


def test_a_rank_with_fewer_passes_runs_its_last_again_with_weight_0(monkeypatch):
    """Under a token budget the ranks' pass counts can differ; FSDP needs them equal, so the rank with fewer runs its
    last pass again through the normal path with weight 0 (the loop multiplies its loss and statistics by it), and
    the window's counts stay its real passes'."""
    from llmtrain.config import RLConfig
    from llmtrain.data.batching import Counts, Window, batch_weight
    from llmtrain.objectives.grpo import GRPO

    rl = RLConfig(rewards=[{"type": "format", "pattern": "x"}], micro_batch_tokens=64)
    grpo = GRPO(rl, tokenizer=None, pad_id=0, packing=True, seed=0, rewards=[("format", lambda **_: [], 1.0)],
                model=torch.nn.Linear(2, 2), columns=["input_ids", "row", "prompt"], stop_ids=[], world=2,
                gather=lambda mine: mine + [mine[0] + 2])  # the other rank: 2 passes more
    real = {"input_ids": torch.ones(1, 5, dtype=torch.long)}
    monkeypatch.setattr(grpo, "_draw", lambda examples, step: ([], 0.0))  # nothing sampled: a Linear is no LM
    monkeypatch.setattr(grpo, "_rollout_batch",
                        lambda examples, step, stand_in, drawn: ([real], Counts(3.0, 3.0, 5.0, 25.0), []))
    window = Window(epoch=0, end=1, epoch_done=False, batches=[{"examples": [{}]}], counts=Counts(0, 0, 0, 0))
    out = grpo.rollout(window, step=0)
    assert out.batches[0] is real and len(out.batches) == 3 and out.counts == Counts(3.0, 3.0, 5.0, 25.0)
    assert [batch_weight(b) for b in out.batches] == [1.0, 0.0, 0.0]
    assert all(b["input_ids"] is real["input_ids"] for b in out.batches[1:])


# --------------------------------------------------------------------------- refused before anything is written


def _refused(recipe: Path, out: Path, *overrides: str) -> str:
    from llmtrain.errors import LLMTrainError

    with pytest.raises(LLMTrainError) as e:
        run_train(recipe, f"output_dir={out}", *overrides)
    assert not out.exists()  # nothing written
    return str(e.value)


def test_an_eval_of_several_sampled_completions_a_prompt_counts_each_and_its_pass_at_n(monkeypatch):
    """rl.num_generations_eval 3: each eval prompt's 3 completions are sampled (not greedy) from seeds of the eval's
    own step, the same at every eval and distinct per row and completion; eval_reward and eval_answer_accuracy are
    means over the 6 completions, eval_answer_pass@3 the share of the 2 prompts with a right one. Unset: one greedy
    completion a prompt, no pass@."""
    from llmtrain.config import RLConfig
    from llmtrain.model.generate import completion_seed
    from llmtrain.objectives.grpo import EVAL_STEP, GRPO

    def objective(**rl):
        config = RLConfig(rewards=[{"type": "format", "pattern": "x"}, {"type": "answer_match", "column": "c"}], **rl)
        return GRPO(config, tokenizer=None, pad_id=0, packing=True, seed=7,
                    rewards=[("format", None, 1.0), ("answer_match", None, 1.0)], model=torch.nn.Linear(2, 2),
                    columns=["input_ids", "row", "prompt", "c"], stop_ids=[], world=1)

    calls = []
    matched = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # the first prompt's first completion alone is right

    def complete(prompt_ids, seeds, *, rows, greedy=False):
        calls.append((len(prompt_ids), seeds, greedy))
        return [[5]] * len(prompt_ids), None

    def score(examples, completions, g, *, where, tooled=None):
        answer = matched[: len(completions)]
        per_function = torch.stack([torch.full_like(answer, 0.5), answer], dim=1)
        return [""] * len(completions), per_function, per_function.sum(1), None

    batch = {"examples": [{"input_ids": [1, 2], "row": 3, "prompt": "a", "c": "x"},
                          {"input_ids": [1, 4], "row": 8, "prompt": "b", "c": "y"}]}
    sampled = objective(num_generations_eval=3)
    monkeypatch.setattr(sampled, "_complete", complete)
    monkeypatch.setattr(sampled, "_score", score)
    line = sampled.eval_metrics(sampled.eval_sums(None, batch, "cpu").tolist())
    assert line["eval_reward"] == pytest.approx((6 * 0.5 + 1) / 6)
    assert line["eval_answer_accuracy"] == pytest.approx(1 / 6) and line["eval_answer_pass@3"] == 0.5
    count, seeds, greedy = calls[0]
    assert count == 6 and not greedy
    assert seeds == [completion_seed(7, EVAL_STEP, row, k) for row in (3, 8) for k in range(3)]
    assert len(set(seeds)) == 6
    sampled.eval_sums(None, batch, "cpu")
    assert calls[1][1] == seeds  # the next eval draws from the same seeds
    greedy_only = objective()
    monkeypatch.setattr(greedy_only, "_complete", complete)
    monkeypatch.setattr(greedy_only, "_score", score)
    line = greedy_only.eval_metrics(greedy_only.eval_sums(None, batch, "cpu").tolist())
    assert calls[2][0] == 2 and calls[2][2] is True
    assert line["eval_answer_accuracy"] == 0.5 and not any(k.startswith("eval_answer_pass") for k in line)


def test_sampled_eval_completions_run_end_to_end_and_bound_the_accuracy(straight, tmp_path):
    """A run with rl.num_generations_eval 4 evaluates before and after its steps (the tiny task's 8 eval prompts x
    4 sampled completions): the means and pass@4 are in each eval line, accuracy <= pass@4; the step-0 eval, of the
    same policy and seeds, is a second run's to the bit, and not the greedy one's (the random model's format reward
    0.28 sampled, 0.62 greedy)."""
    recipe, plain, _ = straight
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run_train(recipe, f"output_dir={run}", "rl.num_generations_eval=4", "train.max_steps=1",
                  "train.eval_every_steps=1")
    first, second = (records(run, "eval") for run in runs)
    assert [e["step"] for e in first] == [0, 1]
    for e in first:
        assert 0 <= e["eval_answer_accuracy"] <= e["eval_answer_pass@4"] <= 1
    assert first[0] == second[0]
    assert first[0]["eval_reward"] != pytest.approx(records(plain, "eval")[0]["eval_reward"], abs=1e-3)


def test_a_prompt_that_leaves_no_room_for_the_completion_is_refused_with_its_row(tiny_assets, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "reverse abc =", "completion": " cba"}] * 5 + [{"prompt": "reverse " + "x" * 40 + " =",
                                                                       "completion": " x"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = grpo_recipe(tiny_assets, tmp_path, data={"path": str(data), "cache_dir": str(tmp_path / "cache")})
    says = _refused(recipe, tmp_path / "run", "data.eval_split=null", "data.eval_max_examples=null")
    assert "row 6" in says and "rl.max_completion_tokens=8" in says and str(data) in says
    assert "Raise data.max_seq_len to 59" in says  # the prompt's 51 tokens (BOS first) + 8


def test_a_row_with_no_prompt_is_refused_with_file_and_row(tiny_assets, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "reverse abc =", "completion": " cba"}) + "\n"
                    + json.dumps({"prompt": "", "completion": " x"}) + "\n")
    recipe = grpo_recipe(tiny_assets, tmp_path, data={"path": str(data), "cache_dir": str(tmp_path / "cache")})
    says = _refused(recipe, tmp_path / "run", "data.eval_split=null", "data.eval_max_examples=null")
    assert f"{data}, row 2: 'prompt' (prompt) is empty" in says


@pytest.mark.parametrize("body, says", [
    ("raise KeyError('answer')", "reward function bad raised KeyError"),
    ("return [1.0]", "reward function bad returned 1 value for 4 completions"),
    ("return [float('nan')] * len(completions)", "reward function bad returned nan for the completion of row"),
])
def test_a_bad_reward_function_is_refused_before_the_run_writes(tiny_assets, tmp_path, monkeypatch, body, says):
    module = f"bad_rewards_{abs(hash(body))}"  # a module of its own: imported modules stay cached
    (tmp_path / f"{module}.py").write_text(f"def bad(prompts, completions, **columns):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [{"type": "function", "function": f"{module}:bad"}]})
    assert says in _refused(recipe, tmp_path / "run")


def test_a_reward_function_that_fails_mid_run_names_the_step_and_the_checkpoint_it_continues_from(tiny_assets,
                                                                                                 tmp_path, monkeypatch):
    """Passed at start-up, raising at step 3 (the checkpoint of step 2 written): the error says the step it stopped,
    that it was not taken, and the command that continues from step 2 once the function is fixed."""
    (tmp_path / "late_rewards.py").write_text(
        "def late(prompts, completions, trainer_state, **kwargs):\n"
        "    if trainer_state.global_step >= 2:\n"
        "        raise ValueError('the grader is down')\n"
        "    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [{"type": "function", "function": "late_rewards:late"}]},
                         data={"eval_split": None})
    out = tmp_path / "run"
    from llmtrain.errors import LLMTrainError

    with pytest.raises(LLMTrainError) as e:
        run_train(recipe, f"output_dir={out}")
    says = str(e.value)
    assert says.startswith("step 3 stopped: reward function late raised ValueError: the grader is down at "
                           "late_rewards.py:3 in late (on the completions of "), says
    assert says.endswith(f"no step was taken with its rewards. The last checkpoint, {out / 'checkpoints'}/step_000002, "
                         f"is intact: once it is fixed, continue with: llmtrain finetune {out / 'recipe.yaml'} "
                         "--resume auto."), says
    assert [d.name for d in (out / "checkpoints").iterdir()] == ["step_000002"]


def test_an_eval_a_stop_cut_short_scores_at_its_own_step_when_the_resume_runs_it(tiny_assets, tmp_path, monkeypatch):
    """A stop during step 2's eval cuts it (the checkpoint owes it); the resumed run evaluates step 2 first, and the
    reward functions see global_step 2 there, as in the uninterrupted run (0 before any step: the rollout sets it).
    The reward is the step it sees, so the eval lines show it."""
    import signal as signals

    import llmtrain.loop.train as loop
    from llmtrain.errors import Stopped

    (tmp_path / "step_rewards.py").write_text(
        "def step(prompts, completions, trainer_state, **kwargs):\n"
        "    return [float(trainer_state.global_step)] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [{"type": "function", "function": "step_rewards:step"}]},
                         train={"eval_every_steps": 2, "eval_batch_size": 2, "eval_samples": 0},
                         checkpoint={"every_steps": 4})
    run_train(recipe, f"output_dir={tmp_path / 'full'}")
    real, calls = loop.evaluate, []

    def signalled(*args, **kwargs):  # the eval at step 2 (the step-0 eval first): signalled as it starts
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signals.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", signalled)
    with pytest.raises(Stopped, match="SIGTERM at step 2"):
        run_train(recipe)
    monkeypatch.setattr(loop, "evaluate", real)
    run_train(recipe, resume="auto")
    evals = [(e["step"], e["eval_reward"]) for e in records(tmp_path / "run", "eval")]
    assert evals == [(e["step"], e["eval_reward"]) for e in records(tmp_path / "full", "eval")] == \
        [(0, 0.0), (2, 2.0), (4, 4.0)]


@pytest.mark.parametrize("reward, says", [
    ({"type": "answer_match", "column": "solution"},
     "answer_match compares with the column 'solution', which the data does not have"),
    ({"type": "function", "function": "needs_solution:reward"},
     "reward function reward needs the argument 'solution'"),
])
def test_a_reward_reading_a_column_the_data_lack_is_refused_before_the_model_loads(tiny_assets, tmp_path,
                                                                                   monkeypatch, reward, says):
    import llmtrain.loop.train

    (tmp_path / "needs_solution.py").write_text("def reward(prompts, completions, solution, **kwargs):\n"
                                                "    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the rewards were checked")

    monkeypatch.setattr(llmtrain.loop.train, "build_model", no_model)
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [reward]})
    refused = _refused(recipe, tmp_path / "run")
    assert says in refused and "'completion'" in refused  # the column the data have


def test_a_trl_style_reward_function_trains_unchanged(tiny_assets, tmp_path, monkeypatch):
    """TRL's signature, TRL's keyword names: prompts, completions, and the data's columns by name."""
    (tmp_path / "trl_rewards.py").write_text(
        "def reversed_right(prompts, completions, completion, **kwargs):\n"
        "    return [float(c.strip() == want.strip()) for c, want in zip(completions, completion)]\n"
        "def short(completions, **kwargs):\n"
        "    return [-len(c) / 10 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [
        {"type": "function", "function": "trl_rewards:reversed_right"},
        {"type": "function", "function": "trl_rewards:short"}]}, train={"max_steps": 1})
    run_train(recipe, f"output_dir={tmp_path / 'run'}")
    rolled = rollouts(tmp_path / "run")
    assert all(r["short"] == pytest.approx(-len(r["completion"]) / 10) for r in rolled)
    assert all(r["reward"] == pytest.approx(r["short"] + r["reversed_right"]) for r in rolled)


COLLIDING = r"""
import asyncio

import numpy as np


def seen(prompts, completions, completion_ids, trainer_state, labels, length, row, input_ids, **kwargs):
    # the user's columns as the file has them, though data preparation has columns of these names too
    assert all(isinstance(v, str) for v in labels) and all(isinstance(v, list) for v in input_ids)
    return [float(n) + 100 * trainer_state.global_step for n in length]


async def later(completions, completion_ids, row, input_ids, log_extra, **kwargs):
    await asyncio.sleep(0)
    log_extra("their_row", row)
    log_extra("their_input_ids", input_ids)
    return np.array([len(ids) for ids in completion_ids], dtype=float)
"""


def test_columns_named_like_prepared_ones_reach_rewards_unchanged_called_as_trl_calls(tiny_assets, tmp_path,
                                                                                       monkeypatch):
    """A file with columns labels, length, row and input_ids (names data preparation uses for its own): an
    answer_match on `labels` and TRL-style functions (completion_ids, trainer_state, async, a numpy result,
    log_extra) get the user's values, row by row."""
    data = tmp_path / "colliding.jsonl"
    rows = [{"prompt": f"reverse {w} =", "completion": f" {w[::-1]}", "labels": w[::-1], "length": len(w) * 7,
             "row": f"r{i}", "input_ids": [i, i + 1]} for i, w in enumerate(["abc", "hello", "xy", "qrst"] * 2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "colliding_rewards.py").write_text(COLLIDING)
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, data={"path": str(data), "cache_dir": str(tmp_path / "cache"),
                                                      "eval_split": None, "eval_max_examples": None},
                         rl={"rewards": [{"type": "answer_match", "column": "labels"},
                                         {"type": "function", "function": "colliding_rewards:seen"},
                                         {"type": "function", "function": "colliding_rewards:later"}]},
                         train={"max_steps": 2, "eval_every_steps": None, "eval_samples": 0})
    run_train(recipe, f"output_dir={tmp_path / 'run'}")
    rolled = rollouts(tmp_path / "run")
    assert len(rolled) == 2 * 4 * G
    for r in rolled:
        mine = rows[r["row"] - 1]  # rollouts.jsonl's row: 1-based, as the errors count
        assert r["answer_match"] == float(r["completion"].strip() == mine["labels"])
        assert r["seen"] == mine["length"] + 100 * (r["step"] - 1)  # trainer_state.global_step: the steps done
        assert r["later"] == len(r["completion_ids"])
        assert (r["their_row"], r["their_input_ids"]) == (mine["row"], mine["input_ids"])


@pytest.mark.parametrize("reward, says", [
    ({"type": "format", "pattern": "QQQQ"}, "no completion was rewarded (every reward 0)"),
    ({"type": "format", "pattern": ".*"}, "the rewards were 1, each prompt's alike: sample more completions"),
])
def test_steps_that_train_nothing_are_said_once(tiny_assets, tmp_path, reward, says):
    """Every completion rewarded alike (nothing matches; everything does) for 5 steps in a row: every advantage is 0
    and the policy does not move, which the loss (about 0 in any GRPO run) hides. make demo-tools after an SFT that had
    not learned to copy the tool's result ran 40 steps at reward 0.000 without a word; now one warning, at step 5.
    The straight run (rewards that tell completions apart) says nothing of the kind."""
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [reward]},
                         train={"max_steps": 6, "eval_every_steps": None, "eval_samples": 0},
                         logging={"every_steps": 1, "progress": False, "plot": False})
    run_train(recipe, f"output_dir={tmp_path / 'run'}")
    assert all(r["advantage"] == 0 for r in rollouts(tmp_path / "run"))
    log = " ".join((tmp_path / "run" / "train.log").read_text().split())
    assert log.count("every advantage was 0") == 1, log
    assert ("warning (rewards): for 5 steps in a row (to step 5) every prompt's completions got the same reward, so "
            "every advantage was 0 and the policy did not move") in log and says in log


def test_a_run_that_learns_is_not_told_it_does_not(straight):
    _, run, _ = straight
    assert any(r["advantage"] != 0 for r in rollouts(run))
    assert "every advantage was 0" not in (run / "train.log").read_text()


def test_a_reward_that_scores_nothing_is_warned_once_and_has_no_mean(tiny_assets, tmp_path, monkeypatch):
    """A function returning None for every completion: one warning in train.log naming it and the step; no
    rewards/<name>/mean in the train lines nor eval_rewards/<name>/mean in the eval lines (nothing was scored)."""
    (tmp_path / "silent_rewards.py").write_text(
        "def never(completions, **kwargs):\n    return [None] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [
        {"type": "format", "pattern": "[aeiou]"}, {"type": "format", "pattern": "[xyz]", "name": "xyz"},
        {"type": "function", "function": "silent_rewards:never"}]},
        train={"max_steps": 2, "eval_every_steps": 2}, logging={"every_steps": 1, "progress": False, "plot": False})
    run_train(recipe, f"output_dir={tmp_path / 'run'}")
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("reward function never returned None for all 16 completions of step 1") == 1
    assert "completions of step 2" not in log  # said once a run
    train, evals = records(tmp_path / "run"), records(tmp_path / "run", "eval")
    assert all("rewards/format/mean" in t and "rewards/xyz/mean" in t and "rewards/never/mean" not in t
               for t in train)  # two rewards of one type, by their names
    assert [e["step"] for e in evals] == [0, 2]
    assert all("eval_rewards/format/mean" in e and "eval_rewards/never/mean" not in e for e in evals)
    # the only reward scoring nothing: no reward, reward_std nor zero-std group (TRL's nanmean is None, its groups'
    # nanstd NaN); it had logged reward 0.0 and frac_reward_zero_std 1.0 over nothing scored
    alone = grpo_recipe(tiny_assets, tmp_path,
                        rl={"rewards": [{"type": "function", "function": "silent_rewards:never"}]},
                        data={"eval_split": None}, train={"max_steps": 1, "eval_every_steps": None, "eval_samples": 0},
                        logging={"every_steps": 1, "progress": False, "plot": False})
    run_train(alone, f"output_dir={tmp_path / 'alone'}")
    (line,) = records(tmp_path / "alone")
    assert "reward" not in line and "reward_std" not in line and line["frac_reward_zero_std"] == 0.0
    assert "step 1/1  reward -  length " in (tmp_path / "alone" / "train.log").read_text()


def test_a_slow_reward_is_its_own_time_and_not_the_updates(tiny_assets, tmp_path, monkeypatch):
    """A reward function that takes 0.3 s: reward_s says so, and policy_tokens_per_s leaves it out with the sampling
    (a slow grader had read as an update 35 times slower than it was, and no metric named the reward)."""
    (tmp_path / "slow_rewards.py").write_text("import time\n\n\ndef slow(completions, **kwargs):\n"
                                              "    time.sleep(0.3)\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [{"type": "function", "function": "slow_rewards:slow"}]},
                         data={"eval_split": None}, train={"max_steps": 1, "eval_every_steps": None, "eval_samples": 0},
                         logging={"every_steps": 1, "progress": False, "plot": False})
    run_train(recipe, f"output_dir={tmp_path / 'run'}")
    (line,) = records(tmp_path / "run")
    assert 0.3 <= line["reward_s"] < 5
    step_s = line["tokens"] / line["tokens_per_s"]
    assert line["policy_tokens_per_s"] == pytest.approx(
        line["tokens"] / (step_s - line["generation_s"] - line["reward_s"]), rel=1e-6)


def test_a_reward_failing_on_eval_prompts_names_the_eval_file_in_train_log_and_the_folder_is_reusable(
        tiny_assets, tmp_path, monkeypatch):
    """A function that raises on the eval rows only (at the step-0 eval, after the folder is made): the paragraph
    names the eval file and its rows, train.log ends with it, and the folder, with no checkpoint in it, takes the
    corrected run without --overwrite."""
    from llmtrain.errors import LLMTrainError

    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    train_file.write_text("".join(json.dumps({"prompt": f"reverse {w} =", "completion": f" {w[::-1]}",
                                              "part": "train"}) + "\n" for w in ["abc", "hello", "xy", "qrst"]))
    eval_file.write_text("".join(json.dumps({"prompt": f"reverse {w} =", "completion": f" {w[::-1]}",
                                             "part": "eval"}) + "\n" for w in ["ab", "cde"]))
    (tmp_path / "picky_rewards.py").write_text(
        "def picky(completions, part, **kwargs):\n"
        "    if 'eval' in part:\n"
        "        raise ValueError('no eval here')\n"
        "    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, data={"path": str(train_file), "eval_split": str(eval_file),
                                                      "cache_dir": str(tmp_path / "cache")},
                         rl={"rewards": [{"type": "function", "function": "picky_rewards:picky"}]},
                         train={"max_steps": 2, "eval_every_steps": 2})
    run = tmp_path / "run"
    with pytest.raises(LLMTrainError) as e:
        run_train(recipe, f"output_dir={run}")
    says = str(e.value)
    assert ("reward function picky raised ValueError: no eval here at picky_rewards.py:3 in picky (on the "
            f"completions of {eval_file}") in says
    assert "rows 1, 2" in says
    assert (run / "train.log").read_text().rstrip().endswith(f"error: {says}".rstrip().split("\n")[-1])
    assert not list((run / "checkpoints").glob("step_*"))
    run_train(recipe, f"output_dir={run}", "rl.rewards=[{type: format, pattern: '[aeiou]'}]")  # no --overwrite
    assert [r["step"] for r in records(run)] == [1, 2] and "picky" not in (run / "train.log").read_text()


@pytest.mark.parametrize("pairs", [
    {"prompt": "reverse abc =", "chosen": " cba", "rejected": " abc"},
    {"chosen": [{"role": "user", "content": "reverse abc ="}, {"role": "assistant", "content": " cba"}],
     "rejected": [{"role": "user", "content": "reverse abc ="}, {"role": "assistant", "content": " abc"}]}])
def test_an_rl_recipe_on_preference_pairs_says_the_data_look_like_pairs(tiny_assets, tmp_path, pairs):
    data = tmp_path / "pairs.jsonl"
    data.write_text((json.dumps(pairs) + "\n") * 4)
    recipe = grpo_recipe(tiny_assets, tmp_path, data={"path": str(data), "cache_dir": str(tmp_path / "cache")})
    says = _refused(recipe, tmp_path / "run", "data.eval_split=null", "data.eval_max_examples=null")
    assert "look like preference pairs (chosen, rejected)" in says and "data.format: preference" in says
    assert "input_ids" not in says and "labels" not in says  # the columns data preparation adds are not the user's


def test_capped_eval_prompts_keep_their_rows_in_the_file(tiny_tok, tmp_path):
    """data.eval_max_examples takes a seeded shuffle's first rows: each keeps its row in the eval file, which the
    errors and rollouts name (1-based), not its place in the shuffle."""
    from llmtrain.config import DataConfig
    from llmtrain.data.prepare import prepare_datasets

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"reverse {w} =", "completion": w[::-1]}) + "\n"
                             for w in ["ab", "cd", "ef"]))
    words = [f"w{i}" for i in range(10)]
    held.write_text("".join(json.dumps({"prompt": f"reverse {w} =", "completion": w[::-1]}) + "\n" for w in words))
    cfg = DataConfig(path=str(train), format="prompt", eval_split=str(held), eval_max_examples=4, max_seq_len=32,
                     cache_dir=str(tmp_path / "cache"))
    evald = prepare_datasets(cfg, tiny_tok, seed=3)[1]
    assert [words.index(p.split()[1]) for p in evald["prompt"]] == evald["row"]
    assert evald["row"] != [0, 1, 2, 3]  # shuffled: the places in the shuffle are not the rows


def test_two_rewards_of_one_type_need_a_name_and_the_advice_works(tiny_assets, tmp_path):
    from llmtrain.config import load_recipe
    from llmtrain.errors import RecipeError

    two = "rl.rewards=[{type: format, pattern: a}, {type: format, pattern: b}]"
    recipe = grpo_recipe(tiny_assets, tmp_path)
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, [two])
    assert "two rewards share the name 'format'" in str(e.value) and "rl.rewards.1.name=format_2" in str(e.value)
    named = load_recipe(recipe, [two, "rl.rewards.1.name=format_2"])  # the advice, followed as written
    assert [r.label for r in named.rl.rewards] == ["format", "format_2"]
    with pytest.raises(RecipeError, match="name"):
        load_recipe(recipe, [two, "rl.rewards.1.name=a/b"])  # a slash would split the metric's name


@pytest.mark.parametrize("overrides, says", [
    (["lora={r: 4, alpha: 8, dropout: 0}", "rl.beta=0.04", "rl.sync_reference=true"],
     "rl.sync_reference.alpha=0.6 with LoRA: a LoRA run's reference can follow the policy only whole"),
    (["train.micro_batch_tokens=64", "train.micro_batch_size=1"], "unset train.micro_batch_tokens"),
    (["data.format=prompt_completion"], "data.format: prompt and the rl: section go together"),
    (["rl.rewards=[{type: format}]"], "needs pattern"),
])
def test_recipes_that_cannot_run_are_refused_by_the_schema(tiny_assets, tmp_path, overrides, says):
    from llmtrain.config import load_recipe
    from llmtrain.errors import RecipeError

    with pytest.raises(RecipeError, match=says):
        load_recipe(grpo_recipe(tiny_assets, tmp_path), overrides)


def test_estimate_memory_counts_the_samples_kv_cache_and_the_step_over_every_completion(tiny_assets, tmp_path):
    from llmtrain.config import load_recipe
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    recipe = load_recipe(grpo_recipe(tiny_assets, tmp_path), ["train.eval_every_steps=null"])
    spec = spec_from_recipe(recipe)
    assert spec.micro_batch == 4 * G and spec.num_generations == G  # the update is over prompts x completions
    shape = load_model_shape(str(tiny_assets / "model"))
    est = estimate(shape, spec)
    kv = 4 * G * 32 * shape.layers * 2 * shape.kv_heads * shape.head_dim * 4  # fp32, every sequence at 32 tokens
    assert est.phase_parts["generation"]["kv_cache"] == kv
    assert est.phase_parts["generation"].get("gradients", 0) == 0  # freed by the previous step
    sft = estimate(shape, spec.but(num_generations=0, micro_batch=4))  # the same run without its completions
    assert est.phases["backward_layers"] > sft.phases["backward_layers"]


def test_doctor_checks_the_reward_functions_and_the_prompt_room(tiny_assets, tmp_path, monkeypatch):
    from llmtrain.config import load_recipe
    from llmtrain.doctor import run_doctor

    (tmp_path / "doctor_rewards.py").write_text("def fine(prompts, completions, **kw):\n    return [0.0] * "
                                                "len(completions)\ndef broken(prompts, completions, **kw):\n"
                                                "    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path)
    good = dict((n, (s, d)) for n, s, d in run_doctor(load_recipe(recipe, ["rl.rewards=[{type: function, function: "
                                                                            "doctor_rewards:fine}]"])))
    assert good["rewards"][0] == "pass" and good["prompt room"][0] == "pass"
    bad = dict((n, (s, d)) for n, s, d in run_doctor(load_recipe(recipe, ["rl.rewards=[{type: function, function: "
                                                                           "doctor_rewards:broken}]",
                                                                           "rl.max_completion_tokens=30"])))
    assert bad["rewards"][0] == "fail" and "reward function broken raised ZeroDivisionError" in bad["rewards"][1]
    assert bad["prompt room"][0] == "fail" and "rl.max_completion_tokens=30" in bad["prompt room"][1]


def test_fit_sizes_the_micro_batch_in_prompts_each_num_generations_sequences(tiny_assets, tmp_path):
    """--fit searches micro-batches of whole prompts (a preference run's: whole pairs) and proposes them as
    train.micro_batch_size, while the estimate counts every completion's sequence."""
    from llmtrain.config import load_recipe
    from llmtrain.memory.fit import fit
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    recipe = load_recipe(grpo_recipe(tiny_assets, tmp_path), ["train.eval_every_steps=null"])
    shape = load_model_shape(str(tiny_assets / "model"))
    result = fit(shape, spec_from_recipe(recipe).but(gpu_memory_gib=1.5), global_batch=None)
    best = result.best.spec
    proposed = int(next(o for o in result.overrides if o.startswith("train.micro_batch_size=")).split("=")[1])
    assert best.micro_batch == proposed * G and proposed >= 1


def test_inspect_data_shows_the_prompt_and_what_goes_to_the_rewards(tiny_assets, tmp_path):
    from helpers import invoke

    out = invoke("inspect-data", str(grpo_recipe(tiny_assets, tmp_path)), "--n", "1").stdout
    first = json.loads((tiny_assets / "data" / "train.jsonl").read_text().splitlines()[0])
    assert "prompt, row 1:" in out and "(completions are sampled)" in out and first["prompt"] in out
    assert f"to the rewards: completion={first['completion']!r}" in out
    assert "prompts" in out and "trained-token fraction" not in out


def test_eval_reward_is_the_mean_of_the_scored_completions_as_the_train_lines_and_trls(tiny_assets, tmp_path,
                                                                                          monkeypatch):
    """A reward function may return None ("does not apply", TRL's multi-task pattern): a completion none scores is
    left out of the eval's mean as it is of the train lines' reward and TRL's nanmean. It had counted as 0 (audit 6:
    eval_reward 0.495 where every scored completion had 1.0)."""
    (tmp_path / "even_rewards.py").write_text(
        "def even(prompts, completions, **kwargs):\n"
        "    return [1.0 if len(c) % 2 == 0 else None for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [{"type": "function", "function": "even_rewards:even"}],
                                                    "num_generations_eval": 4},
                         data={"eval_max_examples": 16}, train={"max_steps": 1, "eval_every_steps": 1})
    run_train(recipe)
    evals = records(tmp_path / "run", kind="eval")
    (train,) = records(tmp_path / "run")
    assert train["reward"] == 1.0
    for ev in evals:
        assert ev["eval_reward"] == ev["eval_rewards/even/mean"] == 1.0, ev


def test_reward_std_holds_for_rewards_far_from_zero(tiny_assets, tmp_path, monkeypatch):
    """reward_std comes from the step's sums of squares, kept in float64: in float32 rewards of 1000 +- 0.05 cancelled
    to a std of 0.0 (0.052 true) and 1000 +- 0.5 were 4.5% off (audit 6). Against the std of rollouts.jsonl's rewards
    (TRL's nanstd: unbiased)."""
    import statistics

    (tmp_path / "far_rewards.py").write_text(
        "def far(prompts, completions, **kwargs):\n"
        "    return [1000.0 + 0.01 * (len(c) % 11) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tiny_assets, tmp_path, rl={"rewards": [{"type": "function", "function": "far_rewards:far"}]},
                         data={"eval_split": None}, train={"max_steps": 1, "eval_every_steps": None})
    run_train(recipe)
    (line,) = records(tmp_path / "run")
    rewards = [r["reward"] for r in rollouts(tmp_path / "run")]
    assert statistics.stdev(rewards) > 0.01
    assert line["reward_std"] == pytest.approx(statistics.stdev(rewards), rel=1e-4)
