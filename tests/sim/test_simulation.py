"""Deterministic simulation of the whole engine under faults (see sim_harness).

CI runs a fixed set of seeds (CADENCE_SIM_SEEDS=N runs N of them) plus a
Hypothesis search over arrival and fault schedules (CADENCE_EXPLORE=1 runs
many more examples with fresh randomness).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.actors.simulated import Fault, FaultPlan
from sim_harness import (
    EOS, NOT_SEEDABLE_REASON, POLICIES, SCHEDULER_SEEDABLE, ClientPlan, Scenario, check_report,
    random_scenario, run_scenario, simulate, trace_fingerprint,
)

replayable = pytest.mark.skipif(not SCHEDULER_SEEDABLE, reason=NOT_SEEDABLE_REASON)

NUM_SEEDS = int(os.environ.get("CADENCE_SIM_SEEDS", "300"))
EXPLORE = os.environ.get("CADENCE_EXPLORE") == "1"
NUM_EXAMPLES = 2000 if EXPLORE else 100


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_seeded_simulation_keeps_every_property(seed):
    check_report(run_scenario(random_scenario(seed)))


# The newest Trio the replay was checked on; the replay tests may skip only past it.
NEWEST_CHECKED_TRIO = (0, 35)


def test_every_checked_trio_can_replay_a_seed():
    version = tuple(int(part) for part in trio.__version__.split(".")[:2])
    if version <= NEWEST_CHECKED_TRIO:
        assert SCHEDULER_SEEDABLE, NOT_SEEDABLE_REASON


@replayable
@pytest.mark.parametrize("seed", [2, 30, 46])
def test_one_seed_gives_one_trace(seed):
    scenario = random_scenario(seed)
    first, second = run_scenario(scenario), run_scenario(scenario)
    assert {fault for _, fault in first.executor.injected} == set(Fault), "every kind of fault"
    assert trace_fingerprint(first) == trace_fingerprint(second)
    assert first.executor.injected == second.executor.injected


@replayable
def test_one_seed_gives_one_trace_across_processes():
    """String hashing is randomised per process; nothing in the trace may depend on it."""
    code = ("import hashlib, sim_harness as h; r = h.run_scenario(h.random_scenario(6)); "
            "print(hashlib.sha256(repr(h.trace_fingerprint(r)).encode()).hexdigest())")
    digests = {
        subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, check=True,
                       capture_output=True, text=True,
                       env={**os.environ, "PYTHONHASHSEED": str(hash_seed)}).stdout
        for hash_seed in (1, 2)
    }
    assert len(digests) == 1
    here = trace_fingerprint(run_scenario(random_scenario(6)))
    assert digests == {hashlib.sha256(repr(here).encode()).hexdigest() + "\n"}


def test_different_seeds_give_different_traces():
    traces = {tuple(trace_fingerprint(run_scenario(random_scenario(seed)))) for seed in range(4)}
    assert len(traces) == 4


# ---- Hypothesis over arrival and fault schedules ------------------------------------
_WALKS = st.one_of(
    st.none(),
    st.tuples(st.just("break"), st.integers(1, 5)),
    st.tuples(st.just("cancel"), st.integers(0, 40_000)),
    st.tuples(st.just("timeout"), st.integers(1, 60_000)),
)
_NUM_FAULTY_CALLS = 40


def _draw_scenario(data) -> Scenario:
    seed = data.draw(st.integers(0, 2**16), label="seed")
    block_size = data.draw(st.sampled_from((2, 4, 8)), label="block_size")
    max_model_len = 64
    num_blocks = data.draw(st.integers(max_model_len // block_size + 1, 3 * max_model_len // block_size),
                           label="num_blocks")
    prefix = tuple(range(1, 17))
    clients = []
    for i in range(data.draw(st.integers(1, 10), label="num_clients")):
        arrival_us = data.draw(st.integers(0, 30_000), label="arrival_us")
        shared = data.draw(st.booleans(), label="shared_prefix")
        suffix = tuple((7 * i + k) % EOS for k in range(data.draw(st.integers(1, 24))))
        walk = data.draw(_WALKS, label="walk_away")
        max_tokens = data.draw(st.integers(1, 16), label="max_tokens")
        clients.append(ClientPlan(
            request_id=f"h{i}", arrival_s=arrival_us / 1e6,
            prompt=(prefix if shared else ()) + suffix, max_tokens=max_tokens,
            priority=data.draw(st.integers(0, 2), label="priority"),
            tenant=data.draw(st.sampled_from("ab"), label="tenant"),
            break_after=walk[1] if walk and walk[0] == "break" else None,
            cancel_after_s=walk[1] / 1e6 if walk and walk[0] == "cancel" else None,
            timeout_s=walk[1] / 1e6 if walk and walk[0] == "timeout" else None))
    ids = [c.request_id for c in clients]
    bursts = data.draw(st.lists(st.tuples(st.integers(0, 40_000), st.sets(st.sampled_from(ids), min_size=1)),
                                max_size=2), label="abort_bursts")
    faults = data.draw(st.dictionaries(st.integers(0, _NUM_FAULTY_CALLS - 1), st.sampled_from(list(Fault)),
                                       max_size=5), label="faults")
    return Scenario(
        seed=seed, clients=tuple(clients),
        abort_bursts=tuple((at / 1e6, tuple(sorted(s))) for at, s in bursts),
        faults=FaultPlan(at=faults, slow_factor=data.draw(st.sampled_from((2.0, 1000.0)), label="slow")),
        num_fault_calls=_NUM_FAULTY_CALLS, policy=data.draw(st.sampled_from(POLICIES), label="policy"),
        num_blocks=num_blocks, block_size=block_size,
        max_num_seqs=data.draw(st.sampled_from((1, 2, 4)), label="max_num_seqs"),
        max_num_batched_tokens=data.draw(st.sampled_from((4, 16, 64)), label="budget"),
        max_model_len=max_model_len, eos_probability=data.draw(st.sampled_from((0.0, 0.1))),
        enable_prefix_caching=data.draw(st.booleans(), label="prefix_caching"))


@settings(max_examples=NUM_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
async def test_simulation_over_drawn_schedules(data, autojump_clock):
    check_report(await simulate(_draw_scenario(data)))
