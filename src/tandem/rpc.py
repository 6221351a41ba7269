"""vLLM's `collective_rpc` and `apply_model`: a call run on every tensor-parallel rank's engine.

The call is an Engine method's name, or a function taking the rank's Engine first (vLLM's
"worker"); `apply_model(func)` is `func(engine.model)` on each rank. It runs between steps:
each rank waits for its device's launched work before and after the call, so the call sees
finished steps and later steps see what it wrote. A function for other ranks must pickle (a
module-level function, as multiprocessing sends it); that is checked before any rank runs it.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch


def check_call(
    engine_type: type, method: str | Callable[..., Any], args: tuple, kwargs: dict | None
) -> None:
    """ValueError for a name that is no public method of `engine_type`, TypeError for a method
    that is neither a name nor a callable, or arguments that are not a tuple and a dict."""
    if isinstance(method, str):
        if method.startswith("_") or not callable(getattr(engine_type, method, None)):
            raise ValueError(f"the engine has no public method {method!r}")
    elif not callable(method):
        raise TypeError(
            f"method must be an Engine method's name or a callable, got {type(method).__name__}"
        )
    if not isinstance(args, tuple | list) or not isinstance(kwargs, dict | None):
        raise TypeError("args must be a tuple and kwargs a dict")


def pickled(method: str | Callable[..., Any], args: tuple, kwargs: dict | None) -> bytes:
    """The call as the other ranks receive it; TypeError when it does not pickle."""
    try:
        return pickle.dumps((method, tuple(args), kwargs or {}))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(
            f"the call must pickle to reach the other ranks (a module-level function): {error}"
        ) from error


def run_call(engine: Any, method: str | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`method(*args, **kwargs)` on this rank's engine (a name checked by `check_call`), after
    its device's launched work."""
    if isinstance(method, str):
        method = getattr(type(engine), method)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
    result = method(engine, *args, **kwargs)
    if cuda:
        torch.cuda.synchronize(engine.device)
    return result


def run_pickled(engine: Any, payload: bytes) -> tuple[str, Any]:
    """A worker's side: ("result", value), or ("failed", the traceback's text)."""
    try:
        return "result", run_call(engine, *pickle.loads(payload))
    except Exception:
        return "failed", traceback.format_exc()


def apply_to_model(engine: Any, func: Callable[[torch.nn.Module], Any]) -> Any:
    return func(engine.model)
