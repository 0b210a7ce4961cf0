"""model.new_tokens: special tokens added to the tokenizer, the embeddings and the LM head grown for them.

A base model without a chat template's markers (ChatML's <|im_start|> and <|im_end|> on the tiny Llama, whose
tokenizer spells them in ten characters each): each becomes one id, its rows start at the mean of the model's rows
and train (in full, or under LoRA as lora.modules_to_save copies the schema adds), and every loader of the run's
final/ (generate, export --merge, a reward model's adapter, resume) grows the base to the tokenizer first. The
estimate counts the grown rows exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import REPO, crash_at_step, invoke, launch_finetune, load_weights, losses, max_abs_diff, run_train, \
    write_recipe

from llmtrain.errors import LLMTrainError

NEW = ["<|im_start|>", "<|im_end|>"]
CHATML = ("{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
          "{%- if add_generation_prompt -%}<|im_start|>assistant\n{% endif -%}")
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}
CONFIGS = REPO / "accelerate_configs"


def _recipe(tiny: Path, tmp: Path, *, model: dict | None = None, data: dict | None = None, **sections) -> Path:
    (tmp / "chatml.jinja").write_text(CHATML)
    return write_recipe(tiny, tmp, model={"name_or_path": str(tiny / "model"), "dtype": "float32",
                                          "attn_implementation": "eager", "new_tokens": NEW, **(model or {})},
                        data={"chat_template": str(tmp / "chatml.jinja"), "max_seq_len": 64, **(data or {})},
                        **sections)


def _load(path: Path, *overrides: str):
    from llmtrain.config import load_recipe

    return load_recipe(path, list(overrides))


# --------------------------------------------------------------------------- the schema


def test_lora_trains_the_new_rows_as_copies_the_schema_adds(tiny_assets, tmp_path):
    recipe = _recipe(tiny_assets, tmp_path, lora=LORA)
    assert _load(recipe).lora.modules_to_save == ["embed_tokens", "lm_head"]
    assert _load(recipe, "lora.modules_to_save=[lm_head]").lora.modules_to_save == ["lm_head", "embed_tokens"]
    assert _load(recipe, "model.new_tokens=[]").lora.modules_to_save is None  # nothing new: nothing added
    assert _load(_recipe(tiny_assets, tmp_path)).lora is None  # a full fine-tune trains every row already
    # a reward model: peft saves its score head itself; the embeddings are the new rows
    (tmp_path / "rm").mkdir()
    rm = _recipe(tiny_assets, tmp_path / "rm", lora=LORA, reward_model={},
                 data={"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference"})
    assert _load(rm).lora.modules_to_save == ["embed_tokens"]


@pytest.mark.parametrize("tokens, words", [('["<a>", " "]', "' ' is blank"),
                                           ('["<a>", "<b>", "<a>"]', "<a> is listed more than once")])
def test_blank_or_repeated_new_tokens_are_refused(tiny_assets, tmp_path, tokens, words):
    with pytest.raises(LLMTrainError) as refused:
        _load(_recipe(tiny_assets, tmp_path), f"model.new_tokens={tokens}")
    assert "model.new_tokens" in str(refused.value) and words in str(refused.value)


# --------------------------------------------------------------------------- the tokenizer and the model


def test_each_new_token_is_one_id_and_its_rows_start_at_the_mean_row(tiny_assets, tmp_path):
    import torch

    from llmtrain.model.modeling import grow_vocabulary, load_model, load_tokenizer

    base_recipe = _load(_recipe(tiny_assets, tmp_path), "model.new_tokens=[]")
    base = load_model(base_recipe.model, None)
    old = base.get_input_embeddings().num_embeddings
    recipe = _load(_recipe(tiny_assets, tmp_path))
    tok = load_tokenizer(recipe.model)
    assert len(tok) == old + 2 and tok.convert_tokens_to_ids(NEW) == [old, old + 1]
    ids = tok("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids == [old, *tok("user\nhi", add_special_tokens=False)["input_ids"], old + 1]
    assert tok.decode([old + 1, 10], skip_special_tokens=True) == tok.decode([10])  # special: left out of replies

    model = load_model(recipe.model, None)
    assert model.config.vocab_size == old + 2
    for ours, theirs in ((model.get_input_embeddings(), base.get_input_embeddings()),
                         (model.get_output_embeddings(), base.get_output_embeddings())):
        assert torch.equal(ours.weight[:old], theirs.weight)  # the model's own rows as they were
        mean = theirs.weight.mean(0)
        assert torch.allclose(ours.weight[old:], mean.expand(2, -1), atol=1e-7)
        assert not torch.allclose(mean, theirs.weight[0])  # (a mean, not a copy of a row)
    # rows already there (a run's final/, or a model with spare rows past its tokenizer) are left as they are
    before = model.get_input_embeddings().weight.clone()
    grow_vocabulary(model, old + 2)
    assert torch.equal(model.get_input_embeddings().weight, before)


def test_a_tied_model_grows_its_one_table_and_trains_one_copy_of_it(tiny_assets, tmp_path):
    """Under LoRA the embeddings' and the head's copies are one tensor (peft's ensure_weight_tying; untied, a merge
    would keep only one of the two trained tables), and the estimate counts it once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llmtrain.memory import estimate_for_recipe
    from llmtrain.model.modeling import load_model

    config = AutoConfig.from_pretrained(tiny_assets / "model")
    config.tie_word_embeddings = True
    folder = tmp_path / "tied"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_assets / "model").save_pretrained(folder)
    recipe = _load(_recipe(tiny_assets, tmp_path, model={"name_or_path": str(folder)}, lora=LORA))
    model = load_model(recipe.model, None)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed is head and embed.shape[0] == config.vocab_size + 2
    assert torch.allclose(embed[-1], embed[:-2].mean(0), atol=1e-7)

    adapted = load_model(recipe.model, recipe.lora)
    embed, head = adapted.get_input_embeddings(), adapted.base_model.model.lm_head
    assert embed.modules_to_save["default"].weight is head.modules_to_save["default"].weight
    assert recipe.lora.modules_to_save == ["embed_tokens", "lm_head"]  # (peft extends the list it is given)
    est = estimate_for_recipe(recipe)
    assert est.params_trainable == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert est.params_total == sum(p.numel() for p in adapted.parameters())
    # it trains (the chunked loss finds the tied head copy, whose Linear peft labels in x out the other way round)
    run_train(_recipe(tiny_assets, tmp_path, model={"name_or_path": str(folder)}, lora=LORA,
                      train={"max_steps": 2}))
    saved = load_weights(tmp_path / "run" / "final" / "adapter_model.safetensors")
    tables = [t for k, t in saved.items() if k.endswith(("embed_tokens.weight", "lm_head.weight"))]
    assert tables and all(torch.equal(t, tables[0]) for t in tables) and tables[0].shape[0] == config.vocab_size + 2


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_estimate_counts_the_grown_rows_exactly(tiny_assets, tmp_path, lora):
    from llmtrain.memory import estimate_for_recipe
    from llmtrain.model.modeling import load_model

    recipe = _load(_recipe(tiny_assets, tmp_path, **({"lora": LORA} if lora else {})))
    model = load_model(recipe.model, recipe.lora)
    est = estimate_for_recipe(recipe)
    assert est.params_total == sum(p.numel() for p in model.parameters())
    assert est.params_trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_doctor_names_each_new_tokens_id_and_what_trains_it(tiny_assets, tmp_path):
    out = invoke("doctor", str(_recipe(tiny_assets, tmp_path, lora=LORA)), check=False).stdout
    text = " ".join(line.strip("│ ") for line in out.splitlines())
    assert "new tokens" in out and "<|im_start|> 104, <|im_end|> 105" in " ".join(text.split())
    assert "lora.modules_to_save embed_tokens, lm_head" in " ".join(text.split())


def test_a_model_with_per_layer_embeddings_is_refused_new_tokens(tiny_assets, tmp_path):
    """Gemma 4 looks each id up in a second table (its per-layer embeddings) that resize_token_embeddings does not
    grow: refused before any file is written, as every other model problem is (capabilities.model_problems)."""
    from transformers import AutoConfig

    from llmtrain.capabilities import model_problems
    from llmtrain.layout import Layout

    recipe = _load(_recipe(tiny_assets, tmp_path))
    gemma4 = AutoConfig.for_model("gemma4_text", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                  num_key_value_heads=1, num_hidden_layers=2, vocab_size=128, head_dim=32,
                                  global_head_dim=32, vocab_size_per_layer_input=128)
    (problem,) = model_problems(recipe, Layout.from_recipe(recipe), gemma4)
    assert problem.startswith("model.new_tokens grows the embeddings") and "vocab_size_per_layer_input" in problem
    llama = AutoConfig.from_pretrained(tiny_assets / "model")
    assert model_problems(recipe, Layout.from_recipe(recipe), llama) == []


def test_a_distillation_teacher_needs_the_students_new_tokens(tiny_assets, tmp_path):
    from llmtrain.model.modeling import load_model, load_tokenizer
    from llmtrain.model.teacher import vocabulary_problem

    recipe = _load(_recipe(tiny_assets, tmp_path), f"distill.teacher={tiny_assets / 'model'}")
    tokenizer = load_tokenizer(recipe.model)
    problem = vocabulary_problem(recipe, tokenizer)
    assert "a vocabulary of 104 ids and the student" in problem and "one of 106" in problem
    assert "model.new_tokens gives the student <|im_start|>, <|im_end|>: the teacher needs them too" in problem
    grown = tmp_path / "grown"  # a teacher trained with the same new tokens (a run's final/)
    load_model(recipe.model, None).save_pretrained(grown)
    tokenizer.save_pretrained(grown)
    assert vocabulary_problem(recipe.model_copy(update={"distill": recipe.distill.model_copy(
        update={"teacher": str(grown)})}), tokenizer) is None


def test_a_lora_adapter_named_as_the_model_is_refused_with_the_merge_that_makes_one(tiny_assets, tmp_path):
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "adapter_config.json").write_text("{}")
    (final.parent / "recipe.yaml").write_text("")
    from llmtrain.model.modeling import load_model

    with pytest.raises(LLMTrainError) as refused:
        load_model(_load(_recipe(tiny_assets, tmp_path)).model.model_copy(update={"name_or_path": str(final)}), None)
    assert f"'{final}' (model.name_or_path) is a LoRA adapter, not a whole model: `llmtrain export " \
        f"{final.parent} --merge` writes the whole model to {final.parent / 'final-merged'}" in str(refused.value)


# --------------------------------------------------------------------------- runs


@pytest.mark.slow
def test_a_lora_run_trains_the_new_rows_and_every_loader_grows_the_base(tiny_assets, tmp_path, monkeypatch):
    """The new rows move from the mean; `generate` and `export --merge` load the adapter onto a base grown to final/'s
    tokenizer, the merged model scoring as the adapter does and stopping at <|im_end|> (its generation_config); a run
    preempted mid-way resumes to the same losses and adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    from llmtrain.model.modeling import grow_vocabulary

    recipe = _recipe(tiny_assets, tmp_path, lora=LORA, train={"max_steps": 6, "lr": 1e-2},
                     checkpoint={"every_steps": 3, "save_final": True})
    run = tmp_path / "run"
    run_train(recipe)
    adapter = load_weights(run / "final" / "adapter_model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
    old = base.get_input_embeddings().num_embeddings
    for name, theirs in (("embed_tokens", base.get_input_embeddings()), ("lm_head", base.get_output_embeddings())):
        (key,) = [k for k in adapter if k.endswith(f"{name}.weight")]  # (modules_to_save's copy, as peft saves it)
        assert adapter[key].shape[0] == old + 2
        moved = (adapter[key][old:] - theirs.weight.mean(0)).abs().amax(1)
        assert (moved > 1e-4).all(), (name, moved)  # both new rows trained

    reply = invoke("generate", str(run), "reverse abc =")
    assert "a LoRA adapter on" in reply.stderr and "reply:" in reply.stdout
    invoke("export", str(run), "--merge", "--out", str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    grow_vocabulary(base, old + 2)
    adapted = PeftModel.from_pretrained(base, str(run / "final"))
    ids = torch.tensor([[old, 40, 41, old + 1, 10]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted(ids).logits, atol=1e-5)
    assert merged.config.vocab_size == old + 2
    assert old + 1 in GenerationConfig.from_pretrained(tmp_path / "merged").eos_token_id  # <|im_end|> ends a reply

    crash_at_step(monkeypatch, recipe, 5, f"output_dir={tmp_path / 'again'}")
    run_train(recipe, f"output_dir={tmp_path / 'again'}", resume="auto")
    assert losses(tmp_path / "again") == pytest.approx(losses(run), abs=1e-6)
    again = load_weights(tmp_path / "again" / "final" / "adapter_model.safetensors")
    assert max_abs_diff(again, adapter) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", pytest.param("pp", marks=pytest.mark.extended)])
def test_new_tokens_under_fsdp_and_pipeline_stages_train_as_one_process(tiny_assets, tmp_path, free_port, layout):
    """FSDP's receiving processes grow an empty model (the main process's rows reach them); a pipeline's first stage
    holds the embeddings' copy and its last the head's. LoRA, 3 steps: the losses of one process."""
    recipe = _recipe(tiny_assets, tmp_path, lora=LORA, train={"max_steps": 3, "lr": 1e-2, "micro_batch_size": 2,
                                                              "grad_accum_steps": 2})
    if layout == "fsdp":
        config, both, single, stages = CONFIGS / "cpu_fsdp.yaml", [], ["train.micro_batch_size=4"], []
    else:  # a packed row of 128 tokens a micro-batch, in varlen attention
        config, single, stages = CONFIGS / "cpu_ddp.yaml", [], ["parallel.pipeline_parallel=2"]
        both = ["train.micro_batch_size=1", "train.micro_batch_tokens=128", "model.attn_implementation=auto"]
    run_train(recipe, f"output_dir={tmp_path / 'one'}", *both, *single)
    launch_finetune(config, 2, free_port, recipe, *both, *stages, f"output_dir={tmp_path / layout}")
    assert losses(tmp_path / layout) == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    assert losses(tmp_path / "one")[-1] < losses(tmp_path / "one")[0]
    saved = yaml.safe_load((tmp_path / layout / "recipe.yaml").read_text())
    assert saved["lora"]["modules_to_save"] == ["embed_tokens", "lm_head"]


@pytest.mark.slow
def test_a_reward_models_adapter_loads_onto_a_grown_base(tiny_assets, tmp_path):
    """A reward model trained with new tokens (LoRA: the embeddings' copy and peft's score head) scores as it was
    trained when online RL loads it (score.load_reward_model grows its base to final/'s tokenizer first)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from llmtrain.model.modeling import grow_vocabulary
    from llmtrain.model.score import load_reward_model

    recipe = _recipe(tiny_assets, tmp_path, lora=LORA, reward_model={}, train={"max_steps": 3, "lr": 1e-2},
                     data={"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference"})
    run_train(recipe)
    final = tmp_path / "run" / "final"
    model, tokenizer = load_reward_model(str(final), torch.device("cpu"))
    old = len(tokenizer) - 2
    assert model.get_input_embeddings().num_embeddings == old + 2
    base = AutoModelForSequenceClassification.from_pretrained(tiny_assets / "model", num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    grow_vocabulary(base, old + 2)
    trained = PeftModel.from_pretrained(base, str(final)).eval()
    ids = torch.tensor([[old, 40, 41, old + 1, 10]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, trained(ids).logits, atol=1e-6)
    embed = model.get_input_embeddings()  # the trained copy's new rows moved from the mean they started at
    moved = (embed.modules_to_save["default"].weight[old:] - embed.original_module.weight[old:]).abs().amax(1)
    assert (moved > 1e-4).all(), moved
