"""The weight half of the reference server's protocol (hpcrl/rollout/reference_server.py): SGLang
0.5.x's weight-update group, its begin/end session, the per-tensor or flattened-bucket broadcast
(/update_weights_from_distributed), hpcrl's shard route (/hpcrl/update_weights_reshard,
hpcrl/rollout/reshard_route.py), weight reads and versions, and memory release/resume. A mixin of
`ReferenceServer`, whose state it uses: `engine`, `args`, `model_lock`, `group_lock`, `groups`,
`session_open`, `released`, `weight_version` and the shard route's buffers. Refusals come before any
receive, as SGLang's (reference_server.py's docstring).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.rollout.reshard_route import ROUTE, PlanRequest, spec_at_dtype, spec_fingerprint
from hpcrl.rollout.weight_sender import init_custom_process_group, parse_dtype, unflatten_bucket

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class _Fail(Exception):
    """A refused request: its message and HTTP status (the server answers it as SGLang would)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _field(req: dict, key: str, kind):
    if key not in req:
        raise _Fail(f"missing field {key!r}")
    value = req[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _Fail(f"field {key!r}={value!r} has the wrong type")
    return value


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class WeightRoutes:
    """The weight routes' handlers (each takes the JSON body, returns the answer or raises _Fail)."""

    def init_weights_update_group(self, req: dict) -> dict:
        addr = _field(req, "master_address", str)
        port, rank_offset, world_size = (_field(req, k, int)
                                         for k in ("master_port", "rank_offset", "world_size"))
        group_name = req.get("group_name") or "weight_update_group"
        backend = req.get("backend") or "nccl"
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise _Fail(f"backend 'nccl' needs CUDA but this engine runs on {self.engine.device}; "
                        f"use backend 'gloo'")
        rank = rank_offset  # + tp_rank, always 0 here
        host = f"[{addr}]" if ":" in addr else addr
        with self.group_lock:
            if group_name in self.groups:
                raise _Fail(f"weight-update group {group_name!r} already exists; destroy it first")
            try:
                self.groups[group_name] = init_custom_process_group(
                    backend, f"tcp://{host}:{port}", world_size, rank, group_name, self.args.dist_timeout_s)
            except Exception as exc:
                raise _Fail(f"Failed to initialize custom process group: {exc}.") from None
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_weights_update_group(self, req: dict) -> dict:
        with self.group_lock:
            group = self.groups.pop(req.get("group_name") or "weight_update_group", None)
            if group is None:
                raise _Fail("The group to be destroyed does not exist.")
            dist.destroy_process_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def begin_weight_update(self, req: dict) -> dict:
        selector = req.get("selector") or "all"
        if selector not in ("all", "target"):
            raise _Fail(f"selector {selector!r}: the reference engine has no draft model; "
                        f"use 'all' or 'target'")
        with self.model_lock:
            if self.session_open:  # SGLang 0.5.23: HTTP 400
                raise _Fail("a weight-update session is already open; call end_weight_update() first")
            self.session_open = True
        return {"success": True, "message": "Success"}

    def end_weight_update(self, req: dict) -> dict:
        with self.model_lock:
            if not self.session_open:
                raise _Fail("no weight-update session is open; call begin_weight_update() first")
            self.session_open = False
        return {"success": True, "message": "Success"}

    def update_weights_from_distributed(self, req: dict) -> dict:
        names = _field(req, "names", list)
        dtype_names, shapes = _field(req, "dtypes", list), _field(req, "shapes", list)
        if not names or not len(names) == len(dtype_names) == len(shapes):
            raise _Fail(f"names, dtypes and shapes must be non-empty lists of one length; got "
                        f"{len(names)}, {len(dtype_names)}, {len(shapes)}")
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise _Fail("shapes must be lists of non-negative integers")
        try:
            dtypes = [parse_dtype(d) for d in dtype_names]
        except ValueError as exc:
            raise _Fail(str(exc)) from None
        load_format = req.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise _Fail(f"load_format {load_format!r} is not supported; use null (per tensor) or "
                        f"'flattened_bucket'")
        group_name = req.get("group_name") or "weight_update_group"
        with self.model_lock:
            # Refusals come before the receive, as in SGLang: the sender's broadcast then has no
            # receiver here, and the client reads this answer to stop waiting for it.
            if not self.session_open:
                raise _Fail("update_weights_from_distributed must run between begin_weight_update() and "
                            "end_weight_update()")
            group = self.groups.get(group_name)
            if group is None:
                raise _Fail(f"Failed to receive weights: Group {group_name} not in {sorted(self.groups)}. "
                            f"Please call `init_weights_update_group` first.")
            if "weights" in self.released:
                raise _Fail("weights are released; call /resume_memory_occupation with tag 'weights' first")
            tensors = self._receive(group, dtypes, shapes, load_format)
            try:
                self.engine.load_weights(zip(names, tensors))
            except ValueError as exc:
                raise _Fail(f"Failed to update parameter online: {exc}. No weight was changed.") from None
        message = "Succeeded to update parameter online."
        version = req.get("weight_version")
        if version is not None:
            self.weight_version = str(version)
            message += f" Weight version updated to {version}."
        return {"success": True, "message": message}

    def update_weights_reshard(self, req: dict) -> dict:
        from moe.runtime import VERIFY_MODES, ReshardError, Staging, reshard

        try:
            request = PlanRequest.from_json(req)
        except ValueError as exc:
            raise _Fail(f"{ROUTE}: {exc}") from None
        rank, deadline_s = _field(req, "engine_rank", int), float(_field(req, "deadline_s", (int, float)))
        verify = req.get("verify", "sampled")
        if verify not in VERIFY_MODES:
            raise _Fail(f"{ROUTE}: field 'verify'={verify!r} must be one of {', '.join(VERIFY_MODES)}")
        if self.reshard_spec is None:
            spec = spec_at_dtype(json.loads(Path(self.args.model_config).read_text()), self.args.dtype)
            self.reshard_spec = spec, spec_fingerprint(spec)
        spec, fingerprint = self.reshard_spec
        if fingerprint != req.get("spec_sha256"):
            raise _Fail(f"spec_sha256 {req.get('spec_sha256')!r} is not this engine's model "
                        f"({fingerprint}, {self.args.model_config}, dtype {self.args.dtype}): "
                        "trainer and engine would plan different models")
        try:
            plan = request.build(spec)
        except ValueError as exc:
            raise _Fail(f"{ROUTE}: cannot plan: {exc}") from None
        if not 0 <= rank < plan.dst.world_size or plan.dst.tp != 1:
            raise _Fail(f"engine_rank={rank} with rollout layout {plan.dst}: the reference engine is one "
                        f"rank (tp 1), engine_rank in [0, {plan.dst.world_size})")
        group_name = _field(req, "group_name", str)
        group = self.groups.get(group_name)
        if group is None:
            raise _Fail(f"Group {group_name} not in {sorted(self.groups)}. Please call "
                        f"`init_weights_update_group` first.")
        with self.model_lock:
            self.reshard_staging = self.reshard_staging or Staging()
            try:
                self.reshard_out = reshard(plan, "rollout", rank, group=group, deadline_s=deadline_s,
                                           verify=verify,
                                           out=self.reshard_out, device=self.engine.device,
                                           staging=self.reshard_staging)
            except ReshardError as exc:
                raise _Fail(f"Failed to receive the weights: {exc}. No weight was changed.") from None
            if "weights" in self.released:
                raise _Fail("weights are released; call /resume_memory_occupation with tag 'weights' first")
            try:
                self.engine.load_weights((n, t) for n, (_, t) in self.reshard_out.items())
            except ValueError as exc:
                raise _Fail(f"Failed to update parameter online: {exc}. No weight was changed.") from None
        version = req.get("weight_version")
        if version is not None:
            self.weight_version = str(version)
        return {"success": True, "message": f"Received {int(plan.received_bytes()[rank])} bytes in "
                                            f"{plan.num_rounds} rounds; weight version {self.weight_version}."}

    def _receive(self, group, dtypes, shapes, load_format) -> list[torch.Tensor]:
        device = self.engine.device if self.engine.device.type == "cuda" else torch.device("cpu")
        if load_format == "flattened_bucket":
            nbytes = sum(dt.itemsize * _numel(s) for dt, s in zip(dtypes, shapes))
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dist.broadcast(buffer, group=group, group_src=0)
            return unflatten_bucket(buffer, dtypes, shapes)
        tensors = [torch.empty(s, dtype=dt, device=device) for dt, s in zip(dtypes, shapes)]
        works = [dist.broadcast(t, group=group, group_src=0, async_op=True) for t in tensors]
        for work in works:
            work.wait()
        return tensors

    def get_weights_by_name(self, req: dict):
        name = _field(req, "name", str)
        truncate = req.get("truncate_size", 100)
        with self.model_lock:
            try:
                tensor = self.engine.get_weight(name)
            except ValueError as exc:
                raise _Fail(str(exc)) from None
        return tensor[:truncate].float().tolist()

    def update_weight_version(self, req: dict) -> dict:
        version = str(_field(req, "new_version", (str, int)))
        self.weight_version = version
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    def release_memory_occupation(self, req: dict) -> dict:
        tags = self._tags(req)
        with self.model_lock:
            if "weights" in tags and "weights" not in self.released and self.engine.device.type != "cpu":
                self.engine.to_device("cpu")
                torch.cuda.empty_cache()
            self.released |= set(tags)
        return {"success": True, "message": f"Released {tags}."}

    def resume_memory_occupation(self, req: dict) -> dict:
        tags = self._tags(req) if req.get("tags") else sorted(self.released)
        with self.model_lock:
            missing = [t for t in tags if t not in self.released]
            if missing:
                raise _Fail(f"cannot resume {missing}: not released (released: {sorted(self.released)})")
            if "weights" in tags and self.engine.device.type != "cpu":
                self.engine.to_device(self.engine.device)
            self.released -= set(tags)
        return {"success": True, "message": f"Resumed {tags}."}

    def _tags(self, req: dict) -> list[str]:
        tags = req.get("tags") or list(MEMORY_TAGS)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise _Fail(f"unknown memory tags {bad}; valid tags are {list(MEMORY_TAGS)}")
        return list(tags)
