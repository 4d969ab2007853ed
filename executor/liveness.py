"""The executor's liveness beacon: a thread of its own that tells every gateway, every `ALIVE_INTERVAL_S`, that
the process is alive, whatever the step loop is doing.

Liveness is kept apart from progress, so that a step of seconds does not look like death to a gateway; why the
thread is not starved is told in docs/architecture.md ("Failures").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from executor import protocol as ep

log = structlog.get_logger("executor")


class LivenessBeacon:
    """`send` is the server's: it sends on the step loop's socket under the server's lock, held by the loop only
    while it reads or sends, never during a step (a lock is the full barrier ZeroMQ asks of a shared socket)."""

    def __init__(
        self,
        send: Callable[[ep.Alive], None],
        alive: Callable[[], ep.Alive],
        interval_s: float = ep.ALIVE_INTERVAL_S,
    ) -> None:
        self._send, self._alive, self.interval_s = send, alive, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="executor-liveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._send(self._alive())
            except Exception as exc:  # a failed beat must not end the beacon (the next one may pass)
                log.warning("liveness_beat_failed", error=str(exc))
