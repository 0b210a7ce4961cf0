"""The tiny model, tokenizer and synthetic task that recipes/tiny.yaml trains on a laptop CPU.

`prepare_tiny(out)` writes, deterministically from its seed and with nothing downloaded:

- `out/model/`: a ~0.5M-parameter random-init Llama (GQA, untied head; `family`: another family's layer at the same
  sizes, FAMILY_LAYERS) saved with `save_pretrained`
  (safetensors), plus a character-level tokenizer with a Llama-like BOS rule and a chat template,
  so it loads through the same `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` path as a
  real 7B checkpoint;
- `out/data/`: the string-reversal task (`reverse abcde =` -> ` edcba`) in prompt_completion format
  (`train.jsonl`, `eval.jsonl`) and the same training examples as chat messages
  (`train_messages.jsonl`) and alpaca records (`train_alpaca.jsonl`); as unpaired feedback for KTO
  (`train_unpaired.jsonl`, `eval_unpaired.jsonl`: each string's reversal labelled true, the string copied
  unreversed, the mistake an untrained model makes most, labelled false); and preference pairs of the same prompts
  (`train_pairs.jsonl`, `eval_pairs.jsonl`: the right reply against a near miss), for reward models.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.run.rundir import cannot_create

# Special tokens first, so their ids are fixed: 0 unk, 1 bos, 2 eos, 3 pad.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]
# Chat role markers are single special tokens. They are upper case on purpose: the messages loss
# mask finds each assistant reply in the rendered text, and a lower-case reply such as "ant" must not
# be found inside a marker like "<|assistant|>".
ROLE_TOKENS = ["<|SYSTEM|>", "<|USER|>", "<|ASSISTANT|>"]
# Every printable ASCII character plus newline and tab: enough for the task, the alpaca prompt and
# ordinary English text; anything else maps to <unk>.
ALPHABET = [chr(c) for c in range(32, 127)] + ["\n", "\t"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|{{ m['role'] | upper }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|ASSISTANT|>{% endif %}"
)

# The same markers with tools (the tool-calling demo, docs/tools.md): the tools' names after a system marker, a call
# as <call>{"name": ..., "arguments": {...}}</call> in the assistant's turn, a tool's result as
# <result>...</result> in a user turn. Written to data/tools.jinja (data.chat_template names it).
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|SYSTEM|>tools:{% for t in tools %} {{ (t.function if t.function is defined else t).name }}"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|USER|><result>{{ m['content'] }}</result>"
    "{% else %}<|{{ m['role'] | upper }}|>{{ m['content'] }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</call>"
    "{% endfor %}{% endif %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|ASSISTANT|>{% endif %}"
)

MODEL_KWARGS = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
)

# Each family of the capability table (capabilities.FAMILIES) at the tiny model's sizes, for `llmtrain prepare-tiny
# --family NAME`: what its config sets apart from the tiny Llama's (tests/test_families.py trains the same layers).
# Gemma 3: a local layer of window 8 and a global one; the mixtures: 4 experts of 64 columns a layer, 2 a token (GPT-OSS
# with its sinks and a window of 8 on every other layer); Gemma 4: per-layer embeddings, local and global layers of
# their own head sizes, its last two layers sharing the keys and values of the two before them.
FAMILY_LAYERS: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": dict(attention_bias=True),
    "qwen3": dict(head_dim=32),
    "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(partial_rotary_factor=0.75),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "gpt_oss": dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8,
                    # its YaRN as the real one's (4,096 x 32 = its 131,072 positions): 16 x 32 = the tiny's 512
                    # (transformers warned of a factor of 32 that the lengths, 512 / 4,096, say is 0.125)
                    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                         truncate=False, original_max_position_embeddings=16, rope_theta=150000.0)),
    "gemma4_text": dict(head_dim=32, global_head_dim=64, num_key_value_heads=4, num_global_key_value_heads=2,
                        attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True, num_hidden_layers=4,
                        sliding_window=8, hidden_size_per_layer_input=16,
                        layer_types=["sliding_attention", "full_attention"] * 2),
}

MIN_LEN, MAX_LEN = 3, 6
N_TRAIN, N_EVAL = 5000, 200


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per character, `<s>` prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character (newlines included) is its own pre-token, so the word-level model sees one char.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join the characters back with nothing in between
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=MODEL_KWARGS["max_position_embeddings"],
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------- model


def build_model(tokenizer, *, seed: int, family: str = "llama"):
    """The tiny model, random weights from `seed`: Llama's layer, or `family`'s (FAMILY_LAYERS) at the same sizes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if family == "llama":
        config = LlamaConfig(**ids, **MODEL_KWARGS)
    else:  # the sizes every family's config reads, then what sets the family apart
        sizes = {k: MODEL_KWARGS[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                              "tie_word_embeddings")}
        extra = {"vocab_size_per_layer_input": len(tokenizer)} if family == "gemma4_text" else {}
        config = AutoConfig.for_model(family, **{**ids, **sizes, **extra, **FAMILY_LAYERS[family]})
    # A private generator state: the weights depend on `seed` only, and the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config) if family == "llama" else AutoModelForCausalLM.from_config(config)
    return model


# --------------------------------------------------------------------------- data


def make_example(rng: random.Random) -> tuple[str, str]:
    """One reversal problem: ("reverse abcde =", " edcba")."""
    s = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
    return f"reverse {s} =", f" {s[::-1]}"


def make_split(rng: random.Random, n: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    out, seen = [], set(exclude)
    while len(out) < n:
        prompt, completion = make_example(rng)
        if prompt not in seen:
            seen.add(prompt)
            out.append((prompt, completion))
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def unpaired(examples: list[tuple[str, str]]) -> list[dict]:
    """KTO rows from reversal problems, as a pair's chosen and rejected: the reversal desirable, the copy not (a
    palindrome's copy is its reversal: that row is left out)."""
    rows = []
    for prompt, completion in examples:
        copied = " " + completion.strip()[::-1]
        rows.append({"prompt": prompt, "completion": completion, "label": True})
        if copied != completion:
            rows.append({"prompt": prompt, "completion": copied, "label": False})
    return rows


def write_data(out: Path, *, seed: int) -> None:
    rng = random.Random(seed)
    evals = make_split(rng, N_EVAL)
    train = make_split(rng, N_TRAIN, exclude={p for p, _ in evals})  # eval strings never seen in training
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "train.jsonl", [{"prompt": p, "completion": c} for p, c in train])
    _write_jsonl(out / "eval.jsonl", [{"prompt": p, "completion": c} for p, c in evals])
    _write_jsonl(out / "train_unpaired.jsonl", unpaired(train))
    _write_jsonl(out / "eval_unpaired.jsonl", unpaired(evals))
    _write_jsonl(
        out / "train_messages.jsonl",
        [
            {"messages": [{"role": "user", "content": p.removesuffix(" =")},
                          {"role": "assistant", "content": c.strip()}]}
            for p, c in train
        ],
    )
    _write_jsonl(
        out / "train_alpaca.jsonl",
        [
            {"instruction": "Reverse the string.", "input": p.removeprefix("reverse ").removesuffix(" ="),
             "output": c.strip()}
            for p, c in train
        ],
    )


def code_of(word: str) -> str:
    """Look up the secret code of a word.

    Args:
        word: the word (lower-case letters)
    """
    import hashlib

    digest = hashlib.sha256(word.encode()).digest()
    return "".join(string.ascii_lowercase[b % 26] for b in digest[:4])


class CodeBook:
    """The tool-calling demo's environment (rl.environment, TRL's environment_factory): reset with a prompt row, it
    holds the row's word; its tool `lookup` tells the word's code, which the model cannot know otherwise."""

    def __init__(self):
        self.word = ""

    def reset(self, prompt=None, word: str = "", **columns) -> None:
        self.word = word

    def lookup(self) -> str:
        """Look up the secret code of the word in question."""
        return code_of(self.word)


CALLS_IN_SFT = 0.35  # the share of the SFT conversations that call the tool; the others answer from memory


def write_tool_data(out: Path, *, seed: int) -> None:
    """The tool-calling demo (docs/tools.md): a word's secret code (a hash: the model cannot learn it, and the eval
    words are never seen in training), which only the CodeBook environment's `lookup` tool knows.
    `train_tools.jsonl`: conversations for SFT, about a third of them (CALLS_IN_SFT) calling `lookup` (the call, its
    result, the reply), the others answering from memory ("it is ...": right for that word, a guess for any other);
    `train_tool_prompts.jsonl` / `eval_tool_prompts.jsonl`: chat prompts with the `word` and its code in `answer`,
    for GRPO with rl.environment; data/tools.jinja: the template with tools. From their own random stream: the other
    files are unchanged."""
    rng = random.Random(seed + 2)
    words: dict[str, None] = {}
    while len(words) < 2400:
        words["".join(rng.choice(string.ascii_lowercase) for _ in range(4))] = None
    words = list(words)
    evals, train = words[:200], words[200:]
    (out / "tools.jinja").write_text(TOOLS_TEMPLATE)
    from transformers.utils import get_json_schema

    lookup = get_json_schema(CodeBook().lookup)  # the schema GRPO's prompts are rendered with

    def chat(word: str, calls: bool) -> dict:
        ask = {"role": "user", "content": f"code of {word}"}
        if not calls:
            return {"tools": [lookup], "messages": [ask, {"role": "assistant", "content": f"it is {code_of(word)}"}]}
        call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
        return {"tools": [lookup], "messages": [
            ask, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "lookup", "content": code_of(word)},
            {"role": "assistant", "content": f"it is {code_of(word)}"}]}

    _write_jsonl(out / "train_tools.jsonl", [chat(w, rng.random() < CALLS_IN_SFT) for w in train[:1000]])
    for name, part in (("train", train[1000:]), ("eval", evals)):
        _write_jsonl(out / f"{name}_tool_prompts.jsonl",
                     [{"prompt": [{"role": "user", "content": f"code of {w}"}], "word": w,
                       "answer": f"it is {code_of(w)}"} for w in part])


def near_miss(rng: random.Random, answer: str) -> str:
    """A wrong reply close to the right one `answer` (" edcba"), of the kinds most of the short SFT run's wrong greedy
    replies are (107 of its 137 on the eval prompts: a letter the string lacks, or a wrong length): one or two letters
    changed to ones the string lacks, one dropped or one repeated. Not the string's own letters in another order or
    count (not reversed, two neighbours swapped, a letter changed to another of its own): the tiny 2-layer model,
    scoring at the last token, stays near chance on those (docs/reward-models.md)."""
    s = answer.strip()
    kind = rng.choice(["change", "change_two", "drop", "repeat"])
    absent = [c for c in string.ascii_lowercase if c not in s]
    i = rng.randrange(len(s))
    if kind == "drop":
        return " " + s[:i] + s[i + 1:]
    if kind == "repeat":
        return " " + s[:i] + s[i] + s[i:]
    wrong = s[:i] + rng.choice(absent) + s[i + 1:]
    if kind == "change_two":
        j = rng.choice([k for k in range(len(s)) if k != i])
        wrong = wrong[:j] + rng.choice(absent) + wrong[j + 1:]
    return " " + wrong


def write_pairs(out: Path, *, seed: int) -> None:
    """Preference pairs of the same task (reward models, DPO): each train and eval prompt once, chosen its right
    reply, rejected a near miss (`near_miss`); from their own random stream, so the other files are unchanged."""
    rng = random.Random(seed + 1)
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
        _write_jsonl(out / f"{split}_pairs.jsonl", [{"prompt": r["prompt"], "chosen": r["completion"],
                                                    "rejected": near_miss(rng, r["completion"])} for r in rows])


# --------------------------------------------------------------------------- entry point


MARK = ".llmtrain-tiny"  # in a folder prepare-tiny wrote: it may write it again


def _record(out: Path) -> dict | None:
    """What prepare-tiny's mark says it wrote: {family, seed, files: {path: sha256} (None while it writes)}; None for
    a mark of before it said (plain text)."""
    try:
        record = json.loads((out / MARK).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _hashes(out: Path) -> dict[str, str]:
    """sha256 of every file under model/ and data/, by path from `out`."""
    import hashlib

    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in ("model", "data") for p in sorted((out / d).rglob("*")) if p.is_file()}


def _check_rewrite(out: Path, *, family: str, seed: int) -> None:
    """A folder prepare-tiny wrote is written again only as it was written: another family or seed would replace the
    base of every run trained on it, and a file changed or added since would be lost (audit 46)."""
    record = _record(out)
    if record is None:
        return  # marked before the mark said what it wrote: written again, as it was
    if (record.get("family"), record.get("seed")) != (family, seed):
        what = f"--family {family}" if record.get("family") != family else f"seed {seed}"
        raise LLMTrainError(f"'{out}' holds the tiny {record.get('family')} model (seed {record.get('seed')}); {what} "
                            "would replace it under every run trained on it (a LoRA run's adapter would then sit on "
                            "another base). Give a new folder (llmtrain prepare-tiny DIR"
                            + (f" --family {family}" if record.get("family") != family else "") + ").")
    if record.get("files") is None:
        return  # a write that was stopped: it is written again, whole
    now = _hashes(out)
    changed = sorted(p for p in now.keys() | record["files"].keys()
                     if p in now and now[p] != record["files"].get(p))
    if changed:
        raise LLMTrainError(f"'{out}' was written by prepare-tiny, and {', '.join(changed[:4])}"
                            f"{', ...' if len(changed) > 4 else ''} changed or added since: writing it again would "
                            "lose that. Give a new folder (llmtrain prepare-tiny DIR), or remove those files.")


def _written_here(out: Path) -> bool:
    """Whether `out` is prepare-tiny's own folder: marked, or (written before the mark) its model/ the tiny model."""
    if (out / MARK).exists():
        return True
    try:
        config = json.loads((out / "model" / "config.json").read_text())
    except (OSError, ValueError):
        return False
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers")
    return config.get("model_type") == "llama" and all(config.get(k) == MODEL_KWARGS[k] for k in shape)


def prepare_tiny(out: Path, *, seed: int = 0, family: str = "llama") -> bool:
    """Write the tiny model + tokenizer to `out/model` and the task data to `out/data`. A folder that holds anything
    prepare-tiny did not write is refused (its files would be replaced); one it wrote is written again, the same
    bytes for the same seed. `family`: the model's layer (FAMILY_LAYERS), the tokenizer and data the same. Returns
    whether `out` held prepare-tiny's files before (now rewritten)."""
    out = Path(out)
    if family not in FAMILY_LAYERS:  # (gemma3 for gemma3_text had got no suggestion; audit 11)
        import difflib

        near = difflib.get_close_matches(family, list(FAMILY_LAYERS), n=1, cutoff=0.6) or [
            k for k in FAMILY_LAYERS if k.startswith(family)][:1]
        # (it had said "not a family llmtrain trains" of gemma3, whose checkpoints train as their text model; audit 58)
        raise LLMTrainError(f"--family {family}: not a model_type prepare-tiny builds"
                            + (f" (did you mean {near[0]}?)" if near else "")
                            + f"; use one of {', '.join(FAMILY_LAYERS)} (the text model's model_type of each family "
                            "of docs/models.md's table)")
    if problem := cannot_create(out / "model", "prepare-tiny's folder"):  # also where `out` itself is a file
        raise LLMTrainError(problem)
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    again = bool(present) and _written_here(out)
    if present and not again:
        raise LLMTrainError(f"prepare-tiny's folder '{out}' already holds {', '.join(present[:4])}"
                            f"{', ...' if len(present) > 4 else ''}, which prepare-tiny did not write: its model/ and "
                            "data/ files would replace them. Give an empty or new folder (llmtrain prepare-tiny DIR).")
    if again:
        _check_rewrite(out, family=family, seed=seed)
    mark = {"written_by": "llmtrain prepare-tiny", "family": family, "seed": seed}
    out.mkdir(parents=True, exist_ok=True)
    (out / MARK).write_text(json.dumps({**mark, "files": None}) + "\n")  # first: a stopped write is still its own
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards": the one line after says it
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, family=family)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    model.generation_config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_data(out / "data", seed=seed)
    write_pairs(out / "data", seed=seed)
    write_tool_data(out / "data", seed=seed)
    (out / MARK).write_text(json.dumps({**mark, "files": _hashes(out)}, indent=1) + "\n")  # what a rewrite checks
    return again
