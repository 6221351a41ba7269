"""tandem on Ray (`pip install 'tandem[ray]'`): Ray Data batch inference, Ray Serve replicas.

import ray.data
from tandem.ray import generate

ds = ray.data.from_items([{"prompt": "Hello", "sampling_params": {"max_tokens": 32}}])
out = generate(ds, "Qwen/Qwen3-0.6B", concurrency=2)  # two engines, one GPU each
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as error:  # the extra is optional; say how to get it
    raise ImportError("tandem.ray needs Ray: pip install 'tandem[ray]'") from error

from tandem.ray.data import LLMPredictor, actor_resources, generate

__all__ = ["LLMPredictor", "actor_resources", "generate"]
