"""The activation formulas against what autograd really saves, on tiny Llama models on the CPU.

Each case runs the real transformers (and peft) modules, walks the autograd graph from the logits and
adds up every distinct tensor storage saved for backward that is not a parameter. Two models that
differ by one decoder layer give one layer's bytes exactly; the one-layer model gives the rest.
The only CPU/CUDA difference in these paths is dropout: the CPU kernel saves a noise tensor in the
input's dtype (fp32 in LoRA: peft casts the input to the adapter's dtype) where CUDA saves a bool mask.
"""

from __future__ import annotations

import json

import pytest
import torch

from llmtrain.memory import activations as act
from llmtrain.memory.estimate import make_pass
from llmtrain.memory.params import _shape_from_json, lora_plan
from llmtrain.memory.spec import TrainSpec

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, attention_dropout=0.0)
B, S, R = 2, 16, 4


def build(layers: int, attn: str, dtype: torch.dtype, lora: float | None):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, num_hidden_layers=layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    if lora is not None:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=8, lora_dropout=lora,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
    return model


def saved_bytes(model, *, autocast: bool, padded: bool) -> int:
    """Bytes of distinct non-parameter storages saved by the autograd graph of one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, TINY["vocab_size"], (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[-1, -3:] = 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=mask if padded else None,
                       position_ids=torch.arange(S).expand(B, S)).logits
    storages, seen, stack = {}, set(), [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                value = getattr(node, attr)
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
                        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(nxt for nxt, _ in node.next_functions)
    return sum(storages.values())


CASES = [  # attn, storage dtype, mixed precision, padded batch, lora dropout (None: full fine-tune)
    ("eager", "float32", "no", False, None),
    ("eager", "float32", "bf16", True, None),
    ("eager", "bfloat16", "bf16", False, None),
    ("sdpa", "float32", "no", False, None),
    ("sdpa", "float32", "bf16", False, None),
    ("sdpa", "float32", "bf16", True, None),
    ("sdpa", "bfloat16", "no", True, None),
    ("sdpa", "bfloat16", "bf16", False, 0.05),
    ("sdpa", "bfloat16", "bf16", True, 0.05),
    ("sdpa", "float32", "no", False, 0.05),
    ("eager", "float32", "bf16", False, 0.05),
]


@pytest.mark.parametrize(("attn", "dtype", "mp", "padded", "lora"), CASES)
def test_layer_and_outside_bytes_equal_what_autograd_saves(attn, dtype, mp, padded, lora):
    shape = _shape_from_json(json.dumps({**TINY, "num_hidden_layers": 2}), "tiny")
    spec = TrainSpec(attn=attn, dtype=dtype, mixed_precision=mp, micro_batch=B, seq_len=S,
                     method="full" if lora is None else "lora", lora_r=R, lora_dropout=lora or 0.0)
    p = make_pass(shape, spec)
    assert p.mask == (B > 1)  # padded rows are assumed whenever a micro-batch has more than one row
    p = act.Pass(**{**p.__dict__, "mask": padded, "dropout_mask_bytes": 4})  # the CPU's dropout noise is fp32
    torch_dtype, autocast = getattr(torch, dtype), mp != "no"
    one = saved_bytes(build(1, attn, torch_dtype, lora), autocast=autocast, padded=padded)
    two = saved_bytes(build(2, attn, torch_dtype, lora), autocast=autocast, padded=padded)

    adapted = lora_plan(shape, r=R).adapted[0] if lora is not None else {}
    # Autocast's weight casts are saved too: every fp32 linear's, and the fp32 adapters'.
    copies = shape.linear_params_per_layer * 2 if (autocast and dtype == "float32") else 0
    copies += sum(R * (i + o) for i, o in adapted.values()) * 2 if autocast else 0
    layer = act.layer_bytes(p, shape, adapted, R) + copies
    # Python-float multiplies (attention scaling, LoRA scaling) save an 8-byte scalar each.
    scalars = 8 * ((attn == "eager") + (len(adapted) if lora is not None else 0))
    assert two - one == layer + scalars

    full = lora is None
    head_copy = shape.vocab * shape.hidden * 2 if (autocast and dtype == "float32") else 0
    outside = act.outside_layers_bytes(p, shape, embed_trainable=full, head_trainable=full, norm_trainable=full)
    first = layer
    if not full:  # frozen embeddings: the first layer's input needs no gradient
        first -= act.frozen_input_discount(p, shape, adapted)
        # ... nor the casts of its q/k/v weights and A weights (saved only for the input's gradient)
        qkv = [x for x in shape.layer_linears if x.name.endswith(("q_proj", "k_proj", "v_proj"))]
        first -= sum(R * x.fan_in * 2 for x in qkv) * autocast
        first -= sum(x.numel * 2 for x in qkv) * (autocast and dtype == "float32")
    assert one == first + scalars + outside + head_copy
