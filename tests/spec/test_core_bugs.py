"""Core bugs the formal checks found, as minimal regression tests.

Each failed on the core as it was when found; fixed ones stay as plain
regression tests, an open one is marked xfail(strict=True) (so its fix turns
the mark into a failure, to be removed).
"""

import attrs

from cadence.spec.refinement import CheckedHarness
from cadence.statemachine.config import CacheConfig, SchedulerConfig

CONFIG = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, max_model_len=12,
                         aging_steps=3, starvation_skip_limit=3, admission_headroom_steps=1,
                         policy="priority")
CACHE = CacheConfig(num_blocks=7, block_size=2)


def test_seat_preemption_only_when_the_preemptor_fits():
    h = CheckedHarness(CONFIG, CACHE)
    h.add("r0", (2,), 1, priority=0)
    h.add("r1", (2,), 1, priority=1)
    h.add("r2", (2, 2, 2, 2, 2, 2), 1, priority=0)
    h.schedule()  # all three run: 1 + 3 + 1 blocks of 7
    h.add("r3", (1, 2, 3, 4, 2), 1, priority=0)  # needs 3 blocks + 1 reserved; 2 are free
    h.schedule()  # preempts r1 for a seat, then r3 does not fit: SpecViolation


def test_seat_preemption_that_admits_is_allowed():
    """The same shape with room for the preemptor: preempting r1 is legitimate."""
    h = CheckedHarness(CONFIG, attrs.evolve(CACHE, num_blocks=10))
    h.add("r0", (2,), 1, priority=0)
    h.add("r1", (2,), 1, priority=1)
    h.add("r2", (2, 2, 2, 2, 2, 2), 1, priority=0)
    h.schedule()
    h.add("r3", (1, 2, 3, 4, 2), 1, priority=0)
    plan = h.schedule()
    assert h.state_of("r1") == "pending" and h.state_of("r3") == "running"
    assert "r3" in plan.num_scheduled_tokens


def test_a_result_from_before_a_preemption_is_ignored():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=10,
                             policy="priority", admission_headroom_steps=0)
    h = CheckedHarness(config, CacheConfig(num_blocks=8, block_size=2))
    h.add("r", (4,), 3, priority=1)
    h.schedule()                      # plan 0 samples r
    h.add("x", (5, 6), 3, priority=0)
    h.schedule()                      # plan 1: x preempts r for the only seat
    h.abort("x")
    h.schedule()                      # plan 2: r re-admitted, will sample again
    h.complete([], 0)                 # plan 0's token for r arrives: must be ignored


def test_an_aged_request_is_not_preempted_in_the_plan_that_admits_it():
    from cadence.spec.explore import SCOPES
    from cadence.spec.harness import Harness
    config, cache = SCOPES["small"].configs("priority")
    h = Harness(config, cache)
    h.add("old", (4,), 2, priority=1)
    for i in range(6):  # two priority-0 requests each round, each done in two steps
        h.add(f"a{i}", (1, 2, 3), 2, priority=0)
        h.add(f"b{i}", (1, 2, 3), 2, priority=0)
        h.step()
        h.step()
    # Each round, "old" is admitted and preempted by the same plan and computes nothing.
    assert h.state_of("old") == "gone", h.scheduler.requests["old"]


def test_budget_preemption_only_when_it_gives_budget_back():
    """Found by the pipelined scope under strict-priority: two plans in flight,
    more seats than budget tokens. r0's token is in flight (it needs no budget
    this step); r1's prefill takes the whole budget; r2, more important, finds
    no budget and preempted r0, which returned none, so r2 was not admitted and
    r0's work was lost for nothing. Now only a victim scheduled in the step may be
    preempted for budget."""
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=2, max_model_len=6,
                             policy="strict-priority", admission_headroom_steps=0)
    h = CheckedHarness(config, CacheConfig(num_blocks=4, block_size=2))
    h.add("r0", (4,), 2, priority=1, tenant="b")
    h.schedule()
    h.add("r1", (1, 2, 3), 2, priority=0, tenant="a")
    h.complete([])
    h.schedule()                      # r0 decodes (its token now in flight), r1 prefills 1
    h.add("r2", (1, 2, 3), 2, priority=0, tenant="a")
    h.schedule()                      # was: preempts r0 and admits nothing (SpecViolation)
    assert h.state_of("r0") == "running" and h.state_of("r2") == "pending"


def test_a_duplicated_answer_does_not_replace_one_held_back():
    """Found by the state machine with async scheduling: plan 1 decodes r ahead of
    plan 0's token and is answered first, so the core holds its answer back; the
    executor then sends plan 1's answer again with another token, which replaced
    the held one, and r emitted the duplicate's token instead of the first answer's."""
    from cadence.statemachine.plan import StepResult
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=8,
                             admission_headroom_steps=1, async_scheduling=True)
    h = CheckedHarness(config, CACHE)
    h.add("r", (2,), 3)
    h.schedule()
    ahead = h.schedule().step_id      # r planned ahead of plan 0's token
    h.complete([], index=1)           # plan 1 answered first: held back
    duplicate = h.scheduler.update(h.scheduler._inflight[ahead], StepResult(ahead, {"r": [7]}))
    assert duplicate == []
    h.complete([], index=0)           # plan 0's answer, then the held one: tokens 1, 1
    assert h.scheduler.requests["r"].output_token_ids == [1, 1]
