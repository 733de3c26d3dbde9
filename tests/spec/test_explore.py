"""Exhaustive exploration of the real core: safety, refinement and starvation per policy.

Runs at CADENCE_SPEC_SCOPE (small by default); the state and transition
counts are printed (pytest -s) and asserted to be non-trivial.
"""

import copy

import attrs

import pytest

from cadence.spec.explore import (
    CI_SCOPES, SCOPES, Scope, Shape, canonical_key, explore, explore_identity, uniform_scope,
)
from cadence.spec.harness import Harness

# Whole-scope explorations: minutes each on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(1800)

LIVE_POLICIES = ["fcfs", "priority", "deadline", "fair"]
REACH_SCOPES = [name for name in CI_SCOPES if SCOPES[name].max_depth is not None]


@pytest.mark.parametrize("policy", LIVE_POLICIES + ["strict-priority"])
def test_every_reachable_state_is_safe_and_refines_the_spec(policy, spec_scope, exploration):
    ex, _ = exploration(policy, spec_scope)
    assert not ex.violations, str(ex.violations[0])
    assert ex.complete
    assert ex.num_states > 1000 and ex.num_transitions > 5 * ex.num_states


@pytest.mark.parametrize("scope_name", REACH_SCOPES)
@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_the_reach_scopes_are_safe_and_refine_the_spec(policy, scope_name, exploration):
    """The depth-bounded scopes chosen for reach (preemption, pipelining, tight
    budgets): every state within the bound is safe and every move refines the spec."""
    ex, _ = exploration(policy, scope_name)
    assert not ex.violations, str(ex.violations[0])
    assert ex.complete and ex.num_bounded > 0
    assert ex.num_states > 1000


@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline", "fair"])
def test_no_starvation_within_scope(policy, spec_scope, exploration):
    ex, live = exploration(policy, spec_scope)
    assert live is not None and live.num_nodes > 0
    assert live.starvation is None, str(live.starvation)


def test_strict_priority_starves_and_the_lasso_replays(spec_scope, exploration):
    ex, live = exploration("strict-priority", spec_scope)
    s = live.starvation
    assert s is not None, "strict-priority must be reported as starving"
    assert s.confirmed
    assert any(m[0] in ("step", "complete") for m in s.loop)
    namespace: dict = {}
    exec(compile(s.code, "<lasso>", "exec"), namespace)  # the printed test runs and passes
    namespace[next(k for k in namespace if k.startswith("test_"))]()


def test_canonical_key_ignores_names_but_not_progress():
    config, cache = SCOPES["small"].configs("fcfs")
    a, b = Harness(config, cache), Harness(config, cache)
    a.add("x", (1, 2, 3), 2)
    a.add("y", (4,), 2, priority=1)
    b.add("p", (1, 2, 3), 2)
    b.add("q", (4,), 2, priority=1)
    assert canonical_key(a, 3)[0] == canonical_key(b, 3)[0]
    a.step()
    assert canonical_key(a, 3)[0] != canonical_key(b, 3)[0]
    b.step()
    assert canonical_key(a, 3)[0] == canonical_key(b, 3)[0]
    c = a.clone()
    c.step()
    assert canonical_key(a, 3)[0] == canonical_key(b, 3)[0] != canonical_key(c, 3)[0]


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_clones_are_made_by_hand_and_independent(policy, monkeypatch):
    """The explorer clones a harness per transition: every field of the core's
    structures must be copied by hand (a field missed falls back to a deep copy,
    several times slower), and a clone must not share mutable state. Preemption
    leaves retained blocks, so every block-manager field is populated."""
    config, cache = SCOPES["tight"].configs(policy)
    h = Harness(config, cache)
    h.add("a", (1, 2, 3), 4, tenant="a")
    h.add("b", (4,), 3, priority=1, tenant="b")
    for _ in range(6):
        h.step()
    assert h.scheduler.blocks.num_releases > 0
    before = canonical_key(h, 3)[0]

    def no_deepcopy(*args, **kwargs):
        raise AssertionError("clone fell back to copy.deepcopy")

    monkeypatch.setattr(copy, "deepcopy", no_deepcopy)
    c = h.clone()
    monkeypatch.undo()
    blocks, copied = h.scheduler.blocks, c.scheduler.blocks
    for name, value in vars(blocks).items():
        if isinstance(value, (list, dict, set)):
            assert getattr(copied, name) is not value, f"BlockManager.{name} is shared"
    c.add("c", (5,), 2, tenant="a")
    while c.scheduler.requests:
        c.step()
    assert canonical_key(h, 3)[0] == before


def test_a_broken_core_gives_a_shortest_runnable_counterexample(monkeypatch):
    """Break block accounting (a finished request's blocks are never freed): the
    explorer must stop with a short trace whose printed test reproduces it."""
    from cadence.statemachine.blocks import BlockManager
    real_free = BlockManager.free

    def leaky_free(self, request_id):
        if len(self.tables.get(request_id, ())) > 1:
            self.tables.pop(request_id)
            self.num_hashed.pop(request_id, None)
            return
        real_free(self, request_id)

    monkeypatch.setattr(BlockManager, "free", leaky_free)
    scope = Scope(name="tiny", shapes=(Shape((1, 2, 3), 1),), max_live=2)
    ex = explore("fcfs", scope)
    assert ex.violations and not ex.complete
    v = ex.violations[0]
    assert len(v.moves) <= 3
    assert "CheckedHarness" in v.code and "def test_" in v.code
    namespace: dict = {}
    exec(compile(v.code, "<counterexample>", "exec"), namespace)
    test = namespace[next(k for k in namespace if k.startswith("test_"))]
    with pytest.raises(AssertionError):
        test()


@pytest.mark.parametrize("scope_name", ["small", "tight"])
@pytest.mark.parametrize("policy", ["fair", "priority", "deadline"])
def test_policies_with_one_tenant_priority_and_no_deadline_plan_as_fcfs(policy, scope_name):
    """`fair` with one tenant, `priority` with one priority and `deadline` with no
    deadlines: in every state pair reachable at the scope (shapes made uniform),
    each move leaves both cores with the same events and plans, entry for entry."""
    result = explore_identity(policy, SCOPES[scope_name])
    assert result.difference is None, result.difference
    assert result.complete and result.num_states > 1000
    shapes = result.scope.shapes
    assert len({(s.priority, s.tenant, s.deadline_after_s) for s in shapes}) == 1


def test_the_identity_check_finds_a_policy_that_plans_otherwise():
    """`weighted` with a throughput weight admits short prompts first: the lockstep
    exploration stops at the first plan that differs, with the moves to it."""
    small = SCOPES["small"]
    scope = attrs.evolve(small, config_overrides={**small.config_overrides,
                                                  "throughput_weight": 1.0})
    result = explore_identity("weighted", scope)
    assert result.difference is not None and "weighted decided" in result.difference
    assert result.moves and result.moves[-1][0] in ("step", "add")
    assert uniform_scope(scope).shapes == result.scope.shapes


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_passed_over_without_a_skip_is_caught(patch_core, policy):
    """`overtaken_only_when_skipped` (the aging bound's plan invariant) fails at the
    tight scope when the core forgets to count skips."""
    # Not charged a skip, a request passed over never holds capacity.
    patch_core("_admit", "request.num_skips += 1", "pass")
    ex = explore(policy, SCOPES["tight"], keep_graph=False, coverage=False)
    assert ex.violations
    assert "overtaken_only_when_skipped" in "\n".join(ex.violations[0].problems)
