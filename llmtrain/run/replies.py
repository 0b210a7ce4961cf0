"""Replies from a finished run or a model (`llmtrain generate`): the prompts rendered as the run rendered its own,
sampled with llmtrain's sampler (the fast one where the model's family has it), reproducible by seed.

A source is a run folder (its final/: a whole model, or a LoRA adapter applied to the base its recipe names, on the
base as the run loaded it: a QLoRA run's 4-bit), one of its checkpoints (checkpoints/step_N of a run whose processes
each kept the whole model), a model folder or a hub id. A run renders each prompt as its data
did (a chat through the chat template, with the run's system prompt, where its rows were chats; else the text with
the tokenizer's BOS); a model through its chat template where its tokenizer has one. The sampling settings are the
run's rl: section's where it has one (temperature, top_p, top_k, min_p, repetition_penalty, max_completion_tokens),
else greedy, 256 new tokens; flags override both. Completion i of prompt p draws its randomness from
completion_seed(seed, 0, p, i), as online RL's do: the same seed gives the same replies, on any device count and
batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmtrain.config import MIN_TEMPERATURE
from llmtrain.errors import LLMTrainError

GREEDY_TOKENS = 256  # new tokens a reply may have when neither the run nor a flag says


@dataclass
class Source:
    model: object  # the model to sample from (a peft model for an adapter), in eval mode
    tokenizer: object
    chat: bool  # prompts rendered through the chat template
    system_prompt: str | None
    template: str | None  # a chat template file's text (data.chat_template: a path), None for the tokenizer's own
    sampling: dict  # the run's temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens
    describe: str
    recipe: object = None  # the run's recipe (None for a model folder or a hub id): its rl.tools / rl.environment
    alpaca: bool = False  # not chat: each prompt an instruction in the Alpaca template the run's rows were rendered in

    @property
    def tools(self) -> bool:
        """Whether the run sampled with tools (rl.tools or rl.environment): its replies run their calls too."""
        rl = getattr(self.recipe, "rl", None)
        return rl is not None and bool(rl.tools or rl.environment)


def unsaved_base(model, target: str) -> str | None:
    """Why a LoRA run's adapter cannot be used (generated from, merged, scored), where its base was drawn at random
    (model.random_init: a speed or memory check) and never saved; None where the base can be read again. `model`: the
    run's recipe's model section (a ModelConfig)."""
    if not model.random_init:
        return None
    return (f"'{target}' trains a LoRA adapter on a randomly initialised {model.name_or_path} "
            "(model.random_init: true), whose weights are never saved: the adapter has no base to be loaded onto. "
            "Train from saved weights (a model folder with its weights, or a hub id) to use the result, or train "
            "without lora: (a full fine-tune's final/ holds the whole model)")


def load_source(source: str, *, device=None) -> Source:
    """The model and rendering of a run folder (its final/), a model folder or a hub id."""
    import torch
    import transformers

    from llmtrain.capabilities import scorer_problem
    from llmtrain.config import ModelConfig
    from llmtrain.data.chat import read_template
    from llmtrain.hub import missing_local
    from llmtrain.model.modeling import load_model, load_model_config, load_tokenizer
    from llmtrain.run.rundir import missing_source, run_folder, run_recipe, unfinished

    transformers.utils.logging.disable_progress_bar()  # "Loading weights": the command says what it reads
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = Path(source).expanduser()
    if not path.exists() and path.parent.name == "checkpoints" and (path.parent.parent / "recipe.yaml").is_file():
        from llmtrain.run.checkpoint import checkpoints_there

        raise LLMTrainError(f"checkpoint '{path}' does not exist; {checkpoints_there(path.parent)}. Generate from one "
                            f"of them, or from the run's final/ ({path.parent.parent})")
    if missing_local(source):  # not a hub id: said before transformers asks the hub for it
        raise LLMTrainError(missing_source(source))
    # a run's final/ is the run (its adapter on its base, its prompts rendered as its data were)
    run = path.parent if (path.parent / "recipe.yaml").is_file() and path.parent.name != "checkpoints" else None
    path = run_folder(path)
    if not (path / "recipe.yaml").is_file():  # a model folder or a hub id
        cfg = ModelConfig(name_or_path=source, dtype="bfloat16" if device.type == "cuda" else "float32")
        if problem := scorer_problem(load_model_config(cfg), source, "the model to generate with"):
            raise LLMTrainError(problem + ". Generate from the policy it was trained for")
        tokenizer = load_tokenizer(cfg)
        model = load_model(cfg, None).to(device)
        if run is not None:  # a model in a run's folder (export --merge's final-merged): rendered as the run's data
            return _source(model, tokenizer, run_recipe(run), f"{source} ({cfg.dtype}, of the run {run})",
                           read_template)
        return Source(model.eval(), tokenizer, tokenizer.chat_template is not None, None, None, {},
                      f"{source} ({cfg.dtype})")
    recipe = run_recipe(path)
    checkpoint = (path / "train_state.json").is_file()  # a checkpoint folder (checkpoints/step_N) rather than a run
    final = path if checkpoint else path / "final"
    if recipe.reward_model is not None:
        raise LLMTrainError(f"'{path}' is a reward model's run: its model scores sequences under a one-output head and "
                            "has no LM head to generate with. Generate from the policy it was trained for")
    if not final.is_dir():
        raise LLMTrainError(unfinished(path, "Generate from"))
    adapter = (final / "adapter_config.json").is_file() if not checkpoint else recipe.lora is not None
    if adapter and (problem := unsaved_base(recipe.model, str(path))):  # a checkpoint's adapter too (it had been put
        raise LLMTrainError(problem)  # on the saved weights: eval loss 4.80 where the run's was 3.86)
    if checkpoint:
        return _from_checkpoint(path, recipe, device)
    trained = trained_model(recipe).model_copy(update={"tokenizer": str(final)})
    if not adapter:
        trained = trained.model_copy(update={"name_or_path": str(final), "quantize": None})
    tokenizer = load_tokenizer(trained)
    model = load_model(trained, None, device=device if trained.quantize else None)
    if adapter:
        from llmtrain.model.modeling import load_adapter

        model = load_adapter(model, str(final))
    model = model.to(device) if not trained.quantize else model
    what = "a LoRA adapter on " + recipe.model.name_or_path if adapter else "a whole model"
    return _source(model, tokenizer, recipe, f"{final} ({what})", read_template)


def trained_model(recipe):
    """The recipe's model section as generation loads it: no training switches."""
    return recipe.model.model_copy(update={"gradient_checkpointing": False, "activation_offload": False,
                                           "tiled_mlp": None, "compile": False, "random_init": False})


def unreadable_checkpoint(path: Path) -> str | None:
    """Why a checkpoint's weights cannot be read as one model (generate and eval refuse it before loading anything):
    damaged (its manifest's sizes and checksums; it had been safetensors' traceback). None: readable, whatever layout
    wrote it (checkpoint.whole_weights)."""
    from llmtrain.run.checkpoint import checkpoint_problem

    if problem := checkpoint_problem(path):
        return (f"checkpoint '{path}' is damaged ({problem}): use another step_* folder under {path.parent}, or the "
                "run's final/")
    return None


def _from_checkpoint(path: Path, recipe, device) -> Source:
    """A checkpoint of a run: the base as the run loaded it, its adapter made as the run made it, and the checkpoint's
    weights (the adapter's alone for LoRA) read into it by name, from one model.safetensors (one process, DDP) or
    assembled from FSDP's or a pipeline's shards in this process (they had been refused: a mid-run FSDP checkpoint
    was unreadable on one process; audit 41)."""
    from llmtrain.data.chat import read_template
    from llmtrain.model.modeling import load_model, load_tokenizer
    from llmtrain.run.checkpoint import whole_weights

    if problem := unreadable_checkpoint(path):
        raise LLMTrainError(problem)
    cfg = trained_model(recipe)
    model = load_model(cfg, recipe.lora, device=device if cfg.quantize else None)
    known = model.state_dict()
    if recipe.lora is not None:  # the adapter's (one process saves only it; FSDP's shards hold the base too)
        wanted = {n for n, p in model.named_parameters() if p.requires_grad}
    else:
        wanted = set(known)
    saved = whole_weights(path, wanted)
    if (path / "model.safetensors").is_file():  # one file holds what the run saved: another model's names too
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            if unknown := sorted(set(f.keys()) - set(known)):
                raise LLMTrainError(f"checkpoint '{path}' holds {len(unknown)} weights this recipe's model does not "
                                    f"have (e.g. {unknown[0]}): it was written by another model. Generate with the "
                                    "recipe that wrote it")
    # (buffers are not trained: a pipeline's stage files hold parameters alone, Gemma 4's layer_scalar is the base's)
    if missing := sorted(wanted - set(saved) - _tied(model) - {n for n, _ in model.named_buffers()}):
        raise LLMTrainError(f"checkpoint '{path}' lacks {len(missing)} of the model's weights (e.g. {missing[0]}): "
                            "it was written by another model. Generate with the recipe that wrote it")
    model.load_state_dict(saved, strict=False)
    model = model.to(device) if not cfg.quantize else model
    return _source(model, load_tokenizer(cfg), recipe, f"{path} (a checkpoint of {recipe.model.name_or_path}"
                   f"{', its LoRA adapter' if recipe.lora is not None else ''})", read_template)


def _tied(model) -> set[str]:
    """Names of parameters that share another's storage (a tied head): a state dict may hold them once."""
    seen, tied = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if t.data_ptr() in seen:
            tied.add(name)
        seen.setdefault(t.data_ptr(), name)
    return tied


def trained_on_chats(data) -> bool:
    """Whether a run of the data section `data` trained on chats rendered through a chat template (messages rows,
    data.chat_template set, conversational rows), which its prompts are then rendered through (generate; eval's
    --apply-chat-template). Alpaca rows are text in ALPACA_PROMPT. A mixture: any source's (its data.format is its
    first source's: the same data had rendered prompts as text or as chats by the sources' order; audit 41)."""
    from llmtrain.config import source_configs
    from llmtrain.data.formats import conversational_rows

    return any(d.format == "messages" or (d.chat_template is not False and d.format != "alpaca") or
               conversational_rows(d) for d in source_configs(data))


def _source(model, tokenizer, recipe, describe: str, read_template) -> Source:
    data = recipe.data
    alpaca = data.format == "alpaca"  # rendered as text in ALPACA_PROMPT (a bare prompt had been sent: no reply ended)
    chat = trained_on_chats(data)
    from llmtrain.config import sampling_of

    rl = recipe.rl or recipe.distill
    sampling = {} if rl is None else {**sampling_of(rl), "max_new_tokens": rl.max_completion_tokens}
    return Source(model.eval(), tokenizer, chat, data.system_prompt, read_template(data, tokenizer) if chat else None,
                  sampling, describe, recipe, alpaca)


def no_template(source: Source) -> None:
    """Refuse rendering a chat where there is no template (neither the run's nor the tokenizer's own)."""
    if source.template is None and source.tokenizer.chat_template is None:
        raise LLMTrainError("--chat renders each prompt through the chat template, and this tokenizer has none; "
                            "pass --no-chat to continue the text as it is")


def prompt_ids(source: Source, prompt, *, chat: bool | None = None, system_prompt: str | None = None,
               row: dict | None = None) -> list[int]:
    """A prompt's ids as the source renders prompts (chat: override the source's choice); a prompt is a text, or a
    chat's messages (a .jsonl row's "prompt", as an RL run's data has them). An Alpaca run's text prompt is the
    instruction of its template, a .jsonl row's "input" the input, as data/formats renders its rows (--no-chat: the
    text as it is)."""
    alpaca = source.alpaca and chat is None
    chat = (source.chat if chat is None else chat) or not isinstance(prompt, str)  # messages are a chat
    system = system_prompt if system_prompt is not None else source.system_prompt
    tok = source.tokenizer
    if not chat and alpaca:
        from llmtrain.data.formats import alpaca_prompt

        prompt = alpaca_prompt(prompt, str((row or {}).get("input") or ""))
    if not chat:
        return tok(prompt, add_special_tokens=True)["input_ids"]
    no_template(source)
    given = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _own_system_off(prompt,
                                                                                                 system_prompt)
    messages = ([{"role": "system", "content": system}] if system is not None and not (given and given[0]["role"]
                                                                                         == "system") else []) + given
    text = tok.apply_chat_template(messages, chat_template=source.template, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def generate_replies(source: Source, prompts: list, *, max_new_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     min_p: float | None = None, repetition_penalty: float | None = None, samples: int = 1,
                     seed: int = 0,
                     chat: bool | None = None, system_prompt: str | None = None, batch: int = 16,
                     tools: bool | None = None, each_batch=None) -> list[dict]:
    """Each prompt's `samples` replies: [{"prompt", "sample", "reply", "tokens", "stopped"}] in prompt order. A prompt
    is a text, or a row {"prompt": a text or a chat's messages, other columns}. A run that sampled with rl.tools or
    rl.environment renders prompts as its own were, showing the tools; with tools (its default) each reply's calls run
    as its rollouts ran them (tool_calls.sample_with_tools; an environment reset with the row's columns, as GRPO
    resets it): the reply is everything after the prompt, the tools' results included, and its row adds "calls" and
    "messages". `each_batch(replies)`: called with each batch's replies once they are drawn."""
    import torch

    from llmtrain.data.chat import end_of_turn
    from llmtrain.model.fast_sample import sampler_for
    from llmtrain.model.generate import completion_seed
    from llmtrain.model.loss import causal_lm
    from llmtrain.model.modeling import pad_id
    from llmtrain.objectives.objective import prompt_renderer, run_end_of_turn, stops_for
    from llmtrain.objectives.tool_calls import Tools, observed, sample_with_tools

    settings = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "max_new_tokens": GREEDY_TOKENS, **source.sampling}
    for key, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                       ("repetition_penalty", repetition_penalty), ("max_new_tokens", max_new_tokens)):
        settings[key] = value if value is not None else settings[key]
    if 0 < settings["temperature"] < MIN_TEMPERATURE:  # the logits over it overflow: every draw NaN, empty replies
        raise LLMTrainError(f"--temperature {settings['temperature']:g} is below {MIN_TEMPERATURE:g}, where the logits "
                            "divided by it overflow (vLLM samples greedily there): give 0 for greedy replies, or a "
                            f"temperature of at least {MIN_TEMPERATURE:g}")
    if not settings["repetition_penalty"] > 0:  # 0 would divide; a negative one would flip the logits' signs
        raise LLMTrainError(f"--repetition-penalty must be above 0 (got {settings['repetition_penalty']}): 1 is off, "
                            "above 1 repeats less (transformers' repetition_penalty, e.g. 1.1)")
    if system_prompt is not None and not (source.chat if chat is None else chat):  # (it had gone nowhere)
        raise LLMTrainError("--system puts a system message before each prompt in the chat template, and the prompts "
                            "are rendered as plain text here (as the run's data were, or for want of a template): "
                            "pass --chat to render them through the chat template, or leave --system out")
    if samples > 1 and settings["temperature"] == 0:  # greedy: every sample the same reply
        raise LLMTrainError(f"--samples {samples} draws several replies a prompt, and they are sampled greedily "
                            f"(temperature 0{'' if temperature is not None else ', the default'}): all {samples} would "
                            "be the same reply. Give --temperature (e.g. 0.7), or leave --samples out.")
    given = [f"--{k.replace('_', '-')} {v}" for k, v, off in (("top_k", top_k, 0), ("top_p", top_p, 1.0),
                                                               ("min_p", min_p, 0.0)) if v is not None and v != off]
    if given and settings["temperature"] == 0:  # (they had been ignored without a word, as transformers warns)
        raise LLMTrainError(f"{' and '.join(given)} {'filters' if len(given) == 1 else 'filter'} what a sample may "
                            f"draw, and the replies are greedy (temperature 0"
                            f"{'' if temperature is not None else ', the default'}): the most likely token every "
                            "time, whatever the filters. Give --temperature (e.g. 0.7) to sample, or leave them out.")
    rows_in = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    tooled = source.tools if tools is None else tools
    if tooled and not source.tools:
        raise LLMTrainError(f"--tools runs the tools a run sampled with (its rl.tools or rl.environment), and "
                            f"{source.describe} has none; leave --tools out")
    rendered_chat = source.chat if chat is None else chat
    lm = causal_lm(source.model)
    if rendered_chat:
        no_template(source)
    turn = end_of_turn(source.tokenizer, source.template) if rendered_chat or tooled else None
    if turn is None and source.recipe is not None:  # a run's replies end where its rollouts and eval samples ended:
        # at its template's end of turn whatever its rows' format (objective.stop_ids; a plain-text run on a base
        # whose template ends a turn with other than EOS had replied past it, to the limit)
        turn = run_end_of_turn(source.recipe, source.tokenizer)
    stops = stops_for(lm, source.tokenizer, turn)
    # a tool run's prompts show the tools, as its own did (--no-tools too), with --system in place of its system prompt
    # (--system in place of a row's own system message too, as prompt_ids renders it; the row itself as given)
    shown = prompt_renderer(_with_system(source, chat, system_prompt), source.tokenizer) if source.tools else None
    render = (lambda prompt, n: shown(_own_system_off(prompt, system_prompt), n)) if shown else None
    ids = [render(r["prompt"], n) if render else prompt_ids(source, r["prompt"], chat=chat, system_prompt=system_prompt,
                                                            row=r)
           for n, r in enumerate(rows_in)]
    if (empty := next((n for n, i in enumerate(ids) if not i), None)) is not None:  # (the sampler's traceback)
        raise LLMTrainError(f"prompt {empty + 1} ({rows_in[empty]['prompt']!r}) renders to no tokens (this tokenizer "
                            "adds no BOS), so there is nothing to reply to: give it some text, or leave it out")
    beyond_positions(source.model, ids, settings["max_new_tokens"])
    calls = Tools.of_run(source.recipe.rl, tokenizer=source.tokenizer, template=source.template,
                         stop_ids=stops) if tooled else None
    rows = [(p, i) for p in range(len(prompts)) for i in range(samples)]
    sample = sampler_for(source.model, "graph")  # the fast sampler (CUDA graphs on CUDA), or the reference loop
    out = []

    def draw(prompts_ids, seeds, room):
        return sample(source.model, prompts_ids, seeds=seeds, max_new_tokens=room, temperature=settings["temperature"],
                      top_p=settings["top_p"], top_k=settings["top_k"], min_p=settings["min_p"],
                      repetition_penalty=settings["repetition_penalty"], stop_ids=stops,
                      pad_id=pad_id(source.tokenizer))

    with torch.no_grad():
        for start in range(0, len(rows), batch):
            part = rows[start:start + batch]
            seeds = [completion_seed(seed, 0, p, i) for p, i in part]
            firsts = [ids[p] for p, _ in part]
            rolled = [None] * len(part)
            if calls is None:
                drawn = draw(firsts, seeds, settings["max_new_tokens"])
            else:
                environments = calls.environments(len(part))
                for k, ((p, _), environment) in enumerate(zip(part, environments)):
                    if environment is not None:  # as GRPO resets it: the prompt and the row's other columns
                        row = rows_in[p]
                        observation = environment.reset(**_accepted(environment.reset, row))
                        if observation is not None:
                            firsts[k] = render(observed(row["prompt"], str(observation)), p)
                rolled = sample_with_tools(draw, firsts, seeds, tools=calls, max_new_tokens=settings["max_new_tokens"],
                                           max_rounds=source.recipe.rl.max_tool_calls, environments=environments)
                drawn = [r.ids for r in rolled]
            for (p, i), tokens, roll in zip(part, drawn, rolled):
                reply = {"prompt": rows_in[p]["prompt"], "sample": i,
                         "reply": stops.reply(source.tokenizer.decode(tokens, skip_special_tokens=True)),
                         # a tool reply whose results did not fit stopped for want of room, not at a stop (audit 9)
                         "tokens": tokens, "stopped": stops.ends(tokens) and not (roll is not None and roll.cut)}
                if roll is not None:
                    reply.update(calls=roll.calls, messages=roll.messages)
                out.append(reply)
            if each_batch is not None:  # the command's output of each batch as it is done (a stop keeps them)
                each_batch(out[-len(part):])
    return out


def _own_system_off(prompt, system_prompt: str | None):
    """A prompt's messages without their own system message where --system replaces it (it had been ignored without a
    word; audit 42); the run's system prompt leaves a row's own as it is, as its rows were rendered."""
    if system_prompt is not None and isinstance(prompt, list) and prompt and prompt[0].get("role") == "system":
        return list(prompt[1:])
    return list(prompt) if isinstance(prompt, list) else prompt


def beyond_positions(model, ids: list[list[int]], max_new_tokens: int) -> None:
    """A prompt and its reply past the model's max_position_embeddings: refused where the model looks positions up in a
    table of that many (GPT-2's wpe: it had ended in an IndexError traceback at the first position past it), a warning
    where it rotates them (RoPE: it goes on replying, past the lengths it was trained on, as transformers' generate
    warns; audit 42)."""
    import warnings

    import torch

    from llmtrain.model.modeling import context_reach

    limit = context_reach(model.config.get_text_config())  # dynamic NTK RoPE: its original length x the factor
    if not ids or not isinstance(limit, int):
        return
    n = max(range(len(ids)), key=lambda k: len(ids[k]))
    if (need := len(ids[n]) + max_new_tokens) <= limit:
        return
    table = any(isinstance(m, torch.nn.Embedding) and m.num_embeddings == limit for name, m in model.named_modules()
                if name.rsplit(".", 1)[-1] in ("wpe", "embed_positions", "position_embeddings"))
    said = (f"prompt {n + 1} is {len(ids[n]):,} tokens and the reply may take {max_new_tokens:,} more "
            f"(--max-new-tokens): {need:,} positions, past the model's max_position_embeddings of {limit:,}")
    if table:
        fix = (f"--max-new-tokens {limit - len(ids[n])} or less" if len(ids[n]) < limit else "a shorter prompt")
        raise LLMTrainError(f"{said}, where it looks each position up in a table of {limit:,}: give {fix}")
    warnings.warn(f"{said}; it replies past them on rotated positions it never trained on (transformers' generate "
                  "warns alike)", stacklevel=2)


def _with_system(source: Source, chat: bool | None, system_prompt: str | None):
    """A tool run's recipe as its prompts are rendered here: through its chat template (the tools are shown there:
    --no-chat is refused), with --system as the system prompt where given."""
    if chat is False:
        raise LLMTrainError(f"--no-chat: {source.describe} sampled with tools, which its prompts show through the chat "
                            "template; its replies are sampled from prompts rendered so. Leave --no-chat out")
    if system_prompt is None:
        return source.recipe
    data = source.recipe.data.model_copy(update={"system_prompt": system_prompt})
    return source.recipe.model_copy(update={"data": data})


def _accepted(fn, row: dict) -> dict:
    """The row's fields `fn` takes by name (all of them where it takes **kwargs)."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return row
    return {k: v for k, v in row.items() if k in {p.name for p in params}}


def read_prompts(path: Path) -> list:
    """Prompts from a file: one a line, or (a .jsonl file) rows with a "prompt" (a text or a chat's messages) and
    any other columns (a run's rl.environment is reset with them)."""
    import json

    if not path.is_file():
        raise LLMTrainError(f"--prompts '{path}' is not a file. Give a text file (one prompt a line) or JSON lines "
                            "with a \"prompt\" field")
    def _a(kind: str) -> str:
        return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}, not text"

    # (split at newlines alone: splitlines also breaks at U+2028 and form feeds, which a JSON string may hold raw)
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(path.read_text().split("\n"), 1) if line.strip()]
    if path.suffix != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:  # the file's own line numbers, blank lines counted (they had been left out; audit 42)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LLMTrainError(f"--prompts '{path}' line {n} is not JSON ({e.msg}); each line of a .jsonl file is "
                                "an object with a \"prompt\"") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not (isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt)):
            has = "no \"prompt\"" if prompt is None else f"a \"prompt\" that is {json.dumps(prompt)[:40]}, " \
                f"{'messages without a role or content' if isinstance(prompt, list) else _a(type(prompt).__name__)}"
            raise LLMTrainError(f"--prompts '{path}' line {n} has {has}: each line of a .jsonl file is an "
                                "object with a \"prompt\", a text or a chat's messages ([{\"role\": \"user\", "
                                "\"content\": ...}]); its other fields are the row's columns")
        prompts.append(row if len(row) > 1 or isinstance(prompt, list) else prompt)
    return prompts
