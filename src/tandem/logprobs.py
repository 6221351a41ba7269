"""vLLM's module path `vllm.logprobs`: the logprob types of outputs under the names scripts import
them by (`from tandem.logprobs import Logprob`)."""

from __future__ import annotations

from tandem.outputs import FlatLogprobs, Logprob, PromptLogprobs, SampleLogprobs

LogprobsOnePosition = dict[int, Logprob]  # one position's logprobs by token id (vLLM's name)

__all__ = ["FlatLogprobs", "Logprob", "LogprobsOnePosition", "PromptLogprobs", "SampleLogprobs"]
