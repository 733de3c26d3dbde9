"""Hand-built simulations of the situations the random ones found or must keep
covering, each asserting that the situation really arose."""

from __future__ import annotations

from cadence.actors.simulated import Fault, FaultPlan
from sim_harness import ClientPlan, Scenario, check_report, run_scenario


def clients(n: int, prompt_len: int = 12, max_tokens: int = 6, **kwargs) -> tuple[ClientPlan, ...]:
    return tuple(ClientPlan(request_id=f"c{i}", arrival_s=0.0005 * i,
                            prompt=tuple(range(i, i + prompt_len)), max_tokens=max_tokens, **kwargs)
                 for i in range(n))


def test_executor_loss_with_a_full_waiting_queue():
    """Sending running requests back to a full waiting queue once broke the core's
    max_waiting invariant; nothing may be lost or refused because of it."""
    scenario = Scenario(seed=1, clients=clients(6), max_num_seqs=2, max_waiting=3,
                        faults=FaultPlan(at={2: Fault.CRASH, 5: Fault.CRASH}), num_fault_calls=10)
    report = run_scenario(scenario)
    check_report(report)
    assert report.num_restarts == 2
    refused = [o for o in report.outcomes.values() if o.refused]
    assert refused and all(o.refused == "QueueFullError" for o in refused)


def test_a_hang_while_a_step_is_planned_ahead():
    """Long prompts in small chunks make the scheduler plan ahead; a hang then voids
    both the step in flight and the one planned."""
    scenario = Scenario(seed=2, clients=clients(3, prompt_len=60, max_tokens=4),
                        max_num_batched_tokens=8, max_num_seqs=4,
                        faults=FaultPlan(at={3: Fault.HANG, 9: Fault.STALE}), num_fault_calls=12)
    report = run_scenario(scenario)
    check_report(report)
    assert report.num_planned_ahead > 0 and report.num_restarts == 2


def test_walking_away_while_a_step_hangs():
    """Consumers that leave while the step in flight hangs abort at once (their
    blocks are freed mid-step), and the others still get every token."""
    walkers = tuple(ClientPlan(request_id=f"w{i}", arrival_s=0.0, prompt=(1, 2, 3, i),
                               max_tokens=20, cancel_after_s=0.1 + 0.001 * i) for i in range(3))
    scenario = Scenario(seed=3, clients=clients(3) + walkers,
                        faults=FaultPlan(at={2: Fault.HANG}), num_fault_calls=4)
    report = run_scenario(scenario)
    check_report(report)
    assert report.num_restarts == 1
    assert all(report.outcomes[f"w{i}"].walked_away for i in range(3))
