"""benchmarks/vllm_model.py: the model of vLLM V1's scheduling rules keeps its invariants, and
the core under the same rules (VLLM_RULES) plans step for step what it plans."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import scheduler_overhead  # noqa: E402
import vllm_model  # noqa: E402
from workloads import engine_config, generate  # noqa: E402


def synthetic_trace(n: int = 60, seed: int = 7) -> list[dict]:
    """Small requests arriving over a few steps; half share one of three 48-token prefixes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        shared = rng.random() < 0.5
        prompt = rng.randint(20, 120) + (48 if shared else 0)
        out.append({"id": i, "arrival_step": i // 6, "prompt_len": prompt,
                    "output_len": rng.randint(5, 60), "priority": 0,
                    "prefix_group": rng.randrange(3) if shared else -1,
                    "prefix_len": 48 if shared else 0})
    return out


def engine(num_gpu_blocks: int) -> dict:
    return {"block_size": 16, "num_gpu_blocks": num_gpu_blocks, "max_num_seqs": 16,
            "max_num_batched_tokens": 128, "max_model_len": 4096, "chunked_prefill": True}


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_gpu_blocks", [40, 4000])
def test_invariants_hold_every_step(prefix_caching, num_gpu_blocks):
    """Every request ends with exactly output_len tokens; block reference counts match
    their holders after every step (check=True); blocks in use never exceed the pool."""
    records = synthetic_trace()
    out = vllm_model.replay(records, engine(num_gpu_blocks), prefix_caching, check=True)
    assert out["finished_ok"] and out["num_wrong"] == 0
    assert out["max_blocks_in_use"] <= num_gpu_blocks - 1  # one block is the null block
    total = sum(r["prompt_len"] + r["output_len"] for r in records)
    if not prefix_caching:
        # Without caching every token is computed once, plus what preemption threw away.
        assert out["tokens_scheduled"] == total - len(records) + out["recompute_tokens"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempts_only_when_the_cache_is_too_small(prefix_caching):
    records = synthetic_trace()
    tight = vllm_model.replay(records, engine(40), prefix_caching)
    roomy = vllm_model.replay(records, engine(4000), prefix_caching)
    assert tight["preemptions"] > 0 and tight["recompute_tokens"] > 0
    assert roomy["preemptions"] == 0 and roomy["recompute_tokens"] == 0
    assert tight["steps"] > roomy["steps"]


def test_prefix_caching_hits_shared_prefixes():
    records = synthetic_trace()
    on = vllm_model.replay(records, engine(4000), True)
    off = vllm_model.replay(records, engine(4000), False)
    assert on["prefix_hit_tokens"] > 0 and on["prefix_hit_tokens"] % 16 == 0
    assert off["prefix_hit_tokens"] == 0
    assert on["tokens_scheduled"] == off["tokens_scheduled"] - on["prefix_hit_tokens"]


def req(i: int, prompt_len: int, output_len: int) -> vllm_model.Req:
    rec = {"id": i, "arrival_step": 0, "prompt_len": prompt_len, "output_len": output_len,
           "priority": 0, "prefix_group": -1, "prefix_len": 0}
    return vllm_model.Req(i, rec, None)


def test_admission_allocates_the_chunk_only():
    """A new request gets blocks for the tokens scheduled now, not the whole prompt."""
    model = vllm_model.VllmModel({**engine(100), "max_num_batched_tokens": 32}, prefix_caching=False)
    r = req(0, 100, 4)
    model.add(r)
    assert model.schedule() == {r: 32}
    assert len(r.blocks) == 2 and model.pool.in_use() == 2


def test_latest_admitted_is_preempted_and_goes_to_the_front():
    # 5 usable blocks (6 with the null block); two 32-token prompts fill 4 of them.
    model = vllm_model.VllmModel({**engine(6), "max_num_batched_tokens": 256}, prefix_caching=False)
    a, b, c = req(0, 32, 40), req(1, 32, 40), req(2, 48, 4)
    for r in (a, b, c):
        model.add(r)
    plan = model.schedule()
    assert plan == {a: 32, b: 32}          # c does not fit: head of line, nothing more admitted
    assert list(model.waiting) == [c]
    for r in (a, b):                       # each samples its first token: 33 tokens, 2 blocks
        r.num_tokens += 1
        r.num_output += 1
    # a needs a third block (1 free): fine; b needs one too: none left, so b (the last
    # of the running list) is preempted, and it is b itself, so the pass stops.
    plan = model.schedule()
    assert plan == {a: 1}
    assert model.running == [a] and list(model.waiting) == [b, c]
    assert b.num_computed == 0 and not b.blocks
    assert model.num_preemptions == 1 and model.num_recompute_tokens == 32
    model.check()


def test_nano_matches_the_vllm_calibration():
    """Real vLLM V1 on nano: 1,650 steps, 131 preemptions, 1.31x / 1.24x tokens."""
    records, eng = generate("nano"), engine_config("nano")
    off = vllm_model.replay(records, eng, False)
    on = vllm_model.replay(records, eng, True)
    assert off["finished_ok"] and on["finished_ok"]
    assert off["preemptions"] == on["preemptions"] == 131
    assert abs(off["steps"] - 1650) <= 5 and abs(on["steps"] - 1650) <= 5
    assert round(off["tokens_over_prompt_plus_output"], 2) == 1.31
    assert round(on["tokens_over_prompt_plus_output"], 2) == 1.24


def prio_req(i: int, prompt_len: int, output_len: int, priority: int, arrival: int = 0):
    rec = {"id": i, "arrival_step": arrival, "prompt_len": prompt_len, "output_len": output_len,
           "priority": priority, "prefix_group": -1, "prefix_len": 0}
    return vllm_model.Req(i, rec, None)


def test_priority_mode_admits_by_priority_then_arrival():
    model = vllm_model.VllmModel({**engine(100), "max_num_seqs": 1}, prefix_caching=False,
                                 policy="priority")
    late_high, early_low = prio_req(0, 8, 4, priority=0, arrival=5), prio_req(1, 8, 4, priority=2)
    for r in (early_low, late_high):
        model.add(r)
    assert list(model.schedule()) == [late_high]


def test_priority_mode_preempts_the_lowest_priority_wherever_it_runs():
    """The victim is the running request with the largest (priority, arrival), even
    one already scheduled earlier in the step (its tokens go back to the budget),
    and it goes back into the priority heap, not to the front."""
    model = vllm_model.VllmModel({**engine(6), "max_num_batched_tokens": 256}, prefix_caching=False,
                                 policy="priority")
    low, high = prio_req(0, 32, 40, priority=2), prio_req(1, 32, 40, priority=0)
    model.add(low)
    model.add(high)
    assert model.schedule() == {high: 32, low: 32}
    for r in (low, high):
        r.num_tokens += 1
        r.num_output += 1
    # high is first in the running list; one block is free for two that need one:
    # high takes it, then low needs one and is itself the victim.
    plan = model.schedule()
    assert plan == {high: 1} and model.running == [high] and model.heap == [low]
    assert model.num_preemptions == 1
    model.check()


def test_both_policies_report_waits_and_the_cli_labels_the_mode(capsys):
    """Waits are reported for both policies; vLLM's admission never reads
    max_tokens, so `--max-tokens generous` only labels the output."""
    records = synthetic_trace()
    for policy in vllm_model.POLICIES:
        out = vllm_model.replay(records, engine(40), True, policy=policy)
        assert out["finished_ok"] and 0 <= out["median_wait"] <= out["p99_wait"]
    assert vllm_model.main(["--preset", "prefix", "--max-tokens", "generous", "--policy", "priority"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["max_tokens"] == "generous" and line["policy"] == "priority" and line["finished_ok"]


# ---- the core under the model's rules plans what the model plans --------------------


def plans_of(records: list[dict], engine_: dict, mode: str, **overrides) -> tuple[list, list, dict, dict]:
    """Every step's plan of the core under VLLM_RULES (with `overrides` on top) and of
    the model, without prefix caching, and both runs' figures."""
    core_plans: list[dict] = []
    model_plans: list[dict] = []
    rules = {**scheduler_overhead.VLLM_RULES, **overrides}
    core = scheduler_overhead.replay(records, scheduler_overhead.vllm_rules_engine(engine_), "fcfs",
                                     False, mode, on_plan=core_plans.append, **rules)
    model = vllm_model.replay(records, engine_, False, on_plan=model_plans.append)
    return core_plans, model_plans, core, model


@st.composite
def small_traces(draw) -> tuple[list[dict], dict]:
    """A few dozen requests arriving in bursts and a pool small enough to preempt.
    The step's budget holds every prompt a step may admit whole (16 seats of at most
    160 tokens): where a prompt is split, vLLM takes blocks a chunk at a time while
    the core takes them for the whole prompt as it admits it (it never admits a
    request that cannot hold its prompt), a difference of design the rules leave."""
    n = draw(st.integers(4, 40))
    out, step = [], 0
    for i in range(n):
        step += draw(st.integers(0, 3))
        out.append({"id": i, "arrival_step": step, "prompt_len": draw(st.integers(1, 90)),
                    "output_len": draw(st.integers(1, 70)), "priority": 0,
                    "prefix_group": -1, "prefix_len": 0})
    blocks = draw(st.integers(12, 80))
    # A declared limit (generous mode: max_model_len - prompt) must fit the pool.
    return out, {**engine(blocks), "max_num_seqs": draw(st.integers(2, 16)),
                 "max_num_batched_tokens": 4096, "max_model_len": (blocks - 1) * 16}


@settings(max_examples=60)
@given(small_traces(), st.sampled_from(["exact", "generous"]))
def test_the_core_under_vllm_rules_plans_what_the_model_plans(trace, mode):
    """The core under VLLM_RULES, given one block fewer, schedules the same requests
    for the same tokens in every step as the model: two implementations of the same
    rules agree, so a difference in the benchmark's counters is what Cadence's own
    rules (margins, lookahead, victim, admission after a preemption) do."""
    records, engine_ = trace
    core_plans, model_plans, core, model = plans_of(records, engine_, mode)
    assert core_plans == model_plans
    assert (core["steps"], core["preemptions"], core["tokens_scheduled"]) == (
        model["steps"], model["preemptions"], model["tokens_scheduled"])


def test_each_vllm_rule_is_needed_to_plan_as_the_model():
    """Each of the core's own rules plans otherwise on a trace that preempts: without
    it the plans part (so the agreement above is not one the rules leave untouched)."""
    records = synthetic_trace(n=80, seed=3)
    engine_ = {**engine(40), "max_num_batched_tokens": 4096}  # no prompt split (see above)
    core_plans, model_plans, core, _ = plans_of(records, engine_, "exact")
    assert core_plans == model_plans and core["preemptions"] > 0
    for name, value in (("fcfs_victim", "least_work"), ("admit_after_preemption", True),
                        ("max_lookahead", 16), ("admission_growth_share", 0.95)):
        other, model_again, _, _ = plans_of(records, engine_, "exact", **{name: value})
        assert other != model_again, name


@pytest.mark.parametrize("preset", ["nano", "prefix"])
def test_presets_under_vllm_rules_match_the_model(preset):
    """A whole preset (seed 21, caching off) gives the model's counters under the rules."""
    records = generate(preset, seed=21)
    core_plans, model_plans, core, model = plans_of(records, engine_config(preset), "generous")
    assert len(core_plans) == model["steps"]
    assert core_plans == model_plans
    assert core["finished_ok"] and model["finished_ok"]
