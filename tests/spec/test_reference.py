"""The reference spec and the refinement checks: they accept the real core and
reject broken ones."""

import pytest

from cadence.spec.invariants import core_table_matches_design
from cadence.spec.reference import EDGES, Abstraction, ReferenceSpec
from cadence.spec.refinement import CheckedHarness, SpecViolation
from cadence.statemachine.config import CacheConfig, SchedulerConfig

CONFIG = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=6, max_model_len=10,
                         admission_headroom_steps=1)
CACHE = CacheConfig(num_blocks=6, block_size=2)


def test_core_table_is_the_design_table():
    assert core_table_matches_design() == []
    assert len(EDGES) == 9


def test_abstraction_of_a_running_request():
    h = CheckedHarness(CONFIG, CACHE)
    h.add("a", (1, 2, 3), 2)
    h.schedule()
    state = Abstraction()(h.scheduler)
    a = state.requests["a"]
    assert (a.phase, a.num_computed_tokens, len(a.table)) == ("running", 3, 2)
    assert state.awaiting == {"a": (0,)} and state.inflight == (0,)
    h.complete()
    state = Abstraction()(h.scheduler)
    assert state.contents == {state.requests["a"].table[0]: (1, 2)}
    assert state.awaiting == {}


def test_a_shared_prefix_is_a_checked_hit():
    h = CheckedHarness(CONFIG, CACHE)
    h.add("a", (1, 2, 3), 4)
    h.step()
    h.add("b", (1, 2, 9), 2)
    h.step()
    s = h.scheduler
    assert s.blocks.tables["a"][0] == s.blocks.tables["b"][0]
    assert s.requests["b"].num_cached_tokens == 2


def test_a_false_prefix_hit_is_rejected(monkeypatch):
    """A core that hands out cached blocks whatever their contents must fail refinement."""
    from cadence.statemachine.blocks import BlockManager

    def any_hit(self, request):
        held = list(self.cached.values())
        return held[:(request.num_tokens - 1) // self.block_size]

    h = CheckedHarness(CONFIG, CACHE)
    h.add("a", (1, 2, 3), 2)
    h.step()
    monkeypatch.setattr(BlockManager, "find_cached_prefix", any_hit)
    h.add("b", (5, 6, 7), 1)
    with pytest.raises(SpecViolation, match="prefix hit"):
        h.step()


def test_tokens_past_max_tokens_are_rejected(monkeypatch):
    from cadence.statemachine.scheduler import Scheduler
    real_update = Scheduler.update

    def greedy_update(self, plan, result):
        for req in self.requests.values():
            object.__setattr__(req, "limits", req.limits.__class__(max_tokens=99))
        return real_update(self, plan, result)

    h = CheckedHarness(CONFIG, CACHE)
    h.add("a", (1,), 1)
    monkeypatch.setattr(Scheduler, "update", greedy_update)
    with pytest.raises(SpecViolation):
        h.step()


def test_update_must_follow_stop_tokens():
    spec = ReferenceSpec(CONFIG, CACHE)
    h = CheckedHarness(CONFIG, CACHE)
    h.add("a", (1, 2), 3)
    h.schedule()
    before = h.checker.state(h)
    # Claim the core kept running after an end-of-sequence token: the spec disagrees.
    assert spec.update_problems(before, before, 0, {"a": [0]})
    assert not spec.update_problems(before, before, 0, {})


def test_leaked_blocks_break_the_invariants(monkeypatch):
    from cadence.statemachine.blocks import BlockManager
    monkeypatch.setattr(BlockManager, "free", lambda self, rid: self.tables.pop(rid, None))
    h = CheckedHarness(CONFIG, CACHE)
    h.add("a", (1, 2, 3), 2)
    h.schedule()
    with pytest.raises(SpecViolation, match="refcount|free"):
        h.abort("a")


SHARED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=10,
                         admission_delay_budget=8, admission_min_tokens=1)


def burst_beside_a_running_request(h: CheckedHarness) -> None:
    h.add("a", (1, 2, 3), 6)
    h.step()
    for rid in ("b", "c", "d"):
        h.add(rid, (4, 5, 6, 7), 2)


def test_admissions_within_their_share_refine_the_spec():
    h = CheckedHarness(SHARED, CacheConfig(num_blocks=16, block_size=2))
    burst_beside_a_running_request(h)
    for _ in range(12):
        h.step()
    assert not h.scheduler.has_work()


def test_admissions_past_their_share_are_rejected():
    """A core that admits the whole burst beside a running request breaks the share
    (8 // 4 requests held = 2 tokens, the burst has 12)."""
    import attrs

    h = CheckedHarness(SHARED, CacheConfig(num_blocks=16, block_size=2))
    burst_beside_a_running_request(h)
    h.scheduler.config = attrs.evolve(SHARED, admission_delay_budget=0)
    with pytest.raises(SpecViolation, match="share"):
        h.step()



MIXED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=12,
                        mixed_prefill_tokens=2, mixed_prefill_per_decode=0.0)
CHUNKS = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=12,
                         mixed_prefill_tokens=2, mixed_prefill_per_decode=0.0, mixed_prefill_chunks=2)
SPLIT = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=10,
                        admission_burst_split=2)


def long_prompt_beside_a_decode(h: CheckedHarness) -> None:
    h.add("a", (1, 2, 3), 8)
    h.step()
    h.add("b", (4, 5, 6, 7, 8, 9), 2)


# A rule, the trace it binds on, the core's config without it, and how the spec says so:
# the bound of 2 prompt tokens beside a decode (the core computes all 6), and the older
# half of a burst of 3 beside 1 running request (the core admits all 3); the bound
# raised to half the 6-token prompt (3; at one chunk the core computes all 6).
RULES = {
    "mixed": (MIXED, long_prompt_beside_a_decode, dict(mixed_prefill_tokens=0), "prompt tokens beside"),
    "chunks": (CHUNKS, long_prompt_beside_a_decode, dict(mixed_prefill_chunks=1), "more than 3"),
    "split": (SPLIT, burst_beside_a_running_request, dict(admission_burst_split=0), "more than 1/2"),
}


@pytest.mark.parametrize("rule", RULES)
def test_plans_within_an_admission_rule_refine_the_spec(rule):
    config, trace, _, _ = RULES[rule]
    h = CheckedHarness(config, CacheConfig(num_blocks=16, block_size=2))
    trace(h)
    for _ in range(16):
        h.step()
    assert not h.scheduler.has_work()


@pytest.mark.parametrize("rule", RULES)
def test_plans_past_an_admission_rule_are_rejected(rule):
    import attrs

    config, trace, without, match = RULES[rule]
    h = CheckedHarness(config, CacheConfig(num_blocks=16, block_size=2))
    trace(h)
    h.scheduler.config = attrs.evolve(config, **without)
    with pytest.raises(SpecViolation, match=match):
        h.step()
