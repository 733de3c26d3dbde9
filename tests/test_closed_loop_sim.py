"""Clients in a closed loop against the scheduling core (benchmarks/closed_loop_sim.py,
a modelled clock): a CPU server's defaults give early first tokens wherever lengths
vary or prompts are long; the pacing rules keep the gaps between tokens even, and
their finish hold keeps 32 clients from settling into groups whose prefills stall
each other every round; the simulation's own counts hold together."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from closed_loop_sim import simulate  # noqa: E402

# The cost model fit to the real server (float32 125M model, 2 threads).
LOOP = dict(requests=200, prompt=128, output=128, lag_s=0.005, step_s=0.009, token_s=0.0005, seed=1)


def test_without_the_hold_32_paced_clients_stall_each_other_every_round():
    held = simulate(32, jitter=0.0, paced=True, **LOOP)
    plain = simulate(32, jitter=0.0, paced=True, admission_finish_hold_steps=0, **LOOP)
    # A decode step of 32 is 9 + 32 * 0.5 = 25 ms: with the hold, that is the p99 gap.
    assert held["itl_p99_ms"] == pytest.approx(25.0)
    assert held["finish_holds"] > 0 and plain["finish_holds"] == 0
    # Without it, prefills of hundreds of ms are more than 1% of the gaps.
    assert plain["itl_p99_ms"] > 10 * held["itl_p99_ms"]
    # The hold costs no throughput and no TTFT worth the name.
    assert held["requests_per_s"] >= 0.99 * plain["requests_per_s"]
    assert held["ttft_p50_ms"] <= 1.05 * plain["ttft_p50_ms"]


@pytest.mark.parametrize("clients", [1, 8, 32])
@pytest.mark.parametrize("jitter", [0.0, 0.5])
def test_every_request_is_served_and_the_hold_never_slows_the_loop(clients, jitter):
    held = simulate(clients, jitter=jitter, paced=True, **LOOP)
    plain = simulate(clients, jitter=jitter, paced=True, admission_finish_hold_steps=0, **LOOP)
    default = simulate(clients, jitter=jitter, **LOOP)
    for run in (held, plain, default):
        # A request's tokens take at least one step each, TTFT at least its prefill step.
        assert run["itl_p50_ms"] >= 1e3 * LOOP["step_s"]
        assert run["ttft_p50_ms"] >= 1e3 * (LOOP["step_s"] + LOOP["token_s"] * LOOP["prompt"] * (1 - jitter))
    assert default["finish_holds"] == 0
    assert held["requests_per_s"] >= 0.99 * plain["requests_per_s"]
    assert held["itl_p99_ms"] <= plain["itl_p99_ms"]


@pytest.mark.parametrize("clients, prompt, jitter", [(32, 128, 0.3), (8, 128, 0.3), (8, 512, 0.0)])
def test_the_defaults_answer_first_where_lengths_vary_or_prompts_are_long(clients, prompt, jitter):
    """The trade the defaults make (engine_args.py has the server's figures): no prompt
    waits for a bounded share of a step, so the first token comes sooner, for longer
    gaps between tokens where a prompt joins beside decodes; the work is the same."""
    loop = dict(LOOP, prompt=prompt, requests=120)
    default = simulate(clients, jitter=jitter, **loop)
    paced = simulate(clients, jitter=jitter, paced=True, **loop)
    assert default["ttft_p50_ms"] < 0.7 * paced["ttft_p50_ms"]
    assert default["itl_p99_ms"] > paced["itl_p99_ms"]
    assert default["requests_per_s"] >= 0.99 * paced["requests_per_s"]
