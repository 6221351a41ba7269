"""LoRA adapters: `request.py` a request's `LoRARequest` (vLLM's, at vLLM's module path) and
`adapters.py` the adapters read into host memory and the device slots they run in."""

from __future__ import annotations

from tandem.lora.request import LoRARequest

__all__ = ["LoRARequest"]
