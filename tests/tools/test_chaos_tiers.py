"""`pagedkv chaos --quick --only tiers` in a subprocess: redis-server, blockd, one executor with host and disk KV
tiers and a gateway, authenticated, under greedy load of token prompts whose blocks go to disk and back. Its disk
tier's faults: kill -9 while its write-behind hangs with writes queued, block files truncated and corrupted (in the
payload and the header) while it is down and while it runs, a full disk (RLIMIT_FSIZE: every write fails with
EFBIG), the directory shared with an executor of another model and that model's file copied over one of its own;
then the shared tier alone, its files damaged and deleted while it runs, and kill -9 with a restart on the volume.
No output may differ from the clean stack's, no block stay held, and each injected fault must be counted."""

from __future__ import annotations

from pathlib import Path

from tests.tools.chaos_run import run_chaos


def test_chaos_tier_faults_are_dropped_counted_and_never_read(tmp_path: Path) -> None:
    result, context, returncode = run_chaos(tmp_path, "--quick", "--only", "tiers")
    assert result["requests"] > 50 and result["wrong_outputs"] == 0, context
    assert result["leaked_blocks"] == 0 and result["check"] == "ok", context
    assert result["problems"] == [] and result["unclear_errors"] == 0, context
    scenarios = result["tier_scenarios"]  # (by name: the JSON's keys are sorted)
    kill, running, full, shared, volume = (
        next(s for name, s in scenarios.items() if name.startswith(start))
        for start in (
            "kill -9",
            "block files damaged while it runs",
            "a full disk",
            "the directory shared",
            "the shared",
        )
    )
    assert all(s["wrong"] == 0 and s["requests"] > 0 for s in (kill, running, full, shared, volume)), context
    # kill -9 with writes queued behind a hung one: its temporary files and the files damaged meanwhile dropped
    # at the restart, the surviving blocks loaded again.
    assert kill["writes_queued_at_kill"] >= 4 and kill["temp_files_left"] >= 1, context
    assert kill["dropped_truncated"] >= kill["temp_files_left"] + 2 and kill["dropped_corrupt"] >= 4, context
    assert kill["disk_held_after"] > 0 and kill["loads_disk_after"] >= 1, context
    # Damaged while it runs: one truncated, one flipped in the payload, one in the header; each dropped at its load.
    assert running["files_damaged"] == 3, context
    assert running["dropped_truncated"] >= 1 and running["dropped_corrupt"] >= 2, context
    # A full disk: writes fail, are counted, leave no partial file and are never loaded (no drop); serving goes on.
    assert full["write_failures"] >= 1 and full["written"] == 0 and full["partial_files_left"] == 0, context
    assert full["dropped"] == 0 and full["answered_meanwhile"] > 0, context
    # Another model in the same directory: each finds the other's files foreign, deletes none, loads its own; its
    # file under one of executor-0's names is dropped at the load.
    assert shared["other_files"] >= 1 and shared["other_dropped_foreign_at_start"] >= 1, context
    assert shared["own_files_gone_at_its_start"] == 0 and shared["own_dropped_truncated"] == 0, context
    assert shared["dropped_foreign_at_load"] >= 1 and shared["other_loads_disk"] >= 1, context
    # The shared tier: four files of prompts off the device damaged or deleted, each dropped at its load; after
    # kill -9 the restarted executor loads the survivors from the volume.
    assert volume["files_damaged"] == 4 and volume["shared_written"] >= 12, context
    assert volume["shared_dropped_truncated"] >= 2 and volume["shared_dropped_corrupt"] >= 2, context
    assert volume["shared_loads_after_restart"] >= 1, context
    assert result["restarts"]["executor-0"] >= 1 and result["restarts"]["gateway"] == 0, context
    assert returncode == 0, context
