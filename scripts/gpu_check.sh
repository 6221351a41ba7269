#!/usr/bin/env bash
# The whole GPU check in one call: GPU tests (incl. the stream sanitizer run), then benchmarks.
# Usage on the device machine: scripts/gpu_check.sh [bench...]; logs go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q tests/gpu tests/test_triton_attention.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 benchmarks/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
for name in "$@"; do
  case $name in
    seed) args="--model llama-3-8b --input-len 128 --output-len 1024 --num-prompts 32 --max-num-seqs 32" ;;
    seed-short) args="--model llama-3-8b --input-len 128 --output-len 256 --num-prompts 32 --max-num-seqs 32" ;;
    small) args="--model qwen3-0.6b --input-len 562 --output-len 562 --range-ratio 0.822 --num-prompts 256" ;;
    latency) args="--model llama-3-8b --input-len 128 --output-len 512 --num-prompts 1 --max-num-seqs 1" ;;
  esac
  python3 -m tandem.cli bench throughput $args --load-format dummy --compare sync --repeats ${REPEATS:-3} \
    --output-json "$OUT/bench_$name.json" --trace "$OUT/trace_$name.json" 2>&1 | tee "$OUT/bench_$name.log" | tail -4
done
