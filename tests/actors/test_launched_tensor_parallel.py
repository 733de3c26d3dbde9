"""`cadence serve` under a launcher: torchrun starts the ranks (here as two
"nodes" on loopback), rank 0 serves clients and drives the other rank's shard.
Greedy tokens must equal a single-rank engine's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import trio

from cadence.actors import EngineConfig, SamplingParams, open_engine
from cadence.actors.client import Client

pytest.importorskip("torch.distributed.run", reason="torchrun is not available")
transformers = pytest.importorskip("transformers", reason="transformers builds the test checkpoint")

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42]]
MAX_TOKENS = 8
START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    directory = tmp_path_factory.mktemp("tp-checkpoint")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def _single_rank_tokens(model: str) -> list[list[int]]:
    async def run() -> list[list[int]]:
        config = EngineConfig.from_kwargs(executor="inprocess", model=model, device="cpu",
                                          num_blocks=64, max_model_len=128)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        async with open_engine(config) as engine:
            return [(await engine.generate(p, params).collect()).token_ids for p in PROMPTS]
    return trio.run(run)


def _wait_for_port(port: int, launches: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(launch.poll() is not None for launch in launches):
            raise AssertionError("a launcher exited before the server listened")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"no server on port {port} after {START_TIMEOUT_S} s")


def _child_pid(pid: int) -> int:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(child) for child in f.read().split()]
    assert len(children) == 1, children
    return children[0]


def test_serve_under_torchrun_across_two_nodes_matches_one_rank(checkpoint):
    expected = _single_rank_tokens(checkpoint)
    port, rendezvous = _free_port(), _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    launches = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(rendezvous),
             "-m", "cadence.actors.cli", "serve", "--model", checkpoint, "--device", "cpu",
             "--port", str(port), "--num-blocks", "64", "--max-model-len", "128"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]
    try:
        _wait_for_port(port, launches)
        with Client.connect(("127.0.0.1", port), timeout_s=60) as client:
            got = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                   .collect().token_ids for p in PROMPTS]
        assert got == expected
        # Stop the rank-0 server itself (the launcher's child): it drains, closes the
        # executor, which stops the follower, and both launchers end cleanly.
        os.kill(_child_pid(launches[0].pid), signal.SIGTERM)
        logs = [launch.communicate(timeout=60)[0] for launch in launches]
        codes = [launch.returncode for launch in launches]
        assert codes == [0, 0], f"{codes}\n" + "\n".join(log[-2000:] for log in logs)
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
                launch.communicate()
