"""Layer groups: how a model's layers share the KV cache's blocks when sliding and global layers are mixed.

A model whose layers all read the same keys (every one global, or every one sliding by one window) is one group
of all its layers. One that mixes sliding and global layers (Gemma 2/3, gpt-oss) keeps its KV in groups of `size`
layers each, all global or all sliding (docs/architecture.md, "Sliding windows and layer groups"): the runner
holds `size` (K, V) pairs, the `j`-th layer of every group reads and writes pair `j`, and each group has its own
block table (blockd: `<seq>`, `<seq>@g<i>`), so a block a sliding group hands back is at once another group's.
Global groups come first: group 0, the table blockd's `lookup` and the scheduler's token counts read, needs the
most.
"""

from __future__ import annotations

from dataclasses import dataclass

from executor.model_config import ModelConfig


@dataclass(frozen=True)
class LayerGroups:
    size: int  # layers per group: the (K, V) pairs the runner holds, and a pool block's layers
    sliding: tuple[bool, ...]  # per group: whether its layers slide by `window`
    window: int | None  # the window blockd hands the sliding groups' blocks back by (None: none slides)
    group_of: tuple[int, ...]  # per layer: its group
    slot_of: tuple[int, ...]  # per layer: its (K, V) pair

    @property
    def num_groups(self) -> int:
        return len(self.sliding)

    @property
    def pool_groups(self) -> tuple[bool, ...]:
        """What the pool registers (blockd.pool.PoolSpec.group_sliding): () for one group."""
        return self.sliding if self.num_groups > 1 else ()


def layer_groups(config: ModelConfig, *, grouped: bool = True) -> LayerGroups:
    """The model's layer groups: one of every layer unless sliding layers of one window and global ones mix;
    then `size` is the smaller of their counts (Gemma 3, 5:1: its global layer count), and a kind whose count
    does not divide by it is padded with empty slots (memory, nothing else). `grouped=False`: one group of every
    layer whatever they are (every layer allocated in full: what `pagedkv bench capacity --executor` compares)."""
    windows = config.sliding_windows
    n = config.num_layers
    sliding = [i for i, w in enumerate(windows) if w is not None]
    full = [i for i, w in enumerate(windows) if w is None]
    distinct = {w for w in windows if w is not None}
    if not sliding or not full or len(distinct) > 1 or not grouped:
        # One group: it slides when every layer does (by the widest window: a block none reaches is read by none).
        window = max(distinct) if sliding and not full else None
        return LayerGroups(n, (window is not None,), window, (0,) * n, tuple(range(n)))
    size = min(len(sliding), len(full))
    group_of, slot_of = [0] * n, [0] * n
    flags: list[bool] = []
    for layers, slides in ((full, False), (sliding, True)):
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                group_of[layer], slot_of[layer] = len(flags), slot
            flags.append(slides)
    return LayerGroups(size, tuple(flags), distinct.pop(), tuple(group_of), tuple(slot_of))
