"""The BlockManager against a plain model made of sets, lists and dicts.

The model knows which blocks are free, which are evictable (in least-recently
freed order; those of preempted requests, retained, go last), which cache key each block holds and each request's block table.
After every rule the real manager must agree with it exactly, and the block
invariants of DESIGN §4 items 1-5 must hold (the shared predicates of
`cadence.statemachine.invariants` where they apply).
"""

from __future__ import annotations

import types

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cadence.statemachine import invariants
from cadence.statemachine.blocks import BlockManager, block_keys_for
from cadence.statemachine.request import Request

from core_helpers import examples

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny vocabulary: prefixes collide
SALTS = st.sampled_from([None, None, None, "salt"])


def chain_keys(tokens: list[int], block_size: int, salt: str | None) -> list[tuple]:
    """The model's key of every full block: the whole prefix up to its end, and
    the salt. Obviously collision-free; the real keys are checked against it."""
    return [(tuple(tokens[:end]), salt)
            for end in range(block_size, len(tokens) + 1, block_size)]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed for `num_tokens`."""
    return -(-num_tokens // block_size)


def snapshot(bm: BlockManager) -> tuple:
    """Everything a failed operation must leave as it was."""
    return (list(bm.free_ids), list(bm.evictable), set(bm.retained), dict(bm.cached), list(bm.block_key),
            {rid: list(t) for rid, t in bm.tables.items()}, dict(bm.num_hashed),
            list(bm.ref_counts), bm.num_evictions, bm.num_query_tokens, bm.num_hit_tokens)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives one BlockManager and a model of it through allocations, growth,
    prefix sharing, caching, frees and eviction under pressure."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None

    @initialize(data=st.data(), num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]),
                caching=st.sampled_from([True, True, True, False]),
                warm_up=st.lists(st.tuples(TOKENS, st.booleans()), max_size=4))
    def setup(self, data, num_blocks: int, block_size: int, caching: bool,
              warm_up: list[tuple[list[int], bool]]) -> None:
        """A small cache, so pressure and eviction are common, warmed up by a few
        requests that are computed and then (some of them) freed."""
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bs = block_size
        self.caching = caching
        self.requests: dict[str, Request] = {}
        self.computed: dict[str, int] = {}  # tokens the caller considers computed, per table
        # The model.
        self.free: set[int] = set(range(num_blocks))
        self.evictable: list[int] = []
        self.retained: set[int] = set()  # evictable blocks freed by a preemption
        self.cached: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}
        self.model_key: dict[bytes, tuple] = {}  # the real key of a block -> the model's
        self.tables: dict[str, list[int]] = {}
        self.hashed: dict[str, int] = {}
        self.num_evictions = 0
        self.num_ids = 0
        for tokens, keep in warm_up:
            rid = self._allocate(data, "fresh", tokens, None, 0, True)
            if rid is not None and not keep:
                self._free(rid, False)

    # ---- model helpers ------------------------------------------------------
    def _expected_hits(self, request: Request) -> list[int]:
        if not self.caching:
            return []
        hits = []
        keys = self._keys(request)
        for key in keys[:(request.num_tokens - 1) // self.bs]:
            if key not in self.cached:
                break
            hits.append(self.cached[key])
        return hits

    def _keys(self, request: Request) -> list[tuple]:
        """The model's keys of the request's full blocks, learning which real key
        stands for each: one real key standing for two prefixes is a collision."""
        keys = chain_keys(request.all_token_ids, self.bs, request.cache_salt)
        real = block_keys_for(request.all_token_ids, self.bs, request.cache_salt)
        for real_key, key in zip(real, keys):
            assert self.model_key.setdefault(real_key, key) == key, "two prefixes share a key"
        return keys

    def _check_taken(self, taken: list[int], free_before: set[int], lru_before: list[int]) -> None:
        """Fresh blocks come from the free set first, then from the evictable
        ones in least-recently-freed order, retained ones only when no other is
        left, and lose their cache key."""
        num_free = min(len(taken), len(free_before))
        assert set(taken[:num_free]) <= free_before and len(set(taken[:num_free])) == num_free
        evicted = taken[num_free:]
        if evicted:
            event("evicted under pressure")
        order = ([b for b in lru_before if b not in self.retained]
                 + [b for b in lru_before if b in self.retained])
        assert evicted == order[:len(evicted)], (evicted, order)
        if any(b in self.retained for b in evicted):
            event("evicted a retained block")
        self.free -= set(taken[:num_free])
        for b in evicted:
            self.retained.discard(b)
            self.evictable.remove(b)
            key = self.key_of.pop(b)
            if self.cached.get(key) == b:
                del self.cached[key]
        self.num_evictions += len(evicted)

    def _allocated(self) -> list[str]:
        return sorted(self.tables)

    def _unallocated(self) -> list[str]:
        return sorted(rid for rid in self.requests if rid not in self.tables)

    # ---- rules --------------------------------------------------------------
    @rule(data=st.data(), source=st.sampled_from(["fresh", "shared prefix", "shared prefix", "resume"]),
          tokens=TOKENS, salt=SALTS, reserve=st.sampled_from([0, 0, 1, 2]),
          prefill=st.sampled_from([True, True, False]))
    def allocate(self, data, source: str, tokens: list[int], salt: str | None, reserve: int,
                 prefill: bool) -> None:
        """Allocate a request (new, sharing another's leading tokens, or one whose
        table was freed) with whatever prefix the cache holds; all or nothing.
        With `prefill` its whole prompt is then computed and cached."""
        self._allocate(data, source, tokens, salt, reserve, prefill)

    def _allocate(self, data, source: str, tokens: list[int], salt: str | None, reserve: int,
                  prefill: bool) -> str | None:
        request = self._pick_request(data, source, tokens, salt)
        rid = request.request_id
        before = snapshot(self.bm)
        hits = self.bm.find_cached_prefix(request)
        assert snapshot(self.bm) == before, "find_cached_prefix changed the manager"
        assert hits == self._expected_hits(request)
        num_new = max(0, blocks_for(request.num_tokens, self.bs) - len(hits))
        revived = [b for b in hits if b in self.evictable]
        fits = num_new + reserve <= len(self.free) + len(self.evictable) - len(revived)
        assert self.bm.can_allocate(num_new, hits, reserve) == fits
        ok = self.bm.allocate(rid, hits, request.num_tokens, reserve)
        assert ok == fits
        event(f"allocate: {'fits' if ok else 'does not fit'}, {'hit' if hits else 'miss'}")
        if not ok:
            assert snapshot(self.bm) == before, "a failed allocation changed the manager"
            return None
        table = self.bm.table(rid)
        assert table[:len(hits)] == hits and len(table) == len(hits) + num_new
        for b in revived:
            self.evictable.remove(b)
            self.retained.discard(b)
        free_before, lru_before = set(self.free), list(self.evictable)
        self._check_taken(table[len(hits):], free_before, lru_before)
        self.tables[rid] = list(table)
        self.hashed[rid] = len(hits)
        self.computed[rid] = len(hits) * self.bs
        if prefill:
            self._compute(rid, request.num_tokens)
        return rid

    def _pick_request(self, data, source: str, tokens: list[int], salt: str | None) -> Request:
        idle = self._unallocated()
        if source == "resume" and idle:
            return self.requests[data.draw(st.sampled_from(idle), label="resumed")]
        if source == "shared prefix" and self.requests:
            base = self.requests[data.draw(st.sampled_from(sorted(self.requests)), label="base")]
            cut = data.draw(st.integers(1, base.num_tokens), label="cut")
            tokens = base.all_token_ids[:cut] + tokens[:data.draw(st.integers(0, 4), label="extra")]
            salt = base.cache_salt if data.draw(st.booleans(), label="same salt") else "other"
        self.num_ids += 1
        request = Request(f"r{self.num_ids}", tokens, cache_salt=salt)
        self.requests[request.request_id] = request
        return request

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=6))
    def grow(self, data, extra: list[int]) -> None:
        """Append tokens and make the table hold them; all or nothing."""
        rid = data.draw(st.sampled_from(self._allocated()), label="request")
        request = self.requests[rid]
        request.all_token_ids.extend(extra)
        before = snapshot(self.bm)
        num_new = blocks_for(request.num_tokens, self.bs) - len(self.tables[rid])
        new = self.bm.grow(rid, request.num_tokens)
        if num_new <= 0:
            assert new == [] and snapshot(self.bm) == before
        elif num_new > len(self.free) + len(self.evictable):
            assert new is None and snapshot(self.bm) == before, "a failed grow changed the manager"
            event("grow: does not fit")
        else:
            assert new is not None and len(new) == num_new
            self._check_taken(new, set(self.free), list(self.evictable))
            self.tables[rid].extend(new)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), num_tokens=st.integers(1, 8))
    def compute_and_cache(self, data, num_tokens: int) -> None:
        """The executor computed more tokens; full blocks become findable."""
        rid = data.draw(st.sampled_from(self._allocated()), label="request")
        self._compute(rid, num_tokens)

    def _compute(self, rid: str, num_tokens: int) -> None:
        request = self.requests[rid]
        limit = min(request.num_tokens, len(self.tables[rid]) * self.bs)
        self.computed[rid] = computed = min(limit, self.computed[rid] + num_tokens)
        if not self.caching:
            return
        self.bm.cache_full_blocks(request, computed)
        keys = self._keys(request)
        for i in range(self.hashed[rid], computed // self.bs):
            block = self.tables[rid][i]
            if keys[i] not in self.cached and block not in self.key_of:
                self.cached[keys[i]] = block
                self.key_of[block] = keys[i]
        self.hashed[rid] = max(self.hashed[rid], computed // self.bs)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), retain=st.booleans())
    def free(self, data, retain: bool) -> None:
        """Release a table; cached blocks become evictable, tail first; with
        `retain` (a preemption) they are evicted after all others."""
        self._free(data.draw(st.sampled_from(self._allocated()), label="request"), retain)

    def _free(self, rid: str, retain: bool) -> None:
        self.bm.free(rid, retain=retain)
        table = self.tables.pop(rid)
        del self.hashed[rid], self.computed[rid]
        held = {b for t in self.tables.values() for b in t}
        for b in reversed(table):
            if b in held:
                continue
            if b in self.key_of:
                self.evictable.append(b)
                if retain:
                    self.retained.add(b)
            else:
                self.free.add(b)

    @rule()
    def free_unknown(self) -> None:
        """Freeing a request without a table is a no-op."""
        before = snapshot(self.bm)
        self.bm.free("never-allocated")
        assert snapshot(self.bm) == before

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def lookup(self, data) -> None:
        """A prefix lookup finds the model's hits and changes nothing."""
        request = self.requests[data.draw(st.sampled_from(sorted(self.requests)), label="request")]
        before = snapshot(self.bm)
        assert self.bm.find_cached_prefix(request) == self._expected_hits(request)
        assert snapshot(self.bm) == before

    @rule()
    def reset_prefix_cache(self) -> None:
        """The executor lost its KV contents: every cached key is forgotten."""
        self.bm.reset_prefix_cache()
        self.free |= set(self.evictable)
        self.evictable.clear()
        self.retained.clear()
        self.cached.clear()
        self.key_of.clear()

    # ---- invariants ---------------------------------------------------------
    @invariant()
    def shared_block_invariants_hold(self) -> None:
        """§4 items 1-3 through the shared predicates."""
        if self.bm is None:
            return
        view = types.SimpleNamespace(blocks=self.bm, requests=self.requests)
        found = (invariants.blocks_partition(view) + invariants.refcounts_match_tables(view)
                 + invariants.cached_hashes_consistent(view))
        assert not found, found

    @invariant()
    def manager_matches_the_model(self) -> None:
        """Free set, LRU order, cache map, block keys, tables and refcounts agree."""
        bm = self.bm
        if bm is None:
            return
        assert bm.tables == self.tables
        assert len(bm.free_ids) == len(self.free) and set(bm.free_ids) == self.free
        assert list(bm.evictable) == self.evictable
        assert bm.retained == self.retained
        assert {self.model_key[k]: b for k, b in bm.cached.items()} == self.cached
        assert {b: self.model_key[k] for b, k in enumerate(bm.block_key) if k is not None} \
            == self.key_of
        counts = [0] * bm.num_blocks
        for table in self.tables.values():
            for b in table:
                counts[b] += 1
        assert bm.ref_counts == counts
        assert bm.num_evictions == self.num_evictions
        assert bm.num_free_blocks == len(self.free) + len(self.evictable)
        assert bm.num_used_blocks == sum(1 for c in counts if c)
        assert set(self.evictable) <= set(self.key_of), "an evictable block has no cache key"

    @invariant()
    def tables_cover_their_requests(self) -> None:
        """§4.5: a table holds at least its computed tokens, and exactly what its
        request's tokens need once grown."""
        if self.bm is None:
            return
        for rid, table in self.tables.items():
            assert blocks_for(self.computed[rid], self.bs) <= len(table)
            assert len(table) <= blocks_for(self.requests[rid].num_tokens, self.bs)
            assert len(set(table)) == len(table)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase


def test_regression_failed_allocation_with_a_revivable_hit_changes_nothing():
    """A failing allocate must not have revived its evictable hits."""
    bm = BlockManager(num_blocks=2, block_size=2)
    request = Request("a", [1, 2, 3])
    assert bm.allocate("a", [], 3)
    bm.cache_full_blocks(request, 3)
    bm.free("a")
    again = Request("b", [1, 2, 3, 4, 5])
    hits = bm.find_cached_prefix(again)
    assert len(hits) == 1
    before = snapshot(bm)
    assert not bm.allocate("b", hits, 5, reserve=1)
    assert snapshot(bm) == before


@pytest.mark.parametrize("reserve", [0, 1])
def test_regression_revived_hits_do_not_count_as_free(reserve):
    """A hit block that is evictable is revived, so it cannot also be counted as
    room for fresh blocks."""
    bm = BlockManager(num_blocks=2, block_size=1)
    request = Request("a", [7, 8])
    assert bm.allocate("a", [], 2)
    bm.cache_full_blocks(request, 2)
    bm.free("a")
    hits = bm.find_cached_prefix(Request("b", [7, 8]))
    assert len(hits) == 1
    assert bm.can_allocate(1, hits, reserve) == (reserve == 0)
