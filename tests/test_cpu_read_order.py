"""benchmarks/cpu_read_order.py: every order reads every line of the cache exactly once."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import cpu_read_order  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="the benchmark's loop is built with gcc")

BLOCK, SLOT, HEAD = 8192, 512, 128


def first_words_sum(memory: torch.Tensor) -> int:
    """The sum (mod 2**64) of each 64-byte line's first eight bytes, as the C loop adds them."""
    words = memory.view(torch.int64)[::8]
    return sum(int(w) for w in words.tolist()) % (1 << 64)


@pytest.mark.parametrize("by_head", [False, True])
@pytest.mark.parametrize("ahead", [0, 5, 256, 10_000])
def test_every_order_reads_each_line_once(by_head, ahead):
    generator = torch.Generator().manual_seed(1)
    memory = torch.randint(0, 256, (64 * BLOCK,), dtype=torch.uint8, generator=generator)
    order = torch.randperm(64, generator=generator)
    lib = cpu_read_order.build()
    got = cpu_read_order.read_lines(lib, memory, order, block_bytes=BLOCK, slot_bytes=SLOT, head_bytes=HEAD,
                                    by_head=by_head, ahead=ahead)
    assert got == first_words_sum(memory)
    # Half the blocks: only they are read (the sum tells a block read twice or left out).
    half = order[:32].contiguous()
    got = cpu_read_order.read_lines(lib, memory, half, block_bytes=BLOCK, slot_bytes=SLOT, head_bytes=HEAD,
                                    by_head=by_head, ahead=ahead)
    blocks = memory.view(64, BLOCK)[half]
    assert got == first_words_sum(blocks.reshape(-1))


@pytest.mark.parametrize("shape", [dict(block_bytes=8192, slot_bytes=512, head_bytes=96),
                                   dict(block_bytes=8192, slot_bytes=384, head_bytes=128),
                                   dict(block_bytes=8000, slot_bytes=500, head_bytes=100)])
def test_shapes_that_are_not_whole_lines_slots_and_blocks_are_refused(shape):
    with pytest.raises(SystemExit, match="whole"):
        cpu_read_order.check_shape(mib=1, **shape)


def test_one_line_per_order_and_distance_then_the_streaming_read(capsys, monkeypatch):
    monkeypatch.setattr(cpu_read_order, "memory_bandwidth_gb_s", lambda: 25.0)  # its 1 GiB read is cpu_peers'
    cpu_read_order.main(["--mib", "4", "--reps", "1", "--ahead", "0", "64"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["order"], r["prefetch_ahead_lines"]) for r in rows[:-1]] == [
        ("address", 0), ("address", 64), ("by_head", 0), ("by_head", 64)]
    assert all(r["gbps"] > 0 and r["block_bytes"] == BLOCK and "load_avg" in r for r in rows[:-1])
    assert rows[-1]["bench"] == "cpu_stream_read" and rows[-1]["gbps"] == 25.0
