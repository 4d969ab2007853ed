"""The flash-decoding split heuristic: a pure function of batch x kv heads, length and SM count."""

from __future__ import annotations

import pytest

from pagedkv_kernels.heuristics import (
    DEFAULT_NUM_SMS,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    next_power_of_two,
)


def test_full_gpu_is_never_split():
    # 64 sequences x 4 kv heads = 256 programs already cover 132 SMs.
    assert choose_num_splits(64, 4, 32_768) == 1
    assert choose_num_splits(33, 4, 32_768) == 1


def test_small_batch_long_context_fills_the_sms():
    splits = choose_num_splits(1, 4, 32_768)
    assert splits > 1
    assert 4 * splits <= DEFAULT_NUM_SMS  # one wave, not a partial second one
    assert 4 * splits > DEFAULT_NUM_SMS // 2
    assert choose_num_splits(8, 4, 8192) == DEFAULT_NUM_SMS // 32


def test_short_context_is_not_split():
    assert choose_num_splits(1, 4, MIN_TOKENS_PER_SPLIT - 1) == 1
    assert choose_num_splits(1, 4, 2 * MIN_TOKENS_PER_SPLIT) == 2  # no split shorter than the minimum


def test_caps_and_device_size():
    assert choose_num_splits(1, 1, 10**7) == MAX_SPLITS
    assert choose_num_splits(1, 1, 10**7, num_sms=16) == 16
    assert choose_num_splits(2, 8, 10**6, num_sms=16) == 1


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5, 8, 16, 40])
@pytest.mark.parametrize("max_kv_len", [1, 300, 2048, 100_000])
def test_bounds_and_monotonic_in_length(num_seqs, max_kv_len):
    s = choose_num_splits(num_seqs, 4, max_kv_len)
    assert 1 <= s <= MAX_SPLITS
    assert s == 1 or num_seqs * 4 * s <= DEFAULT_NUM_SMS
    assert s == 1 or max_kv_len // s >= MIN_TOKENS_PER_SPLIT
    assert choose_num_splits(num_seqs, 4, max_kv_len * 2) >= s


def test_rejects_nonsense():
    with pytest.raises(ValueError, match="num_seqs"):
        choose_num_splits(0, 4, 100)
    with pytest.raises(ValueError, match="max_kv_len"):
        choose_num_splits(1, 4, -1)


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 80, 96, 128, 129)] == [1, 1, 2, 4, 128, 128, 128, 256]
