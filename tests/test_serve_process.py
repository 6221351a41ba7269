"""`tandem serve` as a process: how it ends. A real uvicorn server on 127.0.0.1 in a subprocess,
serving the tiny model; every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}

# serve() over an engine whose steps are slowed (so a stream outlasts the drain) and whose
# step number FAIL_AT raises, as a lost device would; the process exits with serve()'s code
SLOW_SERVER = """
import sys, time
from tandem.async_llm import AsyncLLM
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.server.lifecycle import serve
from tandem.server.options import ServerOptions

folder, port, delay, fail_at, drain = sys.argv[1:6]
engine = Engine(EngineConfig(model=folder, max_model_len=1024, block_size=8))
step, steps = engine.step, [0]

def slow_step():
    steps[0] += 1
    if steps[0] == int(fail_at):
        raise RuntimeError("device lost")
    time.sleep(float(delay))
    return step()

engine.step = slow_step
llm = AsyncLLM(engine)
code = serve(llm, "tiny", "127.0.0.1", int(port), ServerOptions(drain_timeout_s=float(drain)))
print(f"serve returned {code}; engine running: {llm.is_running}", flush=True)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(
    command: list[str], scheme: str = "http", verify: ssl.SSLContext | bool = True
) -> Iterator[tuple[subprocess.Popen, str]]:
    """Start a server process, wait for /health, yield it and its URL; kill it if still up."""
    port = command[command.index("PORT")] = str(free_port())
    url = f"{scheme}://127.0.0.1:{port}"
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", verify=verify).status_code == 200:
                    break
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def slow_server(folder: str, delay: float, fail_at: int = 0, drain: float = 30.0) -> list[str]:
    return [sys.executable, "-c", SLOW_SERVER, folder, "PORT", str(delay), str(fail_at), str(drain)]


class Stream(threading.Thread):
    """One streamed completion read on a thread: its events, and whether the first has come."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.error: Exception | None = None
        self.first = threading.Event()

    def run(self) -> None:
        body = {"prompt": "Once upon", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        self.events.append(line)
                        self.first.set()
        except Exception as error:  # the test reads it
            self.error = error
        finally:
            self.first.set()

    def texts(self) -> list[dict]:
        return [json.loads(e[6:]) for e in self.events if e != "data: [DONE]"]


def test_sigterm_lets_short_streams_finish_ends_long_ones_with_an_error_event_and_exits_0(folder):
    with process(slow_server(folder, delay=0.05, drain=2.0)) as (proc, url):
        short, long = Stream(url, 10), Stream(url, 900)  # 0.5 s and 45 s of steps
        for stream in (short, long):
            stream.start()
            assert stream.first.wait(timeout=30)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 2.0 + 5 + 5  # drain, margin, engine shutdown
        output = proc.stdout.read()
    for stream in (short, long):
        stream.join(timeout=10)
        assert stream.error is None, stream.error
        assert stream.events[-1] == "data: [DONE]"
    assert short.texts()[-1]["choices"][0]["finish_reason"] == "length"
    last = long.texts()[-1]
    assert "shutting down" in last["error"]["message"], last
    assert "serve returned 0; engine running: False" in output


def test_a_fatal_engine_error_fails_the_open_stream_then_the_server_exits_1(folder):
    with process(slow_server(folder, delay=0.02, fail_at=30)) as (proc, url):
        stream = Stream(url, 500)
        stream.start()
        stream.join(timeout=30)
        assert proc.wait(timeout=30) == 1
        output = proc.stdout.read()
    assert stream.events[-1] == "data: [DONE]"
    assert "device lost" in stream.texts()[-1]["error"]["message"]
    assert "serve returned 1; engine running: False" in output


def test_tandem_serve_exits_non_zero_with_one_line_when_the_engine_fails(folder, tmp_path):
    """The CLI's exit status: a supervisor restarts it."""
    script = tmp_path / "failing_cli.py"
    script.write_text(
        "import sys\n"
        "from tandem import engine\n"
        "def failing_step(self):\n"
        "    raise RuntimeError('device lost')\n"
        "engine.Engine.step = failing_step\n"
        "from tandem.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    command = [
        sys.executable,
        str(script),
        "serve",
        folder,
        "--port",
        "PORT",
        "--max-model-len",
        "128",
    ]
    with process(command) as (proc, url):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 500
        assert proc.wait(timeout=30) == 1
        output = proc.stdout.read()
    assert output.strip().splitlines()[-1].startswith("tandem: error: the engine failed")


def test_a_client_disconnect_is_one_log_line(folder):
    with process(slow_server(folder, delay=0.02)) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        for stream in (True, False):
            body = json.dumps({"prompt": "Hi", "max_tokens": 400, "ignore_eos": True,
                               "stream": stream})  # fmt: skip
            with socket.create_connection(("127.0.0.1", port)) as client:
                client.sendall(
                    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
                )
                time.sleep(1.0)  # generating
            time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        lines = proc.stdout.read().splitlines()
    disconnects = [line for line in lines if "disconnected" in line]
    assert len(disconnects) == 2, lines
    assert not any("Traceback" in line for line in lines), lines


def test_access_log_is_off_by_default_and_on_with_the_flag(folder):
    for flags, expected in (([], 0), (["--access-log"], 1)):
        command = [sys.executable, "-m", "tandem.cli", "serve", folder, "--port", "PORT",
                   "--max-model-len", "128", *flags]  # fmt: skip
        with process(command) as (proc, url):
            httpx.get(f"{url}/v1/models")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            output = proc.stdout.read()
        assert output.count('"GET /v1/models HTTP/1.1" 200') == expected, output
