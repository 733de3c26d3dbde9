"""Deterministic request traces for replaying through the scheduler.

One request per line of a JSON-lines file:
    {"id", "arrival_step", "prompt_len", "output_len", "priority", "prefix_group", "prefix_len"}
Token ids are not stored: they are a pure function of those fields, built on
splitmix64 so any engine (in any language) rebuilds the same prompts:

    token(stream, pos) = 100 + splitmix64((stream << 24 | pos) mod 2**64) mod 31000
    prompt position p < prefix_len:  token(1 << 32 | prefix_group, p)
    prompt position p >= prefix_len: token(id, p)
    k-th generated token:            token(2 << 32 | id, k)

Each preset carries the engine configuration it is meant to run with. The
presets draw their random numbers in a fixed order from `random.Random(seed)`,
so a preset name always yields the same trace.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

MASK64 = (1 << 64) - 1
FIRST_TOKEN = 100
NUM_TOKEN_IDS = 31000

ENGINE_DEFAULTS = {
    "block_size": 16,
    "num_gpu_blocks": 8192,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "max_model_len": 4096,
    "chunked_prefill": True,
}

PRESETS = {
    "nano": dict(seed=0, engine={}, doc="256 requests at step 0, prompt and output U[100,1024]"),
    "poisson": dict(seed=1, engine={}, doc="2000 requests, Poisson(4) arrivals per step, "
                    "prompt U[32,2048], output U[16,512], priority in {0,1,2}"),
    "prefix": dict(seed=2, engine={}, doc="1000 requests, Poisson(4) arrivals, 10 groups sharing "
                   "a 512-token prefix + U[16,256] own tokens, output U[16,128]"),
    "overload": dict(seed=3, engine={"num_gpu_blocks": 1024}, doc="4000 requests at step 0, prompt "
                     "U[128,1024], output U[128,512], priority in {0,1,2}, 1024 KV blocks"),
}


def splitmix64(x: int) -> int:
    """One round of the splitmix64 mixer."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def token_id(stream: int, position: int) -> int:
    return FIRST_TOKEN + splitmix64(((stream << 24) | position) & MASK64) % NUM_TOKEN_IDS


def prompt_tokens(req: dict) -> list[int]:
    """The prompt token ids of a trace record."""
    group = (1 << 32) | max(req["prefix_group"], 0)
    own, shared = req["id"], req["prefix_len"]
    return [token_id(group, p) if p < shared else token_id(own, p) for p in range(req["prompt_len"])]


def output_token(req: dict, k: int) -> int:
    """The k-th generated token of a trace record."""
    return token_id((2 << 32) | req["id"], k)


def _poisson_count(rng: random.Random, lam: float) -> int:
    threshold, k, product = math.exp(-lam), 0, 1.0
    while True:
        product *= rng.random()
        if product <= threshold:
            return k
        k += 1


def _arrival_steps(rng: random.Random, n: int, lam: float) -> list[int]:
    out: list[int] = []
    step = 0
    while len(out) < n:
        out += [step] * _poisson_count(rng, lam)
        step += 1
    return out[:n]


def _record(i, step, prompt_len, output_len, priority=0, group=-1, prefix_len=0) -> dict:
    return {"id": i, "arrival_step": step, "prompt_len": prompt_len, "output_len": output_len,
            "priority": priority, "prefix_group": group, "prefix_len": prefix_len}


def generate(preset: str) -> list[dict]:
    """The trace a preset names, sorted by (arrival_step, id)."""
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    rng = random.Random(PRESETS[preset]["seed"])
    out = []
    if preset == "nano":
        for i in range(256):
            p = rng.randint(100, 1024)
            out.append(_record(i, 0, p, rng.randint(100, 1024)))
    elif preset == "poisson":
        for i, step in enumerate(_arrival_steps(rng, 2000, 4.0)):
            p, o = rng.randint(32, 2048), rng.randint(16, 512)
            out.append(_record(i, step, p, o, rng.randint(0, 2)))
    elif preset == "prefix":
        for i, step in enumerate(_arrival_steps(rng, 1000, 4.0)):
            group = rng.randrange(10)
            own = rng.randint(16, 256)
            out.append(_record(i, step, 512 + own, rng.randint(16, 128), 0, group, 512))
    elif preset == "overload":
        for i in range(4000):
            p, o = rng.randint(128, 1024), rng.randint(128, 512)
            out.append(_record(i, 0, p, o, rng.randint(0, 2)))
    out.sort(key=lambda r: (r["arrival_step"], r["id"]))
    return out


def engine_config(preset: str) -> dict:
    return {**ENGINE_DEFAULTS, **PRESETS[preset]["engine"]}


def load(path: str) -> list[dict]:
    """Read a JSON-lines trace."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return sorted(records, key=lambda r: (r["arrival_step"], r["id"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a preset trace as JSON lines.")
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("-o", "--out", default="-")
    args = ap.parse_args(argv)
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in generate(args.preset))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
