"""The distribution: a wheel built from the tree ships all four packages, and the
installed packages import."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cadence.statemachine", "cadence.actors", "cadence.actors.serve", "cadence.gpu", "cadence.spec")
EXPECTED_FILES = (
    "cadence/statemachine/scheduler.py",
    "cadence/actors/__init__.py",
    "cadence/gpu/__init__.py",
    "cadence/spec/__init__.py",
)
# Build outputs and caches that must not travel into the copy the wheel is built from.
IGNORED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                                 ".pytest_cache", ".whl", "out", "tests", "benchmarks", ".venv")


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    """File names inside a wheel built, without network, from a copy of the tree
    (a copy, so concurrent builds never share a build/ directory)."""
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
    (wheel,) = out.glob("cadence-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_wheel_ships_all_four_packages(wheel_files):
    """Each package's key module is in the wheel."""
    for name in EXPECTED_FILES:
        assert name in wheel_files, f"{name} missing from the wheel"


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
