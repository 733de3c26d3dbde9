"""Coverage you can see: every behaviour family a policy can reach is reached by
the CI scopes, families are read correctly from outside the core, and the
Hypothesis machines report them; plus what the reach buys (a bug seen only with
more seats than budget tokens and two plans in flight is caught)."""


import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from cadence.spec import coverage as cov
from cadence.spec.explore import CI_SCOPES, SCOPES, explore
from cadence.spec.harness import Harness
from cadence.spec.stateful import SMALL_CONFIG, scheduler_state_machine, state_machine_settings
from cadence.statemachine import scheduler as core
from cadence.statemachine.config import CacheConfig, SchedulerConfig

# Whole-scope explorations: minutes each on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(1800)

LIVE_POLICIES = ["fcfs", "priority", "deadline", "fair"]


@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_every_reachable_family_is_reached_by_the_ci_scopes(policy, exploration):
    tables = {name: exploration(policy, name)[0].coverage for name in CI_SCOPES}
    reachable = {f for c in tables.values() for f in c.reachable()}
    reached = {f for c in tables.values() for f, n in c.counts.items() if n}
    missing = sorted(reachable - reached)
    assert not missing, f"{policy}: not reached: {missing}\n{cov.format_table(tables)}"
    # Preemption by growth is what the small scope alone never showed for fcfs and deadline.
    assert {"preempt.grow_other", "preempt.grow_self"} <= reached


def test_priority_reaches_both_displacements(exploration):
    reached = {f for name in CI_SCOPES
               for f, n in exploration("priority", name)[0].coverage.counts.items() if n}
    assert {"preempt.displace_seat", "preempt.displace_blocks"} <= reached


def test_what_each_policy_can_reach():
    """Displacement only where a policy may preempt for priority, rejection only
    with deadlines and reject_late, the memo only without reject_late."""
    def able(policy, scope="pipelined", **overrides):
        config, _ = SCOPES[scope].configs(policy)
        return set(cov.Coverage(attrs.evolve(config, **overrides), SCOPES[scope]).reachable())
    assert "preempt.displace_seat" in able("priority") and "preempt.displace_seat" not in able("fcfs")
    assert "reject" in able("deadline") and "reject" not in able("fcfs")
    assert "reject" not in able("deadline", reject_late=False)
    assert "memo.hit" not in able("deadline") and "memo.hit" in able("deadline", "tight")
    assert "inflight.two_plans" not in able("fcfs", "tight")
    overlap = {n for n in cov.FAMILIES if n.startswith("overlap.")}
    assert len(overlap) == 7 and overlap <= able("fcfs", "overlap")
    assert not overlap & able("fcfs", "pipelined"), "async scheduling is off there"
    assert "overlap.answer_deferred" not in able("fcfs", "overlap", async_scheduling=False)
    in_order = attrs.evolve(SCOPES["overlap"], out_of_order=False)
    assert "overlap.answer_deferred" not in set(cov.Coverage(SCOPES["overlap"].configs("fcfs")[0],
                                                            in_order).reachable())


def test_families_are_read_from_outside_the_core():
    """Two one-block requests fill two blocks; the growth of the first preempts it
    (it is its own victim: equal work, the earlier of equal arrivals), and it
    comes back with nothing cached. Each schedule reports what it did."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=2, max_model_len=4,
                             admission_headroom_steps=0)
    h = Harness(config, CacheConfig(num_blocks=2, block_size=2))
    h.add("r0", (1,), 3)
    h.add("r1", (2,), 3)
    seen = []
    for _ in range(4):
        seen.append(cov.watch("schedule", h.scheduler, lambda: [f.plan for f in h.inflight],
                              lambda: (h.schedule(), h.last_events)[1]))
        h.complete()
    assert seen[0] == {"admit"} and seen[1] == set()
    assert {"preempt.grow_self", "grow", "memo.set"} <= seen[2]
    assert "preempt.grow_other" not in seen[2]
    assert {"admit", "readmit.no_hit", "memo.miss.released"} <= seen[3]
    # The wrappers are gone once the move is made.
    assert core.Scheduler._preempt.__name__ == "_preempt"
    assert core.Scheduler._preempt.__qualname__ == "Scheduler._preempt"


def test_a_new_family_joins_the_registry_and_the_table():
    family = cov.register(cov.Family("test.only", "a family registered by this test"))
    try:
        with pytest.raises(ValueError, match="already registered"):
            cov.register(family)
        tally = cov.Coverage(SMALL_CONFIG)
        assert "test.only" in tally.missing()
        tally.add(["test.only", "test.only"])
        assert tally.counts["test.only"] == 1  # counted once per transition
        assert "test.only" in cov.format_table({"x": tally})
    finally:
        del cov.FAMILIES["test.only"]


def test_the_check_command_prints_the_coverage_table(capsys, shared_explorer):
    from cadence.spec.check import main
    assert main(["--policy", "fcfs", "--no-stateful"]) == 0
    out = capsys.readouterr().out
    assert "coverage of fcfs" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("preempt.grow_other"))
    assert row.split()[1:] != ["0", "0", "0"]
    for name in CI_SCOPES:
        assert f"fcfs: CLEAN (scope {name})" in out


def _schedule_running_at_zero_budget(patch_core):
    """Patch the core so the running loop goes on at a budget of zero (the bug
    the issue describes: a request scheduled for no tokens)."""
    patch_core("schedule", "if budget <= 0 or", "if budget < 0 or")


def test_the_zero_budget_bug_is_caught_by_the_pipelined_scope(patch_core):
    _schedule_running_at_zero_budget(patch_core)
    ex = explore("fcfs", SCOPES["pipelined"], keep_graph=False)
    assert ex.violations
    text = "\n".join(ex.violations[0].problems)
    assert "plan_gives_every_request_a_token" in text or "no tokens" in text


def test_the_zero_budget_bug_is_invisible_at_the_small_scope(patch_core):
    """Why the pipelined scope exists: the small scope has fewer seats than tokens."""
    _schedule_running_at_zero_budget(patch_core)
    small = attrs.evolve(SCOPES["small"], max_depth=8)
    assert not explore("fcfs", small, keep_graph=False).violations


class _Recording:
    """Collect the families every run of a machine reached."""

    seen: set = set()

    def teardown(self):
        type(self).seen |= self.families
        super().teardown()


def test_the_overlap_hypothesis_machine_reports_overlap_families():
    base = scheduler_state_machine(attrs.evolve(SMALL_CONFIG, policy="fcfs"),
                                   async_scheduling=True)
    machine = type("RecordingOverlap", (_Recording, base), {"seen": set()})
    run_state_machine_as_test(machine, settings=settings(state_machine_settings(100),
                                                         derandomize=True, database=None))
    assert {"overlap.request_in_two_plans", "overlap.answer_deferred",
            "overlap.held_answer_applied", "overlap.stop_one_step_late",
            "overlap.no_lookahead_at_limit"} <= machine.seen, machine.seen


def test_the_tight_hypothesis_machine_reports_families():
    # Async scheduling fixed off: this run is about the drawn limits (the overlap
    # machine above covers async scheduling).
    base = scheduler_state_machine(attrs.evolve(SMALL_CONFIG, policy="fcfs"), draw_config=True,
                                   async_scheduling=False)
    machine = type("RecordingTight", (_Recording, base), {"seen": set()})
    run_state_machine_as_test(machine, settings=settings(state_machine_settings(60),
                                                         derandomize=True, database=None))
    assert {"admit", "chunk", "budget.more_running_than_tokens", "inflight.two_plans",
            "result.duplicate", "fork.share"} <= machine.seen, machine.seen
