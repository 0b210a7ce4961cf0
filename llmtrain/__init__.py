"""llmtrain: fine-tune 7B-class Llama and Mistral models with Hugging Face Accelerate."""

__version__ = "0.1.0"

import logging as _logging
import warnings as _warnings

# bitsandbytes (imported by peft wherever it is installed) says on a CPU without the optional `kernels` package that
# it falls back to its own 4-bit kernels: nothing for the user to do, on every command.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
# peft asks transformers' deprecated is_gradient_checkpointing of every LoRA model (train, export, samples): nothing
# for the user to do.
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
# Accelerate slices HSDP's flattened mesh dimension the way torch 2.13 says it will deprecate: nothing for the user
# to do, on every process of every HSDP launch.
_warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
# DTensor says that a 2-D (FSDP x TP) gradient norm or full-state gather runs two collectives where one flattened
# dimension could run one: a performance note about PyTorch's own redistribution, on every process of every step.
_logging.getLogger("torch.distributed.tensor._redistribute").setLevel(_logging.ERROR)
# The `kernels` package (imported with peft and bitsandbytes) says on every command, offline, that it skips a trust
# check of a bitsandbytes kernel repository the run never fetches (llmtrain turns HF_HUB_OFFLINE on itself when the
# hub does not answer): noise naming a package the run does not use (audit 58).
_logging.getLogger("kernels._internals.hf_hub").setLevel(_logging.ERROR)


class _TiedHeadSaved(_logging.Filter):
    """Accelerate asks the user to check, on every save of a model whose head shares the embedding (Qwen3 below 8B,
    Gemma 3, Llama 3.2), that reloading gives no warning: llmtrain saves the tied weight once itself (run/export.
    tied_once) and its tests reload it (audit 58)."""

    def filter(self, record: _logging.LogRecord) -> bool:  # kept for any other shared tensor: a reload may not tie it
        import re

        said = re.search(r"Removed shared tensor \{(.*?)\} while saving", record.getMessage())
        names = re.findall(r"'([^']+)'", said.group(1)) if said else []
        return not names or not all(n.endswith(("lm_head.weight", "embed_tokens.weight")) for n in names)


_logging.getLogger("accelerate.utils.other").addFilter(_TiedHeadSaved())
