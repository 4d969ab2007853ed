"""The thread governor (executor.threads): it sizes torch's team to the cores other processes leave, from fake
/proc/stat and process-time readings on a fake clock."""

from __future__ import annotations

from executor.threads import ThreadGovernor


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


def governor(machine: Machine, *, max_threads: int = 2, cores: int = 2, window: float = 0.04):
    """A governor reading the machine every 0.04 s, i.e. every 4 steps of `run`."""
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
    return gov, applied


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
