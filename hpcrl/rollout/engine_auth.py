"""Per-job engine keys: SGLang 0.5.23's API-key rules, shared by the reference server and the client.

Every engine of a job is protected by two secrets generated for the job (`job_keys`): SGLang's
`--api-key` (ordinary routes such as /generate, /model_info, /server_info) and `--admin-api-key`
(weight-update, memory, cache and pause routes). Both are set: with the admin key alone SGLang
leaves /generate open. They live in RUN_DIR/engine_keys.yaml, mode 0600, in the YAML form SGLang
reads with `--config FILE` (`api-key: ...`), so no key appears on a command line (`ps`); the
reference server reads the same file with the same flag. Clients send `Authorization: Bearer KEY`
with the key of the route's level (`EngineKeys.header`).

The rules (`decide_request_auth`) are SGLang's `sglang/srt/utils/auth.py`, route levels from the
`@auth_level` marks in `entrypoints/http_server.py`: /health*, /ready*, /metrics* are always open;
an ADMIN_OPTIONAL route needs the admin key when one is set (the API key is then not accepted),
else the API key when set; a NORMAL route needs the API key when set (the admin key does not
unlock it). A refusal is HTTP 401 {"error": "Unauthorized"} (403 {"error": "Forbidden"} only for
ADMIN_FORCE routes on a server without an admin key, which no route used here is).

torch.distributed's weight-update ports are not authenticated (docs/sglang.md).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

__all__ = ["ADMIN_ROUTES", "AuthLevel", "EngineKeys", "decide_request_auth", "job_keys", "keys_path",
           "route_level", "set_process_keys", "process_keys"]

KEYS_FILE = "engine_keys.yaml"


class AuthLevel(str, Enum):
    """SGLang's per-route auth levels."""

    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


ADMIN_ROUTES = frozenset({
    "/flush_cache", "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/update_weights_from_distributed", "/update_weights_from_tensor",
    "/update_weights_from_disk", "/update_weight_version", "/get_weights_by_name",
    "/release_memory_occupation", "/resume_memory_occupation", "/pause_generation",
    "/continue_generation", "/abort_request", "/set_internal_state", "/start_profile", "/stop_profile",
    "/hpcrl/update_weights_reshard",  # hpcrl's extension: a weight update, so admin like SGLang's
})
"""Routes SGLang 0.5.23 marks ADMIN_OPTIONAL (those hpcrl's engines serve or may call)."""


def route_level(path: str) -> AuthLevel:
    """The auth level of a route path (NORMAL unless it is one of ADMIN_ROUTES)."""
    return AuthLevel.ADMIN_OPTIONAL if path in ADMIN_ROUTES else AuthLevel.NORMAL


def decide_request_auth(*, method: str, path: str, authorization_header: str | None, api_key: str | None,
                        admin_api_key: str | None, auth_level: AuthLevel) -> tuple[bool, int]:
    """SGLang's `decide_request_auth`: (allowed, HTTP status when refused)."""
    if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True, 401

    def bearer(expected: str) -> bool:
        if not authorization_header:
            return False
        parts = authorization_header.split(" ", 1)
        return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], expected)

    if auth_level == AuthLevel.ADMIN_FORCE:
        if not admin_api_key:
            return False, 403
        return bearer(admin_api_key), 401
    if auth_level == AuthLevel.ADMIN_OPTIONAL:
        if admin_api_key:
            return bearer(admin_api_key), 401
        if api_key:
            return bearer(api_key), 401
        return True, 401
    if api_key:
        return bearer(api_key), 401
    return True, 401


@dataclass(frozen=True)
class EngineKeys:
    """A job's two engine keys; `header(path)` is the Authorization header a client sends there."""

    api_key: str
    admin_api_key: str

    def header(self, path: str) -> str:
        key = self.admin_api_key if path in ADMIN_ROUTES else self.api_key
        return f"Bearer {key}"

    @classmethod
    def read(cls, path: str | Path) -> EngineKeys:
        """From an SGLang --config YAML file holding `api-key` and `admin-api-key`."""
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        norm = {str(k).replace("_", "-"): v for k, v in data.items()}
        missing = [k for k in ("api-key", "admin-api-key") if not norm.get(k)]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        return cls(str(norm["api-key"]), str(norm["admin-api-key"]))


def keys_path(run_dir: str | Path) -> Path:
    """Where a run keeps its engine keys."""
    return Path(run_dir) / KEYS_FILE


def job_keys(run_dir: str | Path) -> EngineKeys:
    """The run's engine keys: read RUN_DIR/engine_keys.yaml, or create it (mode 0600, fresh random
    keys of 64 hex digits, quoted: SGLang's --config passes each as its own argv item, so a key must
    not start with "-", as a URL-safe token may) if absent. Safe when every rank of a job calls it at once: the file appears complete or not
    at all (written aside, then hard-linked into place; the first link wins), also on NFS/Lustre."""
    path = keys_path(run_dir)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# hpcrl: this job's engine keys (SGLang --config); user-only, never on a command line\n"
                    f'api-key: "{secrets.token_hex(32)}"\nadmin-api-key: "{secrets.token_hex(32)}"\n')
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another rank's file won
        finally:
            tmp.unlink()
    return EngineKeys.read(path)


_PROCESS_KEYS: EngineKeys | None = None


def set_process_keys(keys: EngineKeys | None) -> None:
    """Make `keys` the default of every EngineClient this process creates afterwards."""
    global _PROCESS_KEYS
    _PROCESS_KEYS = keys


def process_keys() -> EngineKeys | None:
    """The keys set by `set_process_keys` (None: clients send no Authorization header)."""
    return _PROCESS_KEYS
