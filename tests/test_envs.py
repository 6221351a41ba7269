"""The TANDEM_* switches: one module reads them, bad values name the variable, docs list them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import envs

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("TANDEM_FUSED_KERNELS", "yes"),
        ("TANDEM_PDL", "2"),
        ("TANDEM_SPLITK", "off"),
        ("TANDEM_FP8_FUSED_QUANT", "no"),
        ("TANDEM_PIECEWISE", "true"),
        ("TANDEM_BLAS", "mkl"),
        ("TANDEM_DECODE_TILES", "64,3,2"),
        ("TANDEM_SHARED_PREFIX_TILES", "48,4,2"),
        ("TANDEM_DECODE_SPLITS", "3"),
        ("TANDEM_BLAS_SLICES", "3"),
        ("TANDEM_DECODE_MAXNREG", "300"),
        ("TANDEM_DECODE_MAXNREG", "many"),
        ("TANDEM_MOE_TILES", "64,48,4,3"),
        ("TANDEM_GLUON_DECODE", "gluon"),
        ("TANDEM_FP8_DECODE_STAGES", "1"),
        ("TANDEM_FP8_DECODE_ROW_LANES", "16"),
    ],
)
def test_a_value_a_switch_does_not_take_is_a_value_error_naming_it(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        envs.READERS[name]()
    with pytest.raises(ValueError, match=name):
        envs.check_all()


def test_unset_switches_take_their_defaults(monkeypatch):
    for name in envs.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert envs.current() == {
        "TANDEM_FUSED_KERNELS": True,
        "TANDEM_PDL": True,
        "TANDEM_FP8_V_BITS": True,
        "TANDEM_SPLIT_MERGE": True,
        "TANDEM_FUSED_ROPE": True,
        "TANDEM_SPLITK": True,
        "TANDEM_BLAS_SLICES": None,
        "TANDEM_FP8_FUSED_QUANT": True,
        "TANDEM_PIECEWISE": True,
        "TANDEM_BLAS": "cublas",
        "TANDEM_DECODE_TILES": None,
        "TANDEM_DECODE_SPLITS": None,
        "TANDEM_SHARED_PREFIX_TILES": None,
        "TANDEM_DECODE_MAXNREG": None,
        "TANDEM_GLUON_DECODE": "fp8",
        "TANDEM_FP8_DECODE_STAGES": 4,
        "TANDEM_FP8_DECODE_ROW_LANES": 8,
        "TANDEM_MOE_TILES": None,
    }


def test_zero_turns_a_flag_off(monkeypatch):
    monkeypatch.setenv("TANDEM_SPLITK", "0")
    assert envs.splitk() is False


def test_a_bad_switch_stops_the_cli_with_one_line_naming_it(tmp_path):
    env = {"PYTHONPATH": str(ROOT / "src"), "TANDEM_PDL": "yes", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "make-tiny-model", str(tmp_path / "m")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "tandem: error: TANDEM_PDL='yes': expected 0 or 1"
    ]


def test_no_module_but_envs_reads_a_tandem_variable():
    readers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "src" / "tandem").rglob("*.py")
        if path.name != "envs.py" and re.search(r"environ[^\n]*TANDEM_", path.read_text())
    ]
    assert readers == []
    every_name = set()
    for path in (ROOT / "src").rglob("*.py"):
        every_name |= set(re.findall(r"TANDEM_[A-Z0-9_]+", path.read_text()))
    assert every_name <= set(envs.SWITCHES) | set(envs.RENAMED)


def test_the_docs_table_lists_every_switch_with_its_default():
    table = (ROOT / "docs" / "environment.md").read_text()
    rows = dict(re.findall(r"^\| `(TANDEM_[A-Z0-9_]+)` \| ([^|]+) \|", table, re.M))
    assert set(rows) == set(envs.SWITCHES)
    for name, switch in envs.SWITCHES.items():
        assert rows[name].strip() == (f"`{switch.default}`" if switch.default else "unset")


def test_a_renamed_switch_names_its_new_name(monkeypatch):
    monkeypatch.setenv("TANDEM_FP8_DECODE", "triton")
    with pytest.raises(ValueError, match="TANDEM_FP8_DECODE was renamed: set TANDEM_GLUON_DECODE"):
        envs.check_all()
