"""The accelerate launch config: which of its settings llmtrain honours, checked before any process starts.

`accelerate launch` quietly ignores a key it does not know (`parallelism_config_pp_size: 2` trains plain FSDP), and a
setting it knows but llmtrain does not follow (DeepSpeed, its own activation checkpointing or torch.compile) would
train something else than the recipe says. `unhonoured` names each such setting with the reason and the fix. Three
places ask it: `llmtrain doctor --accelerate-config`, `llmtrain launch` (before `accelerate launch` starts a process),
and every process of `finetune` (which finds its launch in the command line of the `accelerate launch` that started
it: the flags it was given and its config file).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.layout import fsdp_flag

# distributed_type values llmtrain trains (the others run another engine, or a device it is not tested on)
DISTRIBUTED = {"NO", "MULTI_GPU", "MULTI_CPU", "FSDP"}
# parallelism_config keys accelerate 1.15 knows; llmtrain honours the first three (cp/sp above 1 are refused by
# layout.Layout with their own reason), the others only matter with cp or sp above 1.
MESH_KEYS = {"dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "cp_backend", "cp_comm_strategy",
             "sp_backend", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"}
NOT_IMPLEMENTED = {"ep": "expert parallelism"}  # what an unknown size key asks for (pp: the recipe's pipeline)
# fsdp_config keys accelerate 1.15 knows (the FSDP1-only ones are harmless under fsdp_version 2)
FSDP_KEYS = {"fsdp_version", "fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy",
             "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
             "fsdp_backward_prefetch", "fsdp_state_dict_type", "fsdp_forward_prefetch", "fsdp_use_orig_params",
             "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states", "fsdp_activation_checkpointing",
             "fsdp_activation_checkpointing_offload"}
# Top-level keys of accelerate's ClusterConfig that only say how to start the processes (or are checked below)
PLUMBING = {"compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
            "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
            "same_network", "main_training_function", "enable_cpu_affinity", "downcast_bf16", "tpu_name", "tpu_zone",
            "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env", "mpirun_config",
            "fsdp_config", "parallelism_config", "dynamo_config", "deepspeed_config", "megatron_lm_config",
            "fp8_config"}
# launch_settings' note of what `accelerate launch` would drop from the flags it was given (not a YAML key)
DROPPED = "(dropped by accelerate launch)"
# FSDP1's sharding strategies, each with its FSDP2 launch (accelerate reads the key only under fsdp_version 1)
SHARDING_UNDER_FSDP2 = {
    "HYBRID_SHARD": "a parallelism_config mesh of replicas x shards (accelerate_configs/hsdp_multinode.yaml)",
    "_HYBRID_SHARD_ZERO2": "a parallelism_config mesh of replicas x shards (accelerate_configs/hsdp_multinode.yaml) "
                           "with fsdp_reshard_after_forward: false",
    "SHARD_GRAD_OP": "fsdp_reshard_after_forward: false",
    "NO_SHARD": "plain data parallelism (accelerate_configs/ddp.yaml)",
}


def _off(value) -> bool:
    """A setting that asks for nothing: absent, empty, false, 1 (a size) or accelerate's 'NO'."""
    return value is not True and value in (None, {}, [], "", False, 1, "1", "false", "False", "no", "NO", "none",
                                           "None")


def unhonoured(launch: dict) -> list[str]:
    """One sentence for each setting of the launch config (a dict as its YAML reads) that llmtrain would not follow."""
    problems = []
    kind = str(launch.get("distributed_type", "NO"))
    if kind not in DISTRIBUTED:
        problems.append(f"distributed_type: {kind} is not trained by llmtrain (it runs DDP, FSDP2 and HSDP through "
                        "torch's own collectives): use accelerate_configs/ddp.yaml or fsdp.yaml")
    if str(launch.get("compute_environment", "LOCAL_MACHINE")) != "LOCAL_MACHINE":
        problems.append(f"compute_environment: {launch['compute_environment']} is not supported: use LOCAL_MACHINE "
                        "(on a cluster, run the same command on each node, as docs/launch.md shows)")
    problems += launch.get(DROPPED, [])
    procs = int(launch.get("num_processes") or 1)
    if kind == "MULTI_CPU" and procs > 1 and not (launch.get("mpirun_config") or {}).get("mpirun_hostfile"):
        problems.append(f"distributed_type: MULTI_CPU starts one process without an mpirun hostfile (accelerate's "
                        f"simple launcher), not the {procs} of num_processes: use accelerate_configs/cpu_ddp.yaml "
                        "(MULTI_GPU with use_cpu: true, torchrun's processes) or cpu_fsdp.yaml")
    if kind == "NO" and "distributed_type" in launch and procs > 1:  # (audit 34: checked as DDP, trained alone)
        problems.append(f"distributed_type: NO starts one process (accelerate's simple launcher), not the {procs} of "
                        "num_processes: use distributed_type: MULTI_GPU (accelerate_configs/ddp.yaml; on a CPU "
                        "cpu_ddp.yaml, with use_cpu: true) or FSDP (fsdp.yaml)")
    for key in sorted(set(launch) - PLUMBING - {DROPPED}):
        problems.append(f"{key} is not a setting of accelerate's launch config{_spelt(key, PLUMBING)}: remove it "
                        "(or check its spelling)")
    for section, fix in (("deepspeed_config", "llmtrain shards with FSDP2: use accelerate_configs/fsdp.yaml"),
                         ("megatron_lm_config", "llmtrain's tensor parallelism is parallelism_config_tp_size"),
                         ("fp8_config", "llmtrain's precision is the recipe's train.mixed_precision (bf16, fp16, no)")):
        if not _off(launch.get(section)):
            problems.append(f"{section} is not honoured by llmtrain: {fix}")
    dynamo = launch.get("dynamo_config") or {}
    if not _off(dynamo.get("dynamo_backend")):
        problems.append(f"dynamo_config's dynamo_backend: {dynamo['dynamo_backend']} would compile the model behind "
                        "llmtrain's back: set model.compile=true in the recipe instead and remove dynamo_config")
    problems += _fsdp_problems(launch.get("fsdp_config") or {}, fsdp_on=kind == "FSDP")
    if kind == "FSDP" and not _off(launch.get("use_cpu")) and fsdp_flag(launch, "fsdp_offload_params", False):
        problems.append("fsdp_config's fsdp_offload_params: true moves the shards to pinned host memory for a GPU to "
                        "read, and this is a CPU launch (use_cpu: true), where torch has no accelerator to pin for: "
                        "set fsdp_offload_params: false (on the CPU the shards are in host memory already)")
    problems += _mesh_problems(launch.get("parallelism_config") or {})
    return problems


def _fsdp_problems(fsdp: dict, *, fsdp_on: bool) -> list[str]:
    problems = [f"fsdp_config's {key} is not a setting accelerate knows{_spelt(key, FSDP_KEYS)}: remove it (or check "
                "its spelling)" for key in sorted(set(fsdp) - FSDP_KEYS)]
    if not fsdp_on:
        return problems
    if "fsdp_version" not in fsdp:
        problems.append("fsdp_config has no fsdp_version, so accelerate would shard with FSDP1: llmtrain shards with "
                        "FSDP2, add fsdp_version: 2")
    elif str(fsdp["fsdp_version"]) != "2":
        problems.append(f"fsdp_config's fsdp_version: {fsdp['fsdp_version']} is not supported: llmtrain shards with "
                        "FSDP2, set fsdp_version: 2")
    if not _off(fsdp.get("fsdp_activation_checkpointing")):
        problems.append("fsdp_config's fsdp_activation_checkpointing: true would wrap the layers a second time: set it "
                        "false and turn on model.gradient_checkpointing in the recipe")
    if str(fsdp.get("fsdp_version", "2")) != "2":
        return problems
    strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper().split(".")[-1]
    if strategy not in ("FULL_SHARD", "1"):  # (ignored by accelerate under FSDP2: every GPU shards, without a word)
        problems.append(f"fsdp_config's fsdp_sharding_strategy: {fsdp['fsdp_sharding_strategy']} is FSDP1's, which "
                        "accelerate ignores under fsdp_version 2 (the run would shard over every GPU): "
                        + (f"for it under FSDP2 use {SHARDING_UNDER_FSDP2[strategy]}, and remove the key"
                           if strategy in SHARDING_UNDER_FSDP2 else "remove the key"))
    reshard = fsdp.get("fsdp_reshard_after_forward", True)
    if str(reshard).lower() not in ("true", "false"):  # (accelerate's "invalid truth value" in every process)
        fix = " (SHARD_GRAD_OP's is false)" if str(reshard).upper() == "SHARD_GRAD_OP" else ""
        problems.append(f"fsdp_config's fsdp_reshard_after_forward: {reshard} is an FSDP1 sharding strategy's name; "
                        f"under fsdp_version 2 it is true or false{fix}: set true (free each layer's gathered weights "
                        "after its forward) or false (keep them until its backward)")
    state_dict = str(fsdp.get("fsdp_state_dict_type", "SHARDED_STATE_DICT")).upper().split(".")[-1]
    if state_dict != "SHARDED_STATE_DICT":  # (the processes refused it, each after starting: accelerator.py)
        problems.append(f"fsdp_config's fsdp_state_dict_type: {fsdp['fsdp_state_dict_type']}: llmtrain's FSDP "
                        "checkpoints are sharded (every rank writes its own shard, nothing is gathered), so set "
                        "fsdp_state_dict_type: SHARDED_STATE_DICT (final/ is still exported as one full model)")
    return problems


def _mesh_problems(mesh: dict) -> list[str]:
    problems = []
    for key in sorted(mesh):
        name = key.removeprefix("parallelism_config_")
        if name in MESH_KEYS or _off(mesh[key]):
            continue
        kind = name.removesuffix("_size")
        if kind == "pp":
            problems.append(f"parallelism_config_pp_size: {mesh[key]} asks accelerate for pipeline parallelism, which "
                            "it does not implement (it would ignore the key and train the rest of the layout without "
                            f"a word); llmtrain's is the recipe's parallel.pipeline_parallel: {mesh[key]} on a plain "
                            "DDP or FSDP launch (docs/pipeline-parallel.md): remove the key and set that")
            continue
        asks = (f"asks for {NOT_IMPLEMENTED[kind]}, which neither llmtrain nor accelerate implements"
                if kind in NOT_IMPLEMENTED else
                f"is not a key accelerate knows{_spelt(key, {'parallelism_config_' + k for k in MESH_KEYS})}")
        problems.append(f"parallelism_config_{name}: {mesh[key]} {asks}; accelerate ignores it and the run would "
                        "train the rest of the layout without a word: remove it")
    return problems


def _spelt(key: str, known) -> str:
    """' (did you mean KEY?)' for the known key nearest a misspelt one, or ''."""
    import difflib

    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


def launch_problem(launch: dict, *, where: str) -> str | None:
    """A launch config's settings llmtrain does not honour, all of them in one paragraph; None if there are none."""
    problems = unhonoured(launch)
    return f"{where} asks for what llmtrain does not do: {'; '.join(problems)}." if problems else None


def check_launch(launch: dict, *, where: str) -> None:
    """Refuse a launch config with settings llmtrain does not honour (launch_problem)."""
    if problem := launch_problem(launch, where=where):
        raise LLMTrainError(problem)


# --------------------------------------------------------------------------- the launch, from its command line


def accelerate_problem(argv: list[str], *, where: str) -> str | None:
    """What `accelerate launch ARGV` itself would refuse once llmtrain's checks had passed (its own
    _validate_launch_command's ValueError, a traceback: a config file without num_processes, two distributed flags,
    --multi_gpu with one process), or start otherwise than the checks took it: one process (its simple launcher, with
    no distributed flag or type, or --cpu) where num_processes asks for more (audit 34). Its own checks, run on ARGV
    as it will run them (on this machine: without a config file, its GPUs decide); None where it would launch."""
    import logging

    from accelerate.commands import launch as accelerate_launch

    validate = getattr(accelerate_launch, "_validate_launch_command", None)
    if validate is None:  # (another accelerate: its launch says it)
        return None
    args = accelerate_launch.launch_command_parser().parse_args(argv)
    logging.disable(logging.WARNING)  # its note of the defaults it filled in: accelerate launch gives it
    try:
        args = validate(args)[0]
    except ValueError as e:
        hint = " (num_processes: N in the file, or --num_processes N)" if "num_processes" in str(e) else ""
        return f"{where} is refused by accelerate launch itself: {str(e).strip()}{hint}"
    finally:
        logging.disable(logging.NOTSET)
    distributed = any(getattr(args, k, False) for k in ("use_deepspeed", "use_fsdp", "use_megatron_lm", "multi_gpu",
                                                          "tpu"))
    if (args.cpu or not distributed) and (args.num_processes or 1) > 1:
        return (f"{where} asks for {args.num_processes} processes, and accelerate launch would start one (its simple "
                "launcher: no distributed type, as a machine without GPUs has it when no config file says one): "
                "give a config file with distributed_type: MULTI_GPU (accelerate_configs/ddp.yaml; on a CPU "
                "cpu_ddp.yaml, with use_cpu: true) or FSDP (fsdp.yaml, cpu_fsdp.yaml)")
    return None


def gpus_problem(launch: dict, *, where: str, gpus: int) -> str | None:
    """Why this machine cannot run the launch's processes one a GPU (None: it can, or the launch is a CPU one,
    use_cpu). Accelerate would start them all the same, on the CPU: an 8-process 7B run then fails minutes later in
    every process at once, or crawls."""
    if launch.get("use_cpu"):
        return None
    per_node = int(launch.get("num_processes") or 1) // max(int(launch.get("num_machines") or 1), 1)
    if gpus >= per_node:
        return None
    have = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "no GPU (torch sees no CUDA device)"
    need = f"are {per_node} GPUs" if per_node != 1 else "is 1 GPU"
    # (no config file: accelerate's defaults, which the user never wrote, had been named as "use_cpu is not set";
    # audit 36)
    what = "without a config file, accelerate launch's defaults" if not launch else where
    return (f"{what} start{'s' if launch else ''} {per_node} process{'es' if per_node != 1 else ''} on this machine, "
            f"one a GPU (use_cpu is not set), and this machine has {have}. Run it where there {need}"
            + (f", lower --num_processes to {gpus}" if gpus else "") + ", or on this CPU: "
            # --cpu beside a config file of several processes is refused (launch_problem): one process is finetune's
            + ("--cpu" if not launch else "`llmtrain finetune RECIPE.yaml`") + " (one process, the recipe's global "
            "batch), or a CPU config (accelerate_configs/cpu_ddp.yaml or cpu_fsdp.yaml: use_cpu: true; their 2 "
            "processes double the global batch)")


def read_launch_file(path, *, name: str) -> dict:
    """An accelerate launch config's YAML as a dict; `name` says it in the error (the option or file it came from)."""
    import yaml

    try:
        launch = yaml.safe_load(Path(path).read_text()) or {}
    except UnicodeDecodeError:  # (a traceback: the review of audit 51's reader)
        raise LLMTrainError(f"{name} is not UTF-8 text: save it as UTF-8 (accelerate_configs/ has one a layout: "
                            "ddp.yaml, fsdp.yaml, ...).") from None
    except OSError as e:
        raise LLMTrainError(f"cannot read {name}: {e.strerror or e}. Give the path of an accelerate config file "
                            "(accelerate_configs/ has one a layout: ddp.yaml, fsdp.yaml, ...; `accelerate config` "
                            "writes one).") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise LLMTrainError(f"{name} is not valid YAML{where}: {getattr(e, 'problem', None) or e}. Fix it there, or "
                            "start from one of accelerate_configs/ (ddp.yaml, fsdp.yaml, ...).") from None
    if not isinstance(launch, dict):
        raise LLMTrainError(f"{name} must be a mapping (distributed_type, num_processes, ...).")
    return launch


def launch_settings(argv: list[str]) -> tuple[dict, str]:
    """The launch config that `accelerate launch ARGV` runs with, as a dict shaped as its YAML (the config file, or
    accelerate's default one, with the command line's flags over it), and where it came from. Parsed with
    accelerate's own parser."""
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    args = parser.parse_args(argv)
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    launch = read_launch_file(path, name=f"the accelerate config {path}") if path is not None else {}
    for action in parser._actions:  # a flag's default is not a value given: `--parallelism_config_dp_shard_size 1`
        action.default = argparse.SUPPRESS  # is, and wins over the config file's 2, as accelerate launch has it
    given = vars(parser.parse_args(argv))
    file_mesh = bool(launch.get("parallelism_config"))
    flags = False  # a setting of the layout given on the command line (the messages then name both)
    for action in parser._actions:  # the flags given: each over the config's value
        value = given.get(action.dest)
        if action.dest in ("help", "config_file", "training_script", "training_script_args", "module",
                           "no_python") or action.dest not in given or value is None:
            continue
        flags = True
        if action.dest.startswith("parallelism_config_"):
            launch.setdefault("parallelism_config", {})[action.dest] = value
        elif action.dest.startswith("fsdp_"):
            launch.setdefault("fsdp_config", {})[action.dest] = value
        elif action.dest.startswith("dynamo_"):
            launch.setdefault("dynamo_config", {})[action.dest] = value
        elif action.dest in ("use_deepspeed", "use_megatron_lm", "use_fsdp", "multi_gpu", "tpu"):
            kind = {"use_deepspeed": "DEEPSPEED", "use_megatron_lm": "MEGATRON_LM", "use_fsdp": "FSDP",
                    "multi_gpu": "MULTI_GPU", "tpu": "XLA"}[action.dest]
            launch["distributed_type"] = kind
        elif action.dest == "cpu" and value:
            launch["use_cpu"] = True
        elif action.dest in PLUMBING:
            launch[action.dest] = value
    dropped = _dropped_by_accelerate(launch, given, file_mesh=file_mesh, from_file=path is not None)
    if dropped:
        launch[DROPPED] = dropped
    where = f"the accelerate config {path}" if path else "the accelerate launch"
    return launch, f"{where} with the command line's flags" if flags and path else where


def _dropped_by_accelerate(launch: dict, given: dict, *, file_mesh: bool, from_file: bool) -> list[str]:
    """What `accelerate launch` would drop of the flags given (accelerate 1.15's _validate_launch_command and
    launch_command): the mesh where it does not use a parallelism_config (it does with --use_parallelism_config, or
    with a config file's section and no --use_fsdp / --multi_gpu / ... flag), and the processes under --cpu (its
    simple launcher starts one)."""
    out = []
    kinds = [f"--{k}" for k in ("use_fsdp", "multi_gpu", "use_deepspeed", "use_megatron_lm", "tpu", "tpu_use_cluster")
             if given.get(k)]
    uses_mesh = bool(given.get("use_parallelism_config")) or (from_file and file_mesh and not kinds)
    mesh_flags = [f"--{k} {v}" for k, v in given.items() if k.startswith("parallelism_config_") and v is not None]
    if launch.get("parallelism_config") and not uses_mesh:
        if file_mesh:
            out.append(f"{' '.join(kinds)} makes accelerate launch drop the config file's parallelism_config section "
                       "(it reads the section only when no --use_fsdp, --multi_gpu or other distributed flag is "
                       "given), so the run would train without the mesh: leave "
                       f"{'it' if len(kinds) == 1 else 'them'} out (the file's distributed_type is the launch's), or "
                       "add --use_parallelism_config")
        else:
            out.append(f"{' '.join(mesh_flags)}: accelerate launch reads the mesh flags only for a config file with a "
                       "parallelism_config section (or with --use_fsdp --use_parallelism_config), and this launch has "
                       "none, so the run would train without the mesh: add a parallelism_config section to the config "
                       "(accelerate_configs/hsdp_multinode.yaml and fsdp_tp.yaml have one), or pass --use_fsdp "
                       "--use_parallelism_config")
    procs = int(launch.get("num_processes") or 1)
    if given.get("cpu") and procs > 1 and not (launch.get("mpirun_config") or {}).get("mpirun_hostfile"):
        out.append(f"--cpu makes accelerate launch start one process (its simple launcher), not the {procs} of "
                   "num_processes: leave --cpu out and launch a CPU config (use_cpu: true: accelerate_configs/"
                   "cpu_ddp.yaml or cpu_fsdp.yaml)")
    return out


def parent_launch() -> list[str] | None:
    """The arguments of the `accelerate launch` that started this process (its parent: torchrun's agent runs inside
    it; `llmtrain launch` runs it as llmtrain.launcher), or None where there is none or it cannot be read (not
    Linux, another launcher)."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in argv if a]
    for i, arg in enumerate(argv):
        if arg in ("accelerate.commands.launch", "llmtrain.launcher") or (  # llmtrain.launcher: llmtrain launch's
                arg == "launch" and i and argv[i - 1].endswith("accelerate")):
            return argv[i + 1:]
    return None


def check_parent_launch() -> None:
    """In a process of `accelerate launch`: refuse the launch's unhonoured settings (see the module's docstring)."""
    argv = parent_launch()
    if argv is None:
        return
    try:
        launch, where = launch_settings(argv)
    except SystemExit:  # accelerate's parser refused it: accelerate launch itself did not, so it is not this one
        return
    check_launch(launch, where=where)
