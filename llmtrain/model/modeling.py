"""Build the tokenizer, the model (full fine-tune or LoRA), the optimizer and the lr schedule from the recipe."""

from __future__ import annotations

import functools
import math
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from llmtrain.config import LoraConfig, ModelConfig, RopeScaling
from llmtrain.errors import LLMTrainError
from llmtrain.model import lora_experts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


MODEL_KEYS = "model.name_or_path / model.tokenizer"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def weights_problem(path: str, *, key: str = MODEL_KEYS) -> str | None:
    """Why a local model folder cannot be trained from: a config.json and no weights file (a half-copied folder, a
    config downloaded alone), or a safetensors file whose header cannot be read (an interrupted download or copy:
    safetensors reads the header alone, no tensor); None otherwise (doctor and launch ask it without loading the
    weights, as the load would refuse them)."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        return None
    if any((folder / w).is_file() for w in WEIGHTS):
        return _damaged_shard(folder)
    return (f"the model folder '{path}' ({key}) has a config.json but no weights ({', '.join(WEIGHTS)}): a config "
            "alone is enough for estimate-memory, not to train or generate. Copy the weights into it, or set "
            f"{key.split(' / ')[0]} to a folder or hub id that has them" + (
                " (or model.random_init: true, to train from random weights: a speed or memory check)"
                if key == MODEL_KEYS else ""))


def _damaged_shard(folder: Path) -> str | None:
    """The paragraph for the first safetensors file of `folder` (model.safetensors, or the shards its index names)
    whose header safetensors cannot read; None where every one reads."""
    import json

    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    # transformers reads the one file where there is one, not the index
    sharded = index.is_file() and not (folder / "model.safetensors").is_file()
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if sharded else ["model.safetensors"]
    except (ValueError, KeyError, TypeError, OSError, AttributeError) as e:
        return damaged_text(folder, f"model.safetensors.index.json: {type(e).__name__}: {e}")
    for name in names:
        if not (folder / name).is_file():
            if sharded:
                return (f"the model folder '{folder}' lacks {name}, which its model.safetensors.index.json names: a "
                        "half-copied folder. Download or copy the model again.")
            continue
        try:
            with safe_open(folder / name, framework="pt"):
                pass
        except Exception as e:  # safetensors' own error type (a header cut short or not JSON), or the OS's
            return damaged_text(folder, f"{name}: {type(e).__name__}: {e}")
    return None


def _load_error(what: str, path: str, err: Exception, *, key: str = MODEL_KEYS) -> LLMTrainError:
    """The paragraph for a model or tokenizer that cannot be read from `path`, naming the recipe `key` it came from."""
    from llmtrain.config import run_folder_problem
    from llmtrain.hub import surely_local

    if problem := run_folder_problem(path, key.split(" / ")[0]):
        return LLMTrainError(problem)
    folder = Path(path).expanduser()
    if what == "model" and (problem := weights_problem(path, key=key)):
        return LLMTrainError(problem)
    local = surely_local(path)  # (myorg/other beside a folder myorg/ is the hub's: not a missing folder)
    if local and not folder.exists():
        run = Path(path).parent if Path(path).name in ("final", "final-merged") else None
        if run is not None:  # another run's output, e.g. the SFT run a GRPO or distillation recipe starts from
            hint = (f" It is the {Path(path).name}/ of the run '{run}', which has not been trained here: train that "
                    "run first (the recipe's header comment names the command; the tiny demos: `make demo-rl`, "
                    "`make demo-distill`, ...), or point the key at another model.")
        elif "tiny" in path:
            hint = " The tiny demo's assets are made by `llmtrain prepare-tiny` (it writes assets/tiny)."
        else:
            hint = ""
        return LLMTrainError(f"the model folder '{path}' ({key}) does not "
                             f"exist. Give the path of a local model folder, or a hub id such as "
                             f"mistralai/Mistral-7B-Instruct-v0.3.{hint}")
    from llmtrain.hub import is_offline

    if is_offline() and not local:  # set by the user, or by llmtrain.hub when the hub did not answer: only the cache
        from huggingface_hub.constants import HF_HUB_CACHE

        return LLMTrainError(
            f"the {what} '{path}' ({key}) is not in the local Hugging Face cache "
            f"({HF_HUB_CACHE}), and the hub is not asked (HF_HUB_OFFLINE=1; transformers says: "
            f"{str(err).splitlines()[0].rstrip('.')}). Download it "
            f"where there is network (`hf download {path}`, with the same HF_HOME), or give a local model folder.")
    if "trust_remote_code" in str(err):  # transformers' words name its own argument, not the recipe's key
        return LLMTrainError(f"the {what} '{path}' ({key}) runs code of its own (its config names a model class that "
                             "transformers does not have): set model.trust_remote_code: true to run that code, after "
                             "reading it, or use a model whose architecture transformers has.")
    return LLMTrainError(
        f"could not load the {what} from '{path}' ({key}): {err}. "
        "Give a local directory with config.json and weights, or a hub id; without network access, the "
        "hub id must already be in the local Hugging Face cache, and HF_HUB_OFFLINE=1 makes every command say so "
        "at once instead of retrying the network for a minute."
    )


def _must_exist(what: str, path: str, *, key: str = MODEL_KEYS) -> None:
    """A local path that is not there (hub.missing_local) is refused before transformers asks the hub for it as an
    id, which without network retries for a minute: a mistyped runs/tiny-sfT/final is said at once."""
    from llmtrain.config import run_folder_problem
    from llmtrain.hub import missing_local

    if missing_local(path):
        raise _load_error(what, path, FileNotFoundError(path), key=key)
    folder = Path(path)
    wanted = ("config.json",) if what == "model" else ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if folder.is_dir() and not any((folder / name).is_file() for name in (*wanted, "adapter_config.json")) and \
            not run_folder_problem(path, key.split(" / ")[0]):  # (a run's folder: _load_error's own paragraph)
        inside = sorted(p.parent.name for name in wanted for p in folder.glob(f"*/{name}"))
        hint = f" Did you mean {folder / inside[0]}?" if inside else ""
        raise LLMTrainError(f"'{path}' ({key}) is a folder without a {what}'s files (no {' or '.join(wanted)}): "
                            f"give the folder that holds them.{hint}")


def load_model_config(cfg: ModelConfig, *, key: str = MODEL_KEYS):
    """The config of the model llmtrain trains (no weights: text_model's for a multimodal checkpoint), with
    load_model's refusal where it cannot be read, naming `key` (where the name came from: the recipe's keys, or a
    command's argument)."""
    from transformers import AutoConfig

    _must_exist("model", cfg.name_or_path, key=key)
    try:
        return text_model(AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code))[0]
    except (OSError, ValueError) as e:
        raise _load_error("model", cfg.name_or_path, e, key=key) from None


# A multimodal checkpoint whose text model llmtrain trains alone: its model_type -> the checkpoint keys of the text
# model's decoder (transformers 4.5x saved language_model.model.*, 5.x saves model.language_model.*)
_LANGUAGE_MODEL_KEYS = {r"^language_model\.model\.": "model.", r"^model\.language_model\.": "model.",
                        r"^language_model\.lm_head\.": "lm_head."}
TEXT_MODELS = {"gemma3": _LANGUAGE_MODEL_KEYS, "gemma4": _LANGUAGE_MODEL_KEYS}


def pretrained(auto, path: str, *, rope_scaling: RopeScaling | None = None, **kwargs):
    """`auto.from_pretrained(path, **kwargs)` of the model llmtrain trains from `path` (text_model: a multimodal
    checkpoint's text model), its rotary embedding scaled as the run's was (model.rope_scaling: scale_rope): for what
    reads a run's base again (the export's merge, a reward model's adapter)."""
    from transformers import AutoConfig

    try:
        config, mapping = text_model(AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items()
                                                                         if k == "num_labels"}))
        kwargs.update(dequantized(config))
        if not mapping and rope_scaling is None:
            return auto.from_pretrained(path, **kwargs)
        scale_rope(config, rope_scaling)
        if "num_labels" in kwargs:
            config.num_labels = kwargs.pop("num_labels")
        if not mapping:
            return auto.from_pretrained(path, config=config, **kwargs)
        with _quiet_new_head(True):
            return _own_names(auto.from_pretrained(path, config=config, key_mapping=mapping, **kwargs))
    except (OSError, ValueError) as e:  # the base moved, deleted or not in the cache: said as load_model says it
        raise _load_error("model", path, e) from None


def _own_names(model):
    """A text model read from a multimodal checkpoint saves under its own names: transformers 5 saves a model in the
    format it was read from (the key mapping reversed), which would give final/, a Gemma3ForCausalLM's config,
    language_model.* weights that no loader maps back (every weight random on loading)."""
    model._weight_conversions = []
    return model


def text_model(config):
    """(config, key_mapping) of the model to train. Gemma 3's hub checkpoints from 4B up (google/gemma-3-4b-it, 12b,
    27b) are its multimodal model (model_type gemma3: a vision tower, a projector, and the text model's config in
    text_config), which AutoModelForCausalLM builds whole and llmtrain's layer-by-layer paths cannot read; so are
    Gemma 4's (model_type gemma4, an audio tower too). llmtrain fine-tunes text, so it builds the text model
    (Gemma3ForCausalLM, Gemma4ForCausalLM) and reads its weights from the checkpoint's language-model keys; the
    vision and audio weights are never read, and final/ is the text model."""
    mapping = TEXT_MODELS.get(getattr(config, "model_type", None))
    return (config.get_text_config(), mapping) if mapping else (config, None)


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    path = cfg.tokenizer or cfg.name_or_path
    _must_exist("tokenizer", path)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error("tokenizer", path, e) from None
    if tok.eos_token_id is None:
        raise LLMTrainError(f"the tokenizer at '{path}' has no eos_token; training needs one to learn to stop.")
    if cfg.new_tokens:  # (those it has already keep their ids: a run's final/ holds them)
        tok.add_tokens(list(cfg.new_tokens), special_tokens=True)
    # transformers warns when a text is longer than the tokenizer's model_max_length; llmtrain tokenises whole rows
    # and cuts them at data.max_seq_len itself (and says how many), so the warning is noise on every long-data run.
    tok.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tok


def pad_id(tokenizer) -> int:
    # Pad positions are masked out of attention and loss, so any id works; prefer the real pad token.
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def scale_rope(config, scaling: RopeScaling | None) -> None:
    """model.rope_scaling into the model's config, as transformers reads it (rope_parameters, the model's rope_theta
    kept), and max_position_embeddings raised to the context it now reaches (original x factor; dynamic NTK's kept
    at the original, where transformers starts to rescale: context_reach): the rotary embedding is built from these
    when the model is."""
    if scaling is None:
        return
    held = getattr(config, "rope_parameters", None) or {}
    # a config this scaling was applied to already (a run's final/ saves it scaled): its original length, not the
    # scaled one, so that loading final/ with the run's recipe scales once (it had scaled twice)
    done = held.get("rope_type") == scaling.rope_type and held.get("factor") == scaling.factor
    original = (scaling.original_max_position_embeddings or (done and held.get("original_max_position_embeddings"))
                or config.max_position_embeddings)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    params = {**scaling.model_dump(exclude_none=True), "original_max_position_embeddings": original}
    # the model's own share of each head that rotates (Phi-3, Phi-4-mini: partial_rotary_factor), unless the scaling
    # gives one: dropped, every head dimension had been rotated
    partial = held.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    kept = {k: v for k, v in (("rope_theta", theta), ("partial_rotary_factor", partial))
            if v is not None and k not in params}
    config.rope_parameters = {**params, **kept}
    # dynamic NTK rescales past max_position_embeddings, which transformers reads as the original length: raised,
    # every position up to original x factor had run on the plain RoPE (logits equal to no scaling at 3x)
    config.max_position_embeddings = original if scaling.rope_type == "dynamic" else int(original * scaling.factor)


def context_reach(config) -> int | None:
    """The context a model's config reaches: its max_position_embeddings, or under dynamic NTK RoPE (which keeps it at
    the original length and rescales past it) the original length x the factor."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "dynamic" and rope.get("original_max_position_embeddings"):
        return int(rope["original_max_position_embeddings"] * rope["factor"])
    return getattr(config, "max_position_embeddings", None)


@contextmanager
def every_process_reads():
    """Weights read in this block are read by every process, also under an FSDP launch with cpu_ram_efficient_loading.

    That launch sets FSDP_CPU_RAM_EFFICIENT_LOADING, and transformers' from_pretrained then reads the checkpoint on the
    main process only, leaving the others' weights for FSDP's `prepare` to broadcast. llmtrain's receiving processes
    build the policy empty instead (parallel/fsdp.receives_weights); every other read must be whole: a frozen model
    never prepared (the distillation teacher, a reward model that scores completions) and a pipeline stage (each
    process loads the model and keeps its stages). transformers 5.17 (the GPU machine's) filled the other processes'
    weights with zeros: a 2-process FSDP distillation, its teacher uniform on process 1, logged a loss of 2.08 where
    one process logs 4.47, and FSDP pipeline stages learned nothing (the last stage's head all zeros: loss ln 104, the
    vocabulary's). Every from_pretrained of llmtrain's runs in this block (load_model, model/score.py)."""
    import os

    key = "FSDP_CPU_RAM_EFFICIENT_LOADING"
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


def load_model(cfg: ModelConfig, lora: LoraConfig | None, *, device: torch.device | None = None,
               empty: bool = False, compute_dtype: torch.dtype | None = None, reward_head: bool = False,
               key: str = MODEL_KEYS):
    """The model as the recipe says, on the CPU (or on `device` for a random init).

    reward_head: a reward model (the reward_model: section), the same decoder under a one-output
    sequence-classification head (LlamaForSequenceClassification's `score`, no bias; what TRL's RewardTrainer
    trains): from a causal-LM checkpoint the LM head is left out and the score head starts random, from the run's
    seed, as AutoModelForSequenceClassification makes it.

    empty=True builds it without reading any weight, for the processes of an FSDP run that receive their
    shards from the main process in `prepare` (fsdp.receives_weights). Its parameters are
    uninitialised (see `_uninitialised_parameters`); its buffers are real, because FSDP broadcasts
    parameters and persistent buffers only: non-persistent ones such as the rotary `inv_freq` are
    computed here from the config, exactly as the main process computes them.

    key: the recipe keys the model came from, for the refusal where it cannot be read (distill.teacher's teacher).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = dict(dtype=DTYPES[cfg.dtype], attn_implementation=attention_backend(cfg),
                  trust_remote_code=cfg.trust_remote_code)
    auto = AutoModelForSequenceClassification if reward_head else AutoModelForCausalLM
    _must_exist("model", cfg.name_or_path, key=key)
    try:
        config, key_mapping = text_model(AutoConfig.from_pretrained(
            cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, **({"num_labels": 1} if reward_head else {})))
        if key_mapping:  # the text model of a multimodal checkpoint: its vision weights are left unread, unreported
            kwargs["key_mapping"] = key_mapping
            if reward_head:
                config.num_labels = 1
        scale_rope(config, cfg.rope_scaling)
        if empty or cfg.random_init:
            from accelerate import init_empty_weights

            # A random init goes straight to the training device: a 7B random init on the CPU takes minutes.
            with init_empty_weights(include_buffers=False) if empty else torch.device(device or "cpu"):
                model = auto.from_config(config, **kwargs)
            if empty:  # init_empty_weights registers a new meta parameter for each module, the tied head's too: tie
                # it again, as the main process's from_pretrained is (else FSDP's prepare finds a head parameter on
                # this process that its own re-tying removes: Gemma 3, Llama 3.2 and small Qwen3 under FSDP)
                model.tie_weights()
        elif cfg.quantize:
            # Every process quantises its own copy on its own device (never device_map="auto", which would put
            # every rank's model on GPU 0).
            with _quiet_new_head(reward_head or key_mapping), every_process_reads():
                model = auto.from_pretrained(
                    cfg.name_or_path, config=config, quantization_config=quantization_config(cfg, compute_dtype),
                    device_map={"": torch.device(device or "cpu")}, **kwargs)
        else:  # a process that calls this reads the weights itself (FSDP's receiving processes build empty=True)
            with _quiet_new_head(reward_head or key_mapping), every_process_reads():
                model = auto.from_pretrained(cfg.name_or_path, config=config, **kwargs, **dequantized(config))
    except (OSError, ValueError) as e:
        raise _load_error("model", cfg.name_or_path, e, key=key) from None
    except Exception as e:  # a damaged weights file (safetensors raises its own error type), a bad config
        if type(e).__name__ not in DAMAGED:
            raise
        raise LLMTrainError(damaged_text(cfg.name_or_path, f"{type(e).__name__}: {e}")) from None
    if key_mapping:
        _own_names(model)
    if cfg.new_tokens:
        grow_vocabulary(model, len(load_tokenizer(cfg)))
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    if cfg.quantize:
        _keep_cpu_4bit_layout(model)
    if use_liger(cfg, device):  # before LoRA: peft then wraps the projections inside liger's SwiGLU MLP
        _apply_liger(model)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and needs no input-grad hooks.
        # transformers 5.24 renamed it (the old name warns on every run); 5.17, the GPU machine's, has the old only
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.activation_offload:
            from llmtrain.model.offload import offload_checkpointed_inputs

            offload_checkpointed_inputs(model, {"use_reentrant": False})
    if cfg.tiled_mlp:  # before LoRA (peft then adapts the projections the tiled forward calls), after liger
        from llmtrain.model.tiled_mlp import tile_mlps

        tile_mlps(model, cfg.tiled_mlp)
    if lora is not None:
        model = apply_lora(model, lora, task="SEQ_CLS" if reward_head else "CAUSAL_LM")
    if empty:
        _uninitialised_parameters(model)
    return model


def embedding_rows(recipe, tokenizer, config) -> int | None:
    """The rows of the model's embedding as load_model leaves them (`config`: the model's text config, None where it
    could not be read): config.vocab_size, grown to the tokenizer's length by model.new_tokens alone
    (grow_vocabulary)."""
    rows = getattr(config, "vocab_size", None) if config is not None else None
    if rows is None:
        return None
    return max(rows, len(tokenizer)) if recipe.model.new_tokens else rows


def grow_vocabulary(model, size: int) -> None:
    """The embeddings and the LM head grown to `size` rows (model.new_tokens: the tokenizer's new length), each new row
    the mean of the old ones: a new token starts where the model's tokens are on average, and its first logits are
    the average logit (Hewitt, "Initializing new word embeddings", 2021). Not transformers' mean_resizing: it also
    draws from the rows' covariance, an (hidden x hidden) product over the whole vocabulary that takes minutes on a
    CPU for a 128K one. A model with rows to spare (Qwen's, past its tokenizer) or whose rows were already grown (a
    run's final/) is left as it is; an empty model (FSDP's receiving processes) gets the main process's rows."""
    old = model.get_input_embeddings().num_embeddings
    if size <= old:
        return
    model.resize_token_embeddings(size, mean_resizing=False)
    grown = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())
             if m is not None}
    with torch.no_grad():
        for w in grown.values():
            if w.device.type != "meta":
                w[old:] = w[:old].float().mean(0).to(w.dtype)


def _quiet_new_head(quiet):
    """transformers' report of the weights a sequence-classification model does not find in a causal-LM checkpoint
    (the new score head) and of those it leaves (lm_head), or of a multimodal checkpoint's vision weights the text
    model leaves: expected, so not printed."""
    from contextlib import nullcontext

    if not quiet:
        return nullcontext()
    from transformers.utils import logging

    class Quiet:
        def __enter__(self):
            self.level = logging.get_verbosity()
            logging.set_verbosity_error()

        def __exit__(self, *exc):
            logging.set_verbosity(self.level)

    return Quiet()


def dequantized(config) -> dict:
    """from_pretrained's arguments that read a checkpoint stored in MXFP4 (GPT-OSS's hub checkpoints: its experts in
    4-bit blocks and scales, `quantization_config: {quant_method: mxfp4}`) as dense weights in model.dtype, which
    train: transformers keeps MXFP4 where its kernels are installed (a GPU with triton and `kernels`), and that does
    not train; elsewhere it dequantizes with warnings. Empty for any other checkpoint."""
    from llmtrain.capabilities import stored_quantization

    if stored_quantization(config) != "mxfp4":
        return {}
    import logging

    from transformers import Mxfp4Config

    # its notes on running MXFP4 natively (kernels, triton, use_kernels) are moot once it is asked to dequantize
    logging.getLogger("transformers.quantizers.quantizer_mxfp4").setLevel(logging.ERROR)
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def quantization_config(cfg: ModelConfig, compute_dtype: torch.dtype | None):
    """bitsandbytes 4-bit (QLoRA) for model.quantize: double quantisation, the compute dtype of the run's mixed
    precision, and the packed 4-bit weights stored in model.dtype (bnb_4bit_quant_storage) rather than uint8, so that
    FSDP2 shards them like every other parameter (with uint8 storage it crashed or trained with NaN gradients).

    The layers that stay unquantised (embeddings, LM head, norms) keep model.dtype: they are frozen under LoRA, so
    fp32 copies (peft's prepare_model_for_kbit_training) would buy no precision in an update and cost 2 bytes per
    parameter (0.54 GB on Mistral-7B); RMSNorm computes in fp32 internally either way."""
    need_bitsandbytes(f"model.quantize={cfg.quantize}", "")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.quantize, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype or DTYPES[cfg.dtype],
                              bnb_4bit_quant_storage=DTYPES[cfg.dtype])


def _keep_cpu_4bit_layout(model) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit layer for its inference kernel the first time the layer
    runs in eval mode on an input that needs no gradient (an eval, a generated sample), and keeps it repacked: the
    training after it would then run another kernel than the same training resumed from a checkpoint. Keep one
    layout for the whole run, so that resume stays exact (GPUs have no such repacking)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def check_flash_attention(cfg: ModelConfig, device=None) -> None:
    """model.attn_implementation=flash_attention_2 needs the flash-attn package and a CUDA device: transformers' own
    ImportError had come as a traceback once the run had started, after doctor had passed it (audit 49)."""
    import importlib.util

    if cfg.attn_implementation != "flash_attention_2":
        return
    # (transformers fetches a hub build of it through the kernels package where flash-attn is not installed)
    installed = any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "kernels"))
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if not (installed and on_cuda):
        raise LLMTrainError(
            "model.attn_implementation=flash_attention_2 needs the flash-attn package (or kernels, which fetches it "
            "from the hub) and a CUDA device (" + ("not installed: pip install flash-attn" if not installed else
                                                  "this run has no CUDA device") + "); "
            "set model.attn_implementation=auto (llmtrain's varlen attention: torch's flash varlen_attn on CUDA, "
            "without flash-attn).")


def attention_backend(cfg: ModelConfig) -> str:
    """The attn_implementation handed to transformers: 'auto' and 'varlen' mean llmtrain's varlen attention."""
    check_flash_attention(cfg)
    if cfg.varlen:
        from llmtrain.model import attention

        return attention.register()
    return cfg.attn_implementation


def describe_attention(cfg: ModelConfig, *, packed: bool, sinks: bool = False) -> str:
    """What the start-up line says about attention. `packed`: micro-batches are packed rows (batching.packs_rows);
    `sinks`: the model's attention has sinks (GPT-OSS's), which the varlen attention computes with an explicit softmax
    per example where flash varlen_attn does not run (the line had said SDPA, and a packed row's mask where none was
    packed; audit 58)."""
    from llmtrain.model import attention

    if not cfg.varlen:
        rows = "a packed row gets a block-diagonal mask" if packed else "each example a padded row"
        return f"{cfg.attn_implementation} (transformers; {rows})"
    kernel = ("flash varlen_attn in bf16/fp16" + (", rescaled by the sinks" if sinks else "")
              if attention.varlen_available() else
              "a softmax with the sinks per example" if sinks else "SDPA per example")
    return f"varlen ({kernel}, cost sum of l_i^2){' [auto]' if cfg.attn_implementation == 'auto' else ''}"


def use_liger(cfg: ModelConfig, device) -> bool:
    """liger-kernel's fused kernels: asked for (kernels=liger), or kernels=auto where installed and on CUDA."""
    import importlib.util

    if cfg.kernels == "none":
        return False
    on_cuda = torch.device(device or "cpu").type == "cuda"
    installed = importlib.util.find_spec("liger_kernel") is not None
    if cfg.kernels == "liger" and not (installed and on_cuda):
        raise LLMTrainError(
            "model.kernels=liger needs liger-kernel and a CUDA device (" + ("not installed: pip install "
            "'llmtrain[gpu]'" if not installed else "this run has no CUDA device") + "); set model.kernels=none or auto."
        )
    return installed and on_cuda


def _apply_liger(model) -> None:
    """RMSNorm, RoPE and the gated MLP (SwiGLU, or Gemma's GeGLU) from liger on this model instance; the loss keeps
    to loss.py (which uses liger's fused linear cross-entropy, see fused_linear_cross_entropy)."""
    import inspect

    from liger_kernel.transformers import monkey_patch

    patch = getattr(monkey_patch, f"apply_liger_kernel_to_{model.config.model_type}", None)
    if patch is None:
        raise LLMTrainError(f"liger-kernel has no kernels for model type '{model.config.model_type}'; "
                            "set model.kernels=none.")
    mlp = "geglu" if "geglu" in inspect.signature(patch).parameters else "swiglu"  # Gemma 3's MLP is a GeGLU
    patch(rope=True, rms_norm=True, **{mlp: True}, cross_entropy=False, fused_linear_cross_entropy=False,
          model=model)


def fused_linear_cross_entropy(cfg: ModelConfig, device):
    """liger's fused LM head + cross-entropy (summed) where liger is in use, else None (chunked loss)."""
    if not use_liger(cfg, device):
        return None
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(reduction="sum")


def compile_layers(model) -> int:
    """torch.compile each decoder layer (regional compilation): one small graph compiled once and reused by
    every layer, instead of the whole model. Returns the number of layers compiled."""
    from llmtrain.model.loss import causal_lm, decoder_layers

    layers = decoder_layers(causal_lm(model))
    for layer in layers:
        layer.compile()
    return len(layers)


def _uninitialised_parameters(model) -> None:
    """Give each parameter of a model built on the meta device its own uninitialised CPU storage.

    torch.empty only reserves address space: no page is written, so none becomes resident, and
    Accelerate's fsdp2_prepare_model moves the model back to meta before it loads the broadcast shards.
    The storage is needed at all because Accelerate maps the optimizer's parameters to their FSDP
    shards by `data_ptr()`, which is 0 for every meta tensor: on meta, all of them would map to one.
    Tied parameters (one object in two modules) stay tied.
    """
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]


def lora_problem(recipe, config) -> str | None:
    """What apply_lora refuses of the recipe's lora: on the model `config` describes (a target name no module of it
    has: a typo beside names that match; a modules_to_save or target_parameters name it lacks), found on the meta
    device before any weight is read: `llmtrain launch` and doctor say it, where each process had said it after the
    whole model loaded (audit 34). None: it adapts, there is no lora:, or the config builds no model here."""
    if recipe.lora is None:
        return None
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = copy.deepcopy(config)
    if recipe.reward_model is not None:
        config.num_labels = 1
    auto = AutoModelForSequenceClassification if recipe.reward_model is not None else AutoModelForCausalLM
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = auto.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    except Exception:  # noqa: BLE001 - a config transformers builds no model of here: the load says what it is
        return None
    try:
        apply_lora(model, recipe.lora, task="SEQ_CLS" if recipe.reward_model is not None else "CAUSAL_LM")
    except LLMTrainError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - what peft cannot do on the meta device: the processes find it as before
        return None
    return None


def apply_lora(model, cfg: LoraConfig, *, task: str = "CAUSAL_LM"):
    """LoRA adapters as lora: says. task SEQ_CLS (a reward model): peft also trains and saves the score head in full
    (modules_to_save), and all-linear leaves the head out of the adapted layers."""
    import peft

    # a tied model's embeddings and head trained in full (model.new_tokens): one copy, tied as the model ties them
    # (peft unties them otherwise, and a merge then keeps one of the two)
    tied = bool(set(cfg.modules_to_save or ()) & {"embed_tokens", "lm_head"}) and \
        getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        use_rslora=cfg.rslora,
        use_dora=cfg.dora,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        modules_to_save=list(cfg.modules_to_save) if cfg.modules_to_save else None,  # (peft extends its list)
        target_parameters=cfg.target_parameters,
        task_type=task,
        **({"ensure_weight_tying": True} if tied else {}),
    )
    try:
        with warnings.catch_warnings():
            experts_patterns_quiet()
            # said below in llmtrain's words, and refused (the run had gone on without those adapters)
            warnings.filterwarnings("ignore", r"target_parameters=.* were set but no parameter was matched",
                                    RuntimeWarning)
            # peft keeps the adapter weights in fp32 even on a bf16 base (autocast_adapter_dtype).
            model = peft.get_peft_model(model, config)
    except ValueError as e:
        if "lora_dropout" in str(e):  # peft's ParamWrapper (experts adapted as parameters): the key is lora.dropout
            raise LLMTrainError(f"lora.dropout={cfg.dropout:g}: {str(e).rstrip('.')} (the experts adapted as "
                                "parameters, lora.target_parameters or a mixture of experts' MLP). Set lora.dropout: "
                                "0.") from None
        keys = "lora.target_modules / lora.modules_to_save" + (
            " / lora.target_parameters" * bool(cfg.target_parameters))
        raise LLMTrainError(f"invalid LoRA settings ({keys}): "
                            f"{str(e).rstrip('.')}. "
                            f"{_linear_names(model)}") from None
    # peft refuses a list none of whose names matches, and adapts what the others match without a word where one
    # does not (a typo such as vproj beside q_proj): each name must match a module (peft's rule: the name itself or
    # the last parts of a module's dotted name)
    tuner = model.base_model  # (a mixture of experts' 3-D experts are adapted as parameters)
    saved = [n for n, m in model.named_modules() if isinstance(m, peft.utils.ModulesToSaveWrapper)]
    for key, names, hit, what in (
            ("lora.target_modules", cfg.target_modules if isinstance(cfg.target_modules, list) else [],
             [*tuner.targeted_module_names, *getattr(tuner, "targeted_parameter_names", [])],
             "no adapter would be put there"),
            ("lora.modules_to_save", cfg.modules_to_save or [], saved, "nothing would be trained in full"),
            ("lora.target_parameters", cfg.target_parameters or [], getattr(tuner, "targeted_parameter_names", []),
             "no adapter would be put there")):
        missed = [t for t in names if not any(k == t or k.endswith(f".{t}") for k in hit)]
        if key == "lora.target_modules" and (whole := [t for t in missed if any(
                k == t or k.endswith(f".{t}") for k in saved)]):  # a reward model's score head, peft's SEQ_CLS
            raise LLMTrainError(f"lora.target_modules names {', '.join(whole)}, which this model trains whole (peft "
                                "saves a sequence-classification head, a reward model's score, in full: "
                                "modules_to_save), so it cannot also take an adapter. Leave it out of "
                                "lora.target_modules: it trains in full whatever they name.")
        if missed:
            embeddings = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                 if isinstance(m, torch.nn.Embedding) and "lora_" not in n})
            also = (f" Its embeddings (which lora.modules_to_save may name too) are {', '.join(embeddings)}."
                    if key == "lora.modules_to_save" else "")
            if key == "lora.target_parameters":  # (peft's RuntimeWarning, and the run went on without them)
                raise LLMTrainError(f"{key} names {', '.join(missed)}, which no parameter of this model is called, so "
                                    f"{what}: give a parameter's dotted name or its last parts (GPT-OSS's and "
                                    "Qwen3-MoE's experts: mlp.experts.gate_up_proj, mlp.experts.down_proj)")
            raise LLMTrainError(f"{key} names {', '.join(missed)}, which no module of this model is called, so "
                                f"{what}. {_linear_names(model)}.{also}")
    lora_experts.install(model)  # adapted experts run their adapters beside the base experts, unmerged
    return model


def _linear_names(model) -> str:
    """What lora.target_modules may name, for its refusals."""
    linears = sorted({n.removesuffix(".base_layer").rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and "lora_" not in n  # (an adapted one: its base_layer)
                      and not n.endswith((".original_module", ".modules_to_save.default"))})  # (peft's copies)
    return (f"This {model.config.model_type} model's linear layers are named {', '.join(linears)} (Phi-3/Phi-4 fuse "
            "q/k/v into qkv_proj and gate/up into gate_up_proj); lora.target_modules: all-linear adapts each of them "
            "but the LM head")


def load_adapter(model, folder: str):
    """A saved LoRA adapter (peft's PeftModel.from_pretrained) on `model`, its adapted experts unmerged as apply_lora
    runs them (model/lora_experts.py)."""
    model = read_adapter(model, folder)
    lora_experts.install(model)
    return model


DAMAGED = ("SafetensorError", "HeaderTooLarge", "JSONDecodeError")  # what a truncated or damaged weights file raises


def damaged_text(folder, detail: str, *, what: str = "model files",
                 fix: str = "Download or copy the model again.") -> str:
    """The paragraph for weights that cannot be read: `detail` names the file and its error."""
    return f"the {what} in '{folder}' could not be read ({detail}): a weights file is truncated or damaged. {fix}"


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def experts_patterns_quiet() -> None:
    """Inside warnings.catch_warnings(): a mixture of experts' adapter, made or read. peft maps all-linear onto the
    experts' 3-D parameters itself and adds rank and alpha patterns for their fused gate_up_proj, which it then
    reports as matching no module and ignored, though it adapts them as parameters with those patterns (llmtrain sets
    none; reading final/ back, export and generate had printed the warning: audit 39)."""
    warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match any targeted "
                            r"module and were ignored: \['[^,]*gate_up_proj'\]", RuntimeWarning)


def read_adapter(model, folder: str):
    """PeftModel.from_pretrained(model, folder), an adapter folder without its weights file, or with a damaged one,
    refused in one paragraph (peft had read a missing file's folder as a hub id, and safetensors' header error had
    been a traceback: export, generate, an rl.rewards reward model)."""
    from peft import PeftModel

    if not any((Path(folder) / name).is_file() for name in ADAPTER_WEIGHTS):
        raise LLMTrainError(f"'{folder}' holds a LoRA adapter's adapter_config.json and no weights "
                            f"({' or '.join(ADAPTER_WEIGHTS)}): a half-copied folder. Copy it again from where the "
                            "run wrote it (a run's final/: or finish the run with --resume auto, which writes it).")
    with readable(folder, "LoRA adapter"), warnings.catch_warnings():
        experts_patterns_quiet()
        return PeftModel.from_pretrained(model, folder)


@contextmanager
def readable(folder, what: str):
    """A damaged weights file read inside the block, said in one paragraph naming `folder` and `what` it holds."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ not in DAMAGED:
            raise
        raise LLMTrainError(damaged_text(folder, f"{type(e).__name__}: {e}", what=what,
                                         fix="Copy the folder again from where it was written.")) from None


def dropout_off(model) -> None:
    """train.disable_dropout (TRL's disable_dropout_in_model): every nn.Dropout's p 0 (the input itself, no mask), and
    peft's lora_dropout modules nn.Identity, which is how peft itself holds a dropout of 0: DoRA takes its dropout
    branch for any other module, a second base matmul each forward that saves a copy of every adapted weight for
    backward (a DPO DoRA step 10% over its estimate, and Mistral-7B's without checkpointing 85 GiB where 71 were
    estimated; audit 35). The same numbers: the base's output is that matmul's. A config's attention dropout, which
    transformers' attention modules keep as a float (attention_dropout) and hand to the attention function, is 0 too
    (TRL's leaves it: a checkpoint with attention_dropout > 0 trained DPO with it)."""
    for module in list(model.modules()):
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
        if isinstance(drops := getattr(module, "lora_dropout", None), torch.nn.ModuleDict):
            for name in list(drops.keys()):
                drops[name] = torch.nn.Identity()


def numel(p) -> int:
    """The parameter's number of weights: a 4-bit bitsandbytes weight (Params4bit) packs them, and knows its shape."""
    state = getattr(p, "quant_state", None)
    return math.prod(state.shape) if state is not None else p.numel()


def unquantized_experts(model) -> tuple[int, int, torch.dtype | None]:
    """What a 4-bit base leaves whole of a mixture of experts: bitsandbytes quantizes linear layers, and transformers
    holds each layer's experts as 3-D parameters (all experts' gate_up_proj in one, down_proj in another), which stay
    in the dtype they were loaded in. Returns their weights, their bytes and that dtype; (0, 0, None) for a dense
    model or an unquantized base."""
    whole = [p for p in model.parameters() if p.ndim == 3 and not p.requires_grad
             and getattr(p, "quant_state", None) is None]
    if not whole or not any(getattr(p, "quant_state", None) is not None for p in model.parameters()):
        return 0, 0, None
    return sum(p.numel() for p in whole), sum(p.numel() * p.element_size() for p in whole), whole[0].dtype


def unadapted_experts(model) -> tuple[int, tuple[str, ...]]:
    """Under LoRA, a mixture of experts whose experts no adapter reaches (lora.target_modules maps onto GPT-OSS's and
    Gemma 4's 3-D expert parameters no adapter, as it does Qwen3-MoE's and Mixtral's): their weights, and their names
    in a decoder layer (what lora.target_parameters would name); (0, ()) where they are adapted, or there are none."""
    if any(hasattr(m, "parameter_name") for m in model.modules()):  # peft's ParamWrapper: an expert adapter
        return 0, ()
    experts = [(n, p) for n, p in model.named_parameters() if p.ndim == 3 and not p.requires_grad]
    names = tuple(dict.fromkeys(n.split(".layers.0.", 1)[1] for n, _ in experts if ".layers.0." in n))
    return (sum(p.numel() for _, p in experts), names) if names else (0, ())


def count_parameters(model) -> tuple[int, int]:
    total = sum(numel(p) for p in model.parameters())
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    return total, trainable


def compute_dtype(mixed_precision: str, device) -> torch.dtype | None:
    """The dtype a 4-bit base's layers compute in under train.mixed_precision (bitsandbytes' compute dtype; None: the
    model's dtype): bf16's and fp16's, but not fp16 on a CPU, where Accelerate runs no fp16 (neither autocast nor a
    loss scale) and the run computes in the model's dtype, as its warning says (the 4-bit layers had computed in fp16
    there, with no loss scale; audit 44)."""
    if mixed_precision == "fp16" and torch.device(device).type == "cpu":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)


def need_bitsandbytes(setting: str, alternative: str) -> None:
    """The one-line refusal of a setting that needs bitsandbytes where it is not installed."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise LLMTrainError(f"{setting} needs bitsandbytes: pip install 'llmtrain[qlora]'{alternative}.")


def build_optimizer(model, *, lr: float, weight_decay: float, betas, eps: float, fused: bool,
                    kind: str = "adamw", lora_lr_ratio: float | None = None, lora_lr_embedding: float = 1e-6):
    """AdamW (train.optimizer: torch's, or bitsandbytes' 8-bit one); no weight decay on biases and norm weights
    (every 1-D parameter). With LoRA+ (lora.lr_ratio) the groups are peft's create_loraplus_optimizer's: the B
    matrices and every trained 1-D parameter at lr x the ratio, LoRA's matrices on an embedding layer at
    lora.lr_embedding, the rest (the A matrices, modules_to_save's) at lr; each group named, the plain rate's first
    (the lr logged is group 0's). The 8-bit one keeps every embedding's moments in 32 bits (model/adamw_8bit.py)."""
    groups: dict[str, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim >= 2
        role, rate = ("decay", lr) if decay else ("no_decay", lr)
        if lora_lr_ratio is not None:
            if "lora_embedding_" in name:
                role, rate = "lora_embedding", lora_lr_embedding
            elif "lora_B" in name or not decay:
                role, rate = ("lora_B" if decay else "lora_B_no_decay"), lr * lora_lr_ratio
        group = groups.setdefault(role, {"params": [], "weight_decay": weight_decay if decay else 0.0, "lr": rate})
        group["params"].append(p)
    order = ["decay", "no_decay", "lora_B", "lora_B_no_decay", "lora_embedding"]
    groups = [({"name": role} if lora_lr_ratio is not None else {}) | groups[role] for role in order if role in groups]
    if kind == "adamw_8bit":
        need_bitsandbytes("train.optimizer=adamw_8bit", ", or set train.optimizer=adamw")
        from llmtrain.model.adamw_8bit import AdamW8bit  # bitsandbytes' own, and on sharded parameters

        # every embedding's moments in 32 bits, as HF Trainer's adamw_bnb_8bit and peft keep them (8-bit ones had put
        # a 10-step full fine-tune 1.3e-3 from HF's in the weights; audit 43)
        return AdamW8bit(groups, lr=lr, betas=tuple(betas), eps=eps, embeddings=lambda: embedding_ids(model))
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


def embedding_ids(model) -> list[int]:
    """The ids of every embedding's weight, and of the LM head's where it is tied to the embeddings (a pipeline's last
    stage holds it as a copy of its own, a Linear: its moments as the first stage's copy's, or the two would drift)."""
    ids = [id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    config = getattr(model, "config", None)
    if config is not None and getattr(config.get_text_config(), "tie_word_embeddings", False):
        head = model.get_output_embeddings()
        if isinstance(getattr(head, "weight", None), torch.Tensor):
            ids.append(id(head.weight))
    return ids


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier on the peak lr for the update at index `step` (0-based): linear warmup, then decay."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def build_scheduler(optimizer, tc, *, total_steps: int):
    """The lr schedule of train.* (warmup_steps, schedule, min_lr_ratio) over `total_steps` updates."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup=tc.warmup_steps, total=total_steps, schedule=tc.schedule, min_ratio=tc.min_lr_ratio))


def recipe_hyperparameters(scheduler) -> tuple[list[dict], list[float]]:
    """The optimizer's group settings (lr aside) and the schedule's base lrs as the recipe built them: taken before a
    checkpoint's state overwrites them (reapply_hyperparameters)."""
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in scheduler.optimizer.param_groups]
    return groups, list(scheduler.base_lrs)


def reapply_hyperparameters(scheduler, built: tuple[list[dict], list[float]]) -> None:
    """The recipe's group settings and base lrs (recipe_hyperparameters) again, over those a checkpoint restored:
    torch's Optimizer.load_state_dict takes every group setting (lr, weight_decay, betas, eps) from the saved groups and
    LambdaLR's its base lrs, so a change allowed at resume (--allow-recipe-change: train.lr, weight_decay, betas, eps)
    had been said and not trained with. The current lr is the schedule's at its restored step, as LambdaLR computes
    it: the same recipe's equal the checkpoint's bit for bit."""
    groups, base_lrs = built
    for group, settings in zip(scheduler.optimizer.param_groups, groups, strict=True):
        group.update(settings)
    scheduler.base_lrs = list(base_lrs)
    for group, base, factor in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]

