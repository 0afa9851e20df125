"""Weight-update groups are joined the way SGLang 0.5.23's engines join them, read from its wheel.

SGLang's TP workers call `init_custom_process_group(backend, init_method, world_size, rank,
group_name)` (model_runner_components/weight_updater.py) without `device_id`, so torch creates their
NCCL communicator lazily, at the group's first collective. A trainer that joined with `device_id`
would create its side eagerly and block in NCCL's connect until that first collective, which the
engines only run after the join has returned: the broadcast route would time out and the shard route
block forever. On a CPU machine NCCL cannot run, so the tests compare what each side asks torch for:
SGLang's own function (run from the wheel with torch's group helper recorded) and hpcrl's, and every
place in hpcrl that joins such a group.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from _sglang_probe import record_join

import hpcrl
from hpcrl.rollout.weight_sender import init_custom_process_group

PROBE = Path(__file__).parent / "_sglang_probe.py"
UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"


def _join_calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == "init_custom_process_group"]


def test_hpcrl_asks_torch_for_the_group_sglangs_engines_ask_for(sglang_root: Path):
    calls = _join_calls(sglang_root / "src" / UPDATER)
    assert len(calls) == 1, f"SGLang's weight updater joins in {len(calls)} places; re-read {UPDATER}"
    keywords = {k.arg for k in calls[0].keywords}
    assert keywords == {"backend", "init_method", "world_size", "rank", "group_name"}, keywords
    call = {"backend": "nccl", "init_method": "tcp://127.0.0.1:29500", "world_size": 3, "rank": 1,
            "group_name": "weight_update_group"}
    out = subprocess.run([sys.executable, str(PROBE), "join-args", str(sglang_root), json.dumps(call)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sglang = json.loads(out.stdout.strip().splitlines()[-1])
    ours = record_join(lambda **k: init_custom_process_group(k["backend"], k["init_method"], k["world_size"],
                                                             k["rank"], k["group_name"]), **call)
    assert sglang["device_id"] is None, sglang  # lazy: the engines' communicator comes at the first collective
    assert ours == sglang


def test_no_join_in_hpcrl_asks_for_an_eager_communicator():
    """Every call of init_custom_process_group in hpcrl (trainer's broadcast and shard routes, the
    reference engine) passes what the function takes, and none asks for a device."""
    root = Path(hpcrl.__file__).parent
    found = {f"{path.relative_to(root)}:{call.lineno}": {k.arg for k in call.keywords}
             for path in root.rglob("*.py") for call in _join_calls(path)}
    assert len(found) >= 3, found  # weight_sender, shard_sync, reference_server
    assert not [where for where, keywords in found.items() if "device_id" in keywords], found
