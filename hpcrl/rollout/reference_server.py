"""hpcrl's reference generation server: SGLang 0.5.x's HTTP routes, JSON and weight-sync semantics on a
`ReferenceModel` (transformers, KV cache), for CPU machines where SGLang cannot run and for debugging.

    python -m hpcrl.rollout.reference_server --model-config config.json --host 127.0.0.1 --port 30000 \
        [--model-path DIR] [--device cpu] [--dtype float32] [--seed 0] [--tokenizer char|none] [--threads 1]
        [--config engine_keys.yaml] [--api-key KEY] [--admin-api-key KEY] [--enable-return-routed-experts]
        [--nnodes N --node-rank R --dist-init-addr HOST:PORT]

With --nnodes > 1 the engine spans nodes as SGLang's does: node 0 serves every route once each other
node has joined its rendezvous; nodes 1.. serve the health routes only, and stop with node 0
(hpcrl/rollout/reference_nodes.py).

With --model-path (a HF model directory, as SGLang's --model-path) the engine starts from its weights;
without it from random weights drawn from --seed (SGLang's --load-format dummy).

Routes (bodies and answers as SGLang's): POST /generate; GET /health, /health_generate, /model_info,
/get_model_info, /server_info, /get_server_info, /get_weight_version; GET|POST /flush_cache,
/get_weights_by_name, /release_memory_occupation, /resume_memory_occupation, /start_profile,
/stop_profile (hpcrl/rollout/engine_profile.py); POST
/init_weights_update_group, /destroy_weights_update_group, /begin_weight_update,
/update_weights_from_distributed, /end_weight_update, /update_weight_version, /pause_generation,
/continue_generation; and hpcrl's extension POST /hpcrl/update_weights_reshard (shard-to-shard sync,
hpcrl/rollout/reshard_route.py). Weight routes answer {"success", "message"} with HTTP 200 or 400; other
failures answer {"error": {"message"}} with 400 (bad request) or 500 (engine fault).

Keys as SGLang's (hpcrl/rollout/engine_auth.py): with --api-key / --admin-api-key, given on the
command line or, to keep them off it, in a YAML file read by --config (SGLang's: its keys are the
long options without dashes, placed before the command line's), requests without the right Bearer
token are refused with 401 before anything runs; /health stays open.

Concurrency: /generate requests are queued and run one at a time, oldest first, each as a batch of
its own rows (a lone request runs on its own handler thread, with no hand-off). SGLang's scheduler
batches concurrent requests together; the reference server does not, so that an answer is a
function of its request alone, bit for bit. Tokens would be the same either way (each request
samples from its own seeded generator, engine.py), but log-probs move by rounding (~5e-7) with the
batch's other rows and their padding: sampled together or apart by timing, an asynchronous run's
behaviour log-probs, and with them the policy, would differ between a run and its resume.
Generation, weight loads and memory release/resume are serialised by one lock.

Refusals as SGLang 0.5.23's: a weight update outside a begin/end_weight_update session, for an
unknown group, or while the weights are released is refused BEFORE its broadcast is received (the
sender must read the HTTP answer, not wait for the broadcast: hpcrl.rollout.weight_sender); a second
/begin_weight_update is HTTP 400; /pause_generation defaults to mode "abort" (queued and running
requests answer 200 with finish_reason abort). A load that fails after the receive (an unknown
tensor name) changes no weight; SGLang skips unknown names silently, the reference engine refuses
them. Differences by design: streaming and top log-probs (top_logprobs_num, token_ids_logprob) are
refused with 400; on CPU, releasing memory only changes state. JSON answers are written by orjson with
non-string keys allowed, as SGLang's `/generate` writes them (so a non-finite float is `null`).

Routed experts as SGLang 0.5.23's (issue 33): with --enable-return-routed-experts, a /generate request
with "return_routed_experts": true (and "routed_experts_start_len" S, default 0; both scalars, for every
item of a batch) gets meta_info["routed_experts"]: base64 of little-endian int32 in C order,
[P + R - 1 - S, num_hidden_layers, top_k], the routes of the tokens at positions S .. P + R - 2
(engine.py, "Routed experts"). Without the flag the key is absent, silently, as SGLang's. S < 0 or
S > P answers HTTP 400 with SGLang's abort message, flag or not. An aborted request carries no routes
(SGLang answers one aborted while running with its partial output and that output's routes; the
reference engine answers it without output tokens, see /pause_generation above).

Input-token log-probs as SGLang 0.5.23's (issue 32's scoring requests; dev/notes_input_logprobs.md):
every answer to a request with return_logprob carries meta_info["input_token_logprobs"] and
"output_token_logprobs_length". With "logprob_start_len" L (one int, or one per item of a batch;
default -1) in [0, P] the former holds P - L triples [logprob, token_id, text] for the input tokens
L .. P - 1, the first logprob None, the others log_softmax(logits)[token] of the position before, at
temperature 1 whatever the request's (engine_score.py); L = P or -1 gives []. As SGLang's detokenizer
reports it, the id vocab_size - 1 appears as 0 (its logprob is that token's). L > P answers HTTP 400
with SGLang's abort message; L < -1 also 400 (SGLang does not check it, and its scheduler then fails an
assertion); without return_logprob L is ignored, as SGLang resets it. The input log-probs come from a
forward of their own over the batch's scoring rows, after its generation: requests with
max_new_tokens 0 (and no routes asked) are left out of the generation batch, so scoring requests
change neither what generation requests return nor the seeds unseeded ones draw.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import orjson
import torch
import torch.distributed as dist

from hpcrl import faults
from hpcrl.rollout.engine import ReferenceModel
from hpcrl.rollout.engine_auth import decide_request_auth, route_level
from hpcrl.rollout.engine_profile import EngineProfile, ProfileRefused
from hpcrl.rollout.engine_score import input_token_logprobs
from hpcrl.rollout.reference_weights import WeightRoutes, _Fail
from hpcrl.rollout.reshard_route import ROUTE

_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "rid", "stream",
                  "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
                  "log_metrics", "return_routed_experts", "routed_experts_start_len"}
_SGLANG_GENERATE_FIELDS = frozenset("""
    rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes mm_content_hashes
    use_audio_in_video video_config sampling_params watermark return_logprob logprob_start_len top_logprobs_num
    token_ids_logprob return_sampling_mask sampling_logprobs_mode return_text_in_logprobs
    return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs stream log_metrics return_hidden_states
    return_routed_experts routed_experts_start_len return_indexer_topk modalities session_params lora_path
    lora_id custom_logit_processor positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room
    bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank routing_key
    conversation_id http_worker_ipc background require_reasoning max_thinking_tokens priority extra_key no_logs
    custom_labels return_bytes return_entropy return_prompt_token_ids external_trace_header received_time
    need_wait_for_mm_inputs num_items_assigned encoder_urls max_dynamic_patch min_dynamic_patch
    image_max_dynamic_patch video_max_dynamic_patch images_config mm_processor_kwargs
    multi_item_delimiter_indices token_indices_to_pool cache_salt kv_hints""".split())
"""/generate's fields in SGLang 0.5.23 (GenerateReqInput, managers/io_struct.py): the reference engine
refuses those it does not serve when set (a half-served request would answer something else), and
ignores any other key, as SGLang's body parsing and contract check (api/v1 GenerateRequest) do."""
_UNSERVED_GENERATE_FIELDS = _SGLANG_GENERATE_FIELDS - _GENERATE_KEYS


class _Job:
    __slots__ = ("prompts", "params", "routes", "starts", "done", "outputs", "error", "epoch", "aborted")

    def __init__(self, prompts, params, routes: bool = False, starts: list[int | None] | None = None) -> None:
        self.prompts, self.params, self.routes = prompts, params, routes
        self.starts = starts or [None] * len(prompts)  # per prompt: the input log-probs' first position
        self.done = threading.Event()
        self.outputs: list[dict] | None = None
        self.error: _Fail | None = None
        self.epoch = 0  # the server's abort epoch when queued: an abort after it answers this job
        self.aborted: str | None = None  # SGLang's abort message, when aborted


class ReferenceServer(WeightRoutes):
    """Route handlers and state of one engine (TP size 1). Each handler takes the JSON body, returns
    the answer object (200) or raises _Fail. The weight routes are WeightRoutes'
    (hpcrl/rollout/reference_weights.py)."""

    def __init__(self, engine: ReferenceModel, tokenizer, model_path: str, args: argparse.Namespace) -> None:
        self.engine, self.tokenizer, self.model_path, self.args = engine, tokenizer, model_path, args
        self.model_lock = threading.Lock()
        self.group_lock = threading.Lock()
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.session_open = False
        self.released: set[str] = set()
        self.weight_version = "default"
        self.reshard_out = None  # the shard route's receive buffers, kept across syncs
        self.reshard_staging = None
        self.reshard_spec = None  # (MoESpec, its fingerprint) of this engine's model, made once
        self.fault = os.environ.get("HPCRL_ENGINE_FAULT")  # tests only (hpcrl/faults.py)
        self.profile = EngineProfile(cuda=engine.device.type == "cuda")  # /start_profile, /stop_profile
        self.unpaused = threading.Event()
        self.unpaused.set()
        self.shutting_down = False
        self.queued: list[_Job] = []  # requests waiting for the next batch
        self.batching = threading.Condition()  # guards `queued` and `running`
        self.running = False  # a handler thread is running a batch
        self.abort_epoch = 0  # bumped by /pause_generation in abort mode (guarded by `batching`)
        post = {"generate": self.generate, "pause_generation": self.pause_generation,
                "continue_generation": self.continue_generation, "flush_cache": self.flush_cache,
                "get_weights_by_name": self.get_weights_by_name, "start_profile": self.start_profile,
                "stop_profile": self.stop_profile}
        weight = {"init_weights_update_group": self.init_weights_update_group,
                  "destroy_weights_update_group": self.destroy_weights_update_group,
                  "begin_weight_update": self.begin_weight_update,
                  "end_weight_update": self.end_weight_update,
                  "update_weights_from_distributed": self.update_weights_from_distributed,
                  ROUTE.lstrip("/"): self.update_weights_reshard,
                  "update_weight_version": self.update_weight_version,
                  "release_memory_occupation": self.release_memory_occupation,
                  "resume_memory_occupation": self.resume_memory_occupation}
        get = {"health": self.health, "health_generate": self.health, "model_info": self.model_info,
               "get_model_info": self.model_info, "server_info": self.server_info,
               "get_server_info": self.server_info, "get_weight_version": self.get_weight_version,
               "flush_cache": self.flush_cache, "get_weights_by_name": self.get_weights_by_name,
               "release_memory_occupation": self.release_memory_occupation,
               "resume_memory_occupation": self.resume_memory_occupation,
               "start_profile": self.start_profile, "stop_profile": self.stop_profile}
        self.routes = {("POST", f"/{k}"): v for k, v in (post | weight).items()}
        self.routes |= {("GET", f"/{k}"): v for k, v in get.items()}
        self.routes[("PUT", "/generate")] = self.generate
        self.weight_routes = {f"/{k}" for k in weight}
        # SGLang's model-update lock: every /generate holds it as a reader, a weight update and the
        # session's begin and end (TokenizerManager._weight_update_session_call) as the writer (unless
        # generation is paused), and a waiting update goes before new requests
        self.update_lock = _UpdateLock()
        self.update_routes = {"/update_weights_from_distributed", ROUTE, "/begin_weight_update",
                              "/end_weight_update"}
        self.api_key = getattr(args, "api_key", None)
        self.admin_api_key = getattr(args, "admin_api_key", None)
        self.auth = bool(self.api_key or self.admin_api_key)  # no keys: no check at all

    def refuse(self, method: str, path: str, authorization: str | None) -> int | None:
        """The HTTP status refusing this request under SGLang's key rules, or None to serve it."""
        allowed, status = decide_request_auth(method=method, path=path, authorization_header=authorization,
                                              api_key=self.api_key, admin_api_key=self.admin_api_key,
                                              auth_level=route_level(path))
        return None if allowed else status

    # -- generation ------------------------------------------------------------------------------

    def generate(self, req: dict):
        start = time.perf_counter()
        faults.inject(faults.engine_fault_due(self.fault, self.weight_version, req), "generate")
        for key, value in req.items():
            if key in _UNSERVED_GENERATE_FIELDS and value not in (None, False, 0, "", [], {}):
                raise _Fail(f"/generate field {key!r} is not supported by the reference engine")
        if req.get("stream"):
            raise _Fail("stream=true is not supported by the reference engine; use a non-streaming request")
        if req.get("top_logprobs_num") or req.get("token_ids_logprob"):
            raise _Fail("top log-probs (top_logprobs_num, token_ids_logprob) are not implemented by the "
                        "reference engine; it returns output_token_logprobs and, with logprob_start_len, "
                        "input_token_logprobs")
        prompts, batched = self._prompts(req)
        n = len(prompts)
        sampling = _per_request(req.get("sampling_params"), n, batched, "sampling_params", {})
        return_logprob = _per_request(req.get("return_logprob"), n, batched, "return_logprob", False)
        rids = _per_request(req.get("rid"), n, batched, "rid", None)
        try:
            params = self.engine.validate(prompts, [s if s is not None else {} for s in sampling])
        except ValueError as exc:
            raise _Fail(str(exc)) from None
        starts = self._logprob_starts(req, prompts, batched, return_logprob)
        routes_from = self._routes_from(req, prompts)
        self._check_not_released()
        job = _Job(prompts, params, routes_from is not None, starts)
        self._run_queued(job)
        if job.error is not None:
            raise job.error
        if job.aborted is not None:  # SGLang answers an aborted request with 200 and finish_reason abort
            job.outputs = [{"output_ids": [], "output_logprobs": [],
                            "finish_reason": {"type": "abort", "message": job.aborted}}] * n
        latency = time.perf_counter() - start
        with_text = bool(req.get("return_text_in_logprobs"))
        base = uuid.uuid4().hex[:20]  # ids unique like SGLang's uuid4 hex, 12 hex digits per answer
        answers = [self._answer(p, o, rid if rid is not None else f"{base}{i:012x}", lp, with_text, latency,
                                routes_from, start)
                   for i, (p, o, rid, lp, start) in enumerate(zip(prompts, job.outputs, rids, return_logprob,
                                                                  job.starts))]
        return answers if batched else answers[0]

    def _logprob_starts(self, req: dict, prompts: list[list[int]], batched: bool,
                        return_logprob: list) -> list[int | None]:
        """Per prompt, the first position of its input_token_logprobs (its length when it gets none),
        or None without return_logprob (SGLang then ignores logprob_start_len). L > P is refused with
        SGLang's abort message (scheduler.py), L < -1 with hpcrl's (SGLang does not check it)."""
        value = req.get("logprob_start_len")
        if isinstance(value, list) and not batched:
            raise _Fail(f"/generate field 'logprob_start_len'={value!r} is a list but the request has one "
                        "prompt; give one integer (a list gives one per item of a batched request)")
        starts = _per_request(value, len(prompts), batched, "logprob_start_len", -1)
        out: list[int | None] = []
        for i, (prompt, start, want) in enumerate(zip(prompts, starts, return_logprob)):
            if not isinstance(start, int) or isinstance(start, bool):
                raise _Fail(f"/generate field 'logprob_start_len'={start!r} (item {i}) must be an integer: "
                            "-1 (no input log-probs) or a position in [0, prompt length]")
            if not want:
                out.append(None)
            elif start > len(prompt):  # SGLang's message (its f-string's "name=" forms), HTTP 400
                raise _Fail(f"req.logprob_start_len={start} is higher than the number of input tokens "
                            f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller "
                            "logprob_start_len.")
            elif start < -1:
                raise _Fail(f"/generate field 'logprob_start_len'={start} (item {i}) must be -1 (no input "
                            f"log-probs) or a position in [0, {len(prompt)}] (the prompt's length)")
            else:
                out.append(len(prompt) if start == -1 else start)
        return out

    def _routes_from(self, req: dict, prompts: list[list[int]]) -> int | None:
        """The first position whose routes the answers carry (routed_experts_start_len), or None when
        they carry none (not asked, or the server runs without --enable-return-routed-experts).
        A start outside [0, prompt length] is refused with SGLang's abort message (scheduler.py's
        check runs whether the flag is on or not)."""
        want = req.get("return_routed_experts")
        start = req.get("routed_experts_start_len")
        start = 0 if start is None else start
        if want is not None and not isinstance(want, bool):
            raise _Fail(f"/generate field 'return_routed_experts'={want!r} must be true or false (one value "
                        "for every item of the request, as SGLang's GenerateReqInput)")
        if not isinstance(start, int) or isinstance(start, bool):
            raise _Fail(f"/generate field 'routed_experts_start_len'={start!r} must be an integer (one "
                        "value for every item of the request, as SGLang's GenerateReqInput)")
        if not want:
            return None
        for prompt in prompts:  # SGLang's messages (its f-strings' "name=" forms), HTTP 400
            if start < 0:
                raise _Fail(f"recv_req.routed_experts_start_len={start} is lower than 0. "
                            "Please use a non-negative routed_experts_start_len.")
            if start > len(prompt):
                raise _Fail(f"recv_req.routed_experts_start_len={start} is higher than the number of input "
                            f"tokens len(req.origin_input_ids)={len(prompt)}. Please use a smaller "
                            "routed_experts_start_len.")
        return start if getattr(self.args, "enable_return_routed_experts", False) else None

    def _prompts(self, req: dict) -> tuple[list[list[int]], bool]:
        ids, text = req.get("input_ids"), req.get("text")
        if (ids is None) == (text is None):
            raise _Fail("give exactly one of 'input_ids' and 'text'")
        if text is not None:
            if self.tokenizer is None:
                raise _Fail("this server has no tokenizer (--tokenizer none); send input_ids")
            texts = text if isinstance(text, list) else [text]
            if not all(isinstance(t, str) for t in texts):
                raise _Fail("'text' must be a string or a list of strings")
            return [self.tokenizer.encode(t) for t in texts], isinstance(text, list)
        if not isinstance(ids, list) or not ids:
            raise _Fail("'input_ids' must be a non-empty list of token ids or a list of such lists")
        if all(isinstance(x, list) for x in ids):
            return ids, True
        return [ids], False

    def _answer(self, prompt, out: dict, rid, return_logprob: bool, with_text: bool, latency: float,
                routes_from: int | None = None, start: int | None = None) -> dict:
        ids = out["output_ids"]
        meta = {"id": rid, "finish_reason": out["finish_reason"],
                "prompt_tokens": len(prompt), "completion_tokens": len(ids), "cached_tokens": 0,
                "reasoning_tokens": 0, "weight_version": self.weight_version, "num_retractions": 0,
                "e2e_latency": latency}
        if return_logprob:
            decode = self.tokenizer.decode if (with_text and self.tokenizer is not None) else None
            # SGLang reports an input id >= vocab_size - 1 as 0 (logprob_result_processor.py, meant for
            # multimodal hashes); the log-prob is still that token's.
            last = self.engine.vocab_size - 1
            inputs = [t if t < last else 0 for t in prompt[start:]] if start is not None else []
            values = out.get("input_logprobs", [])
            meta["input_token_logprobs"] = [[lp, t, decode([t]) if decode else None]
                                            for lp, t in zip(values, inputs)]
            meta["output_token_logprobs"] = [[lp, t, decode([t]) if decode else None]
                                             for lp, t in zip(out["output_logprobs"], ids)]
            meta["output_token_logprobs_length"] = len(ids)
        if routes_from is not None and "routed_experts" in out:
            meta["routed_experts"] = encode_routed_experts(out["routed_experts"][routes_from:])
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _check_not_released(self) -> None:
        if self.released:
            raise _Fail(f"engine memory is released (tags {sorted(self.released)}); call "
                        f"/resume_memory_occupation before /generate")

    def _run_queued(self, job: _Job) -> None:
        """Queue `job` and return when it has run. Requests run one at a time, oldest first, each as
        a batch of its own rows only: while none runs, the caller's thread runs the oldest queued one
        (its own, or one whose thread has not woken yet, then it goes on waiting for its own)."""
        with self.batching:
            job.epoch = self.abort_epoch
            self.queued.append(job)
        while True:
            with self.batching:
                while self.running and not job.done.is_set():
                    self.batching.wait()
                if job.done.is_set():
                    return
                self.running, oldest = True, self.queued.pop(0)
            self._run_job(oldest)

    def _run_job(self, job: _Job) -> None:
        """Run `job` (taken from the queue, `running` set) unless paused away or aborted; answer it."""
        try:
            while not self.unpaused.wait(0.05):  # paused: until continue, or an abort of this job
                if job.epoch < self.abort_epoch:
                    break
            with self.model_lock:
                with self.batching:  # aborted while this thread waited for the pause to end
                    if job.epoch < self.abort_epoch:
                        job.aborted = "Abort in waiting queue"
                if job.aborted is None:
                    with self.profile.traced():  # /start_profile
                        self._run_batch(job)
        finally:
            with self.batching:
                if job.aborted is None and job.epoch < self.abort_epoch:
                    job.aborted = "Aborted"  # aborted while it ran (SGLang's FINISH_ABORT message)
                job.done.set()
                self.running = False
                self.batching.notify_all()

    def _run_batch(self, job: _Job) -> None:
        """Generate for the request's rows that produce tokens or routes, then score the rows that
        asked for input log-probs (one forward each); rows with max_new_tokens 0 and no routes are
        answered without generating (what the engine answers them: no token, finish_reason length 0)."""
        rows = range(len(job.prompts))
        gen = [k for k in rows if job.params[k].max_new_tokens > 0 or job.routes]
        scored = [k for k in rows if job.starts[k] is not None and job.starts[k] < len(job.prompts[k])]
        try:
            self._check_not_released()
            generated = self.engine.generate([job.prompts[k] for k in gen], [job.params[k] for k in gen],
                                             return_routes=job.routes)
            values = input_token_logprobs(self.engine, [job.prompts[k] for k in scored],
                                          [job.starts[k] for k in scored])
        except _Fail as exc:
            job.error = exc
            return
        except Exception as exc:  # an engine fault: report it to the waiting request
            traceback.print_exc()
            job.error = _Fail(f"generation failed: {type(exc).__name__}: {exc}", status=500)
            return
        outputs = dict(zip(gen, generated))
        for k, vals in zip(scored, values):
            outputs.setdefault(k, _no_output())["input_logprobs"] = vals
        job.outputs = [outputs.get(k) or _no_output() for k in rows]

    def health(self, req: dict):
        if self.shutting_down:
            raise _Fail("shutting down", status=503)
        return None

    def flush_cache(self, req: dict):
        return "Cache flushed.\n"  # no cache outlives a batch in the reference engine

    def model_info(self, req: dict) -> dict:
        return {"model_path": self.model_path,
                "tokenizer_path": self.args.tokenizer if self.tokenizer else None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "model_type": self.engine.model_type, "vocab_size": self.engine.vocab_size,
                "context_len": self.engine.context_len}

    def server_info(self, req: dict) -> dict:
        """SGLang's answer: the resolved server arguments (its `resolved_dict`, the keys among them:
        SGLang 0.5.23 returns them to any holder of the API key) plus live state."""
        a = self.args
        return {"model_path": self.model_path, "host": a.host, "port": a.port, "device": a.device,
                "dtype": a.dtype, "api_key": self.api_key, "admin_api_key": self.admin_api_key,
                "random_seed": a.seed, "tp_size": 1, "dp_size": 1, "nnodes": getattr(a, "nnodes", 1),
                "node_rank": 0,
                "dist_init_addr": getattr(a, "dist_init_addr", None), "weight_version": self.weight_version,
                "enable_return_routed_experts": bool(getattr(a, "enable_return_routed_experts", False)),
                "enable_fp32_lm_head": bool(getattr(a, "enable_fp32_lm_head", False)),
                "context_length": getattr(a, "context_length", None),
                "max_req_input_len": self.engine.context_len - 6,  # SGLang's min(context, pool) - 1 - 5
                "version": "hpcrl-reference",
                "internal_states": [{"released_tags": sorted(self.released),
                                     "weight_update_session": self.session_open,
                                     "weight_update_groups": sorted(self.groups)}]}

    def get_weight_version(self, req: dict) -> dict:
        return {"weight_version": self.weight_version}

    def pause_generation(self, req: dict) -> dict:
        """SGLang's modes: "abort" (default) answers every request queued or running now with
        finish_reason abort and returns once none runs; "retract" and "in_place" keep them, to finish
        after /continue_generation. Requests that arrive while paused wait for /continue_generation."""
        mode = req.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise _Fail(f"mode {mode!r} must be one of 'abort', 'retract', 'in_place'")
        self.unpaused.clear()
        if mode == "abort":
            with self.batching:
                self.abort_epoch += 1
                for j in self.queued:
                    j.aborted = "Abort in waiting queue"
                    j.done.set()
                self.queued = []
                self.batching.notify_all()
            with self.model_lock:
                pass  # a batch that was running has ended; its requests answer as aborted
        return {"message": "Generation paused successfully.", "status": "ok"}

    def start_profile(self, req: dict) -> str:
        """SGLang's /start_profile (hpcrl/rollout/engine_profile.py): this engine's forward batches
        from now until /stop_profile."""
        return self._profile_call(self.profile.start, req)

    def stop_profile(self, req: dict) -> str:
        with self.model_lock:  # after the batch that runs now: its trace is whole
            return self._profile_call(lambda _: self.profile.stop(), req)

    @staticmethod
    def _profile_call(call, req: dict) -> str:
        try:
            return call(req)
        except ProfileRefused as exc:
            raise _Fail(str(exc), exc.status) from None

    def continue_generation(self, req: dict) -> dict:
        self.unpaused.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def close(self) -> None:
        """Stop the worker and destroy the groups (skipped if a transfer still holds the lock)."""
        self.shutting_down = True
        if self.model_lock.acquire(timeout=1.0):
            for group in self.groups.values():
                dist.destroy_process_group(group)
            self.groups.clear()
            self.model_lock.release()


def _no_output() -> dict:
    """The engine's result for a request with max_new_tokens 0 (engine.py `_result`)."""
    return {"output_ids": [], "output_logprobs": [], "finish_reason": {"type": "length", "length": 0}}


def encode_routed_experts(routes: torch.Tensor) -> str:
    """SGLang's meta_info["routed_experts"]: base64 of the int32 array's bytes, little-endian, C order
    (its detokenizer's `pybase64.b64encode(tensor.numpy().tobytes())` on a little-endian host)."""
    return base64.b64encode(np.ascontiguousarray(routes.numpy(), dtype="<i4").tobytes()).decode("ascii")


def _per_request(value, n: int, batched: bool, key: str, default) -> list:
    """A request field as one value per prompt: a list gives one each (batch), anything else is shared."""
    if isinstance(value, list):
        if len(value) != n:
            raise _Fail(f"{key} is a list of {len(value)} but the request has {n} prompt(s)")
        return value
    return [default if value is None else value] * n


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server_version = "hpcrl-reference"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        device = self.server.app.engine.device  # type: ignore[attr-defined]
        if device.type == "cuda":  # CUDA's current device is per thread; NCCL's p2p batches use it
            torch.cuda.set_device(device)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (base-class signature)
        pass  # one line per request would cost more than the request

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        app: ReferenceServer = self.server.app  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if app.auth:
            status = app.refuse(method, path, self.headers.get("Authorization"))
            if status is not None:
                self._send(status, {"error": "Unauthorized" if status == 401 else "Forbidden"})
                return
        handler = app.routes.get((method, path))
        weight_route = path in app.weight_routes
        try:
            if handler is None:
                known = any(p == path for _, p in app.routes)
                raise _Fail(f"{method} {path} is not a route of this server", status=405 if known else 404)
            try:
                req = json.loads(raw) if raw.strip() else {}
            except ValueError as exc:
                raise _Fail(f"request body is not valid JSON: {exc}") from None
            if not isinstance(req, dict):
                raise _Fail("request body must be a JSON object")
            if path == "/generate":
                gate = app.update_lock.reading()
            elif path in app.update_routes and app.unpaused.is_set():
                gate = app.update_lock.writing()
            else:
                gate = contextlib.nullcontext()
            with gate:
                answer = handler(req)
            self._send(200, answer)
        except _Fail as exc:
            self._send(exc.status, _error_body(str(exc), weight_route))
        except Exception as exc:
            traceback.print_exc()
            self._send(500, _error_body(f"internal error: {type(exc).__name__}: {exc}", weight_route))

    def _send(self, status: int, obj) -> None:
        if obj is None:
            body, ctype = b"", "text/plain"
        elif isinstance(obj, str):
            body, ctype = obj.encode(), "text/plain; charset=utf-8"
        else:
            body, ctype = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS), "application/json"
        reason = self.responses.get(status, ("",))[0]
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"{'Connection: close' if self.close_connection else 'Connection: keep-alive'}\r\n\r\n")
        self.wfile.write(head.encode() + body)  # one write: no Nagle/delayed-ACK stall


class _UpdateLock:
    """SGLang's RWLock (srt/utils/aio_rwlock.py) in threads: readers share it, a writer holds it
    alone, and readers arriving while a writer waits wait behind it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.contextmanager
    def reading(self):
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self):
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def _error_body(message: str, weight_route: bool) -> dict:
    """SGLang's failure shapes: weight routes {"success", "message"}, others {"error": {"message"}}."""
    return {"success": False, "message": message} if weight_route else {"error": {"message": message}}


def _with_config(argv: list[str]) -> list[str]:
    """SGLang's --config merge: the YAML file's options ({"api-key": K} -> --api-key K, true ->
    the bare flag) go before the command line's, whose own values therefore win."""
    if "--config" not in argv:
        return argv
    import yaml

    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise SystemExit("--config needs a YAML file")
    data = yaml.safe_load(Path(argv[i + 1]).read_text()) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"--config {argv[i + 1]}: must hold a mapping of options")
    merged: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            merged.append(flag)
        elif value is not False and value is not None:
            merged.append(f"{flag}={value}")  # one item: a value may start with "-"
    return merged + argv[:i] + argv[i + 2:]


def context_length(asked: int, derived: int) -> int:
    """--context-length as SGLang 0.5.23 takes it (configs/model_config.py `_derive_context_length`):
    at most the model's; longer only with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN set, else its
    ValueError's message, at start."""
    allowed = os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "").lower()
    if asked > derived and allowed not in ("1", "true", "yes", "y"):  # SGLang's EnvBool
        raise SystemExit(f"Warning: User-specified context_length ({asked}) is greater than the derived "
                         f"context_length ({derived}). This may lead to incorrect model outputs or CUDA "
                         "errors. Note that the derived context_length may differ from "
                         "max_position_embeddings in the model's config. To allow overriding this maximum, "
                         "set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    return asked


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", required=True, help="HF config.json of the model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0: let the OS choose (see --port-file)")
    parser.add_argument("--port-file", default=None,
                        help="write the bound port here once listening (race-free with --port 0)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model-path", default=None,
                        help="HF model directory whose safetensors the engine starts from")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and unseeded sampling")
    parser.add_argument("--tokenizer", default="char", choices=["char", "none"],
                        help="text <-> ids for 'text' inputs and the 'text' answer field")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--dist-timeout-s", type=float, default=600.0, help="weight-update group timeout")
    parser.add_argument("--api-key", default=None, help="Bearer key of ordinary routes (SGLang's)")
    parser.add_argument("--admin-api-key", default=None, help="Bearer key of weight/memory routes (SGLang's)")
    parser.add_argument("--config", default=None, help="YAML file of options, read as SGLang's --config")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="answer requests with return_routed_experts with meta_info routed_experts "
                             "(SGLang's flag)")
    parser.add_argument("--enable-fp32-lm-head", action="store_true",
                        help="the LM head in float32 from the model-dtype hidden states (SGLang's flag)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="the longest request, prompt and output, instead of the model's "
                             "max_position_embeddings (SGLang's flag; longer only with "
                             "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the engine (SGLang's flag)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank in the engine (SGLang's)")
    parser.add_argument("--dist-init-addr", default=None,
                        help="HOST:PORT of node 0's rendezvous, with --nnodes > 1 (SGLang's flag; "
                             "hpcrl/rollout/reference_nodes.py)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(_with_config(argv))
    if args.nnodes > 1 or args.node_rank:
        if not 0 <= args.node_rank < args.nnodes or args.dist_init_addr is None:
            raise SystemExit(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: give 0 <= node-rank < "
                             "nnodes and --dist-init-addr HOST:PORT (node 0's rendezvous)")
        if args.node_rank:
            from hpcrl.rollout.reference_nodes import follow

            os._exit(follow(args.dist_init_addr, args.nnodes, args.node_rank, args.host, args.port,
                            args.port_file, args.dist_timeout_s))
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_config = json.loads(Path(args.model_config).read_text())
    engine = ReferenceModel(hf_config, device=args.device, dtype=getattr(torch, args.dtype), seed=args.seed,
                            fp32_lm_head=args.enable_fp32_lm_head)
    if args.context_length is not None:
        engine.context_len = context_length(args.context_length, engine.context_len)
    if args.enable_return_routed_experts and engine.routes_refusal():
        raise SystemExit(f"--enable-return-routed-experts: {engine.routes_refusal()}; drop the flag")
    if args.model_path:
        loaded = engine.load_model_dir(args.model_path)
        mtp = engine.skipped_mtp
        print(f"loaded {loaded} weights from {args.model_path}" + (
            f"; {len(mtp)} MTP tensors not loaded (the reference engine runs no draft model)" if mtp else ""),
              flush=True)
    # Warm-up (lazy imports, allocator) so the first real request is not slow; a context of 8 tokens
    # or fewer (--context-length) refuses these inputs as SGLang would, and the server starts cold.
    if engine.context_len > 8:
        engine.generate([[0, 0], [0]], [{"max_new_tokens": 2, "temperature": 1.0, "sampling_seed": 0}] * 2)
    tokenizer = None
    if args.tokenizer == "char":
        from hpcrl.tasks.tokenizer import CharTokenizer

        tokenizer = CharTokenizer()
    nodes = None
    if args.nnodes > 1:  # every node joins before node 0 serves, as SGLang's distributed init
        from hpcrl.rollout.reference_nodes import Rendezvous

        nodes = Rendezvous(args.dist_init_addr, args.nnodes, args.dist_timeout_s)
    app = ReferenceServer(engine, tokenizer, str(Path(args.model_config).resolve()), args)
    httpd = _HTTPServer((args.host, args.port), _Handler)
    httpd.app = app  # type: ignore[attr-defined]
    port = httpd.server_address[1]
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)  # atomic: the launcher never reads a half-written port

    def stop(signum, frame) -> None:
        app.shutting_down = True
        threading.Thread(target=httpd.shutdown, daemon=True).start()  # shutdown() waits for serve_forever

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # Slurm's preemption notice (scancel --signal=USR1; submitit's _interrupt sends USR2) reaches
    # every process of the step; it is the controller's to act on, and must not kill the engine
    # (the default action of both).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    print(f"ready on http://{args.host}:{port}", flush=True)
    httpd.serve_forever(poll_interval=0.1)
    httpd.server_close()
    app.close()
    if nodes is not None:
        nodes.stop()
    print("reference server stopped", flush=True)
    sys.stdout.flush()
    os._exit(0)  # do not wait on daemon threads that may sit in a collective


if __name__ == "__main__":
    main()
