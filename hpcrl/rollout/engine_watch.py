"""Engine deaths named first: rollout ranks record their engine process, the controller reads it.

When an engine process dies mid-run (OOM killer, `kill -9`, a crash in SGLang's scheduler), the
first error the controller sees is usually a consequence: a trainer rank's broadcast failing with
gloo's "Connection closed by peer", or a /generate request cut off. The rollout rank that launched
the engine knows better, at once: `EngineRecord` is written by it to RUN_DIR/logs/engine<i>.json
(engine<i>-node<n>.json for the node n > 0 of an engine over several, rollout.nodes_per_engine)
when the engine starts ({engine, node, rank, host, rank_pid, pid, url, log}) and, by a watcher thread that
waits on the process, again with {"exit": {"code" | "signal"}} the moment it dies unasked.

`dead_engines_first(run_dir, message)` is the controller's side: before it reports a failure it
looks for such records (waiting briefly for engines it cannot reach to get one) and puts a line per
dead engine in front of the message, which then follows as the consequence.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["EngineDied", "EngineRecord", "dead_engines_first", "engine_log_name", "engine_name",
           "first_death", "record_path"]


class EngineDied(RuntimeError):
    """A rollout rank's heartbeat: its engine (node) died unasked; the message is `describe`'s."""


def _stem(engine: int, node: int) -> str:
    """engine<i>, and for the node n > 0 of an engine over several nodes engine<i>-node<n>."""
    return f"engine{engine}" + (f"-node{node}" if node else "")


def engine_name(engine: int, node: int = 0) -> str:
    """'engine 3', or 'engine 3 node 1' for a follower node (rollout.nodes_per_engine)."""
    return f"engine {engine}" + (f" node {node}" if node else "")


def engine_log_name(engine: int, node: int = 0) -> str:
    return _stem(engine, node) + ".log"


def record_path(run_dir: str | Path, engine: int, node: int = 0) -> Path:
    return Path(run_dir) / "logs" / (_stem(engine, node) + ".json")


class EngineRecord:
    """The rollout rank's record of its engine `engine` (process `proc`, serving at `url`).

    `stop()` before stopping the engine on purpose: then its exit is not recorded as a death.
    """

    def __init__(self, run_dir: str | Path, engine: int, rank: int, host: str, proc: subprocess.Popen,
                 url: str, node: int = 0) -> None:
        self.path = record_path(run_dir, engine, node)
        self.proc = proc
        self.stopping = False
        self.data = {"engine": engine, "node": node, "rank": rank, "host": host, "rank_pid": os.getpid(),
                     "pid": proc.pid, "url": url, "log": f"RUN_DIR/logs/{engine_log_name(engine, node)}"}
        self._write()
        threading.Thread(target=self._watch, name=f"{_stem(engine, node)}-watch", daemon=True).start()

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)  # atomic: readers see the old record or the new one

    def _watch(self) -> None:
        code = self.proc.wait()
        # a follower node exits 0 when its node 0 stops it, which the shutdown of node 0's rank may
        # do before this rank's own shutdown; a node 0 that stops unasked has a record of its own
        if self.stopping or (code == 0 and self.data["node"] > 0):
            return
        self.data["exit"] = {"signal": signal.Signals(-code).name} if code < 0 else {"code": code}
        self.data["exit"]["at"] = time.strftime("%H:%M:%S")
        self._write()

    def stop(self) -> None:
        self.stopping = True

    def death(self) -> str | None:
        """The death sentence (`describe`) if the engine died unasked, else None."""
        return describe(self.data) if "exit" in self.data else None


def describe(record: dict) -> str:
    """'engine 0 (rollout rank 2, host h) died at 12:00:01: killed by signal SIGKILL (pid 123); ...'
    ('engine 0 node 1 (...' for a follower node of an engine over several)."""
    ex = record["exit"]
    how = f"killed by signal {ex['signal']}" if "signal" in ex else f"exited with code {ex['code']}"
    who = engine_name(record["engine"], record.get("node", 0))
    return (f"{who} (rollout rank {record['rank']}, host {record['host']}) died at "
            f"{ex.get('at', '?')}: {how} (pid {record['pid']}, {record['url']}); see {record['log']}")


def _reachable(url: str, timeout_s: float = 1.0) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _rank_gone(record: dict) -> bool:
    """Whether the engine's rollout rank is known to be dead (checked on its own host only): then
    no record of the engine's death will come."""
    if record.get("host") not in (socket.gethostname(), os.environ.get("SLURMD_NODENAME")):
        return False
    try:
        os.kill(record["rank_pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _records(run_dir: Path) -> list[dict]:
    """This attempt's records: files older than this process (an earlier attempt of a requeued or
    resumed run, whose engines are long gone) are left out."""
    import psutil

    started = psutil.Process().create_time() - 1.0
    out = []
    for p in sorted((run_dir / "logs").glob("engine*.json")):
        try:
            if p.stat().st_mtime >= started:
                out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=_key)


def _key(record: dict) -> tuple[int, int]:
    return record.get("engine", 0), record.get("node", 0)


def first_death(run_dir: str | Path) -> str | None:
    """The death sentence (`describe`) of this attempt's first engine (node) that died unasked, if
    any: the controller's look while it waits on the engines (an SGLang engine whose follower node
    died hangs rather than fails)."""
    records = _records(Path(run_dir)) if (Path(run_dir) / "logs").is_dir() else []
    return next((describe(r) for r in records if "exit" in r), None)


def dead_engines_first(run_dir: str | Path, message: str, wait_s: float = 5.0) -> str:
    """`message` with a line per engine that died unasked in front of it (unchanged if none did).

    Engines without a death record that do not accept a connection get up to `wait_s` for their
    rollout rank to write one (it is usually there before any other rank notices). An engine whose
    rollout rank died with it has no record (and, on this host, is not waited for): the rank is named,
    unless the message names it already.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "logs").is_dir():
        return message
    records = _records(run_dir)
    silent = [_key(r) for r in records
              if "exit" not in r and not _reachable(r["url"]) and not _rank_gone(r)]
    end = time.monotonic() + wait_s
    while silent and time.monotonic() < end:
        time.sleep(0.1)
        records = _records(run_dir)
        silent = [e for e in silent if not any(_key(r) == e and "exit" in r for r in records)]
    deaths = [describe(r) for r in records if "exit" in r]
    dead = [d for d in deaths if d not in message]
    # a rollout rank killed with its engine leaves no record; the message may name only what the
    # loss caused (the weight push's refused connection)
    dead += [f"rollout rank {r['rank']} (host {r['host']}, pid {r['rank_pid']}) is gone, and its "
             f"{engine_name(r['engine'], r.get('node', 0))} ({r['url']}) with it" for r in records
             if "exit" not in r and _rank_gone(r) and f"rank {r['rank']} " not in message]
    head, _, rest = message.partition(": ")
    if not dead:  # none, or the message is a death already: a rollout rank's heartbeat reported it
        named = [d for d in deaths if d in rest]  # the death alone (it names the rank), not who reported it
        return f"{head}: " + "; ".join(named) if named and not rest.startswith(named[0]) else message
    return (f"{head}: " if rest else "") + "; ".join(dead) + f"\n  then: {_gist(rest or head)}"


def _gist(message: str) -> str:
    """One line of a failure message: its first line, and when that introduces a traceback, the
    traceback's last line (the exception) instead of the traceback."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or ["(no message)"]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[-1]}"
    return lines[0]
