"""The CPU kernels (`csrc/cpu_kernels.cpp`): built on first use, loaded with ctypes.

Why native: on the CPU, batched torch has to gather every decode row's blocks into a contiguous copy before SDPA
can read them, so each step moves the whole KV cache three times (read, write, read again); this kernel reads each
block once, where it lies. On a 2-core VM with 256 rows of 16-512 tokens it took 4.1 ms a layer against 14 ms.
The fused per-token steps (`pagedkv_kernels.pointwise`) replace a dozen small torch ops a layer, each a pass over memory
and a dispatch, with one pass.

The source is compiled by the system C++ compiler ($CXX, else c++) with `-O3 -march=native -fopenmp` into
$PAGEDKV_HOME/native/ (~/.cache/pagedkv), named by a hash of the source, the flags, the compiler's version and
this CPU's feature flags, so a changed source or another machine builds afresh and concurrent first uses race
harmlessly (each writes its own temporary file and renames it into place). A build takes about 2 s. The library
needs `libgomp.so.1`: torch has already loaded its own by that name, so the kernel's threads are torch's.

PAGEDKV_CPU_KERNELS chooses: `auto` (default: native when it builds, else torch: the gather path for attention,
eager ops for the rest, with one warning saying why), `native` (a build failure is an error), `torch` (never build).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from common.home import pagedkv_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
ABI = 7
CHOICE_ENV = "PAGEDKV_CPU_KERNELS"
CHOICES = ("auto", "native", "torch")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
HEAD_DIMS = (32, 64, 80, 96, 128, 256)
MAX_GROUP = 16
MAX_BLOCK_SIZE = 256
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_ERRORS = {
    1: "unsupported shape",
    2: "a block table or slot mapping names a block or slot outside the cache",
    3: "a sequence length is below 1 or beyond its block table",
    4: "a decode row names a token or sequence out of range, or a position is beyond the rotary table",
}


class NativeKernelError(RuntimeError):
    """The native kernel could not be built, or refused its arguments; the message says which and why."""


def choice() -> str:
    value = os.environ.get(CHOICE_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{CHOICE_ENV}={value!r} is not one of {CHOICES}")
    return value


def supports(key_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether the kernel handles this cache (dtype, head size, block size, heads per KV head)."""
    _, block_size, kv_heads, head_dim = key_cache.shape
    return (
        key_cache.device.type == "cpu"
        and key_cache.dtype in _DTYPES
        and head_dim in HEAD_DIMS
        and block_size <= MAX_BLOCK_SIZE
        and num_heads % kv_heads == 0
        and num_heads // kv_heads <= MAX_GROUP
    )


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where the gather path is to be used (by choice or build failure)."""
    mode = choice()
    if mode == "torch":
        return None
    try:
        return _load()
    except NativeKernelError as exc:
        if mode == "native":
            raise
        _warn_once(str(exc))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("CPU kernels fall back to torch (slower: gathered attention, eager per-token ops): %s", reason)


@functools.cache
def _load() -> ctypes.CDLL:
    path = _build()
    lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
    if lib.pagedkv_native_abi() != ABI:
        raise NativeKernelError(f"{path} implements ABI {lib.pagedkv_native_abi()}, this pagedkv expects {ABI}")
    fn = lib.pagedkv_decode_attention
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32, i32, i32, i32]
    fn.argtypes += [ctypes.c_float, i32, i32, ctypes.c_float, ptr]
    lib.pagedkv_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32]
    lib.pagedkv_silu_mul.argtypes = [ptr, ptr, i64, i64, i32]
    lib.pagedkv_rope_write_kv.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i64, i64, i32]
    lib.pagedkv_pin_workers.argtypes = [ptr, i32]
    lib.pagedkv_argmax.argtypes = [ptr, i64, i64, ptr, i32]
    fn = lib.pagedkv_prefill_attention
    fn.argtypes = [ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32, i32, i32, i32]
    fn.argtypes += [ctypes.c_float, i32, i32, ctypes.c_float, ptr]
    for name in (
        "decode_attention",
        "prefill_attention",
        "add_rms_norm",
        "silu_mul",
        "rope_write_kv",
        "pin_workers",
        "argmax",
    ):
        getattr(lib, f"pagedkv_{name}").restype = i32
    return lib


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise NativeKernelError("no C++ compiler found (set CXX, or install g++)")
    return cxx


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build() -> Path:
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelError(f"{cxx} --version failed: {exc}") from None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()]))
    out_dir = pagedkv_home() / "native"
    target = out_dir / f"cpu_kernels-{key.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
        os.close(fd)
    except OSError as exc:
        raise NativeKernelError(f"cannot write to {out_dir}: {exc}") from None
    try:
        done = subprocess.run(
            [cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300, check=False
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()[:3]
            raise NativeKernelError(f"{cxx} failed to build {SOURCE.name}: {' | '.join(detail)}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelError(f"building {SOURCE.name} failed: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """out[tokens[i]] = attention of q[tokens[i]] over sequence seqs[i]'s first seq_lens[seqs[i]] cached positions.

    q [T, h, d] and out [T, h, d] float32 contiguous; caches [blocks, block_size, kv_heads, d] contiguous, of one
    dtype in `_DTYPES`; block_tables [S, W] and seq_lens [S] int32; tokens and seqs [R] int64. The options are
    `pagedkv_kernels.dispatch.paged_attention`'s; sinks float32 contiguous [h]."""
    tables, lens = _check_attention(
        q, key_cache, value_cache, block_tables, seq_lens, out, sliding_window, softcap, sinks
    )
    _require(tokens.dtype == seqs.dtype == torch.int64 and tokens.shape == seqs.shape, "rows")
    _require(tokens.is_contiguous() and seqs.is_contiguous(), "rows not contiguous")
    status = lib.pagedkv_decode_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        _DTYPES[key_cache.dtype],
        tables.data_ptr(),
        lens.data_ptr(),
        tokens.data_ptr(),
        seqs.data_ptr(),
        out.data_ptr(),
        tokens.numel(),
        *_attention_shape(q, key_cache, tables, scale),
        *_attention_options(sliding_window, softcap, sinks),
    )
    _raise_on(status, "decode attention")


def prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seqs: torch.Tensor,
    begins: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of the chunks of several query tokens: chunk i's tokens q[begins[i] : begins[i] +
    q_lens[i]] are the last q_lens[i] of sequence seqs[i]'s seq_lens[seqs[i]] cached positions, each seeing the
    positions up to its own. seqs, begins and q_lens [C] int64; the rest as `decode_attention`."""
    tables, lens = _check_attention(
        q, key_cache, value_cache, block_tables, seq_lens, out, sliding_window, softcap, sinks
    )
    _require(seqs.dtype == begins.dtype == q_lens.dtype == torch.int64, "chunks")
    _require(seqs.shape == begins.shape == q_lens.shape and seqs.dim() == 1, "chunks shape")
    _require(seqs.is_contiguous() and begins.is_contiguous() and q_lens.is_contiguous(), "chunks not contiguous")
    status = lib.pagedkv_prefill_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        _DTYPES[key_cache.dtype],
        tables.data_ptr(),
        lens.data_ptr(),
        seqs.data_ptr(),
        begins.data_ptr(),
        q_lens.data_ptr(),
        out.data_ptr(),
        seqs.numel(),
        *_attention_shape(q, key_cache, tables, scale),
        *_attention_options(sliding_window, softcap, sinks),
    )
    _raise_on(status, "prefill attention")


def _check_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks both attention calls make of what they share; the tables and lengths, contiguous."""
    head_dim = key_cache.shape[3]
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    _require(q.dtype == out.dtype == torch.float32 and q.is_contiguous() and out.is_contiguous(), "q, out")
    _require(q.dim() == 3 and q.shape == out.shape and q.shape[2] == head_dim, "q, out shape")
    _require(key_cache.is_contiguous() and value_cache.is_contiguous(), "caches not contiguous")
    _require(value_cache.shape == key_cache.shape and value_cache.dtype == key_cache.dtype, "caches differ")
    _require(
        tables.dtype == lens.dtype == torch.int32 and tables.dim() == 2 and lens.shape == tables.shape[:1], "tables"
    )
    _require(sliding_window is None or sliding_window >= 1, "sliding_window")
    _require(softcap is None or 0 < softcap < float("inf"), "softcap")
    if sinks is not None:
        _require(sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.shape == q.shape[1:2], "sinks")
    return tables, lens


def _attention_shape(q: torch.Tensor, key_cache: torch.Tensor, tables: torch.Tensor, scale: float) -> tuple:
    """num_tokens, num_seqs, width, num_blocks, block_size, heads, kv_heads, head_dim, scale, threads."""
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    return (
        q.shape[0],
        tables.shape[0],
        tables.shape[1],
        num_blocks,
        block_size,
        q.shape[1],
        kv_heads,
        head_dim,
        scale,
        torch.get_num_threads(),
    )


def _attention_options(sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> tuple:
    # A window past any int32 length is no window.
    return min(sliding_window or 0, 2**31 - 1), softcap or 0.0, None if sinks is None else sinks.data_ptr()


def add_rms_norm(
    lib: ctypes.CDLL, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += delta (in place, when given); returns RMSNorm(residual) * weight. float32, contiguous [T, H]."""
    rows, hidden = residual.shape
    _require(residual.dtype == weight.dtype == torch.float32 and residual.is_contiguous(), "residual")
    _require(weight.shape == (hidden,) and weight.is_contiguous(), "weight")
    if delta is not None:
        _require(delta.shape == residual.shape and delta.dtype == torch.float32 and delta.is_contiguous(), "delta")
    out = torch.empty_like(residual)
    status = lib.pagedkv_add_rms_norm(
        residual.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
        torch.get_num_threads(),
    )
    _raise_on(status, "add_rms_norm")
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a float32 contiguous [T, 2I] whose halves are gate and up."""
    rows, width = gate_up.shape
    _require(gate_up.dtype == torch.float32 and gate_up.is_contiguous() and width % 2 == 0, "gate_up")
    out = gate_up.new_empty(rows, width // 2)
    _raise_on(
        lib.pagedkv_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()), "silu_mul"
    )
    return out


def argmax(lib: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value (a NaN counting as largest, as torch.argmax), of a float32
    contiguous [rows, cols] with cols >= 1."""
    _require(logits.dtype == torch.float32 and logits.is_contiguous() and logits.dim() == 2, "logits")
    rows, cols = logits.shape
    _require(cols >= 1, "logits")
    out = torch.empty(rows, dtype=torch.int64)
    _raise_on(lib.pagedkv_argmax(logits.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads()), "argmax")
    return out


def rope_write_kv(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """The rotary embedding of q and k, k and v written into the caches at `slot_mapping` (-1: skipped); returns the
    rotated q [T, heads, d]. qkv float32 contiguous [T, (heads + 2 kv_heads) d]; cos, sin [positions, d]."""
    _, _, kv_heads, head_dim = key_cache.shape
    tokens = qkv.shape[0]
    _require(qkv.dtype == torch.float32 and qkv.is_contiguous(), "qkv")
    _require(qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * kv_heads) * head_dim, "qkv shape")
    _require(key_cache.dtype == value_cache.dtype == torch.float32, "caches not float32")
    _require(key_cache.is_contiguous() and value_cache.is_contiguous(), "caches not contiguous")
    _require(value_cache.shape == key_cache.shape, "caches differ")
    _require(cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous(), "rotary tables")
    _require(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim, "rotary table shape")
    _require(positions.dtype == slot_mapping.dtype == torch.int64, "positions, slot_mapping")
    _require(positions.shape == slot_mapping.shape == (tokens,), "positions, slot_mapping shape")
    _require(positions.is_contiguous() and slot_mapping.is_contiguous(), "positions, slot_mapping")
    q = qkv.new_empty(tokens, num_heads, head_dim)
    status = lib.pagedkv_rope_write_kv(
        qkv.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        q.data_ptr(),
        tokens,
        num_heads,
        kv_heads,
        head_dim,
        cos.shape[0],
        key_cache.shape[0] * key_cache.shape[1],
        torch.get_num_threads(),
    )
    _raise_on(status, "rope_write_kv")
    return q


def pin_workers(lib: ctypes.CDLL, threads: int) -> list[int] | None:
    """Pin torch's OpenMP worker threads (team threads 1..threads-1) one to a CPU of this process's affinity, the
    caller's thread left free; the CPUs used, or None when there are fewer CPUs than threads or pinning failed."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    if threads < 2 or len(cpus) < threads:
        return None
    array = (ctypes.c_int * len(cpus))(*cpus)
    return cpus if lib.pagedkv_pin_workers(array, len(cpus)) == 0 else None


def _raise_on(status: int, what: str) -> None:
    if status:
        raise NativeKernelError(f"{what} refused its input: {_ERRORS.get(status, f'status {status}')}")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise NativeKernelError(f"native kernel refused its input: {what}")
