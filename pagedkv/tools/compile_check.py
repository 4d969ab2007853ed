"""Compile every Triton kernel for a GPU architecture without a GPU: `python -m pagedkv.tools.compile_check`.

The interpreter accepts code the GPU compiler rejects (dot shapes, types, shared-memory limits), so
this runs the real compiler (Triton -> PTX -> cubin via the ptxas bundled with Triton) for Hopper
(sm_90) on representative configurations, with the hints the JIT would infer at run time (16-byte
aligned pointers, strides divisible by 16). Exit status 0: all compiled; 1: a kernel failed;
3: no compiler toolchain here. Must run with TRITON_INTERPRET unset (it compiles JITFunctions).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import click

from pagedkv_kernels.heuristics import next_power_of_two

_PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "fp8_e4m3": "*fp8e4nv", "fp8_e5m2": "*fp8e5"}
_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
_FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def _attention_cases() -> Iterator[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    from pagedkv_kernels import triton_attention as ta

    # (dtype, head_dim, group, block_size, num_tokens, num_seqs, options): decode, prefill, mixed; GQA/MQA/MHA;
    # options: "" none, or w (sliding window), c (softcap), s (sinks, the given dtype).
    for dtype, head_dim, group, block_size, num_tokens, num_seqs, options in (
        ("bfloat16", 128, 8, 16, 256, 256, ""),
        ("bfloat16", 128, 8, 16, 8192, 1, ""),
        ("float16", 128, 1, 16, 8192, 4, ""),
        ("float16", 64, 4, 8, 100, 10, ""),
        ("float16", 80, 4, 32, 1, 1, ""),
        ("float16", 96, 2, 64, 1000, 8, ""),
        ("bfloat16", 256, 8, 16, 64, 64, ""),
        ("bfloat16", 256, 4, 16, 4096, 2, ""),
        ("float32", 128, 8, 16, 64, 64, ""),
        ("float32", 256, 1, 16, 4096, 2, ""),
        ("bfloat16", 128, 32, 16, 4096, 4, ""),
        ("bfloat16", 256, 2, 16, 4096, 2, "wc"),  # Gemma 2/3
        ("bfloat16", 256, 2, 16, 64, 64, "wc"),
        ("bfloat16", 64, 8, 16, 4096, 4, "ws"),  # gpt-oss
        ("bfloat16", 64, 8, 16, 256, 256, "ws"),
        ("float32", 128, 4, 16, 100, 10, "wcs"),
        ("bfloat16/fp8_e4m3", 128, 8, 16, 256, 256, ""),  # fp8 KV caches ("q dtype/cache dtype")
        ("float16/fp8_e5m2", 128, 4, 16, 4096, 4, ""),
        ("bfloat16/fp8_e4m3", 256, 2, 16, 64, 64, "wc"),
    ):
        dtype, _, kv = dtype.partition("/")
        cfg = ta.attention_config(num_tokens, num_seqs, group, head_dim, _BYTES[kv or dtype])
        p = _PTR[dtype]
        sig = dict(
            q_ptr=p,
            k_cache_ptr=_PTR[kv or dtype],
            v_cache_ptr=_PTR[kv or dtype],
            out_ptr=p,
            block_tables_ptr="*i32",
            query_start_ptr="*i32",
            seq_lens_ptr="*i32",
            part_m_ptr="*fp32",
            part_l_ptr="*fp32",
            part_acc_ptr="*fp32",
            sinks_ptr=_PTR[dtype] if "s" in options else "*fp32",
            qk_scale_log2="fp32",
            window="i32",
            cap_pre="fp32",
            cap_post="fp32",
            num_seqs="i32",
            num_heads="i32",
            search_steps="i32",
            num_splits="i32",
            stride_q_tok="i32",
            stride_q_head="i32",
            stride_o_tok="i32",
            stride_o_head="i32",
            stride_block="i32",
            stride_token="i32",
            stride_head="i32",
            stride_bt_seq="i32",
        )
        consts = dict(
            BLOCK_SIZE=block_size,
            GROUP=group,
            GROUP_P=cfg.group_p,
            BLOCK_Q=cfg.block_q,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            HEAD_DIM=head_dim,
            HEAD_P=cfg.head_p,
            IEEE_DOT=dtype == "float32",
            SLIDING="w" in options,
            SOFTCAP="c" in options,
            SINKS="s" in options,
        )
        label = f"attention {dtype}{'/' + kv if kv else ''} d={head_dim} group={group} bs={block_size} "
        label += f"tokens={num_tokens} seqs={num_seqs}"
        label += f" options={options}" if options else ""
        yield label, ta._paged_attention_kernel, sig, consts, cfg.num_warps, cfg.num_stages
    for dtype, head_dim, splits, sinks in (
        ("bfloat16", 128, 32, False),
        ("float16", 80, 2, False),
        ("float32", 256, 64, False),
        ("bfloat16", 64, 16, True),
    ):
        sig = dict(
            out_ptr=_PTR[dtype],
            part_m_ptr="*fp32",
            part_l_ptr="*fp32",
            part_acc_ptr="*fp32",
            query_start_ptr="*i32",
            sinks_ptr=_PTR[dtype] if sinks else "*fp32",
            num_heads="i32",
            num_splits="i32",
            stride_o_tok="i32",
            stride_o_head="i32",
        )
        consts = dict(
            HEAD_DIM=head_dim, HEAD_P=next_power_of_two(head_dim), SPLITS_P=next_power_of_two(splits), SINKS=sinks
        )
        label = f"reduce {dtype} d={head_dim} splits={splits}" + (" sinks" if sinks else "")
        yield label, ta._reduce_splits_kernel, sig, consts, 4, 3


def _cache_cases() -> Iterator[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    from pagedkv_kernels import triton_cache as tc

    for dtype, head_dim, heads, block_size, slot in (
        ("bfloat16", 128, 8, 16, "i64"),
        ("float16", 80, 2, 8, "i32"),
        ("float32", 256, 32, 64, "i64"),
        ("bfloat16/fp8_e4m3", 128, 8, 16, "i64"),
        ("float32/fp8_e5m2", 64, 2, 16, "i64"),
    ):
        dtype, _, kv = dtype.partition("/")
        p = _PTR[dtype]
        sig = dict(
            key_ptr=p,
            value_ptr=p,
            k_cache_ptr=_PTR[kv or dtype],
            v_cache_ptr=_PTR[kv or dtype],
            slot_mapping_ptr="*" + slot,
            num_slots="i64",
            num_kv_heads="i32",
            stride_k_tok="i32",
            stride_k_head="i32",
            stride_v_tok="i32",
            stride_v_head="i32",
            stride_block="i32",
            stride_token="i32",
            stride_head="i32",
            k_scale="fp32",
            v_scale="fp32",
        )
        head_p = next_power_of_two(head_dim)
        consts = dict(
            BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim,
            HEAD_P=head_p,
            BLOCK_H=min(next_power_of_two(heads), max(1, 4096 // head_p)),
            FP8_MAX=_FP8_MAX.get(kv, 0.0),
        )
        label = f"write_kv {dtype}{'/' + kv if kv else ''} d={head_dim} heads={heads} slots={slot}"
        yield label, tc._write_kv_kernel, sig, consts, 4, 3
    for dtype in ("bfloat16", "float32", "fp8_e4m3"):
        sig = dict(cache_addrs_ptr="*i64", mapping_ptr="*i64", typed_ptr=_PTR[dtype], block_numel="i32")
        yield f"copy_blocks {dtype}", tc._copy_blocks_kernel, sig, dict(CHUNK=4096), 4, 3


def _moe_cases() -> Iterator[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    from pagedkv_kernels import triton_moe as tm

    # (dtype, pairs, experts, hidden, inter, biased, activation): decode and prefill of Mixtral/Qwen3-MoE/gpt-oss.
    for dtype, pairs, experts, hidden, inter, biased, activation in (
        ("bfloat16", 8, 128, 2048, 768, False, "silu"),
        ("bfloat16", 512, 32, 2880, 2880, True, "swiglu_oai"),
        ("float16", 4096, 8, 4096, 14336, False, "gelu_tanh"),
        ("float32", 300, 16, 96, 40, True, "swiglu_oai"),
    ):
        cfg = tm.moe_config(pairs, experts, hidden, inter, _BYTES[dtype])
        p = _PTR[dtype]
        sig = dict(
            hidden_ptr=p,
            w_gate_up_ptr=p,
            w_down_ptr=p,
            b_gate_up_ptr=p,
            b_down_ptr=p,
            routing_ptr="*fp32",
            pairs_ptr="*i32",
            tile_experts_ptr="*i32",
            acc_ptr="*fp32",
            hidden_size="i32",
            inter_size="i32",
            num_experts="i32",
            top_k="i32",
            alpha="fp32",
            limit="fp32",
            **{f"stride_{name}": "i32" for name in ("x_tok", "gu_e", "gu_n", "d_e", "d_n", "bgu_e", "bd_e")},
        )
        consts = dict(
            stride_gu_k=1,  # contiguous weights: the JIT makes a stride of 1 a constant
            stride_d_k=1,
            HAS_B_GATE_UP=biased,
            HAS_B_DOWN=biased,
            ACTIVATION=tm.ACTIVATION_CODES[activation],
            IEEE_DOT=dtype == "float32",
            BLOCK_M=cfg.block_m,
            BLOCK_I=cfg.block_i,
            BLOCK_K=cfg.block_k,
            BLOCK_N=cfg.block_n,
        )
        label = f"moe {dtype} pairs={pairs} experts={experts} H={hidden} I={inter} {activation} bias={biased}"
        yield label, tm._fused_experts_kernel, sig, consts, cfg.num_warps, cfg.num_stages


def _cases() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    return [*_attention_cases(), *_cache_cases(), *_moe_cases()]


def _compile_case(arch: int, index: int) -> tuple[bool, str]:
    """Compile case `index` of `_cases()` for `sm_<arch>`: whether it compiled, and the line that says so."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    label, kernel, sig, consts, num_warps, num_stages = _cases()[index]
    names = kernel.arg_names
    # What the JIT infers at run time for real inputs: aligned pointers, strides divisible by 16.
    hinted = [k for k, t in sig.items() if t.startswith("*") or k.startswith("stride") or k == "block_numel"]
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in hinted if k != "stride_bt_seq"}
    src = ASTSource(kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
    try:
        target = GPUTarget("cuda", arch, 32)
        compiled = triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))
        return True, f"ok    {label}: shared memory {compiled.metadata.shared} B"
    except Exception as exc:
        return False, f"FAIL  {label}: {type(exc).__name__}: {str(exc)[:2000]}"


def compile_all(arch: int, echo=click.echo, workers: int | None = None) -> bool:
    """Compile every case for `sm_<arch>`, on `workers` processes (default: one per usable core: each compile is
    single-threaded, and the cases are independent); echo a line per case, in the cases' order. Return whether
    all compiled."""
    count = len(_cases())
    workers = max(1, min(count, workers or len(os.sched_getaffinity(0))))
    if workers == 1:
        results = [_compile_case(arch, i) for i in range(count)]
    else:
        # fork: the workers inherit the imported kernel modules (and no GPU context exists to break).
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            results = list(pool.map(_compile_case, [arch] * count, range(count)))
    for _, line in results:
        echo(line)
    return all(ok for ok, _ in results)


@click.command()
@click.option("--arch", default=90, show_default=True, help="CUDA compute capability, e.g. 90 for H100/H200.")
def main(arch: int) -> None:
    """Compile every kernel for sm_<arch> without a GPU."""
    os.environ.pop("TRITON_INTERPRET", None)  # before the kernel modules are imported (lazily, below)
    try:
        import triton.backends.nvidia  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        click.echo(f"no Triton NVIDIA toolchain: {exc}")
        sys.exit(3)
    sys.exit(0 if compile_all(arch) else 1)


if __name__ == "__main__":
    main()
