"""The weight syncs move each tensor at the dtype moe.specs gives it (the engines and the reshard plans
size their buffers by it): the run's dtype, but DeepSeek-V3's router bias in float32 (as checkpoints,
the trainer and SGLang keep it). Built from a tiny-deepseek-v3 rank's shards under a bf16 run."""

from __future__ import annotations

import torch

from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.reshard_route import spec_at_dtype
from hpcrl.trainer.shard_sync import LocalHFShards
from moe.hf_megatron import HFModelDims, RankCoords, local_params


def test_local_shards_take_the_specs_dtypes_bias_in_float32():
    cfg = load_hf_config("tiny-deepseek-v3", None)
    dims = HFModelDims.from_hf_config(cfg)
    coords = RankCoords(tp=2, tp_rank=1, ep=2, ep_rank=0)
    params = {lp.name: torch.ones(lp.shape, dtype=torch.float32 if lp.name.endswith("expert_bias")
                                  else torch.bfloat16) for lp in local_params(dims, coords)}
    shards = LocalHFShards(params, dims, coords, torch.bfloat16).refresh()
    spec = {t.name: t.dtype for t in spec_at_dtype(cfg, "bfloat16").tensors}
    got = {name: str(t.dtype).removeprefix("torch.") for name, (_, t) in shards.items()}
    assert got == {name: spec[name] for name in got}
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert got["model.layers.1.mlp.gate.weight"] == "bfloat16"
