"""The model runner: owns the model and the physical KV cache of one device, and runs one step's chunks.

The KV cache is one (K, V) pair of `[num_blocks, block_size, num_kv_heads, head_dim]` tensors per layer of a
layer group (executor.layer_groups; one group of every layer unless sliding and global layers mix): the `j`-th
layer of every group reads and writes pair `j`, through its group's block table. Block b of every pair is what
blockd calls block b of this executor's pool.
"""

from __future__ import annotations

import array
import contextlib
import math
import mmap
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from blockd.client import MirroredSequence
from blockd.pool import group_suffix
from executor.checkpoint import iter_weights, load_config
from executor.kv_tiers import KvLayout
from executor.layer_groups import LayerGroups, layer_groups
from executor.model import ForwardBatch, PagedCausalLM, build_model
from executor.model_config import ModelConfig, UnsupportedModel
from executor.parallel import Collectives, Shard, local_config
from executor.parallel_load import iter_shard_weights
from executor.scheduler import Chunk
from pagedkv_kernels import SUPPORTED_HEAD_DIMS, dispatch
from pagedkv_kernels.quant import kv_cache_dtype

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, layout: LayerGroups | None = None
) -> int:
    """Bytes of one pool block: K and V of a layer group's layers (every layer's, for a model of one group),
    `dtype` the cache's (1 byte an element for fp8); `layout`: the model's layer groups, unless given."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * (layout or layer_groups(config)).size * block_size * config.num_kv_heads * config.head_dim * element


# madvise(2) advice Python 3.11's mmap module has no name for: fault every page of the range in, writable (Linux
# 5.14+).
MADV_POPULATE_WRITE = 23


def zeroed_tensors(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """`count` zero-filled tensors of `shape`, as torch.zeros makes them.

    On the CPU they are views of one anonymous mapping that the kernel hands over already zeroed and faulted in:
    the same zeros and the same memory taken at once as torch.zeros, without its second pass writing zeros over
    pages the kernel has just zeroed (1 GiB of KV cache: 0.27 s against 0.54 s on a 2-core VM). The mapping asks
    for transparent huge pages first (MADV_HUGEPAGE; the kernel's default policy is often `madvise`): block tables
    scatter a step's K/V reads and writes over the whole cache, and with 4 KiB pages nearly each block read or slot
    written costs a TLB miss (decode attention over mid's heads was 4-10 % faster on huge pages, interleaved in one
    process). Where the kernel refuses the advice the pages are 4 KiB ones, as before.
    """
    nbytes = count * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_POPULATE"):
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    try:
        memory = _populated_mapping(nbytes)
    except OSError as exc:  # torch.zeros' error type, so callers see one kind of allocation failure
        raise RuntimeError(f"cannot allocate {nbytes:,} bytes of KV cache: {exc}") from None
    # The tensors keep the mapping alive (frombuffer holds a reference to it); it is unmapped with the last one.
    return list(torch.frombuffer(memory, dtype=dtype).view(count, *shape).unbind(0))


def _populated_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of `nbytes`, zeroed and faulted in, on huge pages where the kernel grants them.
    The advice must come before the pages are faulted, so MAP_POPULATE (which faults them inside mmap) is the
    fallback for kernels without MADV_POPULATE_WRITE, not the first choice."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge is None:
        return mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_POPULATE)
    memory = mmap.mmap(-1, nbytes, flags=flags)
    with contextlib.suppress(OSError):  # THP compiled out, or disabled ("never"): 4 KiB pages
        memory.madvise(huge)
    try:
        memory.madvise(MADV_POPULATE_WRITE)
    except OSError:  # a kernel before 5.14: MAP_POPULATE on 4 KiB pages, as before (no advice can precede it)
        memory.close()
        return mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_POPULATE)
    return memory


_TYPECODES = {torch.int64: "q", torch.int32: "i"}  # array.array's codes of the same C integer types


def _ints(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-d integer tensor of `values`. Through array.array: several times faster than torch.tensor(list), which
    inspects every element's Python type (a step builds a few such lists of up to max_num_batched_tokens)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype).to(device)


def kv_layout(loaded: LoadedModel, block_size: int) -> KvLayout:
    """The layout of this executor's KV blocks, which every block stored outside the device carries."""
    c = loaded.config
    element = torch.empty((), dtype=loaded.kv_dtype).element_size()
    dtype = str(loaded.kv_dtype).removeprefix("torch.")
    return KvLayout(
        loaded.pool_model_id, dtype, 1.0, 1.0, block_size, c.num_layers, c.num_kv_heads, c.head_dim, element
    )


@dataclass
class LoadedModel:
    config: ModelConfig
    model: PagedCausalLM
    dtype: torch.dtype
    device: torch.device
    load_s: float
    model_dir: Path | None = None  # where the checkpoint (and its tokenizer) is
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: auto (the model's dtype), fp8 / fp8_e4m3, fp8_e5m2

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the KV cache's elements."""
        return kv_cache_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def pool_model_id(self) -> str:
        """The model identity the pool registers at blockd, which keys its prefix hashes: the KV dtype is part of
        it, so blocks of different dtypes are never matched with each other."""
        if self.kv_dtype == self.dtype:
            return self.config.model_id
        return f"{self.config.model_id}+kv-{str(self.kv_dtype).removeprefix('torch.')}"


def load_model(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype | None = None, shard: Shard | None = None
) -> LoadedModel:
    """The checkpoint's model on `device`; with `shard` (tensor parallel), only that rank's slices of it, read as
    slices, and `LoadedModel.config` that rank's (its heads, so its share of each KV block)."""
    started = time.perf_counter()
    config = load_config(model_dir)
    if config.head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedModel(
            f"{model_dir}: head dim {config.head_dim} is not one the paged-attention kernels "
            f"support ({', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
        )
    if dtype is None:
        dtype = DTYPES.get(config.torch_dtype, torch.float32)
        if device.type == "cpu" and dtype is torch.bfloat16:
            dtype = torch.float32  # bfloat16 matmuls are slow on most CPUs
    if shard is None:
        model = build_model(config, iter_weights(model_dir), dtype=dtype, device=device)
    else:
        weights = iter_shard_weights(model_dir, config, shard)
        config = local_config(config, shard)
        model = build_model(config, weights, dtype=dtype, device=device, collectives=Collectives(shard))
    return LoadedModel(config, model, dtype, device, time.perf_counter() - started, Path(model_dir))


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int,
        block_size: int,
        backend: dispatch.Backend = "auto",
        layout: LayerGroups | None = None,
    ) -> None:
        self.config = loaded.config
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.kv_dtype = loaded.kv_dtype
        self.model_dir = loaded.model_dir
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = backend
        c = self.config
        self.groups = layout or layer_groups(c)  # (another layout: one group of every layer, to compare)
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        caches = zeroed_tensors(2 * self.groups.size, shape, self.kv_dtype, self.device)
        self.kv_pairs = [(caches[2 * j], caches[2 * j + 1]) for j in range(self.groups.size)]
        self.kv_caches = [self.kv_pairs[j] for j in self.groups.slot_of]  # each layer's pair

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * kv_bytes_per_block(self.config, self.block_size, self.kv_dtype, self.groups)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = zip(*pairs, strict=False)
            dispatch.copy_blocks(
                [k for k, _ in self.kv_pairs],
                [v for _, v in self.kv_pairs],
                (list(src), list(dst)),
                backend=self.backend,
            )

    def build_batch(self, chunks: list[Chunk], tables: Mapping[str, MirroredSequence]) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for chunk in chunks:
            start, n = chunk.start, len(chunk.token_ids)
            draft = len(chunk.draft)
            if draft:  # speculative: the draft's tokens are more query positions, into slots held reserved
                n += draft
                input_ids.extend(chunk.token_ids + chunk.draft)
            else:
                input_ids.extend(chunk.token_ids)
            end = start + n
            if n == 1:  # a decode: most chunks of a busy step
                positions.append(start)
            else:
                positions.extend(range(start, start + n))
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            if chunk.samples:  # the last token's row, and each draft token's (verified)
                logits_indices.extend(range(starts[-1] - 1 - draft, starts[-1]))
        for chunk, start in zip(chunks, starts, strict=False):  # then the rows prompt logprobs score, in order
            scored = chunk.scored_positions
            if scored:
                logits_indices.extend(range(start + scored.start - chunk.start, start + scored.stop - chunk.start))
        # Each layer group's slots and block tables: group 0's from the sequence's own table, the others' from
        # theirs (blockd.pool.group_table_ids), all padded to one width.
        per_group = [self._slots_and_rows(chunks, tables, group_suffix(g)) for g in range(self.groups.num_groups)]
        width = max(len(r) for _, rows in per_group for r in rows)
        padded: list[int] = []
        for _, rows in per_group:
            for r in rows:
                padded += r
                padded += [0] * (width - len(r))
        device = self.device
        slots = _ints([s for group_slots, _ in per_group for s in group_slots], torch.int64, device)
        block_tables = _ints(padded, torch.int32, device).view(len(per_group), len(chunks), width)
        t = len(input_ids)
        return ForwardBatch(
            input_ids=_ints(input_ids, torch.int64, device),
            positions=_ints(positions, torch.int64, device),
            slot_mapping=slots[:t],
            block_tables=block_tables[0],
            query_start_loc=_ints(starts, torch.int32, device),
            seq_lens=_ints(seq_lens, torch.int32, device),
            logits_indices=_ints(logits_indices, torch.int64, device),
            group_slots=slots[t:].view(len(per_group) - 1, t) if len(per_group) > 1 else None,
            group_tables=block_tables[1:] if len(per_group) > 1 else None,
        )

    def _slots_and_rows(
        self, chunks: list[Chunk], tables: Mapping[str, MirroredSequence], suffix: str
    ) -> tuple[list[int], list[list[int]]]:
        """One layer group's cache slot of every token and block table row of every chunk (`suffix` names the
        group's table after the sequence's id)."""
        bs = self.block_size
        slots: list[int] = []
        rows: list[list[int]] = []
        for chunk in chunks:
            mirrored = tables[chunk.seq.seq_id + suffix]
            table = mirrored.blocks
            start, n = chunk.start, len(chunk.token_ids) + len(chunk.draft)  # (a draft's slots: held reserved)
            end = start + n
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
            else:
                slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
            row = table[: -(-end // bs)]
            holes = mirrored.holes
            if holes:  # blocks handed back: the kernels read none of them, any valid id will do
                row = [0] * holes + row[holes:]
            rows.append(row)
        return slots, rows

    def execute(self, chunks: list[Chunk], tables: Mapping[str, MirroredSequence]) -> torch.Tensor:
        """Compute every chunk's K/V into the cache; float32 logits for the chunks that sample, in order (a drafted
        chunk's 1 + len(draft) rows), then
        those of each chunk's `scored_positions` (prompt logprobs), chunk by chunk."""
        batch = self.build_batch(chunks, tables)
        return self.model(batch, self.kv_caches, self.backend)
