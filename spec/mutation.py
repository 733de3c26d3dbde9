"""Mutation testing of the scheduling core: how many seeded bugs do the fast suites kill?

    python -m cadence.spec.mutation [--jobs 2] [--max-mutants 120] [--seed 0]
                                    [--file scheduler.py] [--only ID ...] [--list]
                                    [--since REV] [--function NAME ...]

Each mutant is one small change to one file of `statemachine/` (a comparison
flipped, an arithmetic or boolean operator swapped, a constant moved by one, a
statement dropped), made on the syntax tree and written into a temporary copy of
the package; the real files are never touched. The CI profile of the fast suites
(`FAST_SUITES`, with CI=true) runs against each mutant, several at once, and stops
at its first failure. A mutant is *killed* when a test fails (or the run exceeds
its time limit, reported apart as *timeout*: an infinite loop is a failure too,
but only a limit well above the unmutated run's time tells one from a slow
machine, so keep `--timeout-factor` at 2 or more), *survived* when every test
passes, and *equivalent* when its id is in `EQUIVALENT`, where each entry says
why no test can tell it from the original.

Operators apply only to code that makes decisions: docstrings, error messages,
statistics and the `SKIP_FUNCTIONS` listed below are left alone, so every
survivor is worth a look. Mutant ids are `file:line:col:operator`, stable while
the file is unchanged, so a survivor can be rerun with `--only`. When the core
changes, `--since REV` keeps the mutants on lines changed since that git
revision and `--function NAME` those inside the named functions: a run for the
new code alone.

A tool of its own rather than mutmut or cosmic-ray: the operators are curated
for this core (no string, message or statistics mutants to triage), mutants run
in parallel in throwaway trees with no configuration or session database, and
the suites run exactly as CI runs them.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import attrs

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "statemachine"
SIBLINGS = ("spec", "actors", "gpu")
"""Packages linked, unmutated, beside the mutated core in each temporary tree."""

FAST_SUITES = (
    "tests/statemachine",
    "tests/spec/test_isolation_explore.py",
    "tests/spec/test_core_bugs.py",
    "tests/spec/test_reference.py",
    "tests/spec/test_stateful.py",
    "tests/spec/test_trace.py",
    "tests/spec/test_coverage.py",
    "tests/spec/test_overlap.py",
    "tests/spec/test_check_cli.py",
)
"""The CI profile's fast tests: the core's unit and stateful tests and the spec
tests that do not explore a whole scope (the reach scopes' tests do, quickly),
and the check command's tests (the only ones that kill a plan scheduling a
request for zero tokens)."""

FILES = ("scheduler.py", "blocks.py", "policy.py", "fsm.py", "request.py", "plan.py",
         "estimate.py", "config.py", "isolation.py")
"""Files of `statemachine/` mutated by default: the ones that decide, the output-length
estimator admission reads, the configuration (its validators and derived limits;
class-level defaults are configuration and are not mutated) and the poison-isolation
machine. Left out: stats, sampling and errors (no decisions), invariants (the checker
itself: a weakened predicate is a passing check; `--file invariants.py` measures the
tests of the tests)."""

SKIP_FUNCTIONS = {
    # Counters for reports; no decision reads them.
    "stats", "saw_time", "_attach_logprobs", "usage", "summary",
    # Representations and error text.
    "__repr__", "__str__",
    # The invariants' own messages are checked by the tests of the invariants;
    # mutating the predicates themselves is kept (see FILES).
}

EQUIVALENT: dict[str, str] = {
    # id -> why no test can distinguish the mutant from the original.
    # Survivors of the runs so far were otherwise killed by tests in
    # tests/statemachine/test_core_mutation_kills.py; mutants of type annotations,
    # which are never evaluated in these modules, are no longer generated.
    "scheduler.py:331:72:compare":
        # `step_id < failed[2]` -> `<=`: the failed-admission memo stands one step
        # longer (ADMISSION_RETRY_STEPS + 1). The window is a tuning constant: it
        # changes when a failed pass is looked at again, never what may be admitted,
        # and no property of DESIGN §4 names the retry step. Not equivalent in
        # timing; equivalent for every specified property.
        "the admission memo's retry window one step longer (timing only)",
    "scheduler.py:333:24:negate":
        # The memo's second clause, `free - (watermark if running else 0) < min_need`,
        # with the condition negated: while requests run it subtracts nothing (the
        # memo stands less often: a pass is repeated that fails the same way, only
        # slower); while none run it subtracts the watermark (the memo stands more
        # often, at most until the queue changes, a release comes or the retry window
        # ends). Like the window mutant above: when a failed pass is looked at again,
        # never what may be admitted. Timing only.
        "the memo's free-block clause with the watermark's condition negated (timing only)",
    "scheduler.py:333:64:constant":
        # The same clause subtracting 1 block instead of 0 while nothing runs: the memo
        # stands a little more often, bounded as above. Timing only.
        "the memo's free-block clause one block stricter while nothing runs (timing only)",
    "scheduler.py:621:27:compare":
        # `has_room = budget > 0` -> `>= 0` in `_admit`'s re-check after a
        # displacement. A displacement for budget or a seat takes only a victim
        # scheduled in this step, which gives back its tokens (at least one: no
        # plan schedules a request for zero); one for a running slot leaves the
        # budget as it was, already above zero. So the re-check never sees zero.
        "the budget after a displacement is never zero",
    "scheduler.py:290:16:break":
        # The running loop's `break` when the budget or the seats run out -> `continue`:
        # every later iteration meets the same test first (nothing in between changes
        # the budget or `scheduled`) and continues, and the loop variable is not read
        # after the loop. Only slower.
        "the rest of the running loop skips every request anyway",
    "blocks.py:155:11:compare":
        # `if num_new < 0: num_new = 0` -> `<= 0`: at zero it sets zero.
        "clamping zero to zero",
    # Async scheduling (`--since` the commit that added it; the rest were killed).
    "scheduler.py:351:27:arith":
        # `computed >= len(all_token_ids) + len(pending)` -> `- len(pending)` when a
        # plan records that it samples: the two differ only for a request with pending
        # steps, and such a request is scheduled only planned ahead (its known tokens
        # are all computed, so any other chunk is empty), with one step pending and
        # computed == len + 1 after it, where `>= len + 1` and `>= len - 1` agree.
        "a request with pending steps is scheduled only planned ahead",
    "scheduler.py:413:36:compare":
        # `known = computed if computed < num_tokens else num_tokens` -> `<=`: at
        # equality both branches give the same number (it is a min).
        "min() at equality",
    "scheduler.py:414:19:compare":
        # `known // block_size > num_hashed[rid]` -> `>=` before
        # `cache_full_blocks(request, known)`, which returns at once when no block
        # past `num_hashed` is full: the guard only saves the call.
        "the callee re-checks the same bound",
    "scheduler.py:414:19:arith":
        # `known // block_size` -> `known * block_size` in the same guard: the guard
        # holds more often; the callee caches exactly the full blocks of `known`.
        "the callee re-checks the same bound",
    "scheduler.py:493:20:drop":
        # `del early[step_id]` for a held answer whose plan is no longer in flight:
        # unreachable. A plan leaves `_inflight` only when its answer is applied
        # (held answers are popped first) or with executor loss, which clears both;
        # an answer to a held plan is ignored. `held_answers_wait_for_older_plans`
        # checks it in every explored state.
        "a held answer's plan is always in flight",
    "scheduler.py:496:31:constant":
        # `progress = True` -> `False` after applying a held answer: the loop then
        # stops after one, but `update` ends with `_update_early` itself while any
        # answer is held, so the recursion applies every answer that becomes ready.
        "update's own call to _update_early looks again",
    "scheduler.py:936:8:augassign":
        # `_preempt`'s `self._queue_version += 1` -> `-= 1`: the version still changes,
        # but an arrival after it can bring it back to a value a failed-admission memo
        # was taken at. The preemption released blocks, so the memo stands only while
        # the free blocks stay below the fewest any waiting request needed at that
        # pass; the victim may need fewer, and then waits until the retry window
        # (ADMISSION_RETRY_STEPS) runs out. Timing only, as the window mutant above:
        # nothing may be admitted that could not be, and no property names the step.
        "a memo that stands a few steps longer after a preemption (timing only)",
    # The fair policy (`--function` on its queue bookkeeping; the rest were killed).
    "policy.py:281:8:drop":
        # `_activate`'s `self._examined.discard(request.request_id)` dropped: the id of
        # a request pushed back stays in `_examined` while it waits. Only `_activate`
        # reads the set, and only for a push; a waiting request is pushed again only
        # after a `pop`, which adds its id anyway, and it leaves the queue by `pop`,
        # `remove` or being scheduled (both discard). So every read sees the same answer.
        "a waiting request's id is re-added by the pop before any read",
    "policy.py:358:11:compare":
        # `if prompt_left > 0` -> `>= 0` in `on_scheduled`: at zero the charge added is
        # min(0, n) * weight = 0, and the tenant's counter already exists (set when its
        # request was pushed), so the counters are unchanged.
        "charging zero prompt tokens adds nothing",
    # Poison isolation (`--file isolation.py`; the rest were killed).
    "isolation.py:102:24:constant":
        # `self._next_id = 0` -> `1`: ids of suspect groups and origins are opaque
        # keys, compared only for equality and kept in creation order; starting
        # the count at 1 renames every one of them alike.
        "the ids of groups and origins start at another number",
    "isolation.py:225:29:constant":
        # `_blame`'s `self._next_id += 1` after taking an origin's id -> `+= 0`: the
        # first half's group then takes the same number, but groups and origins are
        # keys of different maps and never compared with each other; the next origin
        # still gets a fresh id, since every origin is followed by at least one group
        # (its failure had live requests), whose `_add_group` moves the count on.
        "an origin and a group may share a number; they live in different maps",
    # Priority aging in steps (`--since` the commit that added it; the rest were killed).
    "request.py:98:28:constant":
        # `self.arrival_step = 0` -> `1` in `Request.__init__`: a placeholder.
        # `Scheduler.add_request`, the only way into a policy (groups go through it
        # too), sets it to the current step before anything reads it.
        "add_request sets arrival_step before any read",
}


@attrs.frozen
class Mutant:
    """One change to one file: where, which operator, and the mutated source."""

    id: str
    path: str
    line: int
    operator: str
    description: str
    function: str = ""

    def __str__(self) -> str:
        return f"{self.id}  {self.description}"


# ---- operators -----------------------------------------------------------------------
_COMPARE_SWAPS = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_BINOP_SWAPS = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult, ast.Mod: ast.FloorDiv, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
}
_BOOL_SWAPS = {ast.And: ast.Or, ast.Or: ast.And}


def _points(tree: ast.Module) -> Iterator[tuple[ast.AST, str, str, int, str]]:
    """Every mutation point of a module: (node, operator name, description,
    variant, enclosing function)."""
    for func, node in _walk_decisions(tree):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _COMPARE_SWAPS:
                    new = _COMPARE_SWAPS[type(op)].__name__
                    yield node, "compare", f"{type(op).__name__} -> {new}", i, func
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
            yield (node, "arith", f"{type(node.op).__name__} -> "
                   f"{_BINOP_SWAPS[type(node.op)].__name__}", 0, func)
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAPS:
            yield (node, "augassign", f"{type(node.op).__name__}= -> "
                   f"{_BINOP_SWAPS[type(node.op)].__name__}=", 0, func)
        elif isinstance(node, ast.BoolOp):
            yield (node, "boolop", f"{type(node.op).__name__} -> "
                   f"{_BOOL_SWAPS[type(node.op)].__name__}", 0, func)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "not", "drop `not`", 0, func
        elif (isinstance(node, ast.Constant) and type(node.value) in (int, bool)
              and not isinstance(getattr(node, "_parent", None), ast.Subscript)):
            yield node, "constant", f"{node.value!r} -> {_constant(node.value)!r}", 0, func
        elif isinstance(node, ast.Break):
            yield node, "break", "break -> continue", 0, func
        elif isinstance(node, ast.Continue):
            yield node, "continue", "continue -> pass", 0, func
        elif (isinstance(node, (ast.If, ast.While, ast.IfExp))
              and isinstance(node.test, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))):
            # A bare truth test (`if self._early:`) has no operator of its own to flip.
            yield node, "negate", "condition negated", 0, func
        if ((isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
             or isinstance(node, ast.Delete)) and _is_statement(node)):
            # A call for its effect (free, push, append, fire) or a `del`: dropping it
            # is a forgotten step. Assignments are left alone: dropping one is a NameError.
            yield node, "drop", "statement dropped", 1, func


def _constant(value):
    if isinstance(value, bool):
        return not value
    return 1 if value == 0 else (0 if value == 1 else value + 1)


def _is_statement(node) -> bool:
    return getattr(node, "_in_body", False)


def _walk_decisions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """Nodes inside functions, less docstrings, raise statements (their messages)
    and the functions of SKIP_FUNCTIONS."""
    def visit(node, func):
        for field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            if field in ("annotation", "returns"):
                continue  # annotations are strings here (`from __future__ import annotations`)
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                child._parent = node
                if field in ("body", "orelse", "finalbody") and isinstance(child, ast.stmt):
                    child._in_body = True
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if child.name in SKIP_FUNCTIONS:
                        continue
                    yield from visit(child, child.name)
                    continue
                if isinstance(child, (ast.Raise, ast.JoinedStr, ast.Assert)):
                    continue
                if (isinstance(child, (ast.Expr, ast.Assign, ast.AugAssign))
                        and _touches_statistics(child)):
                    continue  # counters for reports
                if isinstance(child, (ast.AnnAssign,)) and func is None:
                    continue  # class fields: defaults are configuration, checked elsewhere
                if func is not None and not isinstance(child, ast.arguments):
                    yield func, child
                if not isinstance(child, ast.arguments):
                    yield from visit(child, func)
    yield from visit(tree, None)


def _touches_statistics(node) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr == "collector")
               or (isinstance(n, ast.Name) and n.id == "collector") for n in ast.walk(node))


def _apply(node: ast.AST, operator: str, variant: int) -> None:
    if operator == "compare":
        node.ops[variant] = _COMPARE_SWAPS[type(node.ops[variant])]()
    elif operator in ("arith", "augassign"):
        node.op = _BINOP_SWAPS[type(node.op)]()
    elif operator == "boolop":
        node.op = _BOOL_SWAPS[type(node.op)]()
    elif operator == "constant":
        node.value = _constant(node.value)
    elif operator == "not":
        parent = node._parent
        for field, value in ast.iter_fields(parent):
            if value is node:
                setattr(parent, field, node.operand)
            elif isinstance(value, list) and node in value:
                value[value.index(node)] = node.operand
    elif operator == "negate":
        node.test = ast.UnaryOp(ast.Not(), node.test)
    elif operator == "break":
        _replace_stmt(node, ast.Continue())
    elif operator in ("continue", "drop"):
        _replace_stmt(node, ast.Pass())


def _fields_of(node: ast.AST) -> dict:
    """A node's fields as they are, lists copied: what `_apply` may change in it."""
    return {field: list(value) if isinstance(value, list) else value
            for field, value in ast.iter_fields(node)}


def _replace_stmt(node, new) -> None:
    parent = node._parent
    for field in ("body", "orelse", "finalbody"):
        body = getattr(parent, field, None)
        if isinstance(body, list) and node in body:
            body[body.index(node)] = ast.copy_location(new, node)
            return


def enumerate_mutants(files: tuple[str, ...] = FILES) -> list[tuple[Mutant, str]]:
    """Every mutant of `files`, with its mutated source, in a stable order."""
    out = []
    for name in files:
        path = CORE / name
        source = path.read_text()
        tree = ast.parse(source)
        points = list(_points(tree))
        seen: dict[str, int] = {}
        for node, operator, description, variant, func in points:
            base = f"{name}:{node.lineno}:{node.col_offset}:{operator}"
            n = seen.get(base, 0)
            seen[base] = n + 1
            mid = base if n == 0 else f"{base}:{n}"
            # One tree serves every mutant: change it, write it out, change it back
            # (a fresh parse and walk per mutant made this quadratic: a minute for
            # scheduler.py).
            touched = [t for t in (node, getattr(node, "_parent", None)) if t is not None]
            saved = [_fields_of(t) for t in touched]
            _apply(node, operator, variant)
            try:
                new_source = ast.unparse(tree)
                compile(new_source, name, "exec")
            except (SyntaxError, ValueError, RecursionError):
                continue
            finally:
                for t, fields in zip(touched, saved):
                    for field, value in fields.items():
                        setattr(t, field, value)
            out.append((Mutant(mid, name, node.lineno, operator,
                               f"{description}: {_line(source, node.lineno)}", func),
                        new_source))
    return out


def changed_lines(since: str, files: tuple[str, ...]) -> dict[str, set[int]]:
    """Per core file, the lines (of the working tree) added or changed since the
    git revision `since`."""
    out: dict[str, set[int]] = {}
    for name in files:
        diff = subprocess.run(["git", "-C", str(ROOT), "diff", "-U0", since, "--",
                               str(CORE / name)], capture_output=True, text=True, check=True)
        lines = out.setdefault(name, set())
        for hunk in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff.stdout, re.M):
            start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
            lines.update(range(start, start + count))
    return out


def _line(source: str, lineno: int) -> str:
    return source.splitlines()[lineno - 1].strip()[:90]


# ---- running -------------------------------------------------------------------------
@attrs.define
class Outcome:
    """What the fast suites did against one mutant."""

    mutant: Mutant
    verdict: str  # killed | survived | equivalent | timeout
    first_failure: str = ""
    seconds: float = 0.0


def _tree_for(workdir: Path, name: str | None, source: str | None) -> Path:
    """A temporary `cadence` package: a copy of the core (one file mutated), links to the rest."""
    pkg = workdir / "cadence"
    shutil.copytree(CORE, pkg / "statemachine", ignore=shutil.ignore_patterns("__pycache__"))
    for sibling in SIBLINGS:
        if (ROOT / sibling).exists():
            (pkg / sibling).symlink_to(ROOT / sibling)
    if name is not None:
        (pkg / "statemachine" / name).write_text(source)
    return workdir


def run_suites(name: str | None, source: str | None, suites: tuple[str, ...],
               timeout_s: float) -> tuple[int | None, str, float]:
    """Run `suites` against the core with `name` replaced by `source` (None: unchanged).
    Returns (exit status or None on timeout, first failing test, seconds)."""
    with tempfile.TemporaryDirectory(prefix="cadence-mutant-") as tmp:
        tree = _tree_for(Path(tmp), name, source)
        # CADENCE_TEST_TREE: the suite's guard would otherwise map cadence back onto
        # the checkout, and every mutant would pass unseen.
        env = dict(os.environ, CI="true", PYTHONPATH=str(tree), CADENCE_TEST_TREE=str(tree),
                   PYTHONDONTWRITEBYTECODE="1")
        env.pop("CADENCE_EXPLORE", None)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "--no-header", "-rf", *suites]
        started = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, "(time limit)", time.perf_counter() - started
        seconds = time.perf_counter() - started
        failed = re.search(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
        return done.returncode, failed.group(1) if failed else done.stdout[-300:], seconds


def run_mutant(mutant: Mutant, source: str, suites, timeout_s) -> Outcome:
    """Run the suites against one mutant and classify it."""
    if mutant.id in EQUIVALENT:
        return Outcome(mutant, "equivalent", EQUIVALENT[mutant.id])
    code, failure, seconds = run_suites(mutant.path, source, suites, timeout_s)
    if code is None:
        return Outcome(mutant, "timeout", failure, seconds)
    return Outcome(mutant, "survived" if code == 0 else "killed", "" if code == 0 else failure,
                   seconds)


def main(argv: list[str] | None = None) -> int:
    """Entry point: enumerate, sample, run, print; exit 1 if any mutant survived."""
    parser = argparse.ArgumentParser(prog="python -m cadence.spec.mutation",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    parser.add_argument("--max-mutants", type=int, default=None,
                        help="run a seeded sample of this many mutants (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--file", action="append", help="core file(s) to mutate (default: FILES)")
    parser.add_argument("--only", nargs="+", default=None, help="mutant ids to run")
    parser.add_argument("--since", default=None,
                        help="only mutants on lines changed since this git revision")
    parser.add_argument("--function", action="append",
                        help="only mutants inside functions of this name (repeatable)")
    parser.add_argument("--suite", action="append", help="test paths (default: FAST_SUITES)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--out", type=Path, default=None,
                        help="append one JSON line per mutant to this file")
    parser.add_argument("--timeout-factor", type=float, default=3.0,
                        help="a mutant's run may take this many times the unmutated run")
    parser.add_argument("--limit-s", type=float, default=None,
                        help="per-mutant time limit in seconds; skips the unmutated run "
                             "that otherwise sets it (use after a clean run of the suites)")
    args = parser.parse_args(argv)
    suites = tuple(args.suite or [s for s in FAST_SUITES if (ROOT / s.split("::")[0]).exists()])
    files = tuple(args.file or FILES)
    mutants = enumerate_mutants(files)
    if args.since is not None:
        changed = changed_lines(args.since, files)
        mutants = [m for m in mutants if m[0].line in changed.get(m[0].path, ())]
    if args.function:
        mutants = [m for m in mutants if m[0].function in set(args.function)]
    if args.only:
        wanted = set(args.only)
        mutants = [m for m in mutants if m[0].id in wanted]
    elif args.max_mutants is not None and args.max_mutants < len(mutants):
        mutants = sorted(random.Random(args.seed).sample(mutants, args.max_mutants),
                         key=lambda m: (m[0].path, m[0].line))
    if args.list:
        for m, _ in mutants:
            print(m)
        print(f"{len(mutants)} mutants")
        return 0
    started = time.perf_counter()
    if args.limit_s is None:
        code, failure, baseline = run_suites(None, None, suites, 3600)
        if code != 0:
            print(f"the unmutated core fails the suites ({failure}); nothing to measure")
            return 2
        timeout_s = max(60.0, args.timeout_factor * baseline)
    else:
        timeout_s = baseline = args.limit_s
        print("note: with --limit-s, a timeout is a kill only if the limit is well above "
              "the unmutated suites' time on this machine", flush=True)
    print(f"{len(mutants)} mutants, suites {' '.join(suites)}; unmutated run {baseline:.0f}s, "
          f"limit {timeout_s:.0f}s per mutant, {args.jobs} at once", flush=True)
    outcomes: list[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_mutant, m, src, suites, timeout_s) for m, src in mutants]
        for future in concurrent.futures.as_completed(futures):
            o = future.result()
            outcomes.append(o)
            detail = f"  <- {o.first_failure}" if o.first_failure else ""
            print(f"{o.verdict:10s} {o.mutant}{detail}", flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps({"id": o.mutant.id, "verdict": o.verdict,
                                        "first_failure": o.first_failure,
                                        "description": o.mutant.description,
                                        "seconds": round(o.seconds, 1)}) + "\n")
    return report(outcomes, time.perf_counter() - started)


def report(outcomes: list[Outcome], seconds: float) -> int:
    """Print the score; 1 if any non-equivalent mutant survived."""
    count = {v: sum(o.verdict == v for o in outcomes)
             for v in ("killed", "timeout", "survived", "equivalent")}
    killed = count["killed"] + count["timeout"]
    scored = killed + count["survived"]
    score = 100.0 * killed / scored if scored else 100.0
    print(f"\n{len(outcomes)} mutants: {count['killed']} killed, {count['timeout']} killed by "
          f"the time limit, {count['survived']} survived, {count['equivalent']} equivalent; "
          f"score {score:.1f}% of non-equivalent mutants killed; {seconds:.0f}s")
    for o in sorted(outcomes, key=lambda o: o.mutant.id):
        if o.verdict == "survived":
            print(f"  survived: {o.mutant}")
    return 1 if count["survived"] else 0


if __name__ == "__main__":
    sys.exit(main())
