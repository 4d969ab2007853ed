"""Paged-KV kernels: write K/V into paged caches, varlen paged attention, copy-on-write block copies.

Each op has a Triton implementation (CUDA, or CPU under the Triton interpreter) and a plain-torch
reference twin; `pagedkv_kernels.dispatch` picks one per call. Importing this package does not import Triton.
See docs/kernels.md.
"""

from pagedkv_kernels.dispatch import BACKEND_ENV, Backend, copy_blocks, paged_attention, resolve_backend, write_kv
from pagedkv_kernels.heuristics import choose_num_splits
from pagedkv_kernels.validate import SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

__all__ = [
    "BACKEND_ENV",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "Backend",
    "choose_num_splits",
    "copy_blocks",
    "paged_attention",
    "resolve_backend",
    "write_kv",
]
