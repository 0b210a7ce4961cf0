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
