"""benchmarks/scheduler_overhead.py: the floor it reports bounds every scheduler."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import scheduler_overhead  # noqa: E402
import vllm_model  # noqa: E402
from test_vllm_model import engine, synthetic_trace  # noqa: E402


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_gpu_blocks", [40, 4000])
def test_no_scheduler_computes_fewer_tokens_than_the_floor(prefix_caching, num_gpu_blocks):
    trace = synthetic_trace()
    floor = scheduler_overhead.tokens_floor(trace, 16, prefix_caching)
    ours = scheduler_overhead.replay(trace, engine(num_gpu_blocks), prefix_caching=prefix_caching)
    theirs = vllm_model.replay(trace, engine(num_gpu_blocks), prefix_caching)
    assert ours["tokens_floor"] == floor
    assert ours["tokens_scheduled"] >= floor and theirs["tokens_scheduled"] >= floor
    if not prefix_caching and num_gpu_blocks == 4000:  # nothing shared, nothing preempted
        assert ours["preemptions"] == 0 and ours["tokens_scheduled"] == floor


def test_the_floor_counts_a_shared_block_once():
    base = {"arrival_step": 0, "priority": 0, "prefix_group": 0, "prefix_len": 32,
            "prompt_len": 40, "output_len": 3}
    trace = [dict(base, id=0), dict(base, id=1)]
    alone = scheduler_overhead.tokens_floor(trace, 16, False)
    assert alone == 2 * (40 + 3 - 1)
    assert scheduler_overhead.tokens_floor(trace, 16, True) == alone - 32


def test_a_seed_draws_another_trace_of_the_same_shape():
    from workloads import generate
    own = generate("prefix")
    assert generate("prefix", None) == own
    other = generate("prefix", 12)
    assert other == generate("prefix", 12) and other != own
    assert len(other) == len(own)
    assert {r["prefix_len"] for r in other} == {r["prefix_len"] for r in own} == {512}


def test_the_seed_family_summary_is_over_every_seed_of_a_cell():
    def row(seed, steps, vsteps, pre=1, vpre=2, policy="fcfs"):
        return {"bench": "scheduler_overhead", "preset": "p", "policy": policy, "max_tokens": "generous",
                "prefix_caching": False, "step_s": 0.02, "seed": seed, "steps": steps,
                "preemptions": pre, "tokens_scheduled": 90,
                "vllm": {"steps": vsteps, "preemptions": vpre, "tokens_scheduled": 100}}
    rows = [row(1, 99, 100), row(2, 102, 100), row(1, 50, 50, policy="fair"),
            {"bench": "scheduler_overhead", "preset": "p", "policy": "fcfs", "steps": 1}]
    fcfs, fair = scheduler_overhead.seed_family(rows)
    assert fcfs["seeds"] == [1, 2] and fcfs["seeds_behind"] == 1
    assert fcfs["steps_ratio_mean"] == 1.005 and fcfs["steps_ratio_max"] == 1.02
    assert fcfs["preemptions"] == 2 and fcfs["vllm_preemptions"] == 4 and fcfs["tokens_ratio"] == 0.9
    assert fair["seeds"] == [1] and fair["steps_ratio_mean"] == 1.0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_generous_max_tokens_take_no_more_steps_than_the_vllm_model_on_prefix(prefix_caching):
    """The `prefix` preset with max_tokens = max_model_len - prompt and EOS at the
    real length, at the default configuration: no more steps than the vLLM
    model (the margin admission keeps for predicted ends decides this one; with
    the declared-limit margin it took 501 steps to the model's 498 caching off)."""
    from workloads import engine_config, generate
    trace, config = generate("prefix"), engine_config("prefix")
    at_most_the_vllm_model(trace, config, prefix_caching)


@pytest.fixture(scope="module")
def starve():
    from workloads import engine_config, generate
    return generate("starve"), engine_config("starve")


@pytest.mark.parametrize("step_s", [1.0, 0.025])
def test_the_starvation_victim_is_served_within_1000_steps_at_any_clock(starve, step_s):
    """The `starve` preset: a priority-2 request in a stream of priority 0 that
    overloads the engine. Under the default `priority` it waits at most 1,000
    steps whatever a step lasts (the aging bound: after 2 * aging_steps no later
    arrival ranks ahead of it); the vLLM model's priority policy, which does not
    age, serves it only once the stream has drained."""
    from workloads import STARVATION_STEP, STARVATION_VICTIM
    trace, config = starve
    victim = next(r for r in trace if r["id"] == STARVATION_VICTIM)
    assert victim["arrival_step"] == STARVATION_STEP and victim["priority"] == 2
    assert all(r["priority"] == 0 for r in trace if r is not victim)
    ours = scheduler_overhead.replay(trace, config, "priority", True, "exact", step_s)
    assert ours["finished_ok"]
    assert ours["max_wait_lowest_priority"] <= 1000
    # The bound, not luck: the victim waits longer than its aging window.
    assert ours["max_wait_lowest_priority"] > 2 * scheduler_overhead.SchedulerConfig().aging_steps


def test_without_aging_the_starvation_victim_waits_for_the_whole_stream(starve):
    """The trace has teeth: vLLM's priority order serves the victim last."""
    trace, config = starve
    theirs = vllm_model.replay(trace, config, True, policy="priority")
    assert theirs["max_wait_lowest_priority"] > 5 * 1000
    assert theirs["max_wait_lowest_priority"] == theirs["max_wait"]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_generous_max_tokens_on_nano_preempt_no_more_than_the_vllm_model(prefix_caching):
    """The trace the thrash window is for: nano with max_tokens = max_model_len -
    prompt outlives its predicted ends one request after another. With the window
    it preempts fewer times than the vLLM model (90 / 92 to 131 caching off /
    on), in fewer steps and tokens; without it (0) it preempted more than the
    model (181 / 176)."""
    from workloads import engine_config, generate
    trace, config = generate("nano"), engine_config("nano")
    theirs = at_most_the_vllm_model(trace, config, prefix_caching)
    without = scheduler_overhead.replay(trace, config, "fcfs", prefix_caching, "generous",
                                        thrash_window_steps=0)
    assert without["preemptions"] > theirs["preemptions"]


def at_most_the_vllm_model(trace, config, prefix_caching: bool) -> dict:
    """Replay `trace` under fcfs with generous max_tokens: every request finishes
    in no more steps, preemptions or tokens than the vLLM model's (returned)."""
    ours = scheduler_overhead.replay(trace, config, "fcfs", prefix_caching, "generous")
    theirs = vllm_model.replay(trace, config, prefix_caching)
    assert ours["finished_ok"]
    assert ours["steps"] <= theirs["steps"]
    assert ours["preemptions"] <= theirs["preemptions"]
    assert ours["tokens_scheduled"] <= theirs["tokens_scheduled"]
    return theirs


TIMINGS = ("sched_total_s", "add_s", "wall_s_whole_replay", "p50_us", "p99_us",
           "us_per_req_step", "bins")


@pytest.mark.parametrize("max_tokens", ["exact", "generous"])
def test_policies_that_reduce_to_fcfs_report_its_counters_on_prefix(max_tokens):
    """The prefix preset has one priority and one tenant and no deadlines: fair,
    priority and deadline replay it with exactly fcfs's counters (steps, tokens,
    preemptions, waits), prefix caching on."""
    from workloads import engine_config, generate
    trace, config = generate("prefix"), engine_config("prefix")
    assert len({(r["priority"], r.get("tenant")) for r in trace}) == 1

    def counters(policy):
        row = scheduler_overhead.replay(trace, config, policy, True, max_tokens)
        return {k: v for k, v in row.items() if k not in TIMINGS}
    fcfs = counters("fcfs")
    for policy in ("fair", "priority", "deadline"):
        assert counters(policy) == fcfs, policy


@pytest.fixture(scope="module")
def backlog_vllm():
    """The vLLM model on `backlog` with prefix caching (it reads no max_tokens, so
    one replay serves both modes)."""
    from workloads import engine_config, generate
    return vllm_model.replay(generate("backlog"), engine_config("backlog"), True)


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", ["exact", "generous"])
def test_fair_on_the_tenant_backlog_stays_fair_and_within_the_vllm_model(max_tokens, backlog_vllm):
    """`backlog` (100 Zipf tenants, 1,024 blocks) under fair with prefix caching:
    no more steps and tokens than the vLLM model, and while every tenant is
    backlogged the tokens served are near equal (Jain's index; FCFS serves in
    proportion to the Zipf shares, 0.16). Preempting the most served tenant's
    request before the least-work one scheduled 1.12x the model's tokens here."""
    from workloads import engine_config, generate
    trace, config = generate("backlog"), engine_config("backlog")
    ours = scheduler_overhead.replay(trace, config, "fair", True, max_tokens)
    theirs = backlog_vllm
    assert ours["finished_ok"]
    assert ours["steps"] <= theirs["steps"]
    assert ours["tokens_scheduled"] <= theirs["tokens_scheduled"]
    assert ours["jain_backlogged"] >= 0.7


def test_tenant_service_is_jains_index_over_the_backlogged_window():
    """Equal service scores 1, one tenant served alone 1 / tenants; the window
    closes with the step that admits a tenant's last request."""
    from types import SimpleNamespace as NS
    records = [{"tenant": t, "arrival_step": 0} for t in ("a", "a", "b", "b")]
    reqs = {"a1": NS(tenant="a"), "a2": NS(tenant="a"), "b1": NS(tenant="b"), "b2": NS(tenant="b")}

    def plan(tokens, admitted):
        return NS(num_scheduled_tokens=tokens,
                  new_requests=[NS(request_id=r, resumed=False) for r in admitted])
    equal = scheduler_overhead.TenantService(records)
    equal.saw(plan({"a1": 8, "b1": 8}, ["a1", "b1"]), reqs)
    equal.saw(plan({"a2": 4, "b2": 4}, ["a2", "b2"]), reqs)
    equal.saw(plan({"a2": 100}, []), reqs)  # after the window: not counted
    assert equal.figures() == {"jain_backlogged": 1.0, "backlogged_steps": 2}
    alone = scheduler_overhead.TenantService(records)
    alone.saw(plan({"a1": 8}, ["a1"]), reqs)
    alone.saw(plan({"a1": 1, "a2": 8}, ["a2"]), reqs)
    assert alone.figures()["jain_backlogged"] == 0.5
    assert scheduler_overhead.TenantService([{"id": 1}]).figures() == {}
    staggered = scheduler_overhead.TenantService([{**r, "arrival_step": i} for i, r in enumerate(records)])
    staggered.saw(plan({"a1": 8}, ["a1"]), reqs)
    assert staggered.figures() == {}  # a tenant yet to arrive is no backlog


def test_set_overrides_reach_the_scheduler_and_bad_ones_name_the_field(capsys):
    assert scheduler_overhead.parse_overrides(
        ["starvation_skip_limit=0", "admission_growth_share=0.5", "async_scheduling=on"]) == {
            "starvation_skip_limit": 0, "admission_growth_share": 0.5, "async_scheduling": True}
    assert scheduler_overhead.parse_overrides(["max_batch_size=4"]) == {"max_batch_size": 4}
    assert scheduler_overhead.parse_overrides(["max_batch_size=none"]) == {"max_batch_size": None}
    for bad, field in (("no_such_field=1", "no_such_field"), ("max_num_seqs=4", "max_num_seqs"),
                       ("starvation_skip_limit=x", "starvation_skip_limit"),
                       ("async_scheduling=maybe", "async_scheduling"),
                       ("max_lookahead=-1", "max_lookahead"), ("max_lookahead", "NAME=VALUE")):
        with pytest.raises(ValueError, match=field):
            scheduler_overhead.parse_overrides([bad])
    # The same trace under a strict head-of-line queue decides differently, and
    # the row says what it ran with.
    args = ["--preset", "nano", "--caching", "off", "--max-tokens", "generous"]
    assert scheduler_overhead.main(args) == 0
    plain = json.loads(capsys.readouterr().out.splitlines()[0])
    assert scheduler_overhead.main(args + ["--set", "starvation_skip_limit=0"]) == 0
    strict = json.loads(capsys.readouterr().out.splitlines()[0])
    assert "overrides" not in plain and strict["overrides"] == {"starvation_skip_limit": 0}
    assert (strict["steps"], strict["preemptions"]) != (plain["steps"], plain["preemptions"])
    with pytest.raises(SystemExit):
        scheduler_overhead.main(args + ["--set", "no_such_field=1"])
    assert "no_such_field" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # that mode builds its own schedulers: refused, not ignored
        scheduler_overhead.main(["--waiting-scaling", "--set", "starvation_skip_limit=0"])
    assert "--waiting-scaling" in capsys.readouterr().err


def test_vllm_rules_give_the_models_counters_and_say_so(capsys):
    """`--vllm-rules` runs the core under VLLM_RULES with one block fewer: on a preset
    without prefix caching its row's counters are the vLLM model's own, and the row
    names the rules; `--set` still applies on top (and then the counters part)."""
    assert scheduler_overhead.parse_overrides(["fcfs_victim=latest_admitted",
                                               "admit_after_preemption=off"]) == {
        "fcfs_victim": "latest_admitted", "admit_after_preemption": False}
    args = ["--preset", "nano", "--caching", "off", "--vllm", "--vllm-rules", "--seed", "24"]
    assert scheduler_overhead.main(args) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["vllm_rules"] is True and row["overrides"]["fcfs_victim"] == "latest_admitted"
    assert row["preemptions"] > 0
    for key in ("steps", "preemptions", "tokens_scheduled", "recompute_tokens", "median_wait", "p99_wait"):
        assert row[key] == row["vllm"][key], key
    assert scheduler_overhead.main(args + ["--set", "fcfs_victim=least_work"]) == 0
    mixed = json.loads(capsys.readouterr().out.splitlines()[0])
    assert mixed["overrides"]["fcfs_victim"] == "least_work"
    assert (mixed["steps"], mixed["preemptions"]) != (row["steps"], row["preemptions"])
    with pytest.raises(SystemExit):
        scheduler_overhead.main(["--waiting-scaling", "--vllm-rules"])
    assert "--waiting-scaling" in capsys.readouterr().err
