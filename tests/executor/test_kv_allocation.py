"""The KV cache's allocation: zero-filled tensors, as torch.zeros makes them, each its own memory."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from executor import runner
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


def _vma_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def _thp_policy() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps to read a mapping's advice")
def test_the_cache_asks_for_huge_pages_where_the_kernel_offers_them() -> None:
    tensors = zeroed_tensors(2, (64, 16, 2, 128), torch.float32, torch.device("cpu"))  # 2 x 8 MiB
    fields = _vma_fields(tensors[0].data_ptr())
    assert fields, "the cache's mapping is not in /proc/self/smaps"
    if _thp_policy() == "never":
        assert fields.get("THPeligible") == "0"
    else:  # "madvise" grants them only to advised ranges: the advice was given
        assert fields.get("THPeligible") == "1" and "hg" in fields.get("VmFlags", "").split()
    assert not tensors[0].any() and not tensors[1].any()


def test_a_kernel_without_populate_write_still_gets_zeroed_faulted_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "MADV_POPULATE_WRITE", 0x7FFF)  # advice no kernel knows: EINVAL, as before 5.14
    tensors = zeroed_tensors(3, (8, 16, 2, 32), torch.float32, torch.device("cpu"))
    assert all(torch.equal(t, torch.zeros(8, 16, 2, 32)) for t in tensors)
    tensors[2].fill_(2)
    assert not tensors[0].any() and not tensors[1].any() and (tensors[2] == 2).all()
