"""train.deterministic: the same losses and weights, bit for bit, from the same recipe on the same GPU and software,
straight or resumed.

What it sets for the run (`deterministic_algorithms`), and why each piece is needed on CUDA:
- torch.use_deterministic_algorithms(True), strict: an op with no deterministic kernel raises instead of warning.
  Strict, not warn-only, because aten's flash attention backward (the varlen kernel llmtrain trains with, and SDPA's
  flash path) only takes its deterministic algorithm when the mode is on and warn_only is off; warn-only leaves the
  fast backward, whose dq accumulation across key blocks is ordered by atomics (the first GPU run's resume differed
  at step 6 by 1.7e-4 with the warning "Flash Attention defaults to a non-deterministic algorithm"). SDPA's
  memory-efficient backward likewise drops its split-key atomics only in strict mode.
- CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless already set): cuBLAS picks reduction splits by workspace, and strict mode
  refuses a cuBLAS matmul without a fixed one. cuBLAS reads it when its first handle is made, after this runs (the
  model is built later), and keeps it for the process, so it is left set when the run ends.
- the chunked loss (model/loss.py) and liger's kernels need nothing more: the loss is a matmul, log-softmax and NLL
  per chunk, summed in a fixed order (NLL's 2-D path has no atomics: only nll_loss2d raises in strict mode); liger's
  RMSNorm, RoPE, SwiGLU and fused linear cross-entropy Triton kernels use no atomics (read at linkedin/Liger-Kernel
  ead96b6: RMSNorm's weight gradient is one partial row per SM, summed by torch; the fused loss adds its chunks'
  weight gradients with addmm, in order).

One part of a step runs warn-only (`sampling_warn_only`): online RL's sampling (model/generate.py), whose nucleus
cut and inverse CDF take a floating-point cumsum over the vocabulary, which torch flags on CUDA and would refuse in
strict mode. Sampling builds no graph; a warning names the op once.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

CUBLAS_WORKSPACE = ":4096:8"


@contextmanager
def deterministic_algorithms():
    """Strict deterministic kernels and a fixed cuBLAS workspace for the run; torch's previous mode (and warn-only
    flag) restored after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@contextmanager
def sampling_warn_only():
    """Within strict deterministic mode, warn-only (see the module's docstring); elsewhere nothing changes."""
    strict = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    if strict:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        if strict:
            torch.use_deterministic_algorithms(True, warn_only=False)
