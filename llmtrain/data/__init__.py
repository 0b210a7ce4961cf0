"""Data: from the user's rows to the tensors of a micro-batch.

- `sources.py`: reading local files, dataset folders and hub datasets.
- `chat.py`: chat templates: the text inference sees and where each reply stands in it.
- `formats.py`: one row to tokens and a loss mask (alpaca, messages, prompt_completion, text).
- `pairs.py`: one preference row to its two encoded answers.
- `prepare.py`: a whole source checked, tokenised, counted and cached (`prepare_datasets`).
- `batching.py`: the data plan (which examples each process sees at each step), token bins, collation, `Counts`
  (what a micro-batch holds) and the prefetching window stream.
- `checks.py`: the data checks `finetune` and `doctor` share.

May import: the schema (`config`, `errors`) and this folder. Never the model, the objectives, the run folder or
the loop.
"""
