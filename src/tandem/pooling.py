"""Embeddings (vLLM's `LLM.embed` and the server's /v1/embeddings): a request's vector is the
final hidden state of its last prompt token, after the model's last norm (the last-token pooling
of decoder embedding models such as Qwen3-Embedding), L2-normalized unless asked not to (or a
sentence-transformers model has no Normalize module). A sequence classifier's (`LLM.classify`,
/classify) is its score head on that state, through the activation its config names
(`problem_type`: softmax, or sigmoid for one label or several labels at once, or none for a
regression) unless asked not to; a cross-encoder's score (`LLM.score`) takes the activation
sentence-transformers names, else the same. `ModelPooling` reads these from the model's files.

A pooling request runs as a one-token generation: the step that computes its last prompt token
samples from that token's row, as any prompt's last step does, and the same row of the hidden
states is its vector. The host lists each such row's index among the step's tokens in the slot's
`PoolingBuffers`; after the forward pass the step gathers those rows into the slot's device
output, which comes back on the D2H stream with the step's other outputs. The engine then
finishes the request with its vector instead of the sampled token. Such steps run eagerly or as
pieces (never a whole decode graph), as steps with prompt-logprob rows do. Normalizing and
truncating (`dimensions`, for Matryoshka models) and the probabilities happen on the host: a
vector per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.model_files import read_json
from tandem.sampling import SamplingParams

if TYPE_CHECKING:
    from tandem.request import Request


# "score": a cross-encoder's pair, through classify's head and the model's score activation
TASKS = ("embed", "classify", "score")
# sentence-transformers' activation_fn names -> the activation applied on the host
ST_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.Tanh": "tanh",
}


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's pooling parameters of an embedding request: `use_activation` (for embeddings the L2
    normalization; None: on) and `dimensions` (keep the first that many values, then normalize:
    Matryoshka embeddings)."""

    use_activation: bool | None = None
    dimensions: int | None = None
    # "embed" or "classify"; None: the call's (LLM.embed, LLM.classify; AsyncLLM.encode: "embed")
    task: str | None = None
    # vLLM's: the prompt's last tokens kept (-1: all that fit), as the calls' own argument
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None  # vLLM's older name for use_activation

    def activated(self) -> bool | None:
        """use_activation, or its older name's value (None: the model's default)."""
        return self.use_activation if self.use_activation is not None else self.normalize

    def truncation(self, given: int | None) -> int | None:
        """The prompt's truncation: the call's `given` or these params' (one of them, or the
        same value in both)."""
        mine = self.truncate_prompt_tokens
        if given is not None and mine is not None and given != mine:
            raise ValueError(
                f"truncate_prompt_tokens is {given} in the call but {mine} in pooling_params"
            )
        return mine if given is None else given

    def for_task(self, task: str) -> PoolingParams:
        """These params for a call that pools for `task`; a ValueError if they name another
        task (vLLM's "cannot overwrite" check), not silently replaced."""
        if self.task is not None and self.task != task:
            raise ValueError(
                f"pooling_params.task is {self.task!r}, but this call pools for {task!r}"
            )
        return replace(self, task=task)

    def validate(self, hidden_size: int, num_labels: int) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.task != "embed" and not num_labels:
            raise ValueError(
                f"{self.task} needs a sequence classifier (a *ForSequenceClassification "
                "checkpoint, with its score head); this model generates"
            )
        if self.task != "embed" and self.dimensions is not None:
            raise ValueError(f"dimensions applies to embeddings, not to {self.task}")
        for name in ("use_activation", "normalize"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None, got {value!r}")
        if None not in (self.use_activation, self.normalize) and (
            self.use_activation != self.normalize
        ):
            raise ValueError("normalize is use_activation's older name: give one value")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not d > 0):
            raise ValueError(f"dimensions must be a positive int or None, got {d!r}")
        if d is not None and d > hidden_size:
            raise ValueError(f"dimensions={d} is more than the model's {hidden_size} values")


def pooling_carrier(truncate_prompt_tokens: int | None, side: str | None = None) -> SamplingParams:
    """The SamplingParams a pooling request travels with: one greedy step, no text; its prompt
    cut to `truncate_prompt_tokens` on `side` (None: pooling's, the first tokens kept)."""
    return SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False,
        truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=side,
    )  # fmt: skip


@dataclass(frozen=True)
class ModelPooling:
    """How a model pools, from its files as vLLM reads them: whether its embeddings are refused
    (a pooling mode other than the last token's), normalized by default, and Matryoshka; the
    activation of its classes and of its scores."""

    refusal: str | None = None  # why embeddings are refused
    normalize: bool = True  # embeddings L2-normalized unless asked not to
    # config.json's matryoshka_dimensions; () for any, with is_matryoshka; None: not Matryoshka
    matryoshka: tuple[int, ...] | None = None
    classify: str = "softmax"  # "softmax", "sigmoid" or "identity"
    score: str = "sigmoid"  # as classify, or "tanh"
    score_refusal: str | None = None  # an activation_fn tandem does not apply

    @classmethod
    def of(cls, folder: Path | None, hf_config: dict, num_labels: int) -> ModelPooling:
        unreadable = None
        try:
            modules = st_modules(folder)
        except ValueError as error:  # refuses embeddings alone: the model still generates
            modules, unreadable = None, str(error)
        types = {m.get("type"): m.get("path") for m in modules or () if isinstance(m, dict)}
        pooled = "sentence_transformers.models.Pooling" in types
        pooling_dir = types.get("sentence_transformers.models.Pooling") or "1_Pooling"
        problem = hf_config.get("problem_type")
        classify = (
            "identity" if problem == "regression"
            else "sigmoid" if problem == "multi_label_classification" or num_labels < 2
            else "softmax"
        )  # fmt: skip
        named = (hf_config.get("sentence_transformers") or {}).get(
            "activation_fn"
        ) or hf_config.get("sbert_ce_default_activation_function")
        dims = hf_config.get("matryoshka_dimensions")
        return cls(
            refusal=unreadable or module_refusal(types) or pooling_refusal(folder, pooling_dir),
            # as vLLM: modules.json decides only where it has a Pooling module
            normalize=not pooled or "sentence_transformers.models.Normalize" in types,
            matryoshka=tuple(dims) if dims else (() if hf_config.get("is_matryoshka") else None),
            classify=classify,
            score=ST_ACTIVATIONS.get(named, classify) if named else classify,
            score_refusal=None if named is None or named in ST_ACTIVATIONS else (
                f"this model's scores go through {named} (its sentence-transformers "
                f"activation_fn); tandem applies {', '.join(sorted(ST_ACTIVATIONS))}"
            ),
        )  # fmt: skip

    def check(self, params: PoolingParams) -> None:
        """ValueError for what this model cannot pool as `params` ask (vLLM's wording)."""
        if params.task == "embed" and self.refusal is not None:
            raise ValueError(self.refusal)
        if params.task == "score" and self.score_refusal is not None:
            raise ValueError(self.score_refusal)
        if params.dimensions is not None and self.matryoshka is None:
            raise ValueError(
                "this model does not support Matryoshka representation (no "
                "matryoshka_dimensions or is_matryoshka in config.json): dimensions would give "
                "poor embeddings"
            )
        if (
            params.dimensions is not None
            and self.matryoshka
            and (params.dimensions not in self.matryoshka)
        ):
            raise ValueError(
                f"this model supports the Matryoshka dimensions {list(self.matryoshka)}, "
                f"got dimensions={params.dimensions}"
            )

    def activation(self, params: PoolingParams) -> str:
        """What a request's pooled values go through: its use_activation over the model's."""
        activated = params.activated()
        if activated is False:
            return "identity"
        if params.task == "embed":
            return "normalize" if activated or self.normalize else "identity"
        return self.score if params.task == "score" else self.classify


@dataclass
class PoolingStep:
    """The step's pooling requests, in the order of their rows in `PoolingBuffers`."""

    requests: list[Request]


class PoolingBuffers:
    """One slot's pooling rows and vectors, host (pinned on CUDA) and device."""

    def __init__(self, max_seqs: int, hidden_size: int, device: torch.device, num_labels: int = 0):
        pin = device.type == "cuda"

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, (torch.zeros(shape, dtype=dtype, device=device) if pin else host)

        # [max_seqs] int32: each pooled row's index among the step's tokens
        self.host_rows, self.dev_rows = pair((max_seqs,), torch.int32)
        # [max_seqs, hidden_size] float32: those rows of the final hidden states
        self.host_vectors, self.dev_vectors = pair((max_seqs, hidden_size), torch.float32)
        # [max_seqs, num_labels] float32: a classifier's scores of those rows (none: 0 labels)
        self.host_scores, self.dev_scores = pair((max_seqs, num_labels), torch.float32)
        self.np_rows = self.host_rows.numpy()
        self.np_vectors = self.host_vectors.numpy()
        self.np_scores = self.host_scores.numpy()

    def copy_in(self, num_rows: int) -> None:
        """H2D of the step's row indices, on the current stream (the caller's h2d_stream)."""
        self.dev_rows[:num_rows].copy_(self.host_rows[:num_rows], non_blocking=True)

    def copy_out(self, num_rows: int) -> None:
        """D2H of the step's vectors, on the current stream (the caller's d2h_stream)."""
        self.host_vectors[:num_rows].copy_(self.dev_vectors[:num_rows], non_blocking=True)
        if self.dev_scores.shape[1]:
            self.host_scores[:num_rows].copy_(self.dev_scores[:num_rows], non_blocking=True)


def has_rows(requests: list[Request], num_new_tokens: list[int]) -> bool:
    """Whether a planned step computes a pooling request's last prompt token (num_computed_tokens
    already counts the step's tokens)."""
    return any(
        r.pooling is not None
        and r.num_computed_tokens - n < r.num_prompt_tokens <= r.num_computed_tokens
        for r, n in zip(requests, num_new_tokens, strict=True)
    )


def plan_rows(
    requests: list[Request],
    pooled: np.ndarray,
    query_start_loc: np.ndarray,
    buffers: PoolingBuffers,
) -> PoolingStep:
    """List the token rows of the step's pooling requests that sample (`pooled`: their indices
    among the step's requests; their last prompt token is in the step, the last of their
    tokens) in `buffers`' host side. E.g. query_start_loc [0, 3, 4, 8], pooled [0, 2] -> rows
    [2, 7]."""
    buffers.np_rows[: len(pooled)] = query_start_loc[pooled + 1] - 1
    return PoolingStep([requests[i] for i in pooled])


@torch.inference_mode()
def compute(
    hidden: torch.Tensor, buffers: PoolingBuffers, num_rows: int, score: torch.nn.Module | None
) -> None:
    """Gather the step's pooled rows of `hidden` [tokens, hidden] into the device vectors, and
    a classifier's `score` of them into the device scores."""
    rows = hidden[buffers.dev_rows[:num_rows].long()]
    buffers.dev_vectors[:num_rows].copy_(rows)
    if score is not None:
        buffers.dev_scores[:num_rows].copy_(score(rows))


def store(step: PoolingStep, buffers: PoolingBuffers, model: ModelPooling) -> None:
    """Give each of a read-back step's requests its vector, truncated and through its
    activation (float64 sums, float32 values as vLLM returns them)."""
    for k, request in enumerate(step.requests):
        if request.finished:
            continue  # aborted while the step was in flight
        params = request.pooling
        if params.task == "embed":
            values = buffers.np_vectors[k, : params.dimensions].astype(np.float64)
        else:
            values = buffers.np_scores[k].astype(np.float64)
        request.pooled = activated(values, model.activation(params)).astype(np.float32).tolist()


def activated(values: np.ndarray, activation: str) -> np.ndarray:
    if activation == "normalize":
        return values / max(math.sqrt(float(values @ values)), 1e-12)
    if activation == "softmax":
        exp = np.exp(values - values.max())
        return exp / exp.sum()
    if activation == "sigmoid":
        return 1 / (1 + np.exp(-values))
    if activation == "tanh":
        return np.tanh(values)
    return values


def st_modules(folder: Path | None) -> list | None:
    """A sentence-transformers model's modules.json (its modules in order), or None."""
    path = folder / "modules.json" if folder is not None else None
    return read_json(path, list) if path is not None and path.is_file() else None


# the sentence-transformers modules embeddings go through here: the model, its pooling (the
# last token's) and the L2 normalization
ST_MODULES = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
)


def module_refusal(types: dict) -> str | None:
    """Why embeddings are refused for a modules.json module they would skip (a Dense
    projection after the pooling changes every vector and its width), or None."""
    others = sorted(str(t) for t in types if t not in ST_MODULES)
    if not others:
        return None
    return (
        f"this model's modules.json runs {', '.join(others)} on its embeddings; tandem applies "
        "its Transformer, last-token Pooling and Normalize modules alone"
    )


def pooling_refusal(folder: Path | None, pooling_dir: str = "1_Pooling") -> str | None:
    """Why this model's embeddings are refused, or None: a sentence-transformers model folder
    says how it pools (its Pooling module's config.json), and the engine pools the last token
    alone."""
    path = folder / pooling_dir / "config.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    modes = {k: v for k, v in read_json(path).items() if k.startswith("pooling_mode")}
    other = sorted(k for k, v in modes.items() if v and k != "pooling_mode_lasttoken")
    if not other:
        return None
    return (
        f"this model pools by {', '.join(other)} (its {pooling_dir}/config.json); tandem's "
        "embeddings take the last token's hidden state (pooling_mode_lasttoken) alone"
    )
