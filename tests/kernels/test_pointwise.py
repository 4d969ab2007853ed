"""The fused per-token steps (`pagedkv_kernels.pointwise`): the native CPU form against the torch form and a float64
computation of the same formula, on fresh random inputs; and the checks that keep a bad slot or position out."""

from __future__ import annotations

import pytest
import torch

from pagedkv_kernels import cpu_native, pointwise


@pytest.fixture(params=["native", "torch"])
def form(request, monkeypatch):
    monkeypatch.setenv(cpu_native.CHOICE_ENV, request.param)
    return request.param


def _rms64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 256), (300, 256), (3, 1000)])
def test_add_rms_norm(form, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    residual = torch.randn(rows, hidden, generator=gen) * 3
    delta = torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    want_sum = residual.double() + delta.double()
    summed, normed = pointwise.add_rms_norm(residual.clone(), delta, weight, 1e-6)
    torch.testing.assert_close(summed.double(), want_sum, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(normed.double(), _rms64(want_sum, weight, 1e-6), atol=1e-5, rtol=1e-5)
    kept, alone = pointwise.add_rms_norm(residual, None, weight, 1e-6)  # no delta: the norm only
    assert kept is residual or torch.equal(kept, residual)
    torch.testing.assert_close(alone.double(), _rms64(residual, weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_native_add_rms_norm_adds_in_place_and_matches_torch(monkeypatch):
    monkeypatch.setenv(cpu_native.CHOICE_ENV, "native")
    gen = torch.Generator().manual_seed(1)
    residual, delta, weight = torch.randn(50, 128, generator=gen), torch.randn(50, 128, generator=gen), torch.randn(128)
    before = residual.clone()
    summed, normed = pointwise.add_rms_norm(residual, delta, weight, 1e-5)
    assert summed.data_ptr() == residual.data_ptr() and torch.equal(residual, before + delta)
    monkeypatch.setenv(cpu_native.CHOICE_ENV, "torch")
    _, eager = pointwise.add_rms_norm(before, delta, weight, 1e-5)
    torch.testing.assert_close(normed, eager, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rows, inter", [(1, 16), (300, 704), (5, 1001)])
def test_silu_mul(form, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6  # past +-20 too, where exp must not overflow
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    g, u = gate_up.double().chunk(2, dim=-1)
    want = g * torch.sigmoid(g) * u
    got = pointwise.silu_mul(gate_up)
    assert got.shape == (rows, inter) and got.isfinite().all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _rope_case(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    max_position = 512
    angles = torch.randn(max_position, head_dim // 2, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    positions = torch.randint(0, max_position, (tokens,), generator=gen)
    num_blocks, block_size = 8, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = [torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan")) for _ in range(2)]
    return qkv, positions, cos, sin, slots, caches


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 4, 4, 32), (37, 8, 2, 64), (100, 8, 4, 32)])
def test_rope_write_kv(form, tokens, heads, kv_heads, head_dim):
    qkv, positions, cos, sin, slots, (key_cache, value_cache) = _rope_case(tokens, heads, kv_heads, head_dim, tokens)
    slots[0] = -1  # a padding token: its K/V is not written
    q = pointwise.rope_write_kv(qkv, positions, cos, sin, slots, key_cache, value_cache, heads)
    x = qkv.double()
    qs, ks, vs = x.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]
    torch.testing.assert_close(q.double(), _rope64(qs.view(tokens, heads, head_dim), c, s), atol=1e-5, rtol=1e-5)
    flat_k, flat_v = key_cache.view(-1, kv_heads, head_dim), value_cache.view(-1, kv_heads, head_dim)
    written = slots >= 0
    want_k = _rope64(ks.view(tokens, kv_heads, head_dim), c, s)[written]
    torch.testing.assert_close(flat_k[slots[written]].double(), want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flat_v[slots[written]].double(), vs.view(tokens, kv_heads, head_dim)[written])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()  # nothing else was written


@pytest.mark.parametrize("spoil, message", [("slot", "outside the cache"), ("position", "rotary table")])
def test_native_rope_refuses_a_bad_slot_or_position_before_writing(monkeypatch, spoil, message):
    monkeypatch.setenv(cpu_native.CHOICE_ENV, "native")
    qkv, positions, cos, sin, slots, (key_cache, value_cache) = _rope_case(4, 4, 2, 32, 0)
    if spoil == "slot":
        slots[3] = key_cache.shape[0] * key_cache.shape[1]
    else:
        positions[3] = cos.shape[0]
    with pytest.raises(cpu_native.NativeKernelError, match=message):
        cpu_native.rope_write_kv(cpu_native.library(), qkv, positions, cos, sin, slots, key_cache, value_cache, 4)
    assert key_cache.isnan().all() and value_cache.isnan().all()


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 17), (256, 4096), (5, 100_003)])
def test_argmax_rows_matches_torch(form, rows, cols):
    generator = torch.Generator().manual_seed(rows * 7 + cols)
    logits = torch.randn(rows, cols, generator=generator)
    if cols > 2:
        logits[0, 1] = logits[0, cols - 1] = logits[0].max() + 1  # a tie: the first index wins
    if rows > 2:
        logits[1, cols // 2] = float("nan")  # a NaN counts as largest, as torch.argmax has it
        logits[2] = float("-inf")
    got = pointwise.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(logits, dim=-1))


def test_native_argmax_refuses_what_it_cannot_read(monkeypatch):
    monkeypatch.setenv(cpu_native.CHOICE_ENV, "native")
    lib = cpu_native.library()
    with pytest.raises(cpu_native.NativeKernelError):
        cpu_native.argmax(lib, torch.randn(4, 8).t())  # not contiguous
    with pytest.raises(cpu_native.NativeKernelError):
        cpu_native.argmax(lib, torch.randn(4, 0))
    with pytest.raises(cpu_native.NativeKernelError):
        cpu_native.argmax(lib, torch.randn(4, 8, dtype=torch.float64))
    transposed = torch.randn(4, 8).t()  # pointwise takes torch's form for what the native one does not read
    assert torch.equal(pointwise.argmax_rows(transposed), torch.argmax(transposed, dim=-1))
