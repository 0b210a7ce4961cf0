"""`llmtrain generate`: replies from a finished run (a whole model, or a LoRA adapter on its base), one of its
checkpoints, or a model folder.

Greedy replies are what transformers' own generate gives for the same model and prompt ids, token for token (the
adapter case through peft); a checkpoint replies as the weights it holds; sampled ones are reproducible by seed,
differ between seeds, and are what the reference sampling loop draws. Prompts are rendered as the run's data was
(text, or a chat through the template with the run's system prompt); bad input is refused in one paragraph before any
model is loaded or file written.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli, invoke, run_train, write_recipe

pytestmark = pytest.mark.long(30)  # tests/conftest.py

PROMPTS = ["reverse abc =", "reverse hello =", "reverse tiny =", "reverse model ="]
STEPS = {"full": 60, "lora": 20}  # the full run learns to reply and stop; the adapter only has to move


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    """A full fine-tune and a LoRA run of the tiny task, final/ and a checkpoint half way and at the end saved."""
    root = tmp_path_factory.mktemp("generate")
    made = {}
    for kind, extra in (("full", {}), ("lora", {"lora": {"r": 8, "alpha": 16, "dropout": 0.0}})):
        recipe = write_recipe(tiny_assets, root, name=f"{kind}.yaml", **extra,
                              train={"max_steps": STEPS[kind], "micro_batch_size": 16,
                                     "lr": 3e-3 if kind == "full" else 1e-2},
                              checkpoint={"save_final": True, "every_steps": STEPS[kind] // 2},
                              output_dir=str(root / kind))
        run_train(recipe)
        made[kind] = root / kind
    return made


def _hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    from llmtrain.model.generate import stop_tokens
    from llmtrain.model.loss import causal_lm

    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None,
                         eos_token_id=stop_tokens(causal_lm(model), tokenizer), pad_token_id=tokenizer.eos_token_id)
    tokens = out[0, ids.shape[1]:].tolist()
    eos = set(stop_tokens(causal_lm(model), tokenizer))
    end = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_greedy_replies_are_transformers_generate_token_for_token(runs, tiny_assets, kind):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtrain.run.replies import generate_replies, load_source

    source = load_source(str(runs[kind]), device="cpu")
    assert source.describe.endswith("(a LoRA adapter on " + str(tiny_assets / "model") + ")" if kind == "lora"
                                    else "(a whole model)")
    got = generate_replies(source, PROMPTS, max_new_tokens=12)
    final = runs[kind] / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = (AutoModelForCausalLM.from_pretrained(final) if kind == "full" else
             PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_assets / "model"), final)).eval()
    with torch.no_grad():
        want = [_hf_greedy(model, tokenizer, p, 12) for p in PROMPTS]
    assert [r["tokens"] for r in got] == want
    if kind == "full":  # it learnt to reply and to stop (an adapter on the random tiny base learns far slower)
        assert all(r["stopped"] and r["reply"].strip() for r in got), got


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_checkpoint_replies_as_the_model_it_holds(runs, kind):
    """The last checkpoint (the final weights) gives final/'s replies; the one half way its own weights', other
    replies (the adapter's alone was saved for LoRA, read into the base made as the run made it)."""
    from llmtrain.run.replies import generate_replies, load_source

    kw = dict(max_new_tokens=12, temperature=1.0, samples=2, seed=3)
    final = generate_replies(load_source(str(runs[kind]), device="cpu"), PROMPTS, **kw)
    last = load_source(str(runs[kind] / "checkpoints" / f"step_{STEPS[kind]:06d}"), device="cpu")
    assert "a checkpoint of" in last.describe
    assert [r["tokens"] for r in generate_replies(last, PROMPTS, **kw)] == [r["tokens"] for r in final]
    half = runs[kind] / "checkpoints" / f"step_{STEPS[kind] // 2:06d}"
    early = generate_replies(load_source(str(half), device="cpu"), PROMPTS, **kw)
    assert [r["tokens"] for r in early] != [r["tokens"] for r in final]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_runs_final_folder_and_its_merged_copy_reply_as_the_run(runs, kind, tmp_path):
    """final/ given as the source is the run: its prompts as the run's data (plain text here), not through the
    tokenizer's chat template, which a whole model's final/ carries and which had made other replies (" fedca" for
    "reverse abcdef ="); export --merge's final-merged, a model folder inside the run's, renders as the run did too.
    The first line says the rendering."""
    import shutil

    from llmtrain.run.replies import generate_replies, load_source

    kw = dict(max_new_tokens=12)
    run = load_source(str(runs[kind]), device="cpu")
    final = load_source(str(runs[kind] / "final"), device="cpu")
    assert not run.chat and not final.chat
    want = [r["tokens"] for r in generate_replies(run, PROMPTS, **kw)]
    assert [r["tokens"] for r in generate_replies(final, PROMPTS, **kw)] == want
    if kind == "full":  # a whole model's final/ copied into the run's folder as a model folder of its own
        shutil.copytree(runs[kind] / "final", runs[kind] / "final-copy", dirs_exist_ok=True)
        copy = load_source(str(runs[kind] / "final-copy"), device="cpu")
        assert not copy.chat and f"of the run {runs[kind]}" in copy.describe
        assert [r["tokens"] for r in generate_replies(copy, PROMPTS, **kw)] == want
        shutil.rmtree(runs[kind] / "final-copy")  # the run's folder as the other tests find it
        shutil.copytree(runs[kind] / "final", tmp_path / "alone")  # outside a run: its tokenizer's template
        assert load_source(str(tmp_path / "alone"), device="cpu").chat
    said = invoke("generate", str(runs[kind] / "final"), PROMPTS[0])
    assert "; prompts as plain text (--chat / --no-chat to change)" in said.stderr, said.stderr


def test_a_run_on_conversational_rows_replies_through_the_chat_template(runs, tiny_assets, tmp_path):
    """TRL's conversational prompt_completion rows (lists of messages) train through the chat template whatever
    data.chat_template says; generate had prompted such a run with plain text (wrong replies, where --chat gave the
    run's own) and doctor said the template was "not used"."""
    import shutil

    import yaml

    from llmtrain.config import load_recipe
    from llmtrain.data.checks import check_chat_template, needs_chat
    from llmtrain.run.replies import load_source

    rows = tmp_path / "conversational.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": "reverse ab ="}],
                                        "completion": [{"role": "assistant", "content": "ba"}]}) + "\n"
                            for _ in range(3)))
    run = tmp_path / "run"
    shutil.copytree(runs["full"], run)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    assert recipe["data"]["chat_template"] is False
    recipe["data"]["path"] = str(rows)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert load_source(str(run), device="cpu").chat
    assert not load_source(str(runs["full"]), device="cpu").chat  # plain rows: plain text, as before
    loaded = load_recipe(run / "recipe.yaml")
    assert needs_chat(loaded)
    [(name, verdict, said)] = check_chat_template(loaded, load_source(str(run), device="cpu").tokenizer)
    assert verdict == "pass" and said.startswith("renders;"), said
    # the same rows from parquet, a dataset folder of it, or one source of a mixture: read so too (it had been
    # JSON lines alone: a parquet run's generate prompted with plain text, " lollh" for the .jsonl run's " olleh")
    import datasets

    from llmtrain.data.formats import conversational_rows

    table = datasets.Dataset.from_list([json.loads(line) for line in rows.read_text().splitlines()])
    table.to_parquet(str(tmp_path / "conversational.parquet"))
    (tmp_path / "folder").mkdir()
    table.to_parquet(str(tmp_path / "folder" / "train.parquet"))
    for path in (tmp_path / "conversational.parquet", tmp_path / "folder"):
        assert conversational_rows(loaded.data.model_copy(update={"path": str(path)})), path
    plain = str(tiny_assets / "data" / "train.jsonl")
    mixed = load_recipe(run / "recipe.yaml", ["data.path=null", "data.eval_split=null", "data.sources=[{path: "
                        f"{plain}, format: prompt_completion, weight: 0.5}}, {{path: "
                        f"{tmp_path / 'conversational.parquet'}, format: prompt_completion, weight: 0.5}}]"])
    assert conversational_rows(mixed.data) and not conversational_rows(mixed.data.model_copy(update={
        "sources": mixed.data.sources[:1]}))


def test_sampled_replies_are_reproducible_by_seed_and_the_reference_loops(runs):
    from llmtrain.model import fast_sample
    from llmtrain.run.replies import generate_replies, load_source

    source = load_source(str(runs["full"]), device="cpu")
    kw = dict(max_new_tokens=10, temperature=1.0, samples=3)
    first, again = (generate_replies(source, PROMPTS, seed=5, **kw) for _ in range(2))
    other = generate_replies(source, PROMPTS, seed=6, **kw)
    assert [r["tokens"] for r in first] == [r["tokens"] for r in again]
    assert [r["tokens"] for r in first] != [r["tokens"] for r in other]
    assert len({tuple(r["tokens"]) for r in first}) > len(PROMPTS)  # the samples of a prompt differ
    # 5 prompts in batches of 2 (another batch), through the reference loop: the same replies
    original = fast_sample.sampler_for
    fast_sample.sampler_for = lambda lm, kind: original(lm, "reference")
    try:
        reference = generate_replies(source, PROMPTS, seed=5, batch=2, **kw)
    finally:
        fast_sample.sampler_for = original
    assert [r["tokens"] for r in reference] == [r["tokens"] for r in first]


def test_a_chat_prompt_is_the_templates_generation_prompt_with_the_system_message(runs):
    import dataclasses

    from llmtrain.run.replies import load_source, prompt_ids

    source = load_source(str(runs["full"]), device="cpu")
    assert not source.chat  # the tiny task's rows are text: its prompts are text too
    tok = source.tokenizer
    assert prompt_ids(source, "reverse abc =") == tok("reverse abc =")["input_ids"]
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                   tokenize=False, add_generation_prompt=True)
    assert prompt_ids(source, "hi", chat=True, system_prompt="Be brief.") == tok(text, add_special_tokens=False)[
        "input_ids"]
    # a prompt's messages with their own system message: --system replaces it (it had been ignored; audit 42), the
    # run's own system prompt does not (as the run's rows had rendered)
    own = [{"role": "system", "content": "Be long."}, {"role": "user", "content": "hi"}]
    assert prompt_ids(source, own, system_prompt="Be brief.") == tok(text, add_special_tokens=False)["input_ids"]
    kept = tok.apply_chat_template(own, tokenize=False, add_generation_prompt=True)
    kept = tok(kept, add_special_tokens=False)["input_ids"]
    assert prompt_ids(dataclasses.replace(source, system_prompt="Be brief."), own) == kept
    alone = tok.apply_chat_template([{"role": "system", "content": "Be brief."}], tokenize=False,
                                    add_generation_prompt=True)  # a row of its system message alone (IndexError)
    assert prompt_ids(source, own[:1], system_prompt="Be brief.") == tok(alone, add_special_tokens=False)["input_ids"]


def test_a_prompts_file_is_split_at_newlines_alone(tmp_path):
    """A JSON string may hold U+2028 or a form feed raw; splitlines had cut the line there (a JSON error naming a line
    the file does not have)."""
    from llmtrain.run.replies import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\x0cc"}, ensure_ascii=False) + "\r\n\n" + json.dumps(
        {"prompt": "d"}) + "\n")
    assert read_prompts(path) == ["a\u2028b\x0cc", "d"]


def test_the_command_prints_the_replies_and_writes_them_once(runs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS[2:])))
    out = tmp_path / "replies" / "r.jsonl"
    result = invoke("generate", str(runs["full"]), *PROMPTS[:2], "--prompts", str(prompts), "--max-new-tokens", "12",
                    "--out", str(out))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == PROMPTS
    for x in lines:
        assert f"prompt: {x['prompt']}\nreply: {x['reply']}" in result.stdout
    again = invoke("generate", str(runs["full"]), "reverse abc =", "--out", str(out), check=False)
    assert again.returncode == 2 and "already exists" in again.stdout + again.stderr
    assert len(out.read_text().splitlines()) == 4  # untouched


def test_the_filters_reach_the_command_top_k_one_replies_greedily(runs, tmp_path):
    """--top-k 1 at --temperature 1: every sample is the greedy reply; --min-p cuts what a sample may draw;
    --repetition-penalty changes the greedy replies."""
    def tokens(name: str, *flags: str) -> list[list[int]]:
        invoke("generate", str(runs["full"]), *PROMPTS, "--max-new-tokens", "10", "--out", str(tmp_path / name),
               *flags)
        return [json.loads(x)["tokens"] for x in (tmp_path / name).read_text().splitlines()]

    greedy = tokens("greedy.jsonl")
    assert tokens("top_k.jsonl", "--temperature", "1", "--top-k", "1", "--samples", "2") == [
        t for t in greedy for _ in range(2)]
    sampled = tokens("sampled.jsonl", "--temperature", "1.5", "--samples", "2")
    assert sampled != tokens("min_p.jsonl", "--temperature", "1.5", "--min-p", "0.3", "--samples", "2")
    # --repetition-penalty: greedy replies that repeat fewer of their tokens; 0 refused
    penalised = tokens("penalty.jsonl", "--repetition-penalty", "1.5")
    repeats = [sum(len(t) - len(set(t)) for t in rows) for rows in (penalised, greedy)]
    assert penalised != greedy and repeats[0] < repeats[1]
    bad = invoke("generate", str(runs["full"]), *PROMPTS, "--repetition-penalty", "0", check=False)
    assert bad.returncode != 0 and "--repetition-penalty must be above 0" in bad.stdout + bad.stderr
    # a temperature whose logits overflow float32 (every draw NaN: an empty reply, exit 0) is refused; 1e-5 samples
    tiny = invoke("generate", str(runs["full"]), *PROMPTS, "--temperature", "1e-40", check=False)
    assert tiny.returncode == 2 and "--temperature 1e-40 is below 1e-05" in tiny.stdout + tiny.stderr
    assert tokens("cold.jsonl", "--temperature", "1e-5") == greedy  # (every logit gap over 1e-5 is a point mass)


@pytest.mark.parametrize("case, says", [
    ("unfinished", "has no final/: the run has not finished (or ran with checkpoint.save_final: false). Generate "
                   "from one of its checkpoints"),
    ("reward", "a reward model's run"),
    # its final/ given as a model folder: a random LM head had replied in noise
    ("scorer", "(the model to generate with) is a sequence classifier (LlamaForSequenceClassification"),
    ("no-prompt", "no prompt to reply to"),
    # a mistyped step or run folder is said at once, with what is there (was: "the model folder ... (model.name_or_path
    # / model.tokenizer) does not exist" after a minute of asking the hub for it as an id)
    ("no-checkpoint", "checkpoints/step_30' does not exist; the checkpoints in"),
    ("no-run", "does not exist. Give a run's output_dir, one of its checkpoints, a model folder or a hub id; the runs "
               "in"),
    ("bad-jsonl", "line 4 has no \"prompt\": each line of a .jsonl file is an object with a \"prompt\", a text or "
                  "a chat's messages"),
    # a base model's tokenizer without a template (was: transformers' "Cannot use chat template functions ...")
    ("no-template", "--chat renders each prompt through the chat template, and this tokenizer has none; pass "
                    "--no-chat to continue the text as it is"),
    # a LoRA run's checkpoint on a random base, as its final/ (it had been put on the saved weights, audit 5)
    ("random-base", "trains a LoRA adapter on a randomly initialised"),
    # (it had ended in safetensors' traceback)
    ("damaged", "is damaged (model.safetensors"),
    # (the system message had gone nowhere)
    ("system-plain", "--system puts a system message before each prompt in the chat template, and the prompts are "
                     "rendered as plain text here"),
    # (they had been ignored without a word under the default greedy decoding, audit 9)
    ("filters-greedy", "--top-k 3 and --min-p 0.2 filter what a sample may draw, and the replies are greedy "
                       "(temperature 0, the default)"),
    # a tokenizer that adds no BOS renders "" to no tokens (the fast sampler's UnboundLocalError, audit 9)
    ("empty-prompt", "prompt 2 ('') renders to no tokens"),
])
def test_bad_input_is_one_paragraph_and_writes_nothing(runs, tmp_path, monkeypatch, case, says):
    import shutil

    import yaml

    run = runs["full"]
    args = ["reverse abc ="]
    if case in ("unfinished", "reward"):
        run = tmp_path / "run"
        shutil.copytree(runs["full"], run, ignore=shutil.ignore_patterns("final"))
        if case == "unfinished":  # (a finished run whose final/ is gone: test_export's)
            (run / "summary.json").unlink()
        if case == "reward":
            recipe = yaml.safe_load((run / "recipe.yaml").read_text())
            recipe["reward_model"] = {}
            recipe["data"]["format"] = "preference"
            (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    if case == "scorer":  # a reward model's final/ as it is saved: the decoder under a one-output score head
        import json

        run = tmp_path / "scorer"
        shutil.copytree(runs["full"] / "final", run)
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    if case == "no-prompt":
        args = []
    if case == "no-checkpoint":
        run = runs["full"] / "checkpoints" / "step_30"
        says += f" {runs['full'] / 'checkpoints'} are step_000030, step_000060. Generate from one of them"
    if case == "no-run":
        run = runs["full"].parent / "ful"
        says += f" {runs['full'].parent} are full, lora"
    if case in ("no-checkpoint", "no-run"):
        import transformers

        def asked(*a, **k):
            raise AssertionError("the hub (or transformers) was asked for a path that is not there")

        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", asked)
    if case == "bad-jsonl":
        bad = tmp_path / "p.jsonl"
        # its line numbers the file's, blank lines counted (they had been left out: "line 2" for line 4; audit 42)
        bad.write_text('{"prompt": "reverse a ="}\n\n \n{"text": "no prompt"}\n')
        args = ["--prompts", str(bad)]
    if case == "no-template":  # a model folder (a whole model's final/) whose tokenizer has no chat template
        import json
        import shutil

        run = tmp_path / "model"
        shutil.copytree(runs["full"] / "final", run)
        (run / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((run / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (run / "tokenizer_config.json").write_text(json.dumps(config))
        args = ["--chat", "reverse abc ="]
    if case == "random-base":
        run = tmp_path / "lora"
        shutil.copytree(runs["lora"], run)
        for recipe in [run / "recipe.yaml", *run.glob("checkpoints/*/recipe.yaml")]:
            recipe.write_text(recipe.read_text().replace("random_init: false", "random_init: true"))
        run = run / "checkpoints" / "step_000010"
    if case == "damaged":
        run = tmp_path / "full"
        shutil.copytree(runs["full"], run)
        run = run / "checkpoints" / "step_000060"
        with open(run / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    if case == "system-plain":
        args = ["--system", "You reverse strings.", "reverse abc ="]
    if case == "filters-greedy":
        args = ["--top-k", "3", "--min-p", "0.2", "reverse abc ="]
    if case == "empty-prompt":  # final/ as a model folder, its tokenizer without the BOS post-processor
        import json

        run = tmp_path / "nobos"
        shutil.copytree(runs["full"] / "final", run)
        tokenizer = json.loads((run / "tokenizer.json").read_text())
        (run / "tokenizer.json").write_text(json.dumps({**tokenizer, "post_processor": None}))
        args = ["--no-chat", "reverse abc =", ""]
    out = tmp_path / "r.jsonl"
    result = invoke("generate", str(run), *args, "--out", str(out), check=False)
    said = result.stdout + result.stderr
    assert result.returncode == 2 and says in " ".join(said.split()), said
    assert "Traceback" not in said and not out.exists()


def test_a_runs_relative_chat_template_is_read_from_where_it_was_started(tiny_assets, tmp_path, monkeypatch):
    """A run whose data.chat_template is a relative file (recipes/tiny-tools-sft.yaml's) replies from any directory:
    the file is read from the directory the run was started in, as its model paths are (it had been refused there,
    with a recipe fix generate cannot take, audit 5); final/ and its checkpoint alike."""
    from helpers import invoke

    started = tmp_path / "started"
    (started / "templates").mkdir(parents=True)
    (started / "templates" / "mine.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]:{% endif %}")
    recipe = write_recipe(tiny_assets, tmp_path, data={"chat_template": "templates/mine.jinja", "max_seq_len": 64},
                          train={"max_steps": 2, "micro_batch_size": 8}, checkpoint={"every_steps": 2},
                          output_dir=str(tmp_path / "run"))
    monkeypatch.chdir(started)
    run_train(recipe)
    monkeypatch.chdir(tmp_path)
    for target in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_000002"):
        proc = invoke("generate", str(target), "reverse abc =", "--max-new-tokens", "4", check=False)
        said = proc.stdout + (proc.stderr or "")
        assert proc.returncode == 0 and "through the chat template" in said, said


def test_an_alpaca_runs_prompts_are_rendered_in_its_template(tiny_assets, tmp_path):
    """An alpaca-format run's prompt is the instruction of the template its rows were rendered in (a --prompts row's
    "input" its input), token for token as training rendered the row's prompt; it had been sent bare (a reply that
    ran on to the limit where the trained format stops, audit 5). The command's first line says so."""
    import json

    from helpers import invoke

    from llmtrain.data.formats import encode_example, prompt_length
    from llmtrain.run.replies import load_source, prompt_ids

    recipe = write_recipe(tiny_assets, tmp_path, data={"format": "alpaca", "max_seq_len": 256,
                                                       "path": str(tiny_assets / "data" / "train_alpaca.jsonl"),
                                                       "eval_split": None},
                          train={"max_steps": 2, "micro_batch_size": 8, "eval_every_steps": None})
    run_train(recipe)
    source = load_source(str(tmp_path / "run"))
    row = {"instruction": "Reverse the string.", "input": "abcde", "output": "edcba"}
    trained = encode_example(row, source.tokenizer, source.recipe.data)
    prompt = trained["input_ids"][:prompt_length(trained["labels"])]
    assert prompt_ids(source, "Reverse the string.", row={"input": "abcde"}) == prompt
    bare = source.tokenizer("Reverse the string.", add_special_tokens=True)["input_ids"]
    assert prompt_ids(source, "Reverse the string.", chat=False, row={"input": "abcde"}) == bare  # --no-chat
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Reverse the string.", "input": "abcde"}) + "\n")
    said = invoke("generate", str(tmp_path / "run"), "--prompts", str(prompts), "--max-new-tokens", "4")
    assert "prompts in the run's Alpaca template" in " ".join((said.stdout + (said.stderr or "")).split())


def test_a_plain_text_runs_replies_stop_where_its_rollouts_stop(runs, tmp_path):
    """A run's replies end at its template's end of turn whatever its rows' format, as its rollouts and eval samples
    do (objective.stop_ids): a plain-text run (prompt_completion) whose template ends an assistant turn with
    <|SYSTEM|> (not EOS, as a base model's template often ends it) had gone on sampling past it (audit 9)."""
    import shutil

    from llmtrain.objectives.objective import stop_ids
    from llmtrain.run.replies import generate_replies, load_source

    run = tmp_path / "full"
    shutil.copytree(runs["full"], run)
    template = run / "final" / "chat_template.jinja"
    template.write_text(template.read_text().replace("{{ eos_token }}", "<|SYSTEM|>"))
    source = load_source(str(run))
    assert not source.chat  # plain-text prompts
    end = source.tokenizer.convert_tokens_to_ids("<|SYSTEM|>")
    assert end in stop_ids(source.recipe, source.model, source.tokenizer)
    out = generate_replies(source, ["reverse hello =", "reverse abc ="], temperature=3.0, samples=32,
                           max_new_tokens=12, seed=1)
    ended = [r["tokens"] for r in out if end in r["tokens"]]
    assert ended and all(t.index(end) == len(t) - 1 for t in ended)  # drawn, and each ends there
    assert all(r["stopped"] for r in out if r["tokens"][-1] == end)


def test_each_batch_of_replies_is_handed_out_as_it_is_drawn(runs):
    """generate_replies hands each batch's replies out once drawn (the command prints and appends them to --out
    then), so a stop keeps the batches before it: --out had been written at the end alone (audit 11). The batches
    are the replies, in order."""
    from llmtrain.run.replies import generate_replies, load_source

    source = load_source(str(runs["full"]))
    batches = []
    replies = generate_replies(source, PROMPTS[:3], max_new_tokens=4, batch=2, each_batch=batches.append)
    assert [len(b) for b in batches] == [2, 1] and [r for b in batches for r in b] == replies


def test_a_reply_past_the_models_positions_is_refused_for_a_table_and_warned_for_rotated_ones(tiny_assets, tmp_path):
    """A prompt and its reply past max_position_embeddings: GPT-2's learned positions (wpe) had ended in an IndexError
    traceback at the first position past the table, and a RoPE model replied without a word where transformers'
    generate warns (audit 42). Refused with the --max-new-tokens that fits; warned once for RoPE, and it replies."""
    import shutil

    from transformers import AutoConfig, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(str(tiny_assets / "model"))
    prompt = "reverse abcdefghij ="
    n = len(tok(prompt)["input_ids"])
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=n + 8, n_embd=32, n_layer=1, n_head=2,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    refused = cli("generate", str(gpt2), prompt, "--no-chat", "--max-new-tokens", "20", check=False)
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert (f"prompt 1 is {n} tokens and the reply may take 20 more (--max-new-tokens): {n + 20} positions, past the "
            f"model's max_position_embeddings of {n + 8}, where it looks each position up in a table of {n + 8}: give "
            "--max-new-tokens 8 or less") in said
    assert "reply:" in cli("generate", str(gpt2), prompt, "--no-chat", "--max-new-tokens", "8").stdout
    rope = tmp_path / "rope"
    shutil.copytree(tiny_assets / "model", rope)
    config = AutoConfig.from_pretrained(rope)
    config.max_position_embeddings = n + 8
    config.save_pretrained(rope)
    warned = cli("generate", str(rope), prompt, "--no-chat", "--max-new-tokens", "20")
    assert warned.stderr.count(f"warning: prompt 1 is {n} tokens and the reply may take 20 more") == 1
    assert "rotated positions it never trained on" in warned.stderr and "reply:" in warned.stdout


def test_an_out_file_that_cannot_grow_keeps_whole_lines_and_says_so(runs, tmp_path):
    """A full disk while --out is appended had ended in a traceback and a cut JSON line (audit 46): the batch's part
    is taken back, and one paragraph says what --out holds. (The file-size limit stands in for the full disk.)"""
    import resource

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"reverse {chr(97 + i % 26)}{chr(98 + i % 24)}c =\n" for i in range(20)))
    whole = tmp_path / "whole.jsonl"
    cli("generate", str(runs["full"]), "--prompts", str(prompts), "--max-new-tokens", "4", "--out", str(whole))
    first = "".join(whole.read_text().splitlines(keepends=True)[:16])  # the first batch's 16 replies
    limit = len(first.encode()) + 40

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out.jsonl"
    cut = cli("generate", str(runs["full"]), "--prompts", str(prompts), "--max-new-tokens", "4", "--out", str(out),
              check=False, preexec_fn=small_files)
    assert cut.returncode == 2 and "Traceback" not in cut.stderr, cut.stderr[-2000:]
    assert f"--out '{out}' could not be written" in " ".join(cut.stderr.split())
    assert out.read_text() == first
