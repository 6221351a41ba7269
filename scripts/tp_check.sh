#!/usr/bin/env bash
# Tensor parallelism on a machine with two or more GPUs (nvidia-h200-x2) in one call: the NCCL
# tests (TP=2 against TP=1 on the Llama-3-8B shape, the Llama-3-70B shape at TP=2), then the seed
# workload at TP=1 and TP=2. Logs go to $OUT (or ./out) as results.tar.gz; a table is printed last.
# Usage on the device machine: [REPEATS=N] scripts/tp_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# NVLink multicast stays off on lent machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
# each step has its own time limit: a hung collective costs minutes, not the whole call
timeout -k 5 240 python3 -m pytest -q -s tests/gpu/test_tensor_parallel_cuda.py -p no:cacheprovider \
  -rA 2>&1 | tee "$OUT/tp_tests.log" | grep -E "bf16 vs|PASSED|FAILED|ERROR|passed|failed"
seed="--model llama-3-8b --input-len 128 --output-len 1024 --num-prompts 32 --max-num-seqs 32"
for tp in 1 2; do
  echo "== seed, tensor parallel $tp"
  timeout -k 5 150 python3 -m tandem.cli bench throughput $seed --load-format dummy \
    --tensor-parallel-size $tp \
    --repeats "${REPEATS:-2}" --output-json "$OUT/bench_seed_tp$tp.json" 2>&1 \
    | tee "$OUT/bench_seed_tp$tp.log" | tail -4
done
shopt -s nullglob
reports=("$OUT"/bench_*.json)
[ ${#reports[@]} -gt 0 ] && python3 scripts/bench_table.py "${reports[@]}"
(cd "$OUT" && files=(*) && [ ${#files[@]} -gt 0 ] && tar -czf results.tar.gz --remove-files "${files[@]}")
exit 0
