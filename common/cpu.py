"""CPU time as Linux accounts it: the whole machine's busy seconds (/proc/stat)."""

from __future__ import annotations

import os


def machine_busy_s() -> float | None:
    """CPU seconds all processes of the machine have used since boot (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
