"""The distribution: a wheel built from the tree ships all four packages, and the
installed packages import."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cadence.actors.bench import load_workload

# Builds and installs a wheel: several pip runs of up to 300 s each.
pytestmark = pytest.mark.timeout(1200)

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cadence.statemachine", "cadence.actors", "cadence.actors.serve", "cadence.gpu", "cadence.spec")
EXPECTED_FILES = (
    "cadence/statemachine/scheduler.py",
    "cadence/actors/__init__.py",
    "cadence/actors/workloads.py",
    "cadence/actors/asyncio_engine.py",
    "cadence/gpu/__init__.py",
    "cadence/gpu/demo_model/model.safetensors",
    "cadence/gpu/cpu_kernels.cpp",
    "cadence/spec/__init__.py",
) + tuple(f"cadence/{package}/py.typed" for package in ("statemachine", "actors", "gpu", "spec"))
# Build outputs and caches that must not travel into the copy the wheel is built from.
IGNORED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                                 ".pytest_cache", ".whl", "out", "tests", "benchmarks", ".venv")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built, without network, from a copy of the tree (a copy, so concurrent
    builds never share a build/ directory)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(REPO_ROOT, source, ignore=IGNORED)
    out = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("cadence-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_files(wheel) -> list[str]:
    """File names inside the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


# Runs from the installed wheel alone: the repository (and its benchmarks/) is not reachable.
_BENCH_FROM_WHEEL = """
import json, sys
import cadence.actors, cadence.actors.cli as cli
assert cadence.actors.__file__.startswith(sys.argv[1]), cadence.actors.__file__
common = ["bench", "--embedded", "--model", "simulated", "--sim-step-us", "0", "--no-progress",
          "--json", "-"]
assert cli.main(common + ["--workload", "nano-vllm", "--num-requests", "2"]) == 0
assert cli.main(common + ["--workload", sys.argv[2]]) == 0
"""


def test_bench_runs_from_the_installed_wheel(wheel, tmp_path):
    """`cadence bench` finds its workloads (a preset and a JSON-lines trace) inside the package."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, timeout=300)
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"id": 0, "arrival_step": 0, "prompt_len": 5, "output_len": 3}\n'
                     '{"id": 1, "arrival_step": 1, "prompt_len": 7, "output_len": 2}\n')
    proc = subprocess.run([sys.executable, "-c", _BENCH_FROM_WHEEL, str(target), str(trace)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(target)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["num_completed"], r["num_output_tokens"]) for r in results] == [
        (2, sum(load_workload("nano-vllm", 2)[i].max_tokens for i in range(2))), (2, 5)]


def test_wheel_ships_all_four_packages(wheel_files):
    """Each package's key module is in the wheel."""
    for name in EXPECTED_FILES:
        assert name in wheel_files, f"{name} missing from the wheel"


def test_the_plot_extra_installs_matplotlib():
    """`cadence bench --plot` names the `plot` extra; it must bring matplotlib."""
    import tomllib
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("matplotlib") for dep in extras["plot"])


def test_wheel_ships_no_tests_or_bytecode(wheel_files):
    """Only the package sources (and metadata) are shipped."""
    assert not [n for n in wheel_files if n.startswith("tests/") or n.endswith(".pyc")]
    assert all(n.startswith(("cadence/", "cadence-")) for n in wheel_files)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_from_the_installed_tree(package):
    """The editable install resolves each package to this repository's folder."""
    module = importlib.import_module(package)
    folder = Path(*package.split(".")[1:])
    assert Path(module.__file__).resolve().parent == REPO_ROOT / folder


def test_the_suite_notices_an_install_from_another_checkout(tmp_path):
    """The suite's guard: this checkout's install passes; seen from anywhere
    else, the message names where cadence comes from and how to fix it."""
    spec = importlib.util.spec_from_file_location("suite_conftest", REPO_ROOT / "tests" / "conftest.py")
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    assert guard.checkout_problem(REPO_ROOT) is None
    problem = guard.checkout_problem(tmp_path)
    assert str(REPO_ROOT / "statemachine") in problem and str(tmp_path) in problem
    assert 'pip install -e ".[gpu,test]"' in problem
    # A tree named on purpose (the mutation runner's) is tested where it is.
    assert guard.checkout_problem(tmp_path, {"CADENCE_TEST_TREE": str(REPO_ROOT / "statemachine")}) is None
    assert guard.checkout_problem(tmp_path, {"CADENCE_TEST_TREE": str(tmp_path / "other")}) is not None


def test_the_suite_can_map_cadence_onto_this_checkout():
    """Where the installed cadence is another copy (or gone), the suite maps
    cadence.* onto this checkout, for itself and the processes it starts."""
    code = f"""
import importlib.util, subprocess, sys
spec = importlib.util.spec_from_file_location("suite_conftest", {str(REPO_ROOT / "tests" / "conftest.py")!r})
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)
shim = guard.use_this_checkout()
import cadence, cadence.statemachine
assert cadence.__file__.startswith(str(shim)), cadence.__file__
assert guard.checkout_problem() is None
child = "import cadence, cadence.actors; print(cadence.__file__, cadence.actors.__file__)"
out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
assert out.startswith(str(shim)) and {str(REPO_ROOT / "actors")!r} in out, out
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
