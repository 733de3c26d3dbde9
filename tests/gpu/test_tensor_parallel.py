"""Tensor parallelism on the CPU (gloo): sharded ranks sample the tokens one rank samples.

Every multi-rank test records a run of hand-built plans on a tp=1 runner, with
a prefix-cache hit and a preemption in it, and replays the same plans on the
sharded ranks: rank 0 in this process with local ranks spawned, a two-"node"
torchrun launch on loopback, and the engine's child-process executor.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cadence.gpu import parallel
from cadence.gpu.config import ModelConfig, preset
from cadence.gpu.model import CausalLM
from cadence.gpu.parallel import RankGroup, decode_command, encode_command, local_config, start_local_runner
from cadence.gpu.runner import ModelRunner
from cadence.statemachine.errors import ConfigError, ExecutorError, WeightShapeError
from cadence.statemachine.plan import NewRequestData, StepPlan
from cadence.statemachine.sampling import MIN_TEMPERATURE, SamplingParams

from conftest import PlanDriver, build_hf_model, random_prompts

BLOCK_SIZE = 8
NUM_BLOCKS = 40
TIMEOUT_S = 60.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> directory: 'tied' (Qwen3: tied embeddings, q/k norm, 2 KV heads) and 'wide'
    (Llama with 4 KV heads, biases on every projection, a vocabulary of 250 that 4 does not divide)."""
    import transformers

    tied_dir = tmp_path_factory.mktemp("tp-tied")
    build_hf_model("qwen3").save_pretrained(tied_dir)
    config = transformers.LlamaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, attention_bias=True, mlp_bias=True,
    )
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).float()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator) + (param.dim() == 1))
    wide_dir = tmp_path_factory.mktemp("tp-wide")
    model.save_pretrained(wide_dir)
    return {"tied": tied_dir, "wide": wide_dir}


def drive(runner) -> tuple[list[tuple[StepPlan, dict]], list[dict]]:
    """Run a fixed scenario with a prefix-cache hit and a preemption; the plans and each step's tokens."""
    driver = PlanDriver(runner, token_budget=24)
    vocab = min(runner.vocab_size, 250)
    first, second, third = random_prompts([20, 13, 9], seed=3, vocab_size=vocab)
    driver.add("a", first, GREEDY)
    driver.add("c", third, GREEDY)
    results = [driver.step().sampled_token_ids]
    results.append(driver.step().sampled_token_ids)
    # "b" shares the first two full blocks of "a": they are prefix-cache hits.
    driver.add("b", first[:16] + second, GREEDY, share_prefix_of="a", num_cached_tokens=16)
    results.append(driver.step().sampled_token_ids)
    driver.preempt("c")
    while driver.waiting or driver.running:
        results.append(driver.step().sampled_token_ids)
    assert driver.requests["b"].cached_prefix is not None
    sampling = []
    for plan in driver.plans:
        sampling.append({r.request_id: driver.requests[r.request_id].params for r in plan.new_requests})
    return list(zip(driver.plans, sampling)), results


def spec(directory) -> dict:
    """The runner options every rank gets."""
    return {"model": str(directory), "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "device": "cpu",
            "dtype": "float32"}


# The unsharded runner the shards are compared with: the same dtype, and torch's plain
# products, as a shard computes its own (each rank reduces inside its modules).
SINGLE = dict(device="cpu", dtype="float32", cpu_path="eager")


@pytest.fixture(scope="module")
def reference(checkpoints):
    """name -> (plans, per-step tokens) of the tp=1 runner."""
    return {name: drive(ModelRunner.from_pretrained(d, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **SINGLE))
            for name, d in checkpoints.items()}


@pytest.fixture
def one_thread():
    """Keep this process to one torch thread while ranks share two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def local_group():
    """Factory for rank 0 of a local group; closes it (and reaps its ranks) after the test."""
    runners = []

    def start(tp: int, directory, **kwargs):
        runner = start_local_runner(tp, spec(directory), timeout_s=TIMEOUT_S, num_threads=1, **kwargs)
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        runner.close()


def test_local_config_splits_heads_mlp_and_vocabulary():
    config = attrs_evolve(preset("tiny"), vocab_size=511)
    shard = local_config(config, 2)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size, shard.vocab_size) == (2, 1, 64, 256)
    with pytest.raises(ConfigError, match=r"tp=4 must divide num_kv_heads \(2\).*\[1, 2\]"):
        local_config(config, 4)
    with pytest.raises(ConfigError, match="tp=3 must divide num_heads"):
        local_config(config, 3)


def attrs_evolve(config: ModelConfig, **changes) -> ModelConfig:
    """A copy of `config` with `changes`."""
    import attrs

    return attrs.evolve(config, **changes)


def test_start_local_runner_rejects_an_unsplittable_model_before_spawning():
    with pytest.raises(ConfigError, match="tp=3 must divide num_heads"):
        start_local_runner(3, {"model": "tiny", "num_blocks": 4, "device": "cpu"})
    assert not torch.distributed.is_initialized()


def test_commands_round_trip_through_msgpack():
    params = SamplingParams(temperature=0.7, top_k=5, stop=("x",), stop_token_ids=(4, 5), seed=3, logprobs=2)
    plan = StepPlan(7, {"a": 3, "b": 1}, 4, [NewRequestData("a", [1, 2, 3], 3, [0], 0, True)],
                    {"b": [4]}, ["c"], ["d"], ["a"])
    op, decoded, sampling = decode_command(encode_command("step", plan, {"a": params}))
    assert (op, decoded, sampling) == ("step", plan, {"a": params})
    assert decode_command(encode_command("stop")) == ("stop", None, {})


_ids = st.text(min_size=1, max_size=8)
_tokens = st.lists(st.integers(0, 2**31), max_size=6)
_params = st.builds(SamplingParams, temperature=st.just(0.0) | st.floats(MIN_TEMPERATURE, 2.0), top_k=st.integers(0, 50),
                    seed=st.none() | st.integers(0, 2**63 - 1), stop=st.lists(st.text(min_size=1, max_size=3), max_size=2),
                    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3), logprobs=st.none() | st.integers(0, 5))
_plans = st.builds(
    StepPlan, step_id=st.integers(0, 2**40), num_scheduled_tokens=st.dictionaries(_ids, st.integers(1, 99)),
    total_num_scheduled_tokens=st.integers(0, 999),
    new_requests=st.lists(st.builds(NewRequestData, _ids, _tokens, st.integers(0, 9), _tokens,
                                    st.integers(0, 9), st.booleans()), max_size=3),
    new_block_ids=st.dictionaries(_ids, _tokens), preempted_ids=st.lists(_ids, max_size=2),
    finished_ids=st.lists(_ids, max_size=2), resumed_ids=st.lists(_ids, max_size=2),
)


@given(plan=_plans, sampling=st.dictionaries(_ids, _params, max_size=3))
def test_any_plan_survives_the_broadcast_encoding(plan, sampling):
    assert decode_command(encode_command("step", plan, sampling)) == ("step", plan, sampling)


def test_shards_read_their_slice_and_pad_the_vocabulary():
    full = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)
    last = RankGroup(rank=3, world_size=4, device=torch.device("cpu"))
    part = parallel._read_shard("model.embed_tokens.weight", full, torch.empty(3, 4), last, "test")
    assert torch.equal(part, torch.cat([full[9:], torch.zeros(2, 4)]))
    columns = parallel._read_shard("x.o_proj.weight", full, torch.empty(10, 1), last, "test")
    assert torch.equal(columns, full[:, 3:])
    assert torch.equal(parallel._read_shard("x.o_proj.bias", full[0], torch.empty(4), last, "test"), torch.zeros(4))
    with pytest.raises(WeightShapeError, match="does not split into 4 shards"):
        parallel._read_shard("x.q_proj.weight", full, torch.empty(2, 4), last, "test")


@pytest.mark.parametrize("name, tp", [("tied", 2), ("wide", 4)])
def test_sharded_ranks_sample_the_tokens_of_one_rank(checkpoints, reference, local_group, one_thread, name, tp):
    plans, expected = reference[name]
    runner = local_group(tp, checkpoints[name])
    assert runner.kv_caches[0][0].shape[-2] == runner.config.num_kv_heads // tp
    got = [runner.execute(plan, sampling).sampled_token_ids for plan, sampling in plans]
    assert got == expected
    assert sum(len(tokens) for tokens in got) > len(plans)  # every request produced tokens


def _prompt_scores(runner, prompt: list[int]) -> dict[int, list]:
    """Prompt logprobs by position, the prompt computed in chunks of 5 tokens."""
    driver = PlanDriver(runner, token_budget=5)
    driver.add("a", prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3))
    scores: dict[int, list] = {}
    while driver.waiting or driver.running:
        driver.step()
        for first, entries in runner.take_prompt_logprobs().values():
            scores.update((first + i, entry) for i, entry in enumerate(entries))
    return scores


def test_sharded_ranks_score_prompts_as_one_rank(checkpoints, local_group, one_thread):
    [prompt] = random_prompts([13], seed=7, vocab_size=250)
    one = _prompt_scores(ModelRunner.from_pretrained(checkpoints["wide"], num_blocks=NUM_BLOCKS,
                                                     block_size=BLOCK_SIZE, **SINGLE), prompt)
    sharded = _prompt_scores(local_group(2, checkpoints["wide"]), prompt)
    assert sorted(one) == sorted(sharded) == list(range(1, len(prompt)))
    for position, entry in one.items():
        assert [t for t, _ in sharded[position]] == [t for t, _ in entry]
        torch.testing.assert_close(torch.tensor([lp for _, lp in sharded[position]]),
                                   torch.tensor([lp for _, lp in entry]), atol=1e-4, rtol=0)


def test_random_weights_shard_the_same_model(one_thread):
    config = preset("tiny")
    single = ModelRunner(config, num_blocks=8, block_size=BLOCK_SIZE, seed=5, **SINGLE)
    runner = start_local_runner(2, {"model": "tiny", "num_blocks": 8, "block_size": BLOCK_SIZE, "device": "cpu",
                                    "dtype": "float32", "seed": 5}, timeout_s=TIMEOUT_S, num_threads=1)
    try:
        plan = StepPlan(0, {"a": 11}, 11, [NewRequestData("a", list(range(3, 14)), 11, [0, 1], 0)], {}, [], [], [])
        sampling = {"a": SamplingParams(temperature=0.0)}
        assert runner.execute(plan, sampling).sampled_token_ids == single.execute(plan, sampling).sampled_token_ids
    finally:
        runner.close()


def test_a_killed_rank_fails_the_step_naming_it(checkpoints, reference, local_group, one_thread):
    plans, _ = reference["tied"]
    runner = local_group(2, checkpoints["tied"])
    runner.execute(*plans[0])
    runner.processes[1].kill()
    with pytest.raises(ExecutorError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        runner.execute(*plans[1])
    with pytest.raises(ExecutorError):
        runner.execute(*plans[2])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_launched_by_torchrun_sample_the_same_tokens(checkpoints, reference, tmp_path):
    pytest.importorskip("torch.distributed.run", reason="torchrun is not available")
    plans, expected = reference["wide"]
    commands = tmp_path / "plans.msgpack"
    commands.write_bytes(msgpack.packb([encode_command("step", plan, s) for plan, s in plans]))
    out = tmp_path / "tokens.jsonl"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    launches = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "-m", "cadence.gpu.tp_worker", "--spec", json.dumps(spec(checkpoints["wide"])),
             "--timeout-s", str(TIMEOUT_S), "--num-threads", "1", "--replay", str(commands), "--out", str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    logs = []
    for launch in launches:
        try:
            logs.append(launch.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for other in launches:
                other.kill()
            raise
    assert [launch.returncode for launch in launches] == [0, 0], "\n".join(logs)[-4000:]
    got = [json.loads(line)["sampled"] for line in out.read_text().splitlines()]
    assert got == expected


def _children(pid: int) -> list[int]:
    """Process ids of `pid`'s children (Linux)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_child_process_executor_runs_and_restarts_tp_ranks(checkpoints, reference):
    import trio

    from cadence.actors.executors import ChildProcessExecutor
    from cadence.actors.messages import ExecuteStep, InitExecutor

    plans, expected = reference["tied"]
    executor = ChildProcessExecutor()
    init = InitExecutor(model=str(checkpoints["tied"]), dtype="float32", device="cpu", num_blocks=NUM_BLOCKS,
                        block_size=BLOCK_SIZE, max_model_len=256, max_num_batched_tokens=64, seed=0,
                        options={"tp": 2, "tp_num_threads": 1, "tp_timeout_s": TIMEOUT_S})
    try:
        ready = await executor.start(init)
        assert ready.num_blocks == NUM_BLOCKS
        got = [(await executor.execute(ExecuteStep(plan, sampling))).result.sampled_token_ids
               for plan, sampling in plans]
        assert got == expected
        # A restart (what supervision does after a failure) builds a fresh group.
        await executor.start(init)
        assert (await executor.execute(ExecuteStep(*plans[0]))).result.sampled_token_ids == expected[0]
        ranks = _children(executor.pid)
        assert len(ranks) == 1
        await executor.kill()
        # The spawned rank dies with its rank 0 rather than lingering.
        with trio.fail_after(TIMEOUT_S):
            while _alive(ranks[0]):
                await trio.sleep(0.05)
    finally:
        await executor.aclose()
