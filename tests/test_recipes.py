"""Every shipped recipe validates and says how to launch it; every launch config loads in Accelerate.

Parametrized over the globs, so a new recipes/*.yaml or accelerate_configs/*.yaml is covered with no edit.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import GSM8K, MISTRAL, needs

from llmtrain.config import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
LAUNCH_CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
GPU_CONFIGS = ["single_gpu.yaml", "ddp.yaml", "fsdp.yaml", "fsdp_multinode.yaml"]


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def _header(path: Path) -> str:
    """The leading comment block of a YAML file, without the '#'s, lines re-joined across '\\'."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return re.sub(r"\\\s+", " ", "\n".join(lines))


def test_the_globs_find_the_shipped_files():
    names = {p.name for p in RECIPES}
    assert {"tiny.yaml", "llama7b.yaml", "llama7b-lora.yaml", "mistral7b-lora.yaml", "mistral7b-full.yaml"} <= names
    assert {"cpu_ddp.yaml", *GPU_CONFIGS} <= {p.name for p in LAUNCH_CONFIGS}


# --------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_recipe_validates(path: Path):
    recipe = load_recipe(path)
    assert recipe.output_dir == f"runs/{path.stem}"


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_recipe_header_gives_its_launch_command(path: Path):
    header = _header(path)
    rel = f"recipes/{path.name}"
    commands = re.findall(r"(?:accelerate launch|llmtrain finetune)[^\n]*", header)
    assert any(rel in c for c in commands), f"{rel}: the header comment must show how to run it"
    # Every launch config a header names must exist.
    for cfg in re.findall(r"--config_file (\S+)", header):
        assert (REPO / cfg).is_file(), f"{rel} names {cfg}, which does not exist"


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_recipe_precision_is_consistent(path: Path):
    recipe = load_recipe(path)
    if recipe.lora is None and recipe.train.mixed_precision != "no":
        # A full fine-tune under autocast keeps fp32 master weights.
        assert recipe.model.dtype == "float32"
    if recipe.train.mixed_precision == "no":
        assert recipe.model.dtype == "float32"


@pytest.mark.parametrize("name", ["llama7b.yaml", "mistral7b-full.yaml"])
def test_full_7b_recipes_are_fsdp_bf16(name: str):
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.lora is None
    assert recipe.train.mixed_precision == "bf16" and recipe.model.dtype == "float32"
    assert recipe.model.gradient_checkpointing
    assert "--config_file accelerate_configs/fsdp.yaml" in _header(REPO / "recipes" / name)


@pytest.mark.parametrize("name", ["llama7b-lora.yaml", "mistral7b-lora.yaml"])
def test_lora_7b_recipes_use_a_bf16_base(name: str):
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.lora is not None and recipe.lora.r == 16
    assert recipe.model.dtype == "bfloat16" and recipe.train.mixed_precision == "bf16"
    assert "--config_file accelerate_configs/single_gpu.yaml" in _header(REPO / "recipes" / name)


HUB_MODELS = {"llama7b.yaml": "meta-llama/Llama-2-7b-hf", "llama7b-lora.yaml": "meta-llama/Llama-2-7b-hf",
              "mistral7b-full.yaml": "mistralai/Mistral-7B-Instruct-v0.3",
              "mistral7b-lora.yaml": "mistralai/Mistral-7B-Instruct-v0.3"}


@pytest.mark.parametrize("name", sorted(HUB_MODELS))
def test_7b_recipes_read_the_hub_and_say_what_they_need(name: str):
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.model.name_or_path == HUB_MODELS[name]
    d = recipe.data
    assert (d.path, d.name, d.split, d.format) == ("openai/gsm8k", "main", "train", "prompt_completion")
    assert d.fields == {"prompt": "question", "completion": "answer"}
    assert (d.eval_split, d.eval_max_examples) == ("test", 200)
    # the instruct model is trained as it is prompted; the base model has no chat template
    assert d.chat_template is name.startswith("mistral")
    header = " ".join(_header(REPO / "recipes" / name).split())
    launch = "single_gpu" if recipe.lora else "fsdp"
    assert re.search(rf"~\d+ GiB (each )?\(estimated by `llmtrain estimate-memory recipes/{name} "
                     rf"--accelerate-config accelerate_configs/{launch}.yaml`\)", header), header
    assert "measured" not in header  # nothing here was measured on a GPU


@needs(MISTRAL)
@needs(GSM8K)
@pytest.mark.parametrize("name", sorted(HUB_MODELS))
def test_7b_recipe_data_with_local_copies(name: str, tmp_path):
    """The recipes with the paths overridden to local copies, as their headers say: a GSM8K folder with
    train.jsonl and test.jsonl keeps eval_split=test. The Mistral tokenizer stands in for Llama-2's (the same
    SentencePiece family; the Llama recipes use no chat template)."""
    import json

    from transformers import AutoTokenizer

    from llmtrain.data.formats import IGNORE
    from llmtrain.data.prepare import prepare_datasets

    folder = tmp_path / "gsm8k"
    folder.mkdir()
    for split, n in (("train", 12), ("test", 300)):
        lines = (GSM8K / f"{split}.jsonl").read_text().splitlines()[:n]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    recipe = load_recipe(REPO / "recipes" / name, [f"model.name_or_path={MISTRAL}", f"data.path={folder}",
                                                   "data.name=null", f"data.cache_dir={tmp_path / 'cache'}"])
    tok = AutoTokenizer.from_pretrained(MISTRAL)
    train, evald, stats, _ = prepare_datasets(recipe.data, tok, seed=recipe.train.seed)
    assert (len(train), len(evald), stats["eval"].examples) == (12, 200, 200)  # the test split, capped
    first = json.loads((folder / "train.jsonl").read_text().splitlines()[0])
    ids, labels = train["input_ids"][0], train["labels"][0]
    k = next(i for i, lab in enumerate(labels) if lab != IGNORE)
    assert labels[k:] == ids[k:] and ids[-1] == tok.eos_token_id
    if recipe.data.chat_template:
        assert tok.decode(ids[:k]) == f"<s>[INST] {first['question']}[/INST]"
    else:
        assert tok.decode(ids[:k]) == f"<s> {first['question']}"
    assert tok.decode(ids[k:]).strip() == first["answer"] + "</s>"


def test_tiny_recipe_points_at_prepare_tiny_output():
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml")
    assert recipe.model.name_or_path == "assets/tiny/model"
    assert recipe.data.path == "assets/tiny/data/train.jsonl"
    assert recipe.data.eval_split == "assets/tiny/data/eval.jsonl"
    assert recipe.data.format == "prompt_completion"
    assert recipe.train.mixed_precision == "no" and recipe.model.dtype == "float32"
    assert recipe.checkpoint.keep_last == 2 and recipe.checkpoint.every_steps
    header = _header(REPO / "recipes" / "tiny.yaml")
    assert "llmtrain prepare-tiny" in header
    assert "accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m llmtrain finetune recipes/tiny.yaml" in header


# --------------------------------------------------------------------------- accelerate launch configs


def _load_launch_config(path: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(path))  # Accelerate's own loader: unknown keys raise


@pytest.mark.parametrize("path", LAUNCH_CONFIGS, ids=_ids(LAUNCH_CONFIGS))
def test_launch_config_loads_in_accelerate(path: Path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment

    cfg = _load_launch_config(path)
    assert isinstance(cfg, ClusterConfig)
    assert cfg.compute_environment == ComputeEnvironment.LOCAL_MACHINE
    assert cfg.num_processes >= 1 and cfg.num_machines >= 1
    assert cfg.num_processes % cfg.num_machines == 0
    assert cfg.mixed_precision in {"no", "bf16"}
    assert "accelerate launch" in _header(path)


def _launch_env(path: Path) -> tuple[object, dict[str, str]]:
    """What `accelerate launch --config_file PATH` would resolve and put into the workers' environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "llmtrain", "finetune", "x.yaml"])
    args, _, _ = _validate_launch_command(args)
    if args.main_process_port in (None, 0):
        args.main_process_port = 29500
    env = prepare_multi_gpu_env(args) if (args.multi_gpu or args.use_fsdp) else {}
    return args, env


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_launch_configs_use_bf16(name: str):
    cfg = _load_launch_config(REPO / "accelerate_configs" / name)
    assert cfg.mixed_precision == "bf16" and not cfg.use_cpu


@pytest.mark.parametrize("name", ["fsdp.yaml", "fsdp_multinode.yaml"])
def test_fsdp_configs_are_fsdp2_full_shard(name: str, monkeypatch):
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    path = REPO / "accelerate_configs" / name
    cfg = _load_launch_config(path)
    assert cfg.distributed_type == DistributedType.FSDP
    fsdp = cfg.fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is True
    assert fsdp["fsdp_sync_module_states"] is True
    # No class list: accelerate wraps the model's own `_no_split_modules` (LlamaDecoderLayer,
    # MistralDecoderLayer), so one config serves both families; a class absent from the model would raise.
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp

    # The launcher accepts it and the plugin the workers build from its environment is FSDP2.
    args, env = _launch_env(path)
    assert args.use_fsdp and args.num_processes == cfg.num_processes
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert plugin.cpu_ram_efficient_loading is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.auto_wrap_policy is not None and plugin.transformer_cls_names_to_wrap is None


def test_single_node_layouts():
    from accelerate.utils import DistributedType

    single = _load_launch_config(REPO / "accelerate_configs" / "single_gpu.yaml")
    assert single.distributed_type == DistributedType.NO and single.num_processes == 1
    ddp = _load_launch_config(REPO / "accelerate_configs" / "ddp.yaml")
    assert ddp.distributed_type == DistributedType.MULTI_GPU and ddp.num_processes == 8 and ddp.num_machines == 1
    fsdp = _load_launch_config(REPO / "accelerate_configs" / "fsdp.yaml")
    assert fsdp.num_processes == 8 and fsdp.num_machines == 1


def test_multinode_config_is_two_by_eight():
    cfg = _load_launch_config(REPO / "accelerate_configs" / "fsdp_multinode.yaml")
    assert cfg.num_machines == 2 and cfg.num_processes == 16
    assert cfg.main_process_ip and cfg.main_process_port
    assert "--machine_rank" in _header(REPO / "accelerate_configs" / "fsdp_multinode.yaml")


def test_cpu_ddp_starts_two_cpu_workers():
    cfg = _load_launch_config(REPO / "accelerate_configs" / "cpu_ddp.yaml")
    assert cfg.use_cpu and cfg.num_processes == 2 and cfg.mixed_precision == "no"
    # MULTI_CPU would make `accelerate launch` start one process (it expects mpirun); the torchrun
    # launcher starts both, and llmtrain's Accelerator(cpu=True) joins them over gloo.
    args, _ = _launch_env(REPO / "accelerate_configs" / "cpu_ddp.yaml")
    assert args.multi_gpu and args.num_processes == 2


@pytest.mark.slow
def test_cpu_ddp_joins_two_processes(tmp_path, free_port):
    """`accelerate launch` with cpu_ddp.yaml really starts 2 workers in one gloo group."""
    import subprocess
    import sys

    script = tmp_path / "who.py"
    script.write_text(
        "from accelerate import Accelerator\n"
        "import sys\n"
        "from pathlib import Path\n"
        "a = Accelerator(cpu=True)\n"
        "Path(sys.argv[1], f'rank{a.process_index}').write_text(f'{a.num_processes} {a.distributed_type.value}')\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--main_process_port", str(free_port), str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # Each worker writes its own file (their stdout lines interleave).
    assert {p.name: p.read_text() for p in tmp_path.glob("rank*")} == {"rank0": "2 MULTI_CPU", "rank1": "2 MULTI_CPU"}


def test_launch_configs_are_plain_yaml_mappings():
    for path in LAUNCH_CONFIGS:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path


@pytest.mark.parametrize("path", sorted(p for p in RECIPES if "GiB" in _header(p)), ids=lambda p: p.name)
def test_recipe_header_estimate_is_what_the_tool_prints_for_its_launch(path: Path):
    """A header's "~N GiB (estimated by `llmtrain estimate-memory recipes/X --accelerate-config Y`)" is the tool's
    per-GPU peak for that recipe and launch, rounded; and without --accelerate-config the tool reads the launch from
    the header, so `estimate-memory recipes/X` alone says the same."""
    from llmtrain.memory.cli import header_launch
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.launch import read_accelerate_config
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    header = " ".join(_header(path).split())
    found = re.search(r"~(\d+) GiB (?:each )?\(estimated by `llmtrain estimate-memory (\S+) --accelerate-config (\S+)`",
                      header)
    assert found, header
    said, named, launch = int(found.group(1)), found.group(2), found.group(3)
    assert named == f"recipes/{path.name}"
    assert header_launch(path).resolve() == (REPO / launch).resolve()  # what the tool reads without the option
    recipe, lay = load_recipe(path), read_accelerate_config(REPO / launch)  # as estimate-memory does
    spec = spec_from_recipe(recipe, gpu_memory_gib=80.0, **lay.estimate_layout())
    got = estimate(load_model_shape(recipe.model.name_or_path), spec).per_gpu_peak_bytes / 2**30
    assert round(got) == said, got
