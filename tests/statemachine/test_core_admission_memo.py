"""The admission memo (a pass that admitted nothing for want of blocks is not run
again while it would fail the same way) changes no decision where the waiting
order is static and no running request can be displaced."""

from __future__ import annotations

import random

import pytest

from cadence.statemachine.scheduler import Scheduler

from core_helpers import drive, make_request, make_scheduler


class Unmemoized(Scheduler):
    """Runs every admission pass."""

    def _failed_pass_stands(self) -> bool:
        return False


def unmemoized(scheduler: Scheduler) -> Scheduler:
    scheduler.__class__ = Unmemoized
    return scheduler


def workload(seed: int, shared_prefix: bool, eos: bool, n: int = 48):
    """Memory-short arrivals over 30 steps; with `shared_prefix`, prompts open with
    one of three 8-token prefixes (so blocks get registered in the prefix cache
    while others wait); with `eos`, generous limits and EOS at the real length."""
    rng = random.Random(seed)
    prefixes = [[500 + 16 * g + i for i in range(8)] for g in range(3)]
    arrivals: dict[int, list] = {}
    eos_after: dict[str, int] = {}
    for i in range(n):
        rid = f"r{i}"
        out_len = rng.randint(2, 20)
        own = [10_000 + 64 * i + k for k in range(rng.randint(2, 10))]
        prompt = (rng.choice(prefixes) + own) if shared_prefix else own + [7] * 8
        arrivals.setdefault(rng.randint(0, 30), []).append(
            make_request(rid, prompt, max_tokens=out_len if not eos else 30, ignore_eos=not eos))
        eos_after[rid] = out_len
    return arrivals, eos_after


# Memory short of the arrivals, with the growth projection on: its reserve shrinks
# as running requests near their ends, with no release.
SHORT = dict(num_blocks=32, block_size=4, max_num_seqs=8, max_model_len=48,
             admission_headroom_steps=16, admission_growth_share=0.95, admission_watermark=0.02)

# Enough steps for every request to finish.
STEPS = 300


@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline", "fair"])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_the_memo_changes_no_decision(policy, caching, eos, seed):
    """Every plan is the same with and without the memo (priority: all equal;
    fair: one tenant), and the memo stood in some steps. (A memo that stood until
    a release, whatever the reserve, made 20 of these 48 runs plan differently:
    the projected reserve shrinks as running requests near their ends.)"""
    memo = make_scheduler(policy, enable_prefix_caching=caching, **SHORT)
    plain = unmemoized(make_scheduler(policy, enable_prefix_caching=caching, **SHORT))
    plans = drive(memo, *workload(seed, caching, eos), STEPS)
    assert plans == drive(plain, *workload(seed, caching, eos), STEPS)
    assert not memo.has_work(), "the trace did not finish"
    assert memo.collector.num_admission_memo_hits > 0
    assert plain.collector.num_admission_memo_hits == 0
