"""A learned reward for online RL (rl.rewards: type reward_model): a trained reward model scores each completion.

The reward model (a reward_model: run's final/, model/score.py loads it) sees the prompt and the completion rendered
as its pairs were when it trained (data/pairs.py renders each answer as the prompt_completion row {prompt,
completion=answer}): through the chat template where the RL data are chats or data.chat_template is set, else as text
plus EOS, with the reward model's own tokenizer. A completion that called tools is the whole conversation after the
prompt (its calls, the tools' results, the last reply), as TRL renders it. It scores them in batches of the reward's
batch_size, right-padded, under no_grad, on the run's device, through transformers' own forward: the score at each
sequence's last token that is not the pad token, as the reward model read it in training.
"""

from __future__ import annotations

import torch

from llmtrain.data.formats import encode_example


def reward_model_function(reward, data, *, device):
    """The reward function (TRL's signature) of a reward_model reward `reward` (its path and batch_size), rendering
    as the RL recipe's data section `data` says; the folder is checked before the model is read."""
    from llmtrain.data.chat import read_template
    from llmtrain.model.score import check_reward_folder, load_reward_model

    check_reward_folder(reward.path)
    model, tokenizer = load_reward_model(reward.path, device if device is not None else "cpu")
    render = data.model_copy(update={"format": "prompt_completion", "max_seq_len": 2**31 - 1, "fields": {},
                                     "train_on_prompt": False})
    template = read_template(data, tokenizer)
    text_config = model.config.get_text_config()
    if text_config.pad_token_id is None:  # a reward model from elsewhere: TRL's rule, the tokenizer's pad, else EOS
        text_config.pad_token_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                    else tokenizer.eos_token_id)
    pad = text_config.pad_token_id

    @torch.no_grad()
    def reward_model(prompts: list, completions: list, **columns) -> list[float]:
        # a conversational completion is its messages, rendered after the prompt as TRL renders prompt + completion
        # for a reward model: one assistant message, or with tools every call, the tools' results and the last reply
        # (its first message alone had scored a tool-calling completion as an empty reply)
        sequences = [encode_example({"prompt": p, "completion": c}, tokenizer, render,
                                    template=template)["input_ids"] for p, c in zip(prompts, completions)]
        scores = []
        for s in range(0, len(sequences), reward.batch_size):
            batch = sequences[s:s + reward.batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([x + [pad] * (width - len(x)) for x in batch], device=model.device)
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch], device=model.device)
            scores += model(input_ids=ids, attention_mask=mask).logits.float().squeeze(-1).tolist()
        return scores

    reward_model.__name__ = "reward_model"
    reward_model.described = described(reward.path, model)
    return reward_model


def described(path: str, model) -> str:
    """How the reward model at `path` was loaded, for the run's start-up line."""
    from pathlib import Path

    from llmtrain.config import adapter_base, adapter_quantization

    folder = Path(path).expanduser()
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    size = f"{base_model.num_parameters() / 1e6:,.2f}M parameters"  # (transformers counts 4-bit weights unpacked)
    if not (folder / "adapter_config.json").is_file():
        return f"{path}, a whole model, {size} in {str(model.dtype).removeprefix('torch.')}, whole on every process"
    held = adapter_quantization(folder)
    base = adapter_base(folder)
    how = (f"its base in 4 bits ({held[0]}, {held[1]}) as its QLoRA run held it" if held is not None else
           f"its base in {str(model.dtype).removeprefix('torch.')} as saved")
    return f"{path}, a LoRA adapter on {base}, {how}, {size}, whole on every process"
