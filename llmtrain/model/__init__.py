"""The model: loading, LoRA and quantisation, kernels, attention, the chunked loss, the optimizer and schedule.

- `modeling.py`: the tokenizer and model (dtype, LoRA, QLoRA's 4-bit base, liger kernels, compile, gradient
  checkpointing), the optimizer and the lr schedule.
- `offload.py`: model.activation_offload, the checkpointed layers' inputs in host memory (side-stream copies).
- `tiled_mlp.py`: model.tiled_mlp, the MLP over shards of the tokens, recomputed shard by shard in backward.
- `attention.py`: varlen attention over packed rows (flash `varlen_attn` on CUDA, SDPA per example elsewhere).
- `loss.py`: the chunked cross-entropy and per-token log-probabilities from the final hidden states (and another
  loss on the same chunks: distillation's).
- `score.py`: a reward model's score head on each sequence's last token only; checking and loading a reward model.
- `teacher.py`: distillation's teacher: its vocabulary checked against the student's, then loaded frozen.
- `generate.py`: sampling completions with the KV cache, each from its own seed (online RL's rollouts), and the
  attention switch generation needs.

May import: the schema (`config`, `errors`) and this folder. Never the data, the run folder or the loop.
"""
