"""Shared settings for the formal checks.

CI=true selects Hypothesis's derandomised "ci" profile. CADENCE_EXPLORE=1
selects a long randomised profile; CADENCE_SPEC_SCOPE=medium|large widens the
exhaustive exploration (see spec/README.md).
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from cadence.spec.explore import SCOPES, explore
from cadence.spec.liveness import find_starvation

settings.register_profile(
    "cadence-explore", max_examples=2000, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("CADENCE_EXPLORE") == "1":
    settings.load_profile("cadence-explore")

_EXPLORED: dict = {}


@pytest.fixture
def patch_core(monkeypatch):
    """`patch_core(name, old, new)`: replace `Scheduler.<name>` for the test by its
    own source with `old` replaced by `new` (a deliberate bug for a checker to
    find); fails if `old` is not there."""
    import inspect
    import textwrap

    from cadence.statemachine import scheduler as core

    def patch(name: str, old: str, new: str) -> None:
        source = textwrap.dedent(inspect.getsource(getattr(core.Scheduler, name)))
        assert old in source, f"{old!r} is no longer in Scheduler.{name}; update this test"
        namespace = dict(vars(core))
        exec(compile(source.replace(old, new), core.__file__, "exec"), namespace)
        monkeypatch.setattr(core.Scheduler, name, namespace[name])
    return patch


@pytest.fixture(scope="session")
def spec_scope() -> str:
    """The exploration scope the suite runs at."""
    return os.environ.get("CADENCE_SPEC_SCOPE", "small")


def explored(policy: str, scope_name: str):
    """The exploration of `policy` at a named scope and its starvation search
    (None for a depth-bounded scope or one with a violation), computed once per
    session and shared by every test that needs it."""
    key = (policy, scope_name)
    if key not in _EXPLORED:
        scope = SCOPES[scope_name]
        exhaustive = scope.max_depth is None
        ex = explore(policy, scope, keep_graph=exhaustive)
        live = find_starvation(ex) if exhaustive and not ex.violations else None
        _EXPLORED[key] = (ex, live)
        print(f"\n{ex.summary()}")
    return _EXPLORED[key]


@pytest.fixture(scope="session")
def exploration():
    """`explored(policy, scope_name)`: shared explorations (see `explored`)."""
    return explored


@pytest.fixture
def shared_explorer(monkeypatch):
    """Make `cadence check` reuse the session's explorations."""
    import cadence.spec.check as check

    def cached(policy, scope, keep_graph=True):
        return explored(policy, scope.name)[0] if scope == SCOPES.get(scope.name) else \
            explore(policy, scope, keep_graph=keep_graph)
    monkeypatch.setattr(check, "explore", cached)
