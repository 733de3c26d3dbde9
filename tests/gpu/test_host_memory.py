"""The CPU runner's host memory: the KV blocks faulted in at start, and freed tensors kept for reuse."""

from __future__ import annotations

import ctypes
import os
import resource
import sys

import attrs
import pytest
import torch

from cadence.actors.engine import EngineConfig, _executor_options
from cadence.gpu import host_memory
from cadence.gpu.config import preset
from cadence.gpu.runner import ModelRunner, zeroed_cpu_tensor
from cadence.statemachine.config import CacheConfig, SchedulerConfig
from cadence.statemachine.errors import ConfigError

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page faults counted on Linux only")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _faults_writing(address: int, length: int) -> int:
    """Minor page faults this thread takes writing `length` bytes at `address`. The
    measuring calls run once before on no bytes: cold, in a process whose heap was just
    trimmed, they fault in pages of their own (11 seen after the server tests)."""
    ctypes.memset(address, 1, 0)
    resource.getrusage(resource.RUSAGE_THREAD)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    ctypes.memset(address, 1, length)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


# What malloc does with freed memory depends on the whole process's history (a heap
# that cannot grow in place, other threads' trims): measured in a fresh interpreter.
_MALLOC_PROBE = """
import ctypes, json, resource, sys
import torch
from cadence.gpu import host_memory

def faults(size):
    tensor = torch.empty(size, dtype=torch.uint8)
    ctypes.memset(tensor.data_ptr(), 1, 0)
    resource.getrusage(resource.RUSAGE_THREAD)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    ctypes.memset(tensor.data_ptr(), 1, size)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

if not host_memory.keep_freed_memory():
    print(json.dumps(None))
    sys.exit()
out = []
for step in sys.argv[1:]:
    out.append(host_memory.release_free_memory() if step == "release" else faults(int(step) << 20))
print(json.dumps(out))
"""


def _malloc_probe(*steps: str) -> list:
    """In a fresh interpreter with malloc keeping freed memory: for each step, the
    faults writing a new tensor of that many MiB, or ("release") what
    `release_free_memory` answered; skips where malloc cannot keep freed memory."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in host_memory.USER_SETTINGS}
    done = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, *steps], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    out = json.loads(done.stdout)
    if out is None:
        pytest.skip("not glibc's malloc")
    return out


@linux_only
def test_prefault_faults_in_exactly_the_first_blocks_of_every_slab():
    # 3 layers, K and V, 64 blocks of 16 KiB each: four pages a block.
    cache = zeroed_cpu_tensor((3, 2, 64, 16, 4, 64), torch.float32)
    # 4 KiB pages even where transparent huge pages are "always": one fault a page.
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise(cache.data_ptr(), cache.numel() * cache.element_size(), 15)  # MADV_NOHUGEPAGE
    slabs = [cache[layer, kv] for layer in range(3) for kv in range(2)]
    block_bytes = slabs[0].stride(0) * slabs[0].element_size()
    done = host_memory.prefault(slabs, 24)
    if done == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+): blocks fault on first use")
    assert done == 6 * 24 * block_bytes
    for slab in slabs:
        pages = 24 * block_bytes // PAGE
        assert _faults_writing(slab.data_ptr(), 24 * block_bytes) <= pages // 20
        # The blocks past the bound were left alone: they fault when first written.
        assert _faults_writing(slab.data_ptr() + 24 * block_bytes, 16 * block_bytes) >= 16 * block_bytes // PAGE * 9 // 10


def test_prefault_keeps_what_the_blocks_hold():
    cache = zeroed_cpu_tensor((1, 2, 8, 16, 2, 32), torch.float32)
    slabs = [cache[0, 0], cache[0, 1]]
    slabs[0][:3].normal_()
    slabs[1][5].fill_(7.0)
    before = [slab.clone() for slab in slabs]
    host_memory.prefault(slabs, 8)
    assert all(torch.equal(a, b) for a, b in zip(slabs, before))


def test_prefault_of_no_blocks_does_nothing():
    cache = zeroed_cpu_tensor((1, 2, 4, 16, 1, 32), torch.float32)
    assert host_memory.prefault([cache[0, 0], cache[0, 1]], 0) == 0


@linux_only
def test_freed_tensors_are_reused_without_faults_once_kept():
    # Both past glibc's largest automatic mmap threshold (32 MiB): by default each is
    # mapped afresh and unmapped when freed, so the second faults in all its 16,384 pages.
    _, reused = _malloc_probe("96", "64")
    assert reused <= (64 << 20) // PAGE // 20


@linux_only
def test_released_memory_goes_back_to_the_kernel():
    """Kept freed memory is reused without faults; after `release_free_memory` (the
    runner calls it once the model is built) the same request faults its pages in
    afresh: they went back to the kernel."""
    pages = (48 << 20) // PAGE
    # 96 first, larger: a freed block serves a later one of its own size only just not.
    _, kept, released, afresh = _malloc_probe("96", "48", "release", "48")
    assert kept <= pages // 20
    assert released is True
    assert afresh >= pages // 2


def test_the_users_malloc_settings_are_left_alone(monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(host_memory, "_kept", None)
    monkeypatch.setattr(host_memory, "_libc", lambda: Libc())
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert host_memory.keep_freed_memory() is False
    assert calls == []
    monkeypatch.setattr(host_memory, "_kept", None)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    for name in host_memory.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert host_memory.keep_freed_memory() is True
    assert calls == [(host_memory.M_MMAP_THRESHOLD, host_memory.MMAP_THRESHOLD),
                     (host_memory.M_TRIM_THRESHOLD, host_memory.TRIM_THRESHOLD)]


def _prefaulted(monkeypatch, **kwargs) -> int:
    asked = []
    monkeypatch.setattr(host_memory, "prefault", lambda slabs, n: asked.append((len(slabs), n)) or 0)
    ModelRunner(preset("tiny"), device="cpu", **kwargs)
    (num_slabs, num_blocks), = asked
    assert num_slabs == 2 * preset("tiny").num_layers
    return num_blocks


def test_the_runner_faults_in_what_its_sequences_can_hold(monkeypatch):
    # 4 sequences of 64 positions in blocks of 16: 16 blocks of the 100.
    assert _prefaulted(monkeypatch, num_blocks=100, max_num_seqs=4, max_model_len=64) == 16
    assert _prefaulted(monkeypatch, num_blocks=10, max_num_seqs=4, max_model_len=64) == 10
    assert _prefaulted(monkeypatch, num_blocks=100, max_num_seqs=4, max_model_len=64, prefault_blocks=7) == 7
    assert _prefaulted(monkeypatch, num_blocks=100, prefault_blocks=0) == 0
    with pytest.raises(ConfigError, match="prefault_blocks"):
        ModelRunner(preset("tiny"), num_blocks=4, device="cpu", prefault_blocks=-1)


def test_the_runner_faults_in_no_more_than_its_weights_take(monkeypatch):
    plain = ModelRunner(preset("tiny"), num_blocks=1, device="cpu", cpu_path="eager")  # weights unpacked
    weight_bytes = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    block_bytes = plain.kv_block_bytes()
    assert weight_bytes // block_bytes < 1000
    assert _prefaulted(monkeypatch, num_blocks=1000, prefault_blocks=1000) == weight_bytes // block_bytes


def test_the_runner_never_faults_in_more_than_the_cap(monkeypatch):
    monkeypatch.setattr(host_memory, "PREFAULT_MAX_BYTES", 0)
    assert _prefaulted(monkeypatch, num_blocks=100, max_num_seqs=4, max_model_len=64) == 0


def test_the_engine_asks_for_the_blocks_its_scheduler_can_run():
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=100),
                          cache=CacheConfig(num_blocks=1000, block_size=16))
    assert _executor_options(config)["prefault_blocks"] == 8 * 7  # ceil(100 / 16) blocks a sequence
    small = attrs.evolve(config, cache=CacheConfig(num_blocks=20, block_size=16))
    assert _executor_options(small)["prefault_blocks"] == 20
    given = attrs.evolve(config, executor_options={"prefault_blocks": 3})
    assert _executor_options(given)["prefault_blocks"] == 3


def test_the_command_line_sets_the_count_and_serve_faults_in_none():
    import argparse

    from cadence.actors.engine_args import add_engine_arguments, cpu_options
    from cadence.actors.serve.server import add_serve_parser

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert "prefault_blocks" not in cpu_options(parser.parse_args([]))
    assert cpu_options(parser.parse_args(["--prefault-blocks", "12"]))["prefault_blocks"] == 12
    with pytest.raises(ConfigError, match="--prefault-blocks"):
        cpu_options(parser.parse_args(["--prefault-blocks", "-1"]))
    commands = argparse.ArgumentParser().add_subparsers()
    serve = add_serve_parser(commands)
    assert cpu_options(serve.parse_args([]))["prefault_blocks"] == 0
    assert cpu_options(serve.parse_args(["--prefault-blocks", "40"]))["prefault_blocks"] == 40


def test_llm_takes_the_count_by_name():
    from cadence.actors.llm import engine_config_from_options

    config = engine_config_from_options(model="simulated", prefault_blocks=5)
    assert config.executor_options["prefault_blocks"] == 5
    assert _executor_options(config)["prefault_blocks"] == 5
