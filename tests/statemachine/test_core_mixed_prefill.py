"""`mixed_prefill_tokens`: beside decoding requests, and while no more requests wait
than decode, a step computes a bounded number of prompt tokens (new admissions and
the next chunks of prompts begun earlier together), so decode steps stay short;
with nothing decoding, or a larger burst waiting, admission is as without it.
`mixed_prefill_chunks` K raises the bound to the longest prompt over K.
`admission_burst_split` N: beside running requests, while more wait than run, a step
admits the oldest 1/N of those waiting."""

from __future__ import annotations

import random

import pytest

from core_helpers import (admissions, arrive, completions, make_request, make_scheduler, random_arrival_plans,
                          random_request, run_until_idle, step)

from cadence.statemachine.policy import waiting_requests


def decoding(num_running: int, **config):
    """A scheduler with `num_running` requests of 4 prompt tokens past their prefill."""
    s = make_scheduler(max_num_batched_tokens=256, num_blocks=512, block_size=4, max_num_seqs=64,
                       max_model_len=256, **config)
    for i in range(num_running):
        s.add_request(make_request(f"d{i}", 4, max_tokens=200, ignore_eos=True))
    step(s)
    return s


def bound_before_step(s) -> int | None:
    """The bound the next step is held to, from the state (None: none applies)."""
    config = s.config
    num_decoding = sum(len(r.all_token_ids) - r.num_computed_tokens <= 1 for r in s.running)
    waiting = list(waiting_requests(s.policy))
    if not num_decoding or len(waiting) > num_decoding:
        return None
    limit = max(config.mixed_prefill_tokens, int(config.mixed_prefill_per_decode * num_decoding))
    if config.mixed_prefill_chunks:
        begun = [r for r in s.running if len(r.all_token_ids) - r.num_computed_tokens > 1]
        longest = max((r.num_tokens for r in waiting + begun), default=0)
        limit = max(limit, -(-longest // config.mixed_prefill_chunks))
    if sum(r.num_tokens for r in waiting) > limit * config.mixed_prefill_drain_steps:
        return None
    return limit


def prompt_tokens(s, plan) -> int:
    """What a plan computes of prompts: admissions, and chunks longer than one token."""
    new = {d.request_id for d in plan.new_requests}
    return sum(n for rid, n in plan.num_scheduled_tokens.items() if rid in new or n > 1)


def test_a_long_prompt_beside_decodes_is_computed_the_bound_at_a_time():
    s = decoding(2, mixed_prefill_tokens=8, mixed_prefill_per_decode=0.0)
    s.add_request(make_request("long", 40, max_tokens=4, ignore_eos=True, arrival_s=1.0))
    chunks = []
    while not s.requests["long"].output_token_ids:
        plan, _ = step(s)
        assert {"d0", "d1"} <= set(plan.num_scheduled_tokens)  # no decode is held back
        chunks.append(plan.num_scheduled_tokens["long"])
    assert chunks == [8] * 5  # without the bound: one step of 40


def test_arrivals_together_join_one_after_another_within_the_bound():
    s = decoding(4, mixed_prefill_tokens=12, mixed_prefill_per_decode=0.0)
    for i in range(3):  # 3 waiting beside 4 decoding: the bound holds
        s.add_request(make_request(f"a{i}", 10, max_tokens=4, ignore_eos=True, arrival_s=1.0 + i))
    order, taken = [], []
    for _ in range(3):
        plan, events = step(s)
        order += admissions(events)
        taken.append(prompt_tokens(s, plan))
    assert order == ["a0", "a1", "a2"]  # in arrival order, each as the bound frees up
    assert taken == [12, 12, 6] and max(taken) <= 12


def test_the_bound_grows_with_the_requests_decoding():
    # 10 decoding at 2 tokens each: 20 prompt tokens a step, more than the floor of 8.
    s = decoding(10, mixed_prefill_tokens=8, mixed_prefill_per_decode=2.0)
    s.add_request(make_request("long", 60, max_tokens=4, ignore_eos=True, arrival_s=1.0))
    plan, _ = step(s)
    assert plan.num_scheduled_tokens["long"] == 20


def test_with_nothing_decoding_prompts_join_at_once():
    s = make_scheduler(max_num_batched_tokens=256, num_blocks=256, max_num_seqs=32,
                       mixed_prefill_tokens=4)
    for i in range(8):
        s.add_request(make_request(f"b{i}", 10, max_tokens=4, arrival_s=float(i)))
    plan, _ = step(s)
    assert len(plan.new_requests) == 8 and prompt_tokens(s, plan) == 80


def test_a_burst_larger_than_the_requests_decoding_is_admitted_as_without_the_bound():
    def first_plan(bound: int) -> dict:
        s = decoding(2, mixed_prefill_tokens=bound, mixed_prefill_per_decode=0.0)
        for i in range(3):  # 3 waiting beside 2 decoding
            s.add_request(make_request(f"b{i}", 10, max_tokens=4, arrival_s=1.0 + i))
        return dict(step(s)[0].num_scheduled_tokens)
    assert first_plan(4) == first_plan(0)
    assert sum(first_plan(4).values()) == 2 + 30


def test_a_preempted_request_recomputes_within_the_bound():
    """A request preempted for memory comes back as a prefill of prompt and output:
    beside decoding requests it too is computed the bound at a time, and nothing is lost."""
    s = make_scheduler(max_num_batched_tokens=256, num_blocks=12, block_size=4, max_num_seqs=8,
                       admission_watermark=0.0, admission_headroom_steps=0,
                       mixed_prefill_tokens=3, mixed_prefill_per_decode=0.0)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 6, max_tokens=14, ignore_eos=True, arrival_s=float(i)))
    events, preempted, bound_held = [], 0, 0
    for _ in range(400):
        if not s.has_work():
            break
        bound = bound_before_step(s)
        plan, new = step(s)
        events += new
        preempted += len(plan.preempted_ids)
        if bound is not None:
            assert prompt_tokens(s, plan) <= bound == 3
            bound_held += 1
    assert bound_held
    assert preempted, "the trace was meant to preempt"
    assert completions(events) and len(completions(events)) == 3
    assert s.blocks.num_free_blocks == 12


@pytest.mark.parametrize("chunks", [0, 3])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_a_bound_loses_no_request_and_no_block_and_holds_in_every_step(policy, seed, chunks):
    rng = random.Random(seed)
    s = make_scheduler(policy, num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                       admission_delay_budget=rng.choice([0, 24]), admission_min_tokens=3,
                       mixed_prefill_tokens=5, mixed_prefill_per_decode=1.0, mixed_prefill_chunks=chunks)
    arrivals = sorted(rng.randint(0, 120) for _ in range(24))
    events, bound_held = [], 0
    for t in range(2000):
        arrive(s, rng, arrivals, t, 24)
        bound = bound_before_step(s)
        plan, new = step(s, float(t))
        events += new
        if bound is not None:
            assert prompt_tokens(s, plan) <= bound
            bound_held += prompt_tokens(s, plan) == bound
        if not arrivals and not s.has_work():
            break
    assert not s.has_work() and len(completions(events)) == 24
    assert s.blocks.num_free_blocks == 40
    assert bound_held, "the bound was meant to bind in some step"


@pytest.mark.parametrize("seed", range(4))
def test_a_bound_that_never_binds_changes_no_decision(seed):
    def plans(bound: int) -> list:
        return random_arrival_plans(seed, mixed=False, admission_watermark=0.0, admission_headroom_steps=0,
                                    mixed_prefill_tokens=bound)
    assert plans(10**9) == plans(0)


def test_prompts_beside_decodes_all_finish_and_give_back_every_block():
    s = decoding(3, mixed_prefill_tokens=4, mixed_prefill_per_decode=0.0)
    for i in range(3):
        s.add_request(make_request(f"q{i}", 17, max_tokens=3, ignore_eos=True, arrival_s=1.0 + i))
    plans, events = run_until_idle(s, max_steps=2000)
    assert {f"q{i}" for i in range(3)} <= set(completions(events))
    assert max(prompt_tokens(s, p) for p in plans[:20]) == 4  # the queue joined 4 tokens a step
    assert s.blocks.num_free_blocks == 512


def test_drain_steps_decide_which_queue_the_bound_holds():
    """A queue of 3 x 10 tokens beside 3 decoding requests, bound 1: past 16 steps of
    the bound, so admitted as without it; with 64 steps it joins a token a step."""
    def first_plan(**config) -> dict:
        s = decoding(3, **{"mixed_prefill_tokens": 1, "mixed_prefill_per_decode": 0.0, **config})
        for i in range(3):
            s.add_request(make_request(f"q{i}", 10, max_tokens=4, ignore_eos=True, arrival_s=1.0 + i))
        return dict(step(s)[0].num_scheduled_tokens)
    assert first_plan() == first_plan(mixed_prefill_tokens=0)
    assert sum(first_plan().values()) == 3 + 30
    held = first_plan(mixed_prefill_drain_steps=64)
    assert sum(held.values()) == 3 + 1 and held.get("q0") == 1
    assert first_plan(mixed_prefill_drain_steps=30) == held  # 30 tokens within 30 steps of 1
    assert first_plan(mixed_prefill_drain_steps=29) == first_plan()


def test_chunks_spread_a_long_prompt_over_that_many_steps_and_a_short_one_over_the_floor():
    def chunks_of(prompt_len: int) -> list[int]:
        s = decoding(2, mixed_prefill_tokens=4, mixed_prefill_per_decode=0.0, mixed_prefill_chunks=4)
        s.add_request(make_request("p", prompt_len, max_tokens=4, ignore_eos=True, arrival_s=1.0))
        out = []
        while not s.requests["p"].output_token_ids:
            plan, _ = step(s)
            assert {"d0", "d1"} <= set(plan.num_scheduled_tokens)
            out.append(plan.num_scheduled_tokens["p"])
        return out
    assert chunks_of(40) == [10] * 4  # the floor alone: ten steps of 4
    assert chunks_of(42) == [11, 11, 11, 9]  # rounded up, never a fifth step
    assert chunks_of(12) == [4] * 3  # 12 / 4 is under the floor


def test_chunks_keep_a_queue_of_long_prompts_under_the_bound():
    """3 x 40 tokens beside 3 decoding requests, floor 1: past 16 steps of the floor,
    so admitted whole; at 4 chunks a prompt the bound is 10 and the queue joins 10 a
    step, one prompt after another."""
    def first_plans(chunks: int) -> list[dict]:
        s = decoding(3, mixed_prefill_tokens=1, mixed_prefill_per_decode=0.0, mixed_prefill_chunks=chunks)
        for i in range(3):
            s.add_request(make_request(f"q{i}", 40, max_tokens=4, ignore_eos=True, arrival_s=1.0 + i))
        return [dict(step(s)[0].num_scheduled_tokens) for _ in range(5)]
    assert sum(first_plans(0)[0].values()) == 3 + 120
    held = first_plans(4)
    assert [p.get("q0", 0) for p in held] == [10, 10, 10, 10, 1]
    assert all(sum(p.values()) == 3 + 10 for p in held[:4])
    assert held[4].get("q1") == 10  # q0 decodes now, beside the next prompt's first chunk


@pytest.mark.parametrize("seed", range(4))
def test_chunks_that_never_raise_the_bound_change_no_decision(seed):
    """At 1,000 chunks a prompt's share is one token, under the floor of 3, so the
    plans are those without chunks."""
    def plans(chunks: int) -> list:
        return random_arrival_plans(seed, mixed_prefill_tokens=3, mixed_prefill_per_decode=1.0,
                                    mixed_prefill_chunks=chunks)
    assert plans(1000) == plans(0)


def test_a_burst_beside_running_requests_joins_in_two_halves():
    s = decoding(2, admission_burst_split=2, mixed_prefill_tokens=4, mixed_prefill_per_decode=0.0)
    for i in range(7):  # 7 waiting beside 2 running: the older 4, whole, then the other 3
        s.add_request(make_request(f"b{i}", 10, max_tokens=4, ignore_eos=True, arrival_s=1.0 + i))
    plan, events = step(s)
    assert admissions(events) == ["b0", "b1", "b2", "b3"]
    assert all(plan.num_scheduled_tokens[f"b{i}"] == 10 for i in range(4))
    # 3 waiting beside 6 decoding, 30 tokens within 16 steps of the bound of 4: the bound holds.
    plan, events = step(s)
    assert admissions(events) == ["b4"] and prompt_tokens(s, plan) == 4


def test_a_split_burst_larger_than_the_bound_admits_joins_whole_in_its_second_step():
    s = decoding(2, admission_burst_split=2, mixed_prefill_tokens=1, mixed_prefill_per_decode=0.0)
    for i in range(7):
        s.add_request(make_request(f"b{i}", 10, max_tokens=4, ignore_eos=True, arrival_s=1.0 + i))
    assert admissions(step(s)[1]) == ["b0", "b1", "b2", "b3"]
    # 30 waiting tokens > 16 steps of a bound of 1: joined as without it.
    assert admissions(step(s)[1]) == ["b4", "b5", "b6"]


def test_a_burst_split_in_thirds_joins_a_third_a_step():
    s = decoding(1, admission_burst_split=3)
    for i in range(9):  # 9 waiting beside 1 running: 3, then 2 of the 6 left beside 4
        s.add_request(make_request(f"b{i}", 10, max_tokens=4, ignore_eos=True, arrival_s=1.0 + i))
    assert admissions(step(s)[1]) == ["b0", "b1", "b2"]
    assert admissions(step(s)[1]) == ["b3", "b4"]


def test_without_a_split_a_burst_joins_at_once():
    s = decoding(2)
    for i in range(7):
        s.add_request(make_request(f"b{i}", 10, max_tokens=4, ignore_eos=True, arrival_s=1.0 + i))
    assert len(admissions(step(s)[1])) == 7


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_split_bursts_lose_no_request_and_no_block(policy, seed):
    rng = random.Random(seed)
    split = rng.choice([2, 3])
    s = make_scheduler(policy, num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                       admission_burst_split=split, admission_delay_budget=rng.choice([0, 24]),
                       admission_min_tokens=3, mixed_prefill_tokens=rng.choice([0, 5]))
    events, num_split = [], 0
    for t in range(3000):
        if t < 24:
            s.add_request(random_request(rng, f"r{t}", float(t)))
        num_running, num_waiting = len(s.running), len(s.policy)
        plan, new = step(s, float(t))
        events += new
        if num_running and num_waiting > num_running:
            assert len(plan.new_requests) <= -(-(num_waiting + len(plan.preempted_ids)) // split)
            num_split += 1
        if t >= 24 and not s.has_work():
            break
    assert num_split, "the trace was meant to split a burst"
    assert not s.has_work() and len(completions(events)) == 24
    assert s.blocks.num_free_blocks == 40
