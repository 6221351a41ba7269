#!/usr/bin/env bash
# Nsight Compute over the decode attention kernels at the workloads' shapes (`benchmarks/
# kernels.py --eager`): one call's launches each (the third call), with the sections that say
# what bounds a kernel (throughput against its peaks, occupancy, the issue slots, the warp stall
# reasons, per kernel and per instruction). Per shape in $OUT/ncu (or ./out/ncu):
# SHAPE.txt (the sections), SHAPE.stalls.txt (the stall reasons, cycles per instruction issued)
# and SHAPE.sass.csv (the kernels' SASS, each instruction with its stall samples).
#   NCU_SHAPES="small small-fp8 moe seed rollout"   the shapes (kernels.py's EAGER_SHAPES, rollout)
#   NCU_TAG=-x   added to the files' names (e.g. a run under another environment setting)
# Usage on the device machine: scripts/ncu_attention.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT/ncu"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
ncu --version | tail -1
sections=""
for s in SpeedOfLight MemoryWorkloadAnalysis Occupancy LaunchStats SchedulerStats WarpStateStats \
  ComputeWorkloadAnalysis InstructionStats SourceCounters; do sections="$sections --section $s"; done
for shape in ${NCU_SHAPES:-small small-fp8 moe seed rollout}; do
  kernels=decode_kernel count=1
  if [ "$shape" = rollout ]; then kernels="decode_kernel|shared_prefix_kernel" count=2; fi
  # --clock-control none: the clocks as the benchmarks run them
  name=$shape${NCU_TAG:-} report=/tmp/ncu-$shape${NCU_TAG:-}
  ncu --clock-control none -k "regex:$kernels" -s $((2 * count)) -c $count $sections \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -f -o "$report" \
    python3 benchmarks/kernels.py --eager "$shape" >"$OUT/ncu/$name.log" 2>&1
  echo "$name: rc $?"
  ncu -i "$report.ncu-rep" --page details >"$OUT/ncu/$name.txt" 2>&1
  ncu -i "$report.ncu-rep" --page raw --metrics "regex:smsp__average_warps_issue_stalled_.*" \
    | grep -E "stalled_[a-z_]+_per_issue_active" | awk '$NF + 0 >= 0.05' >"$OUT/ncu/$name.stalls.txt"
  ncu -i "$report.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu/$name.sass.csv" 2>&1
done
