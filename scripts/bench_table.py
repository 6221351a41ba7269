"""Print one line per mode of `tandem bench --output-json` files: the short table of a GPU check.

Usage: python3 scripts/bench_table.py out/bench_*.json
"""

from __future__ import annotations

import json
import pathlib
import sys


def main() -> None:
    print(f"{'file':28} {'mode':20} {'tok/s':>9} {'ms/step':>8} {'GPU act':>8} {'roofline':>8} "
          f"{'copy TB/s':>9}")  # fmt: skip
    for path in sys.argv[1:]:
        report = json.loads(pathlib.Path(path).read_text())
        copy = report["environment"].get("copy_tb_per_s")  # this machine's, where measured
        for mode, r in report["results"].items():
            active = r.get("timeline", {}).get("gpu_active_pct")
            print(
                f"{pathlib.Path(path).stem:28} {mode:20} {r['output_tokens_per_s']:9.0f} "
                f"{r.get('ms_per_step') or 0:8.2f} {'' if active is None else f'{active:.2f}%':>8} "
                f"{100 * r['roofline_fraction']:7.1f}% {'' if copy is None else f'{copy:.2f}':>9}"
            )


if __name__ == "__main__":
    main()
