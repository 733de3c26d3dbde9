"""Benchmark workloads, shipped with the package so that `cadence bench` runs from a wheel.

The nano-vllm workload (`nano`, `scaled`): the offline throughput workload of
nano-vllm's bench.py, token for token. `random.seed(0)`; 256 prompts of
U[100, 1024] token ids, each id U[0, 10000]; then, in a second pass, one output
length U[100, 1024] per request. EOS is ignored, so every request produces
exactly its output length: 133,966 tokens in all. (Drawing each request's
output length right after its prompt gives another total; the prompts-first
order is the one that reproduces 133,966.) Scaled-down variants draw the same
way with every length bound scaled alike: 32 requests with bounds of 128 draw
prompts and output lengths from U[12, 128], an eighth of the original bounds.

Trace presets (`PRESETS`, `generate`, `load`): deterministic request traces,
one request per line of a JSON-lines file:
    {"id", "arrival_step", "prompt_len", "output_len", "priority", "prefix_group", "prefix_len"}
and, where a preset names them, "tenant" (otherwise a request's tenant is its priority).
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

import json
import math
import random

import attrs

from cadence.statemachine.errors import ConfigError

__all__ = [
    "Workload", "draw", "nano", "scaled", "PRESETS", "STARVATION_VICTIM", "STARVATION_STEP", "ENGINE_DEFAULTS", "generate", "load",
    "engine_config", "prompt_tokens", "output_token", "token_id", "splitmix64",
]

# ---- the nano-vllm workload ---------------------------------------------------------------
NUM_REQUESTS = 256
MIN_LEN = 100
MAX_INPUT_LEN = 1024
MAX_OUTPUT_LEN = 1024
MAX_TOKEN_ID = 10000
EXPECTED_OUTPUT_TOKENS = 133_966
NANO_TEMPERATURE = 0.6


@attrs.frozen
class Workload:
    """Prompts (token ids) and output lengths, one per request."""

    prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        """Requests in the workload."""
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens over all requests (EOS ignored, so exactly the drawn lengths)."""
        return sum(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        """Longest prompt plus output."""
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))

    def head(self, num_requests: int) -> Workload:
        """The first `num_requests` requests."""
        return Workload(self.prompts[:num_requests], self.output_lens[:num_requests])

    def capped(self, max_output: int) -> Workload:
        """The same prompts with output lengths capped at `max_output`."""
        return Workload(self.prompts, tuple(min(o, max_output) for o in self.output_lens))

    def summary(self) -> dict:
        """Counts as a JSON-ready dict."""
        return dict(num_requests=self.num_requests, num_prompt_tokens=self.num_prompt_tokens,
                    num_output_tokens=self.num_output_tokens, max_seq_len=self.max_seq_len)


def draw(num_requests: int = NUM_REQUESTS, max_input: int = MAX_INPUT_LEN, max_output: int = MAX_OUTPUT_LEN,
         min_len: int = MIN_LEN, max_token_id: int = MAX_TOKEN_ID, seed: int = 0) -> Workload:
    """Draw the workload: all prompts first, then all output lengths, from the global-style RNG seeded `seed`."""
    rng = random.Random(seed)
    prompts = tuple(
        tuple(rng.randint(0, max_token_id) for _ in range(rng.randint(min_len, max_input)))
        for _ in range(num_requests)
    )
    output_lens = tuple(rng.randint(min_len, max_output) for _ in range(num_requests))
    return Workload(prompts, output_lens)


def nano() -> Workload:
    """The exact nano-vllm workload; checks its published output-token total."""
    workload = draw()
    assert workload.num_output_tokens == EXPECTED_OUTPUT_TOKENS, (
        f"nano workload drew {workload.num_output_tokens} output tokens, expected {EXPECTED_OUTPUT_TOKENS}"
    )
    return workload


def scaled(num_requests: int, max_input: int, max_output: int, max_token_id: int = MAX_TOKEN_ID,
           seed: int = 0) -> Workload:
    """The nano draw with every length bound scaled alike: the minimum length keeps its ratio to 1024.

    With the full bounds (256, 1024, 1024) this is exactly `nano()`.
    """
    if (num_requests, max_input, max_output, max_token_id) == (NUM_REQUESTS, MAX_INPUT_LEN, MAX_OUTPUT_LEN,
                                                              MAX_TOKEN_ID):
        return nano()
    min_len = max(1, round(MIN_LEN * min(max_input, max_output) / MAX_INPUT_LEN))
    return draw(num_requests, max_input, max_output, min_len=min_len, max_token_id=max_token_id, seed=seed)



# ---- trace presets ---------------------------------------------------------------------
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
    "backlog": dict(seed=5, engine={"num_gpu_blocks": 1024}, doc="4000 requests at step 0 from 100 "
                    "tenants with Zipf(1) shares (tenant k draws 1/k of the weight), prompt "
                    "U[128,1024], output U[128,512], priority 0, 1024 KV blocks"),
    "starve": dict(seed=4, engine={}, doc="one priority-2 request (id 0) at step 200 in a stream "
                   "of 12000 priority-0 requests from step 0, Poisson(2.4) arrivals per step (about 1.25 times "
                   "what the engine serves), prompt U[32,512], output U[16,256]"),
}

NUM_BACKLOG_TENANTS = 100
"""Tenants of the `backlog` preset."""
STARVATION_VICTIM = 0
"""The id of the low-priority request of the `starve` preset."""
STARVATION_STEP = 200
"""Its arrival step: the stream has built a backlog by then."""


def splitmix64(x: int) -> int:
    """One round of the splitmix64 mixer."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def token_id(stream: int, position: int) -> int:
    """The token at `position` of stream `stream` (see the module docstring)."""
    return FIRST_TOKEN + splitmix64(((stream << 24) | position) & MASK64) % NUM_TOKEN_IDS


def prompt_tokens(req: dict) -> list[int]:
    """The prompt token ids of a trace record."""
    group = (1 << 32) | max(req.get("prefix_group", -1), 0)
    own, shared = req["id"], req.get("prefix_len", 0)
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


def generate(preset: str, seed: int | None = None) -> list[dict]:
    """The trace a preset names, sorted by (arrival_step, id); `seed` draws another
    trace of the same shape (default: the preset's own seed)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    rng = random.Random(PRESETS[preset]["seed"] if seed is None else seed)
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
    elif preset == "backlog":
        weights = [1 / k for k in range(1, NUM_BACKLOG_TENANTS + 1)]
        tenants = rng.choices(range(NUM_BACKLOG_TENANTS), weights, k=4000)
        for i, tenant in enumerate(tenants):
            p, o = rng.randint(128, 1024), rng.randint(128, 512)
            out.append({**_record(i, 0, p, o), "tenant": f"t{tenant}"})
    elif preset == "starve":
        out.append(_record(STARVATION_VICTIM, STARVATION_STEP, rng.randint(32, 512),
                           rng.randint(16, 256), 2))
        for i, step in enumerate(_arrival_steps(rng, 12000, 2.4), start=1):
            out.append(_record(i, step, rng.randint(32, 512), rng.randint(16, 256), 0))
    out.sort(key=lambda r: (r["arrival_step"], r["id"]))
    return out


def engine_config(preset: str) -> dict:
    """The engine configuration a preset is meant to run with (scheduler-replay names)."""
    return {**ENGINE_DEFAULTS, **PRESETS[preset]["engine"]}


def load(path: str) -> list[dict]:
    """Read a JSON-lines trace, sorted by (arrival_step, id); a file that cannot be read
    or parsed raises ConfigError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError as exc:
        raise ConfigError(f"cannot read the trace: {exc.strerror}: {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not a JSON-lines trace: {exc}") from None
    missing = [key for key in ("id", "arrival_step", "prompt_len", "output_len")
               if records and key not in records[0]]
    if missing:
        raise ConfigError(f"{path}: trace records need {', '.join(missing)}")
    return sorted(records, key=lambda r: (r["arrival_step"], r["id"]))
