"""vLLM's `collective_rpc` and `apply_model`: a call run on every tensor-parallel rank's engine.

The call is an Engine method's name, or a function taking the rank's Engine first (vLLM's
"worker"); `apply_model(func)` is `func(engine.model)` on each rank. It runs between steps:
each rank waits for its device's launched work before and after the call, so the call sees
finished steps and later steps see what it wrote. A function for other ranks must pickle (a
module-level function, as multiprocessing sends it); that is checked before any rank runs it.

vLLM's `worker_extension_cls` names a class whose methods a call may name too: each rank's
engine holds an object of it (`worker_extension`) whose `self` reads as that rank's engine does
(`self.model_runner.model`, `self.rank`, `self.device`, the engine's methods) and keeps what the
methods set on it, as vLLM mixes the class into its worker.
"""

from __future__ import annotations

import functools
import importlib
import pickle
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch


def worker_extension(engine: Any, qualified_name: str) -> object | None:
    """The object of the class `qualified_name` names ("package.module.Class") that the engine's
    calls by name reach (None for ""); its `__init__` is not run, as vLLM's worker runs none. A
    ValueError for a name that names no class, or a class that would hide an engine attribute."""
    if not qualified_name:
        return None
    cls = import_class(qualified_name)
    clashes = sorted(
        name for name in dir(cls) if not name.startswith("__") and hasattr(type(engine), name)
    )
    if clashes:
        raise ValueError(
            f"worker_extension_cls {qualified_name!r} defines {', '.join(clashes)}, which the "
            "engine has already: rename them"
        )
    engine_ref = weakref.ref(engine)  # the engine holds the extension, not the other way round

    def engine_attribute(self: object, name: str) -> Any:
        return getattr(engine_ref(), name)

    extended = type(cls.__name__, (cls,), {"__getattr__": engine_attribute})
    return extended.__new__(extended)


def import_class(qualified_name: str) -> type:
    if not isinstance(qualified_name, str):
        raise TypeError(
            "worker_extension_cls must be a class's qualified name (a string), got "
            f"{type(qualified_name).__name__}"
        )
    module_name, _, name = qualified_name.rpartition(".")
    if not module_name or not name:
        raise ValueError(
            f"worker_extension_cls must be a class's qualified name (package.module.Class), "
            f"got {qualified_name!r}"
        )
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"worker_extension_cls {qualified_name!r} does not import: {error}"
        ) from error
    if not isinstance(found, type):
        raise ValueError(f"worker_extension_cls {qualified_name!r} is no class")
    return found


def check_call(
    engine: Any, method: str | Callable[..., Any], args: tuple, kwargs: dict | None
) -> None:
    """ValueError for a name that is no public method of the engine or its worker extension,
    TypeError for a method that is neither a name nor a callable, or arguments that are not a
    tuple and a dict."""
    if isinstance(method, str):
        if method.startswith("_") or not callable(bound(engine, method)):
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


def bound(engine: Any, name: str) -> Callable[..., Any] | None:
    """The engine's method of that name, else its worker extension's; None if neither has it."""
    if callable(getattr(type(engine), name, None)):
        return getattr(engine, name)
    extension = engine.worker_extension
    if extension is not None and callable(getattr(type(extension), name, None)):
        return getattr(extension, name)
    return None


def run_call(engine: Any, method: str | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`method(*args, **kwargs)` on this rank's engine (a name checked by `check_call`: the
    engine's method or its worker extension's), after its device's launched work."""
    call = bound(engine, method) if isinstance(method, str) else functools.partial(method, engine)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
    result = call(*args, **kwargs)
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
