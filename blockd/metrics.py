"""blockd's Prometheus metrics. Updated on the daemon's thread; served by prometheus_client's HTTP thread."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from blockd import protocol as p


class BlockdMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "blockd_requests", "Requests answered, by op and outcome", ["op", "outcome"], registry=r
        )
        self.request_seconds = Histogram(
            "blockd_request_seconds",
            "Time to handle one request inside blockd (decode to encode)",
            ["op"],
            buckets=(5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1),
            registry=r,
        )
        self.blocks_total = Gauge("blockd_pool_blocks", "Blocks in the pool", ["pool"], registry=r)
        self.blocks_in_use = Gauge(
            "blockd_pool_blocks_in_use", "Blocks referenced by live sequences", ["pool"], registry=r
        )
        self.index_entries = Gauge("blockd_pool_index_entries", "Prefix-index entries", ["pool"], registry=r)
        self.live_sequences = Gauge("blockd_pool_live_sequences", "Live sequences", ["pool"], registry=r)
        self.hit_tokens = Gauge(
            "blockd_pool_prefix_hit_tokens", "Prompt tokens found cached at admit", ["pool"], registry=r
        )
        self.queried_tokens = Gauge("blockd_pool_prompt_tokens", "Prompt tokens admitted", ["pool"], registry=r)
        self.evictions = Gauge("blockd_pool_evictions", "Cached blocks evicted by allocation", ["pool"], registry=r)
        tier = ["pool", "medium"]
        self.tier_gauges = {
            "capacity_blocks": Gauge(
                "blockd_pool_tier_capacity_blocks",
                "Blocks a lower KV tier (CPU, DISK, SHARED) holds at most",
                tier,
                registry=r,
            ),
            "blocks": Gauge("blockd_pool_tier_blocks", "Blocks a lower KV tier holds", tier, registry=r),
            "hits": Gauge("blockd_pool_tier_hits", "Admitted blocks found in a lower tier", tier, registry=r),
            "loads": Gauge("blockd_pool_tier_loads", "Blocks loaded from a lower tier to the device", tier, registry=r),
            "demotions": Gauge(
                "blockd_pool_tier_demotions", "Blocks written into a lower tier (evicted above it)", tier, registry=r
            ),
            "drops": Gauge(
                "blockd_pool_tier_drops", "Blocks that left a lower tier with no copy below", tier, registry=r
            ),
        }
        self._known_tiers: set[tuple[str, str]] = set()
        self.persistence_degraded = Gauge("blockd_persistence_degraded", "1 while Redis writes are failing", registry=r)
        self.persistence_lag = Gauge(
            "blockd_persistence_lag_seconds", "Age of the oldest index change not yet in Redis", registry=r
        )
        self.persistence_skipped = Gauge(
            "blockd_persistence_skipped_records",
            "Corrupt or unknown-version records found in Redis and left out",
            registry=r,
        )
        self.persistence_writer_restarts = Gauge(
            "blockd_persistence_writer_restarts", "Times the Redis writer thread died and was restarted", registry=r
        )
        self.persistence_dropped_batches = Gauge(
            "blockd_persistence_dropped_batches",
            "Index-change batches dropped because the Redis writer's queue was full",
            registry=r,
        )
        self.expired_pools = Counter("blockd_expired_pools", "Pools dropped after their lease ran out", registry=r)
        self._known_pools: set[str] = set()

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def update(self, pools: dict, persistence: p.PersistenceStats) -> None:
        """Cheap gauges only (O(1) per pool): a full scan per scrape would stall the request loop."""
        for pool_id, pool in pools.items():
            self.blocks_total.labels(pool_id).set(pool.num_blocks)
            self.blocks_in_use.labels(pool_id).set(pool.num_blocks - len(pool.free_queue))
            self.index_entries.labels(pool_id).set(len(pool.index))
            self.live_sequences.labels(pool_id).set(len(pool.seqs))
            self.hit_tokens.labels(pool_id).set(pool.counters.hit_tokens)
            self.queried_tokens.labels(pool_id).set(pool.counters.queried_tokens)
            self.evictions.labels(pool_id).set(pool.counters.evictions)
        for gone in self._known_pools - set(pools):
            for gauge in (
                self.blocks_total,
                self.blocks_in_use,
                self.index_entries,
                self.live_sequences,
                self.hit_tokens,
                self.queried_tokens,
                self.evictions,
            ):
                gauge.remove(gone)
        self._known_pools = set(pools)
        tiers: set[tuple[str, str]] = set()
        for pool_id, pool in pools.items():
            for t in pool.tiers.all_tiers if pool.tiers is not None else ():
                tiers.add((pool_id, t.medium))
                g, c = self.tier_gauges, t.counters
                g["capacity_blocks"].labels(pool_id, t.medium).set(t.capacity)
                g["blocks"].labels(pool_id, t.medium).set(len(t.entries))
                g["hits"].labels(pool_id, t.medium).set(c.hits)
                g["loads"].labels(pool_id, t.medium).set(c.loads)
                g["demotions"].labels(pool_id, t.medium).set(c.demotions)
                g["drops"].labels(pool_id, t.medium).set(c.drops)
        for gone in self._known_tiers - tiers:
            for gauge in self.tier_gauges.values():
                gauge.remove(*gone)
        self._known_tiers = tiers
        self.persistence_degraded.set(1 if persistence.state == "degraded" else 0)
        self.persistence_lag.set(persistence.lag_s)
        self.persistence_skipped.set(persistence.skipped_records)
        self.persistence_writer_restarts.set(persistence.writer_restarts)
        self.persistence_dropped_batches.set(persistence.dropped_batches)
