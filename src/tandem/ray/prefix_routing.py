"""Which replica a request should go to, so that requests sharing a prompt prefix meet.

A request's key is its prompt's first block: the first `block_size` token ids, or for text the
first `block_size * CHARS_PER_TOKEN` characters (chat: the messages as role/content lines).
Two prompts can share cached KV blocks only if they share that first block and their
`cache_salt` (none, or one string), so the key holds the salt too: equal keys are what must land
together, and tenants of one system prompt under different salts spread. A consistent-hash ring
maps keys to replicas: when a replica goes (or comes back under a new id), only the keys it
owned move.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
from typing import Any

from tandem.server.anthropic import BILLING_HEADER
from tandem.tokenizer import encodable

CHARS_PER_TOKEN = 4  # about, for English text
POINTS_PER_REPLICA = 64  # ring points per replica: keys spread evenly over a few replicas


def prefix_key(path: str, body: bytes, block_size: int) -> str | None:
    """The routing key of a POST body to /v1/completions, /v1/chat/completions or /v1/messages
    (Anthropic's: its system text a first message), else None."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    if path == "/v1/completions":
        key = _prompt_key(request.get("prompt"), block_size)
    elif path == "/v1/chat/completions":
        key = _messages_key(request.get("messages"), block_size)
    elif path == "/v1/messages":
        key = _messages_key(_with_system(request), block_size)
    else:
        return None
    if key is None:
        return None
    salt = request.get("cache_salt")
    if isinstance(salt, str) and salt:
        key = f"salt:{json.dumps(salt)}:{key}"  # a JSON string ends where it ends: no overlap
    try:  # the ring hashes UTF-8: a key with a lone surrogate routes anywhere (the app: 400)
        return encodable(key)
    except ValueError:
        return None


def _prompt_key(prompt: Any, block_size: int) -> str | None:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str):
        return "text:" + prompt[: block_size * CHARS_PER_TOKEN]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "ids:" + ",".join(map(str, prompt[:block_size]))
    return None


def _with_system(request: dict[str, Any]) -> Any:
    """An Anthropic request's messages after its system text, as the prompt renders them
    (Claude Code's per-request billing block left out)."""
    messages, system = request.get("messages"), request.get("system")
    if isinstance(system, list):
        system = [
            block for block in system
            if not (isinstance(block, dict) and str(block.get("text")).startswith(BILLING_HEADER))
        ]  # fmt: skip
    if not system or not isinstance(messages, list):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _messages_key(messages: Any, block_size: int) -> str | None:
    if not isinstance(messages, list):
        return None
    lines = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        lines.append(f"{message.get('role')}: {content}\n")
    return "chat:" + "".join(lines)[: block_size * CHARS_PER_TOKEN]


def ring_order(key: str, replicas: list[str]) -> list[str]:
    """`replicas` in the order the ring meets them going clockwise from `key`'s point."""
    unique = tuple(sorted(set(replicas)))
    if not unique:
        return []
    points, owners = _ring(unique)
    start = bisect.bisect(points, _point(key))
    order: dict[str, None] = {}  # insertion-ordered set
    for i in range(len(points)):
        order.setdefault(owners[(start + i) % len(points)])
        if len(order) == len(unique):
            break
    return list(order)


@functools.lru_cache(maxsize=64)
def _ring(replicas: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """Sorted ring points and the replica owning each; cached per replica set."""
    pairs = sorted(
        (_point(f"{replica}#{i}"), replica)
        for replica in replicas
        for i in range(POINTS_PER_REPLICA)
    )
    return [p for p, _ in pairs], [r for _, r in pairs]


def _point(text: str) -> int:
    """A position on the ring, the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
