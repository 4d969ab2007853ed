"""Running a TierStore's ops to the end, as a test wants them: every load begun is landed before it returns."""

from __future__ import annotations

from blockd.tiers import TierOp
from executor.tier_store import TierStore


def run_landed(store: TierStore, ops: list[TierOp], timeout_s: float = 30.0) -> list[int]:
    """Run `ops`, then wait for and land every disk or shared load they began; returns the device blocks whose
    load failed, at once (no file to open) or once read (a bad file)."""
    moved = store.run(ops)
    landed = store.land(set(moved.reading.values()), wait_s=timeout_s)
    assert landed.in_flight == 0, f"{landed.in_flight} reads still going after {timeout_s} s"
    failed = set(landed.failed)
    return [*moved.failed, *(block for block, ticket in moved.reading.items() if ticket in failed)]
