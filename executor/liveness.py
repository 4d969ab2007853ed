"""The executor's liveness beacon: a thread of its own that tells every gateway, every `ALIVE_INTERVAL_S`, that
the process is alive, whatever the step loop is doing.

Liveness is kept apart from progress: a step of seconds (a big model, a long prefill, a loaded host) sends no
delta and answers no question until it ends, and a gateway that judged that silence as death would fail every
stream of a live executor. The beacon needs the interpreter only for a moment each interval: torch's kernels,
the native CPU kernels (ctypes) and CUDA waits release the GIL, and in a long pure-Python stretch CPython hands
the GIL to another thread every switch interval (5 ms), so neither starves it. What it cannot outlive is the
process (killed, or stopped: SIGSTOP stops every thread), which is what the gateway's lease detects.

The serving socket is the step loop's; the beacon sends on it under the server's lock (held by the loop only
while it reads or sends, never during a step: a lock is the full barrier ZeroMQ asks of a socket shared that way).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from executor import protocol as ep

log = structlog.get_logger("executor")


class LivenessBeacon:
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
