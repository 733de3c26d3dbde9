"""Policies that reduce to FCFS decide exactly as FCFS: `fair` with one tenant,
`priority` with one priority, `deadline` with no deadlines. Checked on the
Hypothesis state machine's runs (every move mirrored, plans compared), and
shown to catch a policy that differs."""

import attrs
import pytest

from cadence.spec.stateful import (
    SMALL_CACHE, SMALL_CONFIG, MirroredHarness, PolicyIdentityMachine, state_machine_settings,
)

TestIdentity = PolicyIdentityMachine.TestCase
TestIdentity.settings = state_machine_settings()


class TightIdentityMachine(PolicyIdentityMachine):
    """The same under drawn limits (few blocks, budgets below one prompt), where
    preemption and the admission memo decide most."""

    draw_config = True


TestIdentityTight = TightIdentityMachine.TestCase
TestIdentityTight.settings = state_machine_settings()


def test_the_mirror_catches_a_policy_that_decides_otherwise():
    """Two priorities: `priority` admits the urgent request first, fcfs the old one."""
    config = attrs.evolve(SMALL_CONFIG, max_num_seqs=1)
    h = MirroredHarness(config, SMALL_CACHE, ("priority",))
    h.add(None, (1, 2, 3), 2, priority=2)
    h.add(None, (4, 5, 6), 2, priority=0)
    with pytest.raises(AssertionError, match="priority decided"):
        h.schedule()


def test_the_mirror_catches_a_second_tenant():
    """With two tenants `fair` serves the second tenant's request before the first's second."""
    config = attrs.evolve(SMALL_CONFIG, max_num_seqs=1)
    h = MirroredHarness(config, SMALL_CACHE, ("fair",))
    for tenant in ("a", "a", "b"):
        h.add(None, (1, 2, 3), 1, tenant=tenant)
    with pytest.raises(AssertionError, match="fair decided"):
        for _ in range(6):
            h.step()
