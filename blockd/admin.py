"""blockd-cli: the operator's window into a running blockd.

Exit status: 0 on success, 1 when `check` finds a violated invariant or blockd answers with an error,
69 (EX_UNAVAILABLE) when blockd does not answer within --timeout (a blockd that serves CURVE never answers a
client without a key it knows: give --keys).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgspec

from blockd.client import BlockdClient, BlockdUnavailable
from blockd.errors import BlockdError
from blockd.protocol import DEFAULT_ENDPOINT
from common.clicks import client_keys, keys_option

EX_UNAVAILABLE = 69


def _run(ctx: click.Context, action: Callable[[BlockdClient], Any]) -> Any:
    client: BlockdClient = ctx.obj
    try:
        return action(client)
    except BlockdUnavailable as exc:
        click.echo(
            f"error: {exc} (is blockd running? set --endpoint or BLOCKD_ENDPOINT; with keys: --keys or PAGEDKV_KEYS)",
            err=True,
        )
        ctx.exit(EX_UNAVAILABLE)
    except BlockdError as exc:
        click.echo(f"error: blockd answered {exc.code}: {exc.message}", err=True)
        ctx.exit(1)
    finally:
        client.close()


def _json(value: Any) -> None:
    click.echo(json.dumps(msgspec.to_builtins(value), indent=2, sort_keys=True))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False))]
    lines += [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False)))
        for r in rows
    ]
    return "\n".join(lines)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--endpoint", envvar="BLOCKD_ENDPOINT", default=DEFAULT_ENDPOINT, help="blockd's ZeroMQ endpoint.")
@click.option("--timeout", type=float, default=3.0, help="Seconds to wait for blockd before giving up.")
@keys_option(
    "Key directory of a blockd that serves CURVE (`pagedkv keys generate`).",
)
@click.option("--key-name", default="operator", help="Which key of --keys to use (an operator's).")
@click.pass_context
def main(ctx: click.Context, endpoint: str, timeout: float, keys_dir: Path | None, key_name: str) -> None:
    """Inspect and operate a running blockd.

    Exit status: 0 on success; 1 when blockd answers with an error or `check` finds a violated invariant;
    69 when blockd does not answer within --timeout.
    """
    curve = client_keys(keys_dir, key_name)
    ctx.obj = BlockdClient(endpoint, timeout_s=timeout, curve=curve)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the raw figures as JSON.")
@click.option("--pool", "pool_id", default=None, help="Only this pool.")
@click.pass_context
def stats(ctx: click.Context, as_json: bool, pool_id: str | None) -> None:
    """Blocks, KV utilization, prefix hit rate, evictions and persistence, per pool and in total."""
    result = _run(ctx, lambda c: c.stats(pool_id))
    if as_json:
        _json(result)
        return
    rows = []
    for s in result.pools:
        rows.append(
            [
                s.pool_id,
                str(s.blocks_total),
                str(s.blocks_in_use),
                str(s.blocks_cached_free),
                str(s.blocks_never_used),
                _pct(s.kv_utilization),
                str(s.live_sequences),
                _pct(s.prefix_hit_rate_tokens),
                _pct(s.prefix_hit_rate_blocks),
                str(s.counters.evictions),
            ]
        )
    t = result.totals
    rows.append(
        [
            "TOTAL",
            str(t.blocks_total),
            str(t.blocks_in_use),
            str(t.blocks_cached_free),
            str(t.blocks_never_used),
            _pct(t.kv_utilization),
            str(t.live_sequences),
            _pct(t.prefix_hit_rate_tokens),
            _pct(t.prefix_hit_rate_blocks),
            str(t.evictions),
        ]
    )
    headers = [
        "pool",
        "blocks",
        "in use",
        "cached free",
        "never used",
        "kv util",
        "seqs",
        "hit tok",
        "hit blk",
        "evictions",
    ]
    click.echo(_table(headers, rows))
    tier_rows = [
        [
            s.pool_id,
            t.medium,
            f"{t.blocks}/{t.capacity_blocks}",
            str(t.counters.hits),
            str(t.counters.loads),
            str(t.counters.demotions),
            str(t.counters.drops),
        ]
        for s in result.pools
        for t in s.tiers
    ]
    if tier_rows:  # the executors' lower KV tiers (blockd.tiers)
        headers = ["pool", "tier", "blocks", "hits", "loads", "demotions", "drops"]
        click.echo("\n" + _table(headers, tier_rows))
    ps = result.persistence
    detail = f" ({ps.redis}, lag {ps.lag_s:.3f} s, flush every {ps.flush_interval_s:g} s)" if ps.enabled else ""
    click.echo(f"\npersistence: {ps.state}{detail}")
    if ps.last_error and ps.state == "degraded":
        click.echo(f"  last error: {ps.last_error}")
    if ps.enabled:
        click.echo(f"  keys: {ps.key_prefix}:*   writer queue: {ps.pending_batches}/{ps.queue_limit} batches")
    problems = [
        f"{n} {what}"
        for n, what in (
            (ps.skipped_records, "bad records skipped"),
            (ps.writer_restarts, "writer restarts"),
            (ps.dropped_batches, "batches dropped (writer queue full)"),
        )
        if n
    ]
    if problems:
        click.echo(f"  {', '.join(problems)}")
    if result.dormant_pools:
        click.echo(f"dormant pools (restored, awaiting their executor): {', '.join(result.dormant_pools)}")
    click.echo(f"uptime: {result.uptime_s:.0f} s   version: {result.version}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.pass_context
def pools(ctx: click.Context, as_json: bool) -> None:
    """Registered pools: their executor's epoch fingerprint (never the epoch itself, which is the executor's
    proof of ownership; the executor logs the same fingerprint at start), shape and when it was last heard
    from."""
    result = _run(ctx, lambda c: c.pools())
    if as_json:
        _json(result)
        return
    rows = [
        [
            i.pool_id,
            i.model_id,
            i.epoch_fingerprint,
            str(i.num_blocks),
            str(i.block_size),
            str(i.live_sequences),
            f"{i.last_seen_s:.1f} s",
        ]
        for i in result.pools
    ]
    click.echo(_table(["pool", "model", "epoch fp", "blocks", "block size", "seqs", "last seen"], rows))
    click.echo(f"\nlease timeout: {result.lease_timeout_s:g} s")


@main.command()
@click.argument("seq_id")
@click.option("--pool", "pool_id", default=None, help="The pool to look in (default: every pool).")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.pass_context
def seq(ctx: click.Context, seq_id: str, pool_id: str | None, as_json: bool) -> None:
    """A live sequence's block table, with each block's refcount."""
    info = _run(ctx, lambda c: c.sequence(seq_id, pool_id))
    if as_json:
        _json(info)
        return
    click.echo(
        f"sequence {info.seq_id} in pool {info.pool_id}: {info.num_tokens} tokens, "
        f"{len(info.blocks)} blocks, {info.committed_blocks} committed to the prefix index"
    )
    click.echo(
        _table(
            ["#", "block", "refcount"],
            [[str(i), str(b), str(r)] for i, (b, r) in enumerate(zip(info.blocks, info.refcounts, strict=False))],
        )
    )


@main.command()
@click.pass_context
def check(ctx: click.Context) -> None:
    """Verify the state invariants (I1-I5) of every pool; exit status 1 if any is violated."""
    problems = _run(ctx, lambda c: c.check())
    if problems:
        for line in problems:
            click.echo(line)
        click.echo(f"{len(problems)} invariant violation(s)", err=True)
        ctx.exit(1)
    click.echo("ok: every invariant holds (I1-I5)")


@main.command("reset-prefix-cache")
@click.argument("pool_id")
@click.pass_context
def reset_prefix_cache(ctx: click.Context, pool_id: str) -> None:
    """Forget every cached prefix of POOL_ID (live sequences keep their blocks)."""
    dropped = _run(ctx, lambda c: c.reset_prefix_cache(pool_id))
    click.echo(f"dropped {dropped} index entries of pool {pool_id}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
