"""GRPO and RLOO with tools (issue 57, rl.tools): a sampled turn's tool calls read back as the chat template writes
them (data/tools.call_syntax, parse_turn), run (objectives/tool_calls.Tools), their results appended as the template
renders tool messages (tool_suffix_ids) and the completion sampled on (sample_with_tools), the results' tokens
masked out of the loss. Checked against TRL 1.16's GRPOTrainer: its _get_tool_suffix_ids, its _tool_call_loop given
the same sampled turns (the same completion ids, tool_mask, calls and failures), and its loss and gradient with the
tool_mask on llmtrain's completions."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from test_chat_templates import stand_in_tokenizer
from test_tools_sft import tokenizer_for

from llmtrain.data.tools import call_syntax, parse_turn, schema_of, tool_suffix_ids
from llmtrain.errors import LLMTrainError
from llmtrain.model.generate import Drawn
from llmtrain.objectives.tool_calls import Tools, sample_with_tools


# ---- the tools the tests call (TRL's contract: type hints and a docstring with Args)

def lookup(word: str) -> str:
    """Look up a word's code.

    Args:
        word: the word
    """
    return word[::-1].upper()


def fail(word: str) -> str:
    """A tool that always fails.

    Args:
        word: the word
    """
    raise ValueError(f"no code for {word}")


async def alookup(word: str) -> str:
    """Look up a word's code, asynchronously.

    Args:
        word: the word
    """
    await asyncio.sleep(0)
    return word.upper()


def slow(word: str) -> str:
    """A tool that takes too long.

    Args:
        word: the word
    """
    time.sleep(2)
    return word


TOOLS = [f"test_tools_grpo:{name}" for name in ("lookup", "fail", "alookup", "slow")]
TEMPLATES = ["qwen2.5-7b-instruct", "qwen3-8b", "llama-3.1-8b-instruct", "mistral"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_each_template_s_tool_calls_are_read_back_as_it_writes_them(name):
    """Render a turn with two calls (Llama 3.1: one, its template allows no more) through the template; what the
    model would write after the generation prompt parses back to the same calls."""
    from llmtrain.data.chat import _apply, end_of_turn

    tok = tokenizer_for(name)
    calls = [{"type": "function", "id": "abcdefghi", "function": {"name": "lookup", "arguments": {"word": "apple"}}},
             {"type": "function", "id": "bcdefghij", "function": {"name": "fail", "arguments": {"word": "x y"}}}]
    calls = calls[:1] if name.startswith("llama") else calls
    user = [{"role": "user", "content": "code of apple?"}]
    prompt = _apply(tok, user, None, generation_prompt=True)
    text = _apply(tok, user + [{"role": "assistant", "content": "", "tool_calls": calls}], None,
                  generation_prompt=False)
    turn = text[len(prompt):text.index(end_of_turn(tok), len(prompt))]
    syntax = call_syntax(tok)
    got = parse_turn(turn, syntax)
    want = [{k: v for k, v in c.items() if k != "id" or syntax.shows_id} for c in calls]
    assert got.calls == want and not got.unreadable
    assert syntax.shows_id == (name == "mistral")
    assert parse_turn("The code is 42.", syntax).calls == []


def test_only_call_blocks_that_end_the_turn_are_run_as_trl_reads_them():
    """A JSON object in prose after the calls had been run as a call, and Llama 3.1's turn of two objects as two calls
    (audit 25); TRL reads Qwen's <tool_call>...</tool_call> blocks at the turn's end and Llama's turn that is one
    object. Such turns are text: no call runs (counted unreadable)."""
    qwen = call_syntax(stand_in_tokenizer("qwen2.5-7b-instruct"))
    assert (qwen.opener, qwen.closer) == ("<tool_call>", "</tool_call>")
    call = '<tool_call>\n{"name": "lookup", "arguments": {"word": "apple"}}\n</tool_call>'
    boom = '{"name": "boom", "arguments": {"word": "x"}}'
    assert [c["function"]["name"] for c in parse_turn(f"Let me see.\n{call}\n{call}", qwen).calls] == ["lookup"] * 2
    mentioned = parse_turn(f"{call}\nFor example the JSON {boom} would fail.", qwen)
    assert mentioned.calls == [] and mentioned.unreadable
    assert parse_turn(f"{call} and then", qwen).calls == []
    llama = call_syntax(stand_in_tokenizer("llama-3.1-8b-instruct"))
    one = '{"name": "lookup", "parameters": {"word": "apple"}}'
    assert [c["function"]["name"] for c in parse_turn(one, llama).calls] == ["lookup"]
    two = parse_turn(f"{one} and {boom}", llama)
    assert two.calls == [] and two.unreadable


def test_a_reasoning_block_is_moved_out_of_the_content_as_trls_response_parser_moves_it():
    """Qwen3 with rl.tools: TRL parses each turn with its response schema (trl.chat_template_utils.qwen3_schema), the
    reasoning block's text into reasoning_content (none where it is empty), the content after it; reward functions
    had got '<think>...</think>The answer is 5.' as the content (audit 30)."""
    tok = stand_in_tokenizer("qwen3-8b")
    tools = Tools(TOOLS[:1], tokenizer=tok, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])

    def message(text):
        return tools.parse(tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]).message()

    assert message("<think>\nAdd them.\n</think>\n\nThe answer is 5.") == {
        "role": "assistant", "content": "The answer is 5.", "reasoning_content": "Add them."}
    assert message("<think>\n\n</think>\n\nThe answer is 5.") == {"role": "assistant", "content": "The answer is 5."}
    called = message('<think>\nLook it up.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": '
                     '{"word": "apple"}}\n</tool_call>')
    assert called["content"] == "" and called["reasoning_content"] == "Look it up."
    assert [c["function"]["name"] for c in called["tool_calls"]] == ["lookup"]


def test_a_sampled_mistral_call_whose_id_the_template_refuses_is_text():
    """Mistral's template raises on a call id that is not 9 letters and digits: a sampled call without one (or with
    "abc") had stopped the whole run mid-rollout (audit 25). Such a turn is text, none of its calls run."""
    tok = tokenizer_for("mistral")
    tools = Tools(TOOLS[:1], tokenizer=tok, stop_ids=[tok.eos_token_id])

    def turn(text):
        return tools.parse(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])

    good = turn('[TOOL_CALLS] [{"name": "lookup", "arguments": {"word": "apple"}, "id": "abcdefghi"}]')
    assert [c["function"]["name"] for c in good.calls] == ["lookup"] and not good.unreadable
    for bad in ('[TOOL_CALLS] [{"name": "lookup", "arguments": {"word": "apple"}}]',
                '[TOOL_CALLS] [{"name": "lookup", "arguments": {"word": "apple"}, "id": "abc"}]'):
        t = turn(bad)
        assert t.calls == [] and t.unreadable


def test_a_template_without_tool_calls_is_refused_in_one_paragraph():
    with pytest.raises(LLMTrainError, match="does not write tool calls") as e:
        call_syntax(stand_in_tokenizer("gemma-3-4b-it"))
    assert "\n" not in str(e.value)


def trl_stand_in(tok, **more):
    """What TRL's GRPOTrainer methods read off the trainer, for calling them unbound."""
    from types import SimpleNamespace

    return SimpleNamespace(processing_class=tok, _tokenizer=tok, _is_vlm=False, chat_template=None,
                           chat_template_kwargs={}, **more)


@pytest.mark.parametrize("name", ["qwen2.5-7b-instruct", "llama-3.1-8b-instruct"])
def test_tool_results_are_appended_as_trls_suffix(name):
    """(Qwen3's own template: TRL's _get_tool_suffix_ids raises, its history renders the turn without the reasoning
    block the last turn has; TRL swaps in a training template. llmtrain appends after the call's end of turn: the
    same result text as Qwen2.5's, checked in the loop test's template family.)"""
    trl = pytest.importorskip("trl")
    tok = stand_in_tokenizer(name)
    messages = [{"role": "tool", "name": "lookup", "content": "ELPPA"},
                {"role": "tool", "name": "fail", "content": str({"error": "no code for x"})}]
    theirs = trl.GRPOTrainer._get_tool_suffix_ids(trl_stand_in(tok), messages)
    assert tool_suffix_ids(tok, None, messages) == theirs
    assert "ELPPA" in tok.decode(theirs)


# ---- the loop: scripted turns in place of the sampler, so TRL's loop can be given the same ones

QWEN_CALL = '<tool_call>\n{{"name": "{}", "arguments": {{"word": "{}"}}}}\n</tool_call>'
SCRIPT = [  # each row's turns, in order; the sampler's stop token (<|im_end|>) ends each
    [QWEN_CALL.format("lookup", "apple"), "The code is ELPPA."],
    ["No tool needed."],
    [QWEN_CALL.format("lookup", "pear") + "\n" + QWEN_CALL.format("nope", "pear"), "Done."],  # an unknown tool
    [QWEN_CALL.format("fail", "fig"), QWEN_CALL.format("alookup", "fig"), "FIG it is."],  # two rounds
    ['<tool_call>\n{"name": "lookup", "argu\n</tool_call>'],  # unreadable: text, no call run
    [QWEN_CALL.format("lookup", "kiwi"), "a reply far too long " * 40],  # cut at max_completion_tokens
]
MAX_NEW = 400


class Scripted:
    """generate(prompts, seeds, max_new_tokens) playing SCRIPT: which row a prompt is, by its first tokens; which
    turn, by how many it has had. The stop token ends a turn that fits; a turn longer than max_new_tokens is cut."""

    def __init__(self, tok, prompts):
        self.tok, self.prompts, self.turns = tok, prompts, [0] * len(prompts)
        self.stop = tok.convert_tokens_to_ids("<|im_end|>")
        self.seeds = []

    def row(self, ids):
        return next(i for i, p in enumerate(self.prompts) if ids[:len(p)] == p)

    def __call__(self, prompts, seeds, max_new_tokens):
        self.seeds.append(list(seeds))
        out = []
        for ids in prompts:
            i = self.row(ids)
            text = SCRIPT[i][self.turns[i]]
            self.turns[i] += 1
            out.append((self.tok(text, add_special_tokens=False)["input_ids"] + [self.stop])[:max_new_tokens])
        return out


def qwen_prompts(tok, schemas):
    words = ["apple", "plum", "pear", "fig", "lime", "kiwi"]
    return [tok(tok.apply_chat_template([{"role": "user", "content": f"code of {w}?"}], tools=schemas,
                                        add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for w in words]


def test_the_loop_runs_each_call_and_masks_the_results_as_trls_tool_call_loop_does():
    """TRL's _tool_call_loop (on a stand-in trainer, its first turns parsed by its parse_response) and llmtrain's
    sample_with_tools, given the same sampled turns: the same completion ids, tool_mask, calls and failures; the
    results' text TRL's ({'error': ...} for a raising or unknown tool); the conversation the rewards get."""
    trl = pytest.importorskip("trl")
    from trl.chat_template_utils import add_response_schema, parse_response

    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    tools = Tools(TOOLS[:3], tokenizer=tok, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    schemas = [schema_of(t) for t in TOOLS[:3]]
    prompts = qwen_prompts(tok, schemas)
    ours_script = Scripted(tok, prompts)
    ours = sample_with_tools(ours_script, prompts, [10 + i for i in range(6)], tools=tools, max_new_tokens=MAX_NEW,
                             max_rounds=None)

    add_response_schema(tok)
    theirs_script = Scripted(tok, prompts)
    first = theirs_script(prompts, [0] * 6, MAX_NEW)
    functions = {"lookup": lookup, "fail": fail}
    stand_in = trl_stand_in(
        tok, max_tool_calling_iterations=10**9, max_completion_length=MAX_NEW, use_vllm=False,
        environment_factories=None,
        tools=[lookup, fail, alookup], _sync_tool_dicts=[functions] * 6, _async_tool_dicts=[{"alookup": alookup}] * 6,
        model=type("M", (), {"config": type("C", (), {"max_position_embeddings": 4096})()})(),
        _generate_single_turn=lambda ids, *a, **k: (theirs_script(ids, [0] * len(ids), MAX_NEW), None))
    stand_in._get_tool_suffix_ids = lambda messages: trl.GRPOTrainer._get_tool_suffix_ids(stand_in, messages)
    from trl.trainer.utils import start_event_loop_in_daemon

    _, stand_in.async_loop, ready = start_event_loop_in_daemon(name="test-tools")
    ready.wait()
    completions = [[parse_response(tok, ids, prefix=p, tools=schemas)] for ids, p in zip(first, prompts)]
    chats = [[{"role": "user", "content": "x"}] for _ in prompts]
    mask, theirs_messages, ids, _, calls, failures, _ = trl.GRPOTrainer._tool_call_loop(
        stand_in, chats, prompts, [list(c) for c in first], completions, None, None, {})

    assert [o.ids for o in ours] == ids
    assert [o.mask for o in ours] == mask
    assert sum(len(o.calls) for o in ours) == calls == 6  # apple, pear x2, fig x2, kiwi
    assert sum(o.failures for o in ours) == failures == 2  # the unknown tool, the raising one
    assert [[m["content"] for m in o.messages if m["role"] == "tool"] for o in ours] == [
        [m["content"] for m in t if m["role"] == "tool"] for t in theirs_messages]
    assert ours[2].messages[2]["content"] == str({"error": "Tool nope not found."})
    assert ours[3].messages[1]["content"] == str({"error": "no code for fig"})
    assert ours[3].messages[3]["content"] == "FIG"
    assert [m["role"] for m in ours[3].messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert ours[3].messages[0]["tool_calls"] == [{"type": "function", "function": {"name": "fail",
                                                                                    "arguments": {"word": "fig"}}}]
    assert ours[4].unreadable == 1 and ours[4].calls == [] and len(ours[4].messages) == 1
    assert len(ours[5].ids) == MAX_NEW and ours[5].ids[-1] != tools.stop_ids  # cut at the limit: clipped
    assert sum(ours[0].mask) < len(ours[0].ids) and tok.decode(
        [t for t, m in zip(ours[0].ids, ours[0].mask) if not m]).count("ELPPA") == 1
    # the rounds after a result have their own seeds (a pure function of the completion's and the round)
    assert ours_script.seeds[0] == [10 + i for i in range(6)] and ours_script.seeds[1][0] not in range(10, 16)


def test_a_round_whose_results_would_not_fit_stops_and_max_tool_calls_stops_the_rounds():
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    tools = Tools(TOOLS[:3], tokenizer=tok, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    prompts = qwen_prompts(tok, None)
    full = sample_with_tools(Scripted(tok, prompts), prompts, list(range(6)), tools=tools, max_new_tokens=MAX_NEW,
                             max_rounds=None)
    first_turn = len(full[0].ids) - len(full[0].mask) + sum(full[0].mask)  # all of row 0 before its result
    tight = sample_with_tools(Scripted(tok, prompts), prompts, list(range(6)), tools=tools,
                              max_new_tokens=full[0].mask.index(0) + 3, max_rounds=None)
    assert tight[0].ids == full[0].ids[:full[0].mask.index(0)] and all(tight[0].mask)  # the result did not fit
    assert len(tight[0].calls) == 1 and len(tight[0].messages) == 1  # run, counted, not appended (TRL's)
    # it stopped for want of room (generate reports it cut at the limit, not stopped, audit 9); nothing else did
    assert tight[0].cut and not any(o.cut for o in full)
    one = sample_with_tools(Scripted(tok, prompts), prompts, list(range(6)), tools=tools, max_new_tokens=MAX_NEW,
                            max_rounds=1)
    assert [m["role"] for m in one[3].messages] == ["assistant", "tool", "assistant"]  # its second call not run
    assert len(one[3].calls) == 1 and one[0].ids == full[0].ids and first_turn > 0
    none = sample_with_tools(Scripted(tok, prompts), prompts, list(range(6)), tools=tools, max_new_tokens=MAX_NEW,
                             max_rounds=0)
    assert all(o.calls == [] and all(o.mask) for o in none)


def test_a_slow_tool_gets_an_error_as_its_result_and_async_tools_run():
    tok = stand_in_tokenizer("qwen2.5-7b-instruct")
    tools = Tools(TOOLS, tokenizer=tok, timeout_s=0.2)
    calls = [{"type": "function", "function": {"name": n, "arguments": {"word": "ab"}}}
             for n in ("slow", "alookup", "lookup")]
    records = tools.run(calls)
    assert [(r["name"], r["result"], r["failed"]) for r in records] == [
        ("slow", str({"error": "the tool ran past rl.tool_timeout_s=0.2 s"}), True), ("lookup", "BA", False),
        ("alookup", "AB", False)]  # TRL's order: the sync tools' results, then the async ones'


@pytest.mark.parametrize("names, says", [
    (["no_such_module:f"], "cannot be imported"),
    (["test_tools_grpo:Scripted"], "cannot be described"),
    (["test_tools_grpo:lookup", "test_tools_grpo:lookup"], "two functions called 'lookup'"),
])
def test_a_tool_that_cannot_be_imported_described_or_told_apart_is_refused(names, says):
    with pytest.raises(LLMTrainError, match=says):
        Tools(names, tokenizer=stand_in_tokenizer("qwen2.5-7b-instruct"))


# ---- the loss: llmtrain's rollout with tools, through TRL's _compute_loss with its tool_mask

def code_reward(completions, **kwargs):
    """1 where the last reply holds the result of a call (the conversation the rewards get, TRL's shape)."""
    return [float(any(m["role"] == "tool" and m["content"].lower() in c[-1]["content"].lower() for m in c))
            for c in completions]


@pytest.mark.parametrize("correction", [None, "token_truncate"])
def test_the_rollout_with_tools_trains_what_trls_loss_trains_with_its_tool_mask(tiny_assets, tmp_path,
                                                                                monkeypatch, correction):
    """The tiny model with the tools template: llmtrain's GRPO objective samples (the turns scripted, the tools, the
    rewards and the packing real) and packs a step; its loss and gradient norm equal TRL's _compute_loss on the same
    prompts, completions and advantages with llmtrain's mask as TRL's tool_mask. With rl.sampler_correction the
    scripted sampler gives each token a log-probability (its turn's and position's): the pass keeps those of the
    model's tokens (mask 1) in order, the results' left out, and TRL's loss given the same ratios and old
    log-probabilities (use_vllm's path) is the same."""
    from test_grpo import padded_inputs, tiny_model, trl_trainer
    from transformers import AutoTokenizer

    from llmtrain.config import RLConfig
    from llmtrain.model.loss import attach_loss
    from llmtrain.objectives.grpo import GRPO
    from llmtrain.objectives.tool_calls import round_seed

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    template = (tiny_assets / "data" / "tools.jinja").read_text()
    tok.chat_template = template
    turns = [['<call>{"name": "lookup", "arguments": {"word": "abc"}}</call>', "CBA"], ["no idea"],
             ['<call>{"name": "lookup", "arguments": {"word": "abc"}}</call>', "cba!"],
             ['<call>{"name": "fail", "arguments": {"word": "z"}}</call>', "sorry"]]
    rl = RLConfig(num_generations=2, max_completion_tokens=160, tools=TOOLS[:2], rewards=[{"type": "answer_match"}],
                  sampler_correction=correction, **({"sampler_correction_max": 1.5} if correction else {}))
    ours_model, theirs_model = tiny_model(tiny_assets), tiny_model(tiny_assets)
    eos = tok.eos_token_id
    grpo = GRPO(rl, tokenizer=tok, pad_id=tok.pad_token_id, packing=True, seed=0,
                rewards=[("code_reward", code_reward, 1.0)], model=ours_model, columns=["input_ids", "row", "prompt"],
                stop_ids=[eos], world=1, template=template)
    which = {}  # a seed: (its completion, its round)

    def generate(prompt_ids, seeds, *, greedy=False, max_new_tokens=None, logps=False):
        if not which:
            which.update({round_seed(s, r) if r else s: (k, r) for k, s in enumerate(seeds) for r in range(3)})
        drawn = [tok(turns[k][r], add_special_tokens=False)["input_ids"] + [eos] for k, r in map(which.get, seeds)]
        if not logps:
            return drawn
        return [Drawn(ids, [-4.0 - k - 0.001 * j for j in range(len(ids))])
                for ids, (k, _) in zip(drawn, map(which.get, seeds))]

    monkeypatch.setattr(grpo, "_generate", generate)
    chat = [{"role": "user", "content": "code of abc"}]
    prompt = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                         tools=[schema_of(t) for t in TOOLS[:2]]), add_special_tokens=False)
    examples = [{"input_ids": prompt["input_ids"], "row": r, "prompt": chat} for r in range(2)]
    attach_loss(ours_model, chunk=4096)  # (the correction's rollout takes the policy's log-probabilities)
    batches, counts, records = grpo._rollout_batch(examples, step=0)
    assert [r["reward"] for r in records] == [1.0, 0.0, 1.0, 0.0]
    assert [len(r["tool_calls"]) for r in records] == [1, 0, 1, 1]
    masks = [r["tool_mask"] for r in records]
    assert [0 in m for m in masks] == [True, False, True, True]

    if correction:  # the sampler's log-probabilities of the trained tokens, the model's tokens alone, in order
        sampled = torch.cat([b["loss_sampler_logps"] for b in batches])
        assert len(batches) == 1  # one pass: its loss_example is each token's completion
        completion = batches[0]["loss_example"]
        assert len(sampled) == sum(sum(m) for m in masks)
        assert ((-4.0 - sampled).floor() == completion).all()  # each token its own completion's value
        for k in range(4):  # the turn's first token first (0.001 a position after it)
            assert sampled[completion == k][0].item() == pytest.approx(-4.0 - k)
        weights = torch.cat([b["loss_sampler_weights"] for b in batches])
        assert weights.max() == pytest.approx(1.5) and weights.min() < 1.5  # the bound binds, not on all
    total = sum(grpo.loss(ours_model, b)[0] for b in batches) / counts.units
    total.backward()
    prompts = [r["prompt_ids"] for r in records]
    completions = [r["completion_ids"] for r in records]
    advantages = torch.tensor([r["advantage"] for r in records])
    trainer = trl_trainer(theirs_model, tiny_assets, tmp_path, loss_type="dapo", beta=0.0)
    trainer.max_completion_length = 160
    inputs = padded_inputs(prompts, completions, advantages, pad=tok.pad_token_id)
    width = inputs["completion_ids"].shape[1]
    inputs["tool_mask"] = torch.tensor([m + [1] * (width - len(m)) for m in masks])  # TRL pads it with 1
    inputs["num_items_in_batch"] = (inputs["completion_mask"] * inputs["tool_mask"]).sum()
    if correction:  # TRL's vLLM path given llmtrain's ratios and old log-probabilities, at the trained tokens
        trained = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        ratio, old = torch.ones(trained.shape), torch.zeros(trained.shape)
        ratio[trained] = torch.cat([b["loss_sampler_weights"] for b in batches])
        old[trained] = torch.cat([b["loss_old_logps"] for b in batches])
        inputs["importance_sampling_ratio"], inputs["old_per_token_logps"] = ratio, old
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    theirs = trainer._compute_loss(theirs_model, inputs)
    theirs.backward()
    assert total.item() == pytest.approx(theirs.item(), abs=1e-5)
    grads = dict(theirs_model.named_parameters())
    worst = max((p.grad - grads[n].grad).abs().max().item() for n, p in ours_model.named_parameters())
    assert worst < 1e-5 and max(p.grad.abs().max().item() for p in ours_model.parameters()) > 1e-4
    ours_norm = torch.stack([p.grad.norm() for p in ours_model.parameters()]).norm()
    theirs_norm = torch.stack([p.grad.norm() for p in theirs_model.parameters()]).norm()
    assert ours_norm.item() == pytest.approx(theirs_norm.item(), rel=1e-5)
    # the results' tokens are not trained: the loss counts exactly the tokens whose mask is 1 (dapo's units)
    assert sum(len(b["loss_example"]) for b in batches) == counts.units == sum(sum(m) for m in masks)
    assert all(len(m) == len(r["completion_ids"]) for m, r in zip(masks, records))


class Vault:
    """An environment as TRL's environment_factory takes one: reset per rollout, a tool method, get_reward."""

    made = 0

    def __init__(self):
        Vault.made += 1
        self.word, self.opened = None, 0

    def reset(self, prompt, word, **columns):
        self.word, self.opened = word, 0
        return f" ({len(word)} letters)"

    def open_vault(self, guess: str) -> str:
        """Try to open the vault.

        Args:
            guess: the word
        """
        self.opened += 1
        return "open" if guess == self.word else "shut"

    def get_reward(self) -> float:
        return float(self.opened)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_an_environment_per_completion_is_reset_with_its_row_and_its_reward_counts(tiny_assets, monkeypatch,
                                                                                   algorithm):
    """rl.environment: one instance per completion, reset with the row's prompt and columns (its observation added
    to the prompt's last message, the prompt rendered again), its method called on that instance as a tool, its
    get_reward a reward named after the class; the instances reused by the next rollout. RLOO rolls out the same
    way (GRPO's rollout, its own advantages): the results masked out of its per-sequence loss too."""
    from transformers import AutoTokenizer

    from llmtrain.config import RLConfig
    from llmtrain.objectives.grpo import GRPO
    from llmtrain.objectives.rloo import RLOO
    from llmtrain.objectives.tool_calls import round_seed

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    template = (tiny_assets / "data" / "tools.jinja").read_text()
    tok.chat_template = template
    rl = RLConfig(algorithm=algorithm, num_generations=2, max_completion_tokens=120, beta=0.0,
                  environment="test_tools_grpo:Vault", rewards=[{"type": "answer_match"}])
    rendered = []

    def render(prompt, row):
        rendered.append((prompt, row))
        return tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                           tools=grpo.tools.schemas), add_special_tokens=False)["input_ids"]

    given = []  # the prompts the reward function gets: with the observation, as TRL passes them (had been the row's)
    grpo = (RLOO if algorithm == "rloo" else GRPO)(
                rl, tokenizer=tok, pad_id=tok.pad_token_id, packing=True, seed=0,
                rewards=[("zero", lambda completions, prompts, **kw: given.extend(prompts) or [0.0] * len(completions),
                          1.0)], model=None,
                columns=["input_ids", "row", "prompt", "user/word"], stop_ids=[tok.eos_token_id], world=1,
                template=template, render=render)
    assert [n for n, _, _ in grpo.rewards] == ["zero", "Vault"] and "rewards/Vault/sum" in grpo.stats
    turns = [['<call>{"name": "open_vault", "arguments": {"guess": "abc"}}</call>', "ok"], ["no"],
             ['<call>{"name": "open_vault", "arguments": {"guess": "xyz"}}</call>', "hm"], ["no"]]
    which = {}

    def generate(prompt_ids, seeds, *, greedy=False, max_new_tokens=None, logps=False):
        if not which:
            which.update({round_seed(s, r) if r else s: (k, r) for k, s in enumerate(seeds) for r in range(3)})
        return [tok(turns[k][r], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                for k, r in map(which.get, seeds)]

    monkeypatch.setattr(grpo, "_generate", generate)
    chat = [{"role": "user", "content": "open the vault"}]
    examples = [{"input_ids": [1, 2, 3], "row": r, "prompt": chat, "user/word": w}
                for r, w in enumerate(["abc", "xyz"])]
    Vault.made = 0
    batches, counts, records = grpo._rollout_batch(examples, step=0)
    assert counts.trained == sum(sum(r["tool_mask"]) for r in records) < sum(len(r["completion_ids"]) for r in records)
    assert Vault.made == 4 and [p[-1]["content"] for p, _ in rendered] == ["open the vault (3 letters)"] * 4
    assert "(3 letters)" in records[0]["prompt"]
    assert [p[-1]["content"] for p in given] == ["open the vault (3 letters)"] * 4
    assert [r["tool_calls"][0]["result"] if r["tool_calls"] else None for r in records] == ["open", None, "open", None]
    assert [r["Vault"] for r in records] == [1.0, 0.0, 1.0, 0.0]
    which.clear()
    grpo._rollout_batch(examples, step=1)
    assert Vault.made == 4  # reused, reset


class Raising(Vault):
    """An environment whose reset raises on one row's word."""

    def reset(self, prompt, word, **columns):
        if word == "xyz":
            raise KeyError("no vault for xyz")
        return super().reset(prompt, word)


def test_an_environment_whose_reset_needs_a_missing_column_or_raises_is_one_paragraph(tiny_assets, monkeypatch):
    """reset(prompt, word) with no `word` column, and a reset that raises: each had been a traceback at step 1, after
    the run folder was written (audit 25). The first is refused when the objective is made, naming the columns; the
    second at the rollout, naming the class's line and the row."""
    from transformers import AutoTokenizer

    from llmtrain.config import RLConfig
    from llmtrain.objectives.grpo import GRPO

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    template = tok.chat_template = (tiny_assets / "data" / "tools.jinja").read_text()

    def make(environment, columns):
        rl = RLConfig(num_generations=2, max_completion_tokens=40, beta=0.0, environment=environment,
                      rewards=[{"type": "answer_match"}])
        return GRPO(rl, tokenizer=tok, pad_id=tok.pad_token_id, packing=True, seed=0,
                    rewards=[("zero", lambda completions, **kw: [0.0] * len(completions), 1.0)], model=None,
                    columns=["input_ids", "row", "prompt", *columns], stop_ids=[tok.eos_token_id], world=1,
                    template=template, render=lambda prompt, row: [1, 2, 3])

    with pytest.raises(LLMTrainError, match=r"rl.environment test_tools_grpo:Vault's reset needs the argument 'word', "
                                            r"which nothing passes: .* by its name: \['answer'\]"):
        make("test_tools_grpo:Vault", ["user/answer"])
    grpo = make("test_tools_grpo:Raising", ["user/word"])
    monkeypatch.setattr(grpo, "_generate", lambda ids, seeds, **kw: [[tok.eos_token_id] for _ in ids])
    chat = [{"role": "user", "content": "open the vault"}]
    examples = [{"input_ids": [1, 2, 3], "row": r, "prompt": chat, "user/word": w}
                for r, w in enumerate(["abc", "xyz"])]
    with pytest.raises(LLMTrainError, match=r"rl.environment test_tools_grpo:Raising.reset raised KeyError: 'no vault "
                                            r"for xyz' at test_tools_grpo.py:\d+ in reset \(on the prompt of row 1\)"):
        grpo._rollout_batch(examples, step=0)


@pytest.mark.parametrize(("cut", "says"), [
    ("{% if tools %}<|SYSTEM|>tools:{% for t in tools %} {{ (t.function if t.function is defined else t).name }}"
     "{% endfor %}{% endif %}", "does not show the tools in the prompt"),
    ("{{ m['content'] }}</result>", "leaves a tool's result out of what it renders after a call"),
])
def test_a_template_that_hides_the_tools_or_their_results_is_refused(tiny_assets, cut, says):
    """A template that never shows the tools in a prompt, or drops a tool message's content: accepted before (the
    model asked to call tools it never sees, or sampling on without their results; audit 25); TRL's GRPOTrainer
    refuses the second. Refused as the SFT side refuses them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    template = (tiny_assets / "data" / "tools.jinja").read_text()
    Tools(TOOLS[:1], tokenizer=tok, template=template, stop_ids=[tok.eos_token_id])  # the tiny template: shown
    broken = template.replace(cut, "</result>" if "result" in cut else "")
    assert broken != template
    with pytest.raises(LLMTrainError, match=says):
        Tools(TOOLS[:1], tokenizer=tok, template=broken, stop_ids=[tok.eos_token_id])


def test_an_environment_that_is_not_one_is_refused():
    with pytest.raises(LLMTrainError, match="not a class with a reset method"):
        Tools([], tokenizer=stand_in_tokenizer("qwen2.5-7b-instruct"), environment="test_tools_grpo:lookup")


def test_under_tensor_parallelism_the_users_code_runs_on_one_process_of_the_pair(tiny_assets, monkeypatch):
    """A tensor-parallel pair samples the same completions on both processes, but the user's code (reward
    functions, an environment's reset, its tools, its get_reward) runs on the pair's first only (GRPO.user_code:
    collectives.on_sampling_group_first), its results given to the other: here two objectives in one process, the
    second's user_code handed the first's results as the broadcast would hand them. Both roll out the same records;
    every function ran for the first alone, with what it logs coming back too."""
    from transformers import AutoTokenizer

    from llmtrain.config import RLConfig
    from llmtrain.objectives.grpo import GRPO
    from llmtrain.objectives.tool_calls import round_seed

    tok = AutoTokenizer.from_pretrained(tiny_assets / "model")
    template = (tiny_assets / "data" / "tools.jinja").read_text()
    tok.chat_template = template
    rl = RLConfig(num_generations=2, max_completion_tokens=120, beta=0.0, environment="test_tools_grpo:Vault",
                  rewards=[{"type": "answer_match"}])
    calls, given = [], []  # (process, function) of each reward function's call; the first's results, in order

    def counted(process):
        def reward(completions, log_metric, **kwargs):
            calls.append(process)
            log_metric("seen", float(len(completions)))
            return [0.5] * len(completions)
        return reward

    def first(compute):
        given.append(compute())
        return given[-1]

    def second(compute):  # the broadcast: the first's result, the compute never run here
        return given.pop(0)

    def objective(process, user_code):
        grpo = GRPO(rl, tokenizer=tok, pad_id=tok.pad_token_id, packing=True, seed=0,
                    rewards=[("counted", counted(process), 1.0)], model=None,
                    columns=["input_ids", "row", "prompt", "user/word"], stop_ids=[tok.eos_token_id], world=1,
                    template=template, user_code=user_code,
                    render=lambda prompt, row: tok(tok.apply_chat_template(
                        prompt, tokenize=False, add_generation_prompt=True, tools=grpo.tools.schemas),
                        add_special_tokens=False)["input_ids"])
        turns = [['<call>{"name": "open_vault", "arguments": {"guess": "abc"}}</call>', "ok"], ["no"],
                 ['<call>{"name": "open_vault", "arguments": {"guess": "xyz"}}</call>', "hm"], ["no"]]
        which = {}

        def generate(prompt_ids, seeds, *, greedy=False, max_new_tokens=None, logps=False):  # both processes sample
            if not which:
                which.update({round_seed(s, r) if r else s: (k, r) for k, s in enumerate(seeds) for r in range(3)})
            return [tok(turns[k][r], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                    for k, r in map(which.get, seeds)]

        monkeypatch.setattr(grpo, "_generate", generate)
        return grpo

    chat = [{"role": "user", "content": "open the vault"}]
    examples = [{"input_ids": [1, 2, 3], "row": r, "prompt": chat, "user/word": w}
                for r, w in enumerate(["abc", "xyz"])]
    Vault.made = 0
    pair = [objective(0, first), objective(1, second)]
    results = [grpo._rollout_batch(examples, step=0) for grpo in pair]
    assert Vault.made == 4 and calls == [0] and not given  # 4 completions' environments, on the first only
    (_, _, mine), (_, _, theirs) = results
    assert [r["Vault"] for r in mine] == [1.0, 0.0, 1.0, 0.0] and [r["counted"] for r in mine] == [0.5] * 4
    assert [r["tool_calls"] for r in theirs] == [r["tool_calls"] for r in mine]  # the first's calls' results
    assert theirs == mine and "(3 letters)" in theirs[0]["prompt"]  # the reset's observation rendered on both
    assert [b["input_ids"].tolist() for b in results[1][0]] == [b["input_ids"].tolist() for b in results[0][0]]
    assert [grpo.logs.metrics["seen"] for grpo in pair] == [[4.0], [4.0]]  # what the function logged, on both
