"""Prompts given as embeddings: vLLM's `{"prompt_embeds": tensor}` (`enable_prompt_embeds`).

A prompt of embeddings [tokens, hidden] takes the place of the embedding layer's output for
its prompt positions: the first layer's input as it is (a model that scales its embeddings,
Gemma by sqrt(hidden), expects them scaled, as transformers' and vLLM's `inputs_embeds` are;
transformers' `get_input_embeddings()(ids)` gives them so). The request carries placeholder ids (0) for its
prompt, so the scheduler, the KV cache and the sampler treat it as any other; its generated
tokens are ids as usual. The host writes a step's embedding rows into the slot's
`PromptEmbedBuffers` as the step is built, and they are copied with the step's other inputs;
such steps run eagerly (no graph or piece replays a forward with them), and the forward puts
the rows in place of those tokens' embeddings. Prefix caching keys a request's first block by
a digest of its whole embedding tensor (`cache_key`), so two prompts share cached blocks only
when their embeddings are the same bytes.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass

import numpy as np
import torch

from tandem.request import Request

KEY_MARK = b"\xfe"  # starts an embeddings key: no UTF-8 salt does, nor an adapter's key (0xff)


@dataclass
class PromptEmbedStep:
    """A step's token rows that take prompt embeddings: the first `num_rows` of the buffers."""

    num_rows: int


class PromptEmbedBuffers:
    """One slot's token rows and their embeddings, host (pinned on CUDA) and device."""

    def __init__(self, max_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, (torch.zeros(shape, dtype=dtype, device=device) if pin else host)

        # [max_tokens] int64: the step's token rows that take an embedding
        self.host_rows, self.dev_rows = pair((max_tokens,), torch.int64)
        # [max_tokens, hidden] in the model dtype: their embeddings, in that order
        self.host_values, self.dev_values = pair((max_tokens, hidden), dtype)
        self.np_rows = self.host_rows.numpy()

    def copy_in(self, step: PromptEmbedStep) -> None:
        """H2D of the step's rows, on the current stream (the caller's h2d_stream)."""
        n = step.num_rows
        self.dev_rows[:n].copy_(self.host_rows[:n], non_blocking=True)
        self.dev_values[:n].copy_(self.host_values[:n], non_blocking=True)

    def device(self, step: PromptEmbedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n] int64, embeddings [n, hidden]) for the forward."""
        return self.dev_rows[: step.num_rows], self.dev_values[: step.num_rows]


def plan_rows(
    requests: list[Request], start: np.ndarray, num_new: np.ndarray, qsl: np.ndarray,
    buffers: PromptEmbedBuffers,
) -> PromptEmbedStep | None:  # fmt: skip
    """Write the step's prompt positions of embedding prompts into `buffers`' host side (the
    request's `start` and `num_new` tokens at token rows from `qsl`); None when there are none."""
    num_rows = 0
    for i, request in enumerate(requests):
        embeds = request.prompt_embeds
        if embeds is None:
            continue
        first, last = int(start[i]), min(int(start[i] + num_new[i]), len(embeds))
        if first >= last:  # its prompt is computed: generated tokens alone
            continue
        n = last - first
        row = int(qsl[i])
        buffers.np_rows[num_rows : num_rows + n] = np.arange(row, row + n)
        buffers.host_values[num_rows : num_rows + n].copy_(embeds[first:last])
        num_rows += n
    return PromptEmbedStep(num_rows) if num_rows else None


def has_rows(requests: list[Request], num_new_tokens: list[int]) -> bool:
    """Whether a planned step computes prompt positions of an embedding prompt (then eagerly)."""
    return any(
        r.prompt_embeds is not None and r.num_computed_tokens - n < len(r.prompt_embeds)
        for r, n in zip(requests, num_new_tokens, strict=True)
    )


def checked(embeds: object, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """A prompt's embeddings as the engine keeps them: [tokens, hidden_size], on the CPU, in the
    model dtype, contiguous; a TypeError or ValueError naming what is wrong otherwise."""
    if not isinstance(embeds, torch.Tensor):
        raise TypeError(f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}")
    if embeds.is_meta:
        raise ValueError("prompt_embeds must hold values: got a tensor on the meta device")
    if embeds.layout != torch.strided:  # sparse: its dense values, as vLLM takes them
        embeds = embeds.to_dense()
    if embeds.dim() != 2 or embeds.shape[0] == 0 or embeds.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embeds must be [tokens, {hidden_size}] (the model's hidden size) with at "
            f"least one token, got {list(embeds.shape)}"
        )
    if not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must be floating point, got {embeds.dtype}")
    values = embeds.detach().to("cpu", dtype).contiguous()
    if not torch.isfinite(values).all():
        raise ValueError(f"prompt_embeds must be finite in {dtype} (no inf or nan)")
    return values


def decode(text: str) -> torch.Tensor:
    """vLLM's wire form of a prompt's embeddings: base64 of `torch.save(tensor)` bytes, read
    back with torch.load's weights_only (tensors and plain containers, no code); a batch of
    one ([1, tokens, hidden]) is its one prompt. A ValueError saying what is wrong."""
    try:
        data = base64.b64decode(text, validate=True)
        tensor = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as error:  # binascii, pickle and zipfile errors alike
        raise ValueError(
            f"prompt_embeds must be base64 of torch.save(tensor) bytes: {error}"
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds must hold a tensor, got {type(tensor).__name__}")
    return tensor[0] if tensor.dim() == 3 and tensor.shape[0] == 1 else tensor


def cache_key(embeds: torch.Tensor) -> bytes:
    """The extra key of the first block of a prompt of `embeds`: a digest of all its bytes."""
    data = embeds.contiguous().view(torch.uint8).numpy()
    return KEY_MARK + hashlib.blake2b(data, digest_size=16).digest()
