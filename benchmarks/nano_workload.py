"""The offline throughput workload of nano-vllm's bench.py, token for token.

`random.seed(0)`; 256 prompts of U[100, 1024] token ids, each id U[0, 10000];
then, in a second pass, one output length U[100, 1024] per request. EOS is
ignored, so every request produces exactly its output length: 133,966 tokens
in all. (Drawing each request's output length right after its prompt gives
another total; the prompts-first order is the one that reproduces 133,966.)

nano-vllm samples at temperature 0.6; the throughput does not depend on the
tokens drawn since EOS is ignored, and Cadence's benchmarks default to greedy
so that outputs can be checked against Hugging Face transformers.

Scaled-down variants (fewer requests, shorter lengths) draw the same way with
every length bound scaled alike (`scaled`): `--num-requests 32 --max-input 128
--max-output 128` draws 32 prompts and output lengths from U[12, 128], an
eighth of the original bounds.

    python benchmarks/nano_workload.py            # prints the totals
"""

from __future__ import annotations

import argparse
import json
import random

import attrs

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


def main() -> int:
    """Print the workload's totals as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--max-input", type=int, default=MAX_INPUT_LEN)
    parser.add_argument("--max-output", type=int, default=MAX_OUTPUT_LEN)
    args = parser.parse_args()
    print(json.dumps(scaled(args.num_requests, args.max_input, args.max_output).summary()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
