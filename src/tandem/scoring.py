"""vLLM's score API (`LLM.score`; the server's /score and /rerank): how well each text of
data_2 goes with its text of data_1, e.g. a query's documents for reranking.

Texts pair up 1:1, 1:N (one query, N documents) or N:N. A sequence classifier of one label (a
cross-encoder, a decoder-only reranker) reads each pair as one prompt, made by the tokenizer's
pair encoding (its post-processor, e.g. BOS before each text), or by the two texts joined where
config.json says `use_sep_token: false` (vLLM's "LLM as reranker"); a pair's score is that
label's probability (sigmoid; its raw logit with use_activation=False). Any other model embeds
each text alone (pooling.py; 1:N's one text once), and a pair's score is the cosine similarity
of its embeddings.
A classifier of several labels gives no score: use classify.

    data_1, data_2 ─pairs─> firsts, seconds ─prompts─> pooled vectors ─scores─> one per pair
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.outputs import ScoringOutput, ScoringRequestOutput
from tandem.request import Request
from tandem.tokenizer import Tokenizer


def pairs(data_1: Any, data_2: Any) -> tuple[list[str], list[str]]:
    """The two sides of every pair, as long as each other: data_1 repeated for 1:N."""
    firsts, seconds = texts("data_1", data_1), texts("data_2", data_2)
    if not firsts or not seconds:
        raise ValueError("data_1 and data_2 must each hold at least one text")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise ValueError(
            f"data_1 and data_2 pair up 1:1, 1:N or N:N; got {len(firsts)} and {len(seconds)} texts"
        )
    return firsts * len(seconds) if len(firsts) == 1 else firsts, seconds


def embedded_once(firsts: list[str], seconds: list[str], same_adapter: bool) -> list[str]:
    """The texts an embedding model embeds for the pairs: 1:N's one first text once (vLLM's:
    N + 1 prompts), else every first text then every second (`spread` puts them back)."""
    if same_adapter and len(firsts) > 1 and len(set(firsts)) == 1:
        return [firsts[0], *seconds]
    return [*firsts, *seconds]


def spread(pooled: list, num_pairs: int) -> list:
    """`embedded_once`'s outputs as every first text's then every second's."""
    if len(pooled) == 2 * num_pairs:
        return pooled
    return [pooled[0]] * num_pairs + pooled[1:]


def texts(name: str, data: Any) -> list[str]:
    """One text, or a list of texts, as a list."""
    if isinstance(data, str):
        return [data]
    if isinstance(data, Sequence) and all(isinstance(text, str) for text in data):
        return list(data)
    raise TypeError(f"{name} must be a text or a list of texts, got {type(data).__name__}")


def cross_encodes(num_labels: int) -> bool:
    """Whether a pair is scored as one prompt (a classifier of one label), else by its two
    embeddings; a classifier of several labels is a ValueError."""
    if num_labels > 1:
        raise ValueError(
            f"this model classifies into {num_labels} labels; scores come from a classifier of "
            "one label (a cross-encoder) or from embeddings: use classify"
        )
    return num_labels == 1


def separates_pairs(hf_config: dict[str, Any]) -> bool:
    """Whether a pair prompt is the tokenizer's pair encoding (config.json's `use_sep_token`,
    or its older `use_pad_token`; on unless false), else the two texts joined."""
    for key in ("use_pad_token", "use_sep_token"):
        if hf_config.get(key) is not None:
            return bool(hf_config[key])
    return True


def pair_prompts(
    tokenizer: Tokenizer | None,
    firsts: list[str],
    seconds: list[str],
    separate: bool,
    max_length: int | None = None,
) -> list[dict[str, Any]]:
    """A cross-encoder's prompt of each pair: token ids and their text. With `max_length` (the
    request's truncate_prompt_tokens), a pair of the tokenizer's is cut as vLLM cuts it, the
    longer text first and its special tokens kept (joined texts are cut by the engine: their
    first tokens kept, as pooling keeps them)."""
    if tokenizer is None:
        raise ValueError("scoring texts needs a tokenizer (skip_tokenizer_init=True, or none)")
    prompts = []
    for first, second in zip(firsts, seconds, strict=True):
        if separate:  # a length that is no count is refused with the request's params
            cut = max_length if isinstance(max_length, int) and max_length > 0 else None
            ids = tokenizer.encode_pair(first, second, cut)
        else:
            ids = tokenizer.encode(first + second)
        prompts.append({"prompt_token_ids": ids, "prompt": tokenizer.decode(ids)})
    return prompts


def outputs(
    requests: list[Request], cross_encoded: bool, tokenizer: Tokenizer | None
) -> list[ScoringRequestOutput]:
    """`LLM.score`'s output of each pair from its pooled requests: one per pair, else every
    first text's then every second's. A pair with an aborted request (a pause's abort) has
    no score and is not finished."""
    if cross_encoded:
        halves = [[request] for request in requests]
    else:
        num_pairs = len(requests) // 2
        halves = [
            list(pair) for pair in zip(requests[:num_pairs], requests[num_pairs:], strict=True)
        ]
    finished = all(request.pooled is not None for request in requests)
    pooled = scores(cross_encoded, [list(r.pooled) for r in requests]) if finished else None
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    answers = []
    for index, pair in enumerate(halves):
        ids = pair[0].prompt_token_ids
        if len(pair) == 2:  # as vLLM: both texts' ids, the pad token between them
            ids = ids + ([] if pad is None else [pad]) + pair[1].prompt_token_ids
        answers.append(
            ScoringRequestOutput(
                request_id="_".join(request.request_id for request in pair),
                outputs=ScoringOutput(pooled[index] if pooled else None),
                prompt_token_ids=ids,
                finished=finished,
                num_cached_tokens=sum(request.num_cached_tokens or 0 for request in pair),
            )
        )
    return answers


def scores(cross_encoded: bool, vectors: list[list[float]]) -> list[float]:
    """Each pair's score from its pooled vectors: a cross-encoder's one per pair (its label's),
    else every first text's embedding then every second's, in pair order."""
    if cross_encoded:
        return [vector[0] for vector in vectors]
    half = len(vectors) // 2
    return [cosine(a, b) for a, b in zip(vectors[:half], vectors[half:], strict=True)]


def cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norms = np.linalg.norm(x) * np.linalg.norm(y)
    return float(x @ y / norms) if norms else 0.0
