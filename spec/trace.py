"""Trace validation: replay a recorded engine trace against the reference spec.

A trace is a list of records (dicts, or JSON lines), one per request event:

    {"seq": 0, "t": 0.0, "step": 0, "request_id": "r0", "event": "add",
     "tokens": [], "reason": null, "prompt_len": 3, "max_tokens": 2,
     "priority": 0, "tenant": "a"}

`event` is one of add, admit, preempt, tokens, finish, abort, reject, fail,
executor_lost; `reason` is the finish reason of a completing event. `tokens`
may be missing on records that carry none. A "finish" record may carry the
final tokens itself or follow a "tokens" record.

`validate_trace` walks the records with the request state machine of DESIGN §3
(`cadence.spec.reference.EDGES`) and stops at the first record the spec cannot
take, raising `TraceViolation`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import attrs

from .reference import COMPLETED, EDGES, PENDING, REASONS, RUNNING

EVENTS = ("add", "admit", "preempt", "tokens", "finish", "abort", "reject", "fail", "executor_lost")
ADD_FIELDS = ("prompt_len", "max_tokens", "priority", "tenant")


class TraceViolation(AssertionError):
    """A trace record the reference spec cannot take; `record` is that record."""

    def __init__(self, record: dict, message: str) -> None:
        super().__init__(f"seq {record.get('seq')}: {record.get('event')} {record.get('request_id')!r}: "
                         f"{message}")
        self.record = record
        self.message = message


@attrs.define
class TraceSummary:
    """What a valid trace contained."""

    num_records: int = 0
    num_requests: int = 0
    num_completed: int = 0
    num_tokens: int = 0
    completed_by_reason: dict[str, int] = attrs.Factory(dict)
    live: list[str] = attrs.Factory(list)


@attrs.define
class _Life:
    phase: str
    prompt_len: int
    max_tokens: int
    num_output: int = 0


class TraceRecorder:
    """Collects trace records in memory, in the format above."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def record(self, t: float, step: int, request_id: str, event: str,
               reason: str | None = None, tokens: list[int] | None = None, **extra) -> None:
        """Append one record; `extra` holds the add-only fields."""
        rec = {"seq": len(self.records), "t": t, "step": step, "request_id": request_id,
               "event": event, "tokens": list(tokens or ()), "reason": reason}
        rec.update(extra)
        self.records.append(rec)

    def dump(self, path: str | Path) -> None:
        """Write the records as JSON lines."""
        with open(path, "w", encoding="utf-8") as f:
            for rec in self.records:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def load_trace(source: str | Path | Iterable) -> list[dict]:
    """Records from a JSON-lines file, an iterable of lines, or an iterable of dicts."""
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    out = []
    for item in source:
        if isinstance(item, dict):
            out.append(item)
        elif item.strip():
            out.append(json.loads(item))
    return out


def validate_trace(records: Iterable, *, max_model_len: int | None = None,
                   max_num_seqs: int | None = None, stop_token_ids: Iterable[int] | None = None,
                   require_complete: bool = False) -> TraceSummary:
    """Replay `records` against the spec; raise `TraceViolation` at the first bad one.

    Checks: sequence numbers increase; every edge is in the state machine
    table; an admit follows an add; no tokens unless running; never more than
    `max_tokens` (or `max_model_len`) tokens; "length" only at one of those
    limits and a request at its limit finishes next; "stop" only after a token
    of `stop_token_ids` when they are given; each request completes exactly
    once; at most `max_num_seqs` run at once. With `require_complete`, every
    request must have completed by the end.
    """
    stops = None if stop_token_ids is None else frozenset(stop_token_ids)
    lives: dict[str, _Life] = {}
    summary = TraceSummary()
    last_seq = None
    num_running = 0
    last_token: dict[str, int] = {}
    for rec in load_trace(records):
        summary.num_records += 1
        fail = lambda message, rec=rec: TraceViolation(rec, message)  # noqa: E731
        event, rid = rec.get("event"), rec.get("request_id")
        if event not in EVENTS:
            raise fail(f"unknown event {event!r}")
        if not isinstance(rid, str) or not rid:
            raise fail("request_id must be a non-empty string")
        seq = rec.get("seq")
        if not isinstance(seq, int) or (last_seq is not None and seq <= last_seq):
            raise fail(f"seq {seq!r} does not follow {last_seq!r}")
        last_seq = seq
        tokens = rec.get("tokens") or []
        life = lives.get(rid)
        if event == "add":
            if life is not None and life.phase != COMPLETED:
                raise fail("added while already live")
            missing = [f for f in ADD_FIELDS if f not in rec]
            if missing:
                raise fail(f"add record lacks {missing}")
            lives[rid] = _Life(PENDING, rec["prompt_len"], rec["max_tokens"])
            summary.num_requests += 1
            continue
        if life is None:
            raise fail("event for a request that was never added")
        if tokens:
            if life.phase != RUNNING:
                raise fail(f"{len(tokens)} tokens while {life.phase}")
            life.num_output += len(tokens)
            summary.num_tokens += len(tokens)
            last_token[rid] = tokens[-1]
            if life.num_output > life.max_tokens:
                raise fail(f"{life.num_output} tokens generated, max_tokens is {life.max_tokens}")
            if max_model_len is not None and life.prompt_len + life.num_output > max_model_len:
                raise fail(f"{life.prompt_len + life.num_output} tokens > max_model_len {max_model_len}")
        if event == "tokens":
            if not tokens:
                raise fail("a tokens record without tokens")
            continue
        at_limit = life.num_output >= life.max_tokens or (
            max_model_len is not None and life.prompt_len + life.num_output >= max_model_len)
        new_phase = EDGES.get((life.phase, event))
        if new_phase is None:
            raise fail(f"no transition from {life.phase} on {event}")
        if life.phase == RUNNING and at_limit and event not in ("finish", "abort", "fail"):
            raise fail(f"reached its length limit but got {event} instead of finishing")
        reason = rec.get("reason")
        if new_phase == COMPLETED:
            if reason not in REASONS[event]:
                raise fail(f"reason {reason!r} cannot complete a request by {event}")
            if reason == "length" and not at_limit:
                raise fail(f"finished by length after {life.num_output} of {life.max_tokens} tokens")
            if reason == "stop":
                if life.num_output == 0:
                    raise fail("finished by a stop token without generating any")
                if stops is not None and last_token.get(rid) not in stops:
                    raise fail(f"finished by stop after token {last_token.get(rid)}, not a stop token")
            summary.num_completed += 1
            summary.completed_by_reason[reason] = summary.completed_by_reason.get(reason, 0) + 1
        elif reason is not None:
            raise fail(f"reason {reason!r} on an event that does not complete the request")
        if life.phase == RUNNING:
            num_running -= 1
        if new_phase == RUNNING:
            num_running += 1
            if max_num_seqs is not None and num_running > max_num_seqs:
                raise fail(f"{num_running} requests running > max_num_seqs {max_num_seqs}")
        life.phase = new_phase
    summary.live = sorted(rid for rid, life in lives.items() if life.phase != COMPLETED)
    if require_complete and summary.live:
        raise TraceViolation({"seq": last_seq, "event": "end", "request_id": summary.live[0]},
                             f"requests never completed: {summary.live}")
    return summary


def record_trace(harness_moves, config=None, cache_config=None) -> list[dict]:
    """Drive the real core through `harness_moves(harness)` and return the trace it produced.

    `harness_moves` is a function taking a recording `cadence.spec.harness.Harness`.
    """
    from .harness import Harness
    h = Harness(config, cache_config, record=True)
    harness_moves(h)
    return h.records
