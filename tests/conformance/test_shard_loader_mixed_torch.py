"""The shard route across torch versions: a trainer on hpcrl's torch (2.13.0) sends with
`moe.runtime.reshard`; an engine of TP 2 runs under SGLang's torch (2.14.1, the side venv of
torch_side_env.py) with SGLang's own `init_custom_process_group` and request deserializer from the
wheel, and receives through hpcrl's `--custom-weight-loader` (point-to-point gloo messages, not the
broadcast test_mixed_torch.py checks) into a stand-in model: bit-exact against SGLang's loading
rules. Skips when the side venv is absent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch_side_env import SIDE_TORCH, side_python

from hpcrl.rollout.reshard_route import spec_at_dtype, spec_fingerprint
from hpcrl.rollout.sglang_shard_loader import tensor_request_body
from moe.layouts import RolloutLayout, TrainerLayout
from moe.network import Topology
from sglang_stand_in import GROUP, hf_config
from stores import hosted_store, init_method

WORKER = Path(__file__).parent / "_shard_loader_worker.py"
TP, EP = 2, 2


@pytest.mark.timeout(600)
def test_engine_on_sglangs_torch_receives_its_slices_bit_exact(tmp_path, sglang_root):
    side = side_python()
    if not side.exists():
        pytest.skip(f"no torch {SIDE_TORCH} side venv at {side.parent.parent}; build it with "
                    ".venv/bin/python tests/conformance/torch_side_env.py (CUDA build, ~5.5 GB)")
    from hpcrl.rollout.reshard_route import PlanRequest

    request = PlanRequest(TrainerLayout(vocab_divisible_by=1), RolloutLayout(num_engines=1, tp=TP, ep=EP),
                          64 << 10, Topology(colocated=True))
    control = {**request.to_json(), "group_name": GROUP, "verify": "full", "deadline_s": 120,
               "spec_sha256": spec_fingerprint(spec_at_dtype(hf_config(), "float32"))}
    body = tmp_path / "body.json"
    body.write_text(json.dumps(tensor_request_body(control, engine_index=0, tp=TP)))
    world = 1 + TP
    store = hosted_store(world)
    init = init_method(store)
    procs = [subprocess.Popen([sys.executable, str(WORKER), "trainer", init, str(world), str(TP), str(EP)])]
    procs += [subprocess.Popen([str(side), str(WORKER), "engine", str(sglang_root), str(body), init,
                                str(world), str(TP), str(EP), str(r), str(tmp_path / f"engine{r}.json")])
              for r in range(TP)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * len(procs)
    for r in range(TP):
        got = json.loads((tmp_path / f"engine{r}.json").read_text())
        assert got["torch"].startswith(SIDE_TORCH) and got["bad"] == [], (r, got)
