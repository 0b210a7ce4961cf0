"""estimate-memory's exit status (0 fits, 4 does not, 2 bad input) and, when nothing fits, advice that follows the
part of the peak that overflows: what the micro-batch keeps, or the model's weights, gradients and optimizer state."""

from __future__ import annotations

import json

import pytest
from helpers import estimate_memory

from llmtrain.memory.cli import DOES_NOT_FIT

LLAMA = ("--model", "llama-2-7b", "--mixed-precision", "bf16")


@pytest.mark.parametrize("args, code", [
    (("--method", "lora", "--seq-len", "512"), 0),  # 61 GiB to spare
    (("--seq-len", "512"), DOES_NOT_FIT),  # a full fine-tune of 7B on one GPU: 139 GiB
    (("--seq-len", "512", "--num-gpus", "8", "--strategy", "ddp"), DOES_NOT_FIT),
    (("--seq-len", "512", "--num-gpus", "8", "--fit"), 0),  # --fit found FSDP on these 8 GPUs
    (("--seq-len", "512", "--fit"), 0),  # --fit: 8-bit AdamW on the one GPU (with AdamW FSDP on 2 would)
    (("--seq-len", "512", "--fit", "--gpu-memory", "40"), DOES_NOT_FIT),  # nothing on one GPU of 40 GiB
])
def test_the_exit_status_says_whether_it_fits(args, code):
    res = estimate_memory(*LLAMA, *args, check=False)
    assert res.returncode == code, res.stdout + res.stderr
    assert "total per GPU" in res.stdout  # the table is printed either way


def test_json_that_does_not_fit_exits_4_after_the_whole_object():
    res = estimate_memory(*LLAMA, "--seq-len", "512", "--json", check=False)
    assert res.returncode == DOES_NOT_FIT == 4 and json.loads(res.stdout)["fits"] is False
    assert estimate_memory("--model", "/no/such/dir", check=False).returncode == 2


def advice(*args: str) -> str:
    res = estimate_memory(*LLAMA, *args, "--json", check=False)
    assert res.returncode == DOES_NOT_FIT, res.stdout + res.stderr
    said = json.loads(res.stdout)["recommendation"]
    assert "nothing fits" in said, said
    return said


def test_activations_that_do_not_fit_are_not_told_to_offload_the_weights_again():
    """FSDP with --cpu-offload on 8 GPUs, 400k-token sequences: the weights are on the host already; before, the
    advice ended "or FSDP with --cpu-offload" all the same."""
    said = advice("--seq-len", "400000", "--grad-checkpointing", "--strategy", "fsdp", "--num-gpus", "8",
                  "--cpu-offload")
    assert "what the micro-batch keeps (activations, logits) is" in said and "--seq-len" in said
    assert "--cpu-offload" not in said and "LoRA" not in said and "weights, gradients" not in said
    assert "--grad-checkpointing" not in said  # on already


def test_lora_activations_that_do_not_fit_are_told_to_checkpoint_and_shorten():
    said = advice("--method", "lora", "--seq-len", "400000")
    assert "try gradient checkpointing (model.gradient_checkpointing=true / --grad-checkpointing), a tiled MLP " \
        "(model.tiled_mlp=true / --tiled-mlp), shorter sequences" in said
    assert "activation offload" not in said  # it needs checkpointing, which this run does not have yet
    said = advice("--method", "lora", "--seq-len", "400000", "--grad-checkpointing")
    assert "try activation offload (model.activation_offload=true / --activation-offload), a tiled MLP" in said
    assert "--cpu-offload" not in said and "QLoRA" not in said and "weights, gradients" not in said


def test_weights_that_do_not_fit_are_told_to_offload_or_train_fewer():
    """A 1.5 GiB card: the micro-batch is small, the full fine-tune's state is 100 GiB."""
    said = advice("--seq-len", "128", "--gpu-memory", "1.5")
    assert "weights, gradients and optimizer state are 100.4 GiB per GPU: try FSDP with --cpu-offload, LoRA on a " \
           "bfloat16 base (--method lora --dtype bfloat16), 8-bit AdamW (train.optimizer=adamw_8bit / --optimizer " \
           "adamw_8bit)" in said
    assert "what the micro-batch keeps" not in said and "--seq-len" not in said


@pytest.mark.parametrize("args, said", [
    (("--model", "mistral-7b", "--dora"), "--dora sets the LoRA adapters (lora.*), and the run estimated is a full "
                                          "fine-tune: add --method lora"),
    (("--model", "mistral-7b", "--lora-r", "64", "--lora-dropout", "0.5"), "--lora-r, --lora-dropout set the LoRA"),
    (("--model", "mistral-7b", "--pipeline-schedule", "gpipe"), "--pipeline-schedule sets the pipeline's schedule, "
                                                                "and the run estimated has no pipeline"),
    (("recipes/mistral7b-lora.yaml", "--pipeline-schedule", "gpipe"), "--pipeline-schedule sets the pipeline's"),
])
def test_options_the_estimated_run_does_not_have_are_refused(args, said):
    """An option for what the run does not have (LoRA's without --method lora, a schedule without stages) is
    refused, as --quantize without LoRA is: they had been dropped without a word (--dora estimated a full fine-tune's
    121 GiB, exit 4; audit 10)."""
    result = estimate_memory(*args, check=False)
    assert result.returncode == 2 and said in " ".join((result.stdout + result.stderr).split()), result.stdout
    assert estimate_memory("--model", "mistral-7b", "--method", "lora", "--dora", "--json").returncode in (0, 4)
