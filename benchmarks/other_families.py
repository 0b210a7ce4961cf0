"""Model types outside the capability table's families, swept at tiny sizes on the CPU: for each, the summed loss of
a packed row of 5 examples through llmtrain's varlen attention and chunked loss against each example alone through
transformers' eager attention and its own logits (eval mode, float32), and whether llmtrain refuses the model
(capabilities.attention_problems, loaded_model_problems). docs/models.md ("Models outside the table") quotes it.

    python benchmarks/other_families.py                 # the types docs/models.md lists
    python benchmarks/other_families.py gemma4_text ... # others

A type the model types' defaults do not build at these sizes says so (SETUP); a refused one is trained as the refusal
says instead, so its "relative error" shows what the rules keep from training.
"""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F

TYPES = ["olmo2", "olmo3", "smollm3", "granite", "granitemoe", "cohere", "cohere2", "glm4", "glm4_moe",
         "exaone4", "seed_oss", "hunyuan_v1_dense", "ernie4_5", "qwen2_moe", "ministral3", "apertus", "phimoe", "olmoe",
         "helium", "stablelm", "starcoder2", "gpt_neox", "hyperclovax", "gpt_oss", "llama4_text", "qwen3_next",
         "minimax", "falcon_h1", "bamba", "granitemoehybrid", "nemotron_h", "lfm2", "gemma2"]
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              vocab_size=97, attention_dropout=0.0, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
OWN = {"lfm2": dict(layer_types=["conv", "full_attention"])}  # its checkpoints' convolution layers (defaults: none)


def main(types: list[str]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    from llmtrain import capabilities
    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.errors import LLMTrainError
    from llmtrain.model.attention import register
    from llmtrain.model.loss import attach_loss, compute_loss

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    g = torch.Generator().manual_seed(1)
    exs = [{"input_ids": torch.randint(3, 97, (n,), generator=g).tolist(),
            "labels": torch.randint(3, 97, (n,), generator=g).tolist()} for n in [5, 9, 3, 12, 1]]
    targets = torch.tensor([t for e in exs for t in e["labels"][1:] + [-100]])
    packed = SimpleNamespace(model=SimpleNamespace(attn_implementation="auto"), data=SimpleNamespace(packing=True))
    print(f"{'model_type':18s} {'packed, varlen: relative loss error':40s} llmtrain")
    for mt in types:
        def config():  # one each model: from_config keeps the config it is given, attention included
            cfg = AutoConfig.for_model(mt, **COMMON, **OWN.get(mt, {}))
            if getattr(cfg, "sliding_window", None):
                cfg.sliding_window = 4  # shorter than the longest example: the window matters
            return cfg

        try:
            torch.manual_seed(0)
            ref = AutoModelForCausalLM.from_config(config(), dtype=torch.float32, attn_implementation="eager").eval()
            refused = (capabilities.attention_problems(packed, config())
                       + capabilities.loaded_model_problems(packed, ref))
            var = AutoModelForCausalLM.from_config(config(), dtype=torch.float32, attn_implementation=register()).eval()
            var.load_state_dict(ref.state_dict())
            with torch.no_grad():
                logits = torch.cat([ref(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0]
                                    for e in exs])
                want = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
            attach_loss(var, chunk=7)
            from llmtrain.model import attention

            attention.UNCOMPUTED, held = {}, attention.UNCOMPUTED  # what it would compute without its own refusal
            try:
                with torch.no_grad():
                    got = compute_loss(var, with_loss_positions(collate(exs, pad_id=0, packing=True))).item()
                error = f"{abs(got - want) / want:.1e}"
            except (ValueError, RuntimeError) as e:
                error = f"{type(e).__name__}: {str(e)[:60]}"
            finally:
                attention.UNCOMPUTED = held
            print(f"{mt:18s} {error:40s} {'refused' if refused else 'trains'}", flush=True)
        except (LLMTrainError, ValueError, RuntimeError, TypeError) as e:
            print(f"{mt:18s} SETUP {type(e).__name__}: {str(e)[:80]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or TYPES)
