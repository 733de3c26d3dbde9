"""`cadence check`: run the formal checks against one or more scheduling policies.

    cadence check --policy fcfs --policy mypkg.policies:MyPolicy [--scope small ...]

For each policy and scope (by default the CI scopes: small, tight, pipelined, forked):
explore every reachable state (safety invariants and refinement of the
reference spec on every move), search the explored graph for starvation
(exhaustive scopes only), and run the Hypothesis state machine once per policy.
Prints a verdict per policy and scope, with a runnable counterexample for
anything found, then a coverage table per policy: how many explored
transitions exercised each behaviour family of the core, per scope ("-" where
the policy or scope cannot reach it). Exits 0 if every policy is clean, 1
otherwise. Progress (each stage as it starts, with the seconds so far) goes to
stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from typing import Callable

import attrs

from cadence.statemachine.config import SchedulerConfig
from cadence.statemachine.errors import ConfigError
from cadence.statemachine.policy import make_policy

from .coverage import format_table
from .explore import CI_SCOPES, SCOPES, explore
from .liveness import find_starvation

BUILT_IN = ("fcfs", "priority", "deadline", "fair", "strict-priority")


@attrs.define
class Verdict:
    """What the checks found for one policy."""

    policy: str
    problems: list[str] = attrs.Factory(list)
    notes: list[str] = attrs.Factory(list)
    details: list[str] = attrs.Factory(list)
    coverage: object = None
    scope: str = ""

    @property
    def clean(self) -> bool:
        """Whether nothing was found."""
        return not self.problems

    def format(self) -> str:
        """The verdict as printed by `cadence check`."""
        head = f"{self.policy}: {'CLEAN' if self.clean else 'VIOLATION'}"
        if self.scope:
            head += f" (scope {self.scope})"
        lines = [head] + [f"  - {p}" for p in self.problems] + [f"    {n}" for n in self.notes]
        return "\n".join(lines + self.details)


def check_policy(policy: str, scope_name: str = "small", *, liveness: bool = True,
                 stateful: bool = True, examples: int | None = None,
                 horizon: int | None = None, out=sys.stdout, explorer=None,
                 progress: Callable[[str], None] | None = None) -> Verdict:
    """Run the explorer, the starvation search and the state machine for `policy`;
    `progress(stage)` is called as each stage starts.

    The starvation search runs only where the scope is exhaustive (no depth
    bound). `explorer(policy, scope)` replaces `explore` (the tests share one
    exploration between checks)."""
    scope = SCOPES[scope_name]
    if horizon is not None:
        scope = attrs.evolve(scope, time_horizon=horizon)
    liveness = liveness and scope.max_depth is None
    verdict = Verdict(policy, scope=scope_name)
    started = time.perf_counter()
    report = progress if progress is not None else (lambda stage: None)
    report(f"exploring the {scope_name} scope")
    ex = (explorer or (lambda p, sc: explore(p, sc, keep_graph=liveness)))(policy, scope)
    verdict.coverage = ex.coverage
    verdict.notes.append(ex.summary())
    if ex.num_cut:
        verdict.notes.append(f"{ex.num_cut} states beyond the scope's counter bound were not expanded")
    if not ex.complete and not ex.violations:
        verdict.notes.append(f"stopped at max_states={scope.max_states}: the scope is not exhausted")
    for v in ex.violations:
        verdict.problems.append(f"safety: {v.problems[0]}")
        verdict.details.append(_indent(f"shortest trace ({len(v.moves)} moves), as a test:\n{v.code}"))
    if liveness and not ex.violations:
        report("searching for starvation")
        result = find_starvation(ex)
        verdict.notes.append(f"starvation search: {result.num_nodes} (state, waiting request) "
                             f"pairs, {result.num_edges} edges")
        if result.starvation is not None:
            s = result.starvation
            verdict.problems.append(f"starvation: {s.request_id} can wait forever while others "
                                    f"finish ({'confirmed' if s.confirmed else 'unconfirmed'} "
                                    "on the real core)")
            verdict.details.append(_indent(s.code))
    if stateful:
        report("running the state machine")
        failure = _run_state_machine(ex.config, ex.cache_config, examples)
        if failure:
            verdict.problems.append(f"state machine: {failure.splitlines()[0]}")
            verdict.details.append(_indent(failure))
        else:
            verdict.notes.append("state machine: no failure")
    verdict.notes.append(f"{time.perf_counter() - started:.1f}s in all")
    return verdict


def _run_state_machine(config, cache_config, examples: int | None) -> str | None:
    try:
        from hypothesis.stateful import run_state_machine_as_test
    except ImportError:
        return None  # Hypothesis is a test dependency; without it only the explorer runs

    from .stateful import SMALL_CACHE, SMALL_CONFIG, scheduler_state_machine, state_machine_settings
    machine_config = attrs.evolve(SMALL_CONFIG, policy=config.policy)
    cls = scheduler_state_machine(machine_config, SMALL_CACHE)
    try:
        run_state_machine_as_test(cls, settings=state_machine_settings(examples))
    except Exception as exc:  # a failing example: report it, do not crash the command
        return f"{type(exc).__name__}: {exc}"
    return None


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())


# Exit status of a command line that names something that does not exist (as argparse's).
USAGE_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of `cadence check`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="cadence check",
        description="Model-check scheduling policies against the reference spec of the core. "
                    "The default run (four built-in policies, the three CI scopes) takes a "
                    "few minutes on two cores; one --policy takes about a quarter of that.")
    parser.add_argument("--policy", action="append", metavar="NAME|package.module:Class",
                        help=f"policy to check (repeatable; default: {', '.join(BUILT_IN[:4])})")
    parser.add_argument("--scope", choices=sorted(SCOPES), action="append",
                        help="bounds of the exploration (repeatable; default: "
                             f"{', '.join(CI_SCOPES)}, or $CADENCE_SPEC_SCOPE)")
    parser.add_argument("--examples", type=int, default=None,
                        help="Hypothesis examples for the state machine")
    parser.add_argument("--horizon", type=int, default=None,
                        help="ticks beyond which arrival gaps are merged (default: derived "
                             "from aging_steps and deadlines; raise it for a time-sensitive policy)")
    parser.add_argument("--no-liveness", action="store_true", help="skip the starvation search")
    parser.add_argument("--no-stateful", action="store_true", help="skip the state machine")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    policies = args.policy or list(BUILT_IN[:4])
    for policy in policies:
        # A policy that cannot be loaded is a usage error, not a finding of the checks.
        try:
            make_policy(SchedulerConfig(policy=policy))
        except ConfigError as exc:
            print(f"cadence check: {exc}", file=sys.stderr)
            return USAGE_ERROR
    env_scope = os.environ.get("CADENCE_SPEC_SCOPE")
    scopes = args.scope or ([env_scope] if env_scope else list(CI_SCOPES))
    verdicts = []
    started = time.perf_counter()
    for index, policy in enumerate(policies, 1):
        def progress(stage: str, index=index, policy=policy) -> None:
            if not args.quiet:
                print(f"[{index}/{len(policies)} {policy}, {time.perf_counter() - started:.0f}s] "
                      f"{stage}", file=sys.stderr, flush=True)
        tables = {}
        for n, scope_name in enumerate(scopes):
            try:
                verdict = check_policy(policy, scope_name, liveness=not args.no_liveness,
                                       stateful=not args.no_stateful and n == 0,
                                       examples=args.examples, horizon=args.horizon,
                                       progress=progress)
            except Exception as exc:  # e.g. a policy that cannot be loaded
                verdict = Verdict(policy, [f"could not be checked: {type(exc).__name__}: {exc}"],
                                  scope=scope_name)
            print(verdict.format(), flush=True)
            verdicts.append(verdict)
            if verdict.coverage is not None:
                tables[scope_name] = verdict.coverage
        if tables:
            print(f"\ncoverage of {policy} (explored transitions per behaviour family):\n"
                  + _indent(format_table(tables)) + "\n", flush=True)
    bad = sorted({v.policy for v in verdicts if not v.clean})
    print(f"\n{len(policies) - len(bad)} clean, {len(bad)} with violations"
          + (f": {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
