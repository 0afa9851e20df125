"""resources.share_gpus on CUDA gives each rank process its own NCCL_HOSTID: NCCL refuses two ranks of a
communicator on one GPU ("Duplicate GPU detected", seen on an H200 with a trainer rank and its engine on
GPU 0; dev/LOG.md), and distinct host ids make it connect them over its network transport. The GPU
check itself is tests/gpu/ (run on a lent GPU machine without the check script's own workaround)."""

from __future__ import annotations

from types import SimpleNamespace

from hpcrl.rollout.placement import set_shared_gpu_host, share_gpu_host_id


def job(share: bool, device: str) -> SimpleNamespace:
    return SimpleNamespace(resources=SimpleNamespace(share_gpus=share, device=device))


def test_each_rank_of_a_shared_gpu_run_gets_its_own_nccl_host_id():
    envs = [{}, {}]
    assert all(set_shared_gpu_host(job(True, "cuda"), f"rank{r}", env) for r, env in enumerate(envs))
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert envs[1]["NCCL_HOSTID"] == share_gpu_host_id("rank1")


def test_nothing_changes_without_shared_gpus_or_when_the_user_set_one():
    for share, device in ((False, "cuda"), (True, "cpu")):
        env: dict[str, str] = {}
        assert not set_shared_gpu_host(job(share, device), "rank1", env) and env == {}
    env = {"NCCL_HOSTID": "mine"}
    assert not set_shared_gpu_host(job(True, "cuda"), "rank1", env) and env == {"NCCL_HOSTID": "mine"}
