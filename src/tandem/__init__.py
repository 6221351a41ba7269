"""tandem: continuous batching over a paged KV cache, with the CPU one step ahead of the GPU."""

from tandem.llm import LLM, CompletionOutput, RequestOutput
from tandem.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
