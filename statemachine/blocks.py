"""Paged KV block accounting with automatic prefix caching.

A block is free (no owner, no cached contents), evictable (no owner, but its
contents are cached and findable by key until it is reused) or in use
(referenced by one or more block tables). A full block is identified by a
chained key: the hash of its parent block's key, its token ids and the cache
salt, packed into one `bytes`. The key itself is the dict key, so two blocks
with different tokens or salts never share a key; and a `bytes` object keeps its
hash once computed, so a lookup costs a memory compare, not a rehash.
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from typing import Sequence

from .request import Request

BlockKey = bytes
NO_PARENT = 0
# Header byte of a key: how the tokens are packed, and whether a salt follows.
_WIDE_TOKENS = 1  # a token id did not fit in 32 bits: the tokens are spelled out
_SALTED = 2
_HEADS = [bytes((h,)) for h in range(4)]


@functools.lru_cache(maxsize=None)
def _packer(block_size: int) -> struct.Struct:
    """Parent hash, header byte and `block_size` 32-bit token ids, little-endian."""
    return struct.Struct(f"<qB{block_size}I")


def block_keys_for(token_ids: Sequence[int], block_size: int, salt: str | None,
                   keys: list[BlockKey] | None = None) -> list[BlockKey]:
    """Extend `keys` to cover every full block of `token_ids` and return it.

    A key is parent hash (8 bytes) + header byte + tokens + salt. Tokens are
    packed as 32-bit integers, a fixed width, so the salt that follows cannot be
    mistaken for tokens; wider ids are written as the tuple's text instead, which
    ends at its first ')'. The header tells the two apart, and a salt from none.
    """
    keys = [] if keys is None else keys
    start = len(keys) * block_size
    num_tokens = len(token_ids)
    if num_tokens - start < block_size:
        return keys
    salted = _SALTED if salt is not None else 0
    tail = salt.encode() if salt is not None else None
    pack = _packer(block_size).pack
    parent = hash(keys[-1]) if keys else NO_PARENT
    for begin in range(start, num_tokens - block_size + 1, block_size):
        block = token_ids[begin:begin + block_size]
        try:
            key = pack(parent, salted, *block)
        except struct.error:  # an id below 0 or above 32 bits
            key = (parent.to_bytes(8, "little", signed=True) + _HEADS[_WIDE_TOKENS | salted]
                   + repr(tuple(block)).encode())
        if tail is not None:
            key += tail
        keys.append(key)
        parent = hash(key)
    return keys


class BlockManager:
    """Owns the KV blocks: block tables, reference counts, free list, prefix cache.

    A request-level operation either succeeds completely or changes nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Popped from the end, so the lowest ids go first.
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        # Insertion order is recency: the first key is evicted first. An OrderedDict
        # pops its oldest entry in O(1); a plain dict's first key is found by
        # scanning past every slot deleted before it.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        # Evictable blocks of preempted requests (a subset of `evictable`): evicted
        # only when no other evictable block is left, so a preempted request finds
        # its prefix again when it resumes. The others, in the same order, are
        # `_unretained`, so the next one to evict is found in O(1).
        self.retained: set[int] = set()
        self._unretained: OrderedDict[int, None] = OrderedDict()
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0
        # Tables given back so far (a finish, abort or preemption): blocks may be free again.
        self.num_releases = 0
        # Blocks registered in the prefix cache so far: a waiting request's cached
        # prefix can only have grown since a count that this still equals.
        self.num_registered = 0

    # ---- queries ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free plus evictable."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids) - len(self.evictable)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Leading blocks of `request` whose contents are cached, leaving at least
        one token to compute. Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        keys = request.block_hashes
        max_blocks = (request.num_tokens - 1) // self.block_size
        if len(keys) < max_blocks:
            block_keys_for(request.all_token_ids, self.block_size, request.cache_salt, keys)
        hits: list[int] = []
        cached = self.cached
        for i in range(max_blocks):
            block = cached.get(keys[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, num_new_blocks: int, cached_blocks: list[int], reserve: int = 0) -> bool:
        """Whether `num_new_blocks` fresh blocks fit beside `cached_blocks` with
        `reserve` blocks left over."""
        available = self.num_free_blocks - reserve
        if num_new_blocks > available:
            return False  # cheap refusal: they do not fit even reviving no hit
        evictable = self.evictable
        return num_new_blocks + sum(1 for b in cached_blocks if b in evictable) <= available

    # ---- mutations -------------------------------------------------------------
    def allocate(self, request_id: str, cached_blocks: list[int], num_tokens: int,
                 reserve: int = 0) -> bool:
        """Give a request without a table the cached blocks plus enough fresh
        ones to hold `num_tokens`. Returns False, changing nothing, if they do not fit."""
        assert request_id not in self.tables, f"{request_id!r} already holds blocks"
        num_new = self.blocks_for(num_tokens) - len(cached_blocks)
        if num_new < 0:
            num_new = 0
        if not self.can_allocate(num_new, cached_blocks, reserve):
            return False
        refs, evictable, retained = self.ref_counts, self.evictable, self.retained
        for b in cached_blocks:
            if refs[b] == 0:
                del evictable[b]
                if b in retained:
                    retained.discard(b)
                else:
                    del self._unretained[b]
            refs[b] += 1
        table = list(cached_blocks)
        table.extend(self._take(num_new))
        self.tables[request_id] = table
        self.num_hashed[request_id] = len(cached_blocks)
        return True

    def grow(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Make the table hold `num_tokens`; return the blocks added ([] if none
        were needed) or None, changing nothing, if they do not fit."""
        table = self.tables[request_id]
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new <= 0:
            return []
        if num_new > len(self.free_ids) + len(self.evictable):
            return None
        new = self._take(num_new)
        table.extend(new)
        return new

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full and computed."""
        rid = request.request_id
        num_full = num_computed_tokens // self.block_size
        start = self.num_hashed[rid]
        if num_full <= start:
            return
        keys = request.block_hashes
        if len(keys) < num_full:
            block_keys_for(request.all_token_ids, self.block_size, request.cache_salt, keys)
        table, cached, block_key = self.tables[rid], self.cached, self.block_key
        for i in range(start, num_full):
            key = keys[i]
            block = table[i]
            if key not in cached and block_key[block] is None:
                cached[key] = block
                block_key[block] = key
                self.num_registered += 1
        self.num_hashed[rid] = num_full

    def free(self, request_id: str, retain: bool = False) -> None:
        """Release a request's blocks; cached ones stay findable until evicted.
        Tail blocks are released first so they are evicted first. With `retain`
        (a preempted request) its cached blocks are evicted after all others."""
        table = self.tables.pop(request_id, None)
        self.num_hashed.pop(request_id, None)
        if table is None:
            return
        self.num_releases += 1
        refs, block_key, evictable, free_ids = self.ref_counts, self.block_key, self.evictable, self.free_ids
        unretained = self._unretained
        for b in reversed(table):
            left = refs[b] - 1
            refs[b] = left
            if not left:
                if block_key[b] is None:
                    free_ids.append(b)
                else:
                    evictable[b] = None
                    if retain:
                        self.retained.add(b)
                    else:
                        unretained[b] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the executor lost the KV contents)."""
        for b in list(self.evictable):
            self.free_ids.append(b)
        self.evictable.clear()
        self.retained.clear()
        self._unretained.clear()
        self.cached.clear()
        self.block_key = [None] * self.num_blocks

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def _evict_next(self) -> int:
        """Pop the evictable block to reuse: the least recently freed one that is
        not retained, or, if all are retained, the least recently freed."""
        if self.retained:
            if self._unretained:
                b, _ = self._unretained.popitem(last=False)
                del self.evictable[b]
                return b
            b, _ = self.evictable.popitem(last=False)
            self.retained.discard(b)
            return b
        b, _ = self.evictable.popitem(last=False)
        del self._unretained[b]
        return b

    def _take(self, n: int) -> list[int]:
        free_ids, refs = self.free_ids, self.ref_counts
        out: list[int] = []
        for _ in range(n):
            if free_ids:
                b = free_ids.pop()
            else:
                b = self._evict_next()
                key = self.block_key[b]
                self.block_key[b] = None
                if self.cached.get(key) == b:
                    del self.cached[key]
                self.num_evictions += 1
            refs[b] = 1
            out.append(b)
        return out
