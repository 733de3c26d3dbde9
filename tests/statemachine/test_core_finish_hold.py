"""Admission held while the running requests finish (`admission_finish_hold_steps`):
it holds only while every running request decodes and is within the hold of its
length limit, never more steps in a row than the hold, and otherwise changes no
decision."""

from __future__ import annotations

import random

import pytest

from core_helpers import admissions, drive_step, make_request, make_scheduler, step


def _admit_steps(hold: int, arrival: int = 2) -> tuple[dict[str, int], int]:
    """Two requests of 4 output tokens run; a third arrives before step `arrival`
    (before step 2 they have two tokens to go, before step 3 one). The step each
    request was admitted in, and the steps held."""
    s = make_scheduler(admission_finish_hold_steps=hold)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, 4, max_tokens=4, ignore_eos=True))
    admitted: dict[str, int] = {}
    for t in range(12):
        if t == arrival:
            s.add_request(make_request("c", 4, max_tokens=4, ignore_eos=True))
        _, events = step(s)
        for rid in admissions(events):
            admitted.setdefault(rid, t)
    assert not s.has_work()
    assert s.stats().num_admission_finish_holds == s.collector.num_admission_finish_holds
    return admitted, s.collector.num_admission_finish_holds


def test_the_running_requests_finish_before_an_arrival_joins():
    assert _admit_steps(0) == ({"a": 0, "b": 0, "c": 2}, 0)
    # Two tokens to go at step 2, one at step 3: both steps held, c joins at step 4.
    assert _admit_steps(2) == ({"a": 0, "b": 0, "c": 4}, 2)
    # A hold of one waits only for the last token.
    assert _admit_steps(1) == ({"a": 0, "b": 0, "c": 2}, 0)
    assert _admit_steps(1, arrival=3) == ({"a": 0, "b": 0, "c": 4}, 1)
    assert _admit_steps(0, arrival=3) == ({"a": 0, "b": 0, "c": 3}, 0)


def test_one_request_with_more_to_go_holds_nothing():
    """A running request further from its end than the hold: the arrival joins at
    once, and every plan is the one made without the hold."""
    def run(hold: int) -> list[tuple]:
        s = make_scheduler(admission_finish_hold_steps=hold)
        arrivals = {0: [make_request("near", 4, max_tokens=3, ignore_eos=True),
                        make_request("far", 4, max_tokens=20, ignore_eos=True)],
                    1: [make_request("new", 4, max_tokens=3, ignore_eos=True)]}
        plans = [drive_step(s, arrivals, {}, t) for t in range(30)]
        assert not s.has_work()
        assert s.collector.num_admission_finish_holds == 0
        return plans

    assert run(2) == run(0)


def _workload(seed: int, eos: bool):
    """Closed-loop-like arrivals: 24 requests over 40 steps, short prompts and
    outputs; with `eos`, limits up to 3 tokens past the real length, which ends
    in EOS (a request that stops early ends a hold sooner, never later)."""
    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    eos_after: dict[str, int] = {}
    for i in range(24):
        rid = f"r{i}"
        out_len = rng.randint(1, 8)
        arrivals.setdefault(rng.randint(0, 40), []).append(
            make_request(rid, rng.randint(2, 12), max_tokens=out_len + (rng.randint(0, 3) if eos else 0),
                         ignore_eos=not eos))
        eos_after[rid] = out_len
    return arrivals, eos_after


@pytest.mark.parametrize("hold", [1, 2, 3])
@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_hold_lasts_at_most_its_steps_and_changes_nothing_before_it(hold, eos, seed):
    """Side by side with a scheduler without the hold: the same plans until the
    first step held; a step is held only while every running request decodes and
    is within the hold of its length limit; no more than `hold` steps are held in
    a row; every request finishes."""
    held_s = make_scheduler(admission_finish_hold_steps=hold, max_num_seqs=4, num_blocks=48)
    plain = make_scheduler(max_num_seqs=4, num_blocks=48)
    arrivals, eos_after = _workload(seed, eos)
    twins, _ = _workload(seed, eos)  # a request object joins one scheduler
    diverged, in_a_row, num_held = False, 0, 0
    for t in range(400):
        if not (held_s.has_work() or plain.has_work()) and t > 40:
            break
        running = [(r.length_limit - len(r.all_token_ids), r.num_tokens - r.num_computed_tokens)
                   for r in held_s.running]
        before = held_s.collector.num_admission_finish_holds
        mine = drive_step(held_s, arrivals, eos_after, t)
        theirs = drive_step(plain, twins, eos_after, t)
        if held_s.collector.num_admission_finish_holds > before:
            num_held += 1
            in_a_row += 1
            assert in_a_row <= hold
            assert running and all(left <= hold and todo <= 1 for left, todo in running)
            assert mine[1] == [], "a held step admitted a request"
            diverged = True
        else:
            in_a_row = 0
        if not diverged:
            assert mine == theirs
    assert not held_s.has_work() and not plain.has_work()
    assert held_s.collector.num_admission_finish_holds == num_held
    if not eos:  # exact limits: every trace here comes within the hold of one
        assert num_held > 0
