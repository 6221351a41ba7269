"""Prefix-aware routing: keys from prompts, and the consistent-hash ring over replicas."""

from __future__ import annotations

import json
from collections import Counter

from tandem.ray.prefix_routing import prefix_key, ring_order

BLOCK = 16
SYSTEM = "You are a careful assistant who answers in one short sentence, always. " * 3


def completion(prompt) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 4}).encode()


def chat(*contents: str) -> bytes:
    roles = ["system", "user", "assistant", "user"]
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]
    return json.dumps({"messages": messages}).encode()


def test_prompts_sharing_their_first_block_share_a_key():
    a = prefix_key("/v1/completions", completion(SYSTEM + "What is a KV cache?"), BLOCK)
    b = prefix_key("/v1/completions", completion(SYSTEM + "Who wrote Hamlet?"), BLOCK)
    c = prefix_key("/v1/completions", completion("Something else entirely. " + SYSTEM), BLOCK)
    assert a == b != c


def test_token_prompts_are_keyed_by_their_first_block_of_ids():
    shared = list(range(100, 100 + BLOCK))
    a = prefix_key("/v1/completions", completion([*shared, 1, 2]), BLOCK)
    b = prefix_key("/v1/completions", completion([*shared, 3]), BLOCK)
    c = prefix_key("/v1/completions", completion([7, *shared]), BLOCK)
    assert a == b != c


def test_chats_with_one_system_prompt_share_a_key_whatever_the_question():
    a = prefix_key("/v1/chat/completions", chat(SYSTEM, "Name a cache."), BLOCK)
    b = prefix_key("/v1/chat/completions", chat(SYSTEM, "Name a river."), BLOCK)
    c = prefix_key("/v1/chat/completions", chat("Be brief.", "Name a cache."), BLOCK)
    assert a == b != c


def test_anthropic_messages_with_one_system_prompt_share_a_key_whatever_the_billing_block():
    """/v1/messages: the system text leads the key, as it leads the prompt; Claude Code's
    billing block, a hash per request, is left out of both."""

    def messages(system, question: str) -> bytes:
        body = {"system": system, "messages": [{"role": "user", "content": question}]}
        return json.dumps(body).encode()

    def blocks(billing: str) -> list[dict]:
        return [
            {"type": "text", "text": f"x-anthropic-billing-header: cch={billing};"},
            {"type": "text", "text": SYSTEM},
        ]

    a = prefix_key("/v1/messages", messages(SYSTEM, "Name a cache."), BLOCK)
    b = prefix_key("/v1/messages", messages(blocks("1"), "Name a river."), BLOCK)
    c = prefix_key("/v1/messages", messages(blocks("2"), "Name a cache."), BLOCK)
    d = prefix_key("/v1/messages", messages("Be brief.", "Name a cache."), BLOCK)
    assert a == b == c != d
    assert a == prefix_key("/v1/chat/completions", chat(SYSTEM, "Name a cache."), BLOCK)


def test_requests_of_different_cache_salts_have_different_keys():
    """Only requests of one salt (or all without) can share cached blocks, so only they must meet."""
    for path, body in [
        ("/v1/completions", {"prompt": SYSTEM + "What is a KV cache?"}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM}]}),
    ]:
        keys = [
            prefix_key(path, json.dumps({**body, "cache_salt": salt}).encode(), BLOCK)
            for salt in ("tenant-a", "tenant-a", "tenant-b", None)
        ]
        assert keys[0] == keys[1] and len(set(keys[1:])) == 3
        assert keys[3] == prefix_key(path, json.dumps(body).encode(), BLOCK)


def test_requests_without_a_prompt_have_no_key():
    assert prefix_key("/v1/models", b"", BLOCK) is None
    assert prefix_key("/v1/completions", b"not json", BLOCK) is None
    assert prefix_key("/v1/completions", b"[1]", BLOCK) is None
    assert prefix_key("/v1/chat/completions", b'{"messages": 3}', BLOCK) is None


def test_ring_order_lists_each_replica_once_and_is_stable():
    replicas = ["r1", "r2", "r3"]
    order = ring_order("text:hello", replicas)
    assert sorted(order) == replicas
    assert ring_order("text:hello", list(reversed(replicas))) == order


def test_keys_spread_over_replicas():
    owners = Counter(ring_order(f"key-{i}", ["a", "b", "c", "d"])[0] for i in range(4000))
    assert set(owners) == {"a", "b", "c", "d"}
    assert min(owners.values()) > 4000 / 4 * 0.6  # no replica far below its share


def test_removing_a_replica_moves_only_the_keys_it_owned():
    keys = [f"key-{i}" for i in range(2000)]
    before = {k: ring_order(k, ["a", "b", "c"])[0] for k in keys}
    after = {k: ring_order(k, ["a", "c"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "b" for k in moved)
    assert all(after[k] == ring_order(k, ["a", "b", "c"])[1] for k in moved)  # to its next


def test_bodies_that_are_no_request_route_anywhere_without_raising():
    """The router must not fail on what the app answers with a 400: a lone surrogate (which
    the ring cannot hash), a text part that is no string, JSON nested too deep."""
    surrogate = json.dumps({"prompt": "a \ud800"}).encode()
    assert prefix_key("/v1/completions", surrogate, BLOCK) is None
    numeric = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert (
        prefix_key("/v1/chat/completions", json.dumps(numeric).encode(), BLOCK) == "chat:user: \n"
    )
    deep = b'{"prompt": ' + b"[" * 100_000
    assert prefix_key("/v1/completions", deep, BLOCK) is None
