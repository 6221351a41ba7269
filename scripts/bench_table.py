"""Print one line per mode of `tandem bench --output-json` files: the short table of a GPU check.

A file named bench_<workload>_<variant>.json (gpu_check's VARIANTS, BASELINE, ...) also shows its
async ms/step over bench_<workload>.json's: 1.03 means the variant's steps take 3% longer.
"jit": Triton kernels compiled during the timed runs (none expected), and each run's seconds.
Usage: python3 scripts/bench_table.py out/bench_*.json
"""

from __future__ import annotations

import json
import pathlib
import sys


def main() -> None:
    reports = {pathlib.Path(p).stem: json.loads(pathlib.Path(p).read_text()) for p in sys.argv[1:]}
    print(f"{'file':28} {'mode':20} {'tok/s':>9} {'ms/step':>8} {'GPU act':>8} {'roofline':>8} "
          f"{'copy TB/s':>9} {'vs own':>7} {'jit':>4} {'hits':>6}  runs (s)")  # fmt: skip
    for stem, report in reports.items():
        copy = report["environment"].get("copy_tb_per_s")  # this machine's, where measured
        # E.g. bench_seed_baseline -> bench_seed
        own = reports.get("_".join(stem.split("_")[:2])) if stem.count("_") > 1 else None
        own_step = own and own["results"].get("async", {}).get("ms_per_step")
        for mode, r in report["results"].items():
            active = r.get("timeline", {}).get("gpu_active_pct")
            step = r.get("ms_per_step")
            versus = f"{step / own_step:.3f}" if own_step and step and mode == "async" else ""
            runs = " ".join(f"{t:.2f}" for t in r.get("seconds_all", []))
            hits = r.get("prefix_cache_hit_rate")
            print(
                f"{stem:28} {mode:20} {r['output_tokens_per_s']:9.0f} {step or 0:8.2f} "
                f"{'' if active is None else f'{active:.2f}%':>8} "
                f"{100 * r['roofline_fraction']:7.1f}% {'' if copy is None else f'{copy:.2f}':>9} "
                f"{versus:>7} {r.get('jit_compiles', ''):>4} "
                f"{'' if hits is None else f'{100 * hits:.1f}%':>6}  {runs}"
            )


if __name__ == "__main__":
    main()
