"""`bench peer --serve`'s --serve-pagedkv-env and what it reads of pagedkv's gateway log."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from pagedkv.bench.peer_serve import gateway_events, pagedkv_env


def test_pagedkv_env_takes_pagedkv_assignments_only() -> None:
    assert pagedkv_env(["PAGEDKV_GATEWAY_EXECUTOR_TIMEOUT=1", "PAGEDKV_EXECUTOR_MAX_STEP_MS=0"]) == {
        "PAGEDKV_GATEWAY_EXECUTOR_TIMEOUT": "1",
        "PAGEDKV_EXECUTOR_MAX_STEP_MS": "0",
    }
    for bad in ("PAGEDKV_EXECUTOR_SEED", "PATH=/tmp"):
        with pytest.raises(click.BadParameter, match="PAGEDKV_NAME=VALUE"):
            pagedkv_env([bad])


def test_gateway_events_counts_load_held_events(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    entries = [
        {"event": "executor_step_long", "step_s": 1.4},
        {"event": "executor_step_long", "step_s": 3.25},
        {"event": "request_refused", "reason": "overloaded"},
        {"event": "request_done"},
    ]
    log.write_text("\n".join(json.dumps(e) for e in entries) + "\nnot json\n")
    assert gateway_events(log) == {
        "executor_step_long": 2,
        "executor_out_of_rotation": 0,
        "stream_failed": 0,
        "request_refused": 1,
    }
    assert gateway_events(tmp_path / "absent.log")["stream_failed"] == 0
