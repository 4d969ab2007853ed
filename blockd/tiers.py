"""The tier directory: which lower KV tiers (host memory, local disk) of a pool's executor hold which cached block
hashes, each tier with its capacity and LRU order; no I/O. blockd directs, the executor moves the bytes.

A pool's device blocks are the top tier (the prefix index in `blockd.pool`). When allocation evicts a cached
device block, the directory demotes its hash (a `save` op: the executor copies the block out before the step
that reuses it writes there); a full host tier spills its least recently used entry to disk (`spill`), a full
disk tier drops its oldest (`discard`). An admit that misses the device but finds the next blocks of its chain
here gets `load` ops into the device blocks it was granted. The ops of one step op are in the order the executor
runs them, all before the step's forward pass. docs/architecture.md ("KV tiers") tells the whole design.

 T1. Each tier holds at most its capacity; a host tier's used slots and free slots are disjoint and together
     are exactly range(capacity), each used slot named by one hash.
 T2. Nothing stays pinned between ops (pins protect the entries an admit loads from while its own allocations
     demote other blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Final, Literal

import msgspec

MEDIUM_GPU: Final = "GPU"  # vLLM's names (its KV events' `medium`): the device tier, whatever the device
MEDIUM_CPU: Final = "CPU"
MEDIUM_DISK: Final = "DISK"

Medium = Literal["CPU", "DISK"]
#: Hears every entry that enters (True) or leaves (False) a tier: (entered, block hash, medium). blockd.kv_events
#: publishes them; the manager binds it to the pool's sink.
TierEvents = Callable[[bool, bytes, str], None]
OpKind = Literal["save", "spill", "load", "discard"]


class TierOp(msgspec.Struct, array_like=True, frozen=True):
    """One move the executor makes, in order, before the step's forward pass.

    save: device `block` (about to be reused) -> `medium` (CPU: host `slot`); spill: host `slot` -> DISK (the
    slot is reused by a later op: copy it out first); load: `medium` (CPU: `slot`) -> device `block`;
    discard: the DISK copy of the hash goes."""

    kind: OpKind
    medium: Medium
    block_hash: bytes
    block: int = -1
    slot: int = -1


class TierHeld(msgspec.Struct, array_like=True, frozen=True):
    """A hash an executor's tier holds (its report on registration); slot -1 on disk."""

    block_hash: bytes
    slot: int = -1


class TierSpec(msgspec.Struct, frozen=True):
    """The lower tiers an executor declares when it registers, and what they hold (oldest first)."""

    host_blocks: int = 0
    disk_blocks: int = 0
    host: list[TierHeld] = []
    disk: list[TierHeld] = []


class TierCounters(msgspec.Struct):
    hits: int = 0  # admitted blocks found in this tier (loaded)
    loads: int = 0  # load ops sent (a block's bytes into the device)
    demotions: int = 0  # entries written into this tier (saves and spills)
    drops: int = 0  # entries that left this tier without a copy below


class TierStats(msgspec.Struct):
    medium: str
    capacity_blocks: int
    blocks: int
    counters: TierCounters


class Tier:
    """One lower tier: hash -> slot in LRU order (oldest first); host slots are numbered, disk entries are not."""

    def __init__(self, medium: Medium, capacity: int) -> None:
        self.medium: Medium = medium
        self.capacity = capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.free_slots: list[int] = list(range(capacity - 1, -1, -1)) if medium == MEDIUM_CPU else []
        self.counters = TierCounters()

    def full(self) -> bool:
        return len(self.entries) >= self.capacity

    def put(self, h: bytes) -> int:
        slot = self.free_slots.pop() if self.medium == MEDIUM_CPU else -1
        self.entries[h] = slot
        return slot

    def remove(self, h: bytes) -> int:
        slot = self.entries.pop(h)
        if self.medium == MEDIUM_CPU:
            self.free_slots.append(slot)
        return slot

    def stats(self) -> TierStats:
        return TierStats(self.medium, self.capacity, len(self.entries), msgspec.structs.replace(self.counters))


class TierDirectory:
    """A pool's lower tiers (host first, then disk; either may be absent) and the ops their changes need."""

    def __init__(self, pool_id: str, tiers: TierSpec, events: TierEvents | None = None) -> None:
        self.pool_id = pool_id
        self._events = events
        self.tiers: list[Tier] = []
        if tiers.host_blocks:
            self.tiers.append(Tier(MEDIUM_CPU, tiers.host_blocks))
        if tiers.disk_blocks:
            self.tiers.append(Tier(MEDIUM_DISK, tiers.disk_blocks))
        self.ops: list[TierOp] = []  # since the last `take`
        self.pinned: set[bytes] = set()
        self._adopt(MEDIUM_CPU, tiers.host)
        self._adopt(MEDIUM_DISK, tiers.disk)

    def _tier(self, medium: str) -> Tier | None:
        return next((t for t in self.tiers if t.medium == medium), None)

    def _adopt(self, medium: str, held: Iterable[TierHeld]) -> None:
        """Take what the executor reports its tier holds (re-sync, or its disk after a restart), within capacity;
        what does not fit or names a bad slot is left out (the executor's own copy is then never loaded)."""
        tier = self._tier(medium)
        if tier is None:
            return
        host = tier.medium == MEDIUM_CPU
        used: set[int] = set()
        for entry in held:
            if entry.block_hash in tier.entries or tier.full():
                continue
            if host:
                if not 0 <= entry.slot < tier.capacity or entry.slot in used:
                    continue
                used.add(entry.slot)
            tier.entries[entry.block_hash] = entry.slot if host else -1
        if used:
            tier.free_slots = [s for s in range(tier.capacity - 1, -1, -1) if s not in used]

    # ------------------------------------------------------------------------------------ the pool's calls

    def find(self, h: bytes) -> Tier | None:
        """The highest tier that holds h (no change: an admit looks before it knows it fits)."""
        for tier in self.tiers:
            if h in tier.entries:
                return tier
        return None

    def demote(self, h: bytes, block: int) -> None:
        """Device `block`, holding h, is about to be reused: keep h below (unless a tier has it already)."""
        if not self.tiers:
            return
        for tier in self.tiers:
            if h in tier.entries:
                tier.entries.move_to_end(h)
                return
        self._store(0, h, block=block)

    def load(self, tier: Tier, h: bytes, block: int) -> None:
        tier.entries.move_to_end(h)
        tier.counters.hits += 1
        tier.counters.loads += 1
        self.ops.append(TierOp("load", tier.medium, h, block=block, slot=tier.entries[h]))

    def forget(self, hashes: Iterable[bytes]) -> None:
        """The executor lost these from its disk (a file found bad when loaded): no copy is there any more."""
        tier = self._tier(MEDIUM_DISK)
        if tier is None:
            return
        for h in hashes:
            if h in tier.entries:
                tier.remove(h)
                tier.counters.drops += 1
                self._emit_removed(h, MEDIUM_DISK)

    def take(self) -> tuple[TierOp, ...]:
        ops, self.ops = tuple(self.ops), []
        self.pinned.clear()
        return ops

    def clear(self) -> None:
        """Forget every entry (reset_prefix_cache): the executor's copies are never named again."""
        for tier in self.tiers:
            for h in list(tier.entries):
                tier.remove(h)
                self._emit_removed(h, tier.medium)

    # ------------------------------------------------------------------------------------ moves

    def _store(self, level: int, h: bytes, *, block: int = -1, slot: int = -1) -> None:
        """Put h into tier `level`, read from device `block` or (a spill) host `slot`."""
        tier = self.tiers[level]
        if tier.full():
            victim = next((v for v in tier.entries if v not in self.pinned), None)
            if victim is None:  # every entry is being loaded from: h is not kept here
                self._dropped(level, h)
                return
            self._evict(level, victim)
        new_slot = tier.put(h)
        if block >= 0:
            self.ops.append(TierOp("save", tier.medium, h, block=block, slot=new_slot))
        else:
            self.ops.append(TierOp("spill", tier.medium, h, slot=slot))
        tier.counters.demotions += 1
        if self._events is not None:
            self._events(True, h, tier.medium)

    def _evict(self, level: int, h: bytes) -> None:
        tier = self.tiers[level]
        slot = tier.remove(h)
        self._emit_removed(h, tier.medium)
        if tier.medium == MEDIUM_DISK:
            self.ops.append(TierOp("discard", MEDIUM_DISK, h))
        below = level + 1
        if below < len(self.tiers) and h not in self.tiers[below].entries:
            self._store(below, h, slot=slot)  # (before the op that reuses the slot: the executor copies it first)
        elif below >= len(self.tiers):
            tier.counters.drops += 1

    def _dropped(self, level: int, h: bytes) -> None:
        self.tiers[level].counters.drops += 1

    def _emit_removed(self, h: bytes, medium: str) -> None:
        if self._events is not None:
            self._events(False, h, medium)

    # ------------------------------------------------------------------------------------ observability

    def held(self, medium: str) -> list[TierHeld]:
        tier = self._tier(medium)
        return [] if tier is None else [TierHeld(h, s) for h, s in tier.entries.items()]

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]

    def check(self) -> list[str]:
        """T1 and T2 (the module docstring); one line per violation."""
        problems: list[str] = []
        pid = self.pool_id
        for tier in self.tiers:
            if len(tier.entries) > tier.capacity:
                problems.append(f"{pid}: T1 tier {tier.medium} holds {len(tier.entries)} of {tier.capacity} blocks")
            if tier.medium == MEDIUM_CPU:
                used = list(tier.entries.values())
                if len(set(used)) != len(used) or set(used) & set(tier.free_slots):
                    problems.append(f"{pid}: T1 tier CPU names a slot twice")
                if sorted(used + tier.free_slots) != list(range(tier.capacity)):
                    problems.append(f"{pid}: T1 tier CPU's used and free slots are not its {tier.capacity} slots")
        if self.pinned or self.ops:
            problems.append(f"{pid}: T2 {len(self.pinned)} pins and {len(self.ops)} ops left between ops")
        return problems
