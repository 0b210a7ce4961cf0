"""GRPO with tools through the training loop (issue 57): the tiny model, taught by a short SFT run on the demo's
conversations (llmtrain/tiny.write_tool_data: a third call `lookup`, the others answer from memory) samples
completions, some of which call the CodeBook environment's `lookup` (rl.environment: an instance per completion,
reset with its row's word); the calls run, their results are appended and masked out of the loss; rollouts.jsonl
and the metrics say so; a run killed like kill -9 resumes to the same completions, tool calls included; two
processes sample and train what one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import invoke, launch_finetune, load_weights, losses, max_abs_diff, records, run_train, write_recipe
from test_grpo_run import CPU_DDP, killed_and_resumed, rollouts

from llmtrain.tiny import code_of

pytestmark = pytest.mark.long(120)  # tests/conftest.py


def tools_data(tiny: Path, **more) -> dict:
    return {"chat_template": str(tiny / "data" / "tools.jinja"), "max_seq_len": 160, **more}


@pytest.fixture(scope="module")
def caller(tiny_assets, tmp_path_factory) -> Path:
    """The tiny model after 120 steps of SFT on the demo's conversations: it calls lookup now and then."""
    tmp = tmp_path_factory.mktemp("tools-sft")
    recipe = write_recipe(tiny_assets, tmp, data=tools_data(
        tiny_assets, path=str(tiny_assets / "data" / "train_tools.jsonl"), format="messages"),
        train={"max_steps": 120, "micro_batch_size": 8, "lr": 3e-3, "warmup_steps": 10})
    run_train(recipe, f"output_dir={tmp / 'sft'}")
    return tmp / "sft" / "final"


def tools_recipe(tiny: Path, model: Path, tmp: Path) -> Path:
    data = tools_data(tiny, path=str(tiny / "data" / "train_tool_prompts.jsonl"), format="prompt",
                      eval_split=str(tiny / "data" / "eval_tool_prompts.jsonl"), eval_max_examples=4)
    rl = {"num_generations": 4, "max_completion_tokens": 96, "temperature": 1.0,
          "environment": "llmtrain.tiny:CodeBook",
          "rewards": [{"type": "answer_match", "column": "answer"},
                      {"type": "format", "pattern": "<call>", "weight": 0.5}]}
    return write_recipe(tiny, tmp, model={"name_or_path": str(model), "dtype": "float32"}, data=data, rl=rl,
                        train={"max_steps": 4, "micro_batch_size": 2, "lr": 1e-3, "eval_every_steps": 4},
                        checkpoint={"every_steps": 2, "keep_last": 3})


@pytest.fixture(scope="module")
def straight(caller, tiny_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools-grpo")
    recipe = tools_recipe(tiny_assets, caller, tmp)
    run_train(recipe, f"output_dir={tmp / 'straight'}")
    return recipe, tmp / "straight"


def test_a_run_with_tools_runs_the_calls_and_trains_only_what_the_model_wrote(straight, tiny_assets):
    from transformers import AutoTokenizer

    _, run = straight
    tok = AutoTokenizer.from_pretrained(run / "final")
    rows = rollouts(run)
    called = [r for r in rows if r["tool_calls"]]
    assert len(called) >= 3  # the SFT run taught it to call now and then
    for r in called:
        word = r["prompt"].split("code of ")[1][:4]  # the row's word, which its CodeBook was reset with
        for call in r["tool_calls"]:
            assert call["name"] == "lookup" and call["result"] == code_of(word)
        results = tok.decode([t for t, m in zip(r["completion_ids"], r["tool_mask"]) if not m])
        assert results == "".join(f"<|USER|><result>{c['result']}</result><|ASSISTANT|>" for c in r["tool_calls"])
        assert "<result>" not in tok.decode([t for t, m in zip(r["completion_ids"], r["tool_mask"]) if m])
    train = records(run, "train")
    for step in (1, 2, 3, 4):
        mine = [r for r in rows if r["step"] == step]
        line = next(t for t in train if t["step"] == step)
        assert line["tools/call_frequency"] == pytest.approx(sum(len(r["tool_calls"]) for r in mine) / len(mine))
        assert line["completions/mean_length"] == pytest.approx(sum(sum(r["tool_mask"]) for r in mine) / len(mine))
    assert any(t["grad_norm"] > 0 for t in train)
    printed = (run / "train.log").read_text()
    assert ("tools: CodeBook.lookup (an instance a completion), called as the template writes calls (<call> with "
            "'name' and 'arguments')") in printed


def test_generate_runs_a_runs_tools_as_its_rollouts_did(straight, tiny_assets, tmp_path):
    """`llmtrain generate` on a run that sampled with tools renders the prompts showing them, resets the run's
    environment with each --prompts row's columns (its word) and runs each reply's calls: the word's code follows the
    call, as in the rollouts, and the reply goes on after it. With --no-tools each reply is its first turn alone: the
    same tokens up to where the tooled one's results begin (a completion depends only on its seed and prompt)."""
    from transformers import AutoTokenizer

    _, run = straight
    tok = AutoTokenizer.from_pretrained(run / "final")
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join((tiny_assets / "data" / "eval_tool_prompts.jsonl").read_text().splitlines(True)[:16]))
    # this run's model writes a well-formed call now and then (after 120 SFT steps and 4 GRPO steps: 0 to 4 of 64
    # replies a seed, as the host's arithmetic trained it): seeds until two replies have called
    tooled, plain, printed = [], [], ""
    for seed in range(10):
        out, alone = tmp_path / f"tools{seed}.jsonl", tmp_path / f"alone{seed}.jsonl"
        printed += invoke("generate", str(run), "--prompts", str(rows), "--samples", "4", "--seed", str(seed),
                          "--out", str(out)).stdout
        invoke("generate", str(run), "--prompts", str(rows), "--samples", "4", "--seed", str(seed), "--no-tools",
               "--out", str(alone))
        tooled += [json.loads(x) for x in out.read_text().splitlines()]
        plain += [json.loads(x) for x in alone.read_text().splitlines()]
        called = [r for r in tooled if r["calls"]]
        if len(called) >= 2:
            break
    assert len(tooled) % 64 == 0 and len(called) >= 2, len(called)
    for r in called:
        word = r["prompt"][-1]["content"].split("code of ")[1][:4]
        assert [c["name"] for c in r["calls"]] == ["lookup"] * len(r["calls"])
        assert all(c["result"] == code_of(word) for c in r["calls"])
        assert f"<result>{code_of(word)}</result>" in tok.decode(r["tokens"])
        assert [m["role"] for m in r["messages"][:2]] == ["assistant", "tool"]
        assert f"tool call: lookup({{}}) -> {code_of(word)}" in printed
    for t, p in zip(tooled, plain):
        assert "calls" not in p and t["tokens"][:len(p["tokens"])] == p["tokens"]
        assert (t["tokens"] == p["tokens"]) == (not t["calls"])


def test_generate_on_a_tool_run_takes_system_and_refuses_no_chat(straight, tmp_path, monkeypatch):
    """--system on a tool run's prompts: they are rendered as its RL prompts were (the chat template showing the
    tools), with the given system message in place of the run's; --no-chat is refused in one paragraph (its prompts
    show the tools through the template), before any reply is sampled."""
    from llmtrain.run import replies

    _, run = straight
    source = replies.load_source(str(run), device="cpu")
    seen = []

    def fake(model, prompts, **kwargs):  # the prompts as the sampler gets them; no reply
        seen.extend(prompts)
        return [[] for _ in prompts]

    monkeypatch.setattr("llmtrain.model.fast_sample.sampler_for", lambda *a, **k: fake)
    rows = [{"prompt": [{"role": "user", "content": "the code of abcd?"}]}]
    replies.generate_replies(source, rows, samples=1, tools=False)
    replies.generate_replies(source, rows, samples=1, tools=False, system_prompt="Answer with the code alone.")
    plain, told = (source.tokenizer.decode(ids) for ids in seen)
    assert "Answer with the code alone." in told and "Answer with the code alone." not in plain
    assert "lookup" in plain and "lookup" in told  # the tools' schema shown either way
    # a row's own system message: --system replaces it, as on a run without tools (it had stayed; audit 42's review)
    own = [{"role": "system", "content": "Be long."}, *rows[0]["prompt"]]
    replies.generate_replies(source, [{"prompt": own}], samples=1, tools=False, system_prompt="Answer with the code "
                             "alone.")
    replaced = source.tokenizer.decode(seen[-1])
    assert "Answer with the code alone." in replaced and "Be long." not in replaced
    refused = invoke("generate", str(run), "the code of abcd?", "--no-chat", check=False)
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2 and "--no-chat" in said and "Leave --no-chat out" in said, said
    assert "Traceback" not in refused.stdout + refused.stderr


@pytest.mark.extended  # main tier: the straight run above
@pytest.mark.slow
def test_a_run_with_tools_killed_mid_run_resumes_to_the_same_completions_and_calls(straight, tmp_path):
    recipe, full = straight
    killed_and_resumed(recipe, full, tmp_path / "cut")
    assert any(r["tool_calls"] for r in rollouts(tmp_path / "cut") if r["step"] > 2)


@pytest.mark.extended
@pytest.mark.slow
def test_two_processes_with_tools_sample_and_train_what_one_does(straight, tmp_path, free_port):
    recipe, one = straight
    two = tmp_path / "two"
    launch_finetune(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", "train.micro_batch_size=1")
    keys = ("step", "row", "completion_ids", "tool_mask", "tool_calls", "reward")
    assert [[r[k] for k in keys] for r in rollouts(two)] == [[r[k] for k in keys] for r in rollouts(one)]
    assert losses(two) == pytest.approx(losses(one), abs=1e-6)
    assert max_abs_diff(load_weights(two / "final"), load_weights(one / "final")) < 1e-5
    assert json.loads((two / "final" / "config.json").read_text())["model_type"] == "llama"


COUNTING = """import os

from llmtrain.tiny import CodeBook


def _note(what):
    with open(os.environ["COUNTING_FILE"], "a") as f:
        f.write(f"{os.environ['RANK']} {what}\\n")


def calls(completions, completion_ids, **kwargs):
    # the start-up check's every other completion is empty
    _note(f"reward {len(completions)}" if all(completion_ids) else "check")
    return [0.0] * len(completions)


class CountingBook(CodeBook):
    def reset(self, prompt=None, word="", **columns):
        _note("reset")
        return super().reset(prompt, word, **columns)

    def lookup(self) -> str:
        \"\"\"Look up the secret code of the word in question.\"\"\"
        _note("lookup")
        return super().lookup()
"""


def _counting(recipe: Path, tmp_path: Path) -> tuple[Path, Path, dict]:
    """The tool run's recipe with COUNTING's environment and a reward function that note each call by rank: (the
    recipe, the notes' file, the environment a launch needs to import them and write there)."""
    import os

    import yaml
    from helpers import ENV

    (tmp_path / "counting.py").write_text(COUNTING)
    spec = yaml.safe_load(recipe.read_text())
    spec["rl"]["environment"] = "counting:CountingBook"
    spec["rl"]["rewards"].append({"type": "function", "function": "counting:calls", "weight": 0.0})
    counted = tmp_path / "recipe.yaml"
    counted.write_text(yaml.safe_dump(spec))
    notes = tmp_path / "calls.txt"
    return counted, notes, {**ENV, "COUNTING_FILE": str(notes),
                            "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV.get("PYTHONPATH", "")])}


@pytest.mark.extended  # main tier: test_tools_grpo's pair in one process (GRPO.user_code), test_tp.py's LoRA
@pytest.mark.slow  # under FSDP x TP (the split model's forward), the SP rollouts (collectives.on_first)
def test_under_fsdp_x_tp_the_users_code_runs_once_a_completion_and_samples_what_one_process_does(
        straight, tmp_path, free_port):
    """2 shards x 2 tensor-parallel processes: each pair samples the same completions, but its reward functions,
    environments' resets and tool calls run on the pair's first process (ranks 0 and 2) alone, once a completion,
    and the start-up check of the reward functions on the main process alone; the run samples, calls and trains
    what one process does."""
    from helpers import REPO

    recipe, one = straight
    counted, notes, env = _counting(recipe, tmp_path)
    tp = tmp_path / "tp"
    launch_finetune(REPO / "accelerate_configs" / "cpu_tp.yaml", 4, free_port, counted, f"output_dir={tp}",
                    "train.micro_batch_size=1", env=env)
    keys = ("step", "row", "completion_ids", "tool_mask", "tool_calls", "reward")
    rows = rollouts(tp)
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in rollouts(one)]
    assert losses(tp) == pytest.approx(losses(one), abs=1e-5)
    lines = [line.split(" ", 1) for line in notes.read_text().splitlines()]
    assert {rank for rank, _ in lines} == {"0", "2"}  # the pairs' first processes only
    said = [what for _, what in lines]
    assert said.count("reward 4") == 8  # 4 steps x 2 pairs, each 1 prompt x 4 completions
    assert lines[0] == ["0", "check"] and said.count("check") == 1  # the start-up check: the main process's alone
    assert said.count("lookup") == sum(len(r["tool_calls"]) for r in rows) > 0
    assert said.count("reset") >= len(rows)  # each completion's (and the eval's)


@pytest.mark.parametrize("overrides, says", [
    (["data.chat_template=true"], "the chat template does not write tool calls as JSON"),
    (["rl.tools=[no_such_module:f]"], "the tool 'no_such_module:f' cannot be imported"),
    (["rl.environment=llmtrain.tiny:code_of"], "is not a class with a reset method"),
    (["rl.environment=llmtrain.tiny:NoSuch"], "rl.environment 'llmtrain.tiny:NoSuch' cannot be imported .* Name it "
                                              "as module:Class"),
    (["rl.tools=[llmtrain.tiny:near_miss]"], "cannot be described to the model"),
])
def test_bad_tools_are_refused_in_one_paragraph_before_anything_is_written(tiny_assets, tmp_path, overrides, says):
    """The tiny model's own template has no tools; a tool that cannot be imported; an environment that is not a
    class; a function without an Args docstring: each refused before the run folder exists."""
    from llmtrain.errors import LLMTrainError

    recipe = tools_recipe(tiny_assets, tiny_assets / "model", tmp_path)
    with pytest.raises(LLMTrainError, match=says) as e:
        run_train(recipe, *overrides, f"output_dir={tmp_path / 'run'}")
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_trls_loss_on_the_runs_completions_equals_the_logged_loss_and_grad_norm(straight, caller, tiny_assets,
                                                                                 tmp_path):
    """TRL 1.16's GRPOTrainer._compute_loss, given the model a step started from (the SFT model for step 1, the
    step-2 checkpoint's weights for step 3) and that step's rollouts as rollouts.jsonl keeps them (prompts,
    completions with the tools' results, advantages) with their tool_mask as TRL's: the loss and the gradient norm
    the run logged for the step (each step whose advantages are not all 0)."""
    import torch
    from safetensors.torch import load_file
    from test_grpo import padded_inputs, trl_trainer
    from transformers import AutoModelForCausalLM

    _, run = straight
    compared = 0
    for step, weights in ((1, None), (3, run / "checkpoints" / "step_000002" / "model.safetensors")):
        rows = [r for r in rollouts(run) if r["step"] == step]
        if not any(r["tool_calls"] for r in rows) or len({r["advantage"] for r in rows}) == 1:
            continue  # nothing to train on at this step
        model = AutoModelForCausalLM.from_pretrained(caller, dtype=torch.float32, attn_implementation="eager")
        if weights is not None:
            model.load_state_dict(load_file(weights))
        model.train()
        trainer = trl_trainer(model, tiny_assets, tmp_path / str(step), loss_type="dapo", beta=0.0)
        trainer.max_completion_length = 96
        inputs = padded_inputs([r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows],
                               torch.tensor([r["advantage"] for r in rows]), pad=trainer.processing_class.pad_token_id)
        width = inputs["completion_ids"].shape[1]
        inputs["tool_mask"] = torch.tensor([r["tool_mask"] + [1] * (width - len(r["tool_mask"])) for r in rows])
        inputs["num_items_in_batch"] = (inputs["completion_mask"] * inputs["tool_mask"]).sum()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        # per tensor, then over the tensors, as clip_grad_norm_ takes it (one fp32 norm over all 518,784 entries
        # of a torch.cat is 9e-5 off the float64 value here; this way, 2e-7)
        norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm().item()
        logged = next(t for t in records(run, "train") if t["step"] == step)
        assert loss.item() == pytest.approx(logged["loss"], abs=1e-5)
        assert norm == pytest.approx(logged["grad_norm"], rel=1e-5) and norm > 1e-3
        compared += 1
    assert compared  # at least one of the two steps had rewards that differ


@pytest.mark.slow
def test_on_two_stages_the_users_code_runs_on_the_first_stage_and_samples_what_one_process_does(
        straight, tmp_path, free_port):
    """A tool loop on 2 pipeline stages (refused before 2026-12-05): both stages sample the same turns through the
    stages, the environments' resets, tool calls and reward functions run on the first stage alone (rank 0), their
    results given to the last (collectives.on_sampling_group_first), the results' tokens masked out of the last
    stage's loss. Against one process: the same completions, tool masks, calls and rewards, losses to 1e-5."""
    recipe, one = straight
    counted, notes, env = _counting(recipe, tmp_path)
    pp = tmp_path / "pp"
    out = launch_finetune(CPU_DDP, 2, free_port, counted, f"output_dir={pp}", "parallel.pipeline_parallel=2",
                          "parallel.pipeline_schedule=gpipe", "rl.sampler=reference", "rl.micro_batch_tokens=512",
                          "model.attn_implementation=auto", "train.eval_batch_size=null", env=env)
    assert "sampled through the stages" in out
    keys = ("step", "row", "completion_ids", "tool_mask", "tool_calls", "reward")
    rows = rollouts(pp)
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in rollouts(one)]
    assert sum(len(r["tool_calls"]) for r in rows) > 0 and any(0 in r["tool_mask"] for r in rows)
    assert losses(pp) == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
    evals = [records(run, "eval") for run in (pp, one)]  # steps 0 and 4, sampled with tools
    assert [r["step"] for r in evals[0]] == [r["step"] for r in evals[1]] == [0, 4]
    assert [r["eval_reward"] for r in evals[0]] == pytest.approx([r["eval_reward"] for r in evals[1]], abs=1e-6)
    assert max(losses(one)) > 0.1 or min(losses(one)) < -0.1  # a step trained (the completions after it agree)
    lines = [line.split(" ", 1) for line in notes.read_text().splitlines()]
    assert {rank for rank, _ in lines} == {"0"}  # the first stage's process only
    said = [what for _, what in lines]
    assert said.count("reward 8") == 4  # 4 steps, each 2 prompts x 4 completions
    assert said.count("lookup") == sum(len(r["tool_calls"]) for r in rows)
