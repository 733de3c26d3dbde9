"""The CPU path's C++ kernels (`cpu_kernels.cpp`), built on first use.

Paged decode attention reads each sequence's keys and values from their cache
blocks in place and attends for a KV head's whole group of query heads at once,
in float32. RMSNorm (with the residual add before it) and the rotary embedding
each run as one kernel instead of torch's chain of elementwise ops, rounding
where those ops round; `rms_norm`, `silu_and_mul` and `rope_and_write_kv` below
have the signatures of `cadence.gpu.triton_fused`, so the model's fused branches
take either module. The extension is compiled with torch's C++ extension builder the first time a
process asks for it (~30 s on two cores; needs a C++ compiler and ninja) and cached
under torch's extension directory, keyed by the source and this CPU's
instruction sets, so a process on another kind of CPU builds its own.
Where it cannot be built, `load` says why and the "cpu" attention backend
falls back to SDPA over gathered blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from pathlib import Path

import torch

from .attention import write_kv

_log = logging.getLogger("cadence.gpu")
SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# The rotary kernel takes any even head size (the Triton one only powers of two).
ANY_HEAD_DIM = True
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def has_avx512() -> bool:
    """Whether this CPU has the AVX-512 the kernels' vector paths take (foundation and
    byte/word): their attention then takes a step's prompts in one pass."""
    flags = _cpu_flags().split()
    return "avx512f" in flags and "avx512bw" in flags


def has_amx_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 on AMX tiles (as the kernels, built with
    -march=native, see it): oneDNN's products then outrun the small-batch kernel
    beyond a few rows, the fewer the larger the product (`SmallBatch.rows_for`)."""
    return "amx_bf16" in _cpu_flags().split()


def build_name() -> str:
    """The extension's name: the source, where it lies and the CPU's flags decide it
    (-march=native). Where it lies, because the build files name the source's path: two
    copies of one source (a checkout and an installed wheel) sharing a name would each
    find the other's build stale and rebuild it."""
    key = SOURCE.read_bytes() + str(SOURCE.resolve()).encode() + _cpu_flags().encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return f"cadence_cpu_kernels_{digest}"


def load():
    """The compiled kernel module, or None when it cannot be built here (see `unavailable_reason`)."""
    with _lock:
        if "module" in _state or "error" in _state:
            return _state.get("module")
        try:
            from torch.utils import cpp_extension

            name = build_name()
            build_dir = Path(cpp_extension._get_build_directory(name, False))
            flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
            with _sole_builder(build_dir):
                # A first build is a silent pause of half a minute otherwise; so is a
                # rebuild of a source edited in place (the builder compares times).
                fresh = _needs_compiling(build_dir / f"{name}.so")
                if fresh:
                    _log.info("compiling the CPU kernels for this machine (~30 s on two cores; "
                              "`cadence build-kernels` does it ahead of time)")
                started = time.perf_counter()
                # The source by its resolved path, as `build_name` names it: a tree that
                # links to this folder (the mutation runner's copy of the core) then
                # writes the same build file and finds the build current, where its own
                # path would make the builder compile again (~30 s on two cores).
                _state["module"] = cpp_extension.load(
                    name=name, sources=[str(SOURCE.resolve())], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir), verbose=False)
                if fresh:
                    _log.info("CPU kernels compiled in %.1f s", time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - any build failure means: fall back, and say why
            _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            _log.warning("CPU paged attention kernel unavailable (%s); attention gathers blocks for SDPA",
                         _state["error"])
            return None
        return _state["module"]


def _needs_compiling(library: Path) -> bool:
    """Whether torch's builder will compile: no library yet, or the source is newer."""
    try:
        return SOURCE.stat().st_mtime > library.stat().st_mtime
    except FileNotFoundError:
        return True


@contextlib.contextmanager
def _sole_builder(build_dir: Path):
    """Hold this build directory alone while torch's builder runs in it.

    Torch's builder marks a build in progress with a plain `lock` file and waits, with
    no limit and no word, for it to go: a process killed mid-build (Ctrl-C in the
    first minute, a timeout) leaves the file and every later load hangs. An advisory
    `flock` on a file beside it is released by the kernel when its holder dies, so
    whoever holds it knows no live process of ours is building here, and a `lock`
    file found then is stale and removed. Without `fcntl` (not POSIX) torch's own
    lock alone serves."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(build_dir / "cadence-build.flock", "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.warning("waiting for another process building the CPU kernels in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = build_dir / "lock"
            if baton.exists():
                _log.warning("removing %s, left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_built() -> bool:
    """Whether `load` would find the extension compiled already and current (this process
    loaded it, or an earlier one built it from this source into torch's extension
    directory): where it would compile, a small model's first token would wait for that."""
    if "module" in _state:
        return True
    try:
        from torch.utils import cpp_extension

        name = build_name()
        return not _needs_compiling(Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so")
    except Exception:  # noqa: BLE001 - no build directory, or a torch without it: not built
        return False


def unavailable_reason() -> str | None:
    """Why `load` returned None, or None if it has not failed."""
    return _state.get("error")


def _kernels():
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU kernels could not be built: {unavailable_reason()}")
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of the rows of `x` [T, H] scaled by `weight` [H]; with `residual`, of
    `x + residual`, returning (normalised, x + residual)."""
    outputs = _kernels().rms_norm(x.contiguous(), weight, eps,
                                  None if residual is None else residual.contiguous())
    return outputs[0] if residual is None else tuple(outputs)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of logits [N, V]: the same index (the first of equal
    largest values, or the first NaN), several times faster than torch's on this
    path's CPUs."""
    return _kernels().argmax(logits.contiguous())


class SmallBatch:
    """The kernels' product (`small_product`) in `dtypes`, made for at most `rows` rows
    (more run in blocks of `rows`), of a weight laid out by `pack` as groups of
    SMALL_COLUMNS outputs, each input of a group (each pair of inputs in bfloat16) side
    by side ([groups, K / P, SMALL_COLUMNS, P] with P = 2 in bfloat16 and 1 in float32;
    the last group padded with zeros)."""

    def __init__(self, module) -> None:
        self.rows, self.columns = module.SMALL_ROWS, module.SMALL_COLUMNS
        names = module.small_product_dtypes()
        self.dtypes = frozenset(getattr(torch, name) for name in names)
        self._product_rows = module.product_rows
        self.product = module.small_product
        # Whether bfloat16 products (of a multiple of 32 inputs) run on AMX tiles here.
        self.tiles = bool(module.tile_products())

    def rows_for(self, dtype: torch.dtype, out_features: int, in_features: int) -> int:
        """The most rows a product of `dtype` and this shape runs here where oneDNN's
        copy is kept (fewer in bfloat16 where oneDNN has AMX tiles: 96 where these
        kernels use the tiles too, else the fewer the larger the product), the same
        bound the decode stack applies."""
        if dtype not in self.dtypes:
            return self.rows
        return self._product_rows(str(dtype).removeprefix("torch."), out_features, in_features)

    def on_tiles(self, dtype: torch.dtype, in_features: int) -> bool:
        """Whether products of this dtype and input count run on AMX tiles here from
        8 rows (bfloat16, whole tiles of 32 inputs)."""
        return self.tiles and dtype == torch.bfloat16 and in_features % 32 == 0

    def fits(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        per_run = 2 if weight.dtype == torch.bfloat16 else 1
        return (weight.dtype in self.dtypes and weight.shape[1] % per_run == 0
                and (bias is None or bias.dtype == weight.dtype))

    def packed_shape(self, out_features: int, in_features: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
        """The shape `pack` lays a [out_features, in_features] weight of `dtype` out in."""
        per_run = 2 if dtype == torch.bfloat16 else 1
        return -(-out_features // self.columns), in_features // per_run, self.columns, per_run

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`weight` in this product's layout: a new tensor, or written into `out` (of
        `packed_shape`, contiguous) and returned."""
        out_features, in_features = weight.shape
        shape = self.packed_shape(out_features, in_features, weight.dtype)
        groups, runs, columns, per_run = shape
        if out is None:
            out = torch.empty(shape, dtype=weight.dtype)
        elif out.shape != shape or out.dtype != weight.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {shape} {weight.dtype} tensor")
        # Written group by group from the weight itself (no padded copy of it is made).
        full = out_features // columns
        if full:
            out[:full].copy_(weight[:full * columns].view(full, columns, runs, per_run).permute(0, 2, 1, 3))
        if full < groups:  # the last group's outputs past out_features are zeros
            rest = out_features - full * columns
            out[full:].zero_()
            out[full, :, :rest].copy_(weight[full * columns:].reshape(rest, runs, per_run).permute(1, 0, 2))
        return out


def small_batch() -> SmallBatch | None:
    """The small-batch product where the kernels are built and this CPU runs it, else None."""
    module = load()
    if module is None or not module.small_product_dtypes():
        return None
    return SmallBatch(module)


def decode_stack(model):
    """The kernels' `DecodeStack` for a packed `CausalLM` (`CausalLM.pack`): its decoder
    layers in one call, for a decode step, a step whose attention runs a row at a time
    (`AttentionMetadata.row_block_tables`) or, where `stack_takes_prompts`, any step, bit
    for bit the results of the layers' own forward on this module's kernels. None where
    that path does not apply: the kernels are not built, or a layer has query/key norms,
    unpacked products or another norm epsilon."""
    from .cpu_linear import PackedLinear

    module = load()
    if module is None or not hasattr(module, "DecodeStack"):
        return None
    stack = model.model
    eps = stack.norm.eps
    layers = []
    for layer in stack.layers:
        attention, mlp = layer.self_attn, layer.mlp
        products = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (attention.q_norm is not None or not all(isinstance(p, PackedLinear) for p in products)
                or {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {eps}):
            return None
        qkv, o, gate_up, down = products
        layers.append([layer.input_layernorm.weight.detach(), *_product(qkv), *_product(o),
                       layer.post_attention_layernorm.weight.detach(), *_product(gate_up), *_product(down)])
    first = stack.layers[0].self_attn
    return module.DecodeStack(layers, stack.norm.weight.detach(), eps, first.num_heads, first.num_kv_heads,
                              first.head_dim, stack.layers[0].mlp.gate_up_proj.out_features // 2, first.scale,
                              stack.layers[0].mlp.chunk_rows or 0)


def stack_takes_prompts(model) -> bool:
    """Whether `decode_stack(model)` also runs steps with prompts in `paged_attention`'s
    form (each sequence's table, length and first query row): where that kernel takes
    the model's dtype and head size (AVX-512 builds). Elsewhere only a step whose prompt
    rows carry tables of their own (`AttentionMetadata.row_block_tables`) goes there."""
    module = load()
    first = model.model.layers[0].self_attn
    probe = torch.empty(0, first.num_heads, first.head_dim, dtype=model.model.norm.weight.dtype)
    return module is not None and module.has_paged_attention(probe)


def _product(linear) -> list:
    return [linear.packed_weight, linear.small_weight, linear.bias]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] tensors: in bfloat16 one kernel pass (rounded where
    torch's silu and mul round, its exp its own), else torch's ops."""
    if gate.dtype == torch.bfloat16 and gate.dim() == 2:
        return _kernels().silu_mul(gate, up)
    return torch.nn.functional.silu(gate).mul_(up)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Per-head norms (where given), the rotary embedding of q and k, and k, v stored at
    their cache slots; returns q. q [T, Hq, D], k, v [T, Hkv, D]; cos, sin [T, 1, D].

    Without norms, q and k are rotated in place (the attention block's own, fresh from
    its projection): a long prefill then makes no new [T, Hq, D] tensor per layer,
    whose first touch of fresh pages cost ~20 ms a layer at 8,192 tokens here."""
    kernels = _kernels()
    if q_norm_weight is not None:
        q = kernels.rms_norm(q.contiguous(), q_norm_weight, eps, None)[0]
        k = kernels.rms_norm(k.contiguous(), k_norm_weight, eps, None)[0]
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    kernels.rotary(q, cos, sin)
    kernels.rotary(k, cos, sin)
    if (k_cache.dtype == k.dtype and all(t.stride(1) == t.shape[2] and t.stride(2) == 1 for t in (k, v))
            and k_cache.is_contiguous()):
        kernels.store_kv(k, v, k_cache, v_cache, slot_mapping.long())
    else:
        write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q
