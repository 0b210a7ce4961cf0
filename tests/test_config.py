"""The recipe schema: defaults live only there, overrides are validated like YAML, errors name the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from helpers import REPO

from llmtrain.config import Recipe, all_keys, load_recipe
from llmtrain.errors import RecipeError

REQUIRED_KEYS = ["train.max_steps", "train.epochs", "train.micro_batch_size", "train.grad_accum_steps", "train.lr",
                 "train.seed", "checkpoint.every_steps", "checkpoint.keep_last"]


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "myrun.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl", "format": "text"}}))
    return path


def test_schema_has_the_documented_keys():
    keys = set(all_keys())
    assert set(REQUIRED_KEYS) <= keys
    assert {"model", "data", "lora", "train", "checkpoint", "logging", "output_dir"} <= keys


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(arg, type) and hasattr(arg, "model_fields"):
                    walk(arg)

    walk(Recipe)


def test_defaults_and_output_dir_from_file_stem(recipe_file):
    r = load_recipe(recipe_file)
    assert r.output_dir == "runs/myrun"
    assert r.lora is None  # absent lora section means full fine-tune
    assert r.train.micro_batch_size == 1 and r.train.grad_accum_steps == 1
    assert r.model.trust_remote_code is False and r.model.attn_implementation == "auto"


def test_overrides_are_typed_and_validated(recipe_file):
    r = load_recipe(recipe_file, ["train.max_steps=8", "train.lr=1e-4", "output_dir=/tmp/x", "lora.r=8",
                                  "lora.target_modules=[q_proj, v_proj]", "data.packing=true"])
    assert r.train.max_steps == 8 and r.train.lr == 1e-4 and r.output_dir == "/tmp/x"
    assert r.lora.r == 8 and r.lora.target_modules == ["q_proj", "v_proj"] and r.data.packing is True
    with pytest.raises(RecipeError, match=r"train.max_steps \(the override train.max_steps=0\): must be more than 0"):
        load_recipe(recipe_file, ["train.max_steps=0"])


def test_roles_are_refused_where_the_rows_hold_no_messages(recipe_file):
    """data.roles on text or alpaca rows had been taken and ignored: nothing in such a row has a role."""
    with pytest.raises(RecipeError, match=r"data.roles maps the roles of messages, and data.format text has none"):
        load_recipe(recipe_file, ["data.roles={human: user}"])
    mixture = ["data.path=null", "data.format=null", "data.sources=[{path: a.jsonl, format: messages, weight: 1}, "
               "{path: b.jsonl, format: alpaca, weight: 1, roles: {human: user}}]"]
    with pytest.raises(RecipeError, match=r"data.sources\[1\].roles maps .* data.format alpaca has none"):
        load_recipe(recipe_file, mixture)
    for fmt in ("messages", "prompt_completion"):  # prompt_completion: TRL's conversational rows have roles
        assert load_recipe(recipe_file, [f"data.format={fmt}", "data.roles={human: user}"]).data.roles == {
            "human": "user"}


@pytest.mark.parametrize(("override", "suggestion"), [
    ("train.learning_rate=1e-4", "train.lr"),
    ("train.lerning_rate=1e-4", "train.lr"),  # a misspelt alias: it had suggested train.min_lr_ratio
    ("data.max_lenght=64", "data.max_seq_len"),
    ("train.max_step=3", "train.max_steps"),
    ("checkpoint.save_steps=10", "checkpoint.every_steps"),
    ("trian.lr=1", "train"),
    ("parallel.pipeline=2", "parallel.pipeline_parallel, parallel.pipeline_schedule or parallel.pipeline_chunks"),
])
def test_typos_get_the_nearest_key(recipe_file, override, suggestion):
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [override])
    assert f"did you mean {suggestion}" in str(e.value)
    assert f"(the override {override})" in str(e.value)  # a mistyped section too names the override that made it


def test_a_typo_in_a_list_item_is_suggested_with_its_index():
    """'did you mean rl.rewards.column?' had dropped the item's index."""
    with pytest.raises(RecipeError) as e:
        load_recipe(REPO / "recipes" / "tiny-grpo.yaml", ["rl.rewards=[{type: format, pattern: x}, "
                                                          "{type: answer_match, colum: completion}]"])
    assert "rl.rewards.1.colum: unknown key (did you mean rl.rewards.1.column?)" in str(e.value), str(e.value)


@pytest.mark.parametrize(("override", "default"), [("train.micro_batch_size=null", "1"), ("lora.r=null", "16"),
                                                     ("train.lr=null", "2e-05"), ("data.split=null", "'train'"),
                                                     ("model.dtype=~", "'float32'")])
def test_null_on_a_key_without_an_unset_state_says_so_and_its_default(recipe_file, override, default):
    """It had said pydantic's 'Input should be a valid integer' of a null, which reads as a typo in the value; on a
    text key (data.split=null) the null had been the text 'null', a split no dataset has, and on a choice of texts
    (model.dtype) pydantic's list of choices."""
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [override])
    assert f"(the override {override}): cannot be null (the key has no unset state; its default is {default}): " \
        "set a value" in str(e.value)
    assert "Input should be" not in str(e.value)


@pytest.mark.parametrize(("override", "null"), [("train.eval_every_steps=0", True), ("train.max_steps=-1", True),
                                              ("train.micro_batch_size=0", False)])
def test_a_bound_on_a_key_whose_default_is_null_says_null_unsets_it(recipe_file, override, null):
    """`train.eval_every_steps=0`, a new user's way to turn it off, was told only 'Input should be greater than 0'."""
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [override])
    assert f"(the override {override}): must be more than 0" in str(e.value)
    assert ("(or null, its default, which leaves it unset)" in str(e.value)) == null


@pytest.mark.parametrize(("override", "line"), [
    ("model.tiled_mlp=abc", "model.tiled_mlp (the override model.tiled_mlp=abc): expected true or false, or a whole "
                            "number"),
    ("data.eval_split=[1]", "data.eval_split (the override data.eval_split=[1]): expected a number, text, or a list "
                            "of text"),
    ("kto=5", "kto (the override kto=5): is a section of keys (kto.KEY=VALUE on the command line, an indented block "
              "under kto: in YAML), not 5"),
    ("eval.tasks=gsm8k", "eval.tasks (the override eval.tasks=gsm8k): expected a list, not 'gsm8k' (eval.tasks=[a, "
                         "b] on the command line, [a, b] or one item a line under it in YAML)"),
    # a section made by a misspelt key is not also missing its required keys (eval.tasks)
    ("eval.every_steps=5", "eval.every_steps (the override eval.every_steps=5): unknown key (did you mean "
                           "train.eval_every_steps?)"),
])
def test_pydantics_own_names_never_show(recipe_file, override, line):
    """A union's members (model.tiled_mlp.bool, .int) and a section's class (instance of KTOConfig) are pydantic's
    names, not the recipe's keys (issue 53): one line a key, in the recipe's words."""
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [override])
    assert f"\n  - {line}\n" in str(e.value) and "instance of" not in str(e.value)
    assert str(e.value).count("\n  - ") == 1


def test_all_problems_reported_together(recipe_file):
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, ["train.lr=-1", "data.format=csv", "data.eval_split=1.5", "model.dtype=int8"])
    msg = str(e.value)
    for key in ("train.lr", "data.format", "data.eval_split", "model.dtype"):
        assert key in msg
    assert str(recipe_file) in msg


def test_bad_files_and_overrides(tmp_path, recipe_file):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name_or_path: m\ndata: [")
    with pytest.raises(RecipeError, match="line"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="key=value"):
        load_recipe(recipe_file, ["train.lr"])
    with pytest.raises(RecipeError, match="required key is missing"):
        empty = tmp_path / "empty.yaml"
        empty.write_text("train: {lr: 1.0e-4}\n")
        load_recipe(empty)
    with pytest.raises(RecipeError, match=r"eval.tasks: required key is missing"):  # a known key: the section is meant
        load_recipe(recipe_file, ["eval.batch_size=4"])


def test_resolved_recipe_round_trips(recipe_file, tmp_path):
    r = load_recipe(recipe_file, ["train.betas=[0.9, 0.95]", "lora.alpha=16"])
    out = tmp_path / "resolved.yaml"
    out.write_text(r.to_yaml())
    assert load_recipe(out) == r


@pytest.mark.parametrize("shipped", sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_recipe_round_trips_through_its_runs_recipe_yaml(shipped, tmp_path):
    """A run writes its resolved recipe, every default spelt out, to recipe.yaml, which eval, generate, doctor and
    `--resume auto` read back: a refusal of a key set where it is unread must not refuse its default (a DPO run's
    recipe.yaml, simpo_gamma 0.5 in it, was refused by every command after training)."""
    r = load_recipe(shipped)
    out = tmp_path / "recipe.yaml"
    out.write_text(r.to_yaml(working_dir=str(tmp_path)))
    assert load_recipe(out) == r
    for loss in ("ipo", "simpo", "orpo", "discopop") if r.preference is not None else ():
        other = load_recipe(shipped, [f"preference.loss={loss}"])
        out.write_text(other.to_yaml())
        assert load_recipe(out) == other, loss


def test_mixed_precision_no_unquoted(tmp_path):
    """YAML 1.1 reads an unquoted `no` as false; in the file and as an override it means "no"."""
    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: m}\ndata: {path: d.jsonl, format: text}\ntrain:\n  mixed_precision: no\n")
    assert load_recipe(path).train.mixed_precision == "no"
    assert load_recipe(path, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_recipe(path, ["train.mixed_precision=bf16"]).train.mixed_precision == "bf16"


@pytest.mark.parametrize(("override", "key", "value"), [
    # ` #` would start a YAML comment and cut the prompt short
    ("data.system_prompt=Solve it step by step. End with #### N.", "data.system_prompt",
     "Solve it step by step. End with #### N."),
    ("data.system_prompt=Reply: yes", "data.system_prompt", "Reply: yes"),  # YAML: a mapping, refused
    ("data.system_prompt=yes", "data.system_prompt", "yes"),  # YAML 1.1: True
    ("data.system_prompt=null", "data.system_prompt", None),  # unsets an optional text key
    ("data.system_prompt='null'", "data.system_prompt", "null"),  # quoted: the text itself
    ("data.name=007", "data.name", "007"),  # YAML: 7
    ("data.fields.prompt=a=b", "data.fields", {"prompt": "a=b"}),  # only the first = separates
    ("output_dir=runs/x #1", "output_dir", "runs/x #1"),
    ("data.fields={prompt: question}", "data.fields", {"prompt": "question"}),  # mappings are YAML
    ("data.eval_split=0.05", "data.eval_split", 0.05),  # a key that also takes numbers is YAML
    ("train.max_steps=20", "train.max_steps", 20),
])
def test_a_text_value_is_the_text_as_given(recipe_file, override, key, value):
    r = load_recipe(recipe_file, ["data.chat_template=true", "data.format=messages", override])
    section, _, leaf = key.rpartition(".")
    got = getattr(getattr(r, section) if section else r, leaf)
    assert got == value


@pytest.mark.parametrize("key", ["rl.temperature", "distill.temperature"])
def test_a_temperature_whose_logits_overflow_is_refused(key):
    """Logits divided by 1e-40 overflow float32: every draw and every log-probability NaN. vLLM's floor, 1e-5."""
    section, field = key.split(".")
    recipe = REPO / "recipes" / {"rl": "tiny-grpo.yaml", "distill": "tiny-distill.yaml"}[section]
    with pytest.raises(RecipeError, match=rf"{key}.*must be 1e-05 or more"):
        load_recipe(recipe, [f"{key}=1e-40"])
    assert getattr(getattr(load_recipe(recipe, [f"{key}=1e-5"]), section), field) == 1e-5


def test_max_tool_calls_zero_is_refused():
    """0 rounds: the prompts show the tools and the model writes calls whose results never come, while
    tools/call_frequency said 0 (audit 25: 15 of 64 completions had called)."""
    recipe = REPO / "recipes" / "tiny-tools-grpo.yaml"
    with pytest.raises(RecipeError, match="rl.max_tool_calls 0 runs no call while the prompts still show the tools"):
        load_recipe(recipe, ["rl.max_tool_calls=0"])
    assert load_recipe(recipe, ["rl.max_tool_calls=1"]).rl.max_tool_calls == 1


@pytest.mark.parametrize("recipe, says", [
    ("tiny-grpo.yaml", "rl: the loss is the policy's on its sampled completions only"),
    ("tiny-rloo.yaml", "rl: the loss is the policy's on its sampled completions only"),
    ("tiny-reward.yaml", "reward_model: scores each sequence at its last token"),  # these three had been ignored
    ("tiny-kto.yaml", "kto: compares the log-probabilities of the completions only"),
    ("tiny-distill.yaml", "distill: matches the teacher on completion tokens only"),
])
def test_train_on_prompt_is_refused_where_no_prompt_token_is_trained(recipe, says):
    with pytest.raises(RecipeError, match=rf"{says}.*; unset data.train_on_prompt"):
        load_recipe(REPO / "recipes" / recipe, ["data.train_on_prompt=true"])
    assert not load_recipe(REPO / "recipes" / recipe).data.train_on_prompt


def test_a_mixture_sources_problem_is_said_without_pydantics_prefix():
    """A source's own refusal had read "data.sources[1] (b.jsonl): Value error, data.system_prompt ..."."""
    from llmtrain.config import DataConfig, source_configs

    data = DataConfig(sources=[{"path": "a.jsonl", "format": "messages", "weight": 0.5},
                               {"path": "b.jsonl", "format": "text", "weight": 0.5}],
                      system_prompt="Be brief.")
    with pytest.raises(RecipeError) as err:
        source_configs(data)
    assert str(err.value).startswith("data.sources[1] (b.jsonl): data.system_prompt puts a system message")
    assert "Value error" not in str(err.value)


@pytest.mark.parametrize("section, says", [
    # reference auto on a reference-free loss: the sync had done nothing
    ({"loss": "simpo", "sync_reference": {"every_steps": 1, "alpha": 0.6}},
     "preference.loss=simpo has no reference: remove preference.sync_reference"),
    # TRL's DPOTrainer knobs on its ORPO / CPO trainers' losses: they had changed the loss (and ORPO's nll_loss)
    ({"loss": "orpo", "ld_alpha": 0.0, "wpo": True}, "preference.ld_alpha and preference.wpo weigh DPO's"),
    ({"loss": "simpo", "wpo": True}, "preference.loss=simpo is TRL's CPOTrainer's, which has none"),
    # the sft term had read the LD-weighted log-probabilities: 9% off TRL's loss on longer chosen answers
    ({"loss": "dpo", "ld_alpha": 0.5, "sft_weight": 0.3}, "preference.sft_weight with preference.ld_alpha"),
    # read by one loss, ignored without a word by the others (as label_smoothing and f_alpha are refused)
    ({"loss": "dpo", "simpo_gamma": 1.0}, "preference.simpo_gamma is read by preference.loss=simpo"),
    ({"loss": "ipo", "discopop_tau": 0.3}, "preference.discopop_tau is read by preference.loss=discopop"),
])
def test_a_preference_setting_its_loss_does_not_read_is_refused(section, says):
    from llmtrain.config import PreferenceConfig

    with pytest.raises(ValueError, match=re.escape(says)):
        PreferenceConfig(**section)


def test_the_preference_settings_their_loss_reads_are_taken():
    from llmtrain.config import PreferenceConfig

    assert PreferenceConfig(loss="simpo", simpo_gamma=1.0).simpo_gamma == 1.0
    assert PreferenceConfig(loss="discopop", discopop_tau=0.3).discopop_tau == 0.3
    assert PreferenceConfig(loss="dpo", ld_alpha=0.5, wpo=True).wpo
    assert PreferenceConfig(loss="dpo", sft_weight=0.3).sft_weight == 0.3


@pytest.mark.parametrize("override", ["train.lr=yes", "train.max_steps=true", "lora.r=true", "lora.alpha=on",
                                      "checkpoint.keep_last=yes", "train.grad_accum_steps=false"])
def test_a_boolean_is_not_taken_as_a_number(recipe_file, override):
    """YAML reads yes, on and true as true, which pydantic took as 1 in every number key: `train.lr=yes` trained at
    a learning rate of 1.0 (audit 47; parallel.* alone refused it)."""
    key, _, value = override.partition("=")
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [override])
    assert f"{key} (the override {override}): is a number, not {str(yaml.safe_load(value)).lower()}" in str(e.value)


def test_a_key_with_no_value_is_refused_whatever_its_type(recipe_file):
    """`output_dir=$OUT` with OUT unset wrote the run into the current folder, and `model.name_or_path=` was the
    text '' (a number key had been refused); `key=null` unsets a key, `key=''` is the empty text."""
    for override in ("output_dir=", "model.name_or_path=", "model.tokenizer=", "train.max_steps="):
        with pytest.raises(RecipeError, match=f"Override '{re.escape(override)}' has no value"):
            load_recipe(recipe_file, [override])
    assert load_recipe(recipe_file, ["model.tokenizer=null"]).model.tokenizer is None
    assert load_recipe(recipe_file, ["data.system_prompt=''"]).data.system_prompt == ""


@pytest.mark.parametrize(("override", "says"), [
    ("train.betas=[1.5,0.999]", "train.betas.0 (the override train.betas=[1.5,0.999]): must be less than 1"),
    ("train.betas=[0.9,-1]", "train.betas.1 (the override train.betas=[0.9,-1]): must be 0 or more"),
    ("train.eps=.inf", "train.eps (the override train.eps=.inf): must be a finite number (not inf or nan)"),
    ("train.weight_decay=.inf", "train.weight_decay (the override train.weight_decay=.inf): must be a finite"),
    ("lora.alpha=.inf", "lora.alpha (the override lora.alpha=.inf): must be a finite number (not inf or nan)"),
    ("train.max_grad_norm=.nan", "train.max_grad_norm (the override train.max_grad_norm=.nan): must be a finite "
                                 "number"),
])
def test_optimizer_and_adapter_numbers_out_of_their_range_are_refused(recipe_file, override, says):
    """AdamW's betas outside [0, 1) had ended in torch's traceback at the first step, an infinite eps trained nothing
    and an infinite weight decay diverged with the advice to lower the learning rate (audit 47)."""
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [override])
    assert says in str(e.value)


def test_adaptive_entropys_switch_is_a_boolean():
    """`rl.use_adaptive_entropy=fasle` (or 2, or maybe) turned it on: the switch was read as Python's truth before
    validation (audit 47)."""
    grpo = REPO / "recipes" / "tiny-grpo.yaml"
    for value in ("fasle", "2", "maybe"):
        with pytest.raises(RecipeError, match=f"rl.use_adaptive_entropy \\(the override rl.use_adaptive_entropy="
                                              f"{value}\\): must be true or false"):
            load_recipe(grpo, [f"rl.use_adaptive_entropy={value}"])
    assert load_recipe(grpo, ["rl.use_adaptive_entropy=true"]).rl.entropy_target == 0.2
    off = load_recipe(grpo, ["rl.use_adaptive_entropy='false'"]).rl
    assert off.use_adaptive_entropy is False and off.entropy_target is None


@pytest.mark.parametrize(("override", "line"), [
    ("eval.batch_size=0", "eval.batch_size (the override eval.batch_size=0): expected a whole number above 0, or "
                          "auto"),
    ("eval.batch_size=Auto", "eval.batch_size (the override eval.batch_size=Auto): expected a whole number, or auto"),
    ("eval.batch_size=null", "eval.batch_size (the override eval.batch_size=null): cannot be null (the key has no "
                             "unset state; its default is 1): set a value"),
    ("train.betas=[0.9]", "train.betas (the override train.betas=[0.9]): expected 2 items, got 1"),
])
def test_a_union_or_a_pair_is_said_in_the_recipes_words(recipe_file, override, line):
    """eval.batch_size's refusals had been two lines in pydantic's words (`eval.batch_size.constrained-int`,
    `expected literal['auto']`), and a pair of one item 'train.betas.1: required key is missing' (audit 47)."""
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, ["eval.tasks=[a]", override])
    assert f"\n  - {line}\n" in str(e.value)
    assert str(e.value).count("\n  - ") == 1


@pytest.mark.parametrize(("override", "says"), [
    ("lora.target_modules=q_proj", "lora.target_modules=[q_proj]"),
    ("lora.target_modules=q_proj,v_proj", "lora.target_modules=[q_proj,v_proj]"),
    ("lora.target_modules=all_linear", "all-linear"),
])
def test_one_module_name_as_target_modules_is_refused_with_the_list_it_means(recipe_file, override, says):
    """peft reads a text target_modules as a regular expression of the whole module path, so `q_proj` matched no
    layer and was refused at the model's load by a message that listed q_proj among the layers (audit 47); a regular
    expression stays peft's."""
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [override])
    assert says in str(e.value)
    regex = r".*\.(q_proj|v_proj)"
    assert load_recipe(recipe_file, [f"lora.target_modules={regex}"]).lora.target_modules == regex
    assert load_recipe(recipe_file, ["lora.target_modules=all-linear"]).lora.target_modules == "all-linear"
    assert load_recipe(recipe_file, ["lora.target_modules=lm_head"]).lora.target_modules == "lm_head"  # top level


def test_a_rope_scaling_key_its_type_does_not_read_is_refused(recipe_file):
    """`beta_fst` (yarn's beta_fast misspelt) had been passed to transformers, which read nothing of it (audit 47)."""
    with pytest.raises(RecipeError, match=r"rope_type yarn reads no beta_fst \(did you mean beta_fast\?\)"):
        load_recipe(recipe_file, ["model.rope_scaling={rope_type: yarn, factor: 4, beta_fst: 32}"])
    with pytest.raises(RecipeError, match="rope_type linear reads no low_freq_factor"):
        load_recipe(recipe_file, ["model.rope_scaling={rope_type: linear, factor: 2, low_freq_factor: 1}"])
    yarn = load_recipe(recipe_file, ["model.rope_scaling={rope_type: yarn, factor: 4, beta_fast: 32}"])
    assert yarn.model.rope_scaling.beta_fast == 32


@pytest.mark.parametrize(("override", "suggestion"), [
    ("rl.kl_coef=0.1", "rl.beta"),
    ("preference.ref_model_mixup_alpha=0.5", "preference.sync_reference.alpha"),
    ("preference.ref_model_sync_steps=5", "preference.sync_reference.every_steps"),
    ("rl.vllm_importance_sampling_correction=true", "rl.sampler_correction"),
])
def test_other_tools_names_suggest_the_key_that_means_the_same(override, suggestion):
    """`rl.kl_coef` had suggested rl.entropy_coef and `preference.ref_model_mixup_alpha` preference.f_alpha: keys
    that mean something else (audit 47)."""
    recipe = REPO / "recipes" / ("tiny-grpo.yaml" if override.startswith("rl.") else "tiny-dpo.yaml")
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, [override])
    assert f"unknown key (did you mean {suggestion}?)" in str(e.value)


def test_an_empty_optional_section_in_the_file_is_refused_naming_its_line(tmp_path):
    """`lora:` with its keys commented out is YAML's null: the run had been a full fine-tune without a word (and an
    empty `distill:` plain SFT; audit 47). `lora: null` (written out) and `lora: {}` mean what they say, and an
    override of the section decides it."""
    base = REPO / "recipes" / "tiny.yaml"
    path = tmp_path / "commented.yaml"
    path.write_text(base.read_text() + "lora:\n  # r: 8\n  # alpha: 16\n")
    line = len(base.read_text().splitlines()) + 1
    with pytest.raises(RecipeError, match=rf"lora: \(line {line} of .*commented.yaml'\) is empty.*full fine-tune.*"
                                          r"lora: \{\}"):
        load_recipe(path)
    assert load_recipe(path, ["lora={}"]).lora.r == 16 and load_recipe(path, ["lora.r=8"]).lora.r == 8
    assert load_recipe(path, ["lora=null"]).lora is None
    (tmp_path / "null.yaml").write_text(base.read_text() + "lora: null\n")
    assert load_recipe(tmp_path / "null.yaml").lora is None
    (tmp_path / "defaults.yaml").write_text(base.read_text() + "lora: {}\n")
    assert load_recipe(tmp_path / "defaults.yaml").lora.r == 16


@pytest.mark.parametrize(("override", "line"), [
    ("model.name_or_path=null", "model.name_or_path (the override model.name_or_path=null): cannot be null (the key "
                                "is required): set a value"),
    ("model.new_tokens=null", "model.new_tokens (the override model.new_tokens=null): cannot be null (the key has no "
                              "unset state; its default is []): set a value"),
    ("train=null", "train (the override train=null): is a section of keys (train.KEY=VALUE on the command line, an "
                   "indented block under train: in YAML), not null"),
])
def test_null_is_said_as_yamls_null_and_a_required_key_as_required(recipe_file, override, line):
    """`train=null` had said "not None" (Python's), a required key pydantic's 'Input should be a valid string', and a
    key with a default_factory (a list) no default (audit 47)."""
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [override])
    assert f"\n  - {line}\n" in str(e.value)


def test_null_on_a_list_items_key_names_the_items_default():
    with pytest.raises(RecipeError) as e:
        load_recipe(REPO / "recipes" / "tiny-grpo.yaml", ["rl.rewards.0.batch_size=null"])
    assert "rl.rewards.0.batch_size (the override rl.rewards.0.batch_size=null): cannot be null (the key has no " \
           "unset state; its default is" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(REPO / "recipes" / "tiny-grpo.yaml", ["rl.rewards=[answer_match]"])
    assert "rl.rewards.0 (the override rl.rewards=[answer_match]): is a mapping of keys ({type: answer_match, ...} " \
           "as the list's item), not 'answer_match'" in str(e.value)


def test_numbers_read_as_written_not_as_yaml_1_1s_octal_or_base_60(recipe_file, tmp_path):
    """PyYAML's YAML 1.1 read `010` as 8 and `1:30` as 90 (audit 47): a seed or a step count written with a leading
    zero changed without a word. They are read as written now (YAML 1.2's core schema, as a reader means them)."""
    r = load_recipe(recipe_file, ["train.max_steps=010", "train.seed=007"])
    assert (r.train.max_steps, r.train.seed) == (10, 7)
    with pytest.raises(RecipeError, match=r"train.max_steps \(the override train.max_steps=1:30\)"):
        load_recipe(recipe_file, ["train.max_steps=1:30"])
    path = tmp_path / "octal.yaml"
    path.write_text(recipe_file.read_text() + "train:\n  seed: 010\n  lr: 1:30.0\n")
    with pytest.raises(RecipeError, match=r"train.lr"):
        load_recipe(path)
    path.write_text(recipe_file.read_text() + "train:\n  seed: 010\n  max_steps: 0x10\n")
    assert (load_recipe(path).train.seed, load_recipe(path).train.max_steps) == (10, 16)


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of a key written twice, so a second `train:` section replaced the whole first one (lr
    and batch back to their defaults) without a word (audit 49): refused naming both lines; YAML's merge keys still
    merge."""
    path = tmp_path / "twice.yaml"
    path.write_text("model: {name_or_path: m}\ndata: {path: d.jsonl, format: text}\ntrain:\n  lr: 1.0e-3\n"
                    "  micro_batch_size: 16\ntrain:\n  max_steps: 5\n")
    with pytest.raises(RecipeError, match=r"not valid YAML at line 6, column 1: the key 'train' is written twice "
                                          r"\(first at line 3\): YAML would keep the second alone"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"Override 'data.fields=\{a: b, a: c\}': its value is not valid YAML \(the "
                                          r"key 'a' is written twice"):
        load_recipe(_write(tmp_path, "ok.yaml"), ["data.fields={a: b, a: c}"])
    merged = _write(tmp_path, "merged.yaml", "model: {name_or_path: m}\ndata: {path: d.jsonl, format: text}\n"
                                             "train: {<<: {lr: 1.0e-3, max_steps: 4}, max_steps: 7}\n")
    assert (load_recipe(merged).train.lr, load_recipe(merged).train.max_steps) == (1e-3, 7)
    from llmtrain.overrides import read_yaml  # a merge of a mapping that merges itself (the first check had refused)

    nested = "base: &base {lr: 1}\nouter: {mid: &mid {<<: *base, lr: 2}}\ntop: {<<: *mid}\n"
    assert read_yaml(nested)["top"] == {"lr": 2}


def _write(tmp_path, name: str, text: str = "") -> Path:
    path = tmp_path / name
    path.write_text(text or "model: {name_or_path: m}\ndata: {path: d.jsonl, format: text}\n")
    return path


def test_a_recipe_that_is_not_utf8_and_other_values_a_crash_met_are_one_line_each(tmp_path):
    """Audit 49's tracebacks at load: a recipe saved as Latin-1, a lora.target_modules that is no regular expression,
    an empty list of data files; and pydantic's own words (bounds, choices, kinds) in the recipe's."""
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"# caf\xe9\n" + _write(tmp_path, "base.yaml").read_bytes())
    with pytest.raises(RecipeError, match=r"Recipe '.*latin.yaml' is not UTF-8 text \(byte 0xe9 at line 1\): save it "
                                          "as UTF-8"):
        load_recipe(latin)
    base = _write(tmp_path, "ok.yaml")
    with pytest.raises(RecipeError) as e:
        load_recipe(base, ["lora.target_modules=.*(q_proj", "data.path=[]", "data.eval_split=[]",
                           "train.schedule=cosin", "train.micro_batch_size=1.5", "model.compile=maybe"])
    said = str(e.value)
    for line in ("lora.target_modules (the override lora.target_modules=.*(q_proj): '.*(q_proj' is not a regular "
                 "expression (missing ), unterminated subpattern at position 2)",
                 "data.path (the override data.path=[]): is an empty list: give at least 1 item",
                 "data.eval_split (the override data.eval_split=[]): is an empty list: give at least 1 item",
                 "train.schedule (the override train.schedule=cosin): must be one of linear, cosine, constant (did "
                 "you mean cosine?)",
                 "train.micro_batch_size (the override train.micro_batch_size=1.5): must be a whole number",
                 "model.compile (the override model.compile=maybe): must be true or false"):
        assert line in said, said
    assert "Input should" not in said
    with pytest.raises(RecipeError, match=r"train.betas \(the override train.betas=\[0.9,0.99,0.9\]\): must have at "
                                          r"most 2 items"):
        load_recipe(base, ["train.betas=[0.9,0.99,0.9]"])


def test_a_key_spelt_with_capitals_is_named_with_the_key_it_means(tmp_path):
    """A capitalised key was taken for one of pydantic's union names and cut from its message ("- : unknown key",
    "- train: unknown key (did you mean train?)" for train.LR; audit 49)."""
    path = _write(tmp_path, "caps.yaml", "model: {name_or_path: m}\ndata: {path: d.jsonl, format: text}\n"
                                         "Train: {max_steps: 5}\ntrain: {LR: 1.0e-3}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(path, ["TRAIN.LR=1"])
    for line in ("  - Train: unknown key (did you mean train?)", "  - train.LR: unknown key (did you mean train.lr?)",
                 "  - TRAIN (the override TRAIN.LR=1): unknown key (did you mean train?)"):
        assert line in str(e.value), str(e.value)


@pytest.mark.parametrize("override", ["preference.simpo_gamma=inf", "preference.beta=.inf", "kto.beta=.nan",
                                      "rl.epsilon_high=.inf", "distill.temperature=-inf"])
def test_an_infinite_or_undefined_number_is_refused_in_every_section(override):
    """An infinite preference.simpo_gamma trained on an infinite loss and crashed after final/, an infinite beta
    ended in advice to lower train.lr (audit 49): every number key refuses inf and nan, but where .inf means no bound
    (rl.sampler_correction_max)."""
    recipe = REPO / "recipes" / {"preference": "tiny-dpo.yaml", "kto": "tiny-kto.yaml", "rl": "tiny-grpo.yaml",
                                 "distill": "tiny-distill.yaml"}[override.split(".")[0]]
    with pytest.raises(RecipeError, match=rf"{re.escape(override.split('=')[0])} \(the override .*\): must be a "
                                          r"finite number \(not inf or nan\)"):
        load_recipe(recipe, [override])
    grpo = load_recipe(REPO / "recipes" / "tiny-grpo.yaml", ["rl.sampler_correction=token_truncate",
                                                             "rl.sampler_correction_min=0.5",
                                                             "rl.sampler_correction_max=.inf"])
    assert grpo.rl.sampler_correction_max == float("inf")


def test_an_output_dir_no_folder_can_be_named_is_refused(recipe_file):
    """A NUL byte in output_dir ended in a ValueError's traceback in doctor and finetune (audit 49)."""
    with pytest.raises(RecipeError, match=r"output_dir \(the override .*\): 'a\\x00b' holds a NUL byte or a line "):
        load_recipe(recipe_file, ["output_dir=a\x00b"])
    assert load_recipe(recipe_file, ["output_dir=runs/a b"]).output_dir == "runs/a b"
