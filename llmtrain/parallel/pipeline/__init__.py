"""Pipeline parallelism (parallel.pipeline_parallel), in one room: the decoder cut into stages on several processes,
run through torch.distributed.pipelining's schedules.

- split.py: which layers each stage runs, which rank runs a (virtual) stage, the bubble, the micro-batches in flight
  (pure arithmetic, shared with the memory estimate, memory/pipeline.py);
- stage.py: one stage of a Llama-layout causal LM, cut by hand, and the placeholders of what other stages hold;
- group.py: this process's pipeline and its stage's replicas, the replicas' gradients, the norm for clipping;
- schedule.py: the training step (and the eval) of a window through the stages (`Pipeline`);
- sampling.py: the stages as one causal LM that generate.sample decodes with, each stage's KV cache its own;
- checkpoint.py: each stage's weights and optimizer state, read back under any split, and the export's gather.

May import: the schema, data/ and model/ (the batching, the varlen attention, the loss), this folder, and
parallel/fsdp.py.
"""
