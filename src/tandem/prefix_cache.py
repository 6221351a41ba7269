"""Automatic prefix caching: full KV blocks found again by the hash of the tokens they hold.

A block's key chains its parent's key with its own token ids (and extra keys), so equal keys
mean equal leading tokens, hence equal KV. A request's LoRA adapter and cache salt make its first
block's extra key: through the chain every key of a salted request differs from those of another
salt, or of none, so only requests with one salt share blocks, and only requests of one adapter
(or none) share KV, which each adapter computes differently. A request
admitted with nothing computed maps its longest run of cached leading blocks instead of
computing them.

A block is published (made findable) once its tokens are all known on the host and a launched
step writes its last KV entry. Every step runs on the one compute stream after the steps
launched before it, so any step that later reads a published block is ordered after the one
that writes it. A block whose last owner finished stays cached in the allocator's free queue
and is evicted, least recently freed first, only when a new block is needed.

The block of a request's last known token is never shared: that token is computed (its logits
are needed), and its KV written. When that block is cached whole (a block-aligned prompt seen
before, the n samples of one), the request gets it copied on write: a block of its own, into
which the step copies the cached block's KV before its forward, and computes only the last
token. Only a block published before the current schedule is copied: one published during it
is written by the step being planned, after the copy would have read it.

Each publication of a block gets a number (`publication`). A copy's first block_size - 1 slots
hold, bit for bit, what the block held under that number (the last slot is the token the copy
computes), so rows whose blocks at one index are copies of one publication, or that block
itself, share those slots too (shared_prefix.py).
"""

from __future__ import annotations

import hashlib

import numpy as np

from tandem.kv_cache import BlockAllocator
from tandem.request import Request

ROOT_KEY = b""  # the parent key of a sequence's first block


def block_key(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    """blake2b over the parent's key, the block's token ids and any extra keys (16 bytes)."""
    return chained_key(parent, np.asarray(token_ids, dtype=np.int64).tobytes(), extra)


def chained_key(parent: bytes, token_bytes: bytes | memoryview, extra: bytes = b"") -> bytes:
    """block_key over the block's token ids as int64 bytes."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(token_bytes)
    digest.update(extra)
    return digest.digest()


def salt_key(cache_salt: str | None) -> bytes:
    """A cache salt as the extra key of a first block (b"" without one). Any str encodes, lone
    surrogates too, and distinct salts to distinct bytes."""
    return cache_salt.encode("utf-8", "surrogatepass") if cache_salt else b""


def first_extra_key(request: Request) -> bytes:
    """The extra key of a request's first block: its adapter's (KV differs under each), its
    prompt embeddings' (prompt_embeds.py), then its salt's. An adapter's key starts with 0xff
    and an embeddings key with 0xfe, which no UTF-8 salt does."""
    lora = request.lora_request
    return (lora.cache_key if lora else b"") + request.embeds_key + salt_key(request.cache_salt)


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True):
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self.block_of: dict[bytes, int] = {}  # key -> block holding those tokens' KV
        self.key_of: dict[int, bytes] = {}  # the reverse, for eviction
        self.published_now: set[int] = set()  # published since `start_schedule`: not copyable
        # [num_blocks] int64: each cached block's publication number, -1 while not cached
        self.publication = np.full(allocator.num_blocks, -1, dtype=np.int64)
        self.num_publications = 0
        # the prompt, first extra key and key memo (Request.block_keys) of the request matched
        # last (match)
        self.last_matched: tuple[list[int], bytes, list[bytes]] | None = None
        allocator.on_reuse = self._evict
        # tokens looked up and tokens found, over every admission (vLLM's counters)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """The keys of the request's first `num_blocks` full blocks, extending its memo (the
        new blocks' tokens turned into bytes in one go: a 1,024-token prompt's 64 keys take
        about two thirds of the time that converting block by block did)."""
        keys, size = request.block_keys, self.block_size
        first = len(keys)
        if first >= num_blocks:
            return keys
        data = memoryview(
            np.asarray(request.tokens(first * size, num_blocks * size), dtype=np.int64).tobytes()
        )
        width = size * 8  # a block's int64 token ids
        for index in range(num_blocks - first):
            parent, extra = (keys[-1], b"") if keys else (ROOT_KEY, first_extra_key(request))
            keys.append(chained_key(parent, data[index * width : (index + 1) * width], extra))
        return keys

    def match(self, request: Request) -> tuple[list[int], int | None]:
        """Cached blocks of the request's leading known tokens, and the cached block of its last
        token when that one is a full block (None otherwise), to copy on write: the last token
        is always computed, its logits are needed. Nothing is taken: `take` the blocks to hold
        them. A request that wants prompt logprobs matches nothing: it computes every prompt
        position's hidden row; nor does one whose penalties count the tokens as the steps feed
        them (penalties.py), nor one whose params say skip_reading_prefix_cache. A scoring
        request (max_tokens=0) copies nothing: it computes no last token."""
        if not self.reads(request):
            return [], None
        keys = request.block_keys
        if not keys and self.last_matched is not None:
            # the n samples of a prompt are matched one after another: its blocks hashed once
            ids, extra, their_keys = self.last_matched
            if request.prompt_token_ids == ids and first_extra_key(request) == extra:
                keys.extend(their_keys[: len(ids) // self.block_size])
        keys = self.keys(request, request.num_tokens // self.block_size)
        self.last_matched = (request.prompt_token_ids, first_extra_key(request), keys)
        blocks = []
        for key in keys:
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        last = (request.num_tokens - 1) // self.block_size  # the block of the last token
        if len(blocks) > last and request.params.max_tokens > 0:
            return blocks[:last], blocks[last]
        return blocks[:last], None

    def copyable(self, block: int) -> bool:
        """Written by a step launched before the one being scheduled (see the module doc)."""
        return block not in self.published_now

    def start_schedule(self) -> None:
        self.published_now.clear()

    def reads(self, request: Request) -> bool:
        """Whether the request looks its blocks up (`match`'s conditions)."""
        params = request.params
        return self.enabled and not (
            request.wants_prompt_logprobs
            or params.needs_token_history
            or params.skip_reading_prefix_cache
        )

    def count(self, request: Request, num_hit: int) -> None:
        """The queries and hits of an admission, as vLLM's counters take them: of requests that
        look their blocks up, on their first admission (a preempted request finding its own
        blocks again is no hit of a shared prefix)."""
        if self.reads(request) and not request.num_preemptions:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_hit

    def publish(self, request: Request) -> None:
        """Make the request's full blocks findable once their tokens are known and written."""
        if not (self.enabled and request.publishes):
            return
        num_known = len(request.prompt_token_ids) + len(request.output_token_ids)
        num_full = min(request.num_computed_tokens, num_known) // self.block_size
        first = request.num_published_blocks
        if num_full <= first:
            return
        keys = self.keys(request, num_full)
        for index in range(first, num_full):
            block, key = request.block_table[index], keys[index]
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key] = block
                self.key_of[block] = key
                self.published_now.add(block)
                self.publication[block] = self.num_publications
                self.num_publications += 1
        request.num_published_blocks = num_full

    def num_created(self, request: Request) -> int:
        """vLLM's num_cache_creation_tokens of a request whose prompt is computed: the prompt
        tokens in its published blocks, less those its first admission found cached."""
        published = min(request.num_published_blocks * self.block_size, request.num_prompt_tokens)
        return max(published - (request.num_cached_tokens or 0), 0)

    def reset(self) -> None:
        """Forget every cached block (e.g. the weights changed); held blocks stay with their owners."""
        self.block_of.clear()
        self.key_of.clear()
        self.published_now.clear()
        self.publication.fill(-1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.key_of)

    def _evict(self, block: int) -> None:
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]
        self.published_now.discard(block)
        self.publication[block] = -1
