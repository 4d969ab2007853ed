"""`pagedkv bench peer`'s report: what each workload measured, the tables of its runs and medians, the plot, and
the figures of the final JSON line."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.bench.common import table_lines
from pagedkv.bench.peer_rounds import RunRecord
from pagedkv.bench.peer_workloads import WorkloadSpec


@dataclass
class WorkloadReport:
    spec: WorkloadSpec
    records: list[RunRecord] = field(default_factory=list)
    medians: dict[str, float] = field(default_factory=dict)
    ratio: float | None = None
    best_vllm: str | None = None
    equality: dict[str, Any] = field(default_factory=dict)
    noisy_records: list[RunRecord] = field(default_factory=list)
    noisy_medians: dict[str, float] = field(default_factory=dict)

    def falls(self) -> dict[str, float]:
        """Each system's fall in median tok/s with the busy neighbour: 1 - noisy / quiet."""
        return {k: 1 - self.noisy_medians[k] / v for k, v in self.medians.items() if v and k in self.noisy_medians}

    def noisy_ok(self) -> bool | None:
        """pagedkv falls by no more than the vLLM setting the ratio is taken against (None: not measured)."""
        falls = self.falls()
        if "pagedkv" not in falls or self.best_vllm not in falls:
            return None
        return falls["pagedkv"] <= falls[self.best_vllm]


def runs_table(records: Sequence[RunRecord], labels: dict[str, str]) -> list[str]:
    rows = [
        [
            str(r.round),
            labels.get(r.system, r.system),
            " ".join(f"{x:.2f}" for x in r.load_before) or "?",
            "?" if r.others_cpu_share is None else f"{r.others_cpu_share:.0%}",
            f"{r.seconds:.2f}",
            f"{r.output_tokens:,}",
            f"{r.tok_s:,.1f}",
            f"{r.cpu_s_per_token * 1e3:.3f}",
        ]
        for r in records
    ]
    columns = ["run", "system", "load before", "others' CPU", "seconds", "tokens", "tok/s", "CPU ms/token"]
    return table_lines(columns, rows, left=2)


def plot_runs(path: Path, records: Sequence[RunRecord], labels: dict[str, str]) -> str | None:
    """A PNG of tok/s per run for every system, one panel per workload; the reason when it cannot be made."""
    try:  # only with --plot: matplotlib is an optional dependency (pagedkv[bench])
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'pagedkv[bench]')"
    workloads = list(dict.fromkeys(r.workload for r in records))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in records if r.workload == workload]
        for system, neighbour in dict.fromkeys((r.system, r.neighbour) for r in mine):
            points = [(r.round, r.tok_s) for r in mine if r.system == system and r.neighbour == neighbour]
            label = labels.get(system, system) + (", busy neighbour" if neighbour else "")
            ax.plot(*zip(*points), marker="o", linestyle="--" if neighbour else "-", label=label)
        ax.set_title(f"workload: {workload}")
        ax.set_xlabel("run")
        ax.set_ylabel("output tok/s")
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({r.round for r in mine}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("pagedkv vs vLLM (offline, same requests), tok/s per run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def report_lines(
    reports: dict[str, WorkloadReport],
    labels: dict[str, str],
    vllm_settings: Sequence[str],
    *,
    runs: int,
    pause_idle: bool,
    quick: bool,
    noisy_neighbour: bool,
) -> list[str]:
    """The tables printed after the runs: each workload's runs, medians, ratio and equality, then the summary
    (and with the busy neighbour, each system's fall)."""
    lines: list[str] = []
    for name, report in reports.items():
        lines += ["", f"workload {name}: {report.spec.describe()}"]
        lines += ["  " + line for line in runs_table(report.records, labels)]
        meds = "; ".join(f"{labels[k]} {v:,.1f}" for k, v in report.medians.items())
        lines.append(f"  median tok/s: {meds}")
        if report.ratio is not None:
            lines.append(f"  ratio pagedkv ÷ {labels[report.best_vllm or '']}: {report.ratio:.2f}")
        lines += ["  " + line for line in report.equality["lines"]]

    lines.append("")
    columns = ["workload", "pagedkv tok/s", *(f"{labels[n]} tok/s" for n in vllm_settings), "pagedkv ÷ best vLLM"]
    rows = [
        [
            name,
            f"{rep.medians.get('pagedkv', 0):,.1f}",
            *(f"{rep.medians.get(n, 0):,.1f}" for n in vllm_settings),
            "-" if rep.ratio is None else f"{rep.ratio:.2f}",
        ]
        for name, rep in reports.items()
    ]
    lines += table_lines(columns, rows)
    lines.append(
        f"medians of {runs} run(s) each, alternated; {os.cpu_count()} cores"
        + ("; the other systems paused during each run" if pause_idle else "")
        + (" [--quick: figures mean nothing]" if quick else "")
    )
    if noisy_neighbour:
        lines += ["", "with a busy-loop neighbour on one core (median tok/s, and the fall from the quiet median):"]
        systems = ("pagedkv", *vllm_settings)
        columns = ["workload", *(labels[n] for n in systems), "pagedkv falls least"]
        rows = []
        for name, rep in reports.items():
            falls = rep.falls()
            cells = [f"{rep.noisy_medians.get(n, 0):,.1f} ({-100 * falls.get(n, 0):+.0f} %)" for n in systems]
            ok = rep.noisy_ok()
            rows.append([name, *cells, "-" if ok is None else "yes" if ok else "no"])
        lines += table_lines(columns, rows)
    return lines


def workloads_json(reports: dict[str, WorkloadReport], *, noisy_neighbour: bool) -> dict[str, Any]:
    """The final JSON line's figures of the workloads: the ratios first (null where not run), then each in full."""

    def ratio_of(name: str) -> float | None:
        rep = reports.get(name)
        return None if rep is None or rep.ratio is None else round(rep.ratio, 4)

    return {
        "ratio_default": ratio_of("default"),
        "ratio_long": ratio_of("long"),
        "ratio_prefix": ratio_of("prefix"),
        **({f"noisy_ok_{name}": rep.noisy_ok() for name, rep in reports.items()} if noisy_neighbour else {}),
        "workloads": {
            name: {
                "spec": asdict(rep.spec),
                "medians_tok_s": {k: round(v, 2) for k, v in rep.medians.items()},
                "best_vllm": rep.best_vllm,
                "runs": [r.as_json() for r in rep.records],
                "equality": {k: v for k, v in rep.equality.items() if k != "lines"},
                **(
                    {
                        "noisy_medians_tok_s": {k: round(v, 2) for k, v in rep.noisy_medians.items()},
                        "noisy_falls": {k: round(v, 4) for k, v in rep.falls().items()},
                        "noisy_runs": [r.as_json() for r in rep.noisy_records],
                    }
                    if noisy_neighbour
                    else {}
                ),
            }
            for name, rep in reports.items()
        },
    }
