"""The mutation runner tests the mutant, not the checkout: a run against a copy of
the core with a bug in it must fail where the same run against the core passes.

(The suite's guard against testing another copy of cadence once mapped the
runner's mutated tree back onto the checkout, so every mutant passed unseen.)"""

from __future__ import annotations

import pytest

from cadence.spec import mutation

# Two runs of a suite in a fresh tree, each allowed 300 s.
pytestmark = pytest.mark.timeout(900)

SUITE = ("tests/statemachine/test_core_length_estimate.py",)


def test_a_mutant_is_what_the_suites_run_against():
    source = (mutation.CORE / "scheduler.py").read_text()
    broken = source.replace("        return held_back if held_back > floor else floor\n",
                            "        return 0\n")
    assert broken != source
    code, _, _ = mutation.run_suites(None, None, SUITE, 300)
    assert code == 0
    code, failure, _ = mutation.run_suites("scheduler.py", broken, SUITE, 300)
    assert code not in (0, None)
    assert failure.startswith(SUITE[0] + "::")  # a test failed, not the run
