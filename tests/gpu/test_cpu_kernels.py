"""The CPU path's own pieces against their references: the in-place paged decode
kernel against the reference attention, and the prepacked, merged products against
torch's plain ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from cadence.gpu import cpu_kernels, cpu_linear, preset
from cadence.gpu.attention import AttentionMetadata, cpu_paged_attention, reference_paged_attention
from cadence.gpu.model import build_model, init_random_weights
from cadence.gpu.attention import get_attention_backend
from memory_maps import mapping_of


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernels.load()
    assert module is not None, f"the CPU attention kernel did not build: {cpu_kernels.unavailable_reason()}"
    return module


def decode_batch(num_seqs, max_len, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    """Random caches with blocks in shuffled order and sequences of random lengths (one full)."""
    generator = torch.Generator().manual_seed(seed)
    width = -(-max_len // block_size)
    num_blocks = num_seqs * width + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * width].view(num_seqs, width)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=generator, dtype=torch.int32)
    lens[0] = max_len
    query = torch.randn(num_seqs, num_kv_heads * group, head_dim, generator=generator).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32), seq_lens=lens,
        block_tables=tables.to(torch.int32), max_query_len=1, max_seq_len=int(lens.max()),
        num_decode_seqs=num_seqs)
    return query, k_cache, v_cache, meta


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def require_one_pass_attention(kernel, query):
    """Skip where this CPU's kernels have no one-pass attention (decodes and prefills) for
    the query's dtype: it needs AVX-512 (and AVX512_BF16 for bfloat16). Where the CPU has
    those, the kernel must be there."""
    if kernel.has_paged_attention(query):
        return
    needed = {"avx512f", "avx512bw"} | ({"avx512_bf16"} if query.dtype == torch.bfloat16 else set())
    assert not needed <= set(cpu_kernels._cpu_flags().split()), "this CPU should have the one-pass kernel"
    pytest.skip(f"the one-pass attention kernel needs {', '.join(sorted(needed))}; on this CPU decodes take "
                f"the portable (or AVX2) decode kernel and prefills SDPA")


def require_bfloat16_packing(dtype):
    """Skip where oneDNN cannot prepack bfloat16 weights on this CPU (the runner then takes
    the eager path in bfloat16: `test_the_runner_takes_the_eager_path_where_packing_is_refused`)."""
    if dtype == torch.bfloat16 and not cpu_linear.packing_available(dtype):
        pytest.skip("oneDNN packs bfloat16 weights only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_seqs, max_len, block_size, num_kv_heads, group, head_dim", [
    (1, 1, 16, 2, 2, 16),      # a single position
    (3, 37, 4, 2, 3, 32),      # few sequences: one task per KV head
    (40, 70, 16, 4, 3, 64),    # many: one task per sequence, every head in a sweep
    (9, 33, 1, 1, 8, 128),     # blocks of one slot, one KV head for eight query heads
    (5, 48, 16, 8, 1, 64),     # no grouping
    (6, 300, 32, 2, 4, 96),    # many whole tiles of positions and a partial one
    (2, 40, 16, 1, 2, 256),    # the widest head size the vector kernels take
])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_kernel_matches_the_reference(kernel, dtype, num_seqs, max_len, block_size, num_kv_heads, group,
                                             head_dim, num_threads):
    query, k_cache, v_cache, meta = decode_batch(num_seqs, max_len, block_size, num_kv_heads, group, head_dim, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = kernel.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.3)
    finally:
        torch.set_num_threads(threads)
    want = reference_paged_attention(query, k_cache, v_cache, meta, 0.3)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 16), (torch.float32, 64), (torch.bfloat16, 64)])
def test_decode_kernel_reads_only_the_sequences_blocks(kernel, dtype, head_dim):
    """Poisoning every block no sequence owns, and every slot past each sequence's
    length, changes nothing: the portable kernel, the vector kernel, and in bfloat16 its
    values taken two positions at a time (odd lengths included: the slot after the
    last position is never read)."""
    query, k_cache, v_cache, meta = decode_batch(6, 29, 4, 2, 2, head_dim, dtype, seed=4)
    assert any(length % 2 for length in meta.seq_lens.tolist())
    clean = kernel.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25)
    owned = torch.zeros(k_cache.shape[0], k_cache.shape[1], dtype=torch.bool)
    for seq, length in enumerate(meta.seq_lens.tolist()):
        for position in range(length):
            owned[meta.block_tables[seq, position // 4], position % 4] = True
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("inf")
    poisoned = kernel.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25)
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


def test_decode_kernel_refuses_mismatched_inputs(kernel):
    query, k_cache, v_cache, meta = decode_batch(2, 8, 4, 2, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.paged_decode_attention(query.bfloat16(), k_cache, v_cache, meta.block_tables, meta.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        kernel.paged_decode_attention(query, k_cache, v_cache, meta.block_tables.long(), meta.seq_lens, 1.0)


def test_cpu_backend_mixes_kernel_decodes_with_sdpa_prefills():
    """A step of two decodes and two prefill chunks: the same as the reference."""
    generator = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, group, head_dim = 4, 2, 2, 16
    k_cache = torch.randn(40, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(40, block_size, num_kv_heads, head_dim, generator=generator)
    q_lens, seq_lens = [1, 1, 5, 3], [9, 4, 12, 3]
    tables = torch.randperm(40, generator=generator)[:16].view(4, 4).to(torch.int32)
    starts = torch.tensor([0, 1, 2, 7, 10], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=generator)
    meta = AttentionMetadata(slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), query_start_loc=starts,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             max_query_len=5, max_seq_len=12, num_decode_seqs=2)
    got = cpu_paged_attention(query, k_cache, v_cache, meta, 0.25)
    want = reference_paged_attention(query, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def prefill_batch(q_lens, seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed):
    """One step's query rows and caches: sequence i has q_lens[i] new tokens ending at
    position seq_lens[i] - 1, its blocks in shuffled order (the leading one-token
    sequences are the step's decodes)."""
    generator = torch.Generator().manual_seed(seed)
    width = -(-max(seq_lens) // block_size)
    num_blocks = len(q_lens) * width + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=generator)[: len(q_lens) * width].view(len(q_lens), width)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), query_start_loc=starts,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables.to(torch.int32),
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                             num_decode_seqs=next((i for i, n in enumerate(q_lens) if n > 1), len(q_lens)))
    return query, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, num_kv_heads, group, head_dim", [(16, 2, 3, 64), (5, 1, 4, 128), (8, 4, 1, 32)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_one_kernel_attends_decodes_and_prefills_as_the_reference(kernel, dtype, block_size, num_kv_heads, group,
                                                                  head_dim, num_threads):
    """Decodes, a fresh prefill longer than a tile of query tokens, a prefill chunk after
    cached context and a one-token chunk, in one call: the reference's answer."""
    q_lens, seq_lens = [1, 1, 37, 20, 1, 16], [9, 1, 37, 61, 30, 16]
    query, k_cache, v_cache, meta = prefill_batch(q_lens, seq_lens, block_size, num_kv_heads, group, head_dim, dtype,
                                                  seed=block_size * head_dim)
    require_one_pass_attention(kernel, query)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = cpu_paged_attention(query, k_cache, v_cache, meta, 0.2)
    finally:
        torch.set_num_threads(threads)
    want = reference_paged_attention(query, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    with pytest.raises(RuntimeError, match="too short a context"):
        kernel.paged_attention(query, k_cache, v_cache, meta.block_tables, torch.tensor([9, 1, 30, 61, 30, 16],
                               dtype=torch.int32), meta.query_start_loc, 0.2)


def attend(kernel, query, k_cache, v_cache, meta, scale, tiles, num_threads=1):
    """The kernel's attention with the tiled prefill path allowed or not (the vector kernel then)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    kernel.set_tile_attention(tiles)
    try:
        return kernel.paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, scale)
    finally:
        kernel.set_tile_attention(True)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size, num_kv_heads, group, head_dim", [
    (16, 4, 3, 64),   # the benchmark model's attention
    (5, 2, 2, 128),   # blocks that do not hold a tile of 16 keys, a wide head
    (32, 1, 4, 32),   # large blocks, one KV head, the narrowest tiled head
    (8, 2, 1, 96),    # no grouping, a head of three tiles' width
])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_tile_attention_of_prefill_chunks_matches_the_reference(kernel, block_size, num_kv_heads, group, head_dim,
                                                                 num_threads):
    """Bfloat16 prefill chunks of 16 tokens and more attend in tiles of 16 query tokens
    (on AMX tiles where the CPU has them, else in AVX512_BF16 vectors; where it has
    neither, the vector kernel): fresh prompts of whole and partial tiles, a long one,
    chunks after cached context of odd and even length, beside decodes and a chunk too
    short for the tiles. Both kernels give the reference's answer."""
    q_lens, seq_lens = [1, 16, 17, 300, 33, 1, 5, 40], [9, 16, 17, 300, 70, 1, 12, 201]
    query, k_cache, v_cache, meta = prefill_batch(q_lens, seq_lens, block_size, num_kv_heads, group, head_dim,
                                                  torch.bfloat16, seed=head_dim + block_size)
    require_one_pass_attention(kernel, query)
    want = reference_paged_attention(query, k_cache, v_cache, meta, 0.125).float()
    tiled = attend(kernel, query, k_cache, v_cache, meta, 0.125, True, num_threads)
    vector = attend(kernel, query, k_cache, v_cache, meta, 0.125, False, num_threads)
    assert tiled.dtype == torch.bfloat16 and tiled.shape == query.shape
    torch.testing.assert_close(tiled.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(vector.float(), want, atol=2e-2, rtol=2e-2)
    # Rows the tiles do not take (decodes and short chunks) are the vector kernel's, bit for bit.
    short = torch.cat([torch.arange(int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1]))
                       for i, n in enumerate(q_lens) if n < 16])
    assert torch.equal(tiled[short], vector[short])
    kind = kernel.tile_attention_kind()
    if kernel.tile_products():  # AMX wherever the products have it
        assert kind == "amx"
    if kind:  # the tiled path ran: its weights, rounded before the values, differ from the vector kernel's somewhere
        assert not torch.equal(tiled, vector)
    kernel.set_tile_attention(False)
    try:
        assert kernel.tile_attention_kind() == ""
    finally:
        kernel.set_tile_attention(True)


def test_tile_attention_reads_only_the_sequences_positions(kernel):
    """Poisoning every slot no sequence owns (NaN keys, infinite values) changes nothing
    of a step of prefill chunks, an odd context length included."""
    q_lens, seq_lens = [16, 31, 1, 50], [16, 45, 7, 99]
    query, k_cache, v_cache, meta = prefill_batch(q_lens, seq_lens, 16, 2, 3, 64, torch.bfloat16, seed=3)
    require_one_pass_attention(kernel, query)
    clean = attend(kernel, query, k_cache, v_cache, meta, 0.2, True)
    owned = torch.zeros(k_cache.shape[0], k_cache.shape[1], dtype=torch.bool)
    for seq, length in enumerate(seq_lens):
        for position in range(length):
            owned[meta.block_tables[seq, position // 16], position % 16] = True
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("inf")
    assert torch.equal(attend(kernel, query, k_cache, v_cache, meta, 0.2, True), clean)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])
def test_bfloat16_rotary_rounds_as_the_torch_ops_with_edge_values(kernel, head_dim):
    """The vector rotary kernel (bfloat16, heads a multiple of 32; 48 takes the scalar
    loop) gives the unfused rotation's exact bits, extreme values included."""
    from cadence.gpu.model import RotaryEmbedding, apply_rotary

    generator = torch.Generator().manual_seed(head_dim)
    q = (torch.randn(37, 3, head_dim, generator=generator) * 4).bfloat16()
    edges = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 1e-39, 0.0, -0.0])
    q.view(-1)[: edges.numel()] = edges.bfloat16()
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None)(torch.arange(1000, 1037), torch.bfloat16)
    got = q.clone()
    kernel.rotary(got, cos.reshape(37, -1), sin.reshape(37, -1))
    want = apply_rotary(q, cos, sin)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.equal(kernel.rotated(q, cos.reshape(37, -1), sin.reshape(37, -1)).nan_to_num(0.0), want.nan_to_num(0.0))


def test_the_kernel_build_is_keyed_by_source_and_cpu(monkeypatch, tmp_path):
    name = cpu_kernels.build_name()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : fpu sse2")
    assert cpu_kernels.build_name() != name and cpu_kernels.build_name().startswith("cadence_cpu_kernels_")
    monkeypatch.undo()
    copy = tmp_path / "cpu_kernels.cpp"  # the same source elsewhere (another install) builds apart
    copy.write_bytes(cpu_kernels.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_kernels, "SOURCE", copy)
    assert cpu_kernels.build_name() != name


def test_a_tree_linking_to_the_source_builds_the_same_files(monkeypatch, tmp_path):
    """The mutation runner's tree links to gpu/: its loader must name the build and
    hand the builder the source as the checkout does, or each run compiles again."""
    name = cpu_kernels.build_name()
    linked = tmp_path / "gpu"
    linked.symlink_to(cpu_kernels.SOURCE.parent.resolve())
    monkeypatch.setattr(cpu_kernels, "SOURCE", linked / cpu_kernels.SOURCE.name)
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert cpu_kernels.build_name() == name
    seen = {}

    def fake_load(**kwargs):
        seen.update(kwargs)
        return "module"

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert cpu_kernels.load() == "module"
    assert seen["sources"] == [str(cpu_kernels.SOURCE.resolve())]
    assert seen["name"] == name


LOAD_AND_REPORT = (
    "import logging, sys; logging.basicConfig(stream=sys.stderr);"
    "from cadence.gpu import cpu_kernels;"
    "ok = cpu_kernels.load() is not None;"
    "print('loaded' if ok else cpu_kernels.unavailable_reason(), flush=True)")


def _output_saying(stream, text: str, timeout_s: float) -> str | None:
    """Whether `stream` (a pipe, read unbuffered) says `text` before `timeout_s` passes
    or it ends: what it said up to then, or None."""
    import os
    import select
    import time

    deadline, said = time.monotonic() + timeout_s, b""
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([stream], [], [], left)[0]:
            return None
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            return None
        said += chunk
        if text.encode() in said:
            return said.decode(errors="replace")
    return None


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(kernel):
    """Torch's builder waits forever on a `lock` file a killed build left; the loader
    removes it when no live process of ours holds the build, and waits while one does."""
    import fcntl
    import subprocess
    import sys
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(cpu_kernels.build_name(), False))
    baton = build_dir / "lock"
    baton.touch()  # a build killed in its first minute leaves this behind
    done = subprocess.run([sys.executable, "-c", LOAD_AND_REPORT], capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == "loaded", done.stderr
    assert "did not finish" in done.stderr and not baton.exists()

    # A live builder (here: this test, holding the build) is waited for, not swept aside.
    with open(build_dir / "cadence-build.flock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        baton.touch()
        waiting = subprocess.Popen([sys.executable, "-c", LOAD_AND_REPORT], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            said = _output_saying(waiting.stderr, "waiting for another process", timeout_s=300)
            assert said and waiting.poll() is None and baton.exists()
        finally:
            baton.unlink(missing_ok=True)  # the builder finishes: torch removes its lock
            fcntl.flock(handle, fcntl.LOCK_UN)
        out, err = waiting.communicate(timeout=600)
    assert out.strip() == "loaded", err


def test_a_build_says_so_and_a_load_of_a_current_build_does_not(monkeypatch, caplog, tmp_path):
    """A first build is half a minute of silence otherwise: the log says a compile has
    begun and how long it took; a process that finds the build current says nothing, and
    `is_built` answers as `load` will act."""
    import logging
    import os
    from torch.utils import cpp_extension

    name = "cadence_cpu_kernels_first_build_test"
    built = []

    def build_directory(which, verbose):
        (tmp_path / which).mkdir(exist_ok=True)
        return str(tmp_path / which)

    def compile_(name, build_directory, **options):  # stands in for the half-minute build
        built.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return "module"

    source = tmp_path / "cpu_kernels.cpp"
    source.write_text("// stands in for the kernels' source")
    monkeypatch.setattr(cpu_kernels, "SOURCE", source)
    monkeypatch.setattr(cpu_kernels, "build_name", lambda: name)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", build_directory)
    monkeypatch.setattr(cpp_extension, "load", compile_)
    library = tmp_path / name / f"{name}.so"
    # No build yet; the build there; the source edited in place after it (the builder
    # compiles again, as it compares the files' times).
    for case, compiles in (("first", True), ("built", False), ("edited", True)):
        if case == "edited":
            os.utime(source, (library.stat().st_mtime + 10,) * 2)
        monkeypatch.setattr(cpu_kernels, "_state", {})  # a fresh process
        # What the runner asks before it lets a small model wait for a build.
        assert cpu_kernels.is_built() is not compiles, case
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cadence.gpu"):
            assert cpu_kernels.load() == "module"
        said = caplog.text
        assert ("compiling the CPU kernels" in said) is compiles, (case, said)
        assert ("compiled in" in said) is compiles, (case, said)
    assert built == [name] * 3


# ---- prepacked products


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_matches_torch(dtype, rows):
    require_bfloat16_packing(dtype)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 48, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(rows, 48, generator=generator).to(dtype)
    got = cpu_linear.PackedLinear(weight, bias)(x)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), F.linear(x, weight, bias).float(), atol=tolerance, rtol=tolerance)
    three_d = cpu_linear.PackedLinear(weight, None)(x.view(1, rows, 48))
    assert three_d.shape == (1, rows, 96)


@pytest.mark.parametrize("kind", ["tiny", "qwen-bias"])
def test_packing_a_model_keeps_its_outputs_and_releases_the_plain_weights(kind):
    config = preset("tiny")
    if kind == "qwen-bias":
        import attrs
        config = attrs.evolve(config, qkv_bias=True, qk_norm=True, tie_word_embeddings=False)
    backend = get_attention_backend("reference")
    plain = build_model(config, backend, torch.float32, "cpu")
    init_random_weights(plain, seed=5)
    packed = build_model(config, backend, torch.float32, "cpu")
    packed.load_state_dict(plain.state_dict())
    packed.pack()
    hidden = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer_plain, layer_packed in zip(plain.model.layers, packed.model.layers):
        torch.testing.assert_close(layer_packed.mlp(hidden), layer_plain.mlp(hidden), atol=1e-5, rtol=1e-5)
        attention = layer_packed.self_attn
        assert attention.q_proj is None and attention.k_proj is None and attention.v_proj is None
        assert layer_packed.mlp.gate_proj is None and layer_packed.mlp.up_proj is None
        q, k, v = attention.qkv_proj(hidden).split(attention.qkv_sizes, dim=-1)
        plain_attention = layer_plain.self_attn
        for got, linear in [(q, plain_attention.q_proj), (k, plain_attention.k_proj), (v, plain_attention.v_proj)]:
            torch.testing.assert_close(got, linear(hidden), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), atol=1e-5, rtol=1e-5)
    names = {name for name, _ in packed.named_parameters()}
    assert not any(part in name for name in names for part in ("q_proj", "gate_proj", "lm_head"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prefill_runs_the_packed_mlp_in_slices_with_the_same_values(dtype):
    require_bfloat16_packing(dtype)
    config = preset("tiny")
    model = build_model(config, get_attention_backend("reference"), dtype, "cpu")
    init_random_weights(model, seed=3)
    model.pack()
    mlp = model.model.layers[0].mlp
    # pack sizes the slices so one slice's gate/up product fills CACHED_OUTPUT_BYTES.
    assert mlp.chunk_rows == cpu_linear.rows_in_cache(2 * config.intermediate_size, dtype)
    assert cpu_linear.rows_in_cache(4096, torch.bfloat16) == 512
    assert cpu_linear.rows_in_cache(4096, torch.float32) == 256
    assert cpu_linear.rows_in_cache(1 << 20, torch.float32) == 64
    hidden = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    whole = mlp(hidden)
    calls = []
    product = mlp.gate_up_proj.forward
    mlp.gate_up_proj.forward = lambda x: calls.append(x.shape[0]) or product(x)
    mlp.chunk_rows = 8
    sliced = mlp(hidden)
    assert calls == [8, 8, 8, 8, 5]
    assert torch.equal(sliced, whole)


# ---- fused elementwise kernels: the same roundings as torch's unfused ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_rounds_as_torchs_silu_then_mul(kernel, dtype):
    """The halves of a merged gate/up product (strided views), 37 rows of 100 (a
    partial vector at each row's end): float32 is torch's ops; bfloat16 one pass whose
    own exp may round a value on a bfloat16 edge the other way (one unit in the last
    place at most, rarely), with torch's zeros, infinities and NaNs."""
    generator = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(37, 200, generator=generator) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate).mul_(up)
    got = cpu_kernels.silu_and_mul(gate, up)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, want)
        return
    differ = got != want
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
    edges = torch.tensor([0.0, -0.0, 1e-30, -200.0, 200.0, float("inf"), float("-inf"), float("nan"),
                          88.0, -88.0, -88.8, -104.0, 1e-3, 1e30, -1e30]).to(dtype).view(1, -1)
    want, got = F.silu(edges).mul_(edges), cpu_kernels.silu_and_mul(edges, edges)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0, 1.0, -1.0), want.nan_to_num(0.0, 1.0, -1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_rotary_round_as_the_torch_ops(kernel, dtype):
    from cadence.gpu.model import RMSNorm, RotaryEmbedding, apply_rotary

    generator = torch.Generator().manual_seed(11)
    norm = RMSNorm(48, 1e-5, dtype=dtype)
    norm.weight.data = torch.randn(48, generator=generator).to(dtype)
    x = torch.randn(33, 48, generator=generator).to(dtype)
    residual = torch.randn(33, 48, generator=generator).to(dtype)
    cos, sin = RotaryEmbedding(48, 10000.0, None)(torch.arange(100, 133), dtype)
    q = torch.randn(33, 5, 48, generator=generator).to(dtype)
    rotated = q.clone()
    kernel.rotary(rotated, cos.reshape(33, -1), sin.reshape(33, -1))
    normed, total = cpu_kernels.rms_norm(x, norm.weight, 1e-5, residual)
    want_normed, want_total = norm.add_and_norm(x, residual)
    assert torch.equal(total, want_total)
    if dtype == torch.bfloat16:  # every intermediate rounds to bfloat16: exactly the same bits
        assert torch.equal(cpu_kernels.rms_norm(x, norm.weight, 1e-5), norm(x))
        assert torch.equal(normed, want_normed) and torch.equal(rotated, apply_rotary(q, cos, sin))
    else:  # float32 differs only in the order of the sums
        torch.testing.assert_close(cpu_kernels.rms_norm(x, norm.weight, 1e-5), norm(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rotated, apply_rotary(q, cos, sin), atol=1e-5, rtol=1e-5)


def test_rope_and_write_kv_normalises_rotates_and_stores(kernel):
    """The CPU's fused attention prologue against the model's unfused one (query/key
    norms as Qwen3 has them, a non-contiguous q from the merged projection)."""
    from cadence.gpu.attention import write_kv
    from cadence.gpu.model import RotaryEmbedding, apply_rotary

    generator = torch.Generator().manual_seed(12)
    qkv = torch.randn(7, (4 + 2 + 2) * 16, generator=generator).bfloat16()
    q, k, v = (t.view(7, -1, 16) for t in qkv.split([64, 32, 32], dim=-1))
    weights = [torch.randn(16, generator=generator).bfloat16() for _ in range(2)]
    cos, sin = RotaryEmbedding(16, 10000.0, None)(torch.arange(3, 10), torch.bfloat16)
    slots = torch.tensor([5, 9, 2, 14, 0, 7, 11])
    caches = [torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16) for _ in range(4)]
    got = cpu_kernels.rope_and_write_kv(q, k, v, cos, sin, caches[0], caches[1], slots,
                                        q_norm_weight=weights[0], k_norm_weight=weights[1], eps=1e-6)

    def norm(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()

    want_q = apply_rotary(norm(q, weights[0]), cos, sin)
    want_k = apply_rotary(norm(k, weights[1]), cos, sin)
    write_kv(caches[2], caches[3], want_k, v, slots)
    torch.testing.assert_close(got, want_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(caches[0], caches[2], atol=1e-2, rtol=1e-2)
    assert torch.equal(caches[1], caches[3])



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_kv_without_norms_rotates_the_projection_in_place(kernel, dtype):
    """Without norms the prologue rotates q and k where the merged projection left them
    (no new tensor): the values are the unfused rotation's, v is untouched, and the
    cache holds what `write_kv` would store."""
    from cadence.gpu.attention import write_kv
    from cadence.gpu.model import RotaryEmbedding, apply_rotary

    generator = torch.Generator().manual_seed(13)
    qkv = torch.randn(11, (6 + 2 + 2) * 32, generator=generator).to(dtype)
    before = qkv.clone()
    q, k, v = (t.view(11, -1, 32) for t in qkv.split([192, 64, 64], dim=-1))
    cos, sin = RotaryEmbedding(32, 10000.0, None)(torch.arange(20, 31), dtype)
    slots = torch.tensor([5, 9, 2, 14, 0, 7, 11, 30, 21, 17, 26])
    caches = [torch.zeros(4, 8, 2, 32, dtype=dtype) for _ in range(4)]
    want_q, want_k, want_v = (t.clone() for t in before.view(11, -1, 32).split([6, 2, 2], dim=1))
    want_q, want_k = apply_rotary(want_q, cos, sin), apply_rotary(want_k, cos, sin)
    got = cpu_kernels.rope_and_write_kv(q, k, v, cos, sin, caches[0], caches[1], slots)
    write_kv(caches[2], caches[3], want_k, want_v, slots)
    assert got.data_ptr() == qkv.data_ptr()  # the projection's own memory, rotated
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(got, want_q, **tolerance)
    torch.testing.assert_close(k, want_k, **tolerance)
    assert torch.equal(v, want_v)
    assert not torch.equal(qkv, before)  # q and k changed where they lie
    torch.testing.assert_close(caches[0], caches[2], **tolerance)
    assert torch.equal(caches[1], caches[3]) and caches[1].any()

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 48, 1000, 32003])
def test_argmax_kernel_gives_torchs_index_with_ties_infinities_and_nans(kernel, dtype, width):
    """Greedy decoding takes this index: it must be torch.argmax's in every case (the first
    of equal largest values, the first NaN, index 0 of an all -inf row)."""
    generator = torch.Generator().manual_seed(width)
    ties = torch.randint(-3, 4, (23, width), generator=generator).to(dtype)  # many equal maxima
    mixed = torch.randn(23, width, generator=generator).to(dtype)
    mixed[1] = float("-inf")
    mixed[2, width // 2] = float("nan")
    mixed[3, -1] = float("nan")
    mixed[4, 0] = float("nan")
    mixed[5, width // 3] = float("inf")
    for logits in (ties, mixed, mixed[:, : max(1, width - 1)]):
        assert torch.equal(cpu_kernels.argmax(logits), logits.argmax(dim=-1))


# ---- small-batch products and the decode-step stack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20, 29, 32, 128, 300])
@pytest.mark.parametrize("out_features, in_features, with_bias", [(100, 48, True), (32, 768, False),
                                                                    (1536, 64, True)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_small_batch_product_matches_the_reference(kernel, dtype, rows, out_features, in_features, with_bias,
                                                   num_threads):
    small = cpu_kernels.small_batch()
    if small is None or dtype not in small.dtypes:
        pytest.skip(f"this CPU's kernels have no small-batch product in {dtype} (it needs AVX2 and FMA, "
                    f"and with AVX-512, AVX512_BF16 for bfloat16)")
    generator = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        packed = small.pack(weight)
        got = small.product(x, packed, bias, out_features)
        one_by_one = torch.cat([small.product(row, packed, bias, out_features) for row in x.split(1)])
        linear = cpu_linear.PackedLinear(weight, bias, small_batch=small)
        assert linear.small_weight is not None
        many = torch.cat([x] * (small.rows // rows + 1))
        # The small product, then the large-batch one: oneDNN's where its copy is kept.
        through_linear, through_large = linear(x), linear(many)
    finally:
        torch.set_num_threads(threads)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
    # Float32 sums of exact products, rounded once to bfloat16 (a relative 2^-8 at most).
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got.float(), want, **tolerance)
    if rows <= linear.small_rows or linear.packed_weight is None:  # the linear took the small product
        assert torch.equal(through_linear, got)
    # A row's sums run in the same order whatever rows share the product (runs of rows
    # over one weight group included): its result does not depend on the batch. Where
    # bfloat16 runs on AMX tiles (from 8 rows, inputs a multiple of 32), within them.
    on_tiles = small.tiles and dtype == torch.bfloat16 and in_features % 32 == 0
    if on_tiles and rows >= 8:
        torch.testing.assert_close(one_by_one.float(), want, **tolerance)
        assert torch.equal(small.product(x[:8], packed, bias, out_features), got[:8])
    else:
        assert torch.equal(one_by_one, got)
    torch.testing.assert_close(through_large.float(), torch.cat([want] * (small.rows // rows + 1)),
                               atol=5e-2, rtol=2e-2)
    # One copy of the weight where the small-batch kernel serves every batch size.
    assert (linear.packed_weight is None) == (dtype not in cpu_linear.LARGE_BATCH_ONEDNN_DTYPES)


@pytest.mark.parametrize("dtype, in_features", [(torch.float32, 1024), (torch.bfloat16, 2048),
                                                (torch.float32, 2048)])
@pytest.mark.parametrize("rows", [2, 13, 64, 130])
def test_rows_a_multiple_of_4_kib_apart_give_the_same_products(kernel, dtype, in_features, rows):
    """Rows whose stride is a multiple of 4 KiB are copied apart before the product (they
    share an L1 set otherwise): the results are those of the same rows laid out 64
    bytes further apart, bit for bit, and as the reference, for every row."""
    small = cpu_kernels.small_batch()
    if small is None or dtype not in small.dtypes:
        pytest.skip(f"this CPU's kernels have no small-batch product in {dtype}")
    generator = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(96, in_features, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    spaced = torch.zeros(rows, in_features + 64 // x.element_size(), dtype=dtype)[:, :in_features]
    spaced.copy_(x)
    # Every row a different offset into a wider buffer: a stride of 4 KiB and rows that
    # do not start at the buffer's start.
    offset = torch.zeros(rows + 1, in_features, dtype=dtype)[1:]
    offset.copy_(x)
    packed = small.pack(weight)
    got = small.product(x, packed, bias, 96)
    assert torch.equal(got, small.product(spaced, packed, bias, 96))
    assert torch.equal(got, small.product(offset, packed, bias, 96))
    want = F.linear(x.double(), weight.double(), bias.double()).float()
    tolerance = dict(atol=1e-3, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=8e-3)
    torch.testing.assert_close(got.float(), want, **tolerance)


def test_the_small_batch_product_follows_the_cpus_instruction_sets(kernel):
    """Float32 and bfloat16 take the small-batch product wherever the CPU has AVX2 and FMA
    (groups of 16 outputs, bfloat16 widened to float32) or AVX-512 (groups of 32; there
    bfloat16 needs AVX512_BF16's dot products, and without them oneDNN packs it)."""
    flags = set(cpu_kernels._cpu_flags().split())
    avx512, avx2 = {"avx512f", "avx512bw"} <= flags, {"avx2", "fma"} <= flags
    small = cpu_kernels.small_batch()
    if not (avx512 or avx2):
        assert small is None
        pytest.skip("this CPU has neither AVX2 and FMA nor AVX-512")
    assert torch.float32 in small.dtypes
    assert (torch.bfloat16 in small.dtypes) == ("avx512_bf16" in flags if avx512 else avx2)
    assert small.columns == (32 if avx512 else 16)


def test_the_runner_takes_the_eager_path_where_packing_is_refused(monkeypatch):
    """oneDNN reorders bfloat16 weights only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT
    (elsewhere it raises): where the kernels' small-batch product takes bfloat16 either,
    a bfloat16 runner computes eagerly, and asking for the packed path is a
    configuration error naming the dtype."""
    from cadence.gpu import ModelRunner
    from cadence.statemachine.errors import ConfigError

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is not None:
        assert cpu_linear.packing_available(torch.bfloat16) == bool(probe())
    assert not cpu_linear.packing_available(torch.float16)
    monkeypatch.setattr(cpu_linear, "packing_available", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(cpu_kernels, "small_batch", lambda: None)
    runner = ModelRunner(preset("tiny"), num_blocks=4, device="cpu", dtype="bfloat16")
    assert runner.cpu_path == "eager"
    assert ModelRunner(preset("tiny"), num_blocks=4, device="cpu", dtype="float32").cpu_path == "packed"
    with pytest.raises(ConfigError, match="bfloat16"):
        ModelRunner(preset("tiny"), num_blocks=4, device="cpu", dtype="bfloat16", cpu_path="packed")


def test_bfloat16_packs_for_the_kernels_alone_where_onednn_refuses(kernel, monkeypatch):
    """Where oneDNN cannot pack bfloat16 but the kernels' product takes it (AVX2 without
    AVX-512; here oneDNN's refusal is simulated where it would pack), a bfloat16 runner
    takes the packed path with every product on the kernels' layout alone (no oneDNN
    copy), whose outputs are the eager path's within bfloat16's rounding."""
    from cadence.gpu import ModelRunner

    small = cpu_kernels.small_batch()
    if small is None or torch.bfloat16 not in small.dtypes:
        pytest.skip("this CPU's kernels have no bfloat16 small-batch product (AVX2 and FMA, and "
                    "with AVX-512, AVX512_BF16)")
    monkeypatch.setattr(cpu_linear, "packing_available", lambda dtype: dtype == torch.float32)
    runner = ModelRunner(preset("tiny"), num_blocks=16, device="cpu", dtype="bfloat16")
    assert runner.cpu_path == "packed"
    linears = [module for module in runner.model.modules() if isinstance(module, cpu_linear.PackedLinear)]
    assert linears and all(linear.packed_weight is None and linear.small_weight is not None for linear in linears)
    eager = ModelRunner(preset("tiny"), num_blocks=16, device="cpu", dtype="bfloat16", cpu_path="eager")
    generator = torch.Generator().manual_seed(3)
    for rows in (3, 40):  # one run of rows (widened in the run), and many (the weight widened once)
        hidden = torch.randn(rows, runner.config.hidden_size, generator=generator).bfloat16()
        for packed_layer, eager_layer in zip(runner.model.model.layers, eager.model.model.layers):
            torch.testing.assert_close(packed_layer.mlp(hidden).float(), eager_layer.mlp(hidden).float(),
                                       atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(runner.model.compute_logits(hidden).float(),
                                   eager.model.compute_logits(hidden).float(), atol=3e-2, rtol=3e-2)


def test_small_batch_row_bounds_follow_the_cpu(kernel):
    """Beside oneDNN's copy, products of up to 128 rows take the small-batch path, but
    where the CPU has AMX (oneDNN's tiles) a bfloat16 product takes at most 4 rows, or
    more the smaller it is (2^20 multiply-adds a row count), and only there bfloat16
    keeps oneDNN's copy; where the kernels multiply on the tiles themselves, a product
    whose inputs fill whole tiles (a multiple of 32) takes at least 96 rows."""
    small = cpu_kernels.small_batch()
    if small is None:
        pytest.skip("this CPU's kernels have no small-batch product (it needs AVX2 and FMA)")
    assert small.rows == 128
    assert small.rows_for(torch.float32, 1280, 768) == small.rows_for(torch.float32, 256, 128) == 128
    if torch.bfloat16 in small.dtypes:
        amx = cpu_kernels.has_amx_bfloat16()
        # A 125M model's products, the demo model's, and one small enough for 128 rows.
        bounds = [small.rows_for(torch.bfloat16, out, into)
                  for out, into in ((32000, 768), (1280, 768), (768, 128), (256, 128), (64, 64), (2048, 48))]
        if not amx:
            assert bounds == [128] * 6 and not small.tiles
        elif small.tiles:
            assert bounds == [96, 96, 96, 96, 128, 10]
        else:
            assert bounds == [4, 4, 10, 32, 128, 10]
        assert (torch.bfloat16 in cpu_linear.LARGE_BATCH_ONEDNN_DTYPES) == amx
    assert torch.float32 not in cpu_linear.LARGE_BATCH_ONEDNN_DTYPES


def test_bfloat16_beside_onednn_routes_rows_by_the_bound(kernel, monkeypatch):
    """As on a CPU with AMX: bfloat16 keeps oneDNN's copy beside the kernel's, products
    of at most the 4-row bound take the kernel, larger ones oneDNN's (the same values
    as each path alone)."""
    small = cpu_kernels.small_batch()
    if small is None or torch.bfloat16 not in small.dtypes:
        pytest.skip("this CPU's kernels have no small-batch product in bfloat16 (it needs AVX2 and FMA, "
                    "and with AVX-512, AVX512_BF16)")
    require_bfloat16_packing(torch.bfloat16)  # oneDNN's copy beside the kernel's
    monkeypatch.setattr(cpu_linear, "LARGE_BATCH_ONEDNN_DTYPES", frozenset({torch.bfloat16}))
    monkeypatch.setattr(small, "rows_for", lambda dtype, out_features, in_features: 4)
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    linear = cpu_linear.PackedLinear(weight, None, small_batch=small)
    assert linear.small_weight is not None and linear.packed_weight is not None and linear.small_rows == 4
    few, many = (torch.randn(n, 64, generator=generator).bfloat16() for n in (4, 5))
    assert torch.equal(linear(few), small.product(few, linear.small_weight, None, 96))
    onednn = torch.ops.mkldnn._linear_pointwise(many, linear.packed_weight, None, "none", [], "")
    assert torch.equal(linear(many), onednn)


def test_a_large_copy_is_dropped_only_where_tiles_take_every_row_count(kernel, monkeypatch):
    """`large_copy=False` (the output head's): where the kernels multiply bfloat16 on AMX
    tiles, no oneDNN copy is kept and every row count takes the small-batch product
    (its values); where they do not, or for inputs that do not fill whole tiles, or in
    float32, the weight is laid out as before."""
    small = cpu_kernels.small_batch()
    if small is None or torch.bfloat16 not in small.dtypes:
        pytest.skip("this CPU's kernels have no small-batch product in bfloat16 (it needs AVX2 and FMA, "
                    "and with AVX-512, AVX512_BF16)")
    require_bfloat16_packing(torch.bfloat16)  # oneDNN's copy beside the kernel's
    monkeypatch.setattr(cpu_linear, "LARGE_BATCH_ONEDNN_DTYPES", frozenset({torch.bfloat16}))
    generator = torch.Generator().manual_seed(12)
    weight, odd = torch.randn(96, 64, generator=generator).bfloat16(), torch.randn(96, 48, generator=generator).bfloat16()
    for tiles in (False, True):
        monkeypatch.setattr(small, "tiles", tiles)
        head = cpu_linear.PackedLinear(weight, None, small_batch=small, large_copy=False)
        kept = cpu_linear.PackedLinear(weight, None, small_batch=small)
        assert kept.packed_weight is not None
        assert (head.packed_weight is None) == tiles
        assert cpu_linear.PackedLinear(odd, None, small_batch=small, large_copy=False).packed_weight is not None
        assert cpu_linear.PackedLinear(weight.float(), None, small_batch=small,
                                       large_copy=False).packed_weight is None  # float32: one copy anyway
        if tiles:
            many = torch.randn(300, 64, generator=generator).bfloat16()
            assert torch.equal(head(many), small.product(many, head.small_weight, None, 96))


def _random_decode_step(config, dtype, num_seqs, seed=0):
    """A decode step's inputs for `config`: random caches for every layer, the block
    tables and lengths of `num_seqs` sequences, and the slots their new tokens take."""
    generator = torch.Generator().manual_seed(seed)
    block_size, width = 16, 5
    num_blocks = num_seqs * width + 2
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = [tuple(torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
              for _ in range(config.num_layers)]
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * width].view(num_seqs, width).to(torch.int32)
    lens = torch.randint(1, block_size * width + 1, (num_seqs,), generator=generator, dtype=torch.int32)
    positions = lens.long() - 1
    slots = tables.long()[torch.arange(num_seqs), positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
                             seq_lens=lens, block_tables=tables, max_query_len=1, max_seq_len=int(lens.max()),
                             num_decode_seqs=num_seqs)
    input_ids = torch.randint(0, config.vocab_size, (num_seqs,), generator=generator)
    return input_ids, positions, caches, meta


def _stacked_model(dtype, seed, **shape):
    """The tiny preset (with q/k/v biases and `shape`'s changes) packed, on the CPU
    kernels, with its decoder stack: (config, model, stack)."""
    import attrs

    require_bfloat16_packing(dtype)
    config = attrs.evolve(preset("tiny"), qkv_bias=True, **shape)
    model = build_model(config, get_attention_backend("cpu"), dtype, "cpu")
    init_random_weights(model, seed=seed)
    model.pack(small_batch=cpu_kernels.small_batch())
    model.set_fused_elementwise(True, cpu_kernels)
    stack = model.model.decode_stack
    assert stack is not None
    return config, model, stack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 5, 12, 130])
def test_the_decode_stack_gives_the_layers_results_bit_for_bit(kernel, dtype, num_seqs):
    """The C++ decode-step stack runs the layers' own ops in their order: the same final
    hidden states and the same cache contents, exactly, for batches the small-batch
    product takes and for larger ones."""
    config, model, stack = _stacked_model(dtype, seed=3)
    input_ids, positions, caches, meta = _random_decode_step(config, dtype, num_seqs)
    copies = [tuple(c.clone() for c in pair) for pair in caches]
    with torch.no_grad():
        got = model(input_ids, positions, caches, meta)
        model.model.decode_stack = None
        want = model(input_ids, positions, copies, meta)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for pair, copy in zip(caches, copies) for a, b in zip(pair, copy))


def with_row_tables(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with each query row's own block table and context length (its position + 1),
    derived from the step's sequences by definition."""
    import attrs

    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)
    index_in_seq = torch.arange(seq_of_row.shape[0]) - meta.query_start_loc.long()[seq_of_row]
    lens = meta.seq_lens.long()[seq_of_row] - q_lens[seq_of_row] + index_in_seq + 1
    return attrs.evolve(meta, row_block_tables=meta.block_tables.index_select(0, seq_of_row),
                        row_seq_lens=lens.to(torch.int32))


def _random_mixed_step(config, dtype, q_lens, seq_lens, seed=0):
    """A step of decodes and prompt chunks (`q_lens` new tokens ending at `seq_lens`, the
    one-token ones first) for `config`: random caches for every layer, blocks in shuffled
    order, the slots the new tokens take, and per-row tables."""
    generator = torch.Generator().manual_seed(seed)
    block_size = 16
    width = -(-max(seq_lens) // block_size)
    num_blocks = len(q_lens) * width + 2
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = [tuple(torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
              for _ in range(config.num_layers)]
    tables = torch.randperm(num_blocks, generator=generator)[: len(q_lens) * width].view(len(q_lens), width)
    positions = torch.cat([torch.arange(end - n, end) for n, end in zip(q_lens, seq_lens)])
    seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = tables[seq_of_row, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                                         dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables.to(torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_decode_seqs=q_lens.count(1))
    input_ids = torch.randint(0, config.vocab_size, (len(positions),), generator=generator)
    return input_ids, positions, caches, with_row_tables(meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled", ["all", "some", "none", "every row"])
# Heads of 16: the portable decode kernel (a row at a time only); of 32: the vector ones.
@pytest.mark.parametrize("head_dim, form", [(16, "rows"), (32, "rows"), (32, "sequences")])
def test_the_stack_runs_a_step_of_prompts_as_the_layers_do(kernel, dtype, sampled, head_dim, form):
    """A step of decodes, a whole prompt, a chunk after cached context and a prompt longer
    than the feed-forward's slice of rows, attended a row at a time (each row's own table)
    or a sequence at a time (`paged_attention`'s form, where the kernels have it): the
    stack's final hidden states of the rows that sample (or of every row) and the caches
    it writes are the layers' own, bit for bit, and agree with the padded (SDPA)
    attention's."""
    import attrs

    from cadence.gpu.model import LastRows

    config, model, stack = _stacked_model(dtype, seed=4, head_dim=head_dim)
    probe = torch.empty(0, config.num_heads, head_dim, dtype=dtype)
    assert model.model.stack_takes_prompts == kernel.has_paged_attention(probe)
    if form == "sequences" and not model.model.stack_takes_prompts:
        pytest.skip("the kernels attend prompts a sequence at a time only with AVX-512")
    chunk_rows = model.model.layers[0].mlp.chunk_rows
    q_lens, seq_lens = [1, 1, 20, 9, chunk_rows + 7], [31, 5, 20, 39, chunk_rows + 7]
    input_ids, positions, caches, meta = _random_mixed_step(config, dtype, q_lens, seq_lens, seed=len(sampled))
    if form == "sequences":
        meta = attrs.evolve(meta, row_block_tables=None, row_seq_lens=None)
    ends = meta.query_start_loc.long()[1:] - 1
    seqs = {"all": [0, 1, 2, 3, 4], "some": [1, 3], "none": [], "every row": None}[sampled]
    keep = None if seqs is None else LastRows(ends[seqs], torch.tensor(seqs, dtype=torch.int64))
    calls = []

    class Counting:
        def forward(self, *args, **kwargs):
            calls.append(kwargs)
            return stack.forward(*args, **kwargs)

    runs = {}
    for name in ("stack", "layers", "padded"):
        model.model.decode_stack = Counting() if name == "stack" else None
        step = meta if name != "padded" else attrs.evolve(meta, row_block_tables=None, row_seq_lens=None)
        copies = [tuple(c.clone() for c in pair) for pair in caches]
        with torch.no_grad():
            runs[name] = (model(input_ids, positions, copies, step, keep), copies)
    # One call of the stack, in the step's form.
    assert len(calls) == 1 and ("query_start" in calls[0]) == (form == "sequences")
    (got, got_caches), (want, want_caches) = runs["stack"], runs["layers"]
    assert got.shape == (len(positions) if seqs is None else len(seqs), config.hidden_size)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for pair, copy in zip(got_caches, want_caches) for a, b in zip(pair, copy))
    torch.testing.assert_close(got.float(), runs["padded"][0].float(), atol=TOLERANCE[dtype] * 10,
                               rtol=TOLERANCE[dtype] * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_attention_of_prompts_matches_the_reference(kernel, dtype):
    """Every query row as a one-token query over its own context (prompt rows included):
    the reference's causal answer, for whole prompts and a chunk after cached context."""
    q_lens, seq_lens = [1, 1, 37, 20, 16], [9, 1, 37, 61, 16]
    query, k_cache, v_cache, meta = prefill_batch(q_lens, seq_lens, 16, 2, 3, 64, dtype, seed=3)
    if not kernel.has_row_attention(query):
        pytest.skip("the decode kernel has no vector path for this dtype here (it needs AVX2 and FMA)")
    got = cpu_paged_attention(query, k_cache, v_cache, with_row_tables(meta), 0.2)
    want = reference_paged_attention(query, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_prompts_rows_in_one_call_give_each_rows_own_answer(kernel, dtype, num_threads):
    """Rows that continue a prompt (the vector kernel reuses the row before's slots and
    prefetches nothing) give exactly what each row gives attended alone, also where a
    row's predecessor shares its first blocks but not the rest (a prefix-cached prompt's
    sibling) or its length but not its blocks."""
    generator = torch.Generator().manual_seed(5)
    block_size, num_kv_heads, group, head_dim = 16, 2, 3, 64
    k_cache, v_cache = (torch.randn(40, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
                        for _ in range(2))
    prompt = torch.tensor([[7, 3, 12, 30]], dtype=torch.int32)
    sibling = torch.tensor([[7, 3, 25, 31]], dtype=torch.int32)  # the same first two blocks
    tables = torch.cat([prompt.expand(50, -1), sibling, sibling, prompt.expand(3, -1)])
    lens = torch.cat([torch.arange(1, 51), torch.tensor([51, 52]), torch.tensor([52, 53, 60])]).to(torch.int32)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    if not kernel.has_row_attention(query):
        pytest.skip("the decode kernel has no vector path for this dtype here (it needs AVX2 and FMA)")
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        together = kernel.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
        alone = torch.cat([kernel.paged_decode_attention(query[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                                         lens[i : i + 1], 0.125) for i in range(len(lens))])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
                             query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens=lens,
                             block_tables=tables, max_query_len=1, max_seq_len=int(lens.max()),
                             num_decode_seqs=len(lens))
    want = reference_paged_attention(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(together.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_row_attention_pays_for_whole_prompts_not_for_a_chunk_after_a_long_context():
    from cadence.gpu.attention import row_attention_pays

    assert row_attention_pays([], 16)  # decodes alone
    assert row_attention_pays([(0, 128)] * 7, 16)
    assert row_attention_pays([(0, 2048)], 16)
    assert not row_attention_pays([(1024, 256)], 16)  # most of the padded work is real
    # Seven short prompts beside one long: padding the short ones to the long one's length wastes most.
    assert row_attention_pays([(0, 8)] * 7 + [(0, 512)], 16)
    # A burst of prompts beside a decode deep into a long context: every row's table would
    # be that decode's width.
    assert row_attention_pays([(0, 128)] * 16, 16, num_rows=2049, table_width=8)
    assert not row_attention_pays([(0, 128)] * 16, 16, num_rows=2049, table_width=2048)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features", [(1, 4), (31, 8), (32, 6), (33, 10), (100, 64)])
def test_the_small_batch_layout_written_into_given_memory_is_the_padded_one(dtype, out_features, in_features):
    small = cpu_kernels.small_batch()
    if small is None or dtype not in small.dtypes:
        pytest.skip(f"this CPU's kernels have no small-batch product in {dtype} (it needs AVX2 and FMA, "
                    f"and with AVX-512, AVX512_BF16 for bfloat16)")
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(out_features)).to(dtype)
    per_run, groups = (2 if dtype == torch.bfloat16 else 1), -(-out_features // small.columns)
    # The layout by definition: outputs padded with zeros to whole groups, each input's
    # (pair of inputs') run of a group's outputs side by side.
    want = (F.pad(weight, (0, 0, 0, groups * small.columns - out_features))
            .view(groups, small.columns, in_features // per_run, per_run).permute(0, 2, 1, 3))
    given = torch.full(small.packed_shape(out_features, in_features, dtype), 7.0, dtype=dtype)  # stale bytes
    written = small.pack(weight, given)
    assert written.data_ptr() == given.data_ptr()
    assert torch.equal(written, want) and torch.equal(small.pack(weight), want)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        small.pack(weight, torch.empty(small.packed_shape(out_features + small.columns, in_features, dtype),
                                       dtype=dtype))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_packed_weights_lie_in_one_huge_page_arena_in_the_order_a_decode_step_reads_them(kernel):
    small = cpu_kernels.small_batch()
    if small is None:
        pytest.skip("this CPU's kernels have no small-batch product (it needs AVX2 and FMA)")
    model = build_model(preset("tiny"), get_attention_backend("cpu"), torch.float32, "cpu")
    init_random_weights(model, seed=5)
    model.pack(small_batch=small)
    products = [p for layer in model.model.layers
                for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                          layer.mlp.down_proj)] + [model.packed_head]
    starts = [p.small_weight.data_ptr() for p in products]
    ends = [p.small_weight.data_ptr() + p.small_weight.numel() * p.small_weight.element_size() for p in products]
    # Front to back in reading order, each on a page of its own, no overlap.
    assert all(end <= start for end, start in zip(ends, starts[1:]))
    assert all(start % cpu_linear.ARENA_ALIGN == 0 for start in starts)
    assert starts[0] % cpu_linear.HUGE_PAGE_BYTES == 0
    mappings = [mapping_of(start) for start in starts]
    assert len({span for _, _, span in mappings}) == 1  # one mapping
    perms, flags, _ = mappings[0]
    assert perms.endswith("p") and "hg" in flags and "sh" not in flags


def test_the_decode_stack_stays_off_where_it_does_not_apply(kernel):
    import attrs

    config = attrs.evolve(preset("tiny"), qk_norm=True)
    model = build_model(config, get_attention_backend("cpu"), torch.float32, "cpu")
    model.pack()
    model.set_fused_elementwise(True, cpu_kernels)
    assert model.model.decode_stack is None  # query/key norms: the layers run one by one
    plain = build_model(preset("tiny"), get_attention_backend("cpu"), torch.float32, "cpu")
    plain.set_fused_elementwise(True, cpu_kernels)
    assert plain.model.decode_stack is None  # unpacked products


def test_rotated_leaves_its_input_and_store_kv_writes_as_write_kv(kernel):
    """The prologue's out-of-place rotation of a strided view equals the in-place one on a
    copy (and leaves the view's row alone); the kernels' cache store equals `write_kv`."""
    from cadence.gpu.attention import write_kv
    from cadence.gpu.model import RotaryEmbedding

    generator = torch.Generator().manual_seed(21)
    qkv = torch.randn(9, (3 + 1 + 1) * 32, generator=generator).bfloat16()
    before = qkv.clone()
    k, v = (t.view(9, 1, 32) for t in qkv[:, 96:].split(32, dim=-1))
    q = qkv[:, :96].view(9, 3, 32)
    cos, sin = (t.view(9, 32) for t in RotaryEmbedding(32, 10000.0, None)(torch.arange(9), torch.bfloat16))
    got = kernel.rotated(q, cos, sin)
    want = q.contiguous()
    kernel.rotary(want, cos, sin)
    assert torch.equal(got, want) and got.is_contiguous() and torch.equal(qkv, before)
    slots = torch.tensor([3, 17, 0, 8, 30, 12, 5, 21, 9])
    caches = [torch.zeros(4, 8, 1, 32, dtype=torch.bfloat16) for _ in range(4)]
    kernel.store_kv(k, v, caches[0], caches[1], slots)
    write_kv(caches[2], caches[3], k, v, slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]) and caches[0].any()
