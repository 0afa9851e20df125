"""hpcrl's SGLang shard loader (hpcrl/rollout/sglang_shard_loader.py) against SGLang 0.5.23's code.

SGLang's own deserializer and process-group code run on hpcrl's `/update_weights_from_tensor` body
(subprocess, _shard_loader_probe.py); the launch flag is parsed by SGLang's server-argument parser;
the call site of custom loaders and the request's fields are read from the wheel's source. The
receive itself is tested in tests/unit/test_sglang_shard_loader.py; docs/sglang_shard_route.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from sglang_wheel import parse_with_sglang

from hpcrl.rollout.sglang_shard_loader import LOADER, tensor_request_body

HERE = Path(__file__).parent
UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"


def test_sglang_decodes_every_tp_ranks_control_and_the_loader_finds_sglangs_group(sglang_root, tmp_path):
    body = tensor_request_body({"group_name": "hpcrl_reshard", "deadline_s": 5}, engine_index=1, tp=4)
    (tmp_path / "body.json").write_text(json.dumps(body))
    out = subprocess.run([sys.executable, str(HERE / "_shard_loader_probe.py"), str(sglang_root),
                          str(tmp_path / "body.json"), "auto"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert [c["rollout_rank"] for c in got["controls"]] == [4, 5, 6, 7]
    assert got["found"] is True


def test_sglang_calls_the_custom_loader_with_model_and_own_rank_tensors(sglang_root):
    src = (sglang_root / "src" / UPDATER).read_text()
    assert "elif load_format in self.custom_weight_loaders:" in src
    assert "custom_loader = dynamic_import(load_format)" in src
    assert "custom_loader(self.get_model(), named_tensors)" in src
    assert "_unwrap_tensor(tensor, tp_rank=tp_rank, device=infered_device)" in src


def test_request_fields_exist_in_sglangs_request(sglang_root):
    src = (sglang_root / "src" / "sglang/srt/managers/io_struct.py").read_text()
    struct = src[src.index("class UpdateWeightsFromTensorReqInput"):]
    struct = struct[:struct.index("\nclass ")]
    fields = set(re.findall(r"^    (\w+):", struct, re.M))
    body = tensor_request_body({}, engine_index=0, tp=2, weight_version="1")
    assert set(body) <= fields, set(body) - fields


def test_launch_flag_parses(sglang_root, tmp_path):
    report = parse_with_sglang(sglang_root, [["--model-path", "/m", "--custom-weight-loader", LOADER]], tmp_path)
    assert report["results"][0]["custom_weight_loader"] == [LOADER]
