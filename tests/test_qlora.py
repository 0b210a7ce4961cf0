"""QLoRA (model.quantize): a 4-bit bitsandbytes base under LoRA adapters, trained on CPU (bitsandbytes 0.50 runs its
4-bit layers on x86 CPUs). The quantised layers stay Linear4bit through `accelerator.prepare` (one process, 2 DDP
processes, and FSDP2 where bitsandbytes' CPU path allows it); only the adapter trains and is saved; resume is
exact; the adapter loads on a quantised and on a bf16 base; the estimator's 4-bit weights against a number worked
out by hand; --fit proposes QLoRA when LoRA on a 16-bit base does not fit."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from conftest import MISTRAL, needs
from helpers import ENV, REPO, crash_at_step, load_weights, losses, records, run_train, write_recipe

from llmtrain.config import load_recipe
from llmtrain.errors import RecipeError

QLORA = {"model": {"dtype": "bfloat16", "quantize": "nf4", "attn_implementation": "auto"},
         "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
         "train": {"max_steps": 8, "micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 0, "mixed_precision": "bf16",
                   "seed": 3}}


pytestmark = pytest.mark.long(120)  # tests/conftest.py


@pytest.fixture
def qlora_recipe(tiny_assets, tmp_path):
    return write_recipe(tiny_assets, tmp_path, **QLORA)


def test_a_full_fine_tune_of_a_quantised_base_is_refused(qlora_recipe):
    with pytest.raises(RecipeError, match="a full fine-tune of a quantised base is not possible") as e:
        load_recipe(qlora_recipe, ["lora=null"])
    assert "\n  - model.quantize=nf4 trains LoRA adapters" in str(e.value)  # no empty key before it ("  - : ...")


@needs(MISTRAL)
def test_estimator_4bit_weights_of_mistral_7b_equal_the_hand_count():
    """Mistral-7B's decoder linears per layer: q and o 4096x4096, k and v 4096x1024, gate, up and down 4096x14336:
    218,103,808 weights, x 32 layers = 6,979,321,856 in 4 bits with an 8-bit absmax per 64 and an fp32 absmax per
    64 x 256 (0.515640... bytes each); the other 268,701,696 (embeddings, LM head, norms) in bf16; one 4096x14336
    linear dequantised to bf16 while it runs."""
    from llmtrain.memory.estimate import quantized_base_bytes
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec

    shape = load_model_shape(str(MISTRAL))
    quantized = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert quantized == 6_979_321_856 and shape.params_total - quantized == 268_701_696
    by_hand = round(quantized * (0.5 + 1 / 64 + 4 / 16384)) + 268_701_696 * 2 + 4096 * 14336 * 2
    spec = TrainSpec(method="lora", quantize="nf4", dtype="bfloat16", mixed_precision="bf16")
    assert quantized_base_bytes(shape, spec) == by_hand == 4_255_260_672  # 3.96 GiB against 13.5 in bf16


@needs(MISTRAL)
def test_fit_proposes_qlora_when_lora_on_a_16bit_base_does_not_fit():
    from llmtrain.memory import fit as fitting
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec

    shape = load_model_shape(str(MISTRAL))
    spec = TrainSpec(method="lora", dtype="bfloat16", mixed_precision="bf16", seq_len=2048, gpu_memory_gib=16)
    assert not estimate(shape, spec).fits  # the bf16 base alone is 13.5 GiB
    result = fitting.fit(shape, spec)
    assert result.best is not None and result.best.spec.quantize == "nf4"
    from llmtrain.memory.render import describe

    assert describe(result.best.spec).startswith("QLoRA r=16, single on 1 GPU") and \
        "nf4 4-bit base (its other weights bfloat16)" in describe(result.best.spec)
    assert "model.quantize=nf4" in result.overrides
    assert result.best.estimate.per_gpu_peak_bytes < 0.9 * 16 * 2**30


# --------------------------------------------------------------------------- with bitsandbytes

TRAIN_PROBE = '''
import sys
import bitsandbytes as bnb
import llmtrain.loop.phases as P
import llmtrain.loop.train as T

real_load, real_build, before = P.load_model, P.build_model, []


def load_model(*a, **k):
    m = real_load(*a, **k)
    before.append(sum(isinstance(x, bnb.nn.Linear4bit) for x in m.modules()))
    return m


def build_model(recipe, accelerator, **kwargs):  # the report, from inside the run, once the model is prepared
    t = real_build(recipe, accelerator, **kwargs)
    after = [x for x in t.model.modules() if isinstance(x, bnb.nn.Linear4bit)]
    # Still 4-bit: each stored bf16 value packs 4 weights; under FSDP2 the weight is a DTensor shard whose Params4bit
    # quant_state lives on the module (bitsandbytes puts it back on the gathered weight in forward).
    packed = sum(x.weight.shape.numel() for x in after)
    logical = sum((getattr(x.weight, "quant_state", None) or x.quant_state).shape.numel() for x in after)
    local = sum((x.weight.to_local() if hasattr(x.weight, "to_local") else x.weight).numel() for x in after)
    print(f"rank {accelerator.process_index}: Linear4bit before {before[0]} after {len(after)}, "
          f"{logical // packed} weights per stored {str(after[0].weight.dtype)}, local share {local / packed:.2f}; "
          f"trainable {sorted({n.split('.')[-3] for n, p in t.model.named_parameters() if p.requires_grad})}",
          flush=True)
    return t


P.load_model, T.build_model = load_model, build_model
sys.argv = ["llmtrain", *sys.argv[1:]]
from llmtrain.cli import main
main()
'''


def _probe(launch: list[str], recipe, run, *overrides: str) -> str:
    """`llmtrain finetune RECIPE output_dir=RUN OVERRIDES` through TRAIN_PROBE, started by `launch` (this Python, or
    accelerate launch); it must succeed. Returns what it printed."""
    probe = run.parent / "probe.py"
    probe.write_text(TRAIN_PROBE)
    proc = subprocess.run([*launch, str(probe), "finetune", str(recipe), f"output_dir={run}", *overrides], env=ENV,
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_quantised_layers_stay_linear4bit_through_prepare_on_one_process(qlora_recipe, tmp_path):
    pytest.importorskip("bitsandbytes")
    out = _probe([sys.executable], qlora_recipe, tmp_path / "run")
    # 2 layers x 7 linears; the packed weights are stored as bf16 (bnb_4bit_quant_storage); only LoRA trains
    assert ("rank 0: Linear4bit before 14 after 14, 4 weights per stored torch.bfloat16, local share 1.00; trainable "
            "['lora_A', 'lora_B']") in out, out


@pytest.mark.precision
def test_qlora_trains_only_the_adapter_and_resumes_exactly(qlora_recipe, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    common = ["checkpoint.every_steps=4", "logging.every_steps=1"]
    summary = run_train(qlora_recipe, f"output_dir={tmp_path / 'straight'}", *common)
    straight = losses(tmp_path / "straight")
    assert straight[-1] < straight[0]
    assert summary["params_trainable"] < summary["params_total"] / 5
    # A QLoRA run says so where a LoRA run's output would read the same: the summary and the start-up line in train.log
    assert (summary["method"], summary["base_quantization"]) == ("qlora", "nf4")
    assert "trainable (QLoRA: LoRA on a 4-bit nf4 base)" in (tmp_path / "straight" / "train.log").read_text()
    saved = load_weights(tmp_path / "straight" / "checkpoints" / "step_000004")
    assert saved and all("lora_" in k for k in saved)  # the adapter only, never the quantised base

    crash_at_step(monkeypatch, qlora_recipe, 6, f"output_dir={tmp_path / 'cut'}", *common)
    run_train(qlora_recipe, f"output_dir={tmp_path / 'cut'}", *common, resume="auto")
    assert losses(tmp_path / "cut") == straight
    a, b = (load_weights(tmp_path / n / "final" / "adapter_model.safetensors") for n in ("cut", "straight"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.precision
def test_exported_adapter_loads_on_a_quantised_and_on_a_bf16_base(qlora_recipe, tiny_assets, tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmtrain.model.modeling import quantization_config

    run_train(qlora_recipe)
    final = tmp_path / "run" / "final"
    recipe = load_recipe(qlora_recipe)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48]])
    deltas = []
    for quantized in (True, False):
        extra = dict(quantization_config=quantization_config(recipe.model, torch.bfloat16),
                     device_map={"": "cpu"}) if quantized else {}
        base = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.bfloat16, **extra)
        model = PeftModel.from_pretrained(base, str(final)).eval()
        with torch.no_grad():
            with model.disable_adapter():
                plain = model(input_ids=ids).logits.float()
            deltas.append((model(input_ids=ids).logits.float() - plain).flatten())
    # The adapter loads on both bases and changes their predictions the same way: what it adds to the logits on
    # the 4-bit base points where it points on the bf16 base (the bases differ by the quantisation error).
    assert deltas[0].abs().max() > 0.1 and deltas[1].abs().max() > 0.1
    assert torch.nn.functional.cosine_similarity(deltas[0], deltas[1], dim=0) > 0.9


@pytest.fixture(scope="module")
def one_process(tiny_assets, tmp_path_factory):
    """The QLoRA recipe's run on 1 process (micro-batch 8), made once for both launches to compare with."""
    folder = tmp_path_factory.mktemp("qlora-one")
    run_train(write_recipe(tiny_assets, folder, **QLORA), f"output_dir={folder / 'one'}")
    return folder / "one"


@pytest.mark.slow
@pytest.mark.precision
# cpu_ddp: extended (make test-portable runs it; main tier: FSDP's, whose shards hold half the base)
@pytest.mark.parametrize("launch, share", [pytest.param("cpu_ddp", "1.00", marks=pytest.mark.extended),
                                           ("cpu_fsdp", "0.50")])
def test_two_processes_keep_the_base_4bit_and_train_as_one(qlora_recipe, one_process, tmp_path, free_port, launch,
                                                          share):
    """2 processes, DDP and FSDP2, train as 1 process with the same global batch, and the base stays 4-bit through
    prepare: DDP keeps a whole 4-bit copy per rank; FSDP2 shards the packed bf16 storage, half per rank, still 4
    weights per stored value (not turned into plain 16-bit parameters). The layers are counted inside the run, once
    the model is prepared (TRAIN_PROBE)."""
    pytest.importorskip("bitsandbytes")
    out = _probe([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(REPO / "accelerate_configs" / f"{launch}.yaml"), "--main_process_port", str(free_port)],
                 qlora_recipe, tmp_path / "two", "train.micro_batch_size=4")
    for rank in (0, 1):
        assert (f"rank {rank}: Linear4bit before 14 after 14, 4 weights per stored torch.bfloat16, local share "
                f"{share}; trainable ['lora_A', 'lora_B']") in out, out
    one, two = records(one_process), records(tmp_path / "two")
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    # The first step, on the same weights: micro-batches of 4 rows against 8 change only the bf16 matmuls' blocking
    # (measured 3.1e-7, under ATen's default and AVX2 kernels alike). After it, AdamW at lr 1e-2 turns the last bits
    # of bf16 gradients into updates of the order of the lr on the parameters whose gradients are small, and the runs
    # part like two bf16 runs do (measured at most 6.4e-3 over 8 steps): a wrong batch or a lost rank moves the loss
    # by more than 0.1.
    assert abs(two[0]["loss"] - one[0]["loss"]) < 1e-5
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=2e-2)
    assert re.search(r"model: [\d,]+ parameters", out)


def test_doctor_checks_bitsandbytes_for_a_quantised_base(qlora_recipe, monkeypatch):
    from llmtrain.doctor import check_quantize

    recipe = load_recipe(qlora_recipe)
    assert check_quantize(load_recipe(qlora_recipe, ["model.quantize=null"])) == []
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    ((name, status, detail),) = check_quantize(recipe)
    assert (name, status) == ("4-bit base", "fail") and "pip install 'llmtrain[qlora]'" in detail
    monkeypatch.undo()
    pytest.importorskip("bitsandbytes")
    ((_, status, detail),) = check_quantize(recipe)
    assert status == "pass" and "nf4" in detail


def test_fp16_on_a_cpu_computes_the_4bit_layers_in_the_models_dtype_as_its_warning_says(qlora_recipe, tmp_path):
    """train.mixed_precision=fp16 on a CPU: Accelerate runs no fp16 there, and the run's warning says it computes in
    the model's dtype; the 4-bit layers had computed in fp16 all the same, without a loss scale (step 1's loss
    4.7773648 against 4.7773384; audit 44). Now the run is mixed_precision=no's, to the bit."""
    pytest.importorskip("bitsandbytes")
    from llmtrain.model.modeling import compute_dtype

    assert compute_dtype("fp16", "cpu") is None and compute_dtype("fp16", "cuda:0") == torch.float16
    assert compute_dtype("bf16", "cpu") == torch.bfloat16 and compute_dtype("no", "cuda") is None
    runs = {}
    for precision in ("fp16", "no"):
        runs[precision] = tmp_path / precision
        run_train(qlora_recipe, f"train.mixed_precision={precision}", "train.max_steps=2", "logging.every_steps=1",
                  f"output_dir={runs[precision]}")
    assert losses(runs["fp16"]) == losses(runs["no"])
