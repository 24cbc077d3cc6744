"""`CpuThreads`: how many threads the CPU executor's step runs on, fitted to what else the machine
runs on the same CPUs.

A step's threads work as a team (OpenMP, and Parkade's kernels on the same threads): each parallel
region ends when its slowest thread does. When another process takes one of the team's cores, the
thread on it waits for the core, and its partners wait for it, idle, at the region's end: the core
the other process did not use goes idle too. Under `parkade up` on 2 vCPUs the gateway, the broker
and a client beside them take 0.7-0.9 of a core while tiny-llama streams, and a 2-thread step ran
on its thread only 55 % of its time (45 % of it waiting). One thread then beat two:
4,167-4,888 against 3,487-3,997 output tok/s, TPOT 11.4-13.1 against 14.3-15.9 ms (alternated,
vLLM's client, 64 streams). Small-llama's steps are six times longer for the same pipeline work a
token, the others take about 0.3 of a core, and two threads beat one (886-898 against 799-816
tok/s). So the size is measured, not fixed: `auto` (the default) counts the CPU time that the rest
of the machine took on this process's CPUs (/proc/stat, less this process's own) over the last
SPAN_S of stepping, sampled every SAMPLE_S. From half a core on, the team leaves one core to it (a
gateway, tokenizer or broker runs one thread of Python or less, so one core is what a pipeline
beside the executor takes), and takes it back below RELEASE_BELOW; the full team has every thread
torch started with. A different size must be wanted by CONFIRM samples in a row. A small step
(SMALL_STEP_TOKENS) runs on the smaller team in any case where the warm-up timed it nearly as fast
there: the measure lags a burst's start; a large one (LARGE_STEP_TOKENS) on the full team.

Why two sizes and no more: dynamo guards the compiled forward on the thread count, so each size is
a compiled variant of its own, made at warm-up (`sizes`); a size first met while serving would
compile then, holding a step up for seconds.

The size applies on the thread that steps (OpenMP's thread count is a property of the calling
thread): `begin_step` sets it there. The compiled forward reads it when it runs (inductor's
`cpp.dynamic_threads`), as do oneDNN and Parkade's kernels (`torch.get_num_threads()`).

NOTE: /proc/stat counts CPUs, not a cgroup's CPU quota: a container limited by quota rather than
by a cpuset sees its host's load. Without /proc/stat (not Linux) `auto` keeps the size torch
started with.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

AUTO = "auto"
# /proc/stat counts in 10 ms ticks: a span of 0.2 s holds 20 a CPU, each tick 5 % of a core. Short
# enough to follow a burst: a 64-stream round of tiny-llama lasts under 2 s.
SPAN_S = 0.2
SAMPLE_S = 0.05
MIN_STEPPING = 0.5  # a span counts when the executor stepped for at least this share of it
CONFIRM = 2  # samples in a row that must want the same new size
# The team leaves the rest of the machine a core once it takes RESERVE_FROM cores, and takes it back
# below RELEASE_BELOW. Measured on 2 vCPUs under `parkade up`: tiny-llama streaming, 0.46-0.63
# (0.28-0.38 while prompts fill the steps); small-llama, 0.0-0.33.
RESERVE_FROM = 0.5
RELEASE_BELOW = 0.35
# A step of at most this many tokens (a few requests' decodes) runs on the smaller team whatever
# the measure says (`auto`), where the warm-up found that team nearly as fast for it (within
# SMALL_STEP_SLACK). A step that small gains little from a second thread when the model's weights
# are few (tiny-llama, offline: 1.58 against 1.76 ms for one row, 2.5 against 2.9 for 16), but a
# partner preempted by the pipeline holds it up for the preemption: under `parkade up` a burst's
# first one-token decodes, planned ahead for its first request, took 14-24 ms each on two threads
# while the gateway took in the burst (before the measure, which follows the load over SPAN_S,
# could react), and the requests that came meanwhile waited behind them; on one thread 2-5 ms.
# Measured under vLLM's client (64 prompts of 256 tokens, alternated, 2026-12-06): a first
# round's mean TTFT 218-280 ms (mean 246, seven stacks) against 240-300 (mean 269), output and
# TPOT within the noise. A model whose weights a step streams from memory gains from the second
# thread's bandwidth (small-llama, 88M: 11.0 against 18.8 ms for one row, 18.3 against 28.0 for
# 16; offline its round lost 5 % with the rule): there small steps keep the measured size.
SMALL_STEP_TOKENS = 16
SMALL_STEP_SLACK = 1.3
# A step of at least this many tokens (a prefill chunk) runs on the full team whatever the measure
# says (`auto`): its work halves on a second thread, and a partner preempted by the pipeline for a
# few ms costs it a few ms, where a decode step of a few ms would lose its whole gain. A burst's
# prompts fill such steps while the gateway takes it in, which is when the measure shrinks the
# team: its prefills ran on one thread (tiny-llama, 2,048-token steps: 100-108 ms against about
# 55 on two). Measured under `parkade up` (tiny-llama, vLLM's client, 64 prompts of 256 tokens
# not seen before, the Zen 4 EPYC, 2026-12-07): mean TTFT 493 against 554 ms over 12 rounds (the
# same prompts in each pair: shorter in 11), output and TPOT the same (2,845 against 2,798 tok/s).
LARGE_STEP_TOKENS = 512
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (not idle, iowait)


def parse_cpu_threads(value: str | int) -> int | None:
    """`--cpu-threads`: "auto" -> None (measured), else a thread count >= 1."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    try:
        threads = int(value)
    except ValueError:
        raise ValueError(f"cpu_threads must be 'auto' or a thread count, got {value!r}") from None
    if threads < 1:
        raise ValueError(f"cpu_threads must be >= 1 or 'auto', got {threads}")
    return threads


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity; every CPU where that is not known)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def busy_seconds(stat_text: str, cpus: Iterable[int], ticks_per_s: float) -> float:
    """Seconds the CPUs `cpus` were busy, from the text of /proc/stat."""
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            values = rest.split()
            ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return ticks / ticks_per_s


def machine_busy_reader(cpus: Iterable[int]) -> Callable[[], float | None]:
    """A reader of `busy_seconds` for `cpus` now; it answers None where /proc/stat is not."""
    cpus = tuple(cpus)
    ticks_per_s = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0

    def read() -> float | None:
        try:
            with open("/proc/stat") as f:
                return busy_seconds(f.read(), cpus, ticks_per_s)
        except OSError:
            return None

    return read


def team_size(max_threads: int, others: float, now: int) -> int:
    """Threads for a team of at most `max_threads`, `now` in force, when other processes take
    `others` cores."""
    if max_threads == 1 or others < RELEASE_BELOW:
        return max_threads
    return max_threads - 1 if others >= RESERVE_FROM else now


class CpuThreads:
    """The team size of one executor's steps. `fixed`: always that many; None: measured (`auto`).

    `set_threads` / `get_threads` act on the calling thread (torch's); `machine_busy` reads the
    busy seconds of the process's CPUs (None: unknown), `own_cpu` the process's own CPU seconds.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        fixed: int | None = None,
        num_cpus: int | None = None,
        set_threads: Callable[[int], None],
        get_threads: Callable[[], int],
        machine_busy: Callable[[], float | None],
        own_cpu: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.fixed = fixed
        self.threads = fixed if fixed is not None else self.max_threads
        # Logical CPUs per thread of the full team (2 on a machine with two hyperthreads a core):
        # the others' busy CPUs count in the team's units.
        self.cpus_per_thread = max(1.0, (num_cpus or self.max_threads) / self.max_threads)
        self._set, self._get = set_threads, get_threads
        self._machine_busy, self._own_cpu, self._clock = machine_busy, own_cpu, clock
        self.others: float | None = None  # cores the rest of the machine took in the last span
        self.small_step_threads: int | None = None  # a small step's team (None: the measured one)
        self.switches = 0
        self._wanted, self._votes = self.threads, 0
        self._step_start = 0.0
        self._stepped = 0.0  # seconds stepped since the start
        # (time, machine busy seconds, own CPU seconds, seconds stepped): the newest spans SPAN_S.
        self._samples: deque[tuple[float, float | None, float, float]] = deque()

    def begin_step(self, num_tokens: int | None = None) -> None:
        """On the stepping thread, before a step of `num_tokens` (None: not known): the team size
        in force there, the smaller one for a small step (SMALL_STEP_TOKENS), the full one for a
        large step (LARGE_STEP_TOKENS)."""
        threads = self.threads
        if num_tokens is not None and self.fixed is None:
            if self.small_step_threads is not None and num_tokens <= SMALL_STEP_TOKENS:
                threads = self.small_step_threads
            elif num_tokens >= LARGE_STEP_TOKENS:
                threads = self.max_threads
        if self._get() != threads:
            self._set(threads)
        self._step_start = self._clock()

    def calibrate_small_steps(self, step_s: Callable[[int], float]) -> None:
        """At warm-up: `step_s(threads)`, the seconds of a step of SMALL_STEP_TOKENS rows on that
        many threads, decides whether small steps run on the smaller team (`auto` only)."""
        if self.fixed is not None or len(self.sizes) < 2:
            return
        full, smaller = self.sizes
        full_s, smaller_s = step_s(full), step_s(smaller)
        self.small_step_threads = smaller if smaller_s <= SMALL_STEP_SLACK * full_s else None
        log.info(
            "CPU team: a step of %d tokens took %.2f ms on %d threads, %.2f on %d: small steps on %d",
            SMALL_STEP_TOKENS, full_s * 1e3, full, smaller_s * 1e3, smaller, self.small_step_threads or full,
        )  # fmt: skip

    def end_step(self) -> None:
        if self.fixed is not None:
            return
        now = self._clock()
        self._stepped += now - self._step_start
        if not self._samples or now - self._samples[-1][0] >= SAMPLE_S:
            self._sample(now)

    def _sample(self, now: float) -> None:
        busy, own = self._machine_busy(), self._own_cpu()
        samples = self._samples
        while len(samples) > 1 and now - samples[1][0] >= SPAN_S:
            samples.popleft()  # the oldest kept starts the span
        if samples:
            start, busy_then, own_then, stepped_then = samples[0]
            wall = now - start
            stepped = self._stepped - stepped_then
            known = busy_then is not None and busy is not None
            if known and wall >= SPAN_S and stepped >= MIN_STEPPING * wall:
                others = max(0.0, (busy - busy_then) - (own - own_then)) / wall
                self.others = others / self.cpus_per_thread
                self._vote(team_size(self.max_threads, self.others, self.threads))
        samples.append((now, busy, own, self._stepped))

    def _vote(self, want: int) -> None:
        if want == self.threads:
            self._votes = 0
            return
        self._votes = self._votes + 1 if want == self._wanted else 1
        self._wanted = want
        if self._votes >= CONFIRM:
            log.info(
                "CPU team: %d -> %d threads (the rest of the machine took %.2f cores)",
                self.threads, want, self.others,
            )  # fmt: skip
            self.threads, self._votes = want, 0
            self.switches += 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every size this team may take (the compiled forward's variants to make at warm-up)."""
        if self.fixed is not None:
            return (self.fixed,)
        return (self.max_threads, self.max_threads - 1) if self.max_threads > 1 else (1,)

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed} (fixed)"
        small = f", small steps on {self.small_step_threads}" if self.small_step_threads is not None else ""
        return f"auto: {self.threads} of {self.max_threads} now{small}"
