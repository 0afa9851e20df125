"""The reference engine on CUDA with an NCCL weight-update group: the check a GPU test machine
without network access can run (it cannot install SGLang). This process is rank 0 on its own GPU,
the engine gets the next GPU from hpcrl's placement (the same GPU, shared, on a one-GPU machine), a
flattened-bucket push of the tiny model's weights (bf16 and fp32 tensors mixed) arrives bit-exact
and the engine then answers with the pushed model's greedy tokens. Prints the push time and
bandwidth (record them in benchmarks/RESULTS.md when run). Skips on machines without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from hpcrl.models.presets import CONFIG_DIR, load_hf_config
from hpcrl.rollout.client import EngineClient, launch_reference_server
from hpcrl.rollout.engine import ReferenceModel
from hpcrl.rollout.hf_names import checkpoint_state_dict
from hpcrl.rollout.placement import node_plan
from hpcrl.rollout.weight_sender import WeightSender
from launch.procs import stop as stop_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
    pytest.mark.timeout(600),
]

CONFIG_PATH = CONFIG_DIR / "tiny-qwen3-moe.json"
PROMPTS = [[1, 5, 6, 7, 8], [1, 20, 21]]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def placed_engine(tmp_path_factory):
    """(this process's GPU, engine client, engine GPU): placement as a run does it for one trainer
    rank and one engine on this node; sharing only where the machine has a single GPU, and then, as
    a run with resources.share_gpus does (hpcrl.rollout.placement), each side with its own NCCL_HOSTID
    (the engine's inherited from the rank that starts it)."""
    import os

    from hpcrl.rollout.placement import share_gpu_host_id

    num_gpus = torch.cuda.device_count()
    share = num_gpus < 2
    plan = node_plan([(1, "trainer"), (2, "rollout")], 1, num_gpus, share=share)
    torch.cuda.set_device(plan[1][0])
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    before = os.environ.get("NCCL_HOSTID")
    if share:
        os.environ["NCCL_HOSTID"] = share_gpu_host_id("rank2")
    proc, url = launch_reference_server(str(CONFIG_PATH), f"cuda:{plan[2][0]}", 0, str(log), threads=1,
                                        startup_timeout_s=300)
    if share:  # read by NCCL when this process's communicator forms, after the engine started
        os.environ["NCCL_HOSTID"] = share_gpu_host_id("rank1")
    client = EngineClient(url, timeout_s=120)
    try:
        yield plan[1][0], client, plan[2][0]
    finally:
        client.close()
        stop_process(proc, 30)
        if before is None:
            os.environ.pop("NCCL_HOSTID", None)
        else:
            os.environ["NCCL_HOSTID"] = before


def test_nccl_push_into_reference_engine_on_cuda(placed_engine):
    gpu, client, engine_gpu = placed_engine
    local = ReferenceModel(load_hf_config("tiny-qwen3-moe", None), seed=321)
    named = [(n, t.to(torch.bfloat16) if i % 3 == 0 else t)
             for i, (n, t) in enumerate(checkpoint_state_dict(local.model).items())]
    local.load_weights(named)
    sender = WeightSender([client], backend="nccl", timeout_s=120)
    sender.connect()
    try:
        sender.push(named, bucket_bytes=1 << 20, flattened=True, weight_version="warm-up")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sent = sender.push(named, bucket_bytes=1 << 20, flattened=True, weight_version="v1")
        push_s = time.perf_counter() - t0
    finally:
        sender.close()
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    got = torch.tensor(client.get_weights_by_name(name, truncate_size=16))
    torch.testing.assert_close(got, local.get_weight(name)[:16].float(), atol=0, rtol=0)
    answers = client.generate(PROMPTS, [GREEDY] * len(PROMPTS), return_logprob=True)
    expected = local.generate(PROMPTS, [GREEDY] * len(PROMPTS))
    assert [a["output_ids"] for a in answers] == [e["output_ids"] for e in expected]
    assert answers[0]["meta_info"]["weight_version"] == "v1"
    print(f"nccl push: trainer GPU {gpu} -> engine GPU {engine_gpu}, {sent / 1e6:.2f} MB in "
          f"{push_s * 1e3:.1f} ms ({sent / push_s / 1e9:.2f} GB/s, tiny model: latency-bound)")
