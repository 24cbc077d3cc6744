"""The CPU executor's team size (services/executor/cpu_threads.py): the option, /proc/stat, and
the measured choice between the full team and one that leaves the rest of the machine a core."""

from __future__ import annotations

import sys

import pytest

from parkade.services.executor import cpu_threads
from parkade.services.executor.cpu_threads import (
    CONFIRM,
    LARGE_STEP_TOKENS,
    SAMPLE_S,
    SMALL_STEP_TOKENS,
    SPAN_S,
    CpuThreads,
    busy_seconds,
    machine_busy_reader,
    parse_cpu_threads,
    team_size,
    usable_cpus,
)
from parkade.services.executor.options import ExecutorOptions

STAT = """cpu  900 10 300 5000 20 0 7 3 0 0
cpu0 400 5 100 2500 10 0 3 1 0 0
cpu1 500 5 200 2500 10 0 4 2 0 0
intr 123456 0 0
ctxt 99
"""


def test_the_option_takes_auto_or_a_thread_count():
    assert parse_cpu_threads("auto") is None
    assert parse_cpu_threads(" AUTO ") is None
    assert parse_cpu_threads("3") == 3
    assert parse_cpu_threads(2) == 2
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ValueError, match="cpu_threads"):
            parse_cpu_threads(bad)
    assert ExecutorOptions().cpu_threads == "auto"
    assert ExecutorOptions(cpu_threads=4).cpu_threads == "4"
    with pytest.raises(ValueError, match="cpu_threads"):
        ExecutorOptions(cpu_threads="fast")


def test_busy_seconds_counts_the_named_cpus_without_idle_and_iowait():
    # user + nice + system + irq + softirq + steal; the aggregate "cpu" line is not a CPU.
    assert busy_seconds(STAT, [0], 100) == pytest.approx((400 + 5 + 100 + 0 + 3 + 1) / 100)
    assert busy_seconds(STAT, [1], 100) == pytest.approx((500 + 5 + 200 + 0 + 4 + 2) / 100)
    assert busy_seconds(STAT, [0, 1], 100) == pytest.approx(12.20)
    assert busy_seconds(STAT, [7], 100) == 0.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_machine_reader_reads_this_machine():
    read = machine_busy_reader(usable_cpus())
    first = read()
    sum(i * i for i in range(300_000))  # some busy time
    second = read()
    assert first is not None and second is not None and second >= first > 0


def test_team_size_leaves_a_core_from_half_a_core_and_takes_it_back_below_the_lower_mark():
    assert team_size(2, 0.1, now=2) == 2
    assert team_size(2, 0.6, now=2) == 1
    assert team_size(8, 2.5, now=8) == 7  # one core left, never more: two compiled sizes
    # Between the marks the size in force stays: no flapping at the edge.
    between = (cpu_threads.RELEASE_BELOW + cpu_threads.RESERVE_FROM) / 2
    assert team_size(2, between, now=2) == 2
    assert team_size(2, between, now=1) == 1
    assert team_size(2, cpu_threads.RELEASE_BELOW - 0.01, now=1) == 2
    assert team_size(1, 5.0, now=1) == 1  # a team of one is never smaller


class Machine:
    """A clock, the machine's busy seconds and the process's own CPU seconds, moved by hand;
    the thread count as torch would keep it on the stepping thread."""

    def __init__(self, threads: int = 2) -> None:
        self.now = 100.0
        self.busy = 0.0
        self.own = 0.0
        self.torch_threads = threads
        self.set_calls: list[int] = []

    def set_threads(self, n: int) -> None:
        self.set_calls.append(n)
        self.torch_threads = n

    def team(self, max_threads: int = 2, fixed: int | None = None, readable: bool = True) -> CpuThreads:
        return CpuThreads(
            max_threads, fixed=fixed, num_cpus=max_threads,
            set_threads=self.set_threads, get_threads=lambda: self.torch_threads,
            machine_busy=(lambda: self.busy) if readable else (lambda: None),
            own_cpu=lambda: self.own, clock=lambda: self.now,
        )  # fmt: skip

    def step_threads(self, team: CpuThreads, num_tokens: int | None) -> int:
        """One step of `num_tokens` (no time passing): -> the threads it ran on."""
        team.begin_step(num_tokens)
        threads = self.torch_threads
        team.end_step()
        return threads

    def steps(self, team: CpuThreads, seconds: float, *, own: float, others: float, idle: float = 0) -> None:
        """Step for `seconds` in 10 ms steps (each followed by `idle` seconds), this process
        using `own` cores and the rest of the machine `others`."""
        elapsed = 0.0
        while elapsed < seconds - 1e-9:
            team.begin_step()
            self.advance(0.01, own, others)
            team.end_step()
            self.advance(idle, own, others)
            elapsed += 0.01 + idle

    def advance(self, dt: float, own: float, others: float) -> None:
        self.now += dt
        self.own += own * dt
        self.busy += (own + others) * dt


def test_a_busy_machine_gets_a_core_after_confirm_windows_and_gets_it_back_when_it_quiets():
    machine = Machine()
    team = machine.team()
    assert team.sizes == (2, 1) and team.threads == 2
    machine.steps(team, SPAN_S + SAMPLE_S / 2, own=1.2, others=0.8)
    assert team.threads == 2, "one span is not enough"
    machine.steps(team, SAMPLE_S * (CONFIRM + 1), own=1.2, others=0.8)
    assert team.threads == 1 and team.switches == 1
    assert team.others == pytest.approx(0.8, abs=0.05)
    team.begin_step()
    assert machine.torch_threads == 1, "the next step runs on the smaller team"
    team.end_step()
    machine.steps(team, SPAN_S + SAMPLE_S * (CONFIRM + 1), own=1.0, others=0.1)
    assert team.threads == 2 and team.switches == 2
    assert machine.set_calls == [1, 2]


def test_spans_of_idling_and_an_unreadable_machine_change_nothing():
    machine = Machine()
    team = machine.team()
    # Busy machine, but the executor stepped 10 ms of every 100: not its load to judge.
    machine.steps(team, 3.0, own=0.1, others=1.5, idle=0.09)
    assert team.threads == 2 and team.others is None
    blind = machine.team(readable=False)
    machine.steps(blind, 3.0, own=1.0, others=1.5)
    assert blind.threads == 2 and blind.others is None


def test_a_fixed_team_is_set_on_the_stepping_thread_and_never_measured():
    machine = Machine(threads=2)
    team = machine.team(fixed=1)
    assert team.sizes == (1,) and "fixed" in team.describe()
    machine.steps(team, 2.0, own=1.0, others=1.5)
    assert machine.torch_threads == 1 and machine.set_calls == [1]
    assert team.others is None and team.switches == 0


def test_a_small_step_runs_on_the_smaller_team_where_the_warm_up_timed_it_nearly_as_fast():
    machine = Machine()
    team = machine.team()
    team.begin_step(1)
    assert machine.torch_threads == 2, "not calibrated: small steps keep the measured size"
    team.end_step()
    timed: list[int] = []
    team.calibrate_small_steps(lambda threads: timed.append(threads) or {2: 0.0020, 1: 0.0023}[threads])
    assert timed == [2, 1] and team.small_step_threads == 1 and "small steps on 1" in team.describe()
    assert machine.step_threads(team, SMALL_STEP_TOKENS) == 1, "a few decodes: one thread"
    assert machine.step_threads(team, SMALL_STEP_TOKENS + 1) == 2, "a bigger step: the measured size"
    assert machine.step_threads(team, None) == 2, "a step of unknown size: the measured size"
    assert team.threads == 2 and team.switches == 0, "a small step is not a switch of the team"
    assert machine.set_calls == [1, 2]


def test_small_steps_keep_the_measured_size_where_the_second_thread_pays():
    machine = Machine()
    team = machine.team()
    slack = cpu_threads.SMALL_STEP_SLACK
    team.calibrate_small_steps(
        lambda threads: {2: 0.011, 1: 0.011 * slack * 1.1}[threads]
    )  # weights streamed
    assert team.small_step_threads is None and "small steps" not in team.describe()
    assert machine.step_threads(team, 1) == 2


def test_a_large_step_runs_on_the_full_team_while_the_measure_keeps_the_smaller_one():
    machine = Machine()
    team = machine.team()
    machine.steps(team, SPAN_S + SAMPLE_S * (CONFIRM + 1), own=1.2, others=0.8)
    assert team.threads == 1 and machine.torch_threads == 1
    assert machine.step_threads(team, LARGE_STEP_TOKENS) == 2, "a prefill chunk: the full team"
    assert machine.step_threads(team, LARGE_STEP_TOKENS - 1) == 1, "below the mark: the measured size"
    assert machine.step_threads(team, None) == 1, "a step of unknown size: the measured size"
    assert team.threads == 1 and team.switches == 1, "a large step is not a switch of the team"
    fixed_machine = Machine()
    fixed_machine.team(fixed=1).begin_step(LARGE_STEP_TOKENS * 4)
    assert fixed_machine.torch_threads == 1, "a fixed team is what the user set, for every step"


def test_a_fixed_team_and_a_team_of_one_are_never_calibrated():
    for team in (Machine(threads=1).team(fixed=2), Machine(threads=1).team(max_threads=1)):
        team.calibrate_small_steps(lambda threads: pytest.fail("timed a step"))
        assert team.small_step_threads is None


def test_a_team_of_one_has_one_size():
    machine = Machine(threads=1)
    team = machine.team(max_threads=1)
    assert team.sizes == (1,)
    machine.steps(team, 2.0, own=1.0, others=3.0)
    assert team.threads == 1 and machine.set_calls == []
