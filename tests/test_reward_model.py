"""Reward models (the reward_model: section, data.format: preference): the loss and gradient against TRL 1.16's
RewardTrainer on the same batch; the score read at each sequence's last non-pad token only, packed as padded; a run on
the tiny task's pairs that scores held-out pairs right; final/ loading with transformers and scoring as it trained
(full and LoRA); a killed run resumed exactly; two DDP processes equal to one; the trained model as GRPO's reward
(rl.rewards: type reward_model); and the folders and recipes refused."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from helpers import REPO, cli, crash_at_step, launch_finetune, load_weights, max_abs_diff, records, run_train, write_recipe

from llmtrain.config import DataConfig, RewardModelConfig
from llmtrain.data.pairs import encode_pair
from llmtrain.errors import LLMTrainError, RecipeError
from llmtrain.model.score import MODEL_INPUTS, attach_score, scored_position, sequence_scores
from llmtrain.objectives.reward_model import RewardModel

PAIRS = [
    {"prompt": "reverse abc =", "chosen": " cba", "rejected": " abc", "margin": 0.5},
    {"prompt": "reverse hello =", "chosen": " olleh", "rejected": " hello", "margin": 1.0},
    {"prompt": "reverse xy =", "chosen": " yx", "rejected": " xyy", "margin": 0.0},
    {"prompt": "reverse stop =", "chosen": " pots", "rejected": " spot", "margin": 2.0},
]


def seq_cls(tiny_assets, *, lora: bool = False):
    """The tiny Llama under a one-output score head, as a reward_model: run builds it (fp32, eager attention), its
    decoder and head moved off the checkpoint's values so that no gradient is trivially zero."""
    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model.modeling import load_model

    torch.manual_seed(0)
    model = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"),
                       LoraConfig(r=4, alpha=8, dropout=0.0) if lora else None, reward_head=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def encoded(tiny_tok, pairs=PAIRS) -> list[dict]:
    cfg = DataConfig(path="x.jsonl", format="preference")
    return [{**encode_pair(p, tiny_tok, cfg), "margin": p["margin"]} for p in pairs]


# --------------------------------------------------------------------------- against TRL


@pytest.fixture
def fresh_accelerate_state():
    """TRL's Trainer sets up Accelerate's process-wide state its own way (use_cpu); put it back afterwards."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("margin, center", [(False, None), (True, None), (False, 0.01), (True, 0.5)])
def test_loss_and_gradient_equal_trls_reward_trainer(tiny_assets, tiny_tok, tmp_path, fresh_accelerate_state,
                                                     margin, center):
    """TRL's RewardTrainer.compute_loss on its padded batch (its own tokenisation of the same rows, the scores
    transformers' forward picks from every token's) against llmtrain's packed pairs (varlen-style restarts, the head
    on the 8 scored tokens only): the same mean loss and the same gradient of every parameter, to 1e-6 in fp32."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    model = seq_cls(tiny_assets)
    ours_model = copy.deepcopy(model)  # before TRL touches its own
    rows = [p if margin else {k: v for k, v in p.items() if k != "margin"} for p in PAIRS]
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PAIRS),
                            report_to="none", use_cpu=True, bf16=False, fp16=False, max_length=None,
                            center_rewards_coefficient=center)
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                processing_class=tiny_tok)
    examples = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    ours_rows = encoded(tiny_tok)
    for row, theirs in zip(ours_rows, examples):  # the same tokens: prompt + answer + EOS
        assert (row["chosen_ids"], row["rejected_ids"]) == (theirs["chosen_ids"], theirs["rejected_ids"])
    trainer.model.train()  # its metrics go under "train"
    theirs_loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    theirs_loss.backward()
    theirs_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    attach_score(ours_model)
    objective = RewardModel(RewardModelConfig(center_rewards_coefficient=center), pad_id=tiny_tok.pad_token_id,
                            score_pad_id=tiny_tok.pad_token_id, packing=True, margin=margin)
    batch, counts = objective.collate(ours_rows)
    assert "cu_seq_lens" in batch and batch["score_index"].numel() == 2 * len(PAIRS) and counts.units == len(PAIRS)
    loss, stats = objective.loss(ours_model, batch)
    (loss / counts.units).backward()  # the step's normalisation: the sum over the window's pairs
    assert loss.item() / len(PAIRS) == pytest.approx(theirs_loss.item(), rel=1e-6, abs=1e-6)
    worst = max((p.grad - theirs_grads[n]).abs().max().item() for n, p in ours_model.named_parameters())
    # fp32 to 1e-6 of the gradients' scale (1 at least): center 0.5's gradients reach 6.2, where one fp32 ulp is 4.8e-7
    # and TRL's padded sums and the packed ones differ by a few (measured 2.1e-6 under ATen's default kernels, 7.2e-7
    # under AVX2; issue 59); the others' stay below 0.12, so 1e-6 absolute
    scale = max(1.0, max(g.abs().max().item() for g in theirs_grads.values()))
    assert worst < 1e-6 * scale, (worst, scale)
    assert theirs_loss.item() > 0.1 and max(g.abs().max().item() for g in theirs_grads.values()) > 1e-3
    metrics = objective.step_metrics(stats.tolist(), counts.units)
    logged = trainer._metrics["train"]
    assert metrics["accuracy"] == pytest.approx(logged["accuracy"][-1], abs=1e-6)
    assert metrics["margin"] == pytest.approx(logged["margin"][-1], abs=1e-5)
    assert metrics["mean_reward"] == pytest.approx(logged["mean_reward"][-1], abs=1e-5)


def test_the_score_is_the_last_non_pad_tokens_packed_or_padded(tiny_assets, tiny_tok):
    """Packed (restarting positions) and padded rows give each sequence the score transformers' own forward gives it
    alone; a pad token that is also EOS moves the scored token before a final EOS, as transformers reads it."""
    model = seq_cls(tiny_assets)
    rows = encoded(tiny_tok)
    sequences = [r[f"{side}_ids"] for r in rows for side in ("chosen", "rejected")]
    with torch.no_grad():
        alone = torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in sequences])
        attach_score(model)
        for packing in (True, False):
            objective = RewardModel(RewardModelConfig(), pad_id=tiny_tok.pad_token_id,
                                    score_pad_id=tiny_tok.pad_token_id, packing=packing, margin=False)
            scores = sequence_scores(model, objective.collate(rows)[0])
            assert scores.tolist() == pytest.approx(alone.tolist(), abs=1e-5)
            # no view as the module's output: FSDP2 warned of wrong gradients on every process and step (audit 57)
            assert model(**{k: v for k, v in objective.collate(rows)[0].items() if k in MODEL_INPUTS}
                         )["scores"]._base is None
    eos = tiny_tok.eos_token_id
    assert scored_position([1, 5, 6, eos], tiny_tok.pad_token_id) == 3
    assert scored_position([1, 5, 6, eos, eos], eos) == 2
    assert scored_position([1, 5, 6], None) == 2


def test_an_idle_ranks_stand_in_scores_real_pairs_yet_trains_and_counts_nothing(tiny_assets, tiny_tok):
    """The last global micro-batch may leave a process no pair: it runs the first rank's pairs as a stand-in
    (batching.StandIn) through the normal loss, and the loop's weight 0 leaves every parameter a zero gradient (DDP
    and FSDP reduce all of them on every rank) and the statistics zero."""
    from llmtrain.data.batching import Counts, batch_weight

    model = seq_cls(tiny_assets)
    attach_score(model)
    objective = RewardModel(RewardModelConfig(), pad_id=tiny_tok.pad_token_id, score_pad_id=tiny_tok.pad_token_id,
                            packing=True, margin=True)
    batch, counts = objective.collate(encoded(tiny_tok)[:1])
    assert counts.units == 1 and batch["score_index"].numel() == 2
    stand_in = {**batch, "batch_weight": 0.0}
    loss, stats = objective.loss(model, stand_in)
    assert loss.item() != 0 and stats.abs().sum() > 0  # real pairs, scored as a working rank scores them
    (loss * batch_weight(stand_in)).backward()  # what train_step backpropagates
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert not (stats * batch_weight(stand_in)).any() and Counts.none().units == 0


# --------------------------------------------------------------------------- training runs


def reward_recipe(tiny_assets, folder, **sections):
    """6 steps of 8 pairs of the tiny task (prepare-tiny's train_pairs.jsonl), its 200 held-out pairs, a checkpoint
    every 3 steps."""
    data = {"path": str(tiny_assets / "data" / "train_pairs.jsonl"), "format": "preference", "max_seq_len": 32,
            "eval_split": str(tiny_assets / "data" / "eval_pairs.jsonl"),
            **sections.pop("data", {})}
    return write_recipe(tiny_assets, folder, data=data, reward_model=sections.pop("reward_model", {}),
                        train={"max_steps": 6, "micro_batch_size": 8, "lr": 1e-3, "warmup_steps": 0, "seed": 7,
                               "eval_every_steps": 6, "eval_batch_size": 50, **sections.pop("train", {})},
                        checkpoint={"every_steps": 3, "keep_last": 3, "save_final": True}, **sections)


LORA = ["lora.r=4", "lora.alpha=8", "lora.dropout=0.0", "train.lr=1e-2"]


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory):
    """`straight(lora)` -> (recipe, run): the reward recipe's uninterrupted run on 1 process (full or LoRA), made
    once for the module's comparisons."""
    folder, made = tmp_path_factory.mktemp("reward"), set()
    recipe = reward_recipe(tiny_assets, folder)

    def get(lora: bool):
        run = folder / ("lora" if lora else "full")
        if lora not in made:
            run_train(recipe, f"output_dir={run}", *(LORA if lora else []))
            made.add(lora)
        return recipe, run

    return get


def held_out_scores(final, tiny_assets, *, lora: bool = False, n: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores of the first n held-out pairs by final/ loaded as transformers loads it (full:
    AutoModelForSequenceClassification; LoRA: the base under peft's adapter), one unpadded sequence at a time,
    tokenised here as text + EOS."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if lora:
        from peft import PeftModel

        base = AutoModelForSequenceClassification.from_pretrained(tiny_assets / "model", num_labels=1)
        model = PeftModel.from_pretrained(base, final)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    rows = [json.loads(line) for line in (tiny_assets / "data" / "eval_pairs.jsonl").read_text().splitlines()[:n]]
    out = []
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            ids = [tok(r["prompt"] + r[side])["input_ids"] + [tok.eos_token_id] for r in rows]
            out.append(torch.stack([model.eval()(input_ids=torch.tensor([x])).logits[0, 0] for x in ids]))
    return out[0], out[1]


@pytest.mark.extended  # main tier: a quality check of the demo recipe; exactness: the TRL comparison
@pytest.mark.slow  # two runs of the shipped tiny recipes: about 2 minutes on 2 cores
def test_the_tiny_reward_model_scores_held_out_pairs_right(tiny_assets, tmp_path):
    """recipes/tiny-reward.yaml as shipped (from recipes/tiny.yaml's SFT model): on the 200 held-out pairs of the
    tiny task (prepare-tiny's eval_pairs.jsonl, prompts never trained on), at least 90% are scored the right way
    round at the end (0.93 measured), where the head started at chance."""
    tiny = [f"model.name_or_path={tiny_assets / 'model'}", f"data.path={tiny_assets / 'data' / 'train.jsonl'}",
            f"data.eval_split={tiny_assets / 'data' / 'eval.jsonl'}", f"output_dir={tmp_path / 'sft'}",
            f"data.cache_dir={tiny_assets.parent / 'data-cache'}", "logging.progress=false", "logging.plot=false",
            "checkpoint.every_steps=null", "train.eval_every_steps=null"]
    run_train(REPO / "recipes" / "tiny.yaml", *tiny)
    run_train(REPO / "recipes" / "tiny-reward.yaml", f"model.name_or_path={tmp_path / 'sft' / 'final'}",
              f"data.path={tiny_assets / 'data' / 'train_pairs.jsonl'}",
              f"data.eval_split={tiny_assets / 'data' / 'eval_pairs.jsonl'}", f"output_dir={tmp_path / 'rm'}",
              f"data.cache_dir={tiny_assets.parent / 'data-cache'}", "logging.progress=false", "logging.plot=false")
    evals = records(tmp_path / "rm", "eval")
    assert [e["step"] for e in evals] == [100, 200, 300, 400]
    assert evals[-1]["eval_accuracy"] >= 0.9, evals
    assert evals[-1]["eval_margin"] > 1


@pytest.mark.parametrize("lora", [False, True])
def test_final_loads_with_transformers_and_scores_as_it_trained(straight, tiny_assets, lora):
    """final/ is a LlamaForSequenceClassification with one output (LoRA: a SEQ_CLS adapter whose score head is saved
    whole, and its merged export): loaded by transformers (and peft), it gives the held-out pairs the accuracy and
    margin the run's last eval logged, and the metrics carry TRL's names."""
    _, run = straight(lora)
    config = json.loads((run / "final" / ("adapter_config.json" if lora else "config.json")).read_text())
    if lora:
        assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    else:
        assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    chosen, rejected = held_out_scores(run / "final", tiny_assets, lora=lora)
    (last,) = records(run, "eval")
    # 6 steps leave some margins near 0, where fp32 rounding (one sequence alone, or packed) may flip a comparison
    ties = ((chosen - rejected).abs() < 1e-5).sum().item()
    assert abs((chosen > rejected).double().mean().item() - last["eval_accuracy"]) <= ties / len(chosen)
    assert (chosen - rejected).mean().item() == pytest.approx(last["eval_margin"], abs=1e-5)
    assert (chosen + rejected).mean().item() / 2 == pytest.approx(last["eval_mean_reward"], abs=1e-5)
    if lora:  # `llmtrain export RUN --merge`: a full sequence-classification model that scores as the adapter does
        from llmtrain.run.export import export_merged

        merged = export_merged(run, run.parent / "lora-merged")
        # the command prints no transformers load report of the base under a new score head ("score.weight MISSING
        # ... Consider training on your downstream task"): the adapter holds the trained head
        proc = cli("export", str(run), "--merge", "--out", str(run.parent / "cli-merged"))
        assert "MISSING" not in proc.stderr and "Consider training" not in proc.stderr, proc.stderr
        # the loader it names reads the score head (AutoModelForCausalLM had been implied: a random LM head; audit 39)
        assert "transformers' AutoModelForSequenceClassification.from_pretrained loads" in " ".join(proc.stderr.split())
        assert json.loads((merged / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
        again = held_out_scores(merged, tiny_assets)
        assert max((a - b).abs().max().item() for a, b in zip(again, (chosen, rejected))) < 1e-5
    for line in records(run):
        assert {"loss", "accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected"} <= line.keys()
        assert line["trained_tokens"] == 16  # one scored token per sequence: 8 pairs
    data = json.loads((run / "summary.json").read_text())["data"]  # so too the data's (the answers' tokens, before)
    assert data["train"]["trained_tokens"] == 2 * data["train"]["examples"]


def test_a_base_without_a_pad_token_saves_eos_as_final_s_pad_and_scores_as_it_trained(tiny_assets, tmp_path):
    """A base whose tokenizer has no pad token (Llama 3's, Mistral's): the run scores the token before each final EOS
    (the model's pad is EOS, TRL's rule). final/'s tokenizer had kept no pad token, so a LoRA final/ loaded as the docs
    said scored the EOS itself (audit 26: accuracy 0.55 against the logged 0.485) and could not be padded. Now EOS is
    saved as its pad token, and the docs' loading (pad_token_id from it) scores the held-out pairs, padded, as the last
    eval measured."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = tmp_path / "nopad"
    shutil.copytree(tiny_assets / "model", base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "pad_token_id": None}))
    assert AutoTokenizer.from_pretrained(base).pad_token is None
    run = tmp_path / "run"
    run_train(reward_recipe(tiny_assets, tmp_path), f"model.name_or_path={base}", f"output_dir={run}", *LORA,
              "checkpoint.every_steps=null")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert tok.pad_token == tok.eos_token
    model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1, pad_token_id=tok.pad_token_id), run / "final").eval()
    rows = [json.loads(line) for line in (tiny_assets / "data" / "eval_pairs.jsonl").read_text().splitlines()]
    tok.padding_side = "right"
    scores = []
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            texts = [r["prompt"] + r[side] + tok.eos_token for r in rows]
            enc = tok(texts, padding=True, return_tensors="pt")
            scores.append(model(**enc).logits[:, 0])
    (last,) = records(run, "eval")
    assert (scores[0] - scores[1]).mean().item() == pytest.approx(last["eval_margin"], abs=1e-5)
    assert (scores[0] + scores[1]).mean().item() / 2 == pytest.approx(last["eval_mean_reward"], abs=1e-5)


@pytest.mark.slow
def test_a_qlora_reward_model_scores_for_rl_on_its_4_bit_base_as_its_evals_measured(tiny_assets, tmp_path):
    """A QLoRA reward model (LoRA on an nf4 base, bf16) scores online RL's completions on its base in 4 bits, as its
    run held it (model/score.load_reward_model reads the run's recipe.yaml beside final/): the 200 held-out pairs
    through the loaded model get the accuracy, margin and mean reward the run's last eval logged, to bf16's rounding.
    Read on a 16-bit base, as any adapter's was, the mean reward was 0.255 off and the margin 0.006 (measured on this
    recipe at 100 steps). The estimate counts its base in 4 bits, as the run does."""
    from transformers import AutoTokenizer

    from llmtrain.config import load_recipe
    from llmtrain.memory.params import reward_models_of
    from llmtrain.memory.reward_models import reward_model_notes, weight_bytes
    from llmtrain.model.score import load_reward_model

    recipe = reward_recipe(tiny_assets, tmp_path, model={"dtype": "bfloat16", "quantize": "nf4",
                                                         "attn_implementation": "auto"},
                           lora={"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
                           train={"max_steps": 60, "micro_batch_size": 16, "lr": 5e-4, "eval_every_steps": 60})
    run = tmp_path / "qlora"
    run_train(recipe, f"output_dir={run}")
    (last,) = records(run, "eval")
    model, tok = load_reward_model(str(run / "final"), "cpu")
    import bitsandbytes as bnb

    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 14  # 2 layers x 7 linears
    assert tok.name_or_path == AutoTokenizer.from_pretrained(run / "final").name_or_path
    rows = [json.loads(line) for line in (tiny_assets / "data" / "eval_pairs.jsonl").read_text().splitlines()]
    scores = []
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            ids = [tok(r["prompt"] + r[side])["input_ids"] + [tok.eos_token_id] for r in rows]
            scores.append(torch.stack([model(input_ids=torch.tensor([x])).logits[0, 0].float() for x in ids]))
    chosen, rejected = scores
    assert abs(last["eval_margin"]) > 0.02  # trained past chance
    assert (chosen - rejected).mean().item() == pytest.approx(last["eval_margin"], abs=1e-3)
    assert (chosen + rejected).mean().item() / 2 == pytest.approx(last["eval_mean_reward"], abs=5e-3)
    # a pair within bf16's rounding of a tie (a score near -1.5 is held to 2^-7) may turn either way, packed or alone
    ties = ((chosen - rejected).abs() < 2**-6).sum().item()
    assert abs((chosen > rejected).double().mean().item() - last["eval_accuracy"]) <= ties / len(chosen)
    from llmtrain.objectives.learned_reward import described

    assert described(str(run / "final"), model) == (
        f"{run / 'final'}, a LoRA adapter on {tiny_assets / 'model'}, its base in 4 bits (nf4, bfloat16) as its QLoRA "
        "run held it, 0.55M parameters, whole on every process")  # (transformers counts 4-bit weights unpacked)

    rl = write_recipe(tiny_assets, tmp_path, name="rl.yaml", data={"format": "prompt"},
                      rl={"rewards": [{"type": "reward_model", "path": str(run / "final")}]})
    (counted,) = reward_models_of(load_recipe(rl, []))
    assert (counted.quantize, counted.dtype) == ("nf4", "bfloat16")
    whole = weight_bytes(type(counted)(**{**counted.__dict__, "quantize": None}))
    linears = counted.shape.linear_params_total
    assert whole - weight_bytes(counted) == round(linears * 2 - linears * (0.5 + 1 / 64 + 4 / (64 * 256)))
    assert "4 bits (nf4, as its QLoRA run held them; the rest in bfloat16)" in reward_model_notes(
        type("Spec", (), {"reward_models": (counted,)})())[0]


def test_killed_mid_run_resumes_to_the_same_losses_and_weights(straight, tmp_path, monkeypatch):
    recipe, full = straight(False)
    crash_at_step(monkeypatch, recipe, 5, f"output_dir={tmp_path / 'cut'}")  # dies in step 5: step 3's checkpoint
    run_train(recipe, f"output_dir={tmp_path / 'cut'}", resume="auto")
    assert [r["loss"] for r in records(tmp_path / "cut")] == [r["loss"] for r in records(full)]
    assert [r["accuracy"] for r in records(tmp_path / "cut")] == [r["accuracy"] for r in records(full)]
    assert max_abs_diff(load_weights(tmp_path / "cut" / "final"), load_weights(full / "final")) == 0


@pytest.mark.slow
def test_two_ddp_processes_train_what_one_does(straight, tmp_path, free_port):
    """2 CPU processes (gloo DDP) x 4 pairs against 1 x 8: the same pairs a step, the same losses, accuracies and
    gradient norms; the final weights within what Adam makes of fp32 reduction order."""
    recipe, one = straight(False)
    launch_finetune(REPO / "accelerate_configs" / "cpu_ddp.yaml", 2, free_port, recipe,
                    f"output_dir={tmp_path / 'two'}", "train.micro_batch_size=4")
    ours, theirs = records(tmp_path / "two"), records(one)
    for key in ("loss", "margin", "mean_reward", "accuracy"):
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in theirs], rel=1e-5, abs=1e-5), key
    assert [r["grad_norm"] for r in ours] == pytest.approx([r["grad_norm"] for r in theirs], rel=1e-5)
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in theirs]
    assert records(tmp_path / "two", "eval")[-1]["eval_accuracy"] == records(one, "eval")[-1]["eval_accuracy"]
    # Adam divides each element's step by its own gradient history, so rounding in a near-zero gradient moves a weight
    # by a visible fraction of lr=1e-3 (7e-5 measured, as tests/test_preference.py finds): the losses, accuracies and
    # gradient norms above are the tight checks
    assert max_abs_diff(load_weights(tmp_path / "two" / "final"), load_weights(one / "final")) < 2e-4


# --------------------------------------------------------------------------- refused


def test_recipes_that_cannot_train_a_reward_model_are_refused(tiny_assets, tmp_path):
    from llmtrain.config import load_recipe

    recipe = reward_recipe(tiny_assets, tmp_path)
    assert load_recipe(recipe).reward_model.center_rewards_coefficient is None  # TRL's default
    with pytest.raises(RecipeError, match="one run does one of the two"):
        load_recipe(recipe, ["preference.loss=dpo"])
    with pytest.raises(RecipeError, match="has no LM head to generate eval samples"):
        load_recipe(recipe, ["train.eval_samples=2"])
    with pytest.raises(RecipeError, match="go together"):
        load_recipe(recipe, ["data.format=prompt_completion"])
    # the score head named as a LoRA target: had been "no module of this model is called score", listing peft's
    # wrapper children (default, original_module) as layer names (audit 26)
    lora = ["lora.r=4", "lora.alpha=8", f"output_dir={tmp_path / 'lora'}"]
    with pytest.raises(LLMTrainError, match="names score, which this model trains whole"):
        run_train(recipe, *lora, "lora.target_modules=[q_proj,score]")
    with pytest.raises(LLMTrainError, match="no module of this model is called") as e:
        run_train(recipe, *lora, "lora.target_modules=[q_proj,vproj]")
    assert "original_module" not in str(e.value) and "default," not in str(e.value)


# --------------------------------------------------------------------------- as GRPO's reward


def test_a_grpo_step_with_a_reward_model_gets_the_scores_the_reward_model_gives(straight, tiny_assets, tmp_path):
    """rl.rewards: [{type: reward_model, path: final/}]: each completion's reward (rollouts.jsonl) is the trained
    reward model's score of its prompt + completion + EOS, as transformers scores that sequence alone; the reward
    model is loaded before the policy and scores in batches (batch_size 5 over 16 completions)."""
    from transformers import AutoModelForSequenceClassification

    _, run = straight(False)
    recipe = write_recipe(tiny_assets, tmp_path, data={"format": "prompt", "max_seq_len": 32},
                          rl={"num_generations": 4, "max_completion_tokens": 6, "temperature": 1.0,
                              "rewards": [{"type": "reward_model", "path": str(run / "final"), "batch_size": 5}]},
                          train={"max_steps": 1, "micro_batch_size": 4, "lr": 1e-3})
    run_train(recipe)
    rolled = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rolled) == 16
    scorer = AutoModelForSequenceClassification.from_pretrained(run / "final").eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "final")
    with torch.no_grad():
        expected = [scorer(input_ids=torch.tensor([r["prompt_ids"] + tok(r["completion"], add_special_tokens=False)[
            "input_ids"] + [tok.eos_token_id]])).logits[0, 0].item() for r in rolled]
    assert [r["reward_model"] for r in rolled] == pytest.approx(expected, abs=1e-5)
    assert [r["reward"] for r in rolled] == pytest.approx(expected, abs=1e-5)
    assert len({round(x, 4) for x in expected}) > 4  # the completions differ, and so do their scores
    (line,) = records(tmp_path / "run")
    assert line["rewards/reward_model/mean"] == pytest.approx(sum(expected) / 16, abs=1e-5)
    said = " ".join((tmp_path / "run" / "train.log").read_text().split())
    assert f"reward reward_model: {run / 'final'}, a whole model, 0." in said and "in float32, whole on every" in said


def test_a_tool_calling_completion_is_scored_as_the_whole_conversation_after_its_prompt(straight, tiny_assets):
    """With tools, a completion is [the call turn, the tool's result, the last reply]: the reward model scores the
    prompt and all of it through the data's template (as TRL renders prompt + completion), so two calls that end in
    other replies score apart. Before, it read the first message alone: every tool-calling completion scored as the
    empty reply (audit 4: a right and a wrong answer both -6.3485)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llmtrain.config import RewardConfig
    from llmtrain.objectives.learned_reward import reward_model_function

    _, run = straight(False)
    data = DataConfig(path="x.jsonl", format="prompt", chat_template=str(tiny_assets / "data" / "tools.jinja"),
                      max_seq_len=160)
    score = reward_model_function(RewardConfig(type="reward_model", path=str(run / "final"), batch_size=2), data,
                                  device=None)
    prompt = [{"role": "user", "content": "code of qirb"}]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}

    def called(reply: str) -> list[dict]:
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "lookup", "content": "jxqf"}, {"role": "assistant", "content": reply}]

    completions = [called("it is jxqf"), called("it is zzzz"), [{"role": "assistant", "content": ""}]]
    got = score(prompts=[prompt] * 3, completions=completions)
    tok = AutoTokenizer.from_pretrained(run / "final")
    template = (tiny_assets / "data" / "tools.jinja").read_text()
    scorer = AutoModelForSequenceClassification.from_pretrained(run / "final").eval()
    with torch.no_grad():
        expected = [scorer(input_ids=torch.tensor([tok(tok.apply_chat_template(
            prompt + c, chat_template=template, tokenize=False), add_special_tokens=False)["input_ids"]])).logits[
            0, 0].item() for c in completions]
    assert got == pytest.approx(expected, abs=1e-5)
    assert len({round(x, 4) for x in got}) == 3  # the two replies after the call, and no reply, score apart


@pytest.mark.parametrize("make, says", [
    ("causal", "holds a LlamaForCausalLM with no sequence-classification head"),
    ("two_labels", "has a classification head with 2 outputs; a reward model has one"),
    # a 2-label classifier's LoRA adapter: had died in peft's size check at start-up (audit 26)
    ("two_label_adapter", "holds a LoRA adapter whose classification head has 2 outputs"),
    ("missing", "does not exist"),
    ("file", "is a file; give the folder that holds it"),  # said "does not exist" (issue 53)
    ("run", "is a run's folder; its model is"),  # no hint to use its final/ (issue 53)
])
def test_a_folder_that_is_not_a_reward_model_is_refused_before_the_policy_loads(tiny_assets, tmp_path, monkeypatch,
                                                                                 make, says):
    import llmtrain.loop.train

    folder = tmp_path / "rm"
    if make == "causal":
        folder = tiny_assets / "model"
    elif make == "two_labels":
        from transformers import AutoModelForSequenceClassification

        AutoModelForSequenceClassification.from_pretrained(tiny_assets / "model", num_labels=2).save_pretrained(folder)
    elif make == "two_label_adapter":
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForSequenceClassification

        two = AutoModelForSequenceClassification.from_pretrained(tiny_assets / "model", num_labels=2)
        get_peft_model(two, LoraConfig(r=4, task_type="SEQ_CLS")).save_pretrained(folder)
    elif make == "file":
        folder = tiny_assets / "model" / "config.json"
    elif make == "run":
        (folder / "final").mkdir(parents=True)
        (folder / "summary.json").write_text("{}")

    def no_model(*args, **kwargs):
        raise AssertionError("the policy was built before the reward model was checked")

    monkeypatch.setattr(llmtrain.loop.train, "build_model", no_model)
    recipe = write_recipe(tiny_assets, tmp_path, data={"format": "prompt", "max_seq_len": 32},
                          rl={"num_generations": 2, "max_completion_tokens": 4,
                              "rewards": [{"type": "reward_model", "path": str(folder)}]})
    with pytest.raises(LLMTrainError) as e:
        run_train(recipe)
    text = str(e.value)
    assert says in text and f"'{folder}'" in text and "rl.rewards path:" in text and "\n" not in text
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_reward_model_whose_tokenizer_outgrows_its_embeddings_is_refused_when_it_loads(tiny_assets, tmp_path):
    """A reward model saved with a tokenizer larger than its embeddings (a 32,000-row model under Mistral v0.3's
    32,768 tokens: the GPU session's first try) had scored until a completion held a token past them, then stopped
    with "reward function reward_model raised IndexError: index out of range in self"."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llmtrain.errors import LLMTrainError
    from llmtrain.model.score import load_reward_model

    model = AutoModelForSequenceClassification.from_pretrained(tiny_assets / "model", num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets / "model")
    rows = model.get_input_embeddings().num_embeddings
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(rows - len(tokenizer) + 3)])
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    with pytest.raises(LLMTrainError, match=rf"has a tokenizer of {len(tokenizer):,} tokens and embeddings of "
                                            rf"{rows:,}: a completion holding a token id from {rows:,} on cannot be "
                                            r"scored\. .*resize_token_embeddings"):
        load_reward_model(str(tmp_path / "rm"), "cpu")
    model.resize_token_embeddings(len(tokenizer))  # the fix it names
    model.save_pretrained(tmp_path / "rm")
    loaded, _ = load_reward_model(str(tmp_path / "rm"), "cpu")
    assert loaded.get_input_embeddings().num_embeddings == len(tokenizer)
