"""Rank 0's tensor-parallel worker processes: start them, drive them, notice when one dies.

Each rank > 0 runs `worker_main`: the same engine as rank 0, stepped in lockstep through a pipe
(see parallel.py for the scheme). A worker that fails sends its traceback back through the pipe
before it exits, so rank 0's error names the cause, not only an exit code.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import sys
import time
import traceback
import types
from collections.abc import Iterator
from typing import Any

import torch.multiprocessing as mp

from tandem.batch import StepFailed
from tandem.config import EngineConfig
from tandem.rpc import run_pickled

JOIN_TIMEOUT_S = 30  # shutdown: how long the other ranks get to leave before they are killed
RPC_POLL_S = 0.05  # collective_rpc: how often rank 0 looks at the others while it waits


class RankExited(RuntimeError):
    """A tensor-parallel rank's process is gone; the engine it belonged to cannot step again."""


class Workers:
    """Rank 0's handle on ranks 1..size-1: their processes and the pipes that drive them."""

    def __init__(self, config: EngineConfig, port: int):
        ctx = mp.get_context("spawn")
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.processes = []
        self.errors: dict[int, str] = {}  # rank -> the traceback it sent before it exited
        self.rpc_calls = 0  # collective_rpc calls so far: each answer names its call
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(
                target=worker_main, args=(rank, config, port, theirs), daemon=True
            )
            with without_main_module():
                process.start()
            theirs.close()  # the worker's end: once it exits, reading ours ends with EOFError
            self.pipes.append(ours)
            self.processes.append(process)

    def step(self, commands: list[tuple[Any, ...]]) -> None:
        """Apply `commands` (("add", request_id, params, prompt_token_ids, cache_salt, pooling,
        lora_request, priority), ("abort", id) or ("reset_prefix_cache",)), then step."""
        self.check()
        for pipe in self.pipes:
            try:
                pipe.send(("step", commands))
            except (BrokenPipeError, ConnectionResetError):
                self.check()  # it died since the check above
                raise

    def apply(self, commands: list[tuple[Any, ...]]) -> None:
        """Apply `commands` now, without a step (("call", method, args) runs an Engine method)."""
        self.check()
        for pipe in self.pipes:
            pipe.send(("apply", commands))

    def start_rpc(self, commands: list[tuple[Any, ...]], payload: bytes) -> None:
        """Apply `commands`, then start the pickled call (rpc.py) on every rank."""
        self.apply(commands)
        self.rpc_calls += 1
        for pipe in self.pipes:
            pipe.send(("rpc", (self.rpc_calls, payload)))

    def rpc_results(self, timeout: float | None) -> list:
        """The call's results in rank order. RuntimeError naming the ranks where it raised;
        TimeoutError after `timeout` seconds without every result (a late one is dropped when
        it comes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        replies = []
        for rank, pipe in enumerate(self.pipes, 1):
            while True:
                while not pipe.poll(RPC_POLL_S):
                    self.check()
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(
                            f"tensor-parallel rank {rank} did not answer in {timeout} s"
                        )
                message = pipe.recv()
                if message[0] == "error":  # its traceback, sent as it exits
                    self.errors[rank] = message[1]
                    raise RankExited(
                        f"tensor-parallel rank {rank} failed{self._last_error(rank, pipe)}"
                    )
                if message[1] == self.rpc_calls:  # not a late answer to a call that timed out
                    replies.append(message[2:])
                    break
        failed = [
            f"rank {r}:\n{value}" for r, (kind, value) in enumerate(replies, 1) if kind != "result"
        ]
        if failed:
            raise RuntimeError("the call failed on other ranks:\n" + "\n".join(failed))
        return [value for _, value in replies]

    def check(self) -> None:
        """Raise if a rank's process is gone: the others would wait for it at their next collective."""
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes, strict=True), 1):
            if not process.is_alive():
                process.join()
                raise RankExited(
                    f"tensor-parallel rank {rank} exited (exit code {process.exitcode}); "
                    f"this engine cannot go on{self._last_error(rank, pipe)}"
                )

    def _last_error(self, rank: int, pipe: multiprocessing.connection.Connection) -> str:
        """What a dead worker sent before it exited (its traceback), as the tail of a message."""
        with contextlib.suppress(EOFError, OSError):
            while rank not in self.errors and pipe.poll():
                order, text = pipe.recv()
                if order == "error":
                    self.errors[rank] = text
        return f". Its error:\n{self.errors[rank]}" if rank in self.errors else ""

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def stop(self) -> None:
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            # one that exits meanwhile has closed its pipe
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if process.is_alive():
                    pipe.send(("stop", []))

    def join(self) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # stuck in a collective that cannot complete: free its GPU
                process.kill()
                process.join()

    def kill(self) -> None:
        """End every rank now: rank 0 failed while they start, so no one will drive them."""
        for process in self.processes:
            process.kill()
            process.join()


@contextlib.contextmanager
def without_main_module() -> Iterator[None]:
    """Spawn a worker that does not re-run the caller's `__main__`.

    A spawned process imports the parent's main script again, which fails for a script read
    from standard input (`python - < script.py`) and starts the engine again in a script
    without an `if __name__ == "__main__"` guard. Workers run tandem's code only.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def worker_main(
    rank: int, config: EngineConfig, port: int, pipe: multiprocessing.connection.Connection
) -> None:
    """A rank > 0: the same engine, stepped in lockstep with rank 0."""
    try:
        from tandem.engine import Engine  # here, not at the top: engine.py imports this module

        engine = Engine(config, rank=rank, port=port)
        follow(engine, pipe)
    except BaseException:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc()))
        raise


def follow(engine: Any, pipe: multiprocessing.connection.Connection) -> None:
    """Apply rank 0's commands and step, until it says stop."""
    while True:
        try:
            order, commands = pipe.recv()
        except EOFError:  # rank 0 is gone: leave at once, without a shutdown whose device work
            os._exit(0)  # could wait forever on a collective rank 0 never joins
        if order == "stop":
            break
        if order == "rpc":  # commands: (the call's number, the pickled call: rpc.py)
            call, payload = commands
            pipe.send(("rpc", call, *run_pickled(engine, payload)))
            continue
        for command in commands:
            if command[0] == "add":
                _, request_id, params, prompt_token_ids, cache_salt, pooling, lora, priority = (
                    command
                )
                engine.enqueue(
                    engine.make_request(
                        request_id,
                        params,
                        prompt_token_ids=prompt_token_ids,
                        cache_salt=cache_salt,
                        pooling=pooling,
                        lora_request=lora,
                        priority=priority,
                    )
                )
            elif command[0] == "reset_prefix_cache":
                engine.reset_prefix_cache()
            elif command[0] == "call":
                getattr(engine, command[1])(*command[2])
            else:
                engine.abort(command[1])
        if order == "step":
            # rank 0's step fails alike: each rank aborted the step's requests itself
            with contextlib.suppress(StepFailed):
                engine.step()
    engine.shutdown()
