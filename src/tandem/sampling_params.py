"""vLLM's module path `vllm.sampling_params`: the parameter classes under the name scripts import
them by (`from tandem.sampling_params import SamplingParams`)."""

from __future__ import annotations

from tandem.beam_search import BeamSearchParams
from tandem.repetition import RepetitionDetectionParams
from tandem.sampling import RequestOutputKind, SamplingParams
from tandem.structured import StructuredOutputsParams

__all__ = [
    "BeamSearchParams",
    "RepetitionDetectionParams",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
