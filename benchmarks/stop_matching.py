"""What stop-string matching costs per delta: the request's automaton beside a scan
per stop string, in the same run.

    python benchmarks/stop_matching.py [--quick]

Prints one JSON line per stop list: CPU microseconds per 4-character delta for
`StopStringMatcher` (one Aho-Corasick automaton per request) and for the scan
(every stop string searched in the held text plus the delta, then every prefix
of every stop string tested against its end), and their ratio. The lists run
from one short stop string to the largest a request may carry by default
(16 of 256 characters); the text never completes a stop string, so every
delta is matched in full.
"""

from __future__ import annotations

import argparse
import json
import time

from cadence.actors.detokenizer import StopStringMatcher
from cadence.actors.validation import DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS

DELTA_CHARS = 4


class ScanMatcher:
    """The peer: find each stop string in the buffer, then hold the longest suffix
    that begins one, testing each stop string's prefixes from the longest."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        buffer = self.held + text
        hits = [at for at in (buffer.find(stop) for stop in self.stops) if at >= 0]
        if hits:
            self.held = ""
            return buffer[:min(hits)], True
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), keep, -1):
                if buffer.endswith(stop[:k]):
                    keep = k
                    break
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False


def stop_lists() -> dict[str, list[str]]:
    longest = ["a" * k + "b" + "a" * (DEFAULT_MAX_STOP_CHARS - k - 1)
               for k in range(0, DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_CHARS // DEFAULT_MAX_STOP_STRINGS)]
    return {
        "one_short": ["</s>"],
        "three_chat": ["</s>", "\n\nUser:", "###"],
        "max_default": longest,
    }


def text_for(name: str, num_chars: int) -> str:
    if name == "max_default":
        # Runs of "a" keep every stop string in play; "b" plus 14 "a"s and a "c" breaks each.
        unit = "a" * 280 + "b" + "a" * 14 + "c"
    else:
        unit = "The quick brown fox jumps over the lazy dog. "
    return (unit * (num_chars // len(unit) + 1))[:num_chars]


def per_delta_us(matcher_type, stops: list[str], pieces: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        matcher = matcher_type(stops)
        start = time.process_time()
        for piece in pieces:
            _, stopped = matcher.feed(piece)
            assert not stopped
        best = min(best, time.process_time() - start)
    return best / len(pieces) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter text, for a smoke run")
    args = parser.parse_args()
    num_chars = 20_000 if args.quick else 200_000
    for name, stops in stop_lists().items():
        text = text_for(name, num_chars)
        pieces = [text[i:i + DELTA_CHARS] for i in range(0, len(text), DELTA_CHARS)]
        automaton = per_delta_us(StopStringMatcher, stops, pieces, 3)
        scan = per_delta_us(ScanMatcher, stops, pieces, 3)
        print(json.dumps({"bench": "stop_matching", "stops": name, "num_stops": len(stops),
                          "max_stop_chars": max(map(len, stops)), "automaton_us_per_delta":
                          round(automaton, 3), "scan_us_per_delta": round(scan, 3),
                          "scan_over_automaton": round(scan / automaton, 2)}))


if __name__ == "__main__":
    main()
