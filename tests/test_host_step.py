"""benchmarks/host_step.py runs on the CPU (in its own process: it stubs the Triton kernels)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_host_step_times_an_eager_step_with_prefill_on_the_cuda_path():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_step.py"), "--decodes", "8",
         "--prompts", "4", "3", "--profile"],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert re.search(r"28 layers, 8 decodes \+ prompts \[4, 3\]: [\d.]+ ms per step", result.stdout)
    # the CUDA path's wrappers ran (their kernels stubbed), not the torch fallbacks
    assert "_add_rms_norm_triton" in result.stdout and "_rope_qk_triton" in result.stdout
