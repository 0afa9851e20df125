"""Subprocess side of test_shard_loader.py: hpcrl's shard-loader request through SGLang's own code.

    python _shard_loader_probe.py ROOT BODY_JSON INIT

Imports sglang.srt.utils.common from the wheel (missing dependencies stubbed, _sglang_import.py),
decodes this TP rank's entry of the body the way SGLang's tokenizer manager and TP worker do
(`normalize_serialized_named_tensor_payloads`, `MultiprocessingSerializer.deserialize`, its
SafeUnpickler), moves each tensor as `_unwrap_tensor` does, makes a one-rank weight-update group with
SGLang's `init_custom_process_group` and checks that hpcrl's loader finds it by name. Prints JSON.
"""

from __future__ import annotations

import base64
import datetime
import json
import sys
from pathlib import Path


def main(root: str, body_file: str, init: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from _sglang_import import install

    install(Path(root))
    # pybase64 (not installed here) is the stdlib's base64 with SIMD: same functions, same results
    sys.modules["pybase64"] = base64
    from sglang.srt.utils.common import (MultiprocessingSerializer, init_custom_process_group,
                                         normalize_serialized_named_tensor_payloads)

    from hpcrl.rollout.sglang_shard_loader import find_group, parse_control

    body = json.loads(Path(body_file).read_text())
    payloads = normalize_serialized_named_tensor_payloads(body["serialized_named_tensors"])
    controls = []
    for tp_rank in range(len(payloads)):  # TpModelWorker.deserialize_own_rank, on each TP rank
        named = MultiprocessingSerializer.deserialize(payloads[tp_rank])
        named = [(name, t.to("cpu")) for name, t in named]  # weight_updater._unwrap_tensor
        controls.append(parse_control(named))
    if init == "auto":  # bound right away by SGLang's rank 0: the shortest window to lose the port in
        from hpcrl.dist import free_port

        init = f"tcp://127.0.0.1:{free_port()}"
    group = init_custom_process_group(backend="gloo", init_method=init, world_size=1, rank=0,
                                      group_name=controls[0]["group_name"],
                                      timeout=datetime.timedelta(seconds=60))
    print(json.dumps({"controls": controls, "found": find_group(controls[0]["group_name"]) is group}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
