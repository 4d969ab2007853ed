"""The KV cache's allocation: zero-filled tensors, as torch.zeros makes them, each its own memory."""

from __future__ import annotations

import itertools

import pytest
import torch

from executor.runner import zeroed_tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zeroed_tensors_are_torch_zeros(dtype: torch.dtype) -> None:
    shape = (3, 16, 2, 32)
    tensors = zeroed_tensors(4, shape, dtype, torch.device("cpu"))
    assert len(tensors) == 4
    for t in tensors:
        assert torch.equal(t, torch.zeros(shape, dtype=dtype)) and t.is_contiguous()
    tensors[1].fill_(1)  # distinct memory: writing one leaves the others zero
    assert tensors[1].all() and not tensors[0].any() and not tensors[2].any() and not tensors[3].any()
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ends))


def test_empty_shapes_fall_back_to_torch_zeros() -> None:
    assert [t.shape for t in zeroed_tensors(2, (0, 16, 2, 32), torch.float32, torch.device("cpu"))] == [
        (0, 16, 2, 32)
    ] * 2
    assert zeroed_tensors(0, (1, 16, 2, 32), torch.float32, torch.device("cpu")) == []
