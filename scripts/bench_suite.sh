#!/usr/bin/env bash
# Every benchmark of docs/performance.md, on the GPU machine, in the doc's order: one log per command in $OUT
# (NAME.log), its tail printed, each command under its own timeout and the whole group under BUDGET seconds.
#   bash scripts/bench_suite.sh              the headline tables (step, end to end, cold start, acceptance,
#                                            1B start-up): about 8 minutes on an H100
#   bash scripts/bench_suite.sh kernels      GEMV, race, sampling probabilities, argmax, split-KV attention
#   bash scripts/bench_suite.sh models       DeepSeek-V3 + MTP, V3.2 sparse MLA, Qwen3.5 (needs fla-core: carry
#                                            the wheels in .whl and set PIP=1)
#   bash scripts/bench_suite.sh tier         the GPU test tier (scripts/gpu_tier.sh, one process)
#   bash scripts/bench_suite.sh cpu          the CPU rows (prefill against transformers, import, metadata build)
#   bash scripts/bench_suite.sh multi        2+ GPUs: the all-reduce sweep, the 8B shape at TP 1 / 2 (/ 4 with four GPUs)
#   bash scripts/bench_suite.sh multitier    2+ GPUs: the multi-GPU tests (four GPUs: both halves at once; two: half a)
#   bash scripts/bench_suite.sh multitier_b  2+ GPUs: the multi-GPU tests' second half (DeepSeek, Qwen3.5)
#   bash scripts/bench_suite.sh all          every group in turn (several 10-minute calls' worth)
# Several groups may be named: `bash scripts/bench_suite.sh default kernels`.
# BUDGET (default 560 s per group): a step that would start past it is skipped; a step's timeout is cut to
# what is left. TAIL: lines of each log to print (default per step).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-560}

fresh() {  # empty Inductor and Triton caches for what follows (cold starts)
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
}
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2
  local left=$((group_start + BUDGET - SECONDS))
  if [ "$left" -le 10 ]; then echo "== $name: skipped (the group's ${BUDGET} s are spent)"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  echo "== $name: $*"; local s=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ${name} $((SECONDS - s)) s (limit ${t} s)"
  grep -av "it/s\]\|s/it\]\|Warning\|warnings.warn" "$OUT/$name.log" | tail -"${TAIL:-12}" | cut -c1-400
}

versions() {
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'CUDA', torch.version.cuda)"
  date -u +"measured %Y-%m-%d"
}

default_group() {  # the headline tables
  TAIL=16 step bench_step 240 python3 scripts/bench_step.py --kinds spec,plain --sizes 1,8,32 \
    --variants overlap --repeats 3
  TAIL=20 step bench_e2e 200 python3 scripts/bench_e2e.py --runs 2 --batches 1,8 --step-batches 1
  TAIL=20 step bench_adaptive 200 python3 scripts/bench_e2e.py --adaptive --new-tokens 128 --prompt-len 64 --runs 3 \
    --skip "K=2 acc 0,K=4 acc 0"
  TAIL=14 step cold_start 200 python3 scripts/bench_cold_start.py --variant default: --warm --artifacts
  TAIL=8 step builtin_generate 90 python3 -m draftgraph generate --device cuda
  TAIL=10 step startup_1b 150 python3 scripts/bench_startup.py --phases cold,warm_lazy --timeout 120
}

kernels_group() {
  TAIL=20 step bench_gemv 120 python3 scripts/bench_gemv.py --rows 1,5
  TAIL=16 step bench_race 200 python3 scripts/bench_race.py --rows 1,8,32,128 --sizes 1,32
  TAIL=8 step bench_sampling 90 python3 scripts/bench_sampling.py --rows 1,32,160
  TAIL=10 step bench_argmax 90 python3 scripts/bench_argmax.py --rows 1,5,32,160,640 --dtypes bfloat16
  TAIL=8 step bench_logits 60 python3 scripts/bench_logits.py
  TAIL=10 step bench_decode_attention 90 python3 scripts/bench_decode_attention.py --contexts 512,8192
}

models_group() {
  if [ "${PIP:-0}" = 1 ]; then pip install -q --no-index --no-deps .whl/*.whl; fi
  fresh; TAIL=10 step bench_deepseek 200 python3 scripts/bench_deepseek.py --sizes 1,4,16,64
  fresh; TAIL=30 step bench_sparse_mla 150 python3 scripts/bench_sparse_mla.py
  fresh; TAIL=25 step bench_qwen3_5 200 python3 scripts/bench_qwen3_5.py
}

tier_group() {  # gpu_tier.sh empties the caches itself and prints the host calibration
  N=1 TAIL=50 step gpu_tier 560 bash scripts/gpu_tier.sh
}

cpu_group() {
  TAIL=8 step bench_cpu_prefill 200 python3 scripts/bench_cpu_prefill.py --runs 7
  TAIL=3 step import_time 60 bash -c 'TIMEFORMAT="%R s"; for i in 1 2 3; do time python3 -c "import draftgraph"; done'
  TAIL=12 step bench_metadata_build 120 python3 scripts/bench_metadata_build.py
}

gpus() { nvidia-smi -L | wc -l; }

multi_group() {  # tensor parallelism (docs/performance.md "Tensor parallelism")
  local n; n=$(gpus)
  if [ "$n" -lt 2 ]; then echo "multi: needs two GPUs or more ($n here)"; return; fi
  local b8=(scripts/bench_8b.py --cases plain,vllm_ci_k3 --sizes 1,8,32 --profile plain)
  TAIL=22 step tp_sweep 120 torchrun --nproc-per-node 2 scripts/bench_tp.py --sweep
  TAIL=16 step b8_tp1 120 env CUDA_VISIBLE_DEVICES=0 python3 "${b8[@]}"
  TAIL=16 step b8_tp2 150 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 "${b8[@]}"
  if [ "$n" -ge 4 ]; then  # no rule ships for 4 ranks: our kernel forced
    TAIL=16 step b8_tp4 150 env CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node 4 "${b8[@]}" --push-kernel lamport
  fi
}

MULTI_A=(tests/gpu/test_multi_gpu_cuda.py tests/gpu/test_push_all_reduce_cuda.py tests/gpu/test_fused_all_reduce_cuda.py)
MULTI_A_K="not deepseek and not qwen3_5"   # Llama-3 + draft model, DP 2, EAGLE-3, fused, a killed rank, our kernels
MULTI_B_K="deepseek or qwen3_5"            # DeepSeek-V3 / V3.2 + MTP, expert parallelism, Qwen3.5-MoE, Qwen3.5 + MTP
multitier_group() {  # the multi-GPU tests: with four GPUs both halves at once on two pairs; with two, half a only
  local n common=(-q -p no:cacheprovider --tb=short --durations=0)
  n=$(gpus)
  if [ "$n" -lt 2 ]; then echo "multitier: needs two GPUs or more ($n here)"; return; fi
  fresh
  if [ "$n" -ge 4 ]; then
    CUDA_VISIBLE_DEVICES=2,3 timeout $((BUDGET - 20)) python3 -m pytest "${common[@]}" "${MULTI_A[0]}" \
      -k "$MULTI_B_K" >"$OUT/multitier_b.log" 2>&1 &
    TAIL=20 step multitier_a "$BUDGET" env CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest "${common[@]}" "${MULTI_A[@]}" \
      -k "$MULTI_A_K"
    wait; echo "== multitier_b (GPUs 2,3):"; tail -"${TAIL:-20}" "$OUT/multitier_b.log"
  else  # the whole set takes about 10 minutes on two GPUs: the other half is group multitier_b, in the next call
    TAIL=25 step multitier_a "$BUDGET" python3 -m pytest "${common[@]}" "${MULTI_A[@]}" -k "$MULTI_A_K"
    echo "multitier: half a only on $n GPUs; run group multitier_b in another call"
  fi
}

multitier_b_group() {  # the multi-GPU tests' second half (two GPUs)
  local n; n=$(gpus)
  if [ "$n" -lt 2 ]; then echo "multitier_b: needs two GPUs or more ($n here)"; return; fi
  fresh
  TAIL=25 step multitier_b "$BUDGET" python3 -m pytest -q -p no:cacheprovider --tb=short --durations=0 "${MULTI_A[0]}" \
    -k "$MULTI_B_K"
}

groups=("$@"); [ ${#groups[@]} -eq 0 ] && groups=(default)
[ "${groups[0]}" = all ] && groups=(default kernels models tier cpu)
[ "${groups[0]}" = cpu ] || versions
for g in "${groups[@]}"; do
  case $g in
    default|kernels|models|tier|cpu|multi|multitier|multitier_b) echo "=== group $g"; group_start=$SECONDS; "${g}_group" ;;
    *) echo "unknown group '$g' (default, kernels, models, tier, cpu, multi, multitier, all)"; exit 2 ;;
  esac
done
