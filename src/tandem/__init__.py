"""tandem: continuous batching over a paged KV cache, with the CPU one step ahead of the GPU."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.async_llm import AsyncLLM, AsyncLLMEngine
    from tandem.beam_search import BeamSearchParams
    from tandem.config import AsyncEngineArgs, EngineArgs
    from tandem.inputs import EmbedsPrompt, PromptType, TextPrompt, TokensPrompt
    from tandem.llm import LLM
    from tandem.lora.request import LoRARequest
    from tandem.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from tandem.pooling import PoolingParams
    from tandem.sampling import SamplingParams
    from tandem.structured import StructuredOutputsParams

try:
    __version__ = version("tandem")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
    "BeamSearchParams",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EmbedsPrompt",
    "EngineArgs",
    "LoRARequest",
    "Logprob",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptType",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]

# Imported on first use, so `import tandem.x` (a tensor-parallel worker, `tandem --version`)
# does not load the engine and torch's CUDA set-up with it.
_LAZY = {
    "LLM": "tandem.llm",
    "AsyncEngineArgs": "tandem.config",
    "AsyncLLM": "tandem.async_llm",
    "AsyncLLMEngine": "tandem.async_llm",
    "EngineArgs": "tandem.config",
    "BeamSearchParams": "tandem.beam_search",
    "ClassificationOutput": "tandem.outputs",
    "ClassificationRequestOutput": "tandem.outputs",
    "CompletionOutput": "tandem.outputs",
    "EmbeddingOutput": "tandem.outputs",
    "EmbeddingRequestOutput": "tandem.outputs",
    "PoolingOutput": "tandem.outputs",
    "PoolingParams": "tandem.pooling",
    "PoolingRequestOutput": "tandem.outputs",
    "LoRARequest": "tandem.lora.request",
    "Logprob": "tandem.outputs",
    "RequestOutput": "tandem.outputs",
    "SamplingParams": "tandem.sampling",
    "ScoringOutput": "tandem.outputs",
    "ScoringRequestOutput": "tandem.outputs",
    "StructuredOutputsParams": "tandem.structured",
    "EmbedsPrompt": "tandem.inputs",
    "PromptType": "tandem.inputs",
    "TextPrompt": "tandem.inputs",
    "TokensPrompt": "tandem.inputs",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
