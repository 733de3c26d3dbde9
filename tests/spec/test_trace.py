"""Trace validation against the reference spec, on recorded and on hand-broken traces."""

import json

import pytest

from cadence.spec.harness import Harness
from cadence.spec.invariants import completed_exactly_once, fcfs_within_class, table_edges_only
from cadence.spec.trace import TraceViolation, load_trace, record_trace, validate_trace
from cadence.statemachine.config import CacheConfig, SchedulerConfig

CONFIG = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=10)
CACHE = CacheConfig(num_blocks=6, block_size=2)


def busy(h: Harness) -> None:
    h.add("a", (1, 2, 3), 3)
    h.add("b", (1, 2, 4, 5), 2, priority=1)
    h.add("c", (7,), 4, tenant="b")
    h.step()
    h.executor_lost()
    h.step()
    h.abort("c")
    h.step(eos=["a", "b"])
    h.add("d", (9, 9), 1)
    h.run_until_idle()


def add(seq, rid, prompt_len=2, max_tokens=2, t=0.0, priority=0, tenant="a"):
    return {"seq": seq, "t": t, "step": 0, "request_id": rid, "event": "add", "tokens": [],
            "reason": None, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "priority": priority, "tenant": tenant}


def ev(seq, rid, event, tokens=(), reason=None, step=0):
    return {"seq": seq, "t": float(step), "step": step, "request_id": rid, "event": event,
            "tokens": list(tokens), "reason": reason}


def test_a_recorded_trace_is_valid_and_complete(tmp_path):
    records = record_trace(busy, CONFIG, CACHE)
    kinds = {r["event"] for r in records}
    assert {"add", "admit", "tokens", "finish", "abort", "executor_lost"} <= kinds
    summary = validate_trace(records, max_model_len=10, max_num_seqs=2, stop_token_ids={0},
                             require_complete=True)
    assert summary.num_requests == 4 == summary.num_completed
    assert summary.completed_by_reason["abort"] == 1
    assert {"stop", "length"} <= set(summary.completed_by_reason)
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert load_trace(path) == records
    assert not table_edges_only(records) and not completed_exactly_once(records)
    assert not fcfs_within_class(records, block_size=2)


@pytest.mark.parametrize("records, message", [
    ([ev(0, "x", "admit")], "never added"),
    ([add(0, "x"), ev(1, "x", "tokens", [5])], "while pending"),
    ([add(0, "x"), ev(1, "x", "admit"), ev(2, "x", "admit")], "no transition from running on admit"),
    ([add(0, "x"), ev(1, "x", "admit"), ev(2, "x", "tokens", [5, 5, 5])], "max_tokens is 2"),
    ([add(0, "x"), ev(1, "x", "admit"), ev(2, "x", "tokens", [5]), ev(3, "x", "finish", reason="length")],
     "finished by length after 1 of 2"),
    ([add(0, "x"), ev(1, "x", "admit"), ev(2, "x", "tokens", [5]), ev(3, "x", "finish", reason="stop")],
     "not a stop token"),
    ([add(0, "x"), ev(1, "x", "abort", reason="abort"), ev(2, "x", "abort", reason="abort")],
     "no transition from completed"),
    ([add(0, "x"), ev(1, "x", "reject", reason="abort")], "cannot complete"),
    ([add(0, "x"), ev(1, "x", "admit"), ev(2, "x", "tokens", [5, 5]), ev(3, "x", "preempt")],
     "length limit"),
    ([add(0, "x"), add(1, "y"), add(2, "z"), ev(3, "x", "admit"), ev(4, "y", "admit"),
      ev(5, "z", "admit")], "max_num_seqs"),
    ([add(0, "x"), add(0, "y")], "does not follow"),
    ([add(0, "x"), add(1, "x")], "already live"),
])
def test_the_first_bad_record_is_reported(records, message):
    with pytest.raises(TraceViolation) as info:
        validate_trace(records, max_num_seqs=2, stop_token_ids={0})
    assert message in str(info.value)
    assert info.value.record is records[-1] or message == "never added"


def test_unfinished_requests_fail_only_when_required():
    records = [add(0, "x"), ev(1, "x", "admit")]
    assert validate_trace(records).live == ["x"]
    with pytest.raises(TraceViolation, match="never completed"):
        validate_trace(records, require_complete=True)


def test_fcfs_within_class_flags_an_overtaking_admission():
    records = [add(0, "early", prompt_len=2, t=0.0), add(1, "late", prompt_len=4, t=1.0),
               ev(2, "late", "admit", step=1)]
    assert fcfs_within_class(records, block_size=2)
    # A different class, or an earlier request too big to fit where the later did, is fine.
    other = [add(0, "early", prompt_len=2, t=0.0, tenant="b")] + records[1:]
    assert not fcfs_within_class(other, block_size=2)
    bigger = [add(0, "early", prompt_len=8, t=0.0)] + records[1:]
    assert not fcfs_within_class(bigger, block_size=2)
