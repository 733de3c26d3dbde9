"""benchmarks/scheduler_overhead.py: the floor it reports bounds every scheduler."""

from __future__ import annotations

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
