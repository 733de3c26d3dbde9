"""The runner's persistent batch, plan validation and construction, on a random-weight preset."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cadence.gpu import ModelRunner, preset
from cadence.gpu.attention import AttentionBackend, reference_paged_attention, write_kv
from cadence.gpu.runner import cpu_has_bfloat16_units, default_dtype
from cadence.statemachine.errors import ConfigError, ExecutorError
from cadence.statemachine.plan import NewRequestData, StepPlan
from cadence.statemachine.sampling import SamplingParams
from memory_maps import mapping_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
NUM_BLOCKS, BLOCK_SIZE = 32, 4


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(preset("tiny"), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, device="cpu")


@pytest.fixture(autouse=True)
def fresh_batch(runner):
    runner.reset()


def plan(step_id=0, scheduled=None, new=(), new_blocks=None, preempted=(), finished=()):
    scheduled = scheduled or {}
    return StepPlan(step_id, scheduled, sum(scheduled.values()), list(new), new_blocks or {},
                    list(preempted), list(finished), [r.request_id for r in new if r.resumed])


def new(request_id, tokens, blocks, num_computed=0, num_prompt=None):
    return NewRequestData(request_id, list(tokens), num_prompt or len(tokens), list(blocks), num_computed)


def test_partial_prefill_samples_nothing_and_results_follow_plan_order(runner):
    first = runner.execute(
        plan(0, {"a": 3, "b": 2}, [new("a", range(3, 9), [0, 1]), new("b", [5, 6], [2])]),
        {"a": GREEDY, "b": GREEDY},
    )
    assert list(first.sampled_token_ids) == ["b"]
    second = runner.execute(plan(1, {"b": 1, "a": 3}), {})
    assert list(second.sampled_token_ids) == ["b", "a"]
    assert second.logprobs is None and second.execute_us > 0


def test_decodes_come_first_in_the_attention_metadata(runner):
    seen = []

    def spy(query, k_cache, v_cache, meta, scale):
        seen.append(meta)
        return reference_paged_attention(query, k_cache, v_cache, meta, scale)

    original = [layer.self_attn.backend for layer in runner.model.model.layers]
    for layer in runner.model.model.layers:
        layer.self_attn.backend = AttentionBackend("spy", spy, write_kv)
    try:
        runner.execute(plan(0, {"a": 2}, [new("a", [3, 4], [0])]), {"a": GREEDY})
        runner.execute(plan(1, {"b": 5, "a": 1}, [new("b", range(10, 15), [1, 2])]), {"b": GREEDY})
    finally:
        for layer, backend in zip(runner.model.model.layers, original):
            layer.self_attn.backend = backend
    meta = seen[-len(runner.model.model.layers)]  # the step's first layer
    assert meta.num_decode_seqs == 1
    assert meta.query_start_loc.tolist() == [0, 1, 6] and meta.seq_lens.tolist() == [3, 5]
    # The last layer attends for the sampling rows only, each a one-token query over
    # its whole context.
    last = seen[-1]
    assert last.num_decode_seqs == 2 and last.max_query_len == 1
    assert last.query_start_loc.tolist() == [0, 1, 2] and last.seq_lens.tolist() == [3, 5]


def test_a_step_of_single_tokens_is_laid_out_as_the_general_path_lays_it_out(runner):
    """A step where every sequence brings one token takes a shortcut (slots read from the
    requests' block lists in Python): its inputs are those of the flattening any step
    takes, read from the host block table."""
    runner.execute(plan(0, {"a": 6, "b": 2, "c": 5},
                        [new("a", range(3, 9), [7, 2]), new("b", [5, 6], [9]), new("c", range(20, 25), [4, 11])]),
                   {"a": GREEDY, "b": GREEDY, "c": GREEDY})
    scheduled = [(runner._requests[r], 1) for r in ("c", "a", "b")]
    fast = runner._host_batch(scheduled)
    starts = [state.num_computed_tokens for state, _ in scheduled]
    assert starts == [5, 6, 2]
    # The general flattening, by its definitions.
    rows = torch.tensor([state.row for state, _ in scheduled])
    width = -(-(max(starts) + 1) // BLOCK_SIZE)
    tables = runner._block_table[:, :width].index_select(0, rows)
    positions = torch.tensor(starts)
    slots = tables[torch.arange(3), positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    assert slots.tolist() == [11 * 4 + 1, 2 * 4 + 2, 9 * 4 + 2]  # c's 6th, a's 7th, b's 3rd position
    assert fast.input_ids.tolist() == [state.token_ids[c] for (state, _), c in zip(scheduled, starts)]
    for got, want in ((fast.positions, positions), (fast.slot_mapping, slots),
                      (fast.query_start_loc, torch.arange(4, dtype=torch.int32)),
                      (fast.seq_lens, (positions + 1).to(torch.int32)), (fast.block_tables, tables)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert (fast.max_query_len, fast.max_seq_len, fast.num_decode_seqs) == (1, 7, 3)
    # And the step runs on it: each request samples its next token.
    result = runner.execute(plan(1, {"c": 1, "a": 1, "b": 1}), {})
    assert sorted(result.sampled_token_ids) == ["a", "b", "c"]


def test_random_weights_are_seeded():
    def first_token(seed):
        r = ModelRunner(preset("tiny"), num_blocks=4, block_size=BLOCK_SIZE, device="cpu", seed=seed)
        return r.execute(plan(0, {"a": 4}, [new("a", [5, 6, 7, 8], [0])]), {"a": GREEDY}).sampled_token_ids
    assert first_token(1) == first_token(1)
    r1 = ModelRunner(preset("tiny"), num_blocks=4, device="cpu", seed=1)
    r2 = ModelRunner(preset("tiny"), num_blocks=4, device="cpu", seed=2)
    assert not torch.equal(r1.model.model.embed_tokens.weight, r2.model.model.embed_tokens.weight)


def test_finished_and_preempted_requests_leave_the_batch(runner):
    runner.execute(plan(0, {"a": 2, "b": 2}, [new("a", [3, 4], [0]), new("b", [3, 4], [1])]),
                   {"a": GREEDY, "b": GREEDY})
    assert runner.num_requests == 2
    runner.execute(plan(1, finished=["a"], preempted=["b"]), {})
    assert runner.num_requests == 0
    with pytest.raises(ExecutorError, match="request 'a' is not in the executor's batch"):
        runner.execute(plan(2, {"a": 1}), {})


def test_reset_forgets_every_request(runner):
    runner.execute(plan(0, {"a": 2}, [new("a", [3, 4], [0])]), {"a": GREEDY})
    runner.reset()
    assert runner.num_requests == 0


def test_resumed_request_replaces_its_old_entry(runner):
    runner.execute(plan(0, {"a": 2}, [new("a", [3, 4], [0])]), {"a": GREEDY})
    tokens = [3, 4, 9, 9, 9]
    result = runner.execute(plan(1, {"a": 5}, [new("a", tokens, [2, 3], num_prompt=2)]), {"a": GREEDY})
    assert list(result.sampled_token_ids) == ["a"]


@pytest.mark.parametrize(
    "bad_plan, params, match",
    [
        (plan(0, {"a": 2}, [new("a", [3, 4], [0])]), {}, "no SamplingParams for new request 'a'"),
        (plan(0, {"a": 3}, [new("a", [3, 4], [0])]), {"a": GREEDY}, "scheduled 3 tokens from 0 but knows only 2"),
        (plan(0, {"a": 5}, [new("a", range(3, 8), [0])]), {"a": GREEDY}, "needs 2 blocks for 5 tokens, has 1"),
        (plan(0, {"a": 2}, [new("a", [3, 4], [NUM_BLOCKS])]), {"a": GREEDY}, r"block ids \[32\] outside"),
        (plan(0, {"a": 1}, [new("a", [3, 4], [0], num_computed=3)]), {"a": GREEDY}, "num_computed_tokens 3"),
        (plan(0, new_blocks={"z": [1]}), {}, "request 'z' is not in the executor's batch"),
    ],
)
def test_inconsistent_plans_raise_executor_errors(runner, bad_plan, params, match):
    with pytest.raises(ExecutorError, match=match):
        runner.execute(bad_plan, params)


def test_total_token_count_is_checked(runner):
    bad = plan(0, {"a": 2}, [new("a", [3, 4], [0])])
    bad.total_num_scheduled_tokens = 3
    with pytest.raises(ExecutorError, match="total_num_scheduled_tokens is 3"):
        runner.execute(bad, {"a": GREEDY})


def test_construction_errors():
    with pytest.raises(ConfigError, match="num_blocks is required on CPU"):
        ModelRunner(preset("tiny"), device="cpu")
    expected = torch.bfloat16 if cpu_has_bfloat16_units() else torch.float32
    assert ModelRunner(preset("tiny"), num_blocks=1, device="cpu", dtype="auto").dtype == expected
    with pytest.raises(ConfigError, match="dtype must be 'auto' or one of"):
        ModelRunner(preset("tiny"), num_blocks=4, device="cpu", dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            ModelRunner(preset("tiny"), num_blocks=4, device="cuda")


def test_bfloat16_runs_and_reports_cache_size():
    runner = ModelRunner(preset("tiny"), num_blocks=8, block_size=BLOCK_SIZE, device="cpu", dtype="bf16")
    assert runner.vocab_size == 512 and runner.eos_token_ids == [2]
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.kv_block_bytes() == 2 * 2 * BLOCK_SIZE * 2 * 16 * 2
    sampling = SamplingParams(temperature=0.9, top_k=20, logprobs=2, seed=3, repetition_penalty=1.2)
    result = runner.execute(plan(0, {"a": 6}, [new("a", range(3, 9), [0, 1])]), {"a": sampling})
    assert len(result.sampled_token_ids["a"]) == 1 and len(result.logprobs["a"][0]) == 3


TRITON_SCRIPT = """
from cadence.gpu import ModelRunner, preset
from cadence.statemachine.plan import NewRequestData, StepPlan
from cadence.statemachine.sampling import SamplingParams

params = SamplingParams(temperature=0.0, logprobs=1)

def run(backend):
    r = ModelRunner(preset("tiny"), num_blocks=16, block_size=4, device="cpu", dtype="float32",
                    attention_backend=backend)
    new = [NewRequestData("a", list(range(3, 10)), 7, [0, 1], 0), NewRequestData("b", [5, 6, 7], 3, [2], 0)]
    results = [r.execute(StepPlan(0, {"a": 7, "b": 3}, 10, new, {}, [], [], []), {"a": params, "b": params})]
    for step, blocks in [(1, {"b": [4]}), (2, {"a": [3]}), (3, {})]:
        results.append(r.execute(StepPlan(step, {"a": 1, "b": 1}, 2, [], blocks, [], [], []), {}))
    return results

for x, y in zip(run("reference"), run("triton")):
    assert x.sampled_token_ids == y.sampled_token_ids, (x, y)
    for rid in x.logprobs:
        assert abs(x.logprobs[rid][0][0][1] - y.logprobs[rid][0][0][1]) < 1e-4
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="test_cuda.py runs the compiled kernels")
@pytest.mark.timeout(900)  # the interpreter's run is allowed 600 s
def test_triton_backend_plugs_in_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


# ---- faults that follow one request stay with it: the runner reports the request and
# serves the rest of the batch (requests that once failed whole steps)


def first_step(runner, prompts: dict[str, list[int]], params: dict[str, SamplingParams]):
    """Admit `prompts` in one step; the failures the runner reports are left for take_failed."""
    runner.take_failed()
    news, block = [], 0
    for rid, tokens in prompts.items():
        blocks = list(range(block, block + -(-len(tokens) // BLOCK_SIZE)))
        block += len(blocks)
        news.append(new(rid, tokens, blocks))
    return runner.execute(plan(scheduled={rid: len(t) for rid, t in prompts.items()}, new=news), params)


def past_the_door(**fields) -> SamplingParams:
    """Parameters that SamplingParams and the engine's door refuse, forced through to
    test the runner's own defence (a client of the runner need not use either)."""
    params = SamplingParams(temperature=1.0)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize(("poison", "why"), [
    (dict(top_k=2**63), "sampling failed"),
    # Refused before the device sees it: on a GPU the bad index would fault the device.
    (dict(temperature=0.0, min_tokens=2, stop_token_ids=(100_000,)), "outside the model's vocabulary"),
], ids=["top_k_2_63", "stop_token_out_of_vocab"])
def test_a_request_whose_sampling_fails_is_reported_and_the_others_sample(runner, poison, why):
    poison = past_the_door(**poison)
    prompts = {"good": [1, 2, 3], "bad": [4, 5, 6], "also-good": [7, 8]}
    params = {"good": GREEDY, "bad": poison, "also-good": GREEDY}
    result = first_step(runner, prompts, params)
    failed = runner.take_failed()
    assert list(failed) == ["bad"] and why in failed["bad"]
    assert set(result.sampled_token_ids) == {"good", "also-good"}
    assert runner.num_requests == 2  # the failed request left the batch
    alone = {}
    for rid in ("good", "also-good"):
        runner.reset()
        alone[rid] = first_step(runner, {rid: prompts[rid]}, {rid: GREEDY}).sampled_token_ids[rid]
    assert {rid: result.sampled_token_ids[rid] for rid in alone} == alone


def test_a_prompt_token_outside_the_vocabulary_is_refused_before_the_forward_pass(runner):
    vocab = runner.vocab_size
    result = first_step(runner, {"ok": [1, 2], "foreign": [3, vocab + 5]}, {"ok": GREEDY, "foreign": GREEDY})
    failed = runner.take_failed()
    assert list(failed) == ["foreign"] and str(vocab + 5) in failed["foreign"]
    assert list(result.sampled_token_ids) == ["ok"]


def test_a_failed_request_in_a_plan_made_before_its_failure_is_answered_the_same_way(runner):
    """Async scheduling hands the runner step N+1 before N's answer: N+1 may schedule
    (and give blocks to) a request N failed. It is reported again, not a protocol error,
    until a plan names it finished."""
    poison = past_the_door(top_k=2**63)
    first_step(runner, {"good": [1, 2, 3], "bad": [4, 5, 6]}, {"good": GREEDY, "bad": poison})
    assert list(runner.take_failed()) == ["bad"]
    result = runner.execute(plan(1, scheduled={"good": 1, "bad": 1}, new_blocks={"bad": [9]}), {})
    assert list(runner.take_failed()) == ["bad"] and list(result.sampled_token_ids) == ["good"]
    runner.execute(plan(2, scheduled={"good": 1}, new_blocks={"good": [8]}, finished=["bad"]), {})
    with pytest.raises(ExecutorError, match="not in the executor's batch"):
        runner.execute(plan(3, scheduled={"good": 1, "bad": 1}), {})


def test_a_sampling_fault_of_every_row_fails_the_step(runner):
    """When no row samples alone, the fault is not any one request's: the step raises."""
    bad = past_the_door(top_k=2**63)
    with pytest.raises(ValueError, match="Overflow"):
        first_step(runner, {"a": [1, 2], "b": [3, 4]}, {"a": bad, "b": bad})
    assert runner.take_failed() == {}


def test_cpu_cache_starts_zeroed_and_each_layer_writes_its_own_memory():
    from cadence.gpu.runner import zeroed_cpu_tensor

    cache = zeroed_cpu_tensor((2, 3, 4), torch.bfloat16)
    assert cache.shape == (2, 3, 4) and cache.dtype == torch.bfloat16 and not cache.any()
    fresh = ModelRunner(preset("tiny"), num_blocks=4, block_size=BLOCK_SIZE, device="cpu")
    assert all(not k.any() and not v.any() for k, v in fresh.kv_caches)
    fresh.kv_caches[0][0].fill_(1.0)
    assert not fresh.kv_caches[0][1].any() and not fresh.kv_caches[1][0].any()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_cpu_cache_memory_is_private_and_asks_for_huge_pages_only_when_told():
    from cadence.gpu.runner import zeroed_cpu_tensor

    # Private (not shmem, where madvise cannot give huge pages), and advised only when asked:
    # the runner's KV cache is not (a huge page's first touch can cost 18x a small page's).
    huge = zeroed_cpu_tensor((4, 1 << 20), torch.float32, huge_pages=True)
    plain = zeroed_cpu_tensor((4, 1 << 20), torch.float32)
    for tensor, advised in ((huge, True), (plain, False)):
        tensor[1, 7] = 3.0
        perms, flags, _ = mapping_of(tensor.data_ptr())
        assert perms.endswith("p") and "sh" not in flags
        assert ("hg" in flags) == advised
        assert tensor.sum().item() == 3.0
    runner = ModelRunner(preset("tiny"), num_blocks=4, block_size=BLOCK_SIZE, device="cpu")
    perms, flags, _ = mapping_of(runner.kv_caches[0][0].data_ptr())
    assert perms.endswith("p") and "hg" not in flags


def test_cpu_runs_its_decode_kernel_and_packed_products_by_default(monkeypatch):
    from cadence.gpu import runner as runner_module

    from cadence.gpu import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "is_built", lambda: False)  # a machine that never built them
    small = ModelRunner(preset("tiny"), num_blocks=4, block_size=BLOCK_SIZE, device="cpu")
    assert small.backend.name == "sdpa" and small.cpu_path == "packed"  # no kernel build for it
    attention = small.model.model.layers[0].self_attn
    assert attention.q_proj is None and attention.qkv_proj is not None and attention.fused is None
    monkeypatch.setattr(cpu_kernels, "is_built", lambda: True)  # built once: the small model takes them
    built = ModelRunner(preset("tiny"), num_blocks=4, block_size=BLOCK_SIZE, device="cpu")
    assert built.backend.name == "cpu" and built.model.model.decode_stack is not None
    monkeypatch.setattr(runner_module, "SMALL_MODEL_MACS", 0)  # the same shape counted as large
    large = ModelRunner(preset("tiny"), num_blocks=4, block_size=BLOCK_SIZE, device="cpu")
    assert large.backend.name == "cpu" and large.model.model.layers[0].self_attn.fused is not None


def test_cpu_falls_back_to_sdpa_where_the_kernel_cannot_be_built(monkeypatch):
    from cadence.gpu import cpu_kernels

    from cadence.gpu import runner as runner_module

    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no compiler")
    monkeypatch.setattr(runner_module, "SMALL_MODEL_MACS", 0)
    fresh = ModelRunner(preset("tiny"), num_blocks=4, block_size=BLOCK_SIZE, device="cpu")
    assert fresh.backend.name == "sdpa"
    with pytest.raises(ConfigError, match="kernel could not be built .no compiler"):
        ModelRunner(preset("tiny"), num_blocks=4, block_size=BLOCK_SIZE, device="cpu", attention_backend="cpu")


def test_cpu_path_is_validated_and_eager_keeps_the_plain_projections():
    with pytest.raises(ConfigError, match="cpu_path must be one of"):
        ModelRunner(preset("tiny"), num_blocks=4, device="cpu", cpu_path="fast")
    with pytest.raises(ConfigError, match="cpu_path 'packed' needs oneDNN or this CPU's kernels, and float32 or bfloat16"):
        ModelRunner(preset("tiny"), num_blocks=4, device="cpu", dtype="float16", cpu_path="packed")
    eager = ModelRunner(preset("tiny"), num_blocks=4, device="cpu", cpu_path="eager")
    assert eager.cpu_path == "eager" and eager.model.model.layers[0].self_attn.qkv_proj is None
    assert ModelRunner(preset("tiny"), num_blocks=4, device="cpu", dtype="float16").cpu_path == "eager"


def test_auto_dtype_on_cpu_follows_the_bfloat16_units(monkeypatch):
    """bfloat16 where the CPU multiplies it in hardware (AMX or AVX-512 BF16), float32 elsewhere."""
    config = preset("tiny")
    for amx, avx512_bf16, expected in [(False, False, torch.float32), (True, False, torch.bfloat16),
                                       (False, True, torch.bfloat16)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert default_dtype(config, torch.device("cpu")) == expected
        assert ModelRunner(config, num_blocks=1, device="cpu").dtype == expected


@pytest.mark.parametrize("backend", ["reference", "sdpa", "cpu"])
@pytest.mark.parametrize("cpu_path", ["eager", "packed"])
def test_the_last_layer_cut_to_the_sampling_rows_keeps_their_values_and_every_rows_kv(backend, cpu_path):
    from cadence.gpu.model import LastRows

    runner = ModelRunner(preset("tiny"), num_blocks=16, block_size=BLOCK_SIZE, device="cpu",
                         attention_backend=backend, cpu_path=cpu_path, dtype=torch.float32, seed=3)
    # A decode over a 6-token context, a whole 7-token prompt (both sample), and the
    # first chunk of a longer prompt (samples nothing).
    inputs = runner._build_inputs([([11], 5, [0, 1]), (list(range(20, 27)), 0, [2, 3]),
                                   (list(range(40, 45)), 0, [4, 5])])
    meta = inputs.meta
    seqs = torch.tensor([0, 1])
    rows = meta.query_start_loc.long()[1:][seqs] - 1

    def forward(keep):
        for k_cache, v_cache in runner.kv_caches:
            k_cache.zero_()
            v_cache.zero_()
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, meta, keep)
        return hidden, [t.clone() for pair in runner.kv_caches for t in pair]

    full, full_kv = forward(None)
    cut, cut_kv = forward(LastRows(rows, seqs))
    assert cut.shape == (2, full.shape[1])
    torch.testing.assert_close(cut, full[rows], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(cut_kv, full_kv))
    # No row kept (a step of partial prompts): every layer's K/V still written.
    none, none_kv = forward(LastRows(rows[:0], seqs[:0]))
    assert none.shape[0] == 0
    assert all(torch.equal(a, b) for a, b in zip(none_kv, full_kv))
    assert any(t.abs().sum() > 0 for t in none_kv[-2:])  # the last layer's were written


def test_prompts_attend_a_row_at_a_time_through_the_stack_where_the_kernels_have_no_one_pass_attention():
    """With heads the vector decode kernel takes and no one-pass prompt attention (an
    AVX2 CPU), a step of prompts carries each row's own block table and context length,
    runs through the kernels' stack in one call, and gives the padded (SDPA) path's
    logits; a chunk after a long cached context keeps the padded path."""
    import attrs

    from cadence.gpu import cpu_kernels

    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    config = attrs.evolve(preset("tiny"), head_dim=32)
    runner = ModelRunner(config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, device="cpu",
                         attention_backend="cpu")
    probe = torch.empty(0, config.num_heads, config.head_dim)
    expected = kernel.has_row_attention(probe) and not kernel.has_paged_attention(probe)
    assert runner._row_attention == expected
    if not expected:
        pytest.skip("this CPU's kernels attend prompts in one pass (AVX-512) or have no vector decode kernel")
    stack = runner.model.model.decode_stack
    assert stack is not None

    class Counting:
        calls = 0

        def forward(self, *args, **kwargs):
            Counting.calls += 1
            return stack.forward(*args, **kwargs)

    logits = []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: logits.append(compute_logits(hidden)) or logits[-1]
    prompts = {"a": list(range(3, 12)), "b": list(range(40, 47))}
    step = plan(0, {"a": 9, "b": 7}, [new("a", prompts["a"], [0, 1, 2]), new("b", prompts["b"], [3, 4])])
    whole = runner._build_inputs([(prompts["a"], 0, [5, 6, 7]), ([1], 6, [8, 9])]).meta
    # The decode first, then the prompt's rows, each over its own context.
    assert whole.row_seq_lens.tolist() == [7, *range(1, 10)]
    assert whole.row_block_tables.tolist() == [[8, 9, 0]] + [[5, 6, 7]] * 9
    chunk = runner._build_inputs([(list(range(8)), 100, list(range(27)))]).meta
    assert chunk.row_block_tables is None  # most of the padded work is real: SDPA
    try:
        runner.model.model.decode_stack = Counting()
        by_rows = runner.execute(step, {"a": GREEDY, "b": GREEDY})
        assert Counting.calls == 1
        runner.reset()
        runner._row_attention = False
        runner.model.model.decode_stack = None
        padded = runner.execute(step, {"a": GREEDY, "b": GREEDY})
    finally:
        runner._row_attention, runner.model.model.decode_stack = True, stack
        runner.model.compute_logits = compute_logits
    assert by_rows.sampled_token_ids.keys() == padded.sampled_token_ids.keys() == {"a", "b"}
    torch.testing.assert_close(logits[0], logits[1], atol=2e-5, rtol=2e-5)
