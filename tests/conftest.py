"""Hypothesis profiles for the whole suite.

- ``ci``: derandomised, no deadline, no example database; chosen when ``CI`` is set,
  so CI replays the same examples every run.
- ``explore``: 2000 examples per property with fresh random seeds; chosen with
  ``CADENCE_EXPLORE=1`` (it wins over ``CI``), for hunting bugs locally.
- ``dev``: Hypothesis defaults without a deadline, for everyday local runs.

The suite tests this checkout: where the installed ``cadence`` is another copy (or
a stale editable install whose folder is gone), ``cadence.*`` is mapped onto this
checkout for the run and the processes it starts. A tool that means the suite to
test another tree on purpose (the mutation runner's copy of the core with one
mutant in it) names it in ``CADENCE_TEST_TREE``, and that tree is left in place.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent

settings.register_profile("ci", derandomize=True, deadline=None, database=None)
settings.register_profile("explore", max_examples=2000, deadline=None)
settings.register_profile("dev", deadline=None)


def hypothesis_profile(environ=os.environ) -> str:
    """The profile the environment asks for."""
    if environ.get("CADENCE_EXPLORE") == "1":
        return "explore"
    if environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return "ci"
    return "dev"


settings.load_profile(hypothesis_profile())


def checkout_problem(root: Path = ROOT, environ=os.environ) -> str | None:
    """Why the suite cannot test the checkout at `root`, or None. The tests, and
    the child processes some of them start, import the installed `cadence`: it
    must be this checkout's editable install (or the tree `CADENCE_TEST_TREE`
    names), or every test module fails to import (or, worse, tests another copy
    of the code)."""
    try:
        spec = importlib.util.find_spec("cadence.statemachine")
    except ImportError:
        spec = None
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    chosen = [root]
    if environ.get("CADENCE_TEST_TREE"):
        chosen.append(Path(environ["CADENCE_TEST_TREE"]).resolve())
    if origin is not None and any(origin.is_relative_to(tree) for tree in chosen):
        return None
    where = f"from {origin.parent}" if origin is not None else "not importable (installed from a copy that is gone, or not at all)"
    return (f"cadence is {where}, not from this checkout ({root}); install it here first: "
            f'pip install -e ".[gpu,test]"')


def use_this_checkout(root: Path = ROOT) -> Path:
    """Make `cadence` this checkout for the test run and the processes it starts,
    whatever is installed: a package directory whose `cadence` maps onto the
    checkout's top-level folders (as the install does), first on `sys.path` and
    `PYTHONPATH`. Returns that directory."""
    shim = Path(tempfile.mkdtemp(prefix="cadence-checkout-"))
    atexit.register(shutil.rmtree, shim, True)
    (shim / "cadence").mkdir()
    (shim / "cadence" / "__init__.py").write_text(
        f"# This checkout's packages as cadence.*, for its tests.\n__path__ = [{str(root)!r}]\n")
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    for name in [m for m in sys.modules if m == "cadence" or m.startswith("cadence.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    return shim


# Before any test module imports cadence: test this checkout, not another copy.
if checkout_problem() is not None:
    _STALE_INSTALL = checkout_problem()
    use_this_checkout()
    if checkout_problem() is not None:
        raise pytest.UsageError(_STALE_INSTALL)


def pytest_sessionstart(session) -> None:
    """Build the CPU kernels once, before any test times anything: the first CPU model
    runner of a fresh machine would otherwise compile them inside some test's timeout."""
    if importlib.util.find_spec("torch") is None or os.environ.get("CADENCE_PREBUILD_CPU_KERNELS") == "0":
        return
    from cadence.gpu import cpu_kernels

    cpu_kernels.load()
