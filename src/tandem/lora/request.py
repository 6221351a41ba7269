"""A request's LoRA adapter: vLLM's `LoRARequest` (at vLLM's module path, `vllm.lora.request`)
and the checks of one call's adapters. The adapters themselves are `adapters.py`'s.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter's name, its id (>= 1; one id, one adapter) and its PEFT folder (a
    str or path-like, kept as a str)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    # vLLM's, taken at their defaults: an id names one adapter here (new weights take a new
    # id, as the server's /v1/load_lora_adapter gives them); adapters are PEFT folders
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        lora_id = self.lora_int_id
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {lora_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"lora_path must name the adapter's PEFT folder, got {self.lora_path!r}"
            )
        if self.load_inplace is not False:
            raise ValueError(
                "load_inplace=True: here one lora_int_id names one adapter's weights; give the "
                "new weights a new lora_int_id (requests under the old one keep theirs)"
            )
        if self.tensorizer_config_dict is not None or self.is_3d_lora_weight is not False:
            raise ValueError(
                "tensorizer_config_dict and is_3d_lora_weight are not supported: an adapter is a "
                "PEFT folder (adapter_config.json and its safetensors)"
            )

    @property
    def identity(self) -> tuple[int, str, str]:
        """Id, name and folder: an id may name another adapter once its first has left the
        adapter cache, so the id alone does not tell two adapters apart."""
        return self.lora_int_id, self.lora_name, self.lora_path

    @property
    def cache_key(self) -> bytes:
        """The prefix cache's extra key of a first block: KV under one adapter is its own (0xff
        first, a byte no UTF-8 cache salt holds, then a digest of its identity: an id given to
        another adapter meets none of the first one's KV)."""
        named = repr(self.identity).encode()
        return b"\xfflora:" + hashlib.blake2b(named, digest_size=16).digest()


def check_one_adapter_per_id(loras: Iterable[LoRARequest | None]) -> None:
    """ValueError where two of `loras` (one call's) give one id to two adapters."""
    named: dict[int, LoRARequest] = {}
    for lora in loras:
        if lora is not None:
            first = named.setdefault(lora.lora_int_id, lora)
            if first.identity != lora.identity:
                raise id_clash(first, lora)


def id_clash(held: LoRARequest, request: LoRARequest) -> ValueError:
    return ValueError(
        f"lora_int_id {request.lora_int_id} names adapter {held.lora_name!r} ({held.lora_path}); "
        f"{request.lora_name!r} ({request.lora_path}) needs an id of its own"
    )


def per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
    """A call's `lora_request` (one for all, or one per prompt) as one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, list | tuple):
        raise TypeError(
            "lora_request must be a LoRARequest, a list of them (one per prompt) or None, "
            f"got {type(lora_request).__name__}"
        )
    if len(lora_request) != count:
        raise ValueError(f"got {len(lora_request)} lora_requests for {count} prompts")
    return list(lora_request)
