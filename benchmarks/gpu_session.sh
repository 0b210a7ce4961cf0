#!/usr/bin/env bash
# The GPU issue's measurements on one H100, batched into calls of under 10 minutes that write JSON lines
# under $OUT (the device tool brings that folder back). Prepare on the CPU machine first:
#
#   bash benchmarks/gpu_session.sh pack          # copies ../shared's wheels, Mistral config/tokenizer, GSM8K
#                                                # into .gpu/ (in .gitignore), to `carry: [".gpu"]` (12 MB)
#
# then, one device call each (carry .gpu):
#
#   bash benchmarks/gpu_session.sh i52           # issue 52's sixth call: samplers, vs HF + Liger, each mode on CUDA
#   bash benchmarks/gpu_session.sh i52b          # issue 53 item 14: an RL step's reserved memory, expandable segments;
#                                                # the fp32 head, generation_batch, LoRA's moving reference (~5 min)
#   bash benchmarks/gpu_session.sh smoke         # every code path a few steps, exact resume on the GPU
#   bash benchmarks/gpu_session.sh distill       # distillation under FSDP on 1 process, the teacher sharded
#   bash benchmarks/gpu_session.sh vs-hf-7b      # Mistral-7B LoRA: llmtrain vs HF Trainer (padded, flattening)
#   bash benchmarks/gpu_session.sh small         # llmtrain at HF's small micro-batches, without and with model.compile
#   bash benchmarks/gpu_session.sh vs-hf-1b      # ~1B Llama full fine-tune, the same comparison
#   bash benchmarks/gpu_session.sh fixed         # random tokens at 2048 (and 512, 4096): 7B LoRA, 1B full, 7B full offloaded
#   bash benchmarks/gpu_session.sh calibrate     # estimate-memory against measured peaks, 12+ runs
#   bash benchmarks/gpu_session.sh fit           # estimate-memory --fit's choice for 7B LoRA and 1B full, run
#   bash benchmarks/gpu_session.sh profile       # torch.profiler of one 7B LoRA step: top kernels
#   bash benchmarks/gpu_session.sh rl            # GRPO sampling: reference loop vs fast sampler (benchmarks/rollouts.py),
#                                                # then Mistral-7B LoRA GRPO steps with it: sampling vs update, peak vs estimate
#   bash benchmarks/gpu_session.sh families      # Qwen3-8B, Gemma 3 12B, Phi-4, Llama 3.2 3B, Qwen2.5-7B: LoRA at their
#                                                # real shapes, peak vs estimate; Liger on Gemma 3 and Phi-4 (~8 min)
#   bash benchmarks/gpu_session.sh long          # Llama-3.1-8B QLoRA (benchmarks/long_context_gpu.py): the longest
#                                                # context that trains with offload + tiled MLP (16K-512K), tokens/s
#                                                # at 16K-64K: plain, offload, tiled, both; peaks vs estimate (~4 min)
#   bash benchmarks/gpu_session.sh tools         # make demo-tools on CUDA: GRPO with a tool through the captured sampler
#   bash benchmarks/gpu_session.sh moe           # Qwen3-30B-A3B's shape: LoRA (experts, attention, the load-balancing
#                                                # loss) peaks vs estimate; GRPO with the experts unmerged (5-8 min)
#   bash benchmarks/gpu_session.sh gemma4        # a Gemma 4 of transformers' default shape, dense and with experts:
#                                                # LoRA peaks vs estimate; liger's Gemma 4 kernels (~4 min)
#   bash benchmarks/gpu_session.sh optim8        # train.optimizer: Mistral-7B's shape, a bf16 full fine-tune on one
#                                                # card with AdamW, then 8-bit AdamW: peaks vs estimate (~3 min)
#   bash benchmarks/gpu_session.sh dora          # lora.dora: Mistral-7B's shape, LoRA against DoRA (dropout 0 and
#                                                # 0.05) checkpointed: step time, peaks vs estimate (~3 min)
#   bash benchmarks/gpu_session.sh forwards      # the estimate's no-grad forwards (a DPO reference, KTO's three
#                                                # passes) at Mistral-7B's shape: step-time ratios vs estimate (~4 min)
#   bash benchmarks/gpu_session.sh rounds        # rl.num_iterations: Mistral-7B LoRA GRPO sampling every step against
#                                                # rounds of 2 (and GSPO): seconds, generation_s, peaks (~3 min)
#
# Each writes $OUT/<name>.jsonl and $OUT/<name>.log.
#
# Rehearsal on the CPU (no GPU time spent): GPU_SESSION_DRY=1 runs every step with the models shrunk to 2 layers of
# hidden 128 (real Mistral vocabulary and tokenizer, real GSM8K) and token budgets divided by 8, on the Python and
# packages named by PY, e.g. a Python 3.12 venv with the device's torch 2.11 and transformers 5.17:
#
#   GPU_SESSION_DRY=1 PY=/work/gpuenv/bin/python OUT=/tmp/dry bash benchmarks/gpu_session.sh smoke
#
# That venv (about 3 minutes; torch 2.11's wheel from the registry is its CUDA build, which runs on the CPU too):
#
#   /root/.pyenv/versions/3.12.1/bin/python -m venv /work/gpuenv && /work/gpuenv/bin/pip install -q torch==2.11.0 \
#     && /work/gpuenv/bin/pip install -q transformers==5.17.0 accelerate==1.15.0 peft typer rich matplotlib \
#        tensorboard pyyaml safetensors \
#     && /work/gpuenv/bin/pip install -q --no-deps ../shared/wheels-py312/*.whl \
#     && /work/gpuenv/bin/pip install -q pyarrow pandas xxhash requests tqdm fsspec httpx
#
# (2026-12-01: i40, vs-hf-7b, distill, families, tools, moe, oss and gemma4 rehearsed so, every run exit 0 but the
# liger rows, which need CUDA, and the tests/test_cuda.py steps, pytest not being in it; moe had died on transformers
# 5.17 until lora_experts read _is_expert_parallel safely.)
#
# (WORK=DIR moves the runs from /tmp/work, or /tmp/work-dry, to DIR.)
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:?usage: gpu_session.sh pack|i52|i52b|small|families|i40|i40b|sp|smoke|distill|vs-hf-7b|vs-hf-1b|fixed|calibrate|fit|profile|rl|long|tools|moe|oss|gemma4|optim8|dora|rounds}
G=.gpu
OUT=${OUT:-/tmp/out}
DRY=${GPU_SESSION_DRY:-0}
PY=${PY:-python3}
SCALE=1  # token budgets are divided by this
TINY='{}'
FSDP_CONFIG=accelerate_configs/fsdp.yaml
if [[ $DRY == 1 ]]; then
  SCALE=8
  TINY='{"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}'
  FSDP_CONFIG=accelerate_configs/cpu_fsdp.yaml
fi
mkdir -p "$OUT"

if [[ $WHAT == pack ]]; then
  mkdir -p $G/wheels $G/mistral $G/gsm8k
  cp ../shared/wheels-py312/*.whl $G/wheels/
  # the device's typer (0.19-0.28) writes its help without display_type_rich, which llmtrain's CLI once needed
  # (2026-12-04: every finetune died at start-up there): the version llmtrain is tested with travels too
  python3 -m pip download -q --no-deps --only-binary=:all: -d $G/wheels "typer==0.29.2" || exit 1
  cp ../shared/models/mistral-7b-instruct-v0.3/{config.json,tokenizer.json,tokenizer_config.json,special_tokens_map.json,generation_config.json} $G/mistral/
  cp ../shared/data/gsm8k/{train,test}.jsonl $G/gsm8k/
  du -sh $G
  exit 0
fi

# ---- on the device: the missing packages (datasets, pydantic, liger-kernel) from the carried wheels
if [[ $DRY == 1 ]] && $PY -c "import datasets, pydantic" 2>/dev/null; then
  # the carried wheels are for the device's Python 3.12; a rehearsal's venv that has these packages runs as it is
  echo "dry run: $PY has datasets and pydantic already; the carried wheels are not installed"
else
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/wheels/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
$PY -c "import torch, transformers, accelerate, peft, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__, 'datasets', datasets.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu (dry run)')" | tee "$OUT/versions.txt"
W=/tmp/work
[[ $DRY == 1 ]] && W=/tmp/work-dry
W=${WORK:-$W}  # two rehearsals at once on one machine need two folders: each call starts by removing its runs
mkdir -p $W
# Every call starts with no runs: a second call on a warm machine (smoke again after a fix) or a second rehearsal
# would find the last call's output_dirs, every finetune would refuse them (exit 2), and the JSON lines would
# report that call's metrics again.
rm -rf "$W/runs"

# A random-init model of a real shape (config + the Mistral tokenizer), and GSM8K as chat messages.
model_dir() {  # model_dir NAME JSON_OVERRIDES
  local d=$W/models/$1
  mkdir -p "$d"
  cp $G/mistral/*.json "$d/"
  $PY - "$d/config.json" "$2" "$TINY" <<'EOF'
import json, sys
path, over, tiny = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
cfg = json.load(open(path)); cfg.update(over); cfg.update(tiny); json.dump(cfg, open(path, "w"), indent=1)
EOF
  echo "$d"
}
# ... and as prompts with their answer column (online RL: smoke's GRPO run, and rl)
$PY - <<EOF
import json
with open("$G/gsm8k/train.jsonl") as f, open("$W/gsm8k-messages.jsonl", "w") as w, open("$W/gsm8k-prompts.jsonl", "w") as p:
    for line in f:
        r = json.loads(line)
        w.write(json.dumps({"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}) + "\n")
        p.write(json.dumps({"prompt": r["question"], "answer": r["answer"]}) + "\n")
EOF
MISTRAL7B=$(model_dir mistral-7b '{}')
LLAMA1B=$(model_dir llama-1b '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 32000, "head_dim": 64}')

recipe() {  # recipe FILE MODEL_DIR LORA(0|1) DTYPE [BUDGET] -> a recipe on GSM8K messages, random init
  cat > "$1" <<EOF
model: {name_or_path: $2, dtype: $4, random_init: true, kernels: none}  # liger only where a run asks
data: {path: $W/gsm8k-messages.jsonl, format: messages, max_seq_len: $((1024 / SCALE)), cache_dir: $W/cache}
$( [[ $3 == 1 ]] && echo "lora: {r: 16, alpha: 32, dropout: 0.0}" )
train: {max_steps: 6, micro_batch_size: 1, micro_batch_tokens: $((${5:-8192} / SCALE)), lr: 1.0e-5, mixed_precision: bf16, seed: 1}
checkpoint: {save_final: false}
logging: {progress: false}
output_dir: $W/runs/unnamed
EOF
}

run() {  # run NAME COMMAND...: one llmtrain finetune into $W/runs/NAME, a JSON line of what it did
  local name=$1; shift
  local t0=$SECONDS
  "$@" output_dir=$W/runs/$name >> "$OUT/$WHAT.log" 2>&1
  local rc=$?
  $PY - "$name" "$rc" "$((SECONDS - t0))" "$W/runs/$name" >> "$OUT/$WHAT.jsonl" <<'EOF'
import json, sys, pathlib
name, rc, secs, run = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4])
lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
train = [l for l in lines if l["type"] == "train"]
summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
keep = ("max_memory_allocated", "max_memory_reserved", "predicted_peak_allocated_bytes", "predicted_peak_reserved_bytes",
        "predicted_peak_bytes", "packing_efficiency", "tokens_per_s_per_gpu")
rl = {k: [l.get(k) for l in train] for k in ("generation_s", "generation_tokens_per_s", "policy_tokens_per_s",
                                              "step_s", "completions/mean_length", "clip_ratio/region_mean",
                                              "sampling/sampling_logp_difference/mean",
                                              "sampling/sampling_logp_difference/max",
                                              "sampling/importance_sampling_ratio/min",
                                              "sampling/importance_sampling_ratio/max")
      if any(k in l for l in train)}
print(json.dumps({"run": name, "rc": rc, "seconds": secs, "steps": len(train), **rl,
                  "losses": [l["loss"] for l in train], "tokens_per_s_per_gpu": [l.get("tokens_per_s_per_gpu") for l in train][-3:],
                  "mfu": [l.get("mfu") for l in train][-3:], **{k: summary.get(k) for k in keep}}))
EOF
}
LLAMA8B_JSON='{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "tie_word_embeddings": false,
    "bos_token_id": 128000, "eos_token_id": 128009}'
grpo_lora() {  # grpo_lora STEPS [UPDATE_BUDGET]: $W/lora.yaml (Mistral-7B LoRA), and in GRPO and RL the overrides of
  # 8 prompts x 8 completions x 256 new tokens a step on GSM8K prompts (the update's token budget, if given)
  recipe $W/lora.yaml "$MISTRAL7B" 1 bfloat16 4096
  GRPO="data.path=$W/gsm8k-prompts.jsonl data.format=prompt data.chat_template=true data.max_seq_len=1024
    train.micro_batch_tokens=null train.micro_batch_size=8 train.max_steps=$1"
  RL="rl={num_generations: 8, max_completion_tokens: $((256 / SCALE)),${2:+ micro_batch_tokens: $(($2 / SCALE)),} rewards: [{type: format, pattern: '${REWARD_PATTERN:-[0-9][0-9]}'}]}"
}
FT="$PY -m llmtrain finetune"
FSDP1="$PY -m accelerate.commands.launch --config_file $FSDP_CONFIG --num_processes 1 -m llmtrain finetune"
distill_fsdp1() {  # on-policy distillation under FSDP on 1 process, the teacher sharded (fsdp.shard_frozen) on CUDA:
  # the 1B's random weights saved once as the teacher, the student a LoRA on a random init of the same shape
  [[ -d $W/models/llama-1b-weights ]] || $PY - "$LLAMA1B" "$W/models/llama-1b-weights" <<'PYEOF' >> "$OUT/$WHAT.log" 2>&1
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16)
model.save_pretrained(sys.argv[2])
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
PYEOF
  recipe $W/distill.yaml "$LLAMA1B" 1 bfloat16
  run distill-fsdp1 $FSDP1 $W/distill.yaml train.micro_batch_tokens=null train.micro_batch_size=4 train.max_steps=3 \
    "distill={teacher: $W/models/llama-1b-weights, lmbda: 1.0, max_completion_tokens: $((128 / SCALE))}"
}

case $WHAT in
smoke)
  # the CUDA kernels against their references first (tests/test_cuda.py; skipped on a dry run's CPU)
  $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs > "$OUT/smoke-cuda-tests.txt" 2>&1
  echo "tests/test_cuda.py: exit $?" | tee -a "$OUT/$WHAT.log"
  recipe $W/full.yaml "$LLAMA1B" 0 float32
  recipe $W/lora.yaml "$MISTRAL7B" 1 bfloat16 4096  # 8192 without checkpointing is predicted at 76 of 79.6 GiB
  run full-varlen-budget $FT $W/full.yaml
  run full-sdpa-mb8 $FT $W/full.yaml model.attn_implementation=sdpa train.micro_batch_tokens=null train.micro_batch_size=8
  run full-ckpt $FT $W/full.yaml model.gradient_checkpointing=true
  run lora-varlen $FT $W/lora.yaml
  run lora-ckpt-16k $FT $W/lora.yaml model.gradient_checkpointing=true train.micro_batch_tokens=$((16384 / SCALE))
  run fsdp1-lora $FSDP1 $W/lora.yaml
  # exact resume on the GPU: 6 steps straight against 3 + resume 3. A constant schedule: with the default cosine,
  # max_steps=3 would change the learning rate of steps 1-3.
  R="checkpoint.every_steps=3 train.schedule=constant train.deterministic=true"
  run resume-straight $FT $W/full.yaml $R
  run resume-cut $FT $W/full.yaml $R train.max_steps=3
  run resume-cut $FT $W/full.yaml $R --resume auto --allow-recipe-change
  $PY - "$W/runs" "$OUT/$WHAT.log" >> "$OUT/$WHAT.jsonl" <<'EOF'
import json, sys, pathlib
runs, log = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).read_text(errors="replace")
loss = lambda name: [r["loss"] for r in map(json.loads, (runs / name / "metrics.jsonl").read_text().splitlines())
                     if r["type"] == "train"]
a, b = loss("resume-straight"), loss("resume-cut")
tps = lambda name: [r.get("tokens_per_s_per_gpu") for r in map(json.loads, (runs / name / "metrics.jsonl").read_text()
                    .splitlines()) if r["type"] == "train"][-2:]
# strict mode (train.deterministic): flash attention's backward no longer warns that it is non-deterministic, and the
# cost is the deterministic run's tokens/s against full-varlen-budget's, the same recipe without the flag
print(json.dumps({"check": "resume", "straight": a, "cut_and_resumed": b, "equal": a == b,
                  "max_abs_diff": max((abs(x - y) for x, y in zip(a, b)), default=None) if len(a) == len(b) else None,
                  "nondeterministic_warnings": log.count("defaults to a non-deterministic algorithm"),
                  "tokens_per_s_deterministic": tps("resume-straight"), "tokens_per_s_default": tps("full-varlen-budget")}))
EOF
  # preference pairs (DPO on Mistral-7B LoRA: the reference is the disabled adapter; GSM8K's answer against the same
  # answer with its final number changed), and QLoRA (a 4-bit base needs weights to quantise: a random 1B saved once)
  $PY - <<EOF
import json
with open("$G/gsm8k/train.jsonl") as f, open("$W/gsm8k-pairs.jsonl", "w") as w:
    for line in f:
        r = json.loads(line)
        body, final = r["answer"].rsplit("####", 1)
        if final.strip().isdigit():
            w.write(json.dumps({"prompt": r["question"], "chosen": r["answer"],
                                "rejected": f"{body}#### {int(final) * 10 + 1}"}) + "\n")
EOF
  run dpo-lora $FT $W/lora.yaml data.path=$W/gsm8k-pairs.jsonl data.format=preference data.chat_template=true \
    data.max_seq_len=$((2048 / SCALE)) \
    preference.loss=dpo
  # online RL (GRPO, Mistral-7B LoRA): sampling with the KV cache, then the packed update; a random model runs every
  # completion to max_completion_tokens, which is the worst case the estimate counts
  run grpo-lora $FT $W/lora.yaml data.path=$W/gsm8k-prompts.jsonl data.format=prompt data.chat_template=true \
    data.max_seq_len=1024 train.micro_batch_tokens=null train.micro_batch_size=4 train.max_steps=3 \
    "rl={num_generations: 4, max_completion_tokens: $((256 / SCALE)), rewards: [{type: format, pattern: '[0-9][0-9]'}]}"
  distill_fsdp1  # also saves the 1B's random weights, which QLoRA quantises
  recipe $W/qlora.yaml "$W/models/llama-1b-weights" 1 bfloat16 4096
  run qlora-nf4 $FT $W/qlora.yaml model.random_init=false model.quantize=nf4
  run qlora-nf4-ckpt $FT $W/qlora.yaml model.random_init=false model.quantize=nf4 model.gradient_checkpointing=true
  # last: the optional kernels, and compile's first compilation (minutes), so that the rest is in before any limit
  run lora-liger $FT $W/lora.yaml model.kernels=liger
  run lora-compile $FT $W/lora.yaml model.compile=true
  ;;
vs-hf-7b|vs-hf-1b)
  shape=$( [[ $WHAT == vs-hf-7b ]] && echo mistral-7b-lora || echo llama-1b-full )
  # hf-liger last (HF padding-free + use_liger_kernel, Triton: CUDA only), so that a failure there costs no other row
  $PY benchmarks/vs_hf.py $( [[ $DRY == 1 ]] && echo --smoke || echo --shape $shape \
    --systems llmtrain,llmtrain-baseline,hf-padded,hf-flatten,hf-liger ) --mistral $G/mistral \
    --gsm8k $G/gsm8k/train.jsonl > "$OUT/$WHAT.jsonl" 2> "$OUT/$WHAT.log"
  ;;
small)  # docs/performance.md's open question (~4 minutes on an H200): at HF's small micro-batches (10 bins of ~1.6k
  # tokens a step) llmtrain ran at half its large-budget speed, launch- and latency-bound; do compiled layers
  # (model.compile, regional torch.compile) take the fixed costs out? The same llmtrain row without and with them
  for compiled in no-compile compile; do
    timeout 270 $PY benchmarks/vs_hf.py $( [[ $DRY == 1 ]] && echo --shape cpu-small --steps 4 --warmup 1 \
      --grad-accum 2 || echo --shape mistral-7b-lora --steps 12 --warmup 3 --grad-accum 10 ) --systems llmtrain \
      --$compiled --mistral $G/mistral --gsm8k $G/gsm8k/train.jsonl >> "$OUT/$WHAT.jsonl" 2>> "$OUT/$WHAT.log"
    echo "vs_hf.py --$compiled: exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  done
  ;;
fixed)  # fixed-length random tokens (benchmarks/throughput.py): speed, and predicted vs measured peak at seq 512-4096
  tp() {  # tp [launcher...] -- SHAPE [args]: one throughput.py run; its JSON (the last line) to the .jsonl
    local launch=() shape
    while [[ $1 != -- ]]; do launch+=("$1"); shift; done; shift
    shape=$1; shift
    [[ $DRY == 1 ]] && { shape=tiny; set -- "$@" --seq-len 256 --steps 3 --warmup 1; }
    if "${launch[@]}" benchmarks/throughput.py --shape $shape "$@" > $W/tp.out 2>> "$OUT/$WHAT.log"; then
      tail -n 1 $W/tp.out >> "$OUT/$WHAT.jsonl"
    else
      echo "{\"failed\": \"$shape $*\"}" >> "$OUT/$WHAT.jsonl"
    fi
    cat $W/tp.out >> "$OUT/$WHAT.log"
  }
  tp $PY -- llama2-7b-lora
  tp $PY -- llama-1b-full
  tp $PY -- llama2-7b-lora --seq-len 4096 --micro-batch 2 --no-grad-checkpointing --steps 6
  tp $PY -- llama-1b-full --seq-len 512 --micro-batch 64 --steps 6
  # the 7B full fine-tune: parameters, gradients and AdamW state offloaded to the host by FSDP on one process
  # (a dry run shards on the CPU without offload: there is no host to offload to)
  tp $PY -m accelerate.commands.launch --config_file $FSDP_CONFIG --num_processes 1 \
    $( [[ $DRY == 1 ]] || echo --fsdp_offload_params true ) -- llama2-7b-full --steps 6 --warmup 2
  ;;
calibrate)  # predicted vs measured peak (summary.json) for 12+ configurations
  recipe $W/full.yaml "$LLAMA1B" 0 float32
  recipe $W/lora.yaml "$MISTRAL7B" 1 bfloat16
  for cfg in "lora 2048 false" "lora 8192 false" "lora 16384 true" "lora 32768 true" "full 2048 false" "full 8192 false" \
             "full 16384 true" "full 32768 true"; do
    set -- $cfg
    run cal-$1-$2-ckpt$3 $FT $W/$1.yaml train.max_steps=3 train.micro_batch_tokens=$(($2 / SCALE)) model.gradient_checkpointing=$3
  done
  for mb in 1 8 32; do
    run cal-full-mb$mb-sdpa $FT $W/full.yaml train.max_steps=3 train.micro_batch_tokens=null train.micro_batch_size=$mb model.attn_implementation=sdpa data.max_seq_len=512
  done
  run cal-fsdp1-lora-4096 $FSDP1 $W/lora.yaml train.max_steps=3 train.micro_batch_tokens=$((4096 / SCALE))
  # the estimator models the chunked loss, not liger's kernels: how far off is it where liger is on (kernels auto)?
  [[ $DRY == 1 ]] || run cal-lora-8192-liger $FT $W/lora.yaml train.max_steps=3 model.kernels=liger
  ;;
fit)  # --fit's recommendation for this card, run: it must not run out of memory, and should use >= 70% of it
  recipe $W/full.yaml "$LLAMA1B" 0 float32
  recipe $W/lora.yaml "$MISTRAL7B" 1 bfloat16
  CARD=$($PY -c "import torch; print(torch.cuda.mem_get_info()[1] / 2**30 if torch.cuda.is_available() else 2)")
  for r in lora full; do
    $PY -m llmtrain estimate-memory $W/$r.yaml --gpu-memory "$CARD" --fit --json > $W/fit-$r.json 2>> "$OUT/$WHAT.log"
    overrides=$($PY -c "import json, sys; print(' '.join(json.load(open(sys.argv[1]))['fit']['overrides']))" $W/fit-$r.json)
    echo "fit $r on $CARD GiB: $overrides" | tee -a "$OUT/$WHAT.log"
    run fit-$r $FT $W/$r.yaml train.max_steps=4 $overrides
  done
  echo "{\"card_gib\": $CARD}" >> "$OUT/$WHAT.jsonl"
  ;;
profile)
  recipe $W/lora.yaml "$MISTRAL7B" 1 bfloat16
  $PY - "$W/lora.yaml" "$W" > "$OUT/$WHAT.jsonl" 2> "$OUT/$WHAT.log" <<'EOF'
import json, sys, torch
from torch.profiler import ProfilerActivity, profile
from llmtrain.config import load_recipe
import llmtrain.loop.train as T
# as vs-hf-7b's llmtrain row runs: kernels auto (liger where installed on CUDA)
recipe = load_recipe(sys.argv[1], ["train.max_steps=4", "model.kernels=auto", f"output_dir={sys.argv[2]}/runs/profile"])
cuda = torch.cuda.is_available()  # False only in a dry run: then CPU time stands in for device time
real = T.train_step
calls = {"n": 0}
def traced(*a, **k):
    calls["n"] += 1
    if calls["n"] != 3:
        return real(*a, **k)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        out = real(*a, **k)
        if cuda:
            torch.cuda.synchronize()
    total_of = (lambda e: e.device_time_total) if cuda else (lambda e: e.cpu_time_total)
    self_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = prof.key_averages()
    total = sum(self_of(e) for e in events)
    for e in sorted(events, key=self_of, reverse=True)[:25]:
        print(json.dumps({"kernel": e.key[:120], "device_ms": total_of(e) / 1e3, "self_device_ms": self_of(e) / 1e3,
                          "calls": e.count, "share_of_step": self_of(e) / max(total, 1)}))
    return out
T.train_step = traced
T.train(recipe, overwrite=True)
EOF
  ;;
rl)  # the rollouts issue: sampling speed, then GRPO steps with the fast sampler (about 4 minutes on an H100)
  # 0. the captured decode step against the eager one and the reference loop, the sampler's peak against the
  #    estimate's price for its filters, the entropy bonus's fused chunk (tests/test_cuda.py, ~15 s)
  $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "sampler or entropy" -rs -s > "$OUT/rl-cuda-tests.txt" 2>&1
  echo "tests/test_cuda.py -k 'sampler or entropy': exit $?" | tee -a "$OUT/$WHAT.log"
  # 1. tokens/s and ms per decode step at 16, 64 and 256 completions of ~150-token GSM8K prompts, 256 and 1024 new
  #    tokens: the reference loop (timed over 64 tokens), the eager static cache (over 128), the CUDA graph, and the
  #    graph with the adapters off plus the merge matmuls (what a merged generation copy would cost)
  if [[ $DRY == 1 ]]; then
    sizes="--completions 16 64 --new-tokens 32 64 --prompt-tokens 40 --cap reference=8 static=32"
  else
    sizes="--completions 16 64 256 --new-tokens 256 1024 --skip 256:1024 --cap reference=64 static=128"
  fi
  $PY benchmarks/rollouts.py --model "$MISTRAL7B" --gsm8k $G/gsm8k/train.jsonl --lora 16 --dtype bfloat16 $sizes \
    >> "$OUT/$WHAT.jsonl" 2>> "$OUT/$WHAT.log"
  echo "rollouts.py: exit $?" | tee -a "$OUT/$WHAT.log"
  # 2. Mistral-7B LoRA GRPO, 8 prompts x 8 completions x 256 new tokens a step: generation_s against the step, and
  #    the peak against the estimate (a random model runs every completion to the limit: the worst case)
  grpo_lora 3
  run grpo-graph $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph
  run grpo-static $FT $W/lora.yaml $GRPO "$RL" rl.sampler=static train.max_steps=2
  # 3. the bf16 sampler's distance from the update's forward (rl.sampler_correction's sampling/* lines: the tiny
  #    model's was 0.8e-3 to 2.1e-3 a token, 1.6e-2 at most, on the CPU), unmerged and on a merged bf16 copy
  run grpo-corrected $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph rl.sampler_correction=token_truncate \
    train.max_steps=2
  run grpo-corrected-merged $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph rl.sampler_correction=token_truncate \
    rl.merged_copy=rollout train.max_steps=2
  ;;
distill)  # on-policy distillation under FSDP on 1 process, the teacher sharded (about 2 minutes; also in smoke); then
  # GRPO (Mistral-7B LoRA) scored by a learned reward: the 1B's random weights under a one-output score head, in bf16,
  # whole on the GPU beside the policy (the estimate's reward_models and reward_scoring against the measured peak)
  distill_fsdp1
  [[ -d $W/models/llama-1b-rm ]] || $PY - "$W/models/llama-1b-weights" "$W/models/llama-1b-rm" <<'PYEOF' >> "$OUT/$WHAT.log" 2>&1
import sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], num_labels=1, dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model.resize_token_embeddings(len(tokenizer))  # Mistral's 32,768 tokens on the 1B's 32,000 rows
model.config.pad_token_id = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
model.save_pretrained(sys.argv[2])
tokenizer.save_pretrained(sys.argv[2])
PYEOF
  grpo_lora 3
  run grpo-reward-model $FT $W/lora.yaml $GRPO "rl={num_generations: 8, max_completion_tokens: $((256 / SCALE)), \
rewards: [{type: reward_model, path: $W/models/llama-1b-rm, batch_size: 16}]}"
  ;;
families)  # issue 55 on CUDA (~8 minutes on an H200): each family's real shape (the estimate's built-in config, random
  # init, Mistral's tokenizer: its ids are a subset of every family's vocabulary), LoRA r16 on GSM8K chats at 4,096
  # tokens a micro-batch with checkpointing, its peak against the estimate the run prints; Liger's kernels on the two
  # families whose patch llmtrain calls differently (Gemma 3's GeGLU) or whose layer it splits (Phi's fused ones)
  for fam in qwen3-8b gemma-3-12b phi-4 llama-3.2-3b qwen2.5-7b; do
    json=$($PY -c "import json, sys; from llmtrain.memory.params import PRESETS
print(json.dumps({**PRESETS[sys.argv[1]], 'architectures': None}))" $fam)  # Mistral's config.json, the family's keys over it
    dir=$(model_dir $fam "$json")
    recipe $W/$fam.yaml "$dir" 1 bfloat16 4096
    run $fam-lora $FT $W/$fam.yaml model.gradient_checkpointing=true train.loss_chunk_tokens=1024
    echo "$fam: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  done
  for fam in gemma-3-12b phi-4; do
    run $fam-lora-liger $FT $W/$fam.yaml model.gradient_checkpointing=true train.loss_chunk_tokens=1024 \
      model.kernels=liger train.max_steps=3
  done
  ;;
i52)  # issue 52's sixth call (~9 minutes on an H200), by value, each part under its own timeout so that one that
  # hangs leaves the rest their time: 1. the samplers since issue 56 (a merged bf16 generation copy, finished rows
  # dropped) against the goals (1,500 tokens/s at 16 completions, 5,000 at 64); 2. llmtrain at HF's micro-batch
  # tokens against HF Trainer + Liger's kernels (equal memory); 3. each mode never run on CUDA, 3 steps on
  # Mistral-7B LoRA (KTO, a reward model, RLOO, GRPO with rl.sampler_correction on a merged copy, distillation under
  # FSDP with the teacher sharded): tokens/s, the loss moving, the peak against the estimate
  sizes="--completions 16 64 --new-tokens 256 --samplers graph graph-merged"
  [[ $DRY == 1 ]] && sizes="--completions 16 --new-tokens 32 --prompt-tokens 40 --samplers graph graph-merged"
  [[ ${I52_SKIP:-} == rollouts ]] && sizes="--completions"  # a second call: the samplers measured in the first
  [[ $sizes == --completions ]] || timeout 170 $PY benchmarks/rollouts.py --model "$MISTRAL7B" --gsm8k $G/gsm8k/train.jsonl --lora 16 \
    --dtype bfloat16 $sizes >> "$OUT/$WHAT.jsonl" 2>> "$OUT/$WHAT.log"
  sizes="--completions 64 --new-tokens 512 --lengths gsm8k --samplers graph-before graph graph-merged"
  [[ $DRY == 1 ]] && sizes="--completions 16 --new-tokens 32 --prompt-tokens 40 --lengths gsm8k --samplers graph-before graph"
  [[ ${I52_SKIP:-} == rollouts ]] || timeout 100 $PY benchmarks/rollouts.py --model "$MISTRAL7B" --gsm8k $G/gsm8k/train.jsonl --lora 16 \
    --dtype bfloat16 $sizes >> "$OUT/$WHAT.jsonl" 2>> "$OUT/$WHAT.log"
  echo "rollouts.py: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  # llmtrain in 10 bins a step (~1.6k tokens each, HF's 8 examples a micro-batch) against hf-liger (8 x 10 examples)
  timeout 240 $PY benchmarks/vs_hf.py $( [[ $DRY == 1 ]] && echo --shape cpu-small --steps 4 --warmup 1 \
    --grad-accum 2 --systems llmtrain,hf-flatten || echo --shape mistral-7b-lora --steps 12 --warmup 3 --grad-accum 10 \
    --systems llmtrain,hf-liger ) --mistral $G/mistral --gsm8k $G/gsm8k/train.jsonl > "$OUT/vs-hf-liger.jsonl" 2>> "$OUT/$WHAT.log"
  echo "vs_hf.py: exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  $PY - <<EOF
import json
with open("$G/gsm8k/train.jsonl") as f, open("$W/gsm8k-pairs.jsonl", "w") as w, open("$W/gsm8k-unpaired.jsonl", "w") as u:
    for i, line in enumerate(f):
        r = json.loads(line)
        body, final = r["answer"].rsplit("####", 1)
        if final.strip().isdigit():
            wrong = f"{body}#### {int(final) * 10 + 1}"
            w.write(json.dumps({"prompt": r["question"], "chosen": r["answer"], "rejected": wrong}) + "\n")
            u.write(json.dumps({"prompt": r["question"], "completion": r["answer"] if i % 2 else wrong,
                                "label": bool(i % 2)}) + "\n")
EOF
  recipe $W/lora.yaml "$MISTRAL7B" 1 bfloat16 4096
  B="train.micro_batch_tokens=null train.max_steps=3 data.chat_template=true data.max_seq_len=$((1024 / SCALE))"
  run kto-lora $FT $W/lora.yaml $B train.micro_batch_size=8 data.path=$W/gsm8k-unpaired.jsonl data.format=unpaired \
    "kto={beta: 0.1}"
  run reward-lora $FT $W/lora.yaml $B train.micro_batch_size=4 data.path=$W/gsm8k-pairs.jsonl data.format=preference \
    "reward_model={center_rewards_coefficient: 0.01}"
  echo "kto, reward: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  # 'ph' is in 0.35% of Mistral's tokens: in about 60% of 256 near-uniform random tokens (the random model's), so
  # rewards differ within a group and the loss moves ('[0-9][0-9]' is in almost none)
  REWARD_PATTERN=ph grpo_lora 3 8192
  run rloo-lora $FT $W/lora.yaml $GRPO "$RL" rl.algorithm=rloo rl.sampler=graph train.max_steps=2
  run grpo-corrected-merged $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph rl.sampler_correction=token_truncate \
    rl.merged_copy=rollout train.max_steps=2
  echo "rloo, grpo: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  distill_fsdp1
  echo "distill: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  ;;
i52b)  # issue 53's item 14, rl.cast_lm_head_to_fp32 and rl.generation_batch on CUDA (~5 minutes on an H200): why an RL step's reserved memory is ~33% over its
  # allocated (91.90 against 68.96 GiB on 2026-12-04, where the estimate adds 10%): the same 2 GRPO steps (Mistral-7B
  # LoRA, 8 x 8 x 256, rl.micro_batch_tokens 8192, the graph sampler) with the caching allocator as it is, with
  # expandable segments (a segment grows in place: passes of other sizes strand no blocks; the graph sampler and the
  # eager static one, in case the captured graphs' pools and expandable segments do not mix); then KTO's 3 steps
  # (+18% reserved) with expandable segments
  # first, a minute: a model whose config has attention dropout, trained packed through llmtrain's varlen attention
  # with its dropout on (train.disable_dropout=false): on CUDA that attention takes SDPA per example (2026-12-07;
  # it had raised NotImplementedError at step 1): it must train, its losses finite
  DROPPY=$(model_dir llama-1b-dropout "$(cat "$LLAMA1B/config.json" | $PY -c 'import json,sys; c=json.load(sys.stdin); c["attention_dropout"]=0.1; print(json.dumps(c))')")
  recipe $W/dropout.yaml "$DROPPY" 1 bfloat16
  run attention-dropout $FT $W/dropout.yaml train.max_steps=3 train.disable_dropout=false
  REWARD_PATTERN=ph grpo_lora 2 8192
  run grpo-cache-default $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run grpo-expandable $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run grpo-expandable-static $FT $W/lora.yaml $GRPO "$RL" \
    rl.sampler=static
  # rl.cast_lm_head_to_fp32: the sampler's distance from the update (sampling/*) with the head in fp32, against the
  # bf16 head's (0.052 a token on a merged copy on 2026-12-04; here both unmerged)
  run grpo-corrected $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph rl.sampler_correction=token_truncate
  # rl.generation_batch: 2 prompts x 8 completions a micro-batch, 4 micro-batches a step, sampled 16 rows at a time
  # (4 calls) against the step's 64 at once (one call): generation_s a step
  M4="train.micro_batch_size=2 train.grad_accum_steps=4"
  run grpo-sample-micro-batch $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph $M4 rl.generation_batch=micro_batch
  run grpo-sample-step $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph $M4 rl.generation_batch=step
  run grpo-corrected-fp32-head $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph rl.sampler_correction=token_truncate \
    rl.cast_lm_head_to_fp32=true
  $PY - <<EOF
import json
with open("$G/gsm8k/train.jsonl") as f, open("$W/gsm8k-unpaired.jsonl", "w") as u:
    for i, line in enumerate(f):
        r = json.loads(line)
        body, final = r["answer"].rsplit("####", 1)
        if final.strip().isdigit():
            u.write(json.dumps({"prompt": r["question"], "completion": r["answer"] if i % 2 else
                                f"{body}#### {int(final) * 10 + 1}", "label": bool(i % 2)}) + "\n")
EOF
  recipe $W/lora.yaml "$MISTRAL7B" 1 bfloat16 4096
  B="train.micro_batch_tokens=null train.max_steps=3 data.chat_template=true data.max_seq_len=$((1024 / SCALE))"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run kto-expandable $FT $W/lora.yaml $B train.micro_batch_size=8 \
    data.path=$W/gsm8k-unpaired.jsonl data.format=unpaired "kto={beta: 0.1}"
  # kto.sync_reference with LoRA (2026-12-04, model/reference.AdapterReference): the adapter's snapshot copied in
  # and out around each reference forward, every step: tokens/s against kto-expandable's, the peak against the
  # estimate (which adds the snapshot and its spare)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run kto-sync-lora $FT $W/lora.yaml $B train.micro_batch_size=8 \
    data.path=$W/gsm8k-unpaired.jsonl data.format=unpaired "kto={beta: 0.1, sync_reference: {every_steps: 1, alpha: 1}}"
  ;;
i40)  # issue 40 in one call (~9 minutes on an H200), by value: the sampler's speed, a GRPO step under FSDP on 1
  # process, the deterministic resume, then the long-context search and table in whatever time is left
  $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "sampler or sinks" -rs -s > "$OUT/i40-cuda-tests.txt" 2>&1
  echo "tests/test_cuda.py -k 'sampler or sinks': exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  # issue 56: the merged copy at the limit (every row to 256), then GSM8K-like lengths (finished rows dropped)
  sizes="--completions 16 64 --new-tokens 256 --samplers graph-before graph graph-merged"
  [[ $DRY == 1 ]] && sizes="--completions 16 64 --new-tokens 32 --prompt-tokens 40 --samplers graph-before graph"
  $PY benchmarks/rollouts.py --model "$MISTRAL7B" --gsm8k $G/gsm8k/train.jsonl --lora 16 --dtype bfloat16 $sizes \
    >> "$OUT/$WHAT.jsonl" 2>> "$OUT/$WHAT.log"
  echo "rollouts.py: exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  sizes="--completions 16 64 --new-tokens 512 --lengths gsm8k --samplers graph-before graph graph-merged"
  [[ $DRY == 1 ]] && sizes="--completions 16 --new-tokens 32 --prompt-tokens 40 --lengths gsm8k --samplers graph"
  $PY benchmarks/rollouts.py --model "$MISTRAL7B" --gsm8k $G/gsm8k/train.jsonl --lora 16 --dtype bfloat16 $sizes \
    >> "$OUT/$WHAT.jsonl" 2>> "$OUT/$WHAT.log"
  echo "rollouts.py --lengths gsm8k: exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  grpo_lora 2
  run grpo-graph $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph
  run grpo-merged $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph rl.merged_copy=rollout
  run grpo-fsdp1 $FSDP1 $W/lora.yaml $GRPO "$RL" train.max_steps=1
  echo "grpo: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  recipe $W/full.yaml "$LLAMA1B" 0 float32
  R="checkpoint.every_steps=3 train.schedule=constant train.deterministic=true"
  run full-default $FT $W/full.yaml
  run resume-straight $FT $W/full.yaml $R
  run resume-cut $FT $W/full.yaml $R train.max_steps=3
  run resume-cut $FT $W/full.yaml $R --resume auto --allow-recipe-change
  $PY - "$W/runs" "$OUT/$WHAT.log" >> "$OUT/$WHAT.jsonl" <<'PYEOF'
import json, sys, pathlib
runs, log = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).read_text(errors="replace")
rows = lambda name: [r for r in map(json.loads, (runs / name / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
a, b = [r["loss"] for r in rows("resume-straight")], [r["loss"] for r in rows("resume-cut")]
print(json.dumps({"check": "resume", "straight": a, "cut_and_resumed": b, "equal": a == b,
                  "max_abs_diff": max((abs(x - y) for x, y in zip(a, b)), default=None) if len(a) == len(b) else None,
                  "nondeterministic_warnings": log.count("defaults to a non-deterministic algorithm"),
                  "tokens_per_s_deterministic": [r.get("tokens_per_s_per_gpu") for r in rows("resume-straight")][-3:],
                  "tokens_per_s_default": [r.get("tokens_per_s_per_gpu") for r in rows("full-default")][-3:]}))
PYEOF
  echo "resume: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  LLAMA8B=$(model_dir llama-8b "$LLAMA8B_JSON")
  LONG=( --budget-s $(( ${I40_END:-540} - SECONDS - 30 )) )
  [[ $DRY == 1 ]] && LONG=( --search 256 512 1024 --table 256 512 --search-layers 1 --table-layers 2 )
  $PY benchmarks/long_context_gpu.py --config "$LLAMA8B" --work $W/long --out "$OUT/long.jsonl" "${LONG[@]}" \
    >> "$OUT/long.log" 2>&1
  echo "long_context_gpu.py: exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  ;;
i40b)  # issue 40's second call (~3 minutes): the sampler tests after the fix of the masked decode's reshape, the
  # GRPO step on the graph sampler with the update split into 8K-token passes (i40's OOM'd at one 26K pass), and the
  # long-context gap at 131K: tiling alone against offload + tiling, 2 real layers
  $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "sampler or entropy" -rs -s > "$OUT/i40b-cuda-tests.txt" 2>&1
  echo "tests/test_cuda.py -k sampler or entropy: exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  grpo_lora 2 8192
  run grpo-graph-8k $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph
  echo "grpo: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  LLAMA8B=$(model_dir llama-8b "$LLAMA8B_JSON")
  T=( --table 131072 ); [[ $DRY == 1 ]] && T=( --table 1024 )
  $PY benchmarks/long_context_gpu.py --config "$LLAMA8B" --work $W/long --out "$OUT/long-b.jsonl" --phases table \
    --table-configs tiled both "${T[@]}" --table-layers 2 --table-steps 2 >> "$OUT/long-b.log" 2>&1
  echo "long_context_gpu.py: exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  ;;
sp)  # issue 43, for a machine of several GPUs (NGPU, default all): Llama-3.1-8B's shape, LoRA r16 on a bf16 base (random
  # init), checkpointing + offload + tiled MLP, one text document of T tokens a step (GSM8K text repeated), split over
  # the GPUs with parallel.sequence_parallel = NGPU; T doubling from 64K while it trains (and 1 GPU at 64K as the
  # baseline). Each row: tokens/s, peak allocated against the estimate's (summary.json).
  NGPU=${NGPU:-$($PY -c "import torch; print(max(torch.cuda.device_count(), 2))")}
  LLAMA8B=$(model_dir llama-8b "$LLAMA8B_JSON")
  CFG=accelerate_configs/ddp.yaml; [[ $DRY == 1 ]] && CFG=accelerate_configs/cpu_ddp.yaml
  SIZES="65536 131072 262144 524288 1048576"; [[ $DRY == 1 ]] && SIZES="1024 2048"
  for T in $SIZES; do
    $PY - "$G/gsm8k/train.jsonl" "$W/long-$T.jsonl" "$T" "$G/mistral" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
from transformers import AutoTokenizer
sample = "\n\n".join(r["question"] + " " + r["answer"] for r in rows[:200])
per_token = len(sample) / len(AutoTokenizer.from_pretrained(sys.argv[4])(sample)["input_ids"])
text, i = [], 0
while sum(len(t) + 2 for t in text) < int(sys.argv[3]) * 0.6 * per_token:  # ~60% of T tokens (the template and the reply after it)
    text.append(rows[i % len(rows)]["question"] + " " + rows[i % len(rows)]["answer"]); i += 1
with open(sys.argv[2], "w") as f:  # a long user turn and a short trained reply, as a long-document QA
    for r in rows[:4]:
        f.write(json.dumps({"messages": [{"role": "user", "content": "\n\n".join(text) + "\n\n" + r["question"]},
                                         {"role": "assistant", "content": r["answer"]}]}) + "\n")
PYEOF
    cat > $W/sp-$T.yaml <<EOF2
model: {name_or_path: $LLAMA8B, dtype: bfloat16, random_init: true, kernels: none, gradient_checkpointing: true,
        activation_offload: true, tiled_mlp: true}
data: {path: $W/long-$T.jsonl, format: messages, max_seq_len: $T, cache_dir: $W/cache}
lora: {r: 16, alpha: 32, dropout: 0.0}
train: {max_steps: 3, micro_batch_size: 1, micro_batch_tokens: $T, lr: 1.0e-5, mixed_precision: bf16, seed: 1}
checkpoint: {save_final: false}
logging: {progress: false}
output_dir: $W/runs/unnamed
EOF2
    [[ $T == 65536 || $DRY == 1 && $T == 1024 ]] && run sp1-$T $FT $W/sp-$T.yaml
    run sp$NGPU-$T $PY -m accelerate.commands.launch --config_file $CFG --num_processes $NGPU -m llmtrain finetune \
      $W/sp-$T.yaml parallel.sequence_parallel=$NGPU
    tail -n 1 "$OUT/$WHAT.jsonl" | grep -q '"rc": 0' || break  # the first size that fails ends the search
  done
  ;;
tools)  # issue 57 on CUDA (about 1 minute): make demo-tools's two recipes with the captured sampler, whose graphs are
  # replayed round after round as the tool's results lengthen the rows; the same numbers as the CPU's (docs/tools.md:
  # greedy accuracy 0% -> 97.5% at step 40) up to sampling's rounding, and generation_tokens_per_s
  $PY -m llmtrain prepare-tiny $W/tiny >> "$OUT/$WHAT.log" 2>&1
  A="data.chat_template=$W/tiny/data/tools.jinja logging.progress=false"
  run tools-sft $FT recipes/tiny-tools-sft.yaml model.name_or_path=$W/tiny/model \
    data.path=$W/tiny/data/train_tools.jsonl $A
  run tools-grpo $FT recipes/tiny-tools-grpo.yaml model.name_or_path=$W/runs/tools-sft/final $A \
    data.path=$W/tiny/data/train_tool_prompts.jsonl data.eval_split=$W/tiny/data/eval_tool_prompts.jsonl
  $PY - "$W/runs/tools-grpo" >> "$OUT/$WHAT.jsonl" <<'EOF'
import json, sys, pathlib
lines = [json.loads(l) for l in (pathlib.Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
print(json.dumps({"check": "tools", "eval_answer_accuracy": [(l["step"], l["eval_answer_accuracy"]) for l in lines
                  if l["type"] == "eval"], "call_frequency": [l.get("tools/call_frequency") for l in lines
                  if l["type"] == "train"]}))
EOF
  ;;
long)  # issue 42 (benchmarks/long_context_gpu.py, about 4 minutes on an H100): Llama-3.1-8B QLoRA on one example
  # of T random tokens a step. The longest T that trains with offload + tiled MLP (16K doubling to 512K, 2 steps
  # each, 2 real layers and a GPU ballast for the other 30), then tokens/s at 16K/32K/64K with plain
  # checkpointing, offload, tiling and both (4 real layers); each row with the peaks and estimate-memory's.
  LLAMA8B=$(model_dir llama-8b "$LLAMA8B_JSON")
  # a dry run: the lengths / 64 (the search to 128K's, 2K), the search building 1 of the 2 layers (the ballast's
  # arithmetic), and no time budget (the CPU's time says nothing of the GPU's)
  LONG=( $( [[ $DRY == 1 ]] && echo --search 256 512 1024 2048 --table 256 512 1024 --search-layers 1 \
    --table-layers 2 || echo --budget-s 210 ) )
  rm -f "$OUT/$WHAT.jsonl"
  $PY benchmarks/long_context_gpu.py --config "$LLAMA8B" --work $W/long --out "$OUT/$WHAT.jsonl" "${LONG[@]}" \
    >> "$OUT/$WHAT.log" 2>&1
  echo "long_context_gpu.py: exit $?" | tee -a "$OUT/$WHAT.log"
  ;;
oss)  # GPT-OSS-20B's shape on CUDA (~3 minutes on an H200): random init, LoRA r16 on attention and on its experts
  # (lora.target_parameters, run unmerged beside the biased experts) at 4,096 tokens a micro-batch, checkpointed: its
  # sinks on the flash path (attention._SinkShare, never run on a GPU), its peak against the estimate the run prints;
  # then tests/test_cuda.py's sinks test (the flash path against the per-example one). Rehearsed (GPU_SESSION_DRY=1):
  # 4 steps, exit 0
  json=$($PY -c "import json; from llmtrain.memory.params import PRESETS
c = {**PRESETS['gpt-oss-20b'], 'architectures': None}; c.pop('layer_types'); print(json.dumps(c))")
  dir=$(model_dir gpt-oss-20b "$json")
  recipe $W/gpt-oss-20b.yaml "$dir" 1 bfloat16 4096
  run gpt-oss-20b-lora-experts $FT $W/gpt-oss-20b.yaml model.gradient_checkpointing=true train.loss_chunk_tokens=1024 \
    train.max_steps=4 'lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]'
  echo "gpt-oss-20b: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k sinks -rs > "$OUT/oss-cuda-tests.txt" 2>&1
  echo "tests/test_cuda.py -k sinks: exit $? at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  ;;
optim8)  # train.optimizer on CUDA (~4 minutes on an H200): Mistral-7B's shape (random init), a bf16 full fine-tune on one
  # card at 4,096 tokens a micro-batch, checkpointed, with torch's fused AdamW and then bitsandbytes' 8-bit AdamW: each
  # peak against the estimate the run prints (the optimizer row 27.0 GiB against 13.7), and the losses of the two;
  # then the 8-bit AdamW under FSDP on the one card (bitsandbytes' CUDA kernels on each DTensor's local shard,
  # llmtrain/model/adamw_8bit.py): its peak and losses against the plain run's (one shard holds one process's blocks,
  # but FSDP keeps fp32 master shards of the bf16 weights: close, not equal; the CPU rehearsal's step 4: 1e-3 apart).
  # Rehearsed (GPU_SESSION_DRY=1, 2026-12-05): 4 steps each, exit 0, all three rc 0
  dir=$(model_dir mistral-7b-full '{}')
  recipe $W/mistral-7b-full.yaml "$dir" 0 bfloat16 4096
  for opt in adamw adamw_8bit; do
    run mistral-7b-full-$opt $FT $W/mistral-7b-full.yaml model.gradient_checkpointing=true train.loss_chunk_tokens=1024 \
      train.max_steps=4 train.optimizer=$opt
    echo "$opt: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  done
  run mistral-7b-full-adamw_8bit-fsdp1 $FSDP1 $W/mistral-7b-full.yaml model.gradient_checkpointing=true \
    train.loss_chunk_tokens=1024 train.max_steps=4 train.optimizer=adamw_8bit
  ;;
dora)  # lora.dora on CUDA (~3 minutes on an H200): Mistral-7B's shape (random init), LoRA r16 on every linear of a bf16
  # base, 4,096 tokens a micro-batch, checkpointed: plain LoRA, then DoRA with dropout 0 and 0.05, each run's step time
  # and peak against the estimate it prints (DoRA adds the base and adapter outputs and, with dropout, a weight copy
  # per adapted linear to each layer's recompute, and 1.64 GiB of down_proj's row norms to each forward).
  dir=$(model_dir mistral-7b-dora '{}')
  recipe $W/mistral-7b-dora.yaml "$dir" 1 bfloat16 4096
  M="model.gradient_checkpointing=true train.loss_chunk_tokens=1024 train.max_steps=4"
  run mistral-7b-lora $FT $W/mistral-7b-dora.yaml $M
  run mistral-7b-dora $FT $W/mistral-7b-dora.yaml $M lora.dora=true
  run mistral-7b-dora-dropout $FT $W/mistral-7b-dora.yaml $M lora.dora=true lora.dropout=0.05
  ;;
rounds)  # rl.num_iterations on CUDA (~3 minutes on an H200): Mistral-7B LoRA GRPO, 8 prompts x 8 completions x 256
  # new tokens a round with the captured sampler: 4 steps sampling every step, then 4 steps in rounds of 2 (half the
  # sampling; the rollout's old-log-probability forward added), and GSPO's ratio; each run's seconds, its sampling
  # steps' generation_s, the clipped shares, the peak against the estimate (rollout_logps phases)
  grpo_lora 4
  run grpo-rounds1 $FT $W/lora.yaml $GRPO "$RL" rl.sampler=graph
  RL2="${RL%\}}, num_iterations: 2}"
  run grpo-rounds2 $FT $W/lora.yaml $GRPO "$RL2" rl.sampler=graph
  run grpo-rounds2-gspo $FT $W/lora.yaml $GRPO "$RL2" rl.sampler=graph rl.importance_sampling_level=sequence \
    rl.loss_type=grpo
  ;;
forwards)  # the estimate's no-grad forwards on CUDA (~4 minutes on an H200): benchmarks/no_grad_forwards.py at
  # Mistral-7B's own shape in bf16 (random init, LoRA r16, GSM8K pairs, 6 steps a run): each run's step time over its
  # baseline's (DPO with its reference precomputed; SFT on KTO's completions) against the estimate's ratio (the CPU's
  # shrunk model has a head of over half its FLOPs; a 7B's is 2%). A dry run keeps the CPU's shrunk shape.
  $PY benchmarks/no_grad_forwards.py --steps 6 --model-dir $G/mistral --gsm8k $G/gsm8k/train.jsonl \
    --workdir $W/forwards $( [[ $DRY == 0 ]] && echo --real ) >> "$OUT/$WHAT.jsonl" 2>> "$OUT/$WHAT.log"
  echo "no_grad_forwards.py: exit $?" | tee -a "$OUT/$WHAT.log"
  ;;
gemma4)  # Gemma 4 on CUDA (~4 minutes on an H200): no checkpoint config is on the CPU machine, so a text model shaped
  # from transformers' own Gemma4TextConfig defaults (30 layers of 2,304, a 262,144-token vocabulary, per-layer inputs
  # of 256 a layer, local layers of head size 256 and global ones of 512 with 2 K/V heads whose keys are their values,
  # the last 10 sharing keys and values with double-wide MLPs, logits capped at 30: 5.64B parameters), random init in
  # bf16, LoRA r16 at 4,096 tokens checkpointed: its peak against the estimate the run prints (the estimate's
  # layer_shapes and per-layer inputs, CPU-checked only); the same with experts beside each MLP (32 of 1,024 columns,
  # 4 a token, shaped by hand); then liger's Gemma 4 kernels on the dense one (3 steps). Rehearsed (GPU_SESSION_DRY=1).
  for variant in dense moe; do
    d=$W/models/gemma4-$variant
    mkdir -p "$d"
    cp $G/mistral/*.json "$d/"  # Mistral's tokenizer (its ids are below Gemma 4's vocabulary); config.json replaced
    $PY - "$d/config.json" "$variant" "$DRY" <<'PYEOF'
import json, sys
path, variant, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
c = dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=262144, hidden_size=2304,
         intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
         global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True, num_kv_shared_layers=10,
         use_double_wide_mlp=True, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
         sliding_window=512, final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0,
         bos_token_id=1, eos_token_id=2)
if dry:  # 4 layers of 128, a local and a global one, then the two sharing theirs
    c.update(vocab_size=32768, vocab_size_per_layer_input=32768, hidden_size=128, intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
             num_global_key_value_heads=2, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
             layer_types=["sliding_attention", "full_attention"] * 2)
if variant == "moe":
    c.update(enable_moe_block=True, num_experts=32, top_k_experts=4, moe_intermediate_size=64 if dry else 1024)
json.dump(c, open(path, "w"), indent=1)
PYEOF
    recipe $W/gemma4-$variant.yaml "$d" 1 bfloat16 4096
    run gemma4-$variant-lora $FT $W/gemma4-$variant.yaml model.gradient_checkpointing=true train.loss_chunk_tokens=1024 \
      train.max_steps=4
    echo "gemma4 $variant: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  done
  run gemma4-dense-lora-liger $FT $W/gemma4-dense.yaml model.gradient_checkpointing=true train.loss_chunk_tokens=1024 \
    train.max_steps=3 model.kernels=liger
  ;;
moe)  # the mixtures of experts on CUDA (5-8 minutes on an H200, its own call): Qwen3-30B-A3B's shape (the estimate's built-in
  # config, random init in bf16: 57 GiB, Mistral's tokenizer), LoRA r16 on GSM8K chats at 4,096 tokens with
  # checkpointing, each run's peak against the estimate it prints: all-linear (the router and every expert adapted,
  # the experts' adapters unmerged: 83.8 GiB by estimate-memory), attention alone, and all-linear with the
  # load-balancing loss; then 2 GRPO steps (the fast sampler: generation tokens/s); then a LoRA step of a small
  # Qwen3-MoE, unmerged against peft's merge (seconds and peak bytes, benchmarks/moe_lora_step.py)
  json=$($PY -c "import json; from llmtrain.memory.params import PRESETS
print(json.dumps({**PRESETS['qwen3-30b-a3b'], 'architectures': None}))")
  MOE=$(model_dir qwen3-30b-a3b "$json")
  recipe $W/moe.yaml "$MOE" 1 bfloat16 4096
  M="model.gradient_checkpointing=true train.loss_chunk_tokens=1024 train.max_steps=3"
  run moe-lora $FT $W/moe.yaml $M
  run moe-lora-attention $FT $W/moe.yaml $M "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
  run moe-lora-aux $FT $W/moe.yaml $M model.router_aux_loss_coef=0.001
  echo "training: done at ${SECONDS}s" | tee -a "$OUT/$WHAT.log"
  grpo_lora 2  # its GRPO and RL overrides (8 prompts x 8 completions x 256 new tokens), on the MoE's recipe
  run moe-grpo $FT $W/moe.yaml $GRPO "$RL" rl.sampler=graph model.gradient_checkpointing=true
  STEP=( --dtype bfloat16 --rows 8 --seq 1024 ); [[ $DRY == 1 ]] && STEP=( --rows 1 --seq 64 --repeat 1 )
  $PY benchmarks/moe_lora_step.py "${STEP[@]}" 2>>"$OUT/$WHAT.log" | tee "$OUT/moe-lora-step.jsonl"
  ;;
esac
echo "done: $WHAT" >> "$OUT/$WHAT.log"
