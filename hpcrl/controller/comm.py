"""The MPI control plane: roles, commands and replies, every wait under a deadline.

One MPI world: rank 0 is the controller, then the trainer ranks, then one rank per rollout engine.
Roles come from `COMM_WORLD.Split` (each role also gets its own communicator). The controller
sends small pickled commands point-to-point and collects one reply per rank; waits poll
non-blocking requests until a deadline, after which the silent ranks are named with role, host and
phase. Between polls a waiting rank sleeps on its doorbell (hpcrl/controller/doorbell.py), which
every sender rings after posting a message: no spinning on the 2-core laptop case, and no sleep
latency per hop either.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from hpcrl.controller.doorbell import Doorbell
from hpcrl.dist import routable_host
from launch.procs import process_gone

TAG_COMMAND = 11
TAG_REPLY = 12
NAP_MIN_S, NAP_MAX_S = 5e-5, 5e-3  # poll back-off of a waiting rank (a doorbell ring resets it)
ROLES = ("controller", "trainer", "rollout")


class RankFailure(RuntimeError):
    """A rank crashed, hung or answered with an error. The message names rank, role, host, phase."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    role: str
    host: str
    pid: int
    ip: str = "127.0.0.1"  # where other hosts reach this rank's doorbell
    bell_port: int = 0

    def describe(self) -> str:
        return f"rank {self.rank} ({self.role}, host {self.host}, pid {self.pid})"


@dataclass
class Command:
    op: str
    step: int
    payload: Any = None


@dataclass
class Reply:
    rank: int
    op: str
    step: int
    ok: bool
    payload: Any = None
    error: str = ""


def role_of(world_rank: int, num_trainer: int) -> str:
    if world_rank == 0:
        return "controller"
    return "trainer" if world_rank <= num_trainer else "rollout"


@dataclass
class World:
    """This process's place in the job: world comm, role comm and the table of every rank."""

    comm: Any
    role: str
    role_comm: Any
    ranks: list[RankInfo] = field(default_factory=list)
    bell: Doorbell | None = None

    @property
    def rank(self) -> int:
        return int(self.comm.Get_rank())

    def ranks_of(self, role: str) -> list[int]:
        return [r.rank for r in self.ranks if r.role == role]

    def ring(self, rank: int) -> None:
        """Wake `rank` if it waits for a message (loopback when it shares this host)."""
        if self.bell is None:
            return
        to, me = self.ranks[rank], self.ranks[self.rank]
        self.bell.ring(("127.0.0.1" if to.host == me.host else to.ip, to.bell_port))

    def gone(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` on this host whose process is gone (remote ones are left to deadlines)."""
        me = self.ranks[self.rank]
        return [r for r in ranks if self.ranks[r].host == me.host and process_gone(self.ranks[r].pid)]

    def nap(self, seconds: float) -> bool:
        """Sleep up to `seconds`, less if the doorbell rings (then True)."""
        if self.bell is None:
            time.sleep(seconds)
            return False
        return self.bell.wait(seconds)


def join_world(num_trainer: int) -> World:
    """Collective over COMM_WORLD: split into roles and exchange (role, host, pid) of every rank."""
    comm = MPI.COMM_WORLD
    role = role_of(comm.Get_rank(), num_trainer)
    role_comm = comm.Split(color=ROLES.index(role), key=comm.Get_rank())
    # Under Slurm name the (possibly virtual) node; several slurmd may share one host.
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    bell = Doorbell()
    me = RankInfo(comm.Get_rank(), role, host, os.getpid(), routable_host(), bell.port)
    ranks = comm.allgather(me)
    return World(comm, role, role_comm, ranks, bell)


def _receive(world: World, sources: list[int], tag: int, deadline: float,
             gone: Callable[[list[int]], list[int]] | None = None,
             watch: Callable[[], None] | None = None) -> dict[int, Any]:
    """Receive one pickled message from each source until the monotonic deadline; return what
    arrived. Matched probes (improbe) size the buffer, so payloads of any size work. Between polls
    the rank naps on its doorbell (back-off 50 us to 5 ms, reset by a ring or a message), so waiting
    ranks leave the CPU to working ones and still wake as soon as a sender rings. `gone` (checked
    twice a second) returns awaited sources known to be dead, which ends the wait early. `watch`
    runs after every poll that leaves sources to wait for; what it raises ends the wait.

    After a wake-up (and at the start) an empty poll is repeated once before napping: MPICH's first
    probe can miss a message that arrived while this rank was busy or asleep (its progress pulls the
    message in, the next probe finds it), and the nap would cost ~0.15 ms per hop."""
    done: dict[int, Any] = {}
    nap = NAP_MIN_S
    next_check = time.monotonic() + 0.5
    repoll = True
    while len(done) < len(sources):
        if gone is not None and time.monotonic() > next_check:
            next_check = time.monotonic() + 0.5
            if gone([s for s in sources if s not in done]):
                break
        for src in sources:
            if src in done:
                continue
            msg = world.comm.improbe(source=src, tag=tag)
            if msg is not None:
                done[src] = msg.recv()
                nap = NAP_MIN_S
        if len(done) == len(sources) or time.monotonic() > deadline:
            break
        if repoll:
            repoll = False
            continue
        if watch is not None:
            watch()
        repoll = world.nap(nap)
        nap = NAP_MIN_S if repoll else min(nap * 2, NAP_MAX_S)
    return done


def _send_all(world: World, messages: dict[int, Any], tag: int, deadline: float) -> list[int]:
    """Send each (dest -> object) without blocking past the deadline, ringing each dest's doorbell;
    return dests not reached."""
    reqs = {dest: world.comm.isend(obj, dest=dest, tag=tag) for dest, obj in messages.items()}
    for dest in reqs:
        world.ring(dest)
    pending = dict(reqs)
    nap = NAP_MIN_S
    while pending and time.monotonic() <= deadline:
        for dest in [d for d, r in pending.items() if r.Test()]:
            del pending[dest]
        if pending:
            time.sleep(nap)
            nap = min(nap * 2, NAP_MAX_S)
    return sorted(pending)


class RoleGroup:
    """Controller-side handle on the ranks of one role."""

    def __init__(self, world: World, role: str) -> None:
        self.world = world
        self.role = role
        self.ranks = world.ranks_of(role)

    def call(self, op: str, step: int, payload: Any, timeout_s: float,
             per_rank: dict[int, Any] | None = None) -> dict[int, Any]:
        """Send `op` to every rank of the role and return {rank: reply payload}."""
        return self.async_call(op, step, payload, per_rank, timeout_s).wait(timeout_s)

    def async_call(self, op: str, step: int, payload: Any = None,
                   per_rank: dict[int, Any] | None = None, timeout_s: float = 300.0) -> PendingCall:
        """Send the command now (under the deadline); the replies are collected by `wait`."""
        messages = {rank: Command(op, step, per_rank[rank] if per_rank is not None else payload)
                    for rank in self.ranks}
        unreached = _send_all(self.world, messages, TAG_COMMAND, time.monotonic() + timeout_s)
        if unreached:
            who = "; ".join(self.world.ranks[r].describe() for r in unreached)
            raise RankFailure(f"could not deliver phase '{op}' of step {step} within {timeout_s:.0f} s "
                              f"to {who} (crashed, exited or hung; see its log in RUN_DIR/logs/)")
        return PendingCall(self.world, op, step, list(self.ranks))


class PendingCall:
    """Replies still to come for one command; `wait` enforces the phase deadline."""

    def __init__(self, world: World, op: str, step: int, sources: list[int]) -> None:
        self.world, self.op, self.step, self.sources = world, op, step, sources

    def wait(self, timeout_s: float, watch: Callable[[], None] | None = None) -> dict[int, Any]:
        """{rank: reply payload}; RankFailure for a failed, dead or silent rank. `watch` runs between
        polls (see `_receive`)."""
        replies: dict[int, Reply] = _receive(self.world, self.sources, TAG_REPLY,
                                             time.monotonic() + timeout_s, self.world.gone, watch)
        for rank, reply in sorted(replies.items()):
            assert (reply.op, reply.step) == (self.op, self.step), \
                f"rank {rank} answered {reply.op!r} of step {reply.step}, awaited {self.op!r} of step {self.step}"
            if not reply.ok:
                raise RankFailure(f"{self.world.ranks[rank].describe()} failed in phase "
                                  f"'{self.op}' of step {self.step}:\n{reply.error}")
        missing = [r for r in self.sources if r not in replies]
        dead = self.world.gone(missing)
        if dead:
            who = "; ".join(self.world.ranks[r].describe() for r in dead)
            raise RankFailure(f"{who} exited during phase '{self.op}' of step {self.step} without "
                              f"answering (see its log in RUN_DIR/logs/)")
        if missing:
            who = "; ".join(self.world.ranks[r].describe() for r in missing)
            raise RankFailure(f"no answer within {timeout_s:.0f} s in phase '{self.op}' of step "
                              f"{self.step} from {who} (crashed, exited or hung; see its log in "
                              f"RUN_DIR/logs/)")
        return {rank: reply.payload for rank, reply in replies.items()}



class WorkerChannel:
    """Worker-side: receive the controller's commands and answer them."""

    def __init__(self, world: World) -> None:
        self.world = world

    def next_command(self, timeout_s: float) -> Command:
        got = _receive(self.world, [0], TAG_COMMAND, time.monotonic() + timeout_s)
        if 0 not in got:
            raise RankFailure(f"{self.world.ranks[self.world.rank].describe()}: the controller "
                              f"({self.world.ranks[0].describe()}) sent no command for "
                              f"{timeout_s:.0f} s")
        return got[0]

    def reply(self, cmd: Command, payload: Any = None, timeout_s: float = 300.0) -> None:
        self._send(Reply(self.world.rank, cmd.op, cmd.step, True, payload), timeout_s)

    def reply_error(self, cmd: Command, exc: BaseException, timeout_s: float = 30.0, brief: bool = False) -> None:
        """The failure of `cmd`, as its traceback, or `brief`: its one line (an error whose message
        names what is wrong and where, e.g. a damaged checkpoint's file and step)."""
        text = f"{type(exc).__name__}: {exc}" if brief else "".join(traceback.format_exception(exc)).rstrip()
        self._send(Reply(self.world.rank, cmd.op, cmd.step, False, error=text), timeout_s)

    def _send(self, reply: Reply, timeout_s: float) -> None:
        if _send_all(self.world, {0: reply}, TAG_REPLY, time.monotonic() + timeout_s):
            raise RankFailure(f"{self.world.ranks[self.world.rank].describe()}: the controller did not "
                              f"take the reply to '{reply.op}' of step {reply.step} within {timeout_s:.0f} s")
