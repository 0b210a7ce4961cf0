"""On-policy distillation (the distill: section): the loss and its gradient against TRL 1.16's DistillationTrainer on
the same batch at beta 0, 0.5 and 1 and temperatures other than 1; the chunked loss equal to the unchunked one and
never holding a micro-batch's logits; a short run whose student comes closer to its teacher, killed and resumed to
the same steps, and two DDP processes equal to one; bad teachers and data refused in one paragraph."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, launch_finetune, load_weights, losses, max_abs_diff, records, run_train, write_recipe

from llmtrain.config import DataConfig, DistillConfig, ModelConfig, load_recipe
from llmtrain.data.formats import encode_example
from llmtrain.model.loss import attach_loss
from llmtrain.model.modeling import load_model
from llmtrain.objectives.distill import Distill, divergence, on_policy, split_prompt

CPU_DDP = REPO / "accelerate_configs" / "cpu_ddp.yaml"
CPU_FSDP = REPO / "accelerate_configs" / "cpu_fsdp.yaml"
ROWS = [  # prompts and completions of different lengths: TRL pads both, llmtrain packs them
    {"prompt": "reverse abc =", "completion": " cba"},
    {"prompt": "reverse hello =", "completion": " olleh"},
    {"prompt": "reverse xy =", "completion": " yx"},
    {"prompt": "reverse stop =", "completion": " pots"},
]


pytestmark = pytest.mark.long(70)  # tests/conftest.py


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def wider_model(tiny: Path, out: Path, *, hidden: int, seed: int) -> Path:
    """A random-init model of the tiny layout, `hidden` wide, with the tiny tokenizer: a teacher of another width
    than the student (only the vocabulary must match)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny / "model")
    config.hidden_size, config.intermediate_size, config.head_dim = hidden, 2 * hidden, hidden // 4
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny / "model").save_pretrained(out)
    return out


# --------------------------------------------------------------------------- the divergence, by hand


def test_divergence_is_trls_generalised_jsd_worked_out_by_hand():
    s, t = torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[math.log(3.0), 0.0]])  # p_s (1/4, 3/4), p_t (3/4, 1/4)
    ps, pt = [0.25, 0.75], [0.75, 0.25]
    kl = lambda p, q: sum(a * math.log(a / b) for a, b in zip(p, q))
    assert divergence(s, t, beta=0.0)[0].item() == pytest.approx(kl(pt, ps), abs=1e-7)  # forward KL(teacher||student)
    assert divergence(s, t, beta=1.0)[0].item() == pytest.approx(kl(ps, pt), abs=1e-7)  # reverse KL(student||teacher)
    m = [0.7 * a + 0.3 * b for a, b in zip(ps, pt)]  # beta 0.3: m = (1 - beta) p_s + beta p_t
    assert divergence(s, t, beta=0.3)[0].item() == pytest.approx(0.3 * kl(pt, m) + 0.7 * kl(ps, m), abs=1e-7)
    assert divergence(s, t, beta=0.5)[1].item() == pytest.approx(-sum(p * math.log(p) for p in ps), abs=1e-7)


def test_the_on_policy_coin_is_a_pure_function_of_seed_and_step():
    coins = [on_policy(7, step, 0.5) for step in range(400)]
    assert coins == [on_policy(7, step, 0.5) for step in range(400)]  # a resumed run draws the same
    assert 0.4 < sum(coins) / len(coins) < 0.6
    assert all(on_policy(7, s, 1.0) for s in range(50)) and not any(on_policy(7, s, 0.0) for s in range(50))


# --------------------------------------------------------------------------- against TRL


@pytest.fixture
def fresh_accelerate_state():
    """TRL's Trainer sets up Accelerate's process-wide state its own way (cpu=True); put it back afterwards."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _rows(tok) -> list[dict]:
    cfg = DataConfig(path="x.jsonl", format="prompt_completion")
    return [{**encode_example(r, tok, cfg), "row": i} for i, r in enumerate(ROWS)]


def _objective(model, teacher, tok, *, beta: float, temperature: float, chunk: int) -> Distill:
    attach_loss(model, chunk=chunk)
    return Distill(DistillConfig(teacher="unused", beta=beta, temperature=temperature), teacher=teacher, model=model,
                   pad_id=tok.pad_token_id, packing=True, seed=0, stop_ids=[tok.eos_token_id], world=1)


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.0, 0.7), (0.5, 2.0),
                                               (1.0, 0.7)])
def test_loss_and_gradient_match_trl_distillation_trainer(tiny_assets, tiny_tok, tmp_path, beta, temperature,
                                                          fresh_accelerate_state):
    """TRL's DistillationTrainer._compute_loss (left-padded prompts, right-padded completions, its chunked divergence
    over the teacher's and the student's hidden states) against llmtrain's on the same sequences packed into one
    row, a 3-token chunk: the same loss, the same student gradients and the same entropy, fp32. The teacher is wider
    than the student (192 against 128) and sure of itself."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    teacher_dir = wider_model(tiny_assets, tmp_path / "teacher", hidden=192, seed=1)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # a confident teacher, far from the near-uniform random student: a loss of order 1
        teacher.lm_head.weight.mul_(10.0)
    student = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"), None)
    theirs_student = copy.deepcopy(student)
    args = trl.DistillationConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(ROWS),
                                  report_to="none", beta=beta, temperature=temperature, use_cpu=True, bf16=False,
                                  fp16=False, gradient_checkpointing=False)
    trainer = trl.DistillationTrainer(model=theirs_student, teacher_model=copy.deepcopy(teacher), args=args,
                                      train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in ROWS]),
                                      processing_class=tiny_tok)
    rows = _rows(tiny_tok)
    prompts = [split_prompt(r) for r in rows]
    completions = [r["input_ids"][len(p):] for r, p in zip(rows, prompts)]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    pad = tiny_tok.pad_token_id
    inputs = {"prompt_ids": torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts]),
              "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
              "completion_ids": torch.tensor([c + [pad] * (width_c - len(c)) for c in completions]),
              "completion_mask": torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])}
    tokens = inputs["completion_mask"].sum()
    trainer.model.train()
    theirs, entropy_sum, n_valid = trainer._compute_loss(trainer.model, inputs, tokens)
    theirs.backward()
    their_grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}

    ours = student
    ours.train()
    objective = _objective(ours, teacher, tiny_tok, beta=beta, temperature=temperature, chunk=3)
    batch, counts = objective.collate(rows)
    assert counts.units == tokens.item() == n_valid.item() and len(batch["loss_index"]) > 3  # several chunks
    loss, stats = objective.loss(ours, batch)
    (loss / counts.units).backward()
    our_grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    metrics = objective.step_metrics(stats.tolist(), counts.units)

    assert loss.item() / counts.units == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)
    assert metrics["entropy"] == pytest.approx(entropy_sum.item() / n_valid.item(), rel=1e-6)
    assert their_grads and set(our_grads) == set(their_grads)
    diff = max((our_grads[n] - their_grads[n]).abs().max().item() for n in their_grads)
    scale = max(g.abs().max().item() for g in their_grads.values())
    print(f"beta {beta} T {temperature}: loss ours {loss.item() / counts.units:.9f} theirs {theirs.item():.9f}; "
          f"max |grad diff| {diff:.3e} of max |grad| {scale:.3e}")
    assert diff <= 1e-6 * max(1.0, scale)  # fp32: a millionth of the gradient


# --------------------------------------------------------------------------- chunks


def test_the_chunked_loss_equals_one_chunk_and_never_holds_a_micro_batchs_logits(tiny_assets, tiny_tok, monkeypatch):
    """The same loss and gradient at 5 tokens a chunk as in one chunk of all of them; and at 5 tokens a chunk the
    divergence never sees more than 5 rows of either model's logits (neither head runs over the micro-batch)."""
    import llmtrain.objectives.distill as D

    teacher = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"), None)
    with torch.no_grad():
        for p in teacher.parameters():  # another model than the student
            p.add_(torch.randn_like(p) * 0.5)
    results, rows_seen = [], []
    real = D.divergence

    def watched(student, teacher_logits, *, beta):
        rows_seen.append((student.shape[0], teacher_logits.shape[0]))
        return real(student, teacher_logits, beta=beta)

    monkeypatch.setattr(D, "divergence", watched)
    for chunk in (5, 10_000):
        rows_seen.clear()
        student = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"), None)
        objective = _objective(student, teacher, tiny_tok, beta=0.5, temperature=1.0, chunk=chunk)
        batch, counts = objective.collate(_rows(tiny_tok) * 3)
        loss, _ = objective.loss(student, batch)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in student.named_parameters()}))
        seen = max(max(r) for r in rows_seen)
        assert seen == min(chunk, counts.trained), rows_seen
    assert counts.trained > 5 * 4  # several chunks
    (chunked, g1), (whole, g2) = results
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert max((g1[n] - g2[n]).abs().max().item() for n in g1) < 1e-6


def test_the_chunks_live_bytes_stay_below_a_micro_batchs_logits(tiny_assets, tiny_tok):
    """Live tensor bytes (tests/live_bytes.py) over the loss's forward and backward from the hidden states on: at 8
    tokens a chunk the peak stays below one model's fp32 logits of the micro-batch (beside the head's weight
    gradient, which any path makes), while the unchunked path holds several such tensors more (both models'
    logits, their log-softmax, their gradient)."""
    from live_bytes import LiveBytes

    from llmtrain.model.loss import chunked_token_loss

    teacher = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"), None)
    student = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"), None)
    # a 7B-like vocabulary, larger than the hidden size (the tiny one, 101 ids, is smaller: its hidden states and
    # their gradient would outweigh its logits)
    tokens, vocab, width = 600, 4096, student.config.hidden_size
    torch.manual_seed(0)
    teacher.lm_head = torch.nn.Linear(teacher.config.hidden_size, vocab, bias=False).requires_grad_(False)
    head = torch.nn.Linear(width, vocab, bias=False)
    objective = _objective(student, teacher, tiny_tok, beta=0.5, temperature=1.0, chunk=8)
    hidden = torch.randn(tokens, width, requires_grad=True)
    teacher_hidden = torch.randn(tokens, teacher.config.hidden_size)
    targets = torch.randint(0, vocab, (tokens,))
    peaks, grads = {}, {}
    for chunk in (8, tokens):
        hidden.grad = None
        with LiveBytes() as live:
            loss, _ = chunked_token_loss(hidden, lambda h: torch.nn.functional.linear(h, head.weight), targets,
                                         objective._token_loss(teacher_hidden), chunk=chunk)
            loss.backward()
        peaks[chunk], grads[chunk] = live.peak, hidden.grad.clone()
    logits = tokens * vocab * 4  # one model's fp32 logits of the micro-batch
    print(f"peak live bytes: chunked {peaks[8]:,}, unchunked {peaks[tokens]:,}; one logits tensor {logits:,}")
    weight = head.weight.numel() * 4  # its gradient, and the running sum over the chunks, exist on either path
    assert peaks[8] < logits + 2 * weight
    assert peaks[tokens] - peaks[8] > 4 * logits
    assert (grads[8] - grads[tokens]).abs().max().item() < 1e-6


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def teacher(tiny_assets, tmp_path_factory) -> Path:
    """A teacher wider than the student (192 against 128) and trained on the task (150 steps of SFT, in this
    process): the student is the tiny model as prepare-tiny writes it (random init)."""
    tmp = tmp_path_factory.mktemp("teacher")
    wider = wider_model(tiny_assets, tmp / "init", hidden=192, seed=3)
    recipe = write_recipe(tiny_assets, tmp, model={"name_or_path": str(wider)},
                          train={"max_steps": 150, "micro_batch_size": 16, "lr": 2e-3, "warmup_steps": 10},
                          output_dir=str(tmp / "sft"))
    run_train(recipe)
    return tmp / "sft" / "final"


def distill_recipe(tiny: Path, tmp: Path, teacher: Path, **sections) -> Path:
    return write_recipe(tiny, tmp, data={"eval_split": str(tiny / "data" / "eval.jsonl"), "eval_max_examples": 32,
                                         **sections.pop("data", {})},
                        distill={"teacher": str(teacher), "lmbda": 0.5, "max_completion_tokens": 8,
                                 **sections.pop("distill", {})},
                        train={"max_steps": 12, "micro_batch_size": 8, "lr": 3e-3, "eval_every_steps": 12,
                               **sections.pop("train", {})},
                        checkpoint={"every_steps": 4, "keep_last": 3}, logging={"progress": False, "plot": False,
                                                                              "every_steps": 1}, **sections)


@pytest.fixture(scope="module")
def straight(tiny_assets, teacher, tmp_path_factory):
    """12 steps of 8 prompts, in this process: (recipe, run folder)."""
    tmp = tmp_path_factory.mktemp("distill")
    recipe = distill_recipe(tiny_assets, tmp, teacher)
    run_train(recipe, f"output_dir={tmp / 'straight'}")
    return recipe, tmp / "straight"


def test_a_short_run_brings_the_student_closer_to_its_teacher(straight):
    """The loss falls, and on the held-out rows (the data's completions, teacher-forced) the divergence falls and
    the student's argmax agrees with the teacher's more often; steps are on- and off-policy as the coin says, and
    the metrics carry TRL's names."""
    _, run = straight
    lines = records(run)
    assert [r["on_policy"] for r in lines] == [float(on_policy(7, s, 0.5)) for s in range(12)]
    assert 0 < sum(r["on_policy"] for r in lines) < 12  # both kinds of step
    sampled = [r for r in lines if r["on_policy"]]
    assert all(0 < r["completions/mean_length"] <= 8 and 0 <= r["completions/clipped_ratio"] <= 1 for r in sampled)
    assert all("completions/mean_length" not in r for r in lines if not r["on_policy"])
    assert all(r["entropy"] > 0 for r in lines)
    assert "distill.sampler=graph: static off CUDA)" in (run / "train.log").read_text()  # the header says which
    first, last = records(run, "eval")
    assert (first["step"], last["step"]) == (0, 12)
    print(f"eval divergence {first['eval_loss']:.3f} -> {last['eval_loss']:.3f}, teacher agreement "
          f"{first['eval_teacher_agreement']:.3f} -> {last['eval_teacher_agreement']:.3f}; train loss "
          f"{lines[0]['loss']:.3f} -> {lines[-1]['loss']:.3f}")
    assert last["eval_loss"] < 0.7 * first["eval_loss"]
    assert last["eval_teacher_agreement"] > first["eval_teacher_agreement"] + 0.1
    assert sum(r["loss"] for r in lines[-3:]) < 0.8 * sum(r["loss"] for r in lines[:3])


def test_distill_top_k_reaches_the_students_sampler(straight, tmp_path, monkeypatch):
    """distill.top_k 1 at temperature 1: every completion the student samples is its greedy one (the sampler called
    again at temperature 0 on the same prompts draws the same tokens); distill.repetition_penalty reaches it too."""
    import llmtrain.objectives.distill as distill

    recipe, _ = straight
    drawn = []

    def sample(lm, sampler, prompts, seeds, **kwargs):
        got = original(lm, sampler, prompts, seeds, **kwargs)
        drawn.append((kwargs["top_k"], got, original(lm, sampler, prompts, seeds, **{**kwargs, "temperature": 0.0}),
                      kwargs["repetition_penalty"]))
        return got

    original = distill.sample
    monkeypatch.setattr(distill, "sample", sample)
    run_train(recipe, f"output_dir={tmp_path / 'top_k'}", "train.max_steps=2", "distill.lmbda=1.0", "distill.top_k=1",
              "distill.repetition_penalty=1.2")
    assert len(drawn) == 2 and all(k == 1 and got == greedy and penalty == 1.2 for k, got, greedy, penalty in drawn)


def test_the_teachers_forward_is_counted_in_tflops_and_mfu(straight):
    """tflops_per_gpu / tokens_per_s is the step's model FLOPs a token: the student's step (6 a weight) and the
    teacher's forward (2 a weight of its, 192 wide): above what the student alone could reach at any length."""
    from llmtrain.config import load_recipe
    from llmtrain.run.metrics import flop_model

    recipe, run = straight
    r = load_recipe(recipe)
    student = flop_model(load_model(r.model, None))
    teacher = flop_model(load_model(ModelConfig(name_or_path=r.distill.teacher), None), forward_only=True)
    for line in records(run):
        per_token = line["tflops_per_gpu"] * 1e12 / line["tokens_per_s_per_gpu"]
        alone = (student.body_per_token + student.head_per_token * line["trained_tokens"] / line["tokens"]
                 + student.attn_per_square * r.data.max_seq_len)  # every row at its longest: more than alone
        with_teacher = student.plus(teacher)
        assert alone < student.body_per_token + teacher.body_per_token <= per_token
        assert per_token <= (with_teacher.body_per_token + with_teacher.head_per_token * line["trained_tokens"]
                             / line["tokens"] + with_teacher.attn_per_square * r.data.max_seq_len) * 1.000001


KILL_MID_STEP_7 = """
import os, signal, sys
import llmtrain.loop.step as step
real = step.train_step
def dying(*args, **kwargs):  # mid step 7, after the step-4 checkpoint: killed as kill -9 kills (no clean-up at all)
    if kwargs["step"] == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
import llmtrain.loop.train as train
train.train_step = dying
sys.argv = ["llmtrain", *sys.argv[1:]]
from llmtrain.cli import main
main()
"""


@pytest.mark.slow
@pytest.mark.extended  # main tier: GRPO's kill -9 resume (the same sampler seeds); the coin: test_distill's unit tests
def test_killed_mid_run_resumes_to_the_same_coins_samples_losses_and_weights(straight, tmp_path):
    """kill -9 in step 7; the resume from the step-4 checkpoint draws the same coins and samples the same
    completions (their lengths logged each step), and ends with the same losses and the same weights."""
    import subprocess
    import sys

    from helpers import ENV, cli

    recipe, full = straight
    cut = tmp_path / "cut"
    killed = subprocess.run([sys.executable, "-c", KILL_MID_STEP_7, "finetune", str(recipe), f"output_dir={cut}"],
                            env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [r["step"] for r in records(cut)] == list(range(1, 7))
    assert any(on_policy(7, s, 0.5) for s in range(4, 12))  # the resumed part samples
    proc = cli("finetune", str(cut / "recipe.yaml"), "--resume", "auto")
    assert "at step 4" in proc.stdout
    keys = ("on_policy", "completions/mean_length", "completions/clipped_ratio", "token_accuracy", "teacher_agreement")
    assert [[r.get(k) for k in keys] for r in records(cut)] == [[r.get(k) for k in keys] for r in records(full)]
    assert losses(cut) == pytest.approx(losses(full), abs=1e-6)
    assert max_abs_diff(load_weights(cut / "final"), load_weights(full / "final")) == 0.0


@pytest.mark.slow
@pytest.mark.extended  # main tier: two FSDP processes sample and train what one does
def test_two_ddp_processes_sample_and_train_what_one_does(straight, tmp_path, free_port):
    """Each rank samples its own 4 prompts' completions from their rows' seeds: the same steps as one process with
    8 prompts, the same losses and eval, and the same weights."""
    recipe, one = straight
    two = tmp_path / "two"
    launch_finetune(CPU_DDP, 2, free_port, recipe, f"output_dir={two}", "train.micro_batch_size=4")
    keys = ("on_policy", "completions/mean_length", "completions/clipped_ratio")
    assert [[r.get(k) for k in keys] for r in records(two)] == [[r.get(k) for k in keys] for r in records(one)]
    assert losses(two) == pytest.approx(losses(one), abs=1e-6)
    assert [e["eval_loss"] for e in records(two, "eval")] == pytest.approx(
        [e["eval_loss"] for e in records(one, "eval")], abs=1e-6)
    # Adam over 12 steps at lr 3e-3 turns rounding-size gradient entries (summed in another order over 2 processes)
    # into weight differences of a fraction of a step: 1.2e-5 under ATen's AVX-512 kernels (measured), below 1e-5
    # under AVX2's
    assert max_abs_diff(load_weights(two / "final"), load_weights(one / "final")) < 5e-5


@pytest.mark.slow
def test_two_processes_of_one_sequence_sample_once_and_train_what_one_process_does(tiny_assets, teacher, tmp_path,
                                                                                 free_port):
    """Sequence parallelism 2: each process of the group samples half of each on-policy micro-batch's completions and
    gets the other half; both (and the teacher, attending through the group's all-to-all) run their slice of each
    packed row, on- and off-policy steps alike, and of the eval's teacher-forced rows: the coins, completions,
    losses, eval and weights of one process."""
    recipe = distill_recipe(tiny_assets, tmp_path, teacher, model={"attn_implementation": "auto"},
                            train={"max_steps": 4, "eval_every_steps": 4})
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(recipe, f"output_dir={one}")
    out = launch_finetune(CPU_DDP, 2, free_port, recipe, "parallel.sequence_parallel=2", f"output_dir={two}")
    assert "each sequence split over 2 processes" in out
    keys = ("on_policy", "completions/mean_length", "completions/clipped_ratio", "tokens", "trained_tokens")
    assert [[r.get(k) for k in keys] for r in records(two)] == [[r.get(k) for k in keys] for r in records(one)]
    assert {r["on_policy"] for r in records(one)} == {0.0, 1.0}  # both kinds of step
    for key in ("loss", "grad_norm", "entropy", "teacher_agreement"):
        assert [r[key] for r in records(two)] == pytest.approx([r[key] for r in records(one)], rel=1e-5, abs=1e-6)
    for key in ("eval_loss", "eval_teacher_agreement", "eval_token_accuracy"):
        assert [e[key] for e in records(two, "eval")] == pytest.approx([e[key] for e in records(one, "eval")],
                                                                         abs=1e-6), key
    assert max_abs_diff(load_weights(two / "final"), load_weights(one / "final")) < 1e-5


@pytest.mark.slow
@pytest.mark.extended  # the main tier: the idle FSDP rank's test below, and test_grpo_run's gather of the layers
def test_two_fsdp_processes_gather_the_layers_to_sample_and_train_what_one_does(straight, tmp_path, free_port):
    """FSDP shards the student and the teacher alike (the teacher's LM head whole on each process); the rollout
    gathers the student's layers to sample: the same steps, losses and eval as one process."""
    from transformers import AutoModelForCausalLM

    recipe, one = straight
    fsdp = tmp_path / "fsdp"
    shown = launch_finetune(CPU_FSDP, 2, free_port, recipe, f"output_dir={fsdp}", "train.micro_batch_size=4")
    teacher = AutoModelForCausalLM.from_pretrained(load_recipe(recipe).distill.teacher)
    # FSDP2 splits each decoder tensor's first dimension in 2, the main process keeping the first ceil(n / 2) rows
    held = sum(math.ceil(p.shape[0] / 2) * p[0].numel() for p in teacher.get_decoder().parameters())
    head = teacher.get_output_embeddings().weight.numel()  # a tied head is a copy of the embeddings then
    total = sum(p.numel() for p in teacher.get_decoder().parameters()) + head
    assert f"teacher: sharded like the student, {held + head:,} of its {total:,} parameters" in " ".join(shown.split())
    assert held + head < 0.75 * total
    keys = ("on_policy", "completions/mean_length")
    assert [[r.get(k) for k in keys] for r in records(fsdp)] == [[r.get(k) for k in keys] for r in records(one)]
    assert losses(fsdp) == pytest.approx(losses(one), abs=1e-5)
    assert [e["eval_loss"] for e in records(fsdp, "eval")] == pytest.approx(
        [e["eval_loss"] for e in records(one, "eval")], abs=1e-5)


@pytest.mark.slow
def test_an_idle_fsdp_rank_still_runs_the_sharded_teachers_forward(tiny_assets, teacher, tmp_path, free_port):
    """9 eval rows on 2 processes of 4: one rank's last eval micro-batch is an idle stand-in (weight 0), whose forward
    still gathers the teacher's shards with the other rank's (else both wait for ever): the eval of one process."""
    recipe = distill_recipe(tiny_assets, tmp_path, teacher, train={"max_steps": 2, "eval_every_steps": 2},
                            data={"eval_max_examples": 9})
    run_train(recipe, f"output_dir={tmp_path / 'one'}")
    launch_finetune(CPU_FSDP, 2, free_port, recipe, f"output_dir={tmp_path / 'two'}", "train.micro_batch_size=4")
    assert [e["eval_loss"] for e in records(tmp_path / "two", "eval")] == pytest.approx(
        [e["eval_loss"] for e in records(tmp_path / "one", "eval")], abs=1e-5)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)


# --------------------------------------------------------------------------- bad input: one paragraph, nothing written


def _refused(recipe: Path, *overrides: str) -> str:
    """`llmtrain finetune RECIPE OVERRIDES` exits non-zero with one paragraph and no traceback, writing nothing."""
    from helpers import invoke

    out = Path(yaml_output_dir(recipe))
    proc = invoke("finetune", str(recipe), *overrides, check=False)
    said = proc.stdout + (proc.stderr or "")
    assert proc.returncode != 0 and "Traceback" not in said, said
    error = said[said.rindex("error"):] if "error" in said else said  # the paragraph, after the start-up lines
    assert "\n\n" not in error.strip(), error
    text = " ".join(error.split())
    assert not out.exists(), sorted(out.rglob("*"))
    return text


def yaml_output_dir(recipe: Path) -> str:
    import yaml

    return yaml.safe_load(recipe.read_text())["output_dir"]


def test_a_teacher_of_another_vocabulary_is_refused_in_one_paragraph(tiny_assets, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_assets / "model")
    config.vocab_size = 120
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "big-vocab")
    recipe = distill_recipe(tiny_assets, tmp_path, tmp_path / "big-vocab")
    text = _refused(recipe)
    assert f"distill.teacher '{tmp_path / 'big-vocab'}' has a vocabulary of 120 ids" in text
    assert "one of 104" in text and "must share the vocabulary" in text


def test_a_tokenizer_longer_than_the_students_rows_asks_the_teacher_for_the_students_rows(tiny_assets, tmp_path):
    """A tokenizer with more ids than the model's config has rows (Mistral v0.3's 32,768 on a 32,000-row config) and
    no model.new_tokens: load_model leaves the student's rows as they are, so the teacher must match those rows, not
    the tokenizer's length (the check once took the larger: it refused the matching teacher, and the run with a
    teacher of the tokenizer's length died on the divergence's shapes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model.modeling import load_tokenizer
    from llmtrain.model.teacher import vocabulary_problem

    recipe = load_recipe(distill_recipe(tiny_assets, tmp_path, tiny_assets / "model"))
    tokenizer = load_tokenizer(recipe.model)
    rows = AutoConfig.from_pretrained(tiny_assets / "model").vocab_size
    tokenizer.add_tokens(["<extra_a>", "<extra_b>"])
    assert len(tokenizer) == rows + 2 and not recipe.model.new_tokens
    assert load_model(recipe.model, None).get_output_embeddings().weight.shape[0] == rows
    assert vocabulary_problem(recipe, tokenizer) is None  # the teacher of the student's own rows
    config = AutoConfig.from_pretrained(tiny_assets / "model")
    config.vocab_size = len(tokenizer)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "long")
    long = recipe.model_copy(update={"distill": recipe.distill.model_copy(update={"teacher": str(tmp_path / "long")})})
    problem = vocabulary_problem(long, tokenizer)
    assert f"has a vocabulary of {rows + 2:,} ids and the student" in problem and f"one of {rows:,}" in problem


def test_a_teacher_whose_tokenizer_gives_the_ids_other_tokens_is_refused(tiny_assets, tmp_path):
    import shutil

    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_assets / "model", swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two tokens at each other's ids
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    text = _refused(distill_recipe(tiny_assets, tmp_path, swapped))
    assert "has 104 ids like the student, but its tokenizer gives 2 of them other tokens" in text
    assert "token for token" in text


def test_a_missing_teacher_is_refused_naming_the_key(tiny_assets, tmp_path):
    text = _refused(distill_recipe(tiny_assets, tmp_path, tmp_path / "nowhere"))
    assert f"distill.teacher '{tmp_path / 'nowhere'}' does not exist. Give a local model folder" in text
    (tmp_path / "empty").mkdir()  # there, but not a model folder: transformers' words
    text = _refused(distill_recipe(tiny_assets, tmp_path, tmp_path / "empty"), f"output_dir={tmp_path / 'run2'}")
    assert f"distill.teacher '{tmp_path / 'empty'}' could not be read" in text
    config_only = tmp_path / "config-only"  # a config and a tokenizer (the vocabulary check passes), no weights
    shutil.copytree(tiny_assets / "model", config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    text = _refused(distill_recipe(tiny_assets, tmp_path, config_only), f"output_dir={tmp_path / 'run3'}")
    assert (f"the model folder '{config_only}' (distill.teacher) has a config.json but no weights" in text
            and "set distill.teacher to a folder or hub id that has them" in text), text  # (it named model.*)
    assert "model.random_init" not in text  # (a teacher is never random)
    text = _refused(write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(config_only)}),
                    f"output_dir={tmp_path / 'run4'}")  # the student's: its own key, and the random start
    assert "(model.name_or_path / model.tokenizer) has a config.json but no weights" in text
    assert "or model.random_init: true, to train from random weights" in text


@pytest.mark.parametrize("overrides, says", [
    (["data.format=text"], "distill: needs rows with a prompt and a completion"),
    (["data.format=prompt"], "data.format=prompt has none"),
    (["data.train_on_prompt=true"], "unset data.train_on_prompt"),
    (["train.micro_batch_size=1", "train.micro_batch_tokens=64"], "unset train.micro_batch_tokens"),
    (["distill.beta=1.5"], "distill.beta"),
    (["distill.lmbda=-0.1"], "distill.lmbda"),
])
def test_recipes_that_cannot_distill_are_refused_by_the_schema(tiny_assets, tmp_path, overrides, says):
    text = _refused(distill_recipe(tiny_assets, tmp_path, tiny_assets / "model"), *overrides)
    assert says in text


def test_prompts_without_room_for_the_students_completion_are_refused_unless_no_step_samples(tiny_assets, tmp_path):
    """The student samples up to distill.max_completion_tokens after each row's prompt: a prompt that leaves less
    room within data.max_seq_len is refused as online RL's (the sequences had grown past max_seq_len without a word,
    and on pipeline stages, whose rows hold max_seq_len, step 1 died after the run folder was written); with
    distill.lmbda 0 nothing is sampled and the recipe trains."""
    recipe = distill_recipe(tiny_assets, tmp_path, tiny_assets / "model")
    text = _refused(recipe, "data.max_seq_len=20", "distill.max_completion_tokens=12")
    assert "prompt room:" in text and "leave no room for distill.max_completion_tokens=12 within data.max_seq_len=20" \
        in text and "lower distill.max_completion_tokens" in text, text
    summary = run_train(recipe, "data.max_seq_len=20", "distill.max_completion_tokens=12", "distill.lmbda=0",
                        "train.max_steps=1", "train.eval_every_steps=null", f"output_dir={tmp_path / 'off'}")
    assert summary["steps"] == 1
    # and what would sample is said to be read by nothing (it had been taken without a word)
    said = " ".join((tmp_path / "off" / "train.log").read_text().split())
    assert ("warning (sampling): distill.lmbda=0 trains every step on the data's completions, so the student samples "
            "nothing: distill.max_completion_tokens is read by nothing.") in said, said
    from llmtrain.config import load_recipe
    from llmtrain.data.checks import check_unsampled_keys

    assert check_unsampled_keys(load_recipe(recipe)) == []  # lmbda 0.5 samples


def test_rows_without_completions_are_refused_naming_the_file(tiny_assets, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in ROWS])
    text = _refused(distill_recipe(tiny_assets, tmp_path, tiny_assets / "model"), f"data.path={prompts}",
                    "data.eval_split=null", "data.eval_max_examples=null", "train.eval_every_steps=null")
    assert str(prompts) in text and "needs completion (column 'completion')" in text


# --------------------------------------------------------------------------- estimate-memory, doctor, inspect-data


def test_the_estimate_counts_the_teachers_weights_hidden_states_and_chunk_logits(tiny_assets, tmp_path):
    """Worked out by hand: the teacher (192 wide) on every phase in fp32 (in bf16 under mixed precision, where it
    is stored so); in the loss's phases also its hidden states of the trained positions (8 prompts x 8 completion
    tokens x 192 x 4 bytes) and a chunk's 4 fp32 tensors of 16 tokens x 104 ids; its own forward is a phase."""
    from llmtrain.config import load_recipe
    from llmtrain.memory import estimate_for_recipe

    teacher = wider_model(tiny_assets, tmp_path / "teacher", hidden=192, seed=0)
    params = sum(p.numel() for p in load_model(ModelConfig(name_or_path=str(teacher)), None).parameters())
    recipe = load_recipe(distill_recipe(tiny_assets, tmp_path, teacher), ["train.loss_chunk_tokens=16"])
    est = estimate_for_recipe(recipe)
    parts = est.phase_parts
    assert parts["optimizer_step"]["teacher"] == params * 4
    assert parts["loss"]["teacher"] == params * 4 + 8 * 8 * 192 * 4 + 4 * 16 * 104 * 4
    assert parts["teacher_forward"]["teacher"] > params * 4 + 8 * 8 * 192 * 4
    assert {"generation", "generation_prefill"} <= parts.keys()  # the student samples (lmbda > 0)
    assert any("the teacher" in note and "whole on every GPU" in note for note in est.notes)
    # FSDP over 2 GPUs: the decoder in halves, the LM head (104 x 192) whole; its forward gathers the embeddings,
    # final norm and two layers besides
    from transformers import AutoConfig

    head = 104 * 192
    decoder = params - (0 if AutoConfig.from_pretrained(teacher).tie_word_embeddings else head)
    fsdp = estimate_for_recipe(recipe, num_processes=2, strategy="fsdp")
    assert fsdp.phase_parts["optimizer_step"]["teacher"] == (-(-decoder // 2) + head) * 4
    assert any("the teacher" in note and "sharded by FSDP over 2 GPUs" in note for note in fsdp.notes)
    assert fsdp.host_ram_bytes == params * 4  # the main process reads the teacher (larger than the student) alone
    assert estimate_for_recipe(recipe, num_processes=2, strategy="ddp").host_ram_bytes == 2 * params * 4
    first = load_model(ModelConfig(name_or_path=str(teacher)), None).model.layers[0]
    layer = sum(p.numel() for p in first.parameters())
    gathered = (head + 192 + 2 * layer) * 4  # embeddings (104 x 192), the final norm, two layers
    assert (fsdp.phase_parts["teacher_forward"]["teacher"] - fsdp.phase_parts["optimizer_step"]["teacher"]
            == parts["teacher_forward"]["teacher"] - parts["optimizer_step"]["teacher"] + gathered)
    bf16 = estimate_for_recipe(load_recipe(distill_recipe(tiny_assets, tmp_path, teacher),
                                           ["train.mixed_precision=bf16"]))
    assert bf16.phase_parts["optimizer_step"]["teacher"] == params * 2
    offline = estimate_for_recipe(load_recipe(distill_recipe(tiny_assets, tmp_path, teacher), ["distill.lmbda=0"]))
    assert "generation" not in offline.phase_parts


def test_doctor_checks_the_teachers_vocabulary(tiny_assets, tmp_path, teacher):
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.config import load_recipe
    from llmtrain.doctor import run_doctor

    recipe = distill_recipe(tiny_assets, tmp_path, teacher)
    checks = {name: (status, detail) for name, status, detail in run_doctor(load_recipe(recipe), gpu_memory=80)}
    assert checks["teacher"][0] == "pass" and "shares the student's vocabulary" in checks["teacher"][1]
    assert "fail" not in {status for status, _ in checks.values()}
    config = AutoConfig.from_pretrained(tiny_assets / "model")
    config.vocab_size = 120
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "big-vocab")
    checks = {name: (status, detail) for name, status, detail in
              run_doctor(load_recipe(recipe, [f"distill.teacher={tmp_path / 'big-vocab'}"]), gpu_memory=80)}
    assert checks["teacher"][0] == "fail" and "a vocabulary of 120 ids" in checks["teacher"][1]
    import shutil  # a teacher folder with no weights: finetune refuses it, doctor had passed it (audit 34)

    shutil.copytree(tiny_assets / "model", tmp_path / "no-weights")
    (tmp_path / "no-weights" / "model.safetensors").unlink()
    checks = {name: (status, detail) for name, status, detail in
              run_doctor(load_recipe(recipe, [f"distill.teacher={tmp_path / 'no-weights'}"]), gpu_memory=80)}
    assert checks["teacher"][0] == "fail" and "(distill.teacher) has a config.json but no weights" in \
        checks["teacher"][1]


def test_inspect_data_shows_what_the_student_completes(tiny_assets, tmp_path):
    from helpers import invoke

    recipe = distill_recipe(tiny_assets, tmp_path, tiny_assets / "model")
    shown = " ".join(invoke("inspect-data", str(recipe), "--n", "1").stdout.split())
    assert "distill: the student samples a completion of the first" in shown


def test_the_teacher_and_a_reward_model_are_read_by_every_process_of_an_fsdp_launch(tiny_assets, tmp_path, teacher,
                                                                                    monkeypatch):
    """An FSDP launch with cpu_ram_efficient_loading sets FSDP_CPU_RAM_EFFICIENT_LOADING, and from_pretrained
    then reads weights on the main process only (5.17 leaves zeros on the others: a 2-process FSDP distillation
    logged 2.08 where one process logs 4.47). Neither frozen model is ever prepared by FSDP, so each process must read
    it: both load with the variable off, and it is put back after."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

    from llmtrain.config import load_recipe
    from llmtrain.model.score import load_reward_model
    from llmtrain.model.teacher import load_teacher

    seen = []
    for auto in (AutoModelForCausalLM, AutoModelForSequenceClassification):
        original = auto.from_pretrained.__func__

        def spy(cls, *args, _original=original, **kwargs):
            seen.append((cls.__name__, os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")))
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(spy))
    reward = tmp_path / "reward"
    config = LlamaConfig.from_pretrained(tiny_assets / "model", num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(reward)
    AutoTokenizer.from_pretrained(tiny_assets / "model").save_pretrained(reward)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    recipe = load_recipe(distill_recipe(tiny_assets, tmp_path, teacher))
    model = load_teacher(recipe, AutoTokenizer.from_pretrained(tiny_assets / "model"), device=torch.device("cpu"))
    load_reward_model(str(reward), torch.device("cpu"))
    assert seen == [("AutoModelForCausalLM", "false"), ("AutoModelForSequenceClassification", "false")]
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"  # the launch's setting, back for what follows
    assert any(p.abs().sum() > 0 for p in model.parameters())
