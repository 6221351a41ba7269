"""A model folder's files, read with errors that name them: a JSON config that does not parse,
or a safetensors file cut short, is a ValueError saying which file and why, where the parsers
alone would say only why (a bare JSONDecodeError, safetensors' "invalid header length")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

if TYPE_CHECKING:
    import torch


def read_json(path: Path, kind: type = dict) -> Any:
    """The JSON object (or `kind`, e.g. list) in `path`; ValueError naming the file if it is
    not readable as one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a readable JSON file: {error}") from error
    if not isinstance(value, kind):
        what = "a JSON object" if kind is dict else f"a JSON {kind.__name__}"
        raise ValueError(f"{path} must hold {what}, got {type(value).__name__}")
    return value


def safetensors_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each tensor in the safetensors file, in the file's key order;
    ValueError naming the file if its header or data cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)
    except SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from error
