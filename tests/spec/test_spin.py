"""SPIN checks the admission-with-aging model and rejects the broken one.

Skipped, saying why, where `spin` or a C compiler is not installed
(`apt-get install -y spin gcc`).
"""

import re
import shutil
import subprocess
from importlib import resources

import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None,
    reason="SPIN model checking needs `spin` and `gcc` on PATH (apt-get install -y spin gcc)")


def run_spin(model: str, workdir) -> str:
    source = resources.files("cadence.spec").joinpath(model).read_text()
    (workdir / model).write_text(source)
    for cmd in (["spin", "-a", model], ["gcc", "-O2", "-o", "pan", "pan.c"], ["./pan", "-a", "-f"]):
        done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def errors_in(output: str) -> int:
    found = re.search(r"errors: (\d+)", output)
    assert found, output
    return int(found.group(1))


def test_admission_with_aging_serves_every_request(tmp_path):
    out = run_spin("admission.pml", tmp_path)
    assert errors_in(out) == 0, out
    assert "acceptance cycle" not in out


def test_admission_without_aging_is_rejected(tmp_path):
    out = run_spin("admission_broken.pml", tmp_path)
    assert errors_in(out) >= 1, out
    assert "acceptance cycle" in out
