"""The Hypothesis state machines of cadence.spec.stateful, per policy, and proof
that they catch a policy that breaks first-come first-served."""

import os
import sys
import textwrap

import attrs
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from cadence.spec.stateful import (
    SMALL_CONFIG, SchedulerStateMachine, scheduler_state_machine, state_machine_settings,
)
from cadence.statemachine.policy import KeyedPolicy

# Hypothesis machines over whole configurations.
pytestmark = pytest.mark.timeout(900)

TestFcfs = scheduler_state_machine(attrs.evolve(SMALL_CONFIG, policy="fcfs")).TestCase
TestPriority = scheduler_state_machine(
    attrs.evolve(SMALL_CONFIG, policy="priority")).TestCase
TestDeadline = scheduler_state_machine(
    attrs.evolve(SMALL_CONFIG, policy="deadline", reject_late=True)).TestCase
TestFair = scheduler_state_machine(attrs.evolve(SMALL_CONFIG, policy="fair")).TestCase
TestStrictPriority = scheduler_state_machine(
    attrs.evolve(SMALL_CONFIG, policy="strict-priority")).TestCase
TestNoPrefixCacheOneInFlight = scheduler_state_machine(
    SMALL_CONFIG, attrs.evolve(SchedulerStateMachine.cache_config, enable_prefix_caching=False),
    max_inflight=1).TestCase


class LastComeFirstServed(KeyedPolicy):
    """Breaks DESIGN §4 item 9 on purpose."""

    name = "lcfs"

    def key(self, request):
        return (-request.arrival_s,)


def test_a_user_policy_that_breaks_fcfs_is_caught():
    machine = scheduler_state_machine(
        attrs.evolve(SMALL_CONFIG, policy="user:LastComeFirstServed", max_num_seqs=1),
        make_policy=LastComeFirstServed)
    machine.priorities, machine.tenants = (0,), ("a",)
    # No shrinking: only that a failure is found matters here, and shrinking it is slow.
    quick = settings(state_machine_settings(300), phases=[Phase.generate], database=None,
                     derandomize=True)
    with pytest.raises(BaseException) as info:
        run_state_machine_as_test(machine, settings=quick)
    assert "same class" in str(info.value) or "same class" in repr(
        getattr(info.value, "exceptions", ""))


def test_a_user_policy_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "user_policies.py").write_text(textwrap.dedent("""
        from cadence.statemachine.policy import KeyedPolicy

        class OldestFirst(KeyedPolicy):
            name = "oldest"

            def key(self, request):
                return (request.arrival_s,)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    machine = scheduler_state_machine(
        attrs.evolve(SMALL_CONFIG, policy="user_policies:OldestFirst"))
    run_state_machine_as_test(machine, settings=state_machine_settings(20))
    sys.modules.pop("user_policies", None)


def test_settings_follow_the_environment(monkeypatch):
    monkeypatch.setenv("CADENCE_EXPLORE", "1")
    assert state_machine_settings().max_examples >= 1000
    monkeypatch.delenv("CADENCE_EXPLORE")
    monkeypatch.setenv("CI", "true")
    assert state_machine_settings().derandomize
    assert os.environ["CI"] == "true"


# Each run draws tight limits first: more seats than budget tokens, budgets below
# one prompt, few blocks; the families each move exercised go to hypothesis.event.
TestFcfsTight = scheduler_state_machine(attrs.evolve(SMALL_CONFIG, policy="fcfs"),
                                        draw_config=True, name="TightFcfs").TestCase
TestPriorityTight = scheduler_state_machine(attrs.evolve(SMALL_CONFIG, policy="priority"),
                                            draw_config=True, name="TightPriority").TestCase
TestDeadlineTight = scheduler_state_machine(
    attrs.evolve(SMALL_CONFIG, policy="deadline", reject_late=True),
    draw_config=True, name="TightDeadline").TestCase
TestFairTight = scheduler_state_machine(attrs.evolve(SMALL_CONFIG, policy="fair"),
                                        draw_config=True, name="TightFair").TestCase
