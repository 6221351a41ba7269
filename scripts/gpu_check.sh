#!/usr/bin/env bash
# The whole GPU check in one call: GPU tests (incl. the stream sanitizer run), kernel benchmark,
# graph memory, then the named workloads sync vs async (plus COMPARE, e.g. "sync transformers"),
# each with a traced run. Results go to $OUT (or ./out); print a short table last.
# UNFUSED=1 also runs each workload (async only) with TANDEM_FUSED_KERNELS=0; PROFILE=1 profiles a
# decode step both ways.
# Usage on the device machine: [SKIP_TESTS=1] [REPEATS=2] scripts/gpu_check.sh seed small latency
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/traces
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q tests/gpu tests/test_triton_attention.py tests/test_fused_ops.py \
    tests/test_sampling_kernel.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
fi
python3 benchmarks/kernels.py --json "$OUT/kernels.json"
[ -n "${GRAPH_MEMORY:-}" ] && python3 benchmarks/graph_memory.py --model qwen3-0.6b --max-num-seqs 256 \
  | tee "$OUT/graph_memory.txt"
if [ -n "${PROFILE:-}" ]; then
  for fused in 1 0; do
    echo "== decode step profile, TANDEM_FUSED_KERNELS=$fused"
    TANDEM_FUSED_KERNELS=$fused python3 benchmarks/profile_step.py --cuda-graphs --input-len 1000 \
      --rows 14 > "$OUT/profile_fused$fused.txt" 2>&1
    grep -E "Self CUDA time total|^-|Name" "$OUT/profile_fused$fused.txt" | tail -2
  done
fi
for name in "$@"; do
  case $name in
    seed) args="--model llama-3-8b --input-len 128 --output-len 1024 --num-prompts 32 --max-num-seqs 32" ;;
    small) args="--model qwen3-0.6b --input-len 562 --output-len 562 --range-ratio 0.822 --num-prompts 256" ;;
    latency) args="--model llama-3-8b --input-len 128 --output-len 512 --num-prompts 1 --max-num-seqs 1" ;;
    *) echo "unknown workload $name"; continue ;;
  esac
  echo "== $name"
  python3 -m tandem.cli bench throughput $args --load-format dummy --compare ${COMPARE:-sync} \
    --repeats "${REPEATS:-3}" --output-json "$OUT/bench_$name.json" \
    --trace "/tmp/traces/trace_$name.json" 2>&1 | tail -6
  if [ -n "${UNFUSED:-}" ]; then
    TANDEM_FUSED_KERNELS=0 python3 -m tandem.cli bench throughput $args --load-format dummy \
      --repeats "${REPEATS:-3}" --output-json "$OUT/bench_${name}_unfused.json" 2>&1 | tail -3
  fi
done
tar -czf "$OUT/traces.tar.gz" -C /tmp traces
python3 scripts/bench_table.py "$OUT"/bench_*.json
