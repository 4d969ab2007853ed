"""FP8 KV caches: quantization, the write paths and every attention backend against a float64 oracle.

The oracle is the paged reference in float64 over the caches *dequantized* (`float(stored) * scale`): upcasting
fp8 to float16/32 is exact, so each backend must match it to the tolerance of its query dtype (TOLERANCES, the
same as non-fp8 caches). Scales 0.5 and 2.0 are powers of two (the post-multiply by v_scale is exact); 0.37 checks
an inexact one with float32.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv_kernels import copy_blocks, paged_attention, pointwise, quant, reference, write_kv
from tests.kernels.paged_case import DEVICE, ON_GPU, TOLERANCES, make_batch, poisoned_like

FP8 = quant.FP8_DTYPES
# The CPU backend twice: decode rows by the native kernel (its 256-entry byte tables), and by gather + SDPA.
BACKENDS = ("reference", "torch-native", "torch-sdpa", "triton")


def _backend(name: str, monkeypatch) -> str:
    if name.startswith("torch-"):
        monkeypatch.setenv("PAGEDKV_CPU_KERNELS", "native" if name == "torch-native" else "torch")
        return "torch"
    return name


def test_quantize_round_trips_grid_values_and_saturates():
    for dtype in FP8:
        grid = torch.arange(256, dtype=torch.uint8).view(dtype)
        finite = grid[torch.isfinite(grid.float())]
        back = quant.quantize(quant.dequantize(finite, 0.25), dtype, 0.25)
        assert torch.equal(back.view(torch.uint8), finite.view(torch.uint8))  # every finite code survives
        bound = quant.fp8_max(dtype)
        big = torch.tensor([1e9, -1e9, float("inf"), -float("inf"), 2 * bound])
        assert quant.quantize(big, dtype, 1.0).float().tolist() == [bound, -bound, bound, -bound, bound]
        assert torch.isnan(quant.quantize(torch.tensor([float("nan")]), dtype, 1.0).float()).all()
        x = torch.randn(4096) * 10
        x = x[x.abs() >= torch.finfo(dtype).smallest_normal]  # subnormals have fewer bits
        rel = ((quant.dequantize(quant.quantize(x, dtype, 1.0), 1.0) - x).abs() / x.abs()).max()
        assert rel <= (2**-4 if dtype == torch.float8_e4m3fn else 2**-3) + 1e-6  # half an ulp: 3 or 2 mantissa bits
    assert quant.fp8_max(torch.float8_e4m3fn) == 448.0 and quant.fp8_max(torch.float8_e5m2) == 57344.0


def _caches(shape, dtype):
    return torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_quantizes_with_saturation(backend, dtype, monkeypatch):
    backend = _backend(backend, monkeypatch)
    tokens, heads, dim = 37, 2, 64
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(tokens, heads, dim, generator=gen) * 4).to(DEVICE)
    v = (torch.randn(tokens, heads, dim, generator=gen) * 4).to(DEVICE)
    if backend == "triton" and not ON_GPU:
        # The interpreter's fp8 cast does not carry a round-up into the exponent (7.97 -> 4, not 8): on the CPU
        # Triton gets values already on the fp8 grid (its saturation still tested); bit-exact on a GPU.
        k, v = (
            quant.dequantize(quant.quantize(k, dtype, 0.5), 0.5),
            quant.dequantize(quant.quantize(v, dtype, 2.0), 2.0),
        )
    k[0, 0, :4] = torch.tensor([1e6, -1e6, float("inf"), 0.0])
    kc, vc = _caches((4, 16, heads, dim), dtype)
    slots = torch.randperm(64, generator=gen)[:tokens].to(DEVICE)
    slots[5] = -1  # padding: skipped
    write_kv(k, v, kc, vc, slots, k_scale=0.5, v_scale=2.0, backend=backend)
    keep = slots >= 0
    for cache, x, scale in ((kc, k, 0.5), (vc, v, 2.0)):
        stored = cache.view(-1, heads, dim)[slots[keep]]
        assert torch.equal(stored.view(torch.uint8), quant.quantize(x[keep], dtype, scale).view(torch.uint8))
    assert kc.view(-1, heads, dim)[slots[0], 0, :3].float().tolist() == [
        448.0 if dtype == FP8[0] else 57344.0,
        -quant.fp8_max(dtype),
        quant.fp8_max(dtype),
    ]
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[keep].cpu()] = False
    assert not kc.view(-1, heads, dim)[untouched.to(DEVICE)].float().any()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_attention_over_fp8_caches_matches_the_dequantized_oracle(backend, dtype, q_dtype, monkeypatch):
    backend = _backend(backend, monkeypatch)
    seqs = [(1, 70), (1, 5), (9, 40), (17, 17), (1, 33)]  # decode rows, a chunk after a prefix, a fresh prefill
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=q_dtype, seed=3)
    scales = (0.37, 1.7) if q_dtype == torch.float32 else (0.5, 2.0)
    kc, vc = (quant.quantize(c, dtype, s) for c, s in zip((batch.key_cache, batch.value_cache), scales))
    out = paged_attention(
        batch.q,
        kc,
        vc,
        *batch.args()[3:],
        k_scale=scales[0],
        v_scale=scales[1],
        out=poisoned_like(batch.q),
        sliding_window=None,
        backend=backend,
    )
    oracle = reference.paged_attention(
        batch.q.double(),
        quant.dequantize(kc, scales[0], torch.float64),
        quant.dequantize(vc, scales[1], torch.float64),
        *batch.args()[3:],
        batch.scale,
        torch.empty(batch.q.shape, dtype=torch.float64, device=DEVICE),
    )
    torch.testing.assert_close(out.double(), oracle, **TOLERANCES[q_dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_moves_fp8_bytes(backend, monkeypatch):
    backend = _backend(backend, monkeypatch)
    kc, vc = _caches((6, 16, 2, 32), torch.float8_e4m3fn)
    kc.view(torch.uint8).copy_(torch.randint(0, 120, kc.shape, dtype=torch.uint8))
    vc.view(torch.uint8).copy_(torch.randint(0, 120, vc.shape, dtype=torch.uint8))
    before_k, before_v = kc.clone(), vc.clone()
    copy_blocks([kc], [vc], ([0, 3], [4, 5]), backend=backend)
    for cache, before in ((kc, before_k), (vc, before_v)):
        assert torch.equal(cache[4].view(torch.uint8), before[0].view(torch.uint8))
        assert torch.equal(cache[5].view(torch.uint8), before[3].view(torch.uint8))
        assert torch.equal(cache[:4].view(torch.uint8), before[:4].view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_fused_rope_write_quantizes_into_fp8_caches(dtype):
    """`pointwise.rope_write_kv` on fp8 caches: the same bytes as rotating in torch, then quantizing."""
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    gen = torch.Generator().manual_seed(4)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(DEVICE)
    positions = torch.tensor([0, 3, 7, 8, 30], device=DEVICE)
    angles = torch.arange(64)[:, None] * torch.rand(dim, generator=gen)[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    kc, vc = _caches((2, 16, kv_heads, dim), dtype)
    slots = torch.tensor([0, 1, 17, 20, 31], device=DEVICE)
    q = pointwise.rope_write_kv(qkv, positions, cos, sin, slots, kc, vc, heads, k_scale=0.5, v_scale=2.0)
    _, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    k = pointwise.rotate(k.reshape(tokens, kv_heads, dim), c, s)
    expected_q = pointwise.rotate(qkv[:, : heads * dim].reshape(tokens, heads, dim), c, s)
    torch.testing.assert_close(q, expected_q)
    stored_k, stored_v = kc.view(-1, kv_heads, dim)[slots], vc.view(-1, kv_heads, dim)[slots]
    assert torch.equal(stored_k.view(torch.uint8), quant.quantize(k, dtype, 0.5).view(torch.uint8))
    expected_v = quant.quantize(v.reshape(tokens, kv_heads, dim), dtype, 2.0)
    assert torch.equal(stored_v.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.skipif(ON_GPU, reason="the native CPU kernel")
@pytest.mark.parametrize("dtype", FP8)
def test_native_kernel_decodes_every_fp8_byte_as_torch(dtype, monkeypatch):
    """One visible slot whose V holds all 256 codes: the output is V itself, as the kernel's table decodes it."""
    monkeypatch.setenv("PAGEDKV_CPU_KERNELS", "native")
    codes = torch.arange(256, dtype=torch.uint8)
    kc, vc = _caches((1, 16, 1, 256), dtype)
    vc.view(torch.uint8)[0, 0, 0] = codes
    out = paged_attention(
        torch.zeros(1, 1, 256),
        kc,
        vc,
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        backend="torch",
    )[0, 0]
    expected = codes.view(dtype).float()
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(out[~torch.isnan(out)], expected[~torch.isnan(expected)])


def test_scales_are_checked():
    k = torch.zeros(1, 2, 32, device=DEVICE)
    fp8c = _caches((1, 16, 2, 32), torch.float8_e4m3fn)
    f32c = _caches((1, 16, 2, 32), torch.float32)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale must be a finite float > 0"):
        write_kv(k, k, *fp8c, slots, k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale must be a finite float > 0"):
        write_kv(k, k, *fp8c, slots, v_scale=float("nan"))
    with pytest.raises(ValueError, match="apply to fp8 caches only"):
        write_kv(k, k, *f32c, slots, k_scale=2.0)
    with pytest.raises(TypeError, match=r"key has dtype torch\.float64"):
        write_kv(k.double(), k.double(), *fp8c, slots)
    assert quant.kv_cache_dtype("fp8", torch.float16) == torch.float8_e4m3fn
    assert quant.kv_cache_dtype("auto", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="kv cache dtype must be one of"):
        quant.kv_cache_dtype("int8", torch.float16)
