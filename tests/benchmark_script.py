"""Importing a script of benchmarks/ in a test."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def import_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module. The folder is on the path only while it imports (with
    the scripts beside it that it imports): a folder of scripts named kernels, gemm, ... must
    not stand in for packages that later tests import."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
