"""An engine over several nodes, as SGLang 0.5.23 starts one (`--nnodes N --node-rank R
--dist-init-addr HOST:PORT`), for the reference engine.

SGLang: every node's process joins torch.distributed's TCP rendezvous at --dist-init-addr (node 0
hosts its store) before any node is ready; node 0 serves the HTTP API; nodes 1.. serve only
/ping, /health and /health_generate (each answering 200, `launch_dummy_health_check_server` in
srt/utils/common.py, once their schedulers are ready), ignore SIGTERM ("waiting for the rank-0
ShutdownReq broadcast") and exit when node 0 stops them. A follower whose node 0 dies fails with its
broken communicator.

The reference engine keeps that protocol and computes on node 0 alone (a difference by design: its
followers hold no weights, so its tensor parallel size of 1 need not divide over the nodes):
`Rendezvous` (node 0) hosts the store and returns once every follower has joined, and at the end
says stop and waits for each follower to have read it; `follow` (nodes 1..) joins it, serves the
health routes, ignores SIGTERM, and exits 0 when node 0 says stop, 1 when node 0 is gone.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["FOLLOWER_ROUTES", "Rendezvous", "follow", "parse_dist_init_addr"]

FOLLOWER_ROUTES = ("/ping", "/health", "/health_generate")
"""What a follower node serves (GET, 200, empty body): SGLang 0.5.23's dummy health server."""
STOP_KEY, STOPPED_KEY = "hpcrl/stop", "hpcrl/stopped"
POLL_S = 0.2


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); SystemExit naming the flag otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SystemExit(f"--dist-init-addr {addr!r}: give HOST:PORT")
    return host.strip("[]"), int(port)


class Rendezvous:
    """Node 0's side: the store every node joins (torch's TCPStore on --dist-init-addr's port)."""

    def __init__(self, addr: str, nnodes: int, timeout_s: float) -> None:
        from torch.distributed import TCPStore

        host, port = parse_dist_init_addr(addr)
        print(f"waiting for {nnodes - 1} follower node(s) at {addr}", flush=True)
        # wait_for_workers: the constructor returns once all `nnodes` members have connected
        self.store = TCPStore(host, port, nnodes, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=True)
        self.followers = nnodes - 1
        print(f"all {nnodes} nodes joined", flush=True)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell the followers to exit (SGLang's ShutdownReq broadcast) and wait until each has read it
        (at most `timeout_s`): once this process, and the store with it, is gone, a follower that
        had not read it would take node 0 for dead."""
        self.store.set(STOP_KEY, "1")
        end = time.monotonic() + timeout_s
        while self.store.add(STOPPED_KEY, 0) < self.followers and time.monotonic() < end:
            time.sleep(POLL_S / 4)


class _Health(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (base-class signature)
        pass

    def do_GET(self) -> None:  # noqa: N802
        status = 200 if self.path.split("?", 1)[0] in FOLLOWER_ROUTES else 404
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


def follow(addr: str, nnodes: int, node_rank: int, host: str, port: int, port_file: str | None,
           timeout_s: float) -> int:
    """Nodes 1..: join node 0's store, serve the health routes on host:port, wait to be stopped.
    The exit code: 0 when node 0 stopped this node, 1 when it went away."""
    from torch.distributed import TCPStore

    store_host, store_port = parse_dist_init_addr(addr)
    print(f"node {node_rank} of {nnodes}: joining {addr}", flush=True)
    store = TCPStore(store_host, store_port, nnodes, is_master=False, timeout=timedelta(seconds=timeout_s))
    httpd = ThreadingHTTPServer((host, port), _Health)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(str(httpd.server_address[1]))
        tmp.replace(port_file)

    def ignore(signum, frame) -> None:
        print(f"SIGTERM received on node_rank {node_rank}; waiting for node 0 to stop this node",
              flush=True)

    signal.signal(signal.SIGTERM, ignore)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # preemption notices are the controller's
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    print(f"node {node_rank} ready on http://{host}:{httpd.server_address[1]} (health routes only)",
          flush=True)
    while True:
        try:
            if store.check([STOP_KEY]):
                store.add(STOPPED_KEY, 1)  # node 0 waits for every follower's word before it goes
                print(f"node {node_rank}: stopped by node 0", flush=True)
                return 0
        except Exception as exc:  # noqa: BLE001 - any store failure means node 0 is gone
            print(f"node {node_rank}: lost node 0 at {addr}: {exc}", file=sys.stderr, flush=True)
            return 1
        time.sleep(POLL_S)
