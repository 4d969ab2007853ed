"""Limits more than one service must agree on, kept here so that neither has to import the other."""

from __future__ import annotations

from typing import Final

#: Tokens per KV block that the attention kernels support (pagedkv_kernels.validate checks against it; blockd refuses to
#: register a pool of any other block size; the executor offers only these).
SUPPORTED_BLOCK_SIZES: Final[tuple[int, ...]] = (8, 16, 32, 64)
