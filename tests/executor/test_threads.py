"""The thread governor (executor.threads): it sizes torch's team to the cores other processes leave while the
engine steps, from fake /proc/stat and process-time readings on a fake clock (and this process's real times)."""

from __future__ import annotations

import subprocess
import sys
import time

from executor.params import SamplingParams
from executor.threads import ThreadGovernor, own_cpu_s
from tests.executor.harness import drive, make_engine


class Machine:
    """Counters as Linux would show them: `others` cores busy elsewhere, `own` cores used by this process."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0.0
        self.mine = 0.0
        self.others = 0.0
        self.own = 2.0

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.busy += (self.others + self.own) * seconds
        self.mine += self.own * seconds


def governor(machine: Machine, *, max_threads: int = 2, cores: int = 2, window: float = 0.04, first_step: bool = True):
    """A governor reading the machine every 0.04 s of steps, i.e. every 4 steps of `run`; with `first_step`, the
    engine's first step made at once, so that the stretch measured starts at time 0."""
    applied: list[int] = []
    gov = ThreadGovernor(
        max_threads,
        cores=cores,
        window=window - 1e-9,
        min_steps=1,
        set_threads=applied.append,
        busy=lambda: machine.busy,
        own=lambda: machine.mine,
        clock=lambda: machine.t,
    )
    if first_step:
        gov.step()
    return gov, applied


def idle(gov: ThreadGovernor, machine: Machine, seconds: float, others: float) -> None:
    """The engine out of work for `seconds` (using no CPU) while the rest of the machine uses `others` cores."""
    gov.idle()
    kept = machine.own, machine.others
    machine.own, machine.others = 0.0, others
    machine.advance(seconds)
    machine.own, machine.others = kept


def run(gov: ThreadGovernor, machine: Machine, steps: int) -> int:
    for _ in range(steps):
        machine.advance(0.01)
        gov.step()
    return gov.threads


def test_a_quiet_machine_keeps_the_whole_team() -> None:
    machine = Machine()
    gov, applied = governor(machine)
    assert run(gov, machine, 40) == 2 and applied == []


def test_a_busy_neighbour_shrinks_the_team_and_its_leaving_restores_it() -> None:
    machine = Machine()
    gov, applied = governor(machine)
    machine.others = 1.0  # a busy loop on one core
    assert run(gov, machine, 4) == 2, "one contended window is not enough: it may be a burst"
    assert run(gov, machine, 4) == 1 and applied == [1]
    assert abs(gov.others - 1.0) < 1e-6
    machine.own = 1.0  # with one thread this process uses one core; the neighbour still the other
    assert run(gov, machine, 8) == 1 and applied == [1], (
        "its own smaller share is not mistaken for the neighbour leaving"
    )
    machine.others = 0.1
    assert run(gov, machine, 8) == 2 and applied == [1, 2]


def test_a_neighbour_at_the_edge_does_not_flip_the_team_every_window() -> None:
    machine = Machine()
    gov, applied = governor(machine)
    machine.others = 0.5  # between the thresholds: the team stays as it is
    assert run(gov, machine, 40) == 2 and applied == []
    machine.others = 0.7
    assert run(gov, machine, 8) == 1
    machine.others = 0.5
    assert run(gov, machine, 40) == 1 and applied == [1]


def test_many_cores_lose_only_what_the_neighbours_take() -> None:
    machine = Machine()
    gov, applied = governor(machine, max_threads=16, cores=16)
    machine.others = 2.2
    assert run(gov, machine, 8) == 14 and applied == [14]


def test_readings_happen_once_a_window_and_without_proc_stat_nothing_changes() -> None:
    machine = Machine()
    gov, applied = governor(machine, window=0.16)
    machine.others = 1.0
    assert run(gov, machine, 31) == 2, "the second window is not over yet"
    assert run(gov, machine, 1) == 1
    blind = ThreadGovernor(
        2, cores=2, window=0.0, min_steps=1, set_threads=applied.append, busy=lambda: None, own=lambda: 0.0
    )
    assert [blind.step() for _ in range(5)] == [2] * 5


def test_what_others_do_while_the_engine_is_idle_is_not_contention() -> None:
    """`pagedkv bench peer`: pagedkv's warm-up, then vLLM's warm-up on both cores while pagedkv waits, then
    pagedkv's timed run on a quiet machine. The window spanning vLLM's turn measured 1.74 cores of others and
    dropped the team to one thread for the first 19 s of the run."""
    machine = Machine()
    gov, applied = governor(machine)
    assert run(gov, machine, 6) == 2
    idle(gov, machine, 10.0, others=2.0)
    assert run(gov, machine, 40) == 2 and applied == []
    assert gov.others < 0.1
    for _ in range(5):  # requests now and then, a neighbour busy only in between
        assert run(gov, machine, 3) == 2
        idle(gov, machine, 1.0, others=2.0)
    assert applied == []


def test_a_long_start_before_the_first_step_is_not_measured() -> None:
    """The governor is made with the engine; what the machine does before the first step (another server
    loading and compiling, the model's own load) is not a window."""
    machine = Machine()
    gov, applied = governor(machine, first_step=False)
    idle(gov, machine, 90.0, others=1.2)
    assert run(gov, machine, 40) == 2 and applied == []


def test_a_neighbour_busy_across_the_idle_gaps_still_shrinks_the_team() -> None:
    """Stretches of steps between idle gaps add up into windows: a neighbour that is there whenever the engine
    runs is found even when no stretch lasts a window."""
    machine = Machine()
    gov, applied = governor(machine, window=0.08)
    machine.others = 1.0
    for _ in range(8):
        run(gov, machine, 3)
        idle(gov, machine, 5.0, others=0.0)  # (idle time would have diluted it to nothing)
    assert gov.threads == 1 and applied == [1]
    assert abs(gov.others - 1.0) < 1e-6


def test_an_idle_engine_keeps_its_team_and_decides_nothing() -> None:
    machine = Machine()
    gov, applied = governor(machine)
    for _ in range(3):
        idle(gov, machine, 5.0, others=2.0)
    gov.idle()  # (twice in a row is harmless)
    assert gov.threads == 2 and applied == [] and gov.others == 0.0


def test_own_time_counts_the_children_this_process_ran_and_waited_for() -> None:
    """A compiler run at the first step (the CPU kernels' build) is this process's work, not a neighbour's."""
    before = own_cpu_s()
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end:\n    pass\n"
    started = time.process_time()
    subprocess.run([sys.executable, "-c", spin], check=True)
    mine = time.process_time() - started  # this process's own share of that (starting the child)
    assert own_cpu_s() - before >= 0.3 + mine - 0.02


def test_the_engine_measures_while_it_steps_and_stops_when_its_work_runs_out(tiny_models, blockd) -> None:
    """A real engine and blockd: the stretch measured opens at the first step, stays open while requests run,
    and closes when the last one finishes or is aborted (the engine then waits for requests, unmeasured)."""
    engine = make_engine(tiny_models["llama"], blockd.endpoint, pool_id="governed")
    gov = engine.model_step.threads
    assert gov is not None and not gov.measuring, "nothing is measured before the first step"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seen: list[tuple[bool, bool]] = []
    drive(
        engine,
        {0: [("a", [5, 6, 7], params)], 2: [("b", [8, 9], params)]},
        on_step=lambda _, e: seen.append((e.has_work(), gov.measuring)),
    )
    assert seen[-1] == (False, False)
    assert all(measuring for work, measuring in seen[:-1] if work)
    engine.add_request("c", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    assert gov.measuring
    engine.abort("c")
    while engine.has_work():  # (the abort's frees go to blockd with the next step)
        engine.step()
    assert not gov.measuring
