"""Shared test fixtures."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# Hugging Face Hub names resolve from the local cache alone: no test reaches the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one core per worker: two workers' OpenMP pools spinning on the same cores slow both
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter; this must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem.model.tiny import make_tiny_model


@pytest.fixture(autouse=True)
def engines_given_back():
    """On a GPU, each test's engines are collected when it ends: an engine sizes its KV cache
    by the free memory, so one left for the collector starves the next test's."""
    yield
    if torch.cuda.is_available():
        gc.collect()


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """make_tiny(arch) -> folder of that arch's tiny random checkpoint, written once per session."""
    folders: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in folders:
            folders[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return folders[arch]

    return make


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny llama checkpoints of one shape, drawn with different seeds (weight updates)."""
    a = make_tiny_model(tmp_path_factory.mktemp("a"), "llama", seed=1)
    b = make_tiny_model(tmp_path_factory.mktemp("b"), "llama", seed=2)
    return str(a), str(b)


@pytest.fixture
def run_sanitized(tmp_path: Path) -> Callable[[str], str]:
    """run_sanitized(script) -> stdout of `python -c script TMP/tiny` under PyTorch's CUDA stream
    sanitizer, asserting that it exited cleanly and reported no unsynchronized access."""

    def run(script: str) -> str:
        env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
        result = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "tiny")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        assert "CSAN" not in result.stderr, result.stderr[-4000:]
        return result.stdout

    return run


PREEMPTING_RUN = """
import sys
from tandem import LLM, SamplingParams
from tandem.model.tiny import make_tiny_model
folder = make_tiny_model(sys.argv[1], "{arch}")
{setup}
for graphs in (False, True):
    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16, num_blocks=12,
              cuda_graphs=graphs)
    prompts = [{{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))}} for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    print("ok", graphs, sum(len(o.outputs[0].token_ids) for o in outs))
"""


def preempting_run(arch: str, setup: str) -> str:
    """A script for `run_sanitized`: `setup` (which defines `params`, for every request or one
    each) then six prompts on a tiny `arch` model in 12 blocks (preemption throughout), eager
    and with CUDA graphs, printing "ok <graphs> <tokens made>" after each."""
    return PREEMPTING_RUN.format(arch=arch, setup=textwrap.dedent(setup).strip())


@pytest.fixture
def counted_waits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps `Runner.wait` waited for, each wait run with CUDA's sync debug mode lifted to
    "default" and set back to "error" after: under "error", any other synchronizing call in
    the step loop raises."""
    from tandem.runner import Runner

    waits: list[int] = []
    original_wait = Runner.wait

    def counted_wait(self, batch, check=None):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return original_wait(self, batch, check)
        finally:
            waits.append(batch.step)
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(Runner, "wait", counted_wait)
    return waits


def wait_until_healthy(process: subprocess.Popen, url: str, seconds: float) -> None:
    """Wait for a `tandem serve` subprocess's /health to answer 200; fail if it exits first or
    takes longer than `seconds`."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, process.stdout.read().decode()
        assert time.monotonic() < deadline, "tandem serve did not come up"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return
        time.sleep(0.1)


@pytest.fixture
def kill_rank_1_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor parallelism: the first worker process is SIGKILLed right after it is started,
    before it joins the process group."""
    import signal

    from tandem.workers import Workers

    start_workers = Workers.__init__

    def start_then_kill(self, config, port):
        start_workers(self, config, port)
        os.kill(self.processes[0].pid, signal.SIGKILL)

    monkeypatch.setattr(Workers, "__init__", start_then_kill)
