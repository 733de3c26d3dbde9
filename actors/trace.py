"""The engine's event recorder: every request event as one JSON record.

A trace is a sequence of records, written as JSON lines to `trace_path` and/or
kept in memory. `cadence.spec` replays such traces against its reference
specification, so the format below is a contract:

    {"seq": 0, "t": 0.0, "step": 0, "request_id": "r0", "event": "add",
     "reason": null, "prompt_len": 12, "max_tokens": 4, "priority": 0,
     "tenant": "default"}

Every record has these keys:
  seq         int, 0, 1, 2, ... in the order the engine saw the events.
  t           float, seconds on the Trio clock (virtual under a MockClock).
  step        int, the id of the step plan the event belongs to: for admit,
              preempt and reject the plan whose scheduling produced it, for
              tokens and finish the plan whose result produced it; for add,
              abort, fail and executor_lost the id the next plan will get.
  request_id  str.
  event       one of "add", "admit", "preempt", "tokens", "finish", "abort",
              "reject", "fail", "executor_lost".
  reason      str or null: the finish reason of a completing event ("stop" or
              "length" for finish, "abort", "rejected", "error"); null otherwise.
Event-specific keys:
  tokens      (tokens only) list of int, the tokens generated in that step.
  prompt_len, max_tokens, priority, tenant   (add only).

Only requests the scheduling core accepted are recorded; a submission refused
by validation (too long, queue full, duplicate id) leaves no record. A finish
that arrives with tokens is recorded as a "tokens" record followed by a
"finish" record, so "tokens" is the only record that carries tokens. Each
request's records read add, then admit/preempt/executor_lost/tokens in the
order the core produced them, then exactly one completing record (finish,
abort, reject or fail).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Iterable, Iterator

__all__ = ["EVENT_NAMES", "TraceRecorder", "read_trace"]

EVENT_NAMES = ("add", "admit", "preempt", "tokens", "finish", "abort", "reject", "fail",
               "executor_lost")


class TraceRecorder:
    """Collects trace records in memory (`records`) and/or appends them to a file.

    Writes go through a buffered file and are flushed on `close()`, so recording
    costs no awaits on the engine's hot path.
    """

    def __init__(self, path: str | Path | None = None, *, keep: bool = True) -> None:
        self.records: list[dict] | None = [] if keep else None
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8") if self.path else None
        self._seq = 0

    def record(self, t: float, step: int, request_id: str, event: str,
               reason: str | None = None, tokens: list[int] | None = None, **extra) -> None:
        """Append one record; `tokens` only for "tokens" events, `extra` only for "add"."""
        rec = {"seq": self._seq, "t": t, "step": step, "request_id": request_id,
               "event": event, "reason": reason}
        if tokens is not None:
            rec["tokens"] = list(tokens)
        if extra:
            rec.update(extra)
        self._seq += 1
        if self.records is not None:
            self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec, separators=(",", ":")))
            self._file.write("\n")

    def __len__(self) -> int:
        return self._seq

    def close(self) -> None:
        """Flush and close the file, if any; in-memory records stay readable."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(source: str | Path | Iterable[str]) -> Iterator[dict]:
    """Yield the records of a JSON-lines trace file (or of an iterable of lines)."""
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as lines:
            yield from (json.loads(line) for line in lines if line.strip())
    else:
        yield from (json.loads(line) for line in source if line.strip())
