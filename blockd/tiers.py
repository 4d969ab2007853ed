"""The tier directory: which lower KV tiers (host memory, local disk) of a pool's executor, and which tier shared by
every executor of a deployment (a shared directory), hold which cached block hashes, each tier with its capacity
and LRU order; no I/O. blockd directs, the executor moves the bytes.

A pool's device blocks are the top tier (the prefix index in `blockd.pool`). When allocation evicts a cached
device block, the directory demotes its hash (a `save` op: the executor copies the block out before the step
that reuses it writes there); a full host tier spills its least recently used entry to disk (`spill`), a full
disk tier drops its oldest (`discard`). An admit that misses the device but finds the next blocks of its chain
here gets `load` ops into the device blocks it was granted. A shared tier is written at commit, not at eviction
(a `save` to SHARED: any executor may want the block while its author still holds it); blockd counts the block as
there only once its writer reports the write done, and its LRU discards the oldest to make room. The ops of one
step op are in the order the executor runs them, all before the step's forward pass. docs/architecture.md ("KV
tiers") tells the whole design.

 T1. Each tier holds at most its capacity; a host tier's used slots and free slots are disjoint and together
     are exactly range(capacity), each used slot named by one hash.
 T2. Nothing stays pinned between ops (pins protect the entries an admit loads from while its own allocations
     demote other blocks).
 T3. A shared tier's written entries and pending writes are disjoint and together within its capacity; every
     pending write is owed by a pool registered with that tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Final, Literal

import msgspec

MEDIUM_GPU: Final = "GPU"  # vLLM's names (its KV events' `medium`): the device tier, whatever the device
MEDIUM_CPU: Final = "CPU"
MEDIUM_DISK: Final = "DISK"
MEDIUM_SHARED: Final = "SHARED"  # (not one of vLLM's: a tier every executor of the deployment reads)
MAX_SHARED_ID: Final = 128  # characters of a shared tier's id (the executor sends a hex digest)

Medium = Literal["CPU", "DISK", "SHARED"]
#: Hears every entry that enters (True) or leaves (False) a tier: (entered, block hash, medium). blockd.kv_events
#: publishes them; the manager binds it to the pool's sink.
TierEvents = Callable[[bool, bytes, str], None]
OpKind = Literal["save", "spill", "load", "discard"]


class TierOp(msgspec.Struct, array_like=True, frozen=True):
    """One move the executor makes, in order, before the step's forward pass.

    save: device `block` (about to be reused; SHARED: just committed) -> `medium` (CPU: host `slot`); spill: host
    `slot` -> DISK (the slot is reused by a later op: copy it out first); load: `medium` (CPU: `slot`) -> device
    `block`; discard: the DISK (or SHARED) copy of the hash goes."""

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
    """The lower tiers an executor declares when it registers, and what they hold (oldest first). `shared_id`
    names a shared tier (its directory's identity and the KV layout, so only executors that can read each
    other's blocks share one); `shared` is what the executor found there."""

    host_blocks: int = 0
    disk_blocks: int = 0
    host: list[TierHeld] = []
    disk: list[TierHeld] = []
    shared_id: str = ""
    shared_blocks: int = 0
    shared: list[TierHeld] = []


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


class SharedTier:
    """A tier every pool registered with the same `shared_id` reads and writes: its written entries in LRU order
    (oldest first) and the writes sent but not yet reported done, which are never loaded (T3)."""

    def __init__(self, shared_id: str, capacity: int) -> None:
        self.shared_id = shared_id
        self.capacity = capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # hash -> -1 (a file, no slot)
        self.pending: dict[bytes, str] = {}  # hash -> the pool whose executor writes it

    def room(self) -> bool:
        return len(self.entries) + len(self.pending) < self.capacity

    def release(self, pool_id: str) -> None:
        """The pool's executor is gone or started over: the writes it owed are not coming."""
        for h in [h for h, owner in self.pending.items() if owner == pool_id]:
            del self.pending[h]

    def check(self, pool_ids: Iterable[str]) -> list[str]:
        """T3; one line per violation."""
        problems: list[str] = []
        sid = self.shared_id
        if set(self.entries) & set(self.pending):
            problems.append(f"shared tier {sid}: T3 a hash is both written and pending")
        if len(self.entries) + len(self.pending) > self.capacity:
            problems.append(
                f"shared tier {sid}: T3 {len(self.entries)} written and {len(self.pending)} pending blocks, "
                f"capacity {self.capacity}"
            )
        owners = set(pool_ids)
        if stray := {o for o in self.pending.values() if o not in owners}:
            problems.append(f"shared tier {sid}: T3 writes pending for unregistered pools {sorted(stray)}")
        return problems


class TierDirectory:
    """A pool's lower tiers (host first, then disk; either may be absent), the shared tier it reads (if any), and
    the ops their changes need."""

    def __init__(
        self, pool_id: str, tiers: TierSpec, events: TierEvents | None = None, shared: SharedTier | None = None
    ) -> None:
        self.pool_id = pool_id
        self._events = events
        self.tiers: list[Tier] = []  # the pool's own, in demotion order
        if tiers.host_blocks:
            self.tiers.append(Tier(MEDIUM_CPU, tiers.host_blocks))
        if tiers.disk_blocks:
            self.tiers.append(Tier(MEDIUM_DISK, tiers.disk_blocks))
        self.shared = shared
        # This pool's view of the shared tier: its entries (the same map every pool sees), this pool's counters.
        self.shared_view: Tier | None = None
        if shared is not None:
            self.shared_view = Tier(MEDIUM_SHARED, shared.capacity)
            self.shared_view.entries = shared.entries
        self.ops: list[TierOp] = []  # since the last `take`
        self.pinned: set[bytes] = set()
        self._adopt(MEDIUM_CPU, tiers.host)
        self._adopt(MEDIUM_DISK, tiers.disk)
        if shared is not None:
            for entry in tiers.shared:
                h = entry.block_hash
                if h not in shared.entries and h not in shared.pending and shared.room():
                    shared.entries[h] = -1
                    self._emit(True, h, MEDIUM_SHARED)

    @property
    def all_tiers(self) -> list[Tier]:
        """Every tier this pool reads, its own first, then the shared tier's view."""
        return self.tiers if self.shared_view is None else [*self.tiers, self.shared_view]

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
        for tier in self.all_tiers:
            if h in tier.entries:
                return tier
        return None

    def publish(self, h: bytes, block: int) -> None:
        """Device `block` was just committed with hash h: write it to the shared tier (behind) unless it is there
        or on its way; a full tier first discards its least recently used written entry."""
        shared = self.shared
        if shared is None or h in shared.entries or h in shared.pending:
            return
        if not shared.room():
            victim = next((v for v in shared.entries if v not in self.pinned), None)
            if victim is None:  # all pending (or being loaded from): not kept there
                return
            del shared.entries[victim]
            self._emit(False, victim, MEDIUM_SHARED)
            self.ops.append(TierOp("discard", MEDIUM_SHARED, victim))
        shared.pending[h] = self.pool_id
        self.ops.append(TierOp("save", MEDIUM_SHARED, h, block=block))
        assert self.shared_view is not None
        self.shared_view.counters.demotions += 1

    def shared_written(self, hashes: Iterable[bytes]) -> None:
        """The executor wrote these to the shared tier: they may be loaded from now on (a write blockd no longer
        waits for, its pool having started over, is taken if there is room)."""
        shared = self.shared
        if shared is None:
            return
        for h in hashes:
            if shared.pending.get(h) == self.pool_id:
                del shared.pending[h]
            elif h in shared.entries or h in shared.pending or not shared.room():
                continue
            shared.entries[h] = -1
            self._emit(True, h, MEDIUM_SHARED)

    def shared_lost(self, hashes: Iterable[bytes]) -> None:
        """The executor could not write these to the shared tier, or found their file bad: no copy is there."""
        shared, view = self.shared, self.shared_view
        if shared is None or view is None:
            return
        for h in hashes:
            if shared.pending.get(h) == self.pool_id:
                del shared.pending[h]
            elif h in shared.entries:
                del shared.entries[h]
                view.counters.drops += 1
                self._emit(False, h, MEDIUM_SHARED)

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
        """Forget every entry of the pool's own tiers (reset_prefix_cache): the executor's copies are never named
        again. The shared tier is the deployment's, not this pool's: it stays."""
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
        self._emit(False, h, medium)

    def _emit(self, entered: bool, h: bytes, medium: str) -> None:
        if self._events is not None:
            self._events(entered, h, medium)

    # ------------------------------------------------------------------------------------ observability

    def held(self, medium: str) -> list[TierHeld]:
        tier = self.shared_view if medium == MEDIUM_SHARED else self._tier(medium)
        return [] if tier is None else [TierHeld(h, s) for h, s in tier.entries.items()]

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.all_tiers]

    def check(self) -> list[str]:
        """T1 and T2 (the module docstring; T3 is the shared tier's own); one line per violation."""
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
