"""The block manager: every pool blockd knows, their registration, re-sync, leases and fencing, and the requests
on them. No I/O: the server decodes requests and hands them over; persistence collects the pools' journals.

The pools' lifecycle (registered, dormant, expired), fencing by epoch and re-sync are told in
docs/architecture.md ("Registration, leases and re-sync").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import msgspec

from blockd import protocol as p
from blockd.errors import BlockdError, ErrorCode
from blockd.hashing import epoch_fingerprint
from blockd.pool import HOLE, BlockPool, BlockRecord, Journal, PoolSpec, PoolStats
from blockd.tiers import MAX_SHARED_ID, SharedTier, TierDirectory
from common.limits import SUPPORTED_BLOCK_SIZES

DEFAULT_MAX_POOLS = 64
DEFAULT_MAX_BLOCKS_PER_POOL = 1 << 20  # ~160 MB of blockd memory and ~0.4 s to register on a small machine
DEFAULT_MAX_LOOKUP_TOKENS = 1 << 17  # a 128k-token prompt: ~0.25 s of hashing


@dataclass(frozen=True)
class Limits:
    """What one request may ask of blockd; checked before any work. None: no limit on that (unit tests)."""

    max_pools: int = DEFAULT_MAX_POOLS
    max_blocks_per_pool: int = DEFAULT_MAX_BLOCKS_PER_POOL
    block_sizes: Collection[int] | None = SUPPORTED_BLOCK_SIZES
    max_lookup_tokens: int = DEFAULT_MAX_LOOKUP_TOKENS


class DormantPool(msgspec.Struct):
    """A pool restored from Redis whose executor has not re-registered since blockd started."""

    spec: PoolSpec
    records: dict[int, BlockRecord]
    since: float


class PoolEvents:
    """What persistence needs to hear besides index changes (it subclasses this)."""

    def pool_registered(self, pool: BlockPool) -> None:
        """The pool's index was rebuilt as a whole: its persisted copy must be replaced."""

    def pool_dropped(self, pool_id: str) -> None:
        """The pool is gone with its index."""

    def new_journal(self) -> Journal | None:
        return None


class BlockManager:
    """Every pool of this blockd and the operations on them."""

    def __init__(
        self,
        *,
        lease_timeout_s: float = 10.0,
        deployment: str = "pagedkv",
        events: PoolEvents | None = None,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits | None = None,
        hash_key: bytes = b"",
    ) -> None:
        self.lease_timeout_s = lease_timeout_s
        self.hash_key = hash_key  # blockd.hashing.secret_key(--deployment-secret), b"" without one
        self.limits = limits or Limits(block_sizes=None)
        self.deployment = deployment
        self.events = events or PoolEvents()
        self.clock = clock
        self.pools: dict[str, BlockPool] = {}
        self.last_seen: dict[str, float] = {}
        self.registered_at: dict[str, float] = {}  # wall-clock time of the pool's registration with its epoch
        self.dormant: dict[str, DormantPool] = {}
        # The deployment's shared KV tiers by id (blockd.tiers): one per shared directory and KV layout, made by the
        # first pool that registers with it, its capacity that pool's; not persisted (executors report them).
        self.shared_tiers: dict[str, SharedTier] = {}

    # ------------------------------------------------------------------------------------ registry

    def pool(self, pool_id: str) -> BlockPool:
        pool = self.pools.get(pool_id)
        if pool is None:
            hint = " (restored from Redis: register it again)" if pool_id in self.dormant else ""
            raise BlockdError(ErrorCode.UNKNOWN_POOL, f"pool {pool_id!r} is not registered{hint}")
        return pool

    def owned(self, pool_id: str, epoch: int) -> BlockPool:
        """The pool, if `epoch` is its epoch; otherwise stale_epoch (the request is not its executor's)."""
        pool = self.pool(pool_id)
        if pool.spec.epoch != epoch:
            raise BlockdError(
                ErrorCode.STALE_EPOCH,
                f"pool {pool_id!r} is held by another executor (epoch {epoch_fingerprint(pool.spec.epoch)}, "
                f"not {epoch_fingerprint(epoch)}): this request changes nothing",
            )
        return pool

    def touch(self, pool_id: str, epoch: int) -> BlockPool:
        """The pool's executor was heard from: its lease is renewed."""
        pool = self.owned(pool_id, epoch)
        self.last_seen[pool_id] = self.clock()
        return pool

    def _lease_alive(self, pool_id: str) -> bool:
        seen = self.last_seen.get(pool_id)
        return seen is not None and self.clock() - seen <= self.lease_timeout_s

    def _check_register_bounds(self, req: p.Register) -> None:
        limits = self.limits
        if limits.block_sizes is not None and req.block_size not in limits.block_sizes:
            allowed = ", ".join(map(str, sorted(limits.block_sizes)))
            raise BlockdError(
                ErrorCode.UNSUPPORTED_BLOCK_SIZE, f"block size {req.block_size} is not one of {allowed} (--block-sizes)"
            )
        if req.num_blocks > limits.max_blocks_per_pool:
            raise BlockdError(
                ErrorCode.POOL_TOO_LARGE,
                f"{req.num_blocks} blocks is more than the {limits.max_blocks_per_pool} this blockd allows a pool "
                "(--max-blocks-per-pool)",
            )
        tiers = req.tiers
        if tiers is not None and not (
            0 <= tiers.host_blocks <= limits.max_blocks_per_pool
            and 0 <= tiers.disk_blocks <= 1 << 31
            and 0 <= tiers.shared_blocks <= 1 << 31
        ):
            raise BlockdError(
                ErrorCode.POOL_TOO_LARGE,
                f"tiers of {tiers.host_blocks} host, {tiers.disk_blocks} disk and {tiers.shared_blocks} shared blocks: "
                f"at most {limits.max_blocks_per_pool} host blocks (--max-blocks-per-pool) and 2**31 on disk",
            )
        if tiers is not None and (
            len(tiers.shared_id) > MAX_SHARED_ID or bool(tiers.shared_id) != (tiers.shared_blocks > 0)
        ):
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"a shared tier needs an id of 1 to {MAX_SHARED_ID} characters and a capacity, not id "
                f"{tiers.shared_id[:MAX_SHARED_ID]!r} with {tiers.shared_blocks} blocks",
            )
        if (
            tiers is not None
            and tiers.shared_id
            and tiers.shared_id not in self.shared_tiers
            and len(self.shared_tiers) >= limits.max_pools
        ):
            raise BlockdError(
                ErrorCode.TOO_MANY_POOLS, f"this blockd holds {limits.max_pools} shared tiers already (--max-pools)"
            )
        known = req.pool_id in self.pools or req.pool_id in self.dormant
        if not known and len(self.pools) + len(self.dormant) >= limits.max_pools:
            raise BlockdError(
                ErrorCode.TOO_MANY_POOLS, f"this blockd holds {limits.max_pools} pools already (--max-pools)"
            )

    def restore(self, specs: Iterable[PoolSpec], records: dict[str, dict[int, BlockRecord]]) -> None:
        """Take pools and their index as persisted; they stay dormant until their executors re-register."""
        now = self.clock()
        for spec in specs:
            self.dormant[spec.pool_id] = DormantPool(spec, records.get(spec.pool_id, {}), now)

    def register(self, req: p.Register) -> p.RegisterResult:
        self._check_register_bounds(req)
        groups = tuple(req.groups) if req.groups is not None and len(req.groups) > 1 else ()
        spec = PoolSpec(
            req.pool_id, req.num_blocks, req.block_size, req.model_id, req.epoch, req.sliding_window, groups
        )
        previous = self.pools.get(req.pool_id)
        # A new epoch takes a pool over only once its lease ran out, or while it is dormant (no executor claimed it).
        if previous is not None and previous.spec.epoch != req.epoch and self._lease_alive(req.pool_id):
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.registered_at.get(req.pool_id, 0.0)))
            silent = self.clock() - self.last_seen[req.pool_id]
            raise BlockdError(
                ErrorCode.POOL_HELD,
                f"pool {req.pool_id} is held by a live executor since {since} (epoch "
                f"{epoch_fingerprint(previous.spec.epoch)}, last heard from {silent:.1f} s ago): give this executor "
                f"another --pool-id, or stop the other one (its pool is free {self.lease_timeout_s:g} s after it "
                "goes silent)",
            )
        dormant = self.dormant.get(req.pool_id)
        known = previous.spec if previous is not None else dormant.spec if dormant is not None else None
        # The same epoch: the executor's KV lived on, so its live sequences are the truth and the index entries its
        # generations still back are kept. A new epoch: its KV memory is new, the pool starts clean.
        resync = known is not None and known.epoch == spec.epoch
        if resync and known != spec:
            raise BlockdError(
                ErrorCode.POOL_MISMATCH,
                f"pool {req.pool_id!r} was registered with {known.num_blocks} blocks of {known.block_size} tokens "
                f"for model {known.model_id!r} (sliding window {known.sliding_window}, layer groups "
                f"{list(known.group_sliding)}), not {spec.num_blocks} of {spec.block_size} for {spec.model_id!r} "
                f"(sliding window {spec.sliding_window}, layer groups {list(spec.group_sliding)})",
            )
        if req.generations is not None and len(req.generations) != spec.num_blocks:
            raise BlockdError(
                ErrorCode.INVALID_REQUEST,
                f"generations has {len(req.generations)} entries for {spec.num_blocks} blocks",
            )
        if resync:
            candidates = previous.block_records() if previous is not None else dormant.records  # type: ignore[union-attr]
        else:
            candidates = {}
        known_entries = len(previous.index) if previous is not None else len(dormant.records) if dormant else 0
        generations = req.generations
        if generations is None and resync and previous is not None:
            generations = previous.generation  # blockd never lost them; the executor simply did not send its own
        pool = BlockPool(spec, deployment=self.deployment, journal=self.events.new_journal(), hash_key=self.hash_key)
        if req.tiers is not None:  # what they hold is the executor's report: it is the truth about its memory and disk
            shared = self._shared_tier(req.tiers)
            if previous is not None and previous.tiers is not None and previous.tiers.shared is not None:
                previous.tiers.shared.release(req.pool_id)  # the writes its old self owed
            pool.tiers = TierDirectory(spec.pool_id, req.tiers, _tier_events(pool), shared)
        # Build the new pool completely before touching the registry: a bad sequence leaves everything as it was.
        if generations is not None:
            pool.adopt_generations(generations)
        for seq in req.sequences:
            pool.restore_sequence(
                seq.seq_id, seq.tokens, seq.blocks, seq.num_computed_tokens, seq.cache_salt, seq.reserved,
                seq.group_blocks,
            )  # fmt: skip
        if candidates:
            pool.restore_index(candidates.items(), generations)
        restored = len(pool.index)  # backed entries kept, plus the live sequences' computed blocks
        if previous is not None and resync:
            pool.counters = previous.counters
        self.pools[req.pool_id] = pool
        self.dormant.pop(req.pool_id, None)
        self.last_seen[req.pool_id] = self.clock()
        if not resync or req.pool_id not in self.registered_at:
            self.registered_at[req.pool_id] = time.time()
        self.events.pool_registered(pool)
        return p.RegisterResult(
            resynced=resync,
            restored_sequences=len(req.sequences),
            restored_index_entries=restored,
            dropped_index_entries=max(0, known_entries - restored),
            lease_timeout_s=self.lease_timeout_s,
            groups=pool.num_groups,
        )

    def _shared_tier(self, tiers: p.TierSpec) -> SharedTier | None:
        if not tiers.shared_id:
            return None
        shared = self.shared_tiers.get(tiers.shared_id)
        if shared is None:
            shared = self.shared_tiers[tiers.shared_id] = SharedTier(tiers.shared_id, tiers.shared_blocks)
        return shared

    def unregister(self, pool_id: str, epoch: int) -> int:
        self.owned(pool_id, epoch)
        return self._drop(pool_id)

    def heartbeat(
        self, pool_id: str, epoch: int, shared_written: Collection[bytes] = (), shared_drops: Collection[bytes] = ()
    ) -> None:
        pool = self.touch(pool_id, epoch)
        if pool.tiers is not None:
            pool.tiers.shared_written(shared_written)
            pool.tiers.shared_lost(shared_drops)

    def _drop(self, pool_id: str) -> int:
        pool = self.pools.pop(pool_id, None)
        if pool is not None and pool.tiers is not None and pool.tiers.shared is not None:
            pool.tiers.shared.release(pool_id)
        self.last_seen.pop(pool_id, None)
        self.registered_at.pop(pool_id, None)
        dormant = self.dormant.pop(pool_id, None)
        self.events.pool_dropped(pool_id)
        if pool is not None:
            return len(pool.index)
        return len(dormant.records) if dormant is not None else 0

    def expire(self) -> list[str]:
        """Drop pools whose executor has been silent past the lease timeout; returns their ids."""
        now = self.clock()
        expired = [pid for pid, seen in self.last_seen.items() if now - seen > self.lease_timeout_s]
        expired += [pid for pid, d in self.dormant.items() if now - d.since > self.lease_timeout_s]
        for pool_id in expired:
            pool = self.pools.get(pool_id)
            if pool is not None:
                pool.free_all()
            self._drop(pool_id)
        return expired

    # ------------------------------------------------------------------------------------ operations

    def step(
        self,
        pool_id: str,
        epoch: int,
        ops: list[p.StepOp],
        tier_drops: Collection[bytes] = (),
        shared_written: Collection[bytes] = (),
        shared_drops: Collection[bytes] = (),
    ) -> p.StepResult:
        """Apply one scheduler step's ops in order; each op succeeds or fails on its own. A step with another
        epoch than the pool's is refused whole (stale_epoch) and neither changes the pool nor renews its lease.
        `tier_drops`: hashes the executor's disk tier lost; `shared_written` and `shared_drops`: the shared tier's
        writes it finished and the ones it could not make or found bad (blockd.tiers); all taken in first."""
        pool = self.touch(pool_id, epoch)
        if pool.tiers is not None:
            if tier_drops:
                pool.tiers.forget(tier_drops)
            if shared_written:
                pool.tiers.shared_written(shared_written)
            if shared_drops:
                pool.tiers.shared_lost(shared_drops)
        results: list[p.StepOpResult] = []
        append = results.append
        for op in ops:
            try:
                if type(op) is p.Append:
                    append(pool.append(op.seq_id, op.tokens, op.reserve))
                elif type(op) is p.Admit:
                    append(pool.admit(op.seq_id, op.tokens, op.cache_salt, reuse_prefix=op.reuse_prefix, hold=op.hold))
                elif type(op) is p.Commit:
                    append(p.CommitResult(pool.commit(op.seq_id, op.num_computed_tokens), pool.take_tier_ops()))
                elif type(op) is p.Free:
                    append(p.FreeResult(pool.free(op.seq_id)))
                elif type(op) is p.Slide:
                    append(p.SlideResult(pool.slide(op.seq_id, op.num_computed_tokens)))
                elif type(op) is p.Trim:
                    append(p.TrimResult(pool.trim(op.seq_id, op.reserve)))
                else:
                    pool.fork(op.parent_id, op.child_id)
                    append(p.ForkResult())
            except BlockdError as exc:
                append(p.OpError(exc.code, exc.message, exc.missing_blocks))
        return p.StepResult(results)

    def lookup(self, tokens: bytes, cache_salt: str | None) -> p.LookupResult:
        """Per pool, the prompt tokens an admit would find cached on the device and those it would load from each
        lower tier after them; the prompt is hashed once per (block size, model), not once per pool."""
        limit = self.limits.max_lookup_tokens
        if len(tokens) // 4 > limit:
            raise BlockdError(
                ErrorCode.TOO_MANY_TOKENS,
                f"a lookup of {len(tokens) // 4} tokens is longer than {limit} (--max-lookup-tokens): "
                "look up the prompt's first tokens",
            )
        chains: dict[tuple[int, str], list[bytes]] = {}
        found: dict[str, int] = {}
        below: dict[str, dict[str, int]] = {}
        for pool_id, pool in self.pools.items():
            if pool.num_groups > 1:  # every group's chain is its own (keyed by the group); no tiers (refused)
                found[pool_id] = pool.lookup(tokens, cache_salt)
                continue
            kind = (pool.block_size, pool.spec.model_id)
            if kind not in chains:
                chains[kind] = pool.prompt_hashes(tokens, cache_salt)
            device = len(pool.cached_prefix_blocks(chains[kind], len(chains[kind])))
            found[pool_id] = device * pool.block_size
            if pool.tiers is not None and (extent := pool.tier_extent(chains[kind], device)):
                below[pool_id] = extent
        return p.LookupResult(found, below)

    def reset_prefix_cache(self, pool_id: str, epoch: int | None = None) -> int:
        """Forget the pool's cached prefixes; with an epoch (an executor's request) only if it is the pool's."""
        pool = self.pool(pool_id) if epoch is None else self.owned(pool_id, epoch)
        return pool.reset_prefix_cache()

    def sequence(self, seq_id: str, pool_id: str | None) -> p.SequenceInfo:
        pools = [self.pool(pool_id)] if pool_id is not None else list(self.pools.values())
        for pool in pools:
            seq = pool.seqs.get(seq_id)
            if seq is not None:
                return p.SequenceInfo(
                    pool_id=pool.spec.pool_id,
                    seq_id=seq_id,
                    num_tokens=pool.num_tokens(seq_id),
                    committed_blocks=seq.committed,
                    blocks=list(seq.table),
                    refcounts=[0 if b == HOLE else pool.refcount[b] for b in seq.table],
                )
        where = f"pool {pool_id!r}" if pool_id is not None else "any pool"
        raise BlockdError(ErrorCode.UNKNOWN_SEQUENCE, f"no live sequence {seq_id!r} in {where}")

    def pool_infos(self) -> list[p.PoolInfo]:
        now = self.clock()
        return [
            p.PoolInfo(
                pool_id=pid,
                model_id=pool.spec.model_id,
                epoch_fingerprint=epoch_fingerprint(pool.spec.epoch),
                num_blocks=pool.num_blocks,
                block_size=pool.block_size,
                live_sequences=len(pool.seqs),
                last_seen_s=round(now - self.last_seen.get(pid, now), 3),
            )
            for pid, pool in sorted(self.pools.items())
        ]

    def pool_stats(self, pool_id: str | None) -> list[PoolStats]:
        pools = [self.pool(pool_id)] if pool_id is not None else [self.pools[k] for k in sorted(self.pools)]
        return [pool.stats() for pool in pools]

    def check(self) -> list[str]:
        problems: list[str] = []
        for pool in self.pools.values():
            problems += pool.check()
        for shared in self.shared_tiers.values():
            readers = [pid for pid, q in self.pools.items() if q.tiers is not None and q.tiers.shared is shared]
            problems += shared.check(readers)
        return problems


def _tier_events(pool: BlockPool) -> Callable[[bool, bytes, str], None]:
    """The pool's tier changes to its KV event sink (set later, by blockd.kv_events, if blockd publishes)."""

    def emit(entered: bool, block_hash: bytes, medium: str) -> None:
        sink = pool.kv_events
        if sink is not None:
            (sink.tier_stored if entered else sink.tier_removed)(pool.spec, block_hash, medium)

    return emit


def totals(stats: list[PoolStats]) -> p.Totals:
    """Sums over pools; rates weighted by what they count."""
    in_use = sum(s.blocks_in_use for s in stats)
    slots = sum(s.blocks_in_use * s.block_size for s in stats)
    queried_tokens = sum(s.counters.queried_tokens for s in stats)
    queried_blocks = sum(s.counters.queried_blocks for s in stats)
    return p.Totals(
        pools=len(stats),
        blocks_total=sum(s.blocks_total for s in stats),
        blocks_in_use=in_use,
        blocks_cached_free=sum(s.blocks_cached_free for s in stats),
        blocks_never_used=sum(s.blocks_never_used for s in stats),
        live_sequences=sum(s.live_sequences for s in stats),
        kv_utilization=sum(s.tokens_held for s in stats) / slots if slots else 1.0,
        prefix_hit_rate_tokens=sum(s.counters.hit_tokens for s in stats) / queried_tokens if queried_tokens else 0.0,
        prefix_hit_rate_blocks=sum(s.counters.hit_blocks for s in stats) / queried_blocks if queried_blocks else 0.0,
        evictions=sum(s.counters.evictions for s in stats),
    )
