"""scripts/gpu_check.sh's test groups: each names files that exist, and together they cover
every GPU test (a file in no group would never run on a device)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
SCRIPT = (ROOT / "scripts" / "gpu_check.sh").read_text()
# the CPU suite's files whose tests also run on CUDA when there is one (kernels, LoRA)
CUDA_TOO = ["test_fused_ops.py", "test_lora.py", "test_pdl.py", "test_sampling_kernel.py",
            "test_shared_prefix.py", "test_splitk.py", "test_triton_attention.py",
            "test_w4a16.py"]  # fmt: skip


def groups() -> dict[str, list[str]]:
    """Each default group's files, as the script's own test_group function names them."""
    function = re.search(r"^test_group\(\) \{\n.*?^\}\n", SCRIPT, re.M | re.S).group(0)
    names = re.search(r"for group in \$\{TESTS:-([^}]*)\}", SCRIPT).group(1).split()
    listing = subprocess.run(
        ["bash", "-c", function + 'for g in "$@"; do echo "$g: $(test_group "$g")"; done', "-",
         *names],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    return {g: files.split() for g, files in (line.split(": ") for line in listing.splitlines())}


def test_every_group_names_files_that_exist():
    found = groups()
    assert found, "no groups found"
    for group, files in found.items():
        assert files, f"group {group} names no file"
        missing = [f for f in files if not (ROOT / f).is_file()]
        assert not missing, f"group {group} names files that do not exist: {missing}"


def test_the_groups_cover_every_gpu_test_once():
    named = [f for files in groups().values() for f in files]
    assert len(named) == len(set(named)), "a file is in two groups"
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    wanted |= {f"tests/{name}" for name in CUDA_TOO}
    assert wanted - set(named) == set(), "GPU tests in no group"
