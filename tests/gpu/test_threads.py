"""The runner's CPU thread policy: sized from the model and the usable cores, set in the runner's own thread."""

from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest
import torch

from cadence.actors.executor_worker import build_runner
from cadence.actors.messages import InitExecutor
from cadence.gpu import ModelRunner, openmp_env, preset
from cadence.gpu.threads import (
    SMALL_MODEL_MACS,
    auto_num_threads,
    macs_per_token,
    resolve_num_threads,
)
from cadence.statemachine.errors import ConfigError

CPU = torch.device("cpu")


def in_fresh_thread(fn):
    """Run `fn` on a new thread (one that has run no torch kernel yet) and return its result."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def test_small_models_get_one_thread_whatever_the_cores():
    tiny = preset("tiny")
    assert macs_per_token(tiny) < SMALL_MODEL_MACS
    assert [auto_num_threads(tiny, cores) for cores in (1, 2, 16, 64)] == [1, 1, 1, 1]


def test_larger_models_get_half_the_usable_cores():
    big = preset("qwen3-0.6b")
    assert macs_per_token(big) >= SMALL_MODEL_MACS
    assert [auto_num_threads(big, cores) for cores in (1, 2, 3, 16)] == [1, 1, 1, 8]


@pytest.mark.parametrize("value", [0, -1, "many", 1.5, True])
def test_bad_thread_counts_name_the_option(value):
    with pytest.raises(ConfigError, match=r"num_threads must be 'auto' or an integer >= 1, got"):
        resolve_num_threads(value, preset("tiny"), CPU)


def test_explicit_none_and_accelerator_values():
    assert resolve_num_threads(3, preset("tiny"), CPU) == 3
    assert resolve_num_threads(None, preset("tiny"), CPU) is None
    assert resolve_num_threads("auto", preset("tiny"), CPU) == 1
    assert resolve_num_threads("auto", preset("tiny"), torch.device("cuda")) is None


def test_the_runner_sets_the_count_in_the_thread_that_builds_it():
    main_before = torch.get_num_threads()
    wanted = 2 if main_before == 1 else 1

    def build():
        runner = ModelRunner(preset("tiny"), num_blocks=4, device="cpu", num_threads=wanted)
        return runner.num_threads, torch.get_num_threads()

    try:
        assert in_fresh_thread(build) == (wanted, wanted)
        assert torch.get_num_threads() == main_before  # a thread that already ran kernels keeps its own
    finally:
        in_fresh_thread(lambda: torch.set_num_threads(main_before))


def test_the_executor_option_reaches_the_runner():
    def build(value):
        init = InitExecutor(model="tiny", dtype="", device="cpu", num_blocks=4, block_size=4, max_model_len=64,
                            max_num_batched_tokens=64, seed=0, options={"num_threads": value})
        return build_runner(init).num_threads

    before = torch.get_num_threads()
    try:
        assert in_fresh_thread(lambda: build(2)) == 2
        assert in_fresh_thread(lambda: build("auto")) == 1
        with pytest.raises(ConfigError, match="num_threads"):
            in_fresh_thread(lambda: build("lots"))
    finally:
        in_fresh_thread(lambda: torch.set_num_threads(before))


def _affinities():
    import os
    from cadence.gpu.threads import _thread_ids, pin_compute_threads

    before = _thread_ids()
    torch.set_num_threads(2)
    cores = pin_compute_threads(2)
    own = os.sched_getaffinity(0)
    team = {tid: os.sched_getaffinity(tid) for tid in _thread_ids() - before}
    return cores, own, team


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="needs Linux thread affinity")
def test_compute_threads_are_pinned_one_per_core():
    import os

    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip(f"pinning two threads needs two usable cores, this process has {len(usable)}")
    cores, own, team = in_fresh_thread(_affinities)
    assert sorted(cores) == usable[-2:]
    assert own == {cores[0]}  # the thread that runs the model
    assert {core for affinity in team.values() for core in affinity} >= {cores[1]}
    assert all(len(affinity) == 1 for affinity in team.values())
    assert os.sched_getaffinity(0) == set(usable)  # other threads keep the process's cores


def test_more_threads_than_cores_pin_nothing():
    import os
    from cadence.gpu.threads import pin_compute_threads

    assert pin_compute_threads(None) is None
    assert in_fresh_thread(lambda: pin_compute_threads(len(os.sched_getaffinity(0)) + 1)) is None


def test_a_single_compute_thread_is_left_unpinned():
    import os

    from cadence.gpu.threads import pin_compute_threads

    def pin_one():
        before = os.sched_getaffinity(0)
        return pin_compute_threads(1), os.sched_getaffinity(0) == before

    assert in_fresh_thread(pin_one) == (None, True)


def test_teams_of_one_process_take_the_least_pinned_cores(monkeypatch):
    """Two teams of two on four cores take two cores each; the pins are recorded
    rather than made, so the test runs on any machine."""
    import os
    from collections import Counter

    from cadence.gpu import threads

    pins: list[tuple[bool, set[int]]] = []  # (the calling thread?, its cores), in order
    monkeypatch.setattr(threads, "_pins", Counter())
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pins.append((pid == 0, set(cores))))

    def pin_team():
        torch.set_num_threads(2)
        return threads.pin_compute_threads(2)

    first, second = in_fresh_thread(pin_team), in_fresh_thread(pin_team)
    assert first == (3, 2) and second == (1, 0)
    assert pins == [(True, {3}), (False, {2}), (True, {1}), (False, {0})]


def test_a_runner_built_directly_leaves_its_thread_unpinned():
    import os

    def build():
        before = os.sched_getaffinity(0)
        runner = ModelRunner(preset("tiny"), num_blocks=4, device="cpu", num_threads=1)
        return runner.pinned_cores, os.sched_getaffinity(0) == before

    assert in_fresh_thread(build) == (None, True)


def test_the_engines_runner_pins_its_model_thread_unless_told_not_to():
    import os

    def build(**options):
        init = InitExecutor(model="tiny", dtype="", device="cpu", num_blocks=4, block_size=4, max_model_len=64,
                            max_num_batched_tokens=64, seed=0, options={"num_threads": 2, **options})
        runner = build_runner(init)
        return runner.pinned_cores, os.sched_getaffinity(0)

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("pinning a team of two needs two usable cores")
    cores, affinity = in_fresh_thread(build)
    assert cores is not None and affinity == {cores[0]}
    assert in_fresh_thread(lambda: build(pin_threads=False))[0] is None


def _fresh_process_says(code: str, **environ: str) -> str:
    """What a fresh interpreter running `code` prints, with none of the user's OpenMP
    settings in its environment but those in `environ`."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in openmp_env.USER_SETTINGS}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, **environ})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _spin_count_after(imports: str, **environ: str) -> str:
    return _fresh_process_says(f"import os; {imports}; print(os.environ.get('GOMP_SPINCOUNT'))", **environ)


def _spin_choice_after(imports: str) -> tuple[str, float | None]:
    """The spin count a fresh process set on `imports`, and the busy cores it saw then."""
    said = _fresh_process_says(f"import os; {imports}; from cadence.gpu import openmp_env; "
                               "print(os.environ.get('GOMP_SPINCOUNT'), openmp_env._neighbour_cores)")
    count, cores = said.split()
    return count, None if cores == "None" else float(cores)


@pytest.mark.parametrize("imports", ["import cadence.actors", "import cadence.gpu.runner",
                                     "from cadence.actors import cli"])
def test_importing_cadence_sets_the_openmp_spin_count_before_torch_loads(imports):
    """The engine, the runner and the CLI each set GNU OpenMP's spin count where torch
    is not loaded yet (the runtime reads it once, when torch loads it): the long one, or
    the short one where other processes were busy on this machine's cores."""
    count, cores = _spin_choice_after(imports)
    assert count == str(openmp_env.spin_count_for(cores))


@pytest.mark.skipif(not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"),
                    reason="watches Linux's /proc/stat")
def test_busy_neighbours_when_cadence_loads_get_the_short_spin():
    import subprocess
    import time

    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(len(os.sched_getaffinity(0)))]
    try:
        time.sleep(0.5)  # every loop running
        count, cores = _spin_choice_after("import cadence.gpu")
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert cores is not None and cores >= openmp_env.NEIGHBOUR_CORES
    assert count == str(openmp_env.CONTENDED_SPIN_COUNT)


def test_busy_cores_counts_other_processes_on_this_process_cpus_only():
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    outside = max(cpus) + 1000
    before = {cpus[0]: (100, 1000), outside: (0, 1000)}
    after = {cpus[0]: (190, 1100), outside: (100, 1100)}  # 90% busy; the CPU outside the set 100%
    readings = iter([before, after])
    cores = openmp_env.busy_cores(0.1, read=lambda: next(readings), sleep=lambda s: None)
    assert cores == pytest.approx(0.9, abs=0.05)  # less this process's own (nearly no) CPU time
    assert openmp_env.busy_cores(0.1, read=lambda: {}, sleep=lambda s: None) is None

    def unreadable():
        raise OSError("no /proc")

    assert openmp_env.busy_cores(0.1, read=unreadable, sleep=lambda s: None) is None


def test_the_spin_count_is_short_from_half_a_busy_core():
    assert openmp_env.spin_count_for(None) == openmp_env.spin_count_for(0.0) == openmp_env.SPIN_COUNT
    assert openmp_env.spin_count_for(openmp_env.NEIGHBOUR_CORES - 0.01) == openmp_env.SPIN_COUNT
    assert openmp_env.spin_count_for(openmp_env.NEIGHBOUR_CORES) == openmp_env.CONTENDED_SPIN_COUNT
    assert openmp_env.SPIN_COUNT > openmp_env.CONTENDED_SPIN_COUNT


def test_the_users_openmp_settings_and_an_already_loaded_torch_are_left_alone():
    assert _spin_count_after("import cadence.actors", GOMP_SPINCOUNT="7") == "7"
    assert _spin_count_after("import cadence.actors", OMP_WAIT_POLICY="PASSIVE") == "None"
    # torch first: its runtime has read the environment already, so nothing is set.
    assert _spin_count_after("import torch; import cadence.actors") == "None"


def test_the_runner_log_says_which_openmp_spin_runs_and_how_to_change_it(caplog):
    """Where torch came first the spin is the runtime's default, and the log says how to
    get the shorter one; otherwise it names the setting in force."""
    report = "from cadence.gpu import openmp_env; print(openmp_env.describe())"
    assert "torch was imported before cadence" in _fresh_process_says(f"import torch; import cadence.gpu; {report}")
    said = _fresh_process_says(f"import cadence.gpu; import torch; {report}")
    assert "GOMP_SPINCOUNT=" in said and "cores busy when cadence loaded" in said
    assert "OMP_WAIT_POLICY=PASSIVE" in _fresh_process_says(f"import cadence.gpu; {report}", OMP_WAIT_POLICY="PASSIVE")
    with caplog.at_level("INFO", logger="cadence.gpu"):
        ModelRunner(preset("tiny"), num_blocks=8, device="cpu")
    assert any("CPU path:" in r.message and "OpenMP spin:" in r.message for r in caplog.records)
