"""stats(): counters, and rates computed only from the times the caller passed in."""

from __future__ import annotations

import pytest

from cadence.statemachine.plan import StepResult

from core_helpers import make_request, make_scheduler, run_until_idle, step


def test_empty_scheduler_reports_zeros():
    """A fresh scheduler divides by nothing."""
    stats = make_scheduler().stats()
    assert stats.num_requests_added == stats.num_batches_scheduled == stats.num_requests_completed == 0
    assert stats.avg_wait_s == stats.tokens_per_s == stats.requests_per_s == stats.avg_batch_size == 0.0
    assert stats.prefix_hit_rate == 0.0 and stats.kv_usage == 0.0 and stats.elapsed_s == 0.0


def test_counters_wait_times_and_rates_from_caller_times():
    """Two requests arriving at 1 s and 2 s, first scheduled at 4 s, served in
    steps at 4..7 s: every figure follows from those times."""
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=3, arrival_s=1.0))
    s.add_request(make_request("b", 4, max_tokens=1, arrival_s=2.0))
    assert s.stats().num_requests_added == 2 and s.stats().num_waiting == 2
    for now in (4.0, 5.0, 6.0):
        step(s, now_s=now)
    empty = s.schedule(now_s=7.0)  # nothing left: an empty plan is not a batch
    assert empty.is_empty
    stats = s.stats()
    assert stats.num_requests_completed == 2 and stats.completed_by_reason == {"length": 2}
    assert stats.total_wait_s == pytest.approx(3.0 + 2.0)
    assert stats.avg_wait_s == pytest.approx(2.5)
    assert stats.num_tokens_generated == 4
    assert stats.elapsed_s == pytest.approx(6.0)  # from 1 s (first arrival) to 7 s
    assert stats.tokens_per_s == pytest.approx(4 / 6.0)
    assert stats.requests_per_s == pytest.approx(2 / 6.0)
    assert stats.num_batches_scheduled == 3
    assert stats.batch_size_distribution == {2: 1, 1: 2}
    assert stats.avg_batch_size == pytest.approx(4 / 3)
    assert stats.num_scheduled_tokens == 8 + 2
    assert stats.num_running == stats.num_waiting == 0


def test_wait_is_counted_once_per_request_even_after_preemption():
    """Wait time runs from arrival to the first scheduled step only."""
    s = make_scheduler("priority", num_blocks=6, block_size=4)
    s.add_request(make_request("low", 16, max_tokens=8, priority=2, arrival_s=0.0))
    step(s, now_s=1.0)
    s.add_request(make_request("high", 8, max_tokens=2, priority=0, arrival_s=1.5))
    plan, _ = step(s, now_s=2.0)
    assert plan.preempted_ids == ["low"]
    run_until_idle(s, start_s=3.0)
    stats = s.stats()
    assert stats.total_wait_s == pytest.approx(1.0 + 0.5)
    assert stats.num_preemptions == 1


def test_preemptions_and_recompute_tokens():
    """Each preemption is counted with the tokens it throws away."""
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add_request(make_request("heavy", 8, max_tokens=4, arrival_s=0.0))
    s.add_request(make_request("light", 5, max_tokens=4, arrival_s=1.0))
    step(s)
    plan, _ = step(s)
    assert plan.preempted_ids == ["light"]
    stats = s.stats()
    assert stats.num_preemptions == 1 and stats.num_recompute_tokens == 5


def test_prefix_queries_and_hits():
    """Query tokens are the prompt tokens looked up; hits those found cached."""
    s = make_scheduler(block_size=4)
    prompt = list(range(500, 510))
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_until_idle(s)
    s.add_request(make_request("b", prompt + [1, 2], max_tokens=1))
    run_until_idle(s)
    stats = s.stats()
    assert stats.num_prefix_query_tokens == 10 + 12
    assert stats.num_prefix_hit_tokens == 8
    assert stats.prefix_hit_rate == pytest.approx(8 / 22)


def test_kv_usage_is_the_fraction_of_blocks_in_use():
    """kv_usage counts blocks referenced by a running request, not cached ones."""
    s = make_scheduler(num_blocks=10, block_size=4)
    s.add_request(make_request("a", 12, max_tokens=4))
    step(s)
    assert s.stats().kv_usage == pytest.approx(3 / 10)  # 12 computed tokens: 3 blocks
    step(s)
    assert s.stats().kv_usage == pytest.approx(4 / 10)  # the 13th token needs a 4th block
    run_until_idle(s)
    assert s.stats().kv_usage == 0.0


def test_update_for_an_unknown_step_counts_nothing():
    """A stale result adds no tokens to the counters."""
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=3))
    plan, _ = step(s)
    before = s.stats()
    assert s.update(plan, StepResult(plan.step_id, {"a": [5]})) == []
    assert s.stats() == before


def test_format_lists_each_figure():
    """The human-readable summary has one labelled line per figure."""
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=2, arrival_s=0.0))
    run_until_idle(s, start_s=1.0)
    text = s.stats().format()
    for label in ("requests added", "batches scheduled", "requests completed", "tokens generated",
                  "tokens/s", "batch sizes", "preemptions", "prefix cache", "KV usage"):
        assert label in text
    assert s.stats().as_dict()["num_requests_added"] == 1
