"""HTTP client for SGLang 0.5.x servers and hpcrl's reference server (same routes, same JSON).

`EngineClient` keeps one keep-alive `http.client` connection per calling thread (so one client may be
used from several threads), sends each request in a single write with TCP_NODELAY (no Nagle/delayed
ACK stalls), and has one method per route with SGLang's argument names. With engine keys (the
job's, hpcrl/rollout/engine_auth.py; by default those set for the process) every request carries
SGLang's `Authorization: Bearer` header of its route's level. A failed call raises
`EngineError` naming the URL, the route, the HTTP status and the server's message. `start` writes a
request and returns a `PendingResponse` to read later on the same thread (the shard sync keeps its
request in flight while the trainer rank sends, without a thread hand-off). Servers older
than SGLang 0.5.23 have no weight-update session routes; `begin_weight_update`/`end_weight_update`
then return None after a 404 instead of failing.

`launch_reference_server` starts `python -m hpcrl.rollout.reference_server` and waits for it.

Routed experts (SGLang 0.5.23, both servers): an engine started with `ROUTED_EXPERTS_FLAG` answers a
/generate body holding `routed_experts_fields()` with meta_info["routed_experts"], which
`decode_routed_experts` turns into an int32 array [P + R - 1 - start_len, num_hidden_layers, top_k].

Scoring (SGLang 0.5.23's input-token log-probs, both servers; asynchronous RL's sync check, issue 32):
`scoring_body(pairs)` is the /generate body asking for the log-probs of each (prompt_ids, response_ids)
pair's response tokens without generating (input_ids prompt + response, max_new_tokens 0,
return_logprob, logprob_start_len len(prompt) - 1: SGLang's first input entry carries no log-prob, so
the start is one before the response); `parse_scores(answers, pairs)` reads the answer back into one
list of floats per pair, log p(response[t] | prompt, response[:t]), checking every entry against the
tokens sent (ValueError on a malformed answer); `EngineClient.score(pairs)` does both. The values are
at temperature 1 whatever the sampling temperature (SGLang does not scale input log-probs): compare
them with the trainer's log_softmax(logits) at T = 1 (dev/notes_input_logprobs.md).
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import orjson

from hpcrl.rollout.engine_auth import ADMIN_ROUTES, EngineKeys, process_keys
from launch.procs import die_with_parent

__all__ = ["ROUTED_EXPERTS_FLAG", "EngineClient", "EngineError", "PendingResponse", "decode_routed_experts",
           "launch_reference_server", "open_private_log", "parse_scores", "routed_experts_fields",
           "scoring_body"]

ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""The server flag (SGLang's and the reference server's) without which no answer carries routes."""

SECRET_SERVER_FIELDS = frozenset({"api_key", "admin_api_key", "launch_command"})
"""/server_info fields that carry or may carry the engine keys (SGLang 0.5.23 server_args: api_key,
admin_api_key; launch_command holds any key given on the command line)."""
REDACTED = "<redacted>"

_JSON_HEADERS = {"Content-Type": "application/json"}
_PROCESS = object()  # EngineClient(keys=...) default: the process's keys (engine_auth.set_process_keys)


class EngineError(RuntimeError):
    """A generation-engine request failed: `url`, `route`, `status` (None if no HTTP answer), `message`."""

    def __init__(self, url: str, route: str, status: int | None, message: str) -> None:
        self.url, self.route, self.status, self.message = url, route, status, message
        where = f"HTTP {status}" if status is not None else "no HTTP answer"
        super().__init__(f"{url}{route} failed ({where}): {message}")


class EngineClient:
    """One generation engine at `base_url` (http://host:port), SGLang's HTTP API."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, keys: EngineKeys | None | object = _PROCESS
                 ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"base_url {base_url!r} must look like http://host:port")
        self.base_url = f"http://{parts.hostname}:{parts.port}"
        self.host, self.port = parts.hostname, parts.port
        self.timeout_s = timeout_s
        self._local = threading.local()
        self.has_session_routes: bool | None = None  # learnt on the first begin_weight_update
        self.keys = process_keys() if keys is _PROCESS else keys
        assert self.keys is None or isinstance(self.keys, EngineKeys), keys
        self._headers: dict[tuple[str, bool], dict[str, str]] = {}  # (route, has body) -> headers

    def headers(self, route: str, has_body: bool) -> dict[str, str]:
        """The request headers for `route`: JSON content type with a body, the route's key if any."""
        out = self._headers.get((route, has_body))
        if out is None:
            out = dict(_JSON_HEADERS) if has_body else {}
            if self.keys is not None:
                out["Authorization"] = self.keys.header(route)
            self._headers[(route, has_body)] = out
        return out

    # -- transport -------------------------------------------------------------------------------

    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh or conn.sock is None:  # sock None: the server closed it (HTTP/1.0)
            if conn is not None:
                conn.close()
            conn = self._local.conn = self._new_connection()
        return conn

    def _new_connection(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.connect()
        except OSError:
            conn.close()
            raise
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def start(self, method: str, route: str, payload=None, timeout_s: float | None = None) -> PendingResponse:
        """Write one request and return at once; `result()` of the answer reads it (on this thread).

        For a call that must be in flight while this thread does other work (the shard sync: the
        engine receives while the trainer sends), without a thread hand-off. Not retried: a kept-alive
        connection the server has closed is detected and replaced before writing. `payload` is a
        JSON-able object, or bytes of JSON encoded ahead of time.
        """
        body = payload if isinstance(payload, bytes) or payload is None else json.dumps(payload).encode()
        # While this thread's kept-alive connection awaits an earlier answer, a request of its own
        # (several in flight at once: asynchronous RL's batches sampled ahead) gets a new connection.
        own = getattr(self._local, "awaiting", False)
        try:
            conn = self._new_connection() if own else self._connection(fresh=self._dropped())
            conn.sock.settimeout(self.timeout_s if timeout_s is None else timeout_s)
            conn.request(method, route, body=body, headers=self.headers(route, body is not None))
        except (OSError, http.client.HTTPException) as exc:
            conn.close() if own else self._drop()
            raise EngineError(self.base_url, route, None, f"{type(exc).__name__}: {exc}") from exc
        if not own:
            self._local.awaiting = True
        return PendingResponse(self, conn, route, own)

    def _dropped(self) -> bool:
        """Whether this thread's kept-alive connection was closed by the server (it is readable:
        a server sends nothing unasked, so that can only be the end of the stream)."""
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.sock is None:
            return False
        return bool(select.select([conn.sock], [], [], 0)[0])

    def _answer(self, route: str, status: int, data: bytes, content_type: str):
        decoded = _decode(data, content_type)
        if status in (401, 403):
            raise EngineError(self.base_url, route, status,
                              f"{_message(decoded)}: the engine wants the job's "
                              f"{'admin ' if route in ADMIN_ROUTES else ''}key (RUN_DIR/engine_keys.yaml, "
                              f"hpcrl/rollout/engine_auth.py); this client sends "
                              f"{'a key' if self.keys is not None else 'none'}")
        if status >= 400:
            raise EngineError(self.base_url, route, status, _message(decoded))
        if isinstance(decoded, dict) and decoded.get("success") is False:
            raise EngineError(self.base_url, route, status, _message(decoded))
        return decoded

    def request(self, method: str, route: str, payload=None, timeout_s: float | None = None):
        """One call; returns the decoded JSON (or text, or None for an empty body); EngineError on failure."""
        body = None if payload is None else json.dumps(payload).encode()
        headers = self.headers(route, body is not None)
        if getattr(self._local, "awaiting", False):  # the kept-alive connection awaits a `start`ed answer
            return self.start(method, route, body, timeout_s).result()
        for attempt in (0, 1):
            reused = getattr(self._local, "conn", None) is not None
            try:
                conn = self._connection(fresh=attempt == 1)
                conn.sock.settimeout(self.timeout_s if timeout_s is None else timeout_s)
                conn.request(method, route, body=body, headers=headers)
                resp = conn.getresponse()
                status, data, ctype = resp.status, resp.read(), resp.getheader("Content-Type", "")
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._drop()
                # A kept-alive connection the server closed while idle: retry once on a new one.
                if attempt == 0 and reused:
                    continue
                raise EngineError(self.base_url, route, None, f"{type(exc).__name__}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                raise EngineError(self.base_url, route, None, f"{type(exc).__name__}: {exc}") from exc
        return self._answer(route, status, data, ctype)

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def close(self) -> None:
        """Close this thread's connection (others close when their threads end)."""
        self._drop()

    # -- generation ------------------------------------------------------------------------------

    def generate(self, input_ids=None, sampling_params=None, return_logprob: bool = False, *,
                 text=None, rid=None, return_routed_experts: bool = False, routed_experts_start_len: int = 0,
                 **extra):
        """POST /generate. `input_ids` is one prompt (list of ints) or a batch (list of lists); the
        answer is one dict or a list of dicts {"text", "output_ids", "meta_info"}; with
        `return_logprob`, meta_info["output_token_logprobs"] is [[logprob, token_id, None], ...]; with
        `return_routed_experts` (on an engine started with ROUTED_EXPERTS_FLAG), meta_info["routed_experts"]
        from position `routed_experts_start_len` on (decode_routed_experts reads it)."""
        payload: dict = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if input_ids is not None:
            payload["input_ids"] = input_ids
        if text is not None:
            payload["text"] = text
        if rid is not None:
            payload["rid"] = rid
        if return_routed_experts:
            payload.update(routed_experts_fields(routed_experts_start_len))
        payload.update(extra)
        return self.request("POST", "/generate", payload)

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], vocab_size: int | None = None
              ) -> list[list[float]]:
        """The engine's log-probs of each (prompt_ids, response_ids) pair's response tokens, one
        /generate scoring request for all (`scoring_body`, read by `parse_scores`); temperature 1."""
        return parse_scores(self.request("POST", "/generate", scoring_body(pairs)), pairs, vocab_size)

    def health(self) -> bool:
        """True when GET /health answers 200; False when the server is down, starting or unhealthy."""
        try:
            self.request("GET", "/health", timeout_s=min(self.timeout_s, 30.0))
            return True
        except EngineError:
            return False

    def wait_healthy(self, deadline_s: float) -> None:
        """Poll /health until it answers 200; EngineError after `deadline_s` seconds."""
        end = time.monotonic() + deadline_s
        while not self.health():
            if time.monotonic() > end:
                raise EngineError(self.base_url, "/health", None, f"not healthy within {deadline_s:.0f} s")
            time.sleep(0.1)

    def flush_cache(self) -> None:
        self.request("POST", "/flush_cache")

    def model_info(self) -> dict:
        return self._with_fallback("/model_info", "/get_model_info")

    def server_info(self) -> dict:
        """GET /server_info with the engine's secrets replaced by "<redacted>": SGLang returns every
        resolved server argument, both keys among them, and its launch command; nothing hpcrl logs
        or reports may carry them (docs/sglang.md, "Engine keys")."""
        info = self._with_fallback("/server_info", "/get_server_info")
        return {k: REDACTED if k in SECRET_SERVER_FIELDS and v is not None else v for k, v in info.items()}

    def _with_fallback(self, route: str, old_route: str):
        try:
            return self.request("GET", route)
        except EngineError as exc:
            if exc.status != 404:
                raise
            return self.request("GET", old_route)

    def pause_generation(self, mode: str | None = None) -> dict:
        """Pause generation; SGLang's `mode`: "abort" (the server's default: requests in flight answer
        with finish_reason abort), "retract" or "in_place" (they finish after continue_generation)."""
        return self.request("POST", "/pause_generation", {} if mode is None else {"mode": mode})

    def continue_generation(self) -> dict:
        return self.request("POST", "/continue_generation", {})

    # -- weights ---------------------------------------------------------------------------------

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "gloo") -> dict:
        """Make the engine join the weight-update group (blocks until every rank has joined)."""
        return self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_reshard(self, body: dict) -> dict:
        """hpcrl's shard-to-shard route (hpcrl/rollout/reshard_route.py); blocks until the engine has
        received its plan's bytes from the trainer ranks and loaded them."""
        from hpcrl.rollout.reshard_route import ROUTE

        return self.request("POST", ROUTE, body)

    def start_update_weights_reshard(self, body: dict) -> PendingResponse:
        """`update_weights_reshard` written now and answered by `result()`, so the calling thread can
        take part in the transfer meanwhile."""
        from hpcrl.rollout.reshard_route import ROUTE

        return self.start("POST", ROUTE, body)

    def start_update_weights_from_tensor(self, body: dict) -> PendingResponse:
        """SGLang's `/update_weights_from_tensor` written now and answered by `result()`; with
        hpcrl's loader (sglang_shard_loader.tensor_request_body) the answer comes once every TP
        worker has received its slices, so the calling thread sends meanwhile."""
        return self.start("POST", "/update_weights_from_tensor", body)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self) -> dict | None:
        """Open a weight-update session (SGLang >= 0.5.23); None on older servers without the route."""
        return self._session_call("/begin_weight_update")

    def end_weight_update(self) -> dict | None:
        """Close the weight-update session; None on older servers without the route."""
        return self._session_call("/end_weight_update")

    def _session_call(self, route: str) -> dict | None:
        if self.has_session_routes is False:
            return None
        try:
            out = self.request("POST", route, {})
        except EngineError as exc:
            if exc.status != 404:
                raise
            self.has_session_routes = False
            return None
        self.has_session_routes = True
        return out

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence,
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: str | None = None,
                                        weight_version: str | None = None) -> dict:
        """Announce one bucket; the caller broadcasts it from rank 0 while this call waits for the engine.

        dtypes may be torch dtypes or names ("bfloat16"); shapes any int sequences.
        """
        payload = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                   "shapes": [[int(x) for x in s] for s in shapes], "group_name": group_name,
                   "flush_cache": flush_cache}
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self.request("POST", "/update_weights_from_distributed", payload)

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """The tensor's values as nested lists, first `truncate_size` rows (SGLang's truncation)."""
        return self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        return self.request("POST", "/update_weight_version",
                            {"new_version": new_version, "abort_all_requests": abort_all_requests})

    def release_memory_occupation(self, tags: list[str] | None = None):
        """Release engine memory: tags from "weights", "kv_cache", "cuda_graph"; None = all."""
        return self.request("POST", "/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None):
        return self.request("POST", "/resume_memory_occupation", {"tags": tags})


def routed_experts_fields(start_len: int = 0) -> dict:
    """The /generate body fields asking for routed experts from absolute position `start_len` on
    (SGLang's GenerateReqInput.return_routed_experts and routed_experts_start_len: one value for
    every item of a batched body; 0 <= start_len <= each prompt's length, else the engine answers 400)."""
    return {"return_routed_experts": True, "routed_experts_start_len": int(start_len)}


def decode_routed_experts(meta_info: dict, num_layers: int, top_k: int) -> np.ndarray | None:
    """meta_info["routed_experts"] of a /generate answer as int32 [rows, num_layers, top_k] (read-only):
    row i holds the experts each layer (num_hidden_layers of them, dense layers' rows 0) routed the
    token at position start_len + i to, rows = prompt + output tokens - 1 - start_len; the columns'
    order within a row is the engine's kernel's (compare rows as sets). None when the key is absent:
    not asked, the engine runs without ROUTED_EXPERTS_FLAG (SGLang then says nothing), or the request
    was aborted before it ran. ValueError when the bytes are not whole [num_layers, top_k] int32 rows."""
    encoded = meta_info.get("routed_experts")
    if encoded is None:
        return None
    raw = base64.b64decode(encoded)
    row_bytes = 4 * num_layers * top_k
    if row_bytes <= 0 or len(raw) % row_bytes:
        raise ValueError(f"meta_info['routed_experts'] holds {len(raw)} bytes, not whole rows of "
                         f"num_layers={num_layers} x top_k={top_k} int32 ({row_bytes} bytes): the engine "
                         "serves another model, or num_layers/top_k are not its num_hidden_layers and "
                         "num_experts_per_tok")
    return np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)


def scoring_body(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict:
    """The /generate body scoring each (prompt_ids, response_ids) pair without generating: input_ids
    prompt + response, sampling_params {"max_new_tokens": 0}, return_logprob, and logprob_start_len
    len(prompt) - 1 per item (SGLang 0.5.23 answers input_token_logprobs from that position on, the
    first entry without a log-prob: the prompt's last token, then one entry per response token).
    ValueError for no pairs or an empty prompt (a response's first token needs a position before it)."""
    if not pairs:
        raise ValueError("scoring_body needs at least one (prompt_ids, response_ids) pair")
    ids, starts = [], []
    for i, (prompt, response) in enumerate(pairs):
        if len(prompt) == 0:
            raise ValueError(f"pairs[{i}] has an empty prompt: the log-prob of a response's first token is "
                             "read at the prompt's last position; give at least one prompt token")
        ids.append([int(t) for t in prompt] + [int(t) for t in response])
        starts.append(len(prompt) - 1)
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": starts}


def parse_scores(answers, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                 vocab_size: int | None = None) -> list[list[float]]:
    """The response tokens' log-probs, one list of floats per pair, from the answer to
    `scoring_body(pairs)`. Each answer's meta_info["input_token_logprobs"] must be SGLang 0.5.23's:
    1 + len(response) [logprob, token_id, text] entries for the prompt's last token and the response,
    the first logprob None, the others numbers, the ids those sent (SGLang reports the id
    vocab_size - 1 as 0: with `vocab_size` only that id may read 0, without it any). ValueError naming
    the pair, the entry and what is wrong otherwise (an engine that ignored logprob_start_len, a
    shifted or truncated answer, a non-finite log-prob, which JSON carries as null)."""
    if not isinstance(answers, list) or len(answers) != len(pairs):
        got = f"a list of {len(answers)}" if isinstance(answers, list) else type(answers).__name__
        raise ValueError(f"a scoring answer must be a list of one answer per pair ({len(pairs)}); got {got}")
    out = []
    for i, (answer, (prompt, response)) in enumerate(zip(answers, pairs)):
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"answer {i} has no meta_info['input_token_logprobs'] list: the engine did not "
                             "return input log-probs (was the body scoring_body's, with return_logprob?)")
        sent = [int(prompt[-1]), *(int(t) for t in response)]
        if len(entries) != len(sent):
            raise ValueError(f"answer {i}: {len(entries)} input_token_logprobs entries, expected {len(sent)} "
                             f"(the prompt's last token and {len(response)} response tokens): the engine "
                             "read logprob_start_len otherwise")
        values = []
        for j, (entry, token) in enumerate(zip(entries, sent)):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(f"answer {i}, input_token_logprobs[{j}]={entry!r} is not a [logprob, "
                                 "token_id, text] triple")
            logprob, got = entry[0], entry[1]
            if got != token and not (got == 0 and (vocab_size is None or token == vocab_size - 1)):
                raise ValueError(f"answer {i}, input_token_logprobs[{j}] is for token {got!r} but the body "
                                 f"sent {token} there: the answer is shifted or for other tokens")
            if j == 0:
                if logprob is not None:
                    raise ValueError(f"answer {i}, input_token_logprobs[0] has logprob {logprob!r}; SGLang "
                                     "0.5.23 leaves the first entry None: the engine follows another rule")
                continue
            if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) \
                    or not math.isfinite(logprob):
                raise ValueError(f"answer {i}, input_token_logprobs[{j}] has logprob {logprob!r}, not a "
                                 "finite number (a NaN or infinite log-prob arrives as null)")
            values.append(float(logprob))
        out.append(values)
    return out


class PendingResponse:
    """The answer to a request `EngineClient.start` has written."""

    def __init__(self, client: EngineClient, conn: http.client.HTTPConnection, route: str,
                 own: bool = False) -> None:
        self.client, self.conn, self.route = client, conn, route
        self.own = own  # a connection of this request only, closed once it is answered

    def ready(self) -> bool:
        """Whether the answer (or the end of the connection) has arrived: `result()` will not wait."""
        sock = self.conn.sock
        return sock is None or bool(select.select([sock], [], [], 0)[0])

    def expire(self) -> None:
        """The caller's deadline passed: `result()` reports this request as timed out at once."""
        if self.conn.sock is not None:
            self.conn.sock.settimeout(1e-3)

    def result(self):
        """Read and decode the answer (the connection's timeout applies); EngineError on failure."""
        try:
            resp = self.conn.getresponse()
            status, data, ctype = resp.status, resp.read(), resp.getheader("Content-Type", "")
        except (OSError, http.client.HTTPException) as exc:
            self.conn.close() if self.own else self.client._drop()
            raise EngineError(self.client.base_url, self.route, None, f"{type(exc).__name__}: {exc}") from exc
        finally:
            if self.own:
                self.conn.close()
            else:
                self.client._local.awaiting = False
        return self.client._answer(self.route, status, data, ctype)


def wait_answers(answers: list[PendingResponse], timeout_s: float) -> list[PendingResponse]:
    """Wait at most `timeout_s` for any of `answers` to arrive; return those still unanswered."""
    socks = [a.conn.sock for a in answers if a.conn.sock is not None]
    if len(socks) == len(answers):
        select.select(socks, [], [], timeout_s)
    return [a for a in answers if not a.ready()]


def _decode(data: bytes, content_type: str):
    if not data:
        return None
    if "json" in content_type:
        for loads in (orjson.loads, json.loads):  # json's also reads NaN / Infinity, which orjson refuses
            try:
                return loads(data)
            except ValueError:
                pass
    return data.decode(errors="replace")


def _message(decoded) -> str:
    """The server's error text from SGLang's shapes: {"message"}, {"error": {"message"}}, or raw text."""
    if isinstance(decoded, dict):
        if isinstance(decoded.get("error"), dict) and "message" in decoded["error"]:
            return str(decoded["error"]["message"])
        if isinstance(decoded.get("error"), str):
            return decoded["error"]
        if "message" in decoded:
            return str(decoded["message"])
        if "detail" in decoded:
            return str(decoded["detail"])
    return str(decoded).strip() or "(empty body)"


def launch_reference_server(model_config_path: str, device: str = "cpu", seed: int = 0,
                            log_path: str | None = None, *, host: str = "127.0.0.1", threads: int | None = 1,
                            dtype: str = "float32", startup_timeout_s: float = 180.0,
                            extra_args: Sequence[str] = (), model_path: str | None = None,
                            config_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start the reference server as a subprocess; return it and its URL once /health answers 200.

    With `model_path` (a HF model directory) the engine loads its weights; otherwise it draws random
    weights from `seed`. `config_path`: a YAML file of server options (SGLang's --config), such as the
    job's engine keys (engine_auth.job_keys), which then stay off the command line. The log file is
    created user-only (0600): servers print their settings.

    The server binds port 0 and reports the port the OS gave it through a file, so no other process
    can take the port between choosing and binding it, and the health check cannot reach another
    server. Output goes to `log_path` (or is discarded). If the process dies or is not healthy within
    `startup_timeout_s`, it is killed and RuntimeError carries the end of its log. The caller stops
    it with SIGTERM (the server exits cleanly) and waits for it.
    """
    fd, port_file = tempfile.mkstemp(prefix="hpcrl-engine-port-")
    os.close(fd)
    os.unlink(port_file)  # the server creates it once it listens
    cmd = [sys.executable, "-m", "hpcrl.rollout.reference_server", "--model-config", str(model_config_path),
           "--host", host, "--port", "0", "--port-file", port_file, "--device", device, "--seed", str(seed),
           "--dtype", dtype, *([] if threads is None else ["--threads", str(threads)]),
           *([] if model_path is None else ["--model-path", str(model_path)]),
           *([] if config_path is None else ["--config", str(config_path)]), *extra_args]
    log = open_private_log(log_path) if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=die_with_parent)
    finally:
        if log_path:
            log.close()
    end = time.monotonic() + startup_timeout_s
    client = None
    try:
        while True:
            if proc.poll() is not None:
                why = f"exited with code {proc.returncode}"
                break
            if client is None and os.path.exists(port_file):
                client = EngineClient(f"http://{host}:{Path(port_file).read_text()}", timeout_s=10.0)
            if client is not None and client.health():
                return proc, client.base_url
            if time.monotonic() > end:
                why = f"was not healthy within {startup_timeout_s:.0f} s"
                break
            time.sleep(0.1)
    finally:
        if client is not None:
            client.close()
        Path(port_file).unlink(missing_ok=True)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    tail = _tail(log_path, _secrets(config_path)) if log_path else "(no log_path given)"
    raise RuntimeError(f"reference server on {host} {why}; command: {' '.join(cmd)}\n"
                       f"log tail ({log_path}):\n{tail}")


def open_private_log(path: str | Path):
    """Open `path` for appending in binary mode, created user-only (0600): an engine's log holds its
    settings, SGLang's its API keys among them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)  # also a log left by an earlier attempt of the run
    return os.fdopen(fd, "ab")


def _secrets(config_path: str | None) -> list[str]:
    """The engine keys of a server options file (the job's engine_keys.yaml), for redaction."""
    if config_path is None:
        return []
    try:
        keys = EngineKeys.read(config_path)
    except Exception:  # noqa: BLE001 - unreadable or not a keys file: no keys to redact, the report goes on
        return []
    return [keys.api_key, keys.admin_api_key]


def _tail(path: str, secrets: Sequence[str] = (), num_bytes: int = 4000) -> str:
    """The end of an engine's log, every secret in `secrets` replaced by "<redacted>": the log stays
    in the run dir (0600), the tail goes into an error message that does not."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    text = data.decode(errors="replace")
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text[-num_bytes:]
