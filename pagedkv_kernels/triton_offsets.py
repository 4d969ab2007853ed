"""Triton helpers that turn token positions into element offsets into a paged cache, always in int64.

Triton integer scalars and loaded int32 block ids multiply in int32 unless told otherwise, and a real pool passes
2**31 elements (e.g. 70k blocks x 16 x 8 x 128): every offset into a cache is widened to int64 *before* the first
multiplication, here and only here. Import after TRITON_INTERPRET is settled (see pagedkv_kernels.dispatch).
"""

from __future__ import annotations

import triton
import triton.language as tl
import triton.language.standard as standard
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# Whether the kernels of this package are interpreted (fixed at import; the other Triton modules follow it).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


def _interpret_triton_language() -> None:
    """Make triton.language's own jit helpers (tl.zeros, tl.sum, tl.cdiv, ...) callable by the interpreter.

    torch imports Triton early; if that happened before TRITON_INTERPRET was set, those helpers were decorated
    as compiled-mode functions, which interpreted kernels cannot call. Re-wrap them: from here on this process
    runs Triton interpreted only (see pagedkv_kernels.dispatch)."""
    for name, obj in list(vars(standard).items()):
        if isinstance(obj, JITFunction) and not isinstance(obj, InterpretedFunction):
            interpreted = InterpretedFunction(obj.fn)
            setattr(standard, name, interpreted)
            if getattr(tl, name, None) is obj:
                setattr(tl, name, interpreted)


if INTERPRETED:  # whoever imports the kernels first (dispatch, a test module), the language helpers follow
    _interpret_triton_language()


@triton.jit
def paged_token_offsets(
    block_table_row_ptr,
    positions,
    mask,
    BLOCK_SIZE: tl.constexpr,
    stride_block,
    stride_token,
):
    """Element offset (int64) of each logical token position's row in `[num_blocks, block_size, ...]`.

    Looks the physical block up per token, so a tile of positions may span several physical blocks
    in any order. Masked-off positions get block 0 (never dereferenced by callers that mask).
    """
    physical = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    within = (positions % BLOCK_SIZE).to(tl.int64)
    return physical * stride_block + within * stride_token


@triton.jit
def slot_offset(slot, BLOCK_SIZE: tl.constexpr, stride_block, stride_token):
    """Element offset (int64) of flat slot `block_id * block_size + offset` in a paged cache."""
    slot = slot.to(tl.int64)
    return (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_token
