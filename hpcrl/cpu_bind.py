"""Which cores a local CPU run's processes use (`resources.cpu_bind`).

    cores 0 .. S-1            | block 0            | block 1            | ...
    controller, reward pool,  | trainer rank 1,    | trainer rank 2,    |
    the engines' host ranks   | engine 0           | engine 1           |      (auto)

    cores 0 .. S-1 (or all)   | block 0            | ... | block T           | ...
    the same                  | trainer rank 1     | ... | engine 0          | ...  (apart)

The trainer ranks and the engines take turns: the engines generate, the trainer ranks train, then
the weights move. `auto` (not the default) puts trainer rank i and engine i on one block of
`resources.cpus_per_rank` cores, as verl's hybrid engine puts the actor and the rollout on the same
GPUs, and every other process on the cores before the blocks. Each phase then starts on a core that
was busy a moment ago and whose caches hold the torch code the other phase just ran; left to the
OS, the trainer may wake on a core that sat idle through generation. Measured on the tiny example
(2 cores of a shared VM, benchmarks/cpu_bind.py): +2% to +7% steps/s in three runs, -12% and 0% in
two others; this host's noise is as large as the effect, so binding stays opt-in.

`apart` gives every trainer rank and every engine a block of its own, for asynchronous runs
(rollout.max_staleness >= 1: the engines generate while the trainer trains): T + E blocks, and the
service processes the cores left, or every core when none is left (they mostly wait).

Start-up runs on every core of the plan (the trainer builds its model while the engines load
theirs): the trainer and rollout ranks bind once their init has run, an engine once it answers
/health. The controller binds at once; the reward workers it starts inherit its cores.

`hpcrl run` makes the plan once from the cores it may use (`os.sched_getaffinity`: `taskset -c 4-7
hpcrl run ...` keeps a run, and its blocks, on cores 4-7) and hands it to the ranks in the
HPCRL_CPU_PLAN environment variable. Slurm steps keep srun's binding (`slurm.srun_args`); runs on
GPUs and runs with too few cores for a block per concurrent rank plus one are not bound.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "HPCRL_CPU_PLAN"


@dataclass(frozen=True)
class CpuPlan:
    """`service`: the cores of the controller, the engines' host ranks and what they start other
    than engines; `blocks[i]`: the cores of trainer rank i and engine i (one trainer rank or engine
    per block at a time, so len(blocks) = max(trainer ranks, engines)); `apart`: engine i's block is
    blocks[engine_offset + i] (the trainer ranks' blocks come first)."""

    service: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    engine_offset: int = 0

    def for_rank(self, world_rank: int, num_trainer: int) -> tuple[int, ...]:
        """The cores of a world rank: trainer ranks (1..num_trainer) their block, the rest service."""
        return self.blocks[world_rank - 1] if 1 <= world_rank <= num_trainer else self.service

    def for_engine(self, engine_index: int) -> tuple[int, ...]:
        return self.blocks[self.engine_offset + engine_index]

    def describe(self, num_trainer: int, num_engines: int) -> str:
        """One line for `hpcrl run`'s output: who runs on which cores."""
        parts = [f"controller on {_cores(self.service)}"]
        for i, block in enumerate(self.blocks):
            who = [f"trainer rank {i + 1}"] if i < num_trainer else []
            e = i - self.engine_offset
            who += [f"engine {e}"] if 0 <= e < num_engines and (self.engine_offset or i < num_engines) else []
            parts.append(f"{' + '.join(who)} on {_cores(block)}")
        return "; ".join(parts)

    def to_env(self) -> str:
        return json.dumps({"service": self.service, "blocks": self.blocks, "engine_offset": self.engine_offset})

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ[str] = os.environ) -> CpuPlan | None:
        text = environ.get(ENV)
        if not text:
            return None
        raw = json.loads(text)
        return cls(tuple(raw["service"]), tuple(tuple(b) for b in raw["blocks"]), raw.get("engine_offset", 0))


def _cores(cores: Sequence[int]) -> str:
    return "core " + str(cores[0]) if len(cores) == 1 else "cores " + ",".join(map(str, cores))


def make_apart_plan(cores: Sequence[int], num_trainer: int, num_engines: int,
                    cpus_per_rank: int) -> tuple[CpuPlan | None, str]:
    """`apart`: (the plan, "") with a block of `cpus_per_rank` cores for every trainer rank and every
    engine, the service processes on the cores left or, when none is, on every core; or (None, why)."""
    cores = sorted(cores)
    need = (num_trainer + num_engines) * cpus_per_rank
    if len(cores) < need:
        return None, (f"{len(cores)} usable core(s); binding apart needs {need} for the trainer ranks and "
                      f"engines (({num_trainer} + {num_engines}) x {cpus_per_rank} cpus_per_rank)")
    split = len(cores) - need
    blocks = tuple(tuple(cores[split + i * cpus_per_rank: split + (i + 1) * cpus_per_rank])
                   for i in range(num_trainer + num_engines))
    return CpuPlan(tuple(cores[:split]) or tuple(cores), blocks, num_trainer), ""


def make_plan(cores: Sequence[int], num_trainer: int, num_engines: int,
              cpus_per_rank: int) -> tuple[CpuPlan | None, str]:
    """(the plan, "") for these cores, or (None, why not): a block of `cpus_per_rank` cores for each
    of max(num_trainer, num_engines) and at least one core left for the rest; the blocks take the
    highest cores, the service processes the lowest."""
    cores = sorted(cores)
    num_blocks = max(num_trainer, num_engines)
    need = num_blocks * cpus_per_rank
    if len(cores) < need + 1:
        return None, (f"{len(cores)} usable core(s); binding needs {need} for the trainer ranks and "
                      f"engines (max({num_trainer}, {num_engines}) x {cpus_per_rank} cpus_per_rank) + 1")
    split = len(cores) - need
    blocks = tuple(tuple(cores[split + i * cpus_per_rank: split + (i + 1) * cpus_per_rank])
                   for i in range(num_blocks))
    return CpuPlan(tuple(cores[:split]), blocks), ""


def bind_process(cores: Sequence[int], pid: int | str = "self") -> None:
    """Bind every thread a process has now (this one by default) to `cores`; threads it starts later
    inherit the binding of the thread that starts them. Repeated until no thread is new, so that
    one started meanwhile is not missed."""
    done: set[int] = set()
    while True:
        tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - done
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        done |= tids


def _parse_list(text: str) -> tuple[int, ...]:
    """A kernel cpu list ("0-2,5") as its cores."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return tuple(out)


def thread_cores(pid: int | str = "self") -> dict[int, tuple[int, ...]]:
    """The kernel's core list (Cpus_allowed_list) of every thread of a process, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(task.name)] = _parse_list(line.split(":", 1)[1].strip())
    return out


def report_line(what: str, pid: int | str = "self") -> str:
    """'cpu_bind: <what> (pid P): T threads on core(s) L' (L as in `CpuPlan.describe`), or each
    thread's cores when they differ: what the kernel says, for the log and the tests. Never raises
    (a process that ended meanwhile, an unreadable /proc): the line then says why it has no cores."""
    try:
        cores = thread_cores(pid)
    except OSError as exc:
        return f"cpu_bind: {what} (pid {pid}): cores unknown ({exc})"
    if not cores:
        return f"cpu_bind: {what} (pid {pid}): cores unknown (no threads left)"
    lists = sorted(set(cores.values()))
    real_pid = os.getpid() if pid == "self" else pid
    on = (_cores(lists[0]) if len(lists) == 1
          else " | ".join(f"thread {t} {_cores(c)}" for t, c in sorted(cores.items())))
    return f"cpu_bind: {what} (pid {real_pid}): {len(cores)} threads on {on}"
