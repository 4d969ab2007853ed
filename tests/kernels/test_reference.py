"""The torch reference (CPU backend and test oracle) against unpaged attention: paging changes no math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv_kernels import reference
from tests.kernels.paged_case import float64_oracle, make_batch


def contiguous_attention(batch) -> torch.Tensor:
    """SDPA per sequence over its K/V stored contiguously, with an explicit mask for the cached prefix."""
    outs = []
    group = batch.q.shape[1] // batch.keys[0].shape[1]
    start = 0
    for q_len, kv_len, k, v in zip(batch.q_lens, batch.kv_lens, batch.keys, batch.values, strict=False):
        q = batch.q[start : start + q_len].double().transpose(0, 1)  # [H, q, D]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos  # query i sees its prefix and itself
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


@pytest.mark.parametrize(
    "seqs, heads, block_size, shared",
    [
        ([(6, 6), (1, 37), (7, 29), (1, 1)], (8, 2), 16, 0),  # fresh prefill, decode, mid-block chunk, length 1
        ([(3, 40), (1, 33), (2, 17)], (4, 1), 8, 2),  # MQA, two blocks shared by all sequences
        ([(5, 70), (1, 64)], (2, 2), 64, 1),  # MHA, a sequence exactly filling its block
    ],
)
def test_paged_reference_matches_contiguous_sdpa(seqs, heads, block_size, shared):
    batch = make_batch(
        seqs,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=32,
        block_size=block_size,
        dtype=torch.float64,
        shared_prefix_blocks=shared,
    )
    torch.testing.assert_close(float64_oracle(batch), contiguous_attention(batch), atol=1e-10, rtol=1e-10)


def test_reference_half_inputs_compute_in_float32():
    batch = make_batch([(4, 20), (1, 9)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float16)
    out = torch.empty_like(batch.q)
    reference.paged_attention(*batch.args(), batch.scale, out)
    # Only the final rounding to fp16 separates it from float64 math (half an ulp, |o| < 4).
    torch.testing.assert_close(out.double(), contiguous_attention(batch), atol=2e-3, rtol=1e-3)


def test_reference_write_kv_scatters_and_skips_padding():
    cache_shape = (5, 4, 2, 32)
    key_cache = torch.full(cache_shape, float("nan"))
    value_cache = torch.full(cache_shape, float("nan"))
    key, value = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    slots = torch.tensor([13, -1, 2, 7])
    reference.write_kv(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(-1, 2, 32), value_cache.view(-1, 2, 32)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[i]) and torch.equal(flat_v[slot], value[i])
    untouched = [s for s in range(20) if s not in (13, 2, 7)]
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_reference_copy_blocks_acts_simultaneously():
    caches = [torch.randn(6, 4, 1, 32) for _ in range(4)]
    before = [c.clone() for c in caches]
    mapping = torch.tensor([[0, 3], [1, 4]])
    reference.copy_blocks(caches[:2], caches[2:], mapping)
    for c, b in zip(caches, before, strict=False):
        assert torch.equal(c[3], b[0]) and torch.equal(c[4], b[1])
        assert torch.equal(c[[0, 1, 2, 5]], b[[0, 1, 2, 5]])
