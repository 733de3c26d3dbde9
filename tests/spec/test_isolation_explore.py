"""Exhaustive exploration of the poison-isolation machine at small scope: every
property holds in every reachable world, every conviction and refund path is
reached, and each property is shown to catch the bug it names."""

from __future__ import annotations

import pytest

from cadence.spec.isolation import (
    CI_ISOLATION_SCOPES, FAMILIES, ISOLATION_SCOPES, PROPERTIES, explore_isolation,
)
from cadence.statemachine import isolation


@pytest.mark.parametrize("name", CI_ISOLATION_SCOPES)
def test_every_reachable_world_keeps_every_property(name):
    ex = explore_isolation(ISOLATION_SCOPES[name])
    assert ex.violation is None, ex.violation
    assert ex.complete and ex.num_states > 500, ex.summary()


def test_the_scopes_reach_every_conviction_and_refund_path():
    reached = set()
    for name in CI_ISOLATION_SCOPES:
        reached |= explore_isolation(ISOLATION_SCOPES[name]).families
    assert reached == FAMILIES


def test_every_property_has_a_docstring_and_a_name_of_its_own():
    assert len({p.__name__ for p in PROPERTIES}) == len(PROPERTIES) == 5
    assert all(p.__doc__ for p in PROPERTIES)


def broken(monkeypatch, name: str, replacement) -> None:
    monkeypatch.setattr(isolation.Isolation, name, replacement)


def violated(scope: str) -> str:
    ex = explore_isolation(ISOLATION_SCOPES[scope])
    assert ex.violation is not None, f"{scope}: no property caught the bug"
    return ex.violation[1][0]


def test_one_budget_for_all_isolations_closes_the_engine_on_two_poisons(monkeypatch):
    """The accounting of before: an isolation under way is no excuse, so a poison
    arriving while another is isolated closes the engine at max_restarts 1."""
    broken(monkeypatch, "_pending", lambda self: set())
    assert violated("poisons").startswith("poisons_never_close")


def test_a_single_failure_alone_convicts_an_innocent_after_a_transient_fault(monkeypatch):
    monkeypatch.setattr(isolation, "CONVICTING_FAILURES", 1)
    assert violated("faults").startswith("no_innocent_convicted")


def test_refunds_never_made_are_caught(monkeypatch):
    real = isolation.Isolation.call_succeeded

    def keep_refunds(self):
        refunds = list(self._refunds)
        self._refunds.clear()
        real(self)
        self._refunds[:] = refunds
    broken(monkeypatch, "call_succeeded", keep_refunds)
    assert violated("poisons").startswith(("counted_only_without_culprit", "suspects_end"))


def test_a_refund_with_no_culprit_is_caught(monkeypatch):
    """Refunding an origin whose suspects were all cleared: a failure nobody caused
    would cost nothing."""
    real = isolation.Isolation.forget

    def refund_on_clear(self, request_id):
        for gid, group in self.groups.items():
            lineage = self._origin_of.get(gid)
            if request_id in group and lineage is not None and lineage not in self._refunds:
                self._refunds.append(lineage)
        real(self, request_id)
    broken(monkeypatch, "forget", refund_on_clear)
    assert violated("faults").startswith("counted_only_without_culprit")


def test_a_verdict_without_a_successful_call_is_caught(monkeypatch):
    real = isolation.Isolation._convict

    def always_verdict(self, request_id, lineage):
        origin = self._origins.get(lineage)
        if origin is not None:
            origin.ran_since = True
        return real(self, request_id, lineage)
    broken(monkeypatch, "_convict", always_verdict)
    assert violated("poisons").startswith("verdicts_are_earned")


def test_suspects_left_behind_are_caught(monkeypatch):
    broken(monkeypatch, "clear", lambda self, tokens: [])
    assert violated("walkaways").startswith("suspects_end_convicted_or_cleared")
