"""moe/hf_megatron.py: HF checkpoint tensors -> the Megatron shards of every rank -> HF is exact."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from moe.hf_megatron import (
    HFModelDims,
    RankCoords,
    hf_checkpoint_to_fused,
    hf_fused_to_checkpoint,
    hf_to_megatron,
    local_params,
    megatron_to_hf,
)

QWEN = json.loads((Path(__file__).parents[2] / "hpcrl/models/configs/tiny-qwen3-moe.json").read_text())
MIXTRAL = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "sliding_window": None,
           "max_position_embeddings": 128, "tie_word_embeddings": False}


def random_hf(dims: HFModelDims, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in dims.hf_shapes().items()}


def all_coords(tp: int, pp: int, ep: int, etp: int) -> list[RankCoords]:
    return [RankCoords(tp_rank=t, tp=tp, pp_rank=p, pp=pp, ep_rank=e, ep=ep, etp_rank=x, etp=etp)
            for t, p, e, x in itertools.product(range(tp), range(pp), range(ep), range(etp))]


LAYOUTS = [(tp, pp, ep, etp) for tp in (1, 2) for pp in (1, 2) for ep in (1, 2, 4) for etp in (1, 2)]


@pytest.mark.parametrize("cfg", [QWEN, MIXTRAL, {**QWEN, "tie_word_embeddings": True}],
                         ids=["qwen3", "mixtral", "qwen3-tied"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}-pp{}-ep{}-etp{}".format(*l))
def test_round_trip_is_bit_identical(cfg: dict, layout: tuple[int, int, int, int]) -> None:
    dims = HFModelDims.from_hf_config(cfg)
    hf = random_hf(dims)
    shards = [(c, hf_to_megatron(hf, dims, c)) for c in all_coords(*layout)]
    for c, sd in shards:
        assert list(sd) == [p.name for p in local_params(dims, c)]
    back = megatron_to_hf(shards, dims)
    assert list(back) == sorted(hf)
    for name, t in hf.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    # Every HF element is stored once per replica: shards of one (PP, EP) slot partition the data.
    numel = sum(t.numel() for _, sd in shards for t in sd.values())
    assert numel >= sum(t.numel() for t in hf.values())


def test_megatron_layout_of_qkv_fc1_and_experts() -> None:
    dims = HFModelDims.from_hf_config(QWEN)  # 4 heads, 2 KV groups, hd 16, 4 experts, I=32
    hf = random_hf(dims, seed=1)
    sd = hf_to_megatron(hf, dims, RankCoords(tp_rank=1, tp=2, ep_rank=1, ep=2, pp_rank=1, pp=2))
    p = "model.layers.1.self_attn."
    # TP rank 1 holds KV group 1: query heads 2,3 then key head 1 then value head 1.
    qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv, torch.cat([hf[p + "q_proj.weight"][32:64], hf[p + "k_proj.weight"][16:32],
                                       hf[p + "v_proj.weight"][16:32]]))
    assert torch.equal(sd["decoder.layers.0.self_attention.linear_proj.weight"],
                       hf[p + "o_proj.weight"][:, 32:])
    # EP rank 1 holds global experts 2, 3 as local 0, 1; fc1 = [gate; up].
    e = "model.layers.1.mlp.experts.3."
    assert torch.equal(sd["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"],
                       torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]]))
    assert torch.equal(sd["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf[e + "down_proj.weight"])
    assert torch.equal(sd["output_layer.weight"], hf["lm_head.weight"][32:])
    assert "embedding.word_embeddings.weight" not in sd
    # ETP 2: each rank holds [gate_r; up_r] rows and down_r columns.
    sd = hf_to_megatron(hf, dims, RankCoords(etp_rank=1, etp=2))
    e = "model.layers.0.mlp.experts.2."
    assert torch.equal(sd["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"],
                       torch.cat([hf[e + "gate_proj.weight"][16:], hf[e + "up_proj.weight"][16:]]))
    assert torch.equal(sd["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"],
                       hf[e + "down_proj.weight"][:, 16:])


def test_missing_shard_and_bad_input_raise() -> None:
    dims = HFModelDims.from_hf_config(QWEN)
    hf = random_hf(dims)
    shards = [(c, hf_to_megatron(hf, dims, c)) for c in all_coords(1, 1, 2, 1)]
    with pytest.raises(ValueError, match="cover"):
        megatron_to_hf(shards[:1], dims)
    with pytest.raises(KeyError, match="lm_head.weight"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, dims, RankCoords())
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep=3"):
        hf_to_megatron(hf, dims, RankCoords(ep=3))
    with pytest.raises(ValueError, match="model_type"):
        HFModelDims.from_hf_config({**QWEN, "model_type": "llama"})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        HFModelDims.from_hf_config({**QWEN, "mlp_only_layers": [0]})


@pytest.mark.parametrize("cfg", [QWEN, MIXTRAL, {**QWEN, "tie_word_embeddings": True}],
                         ids=["qwen3", "mixtral", "qwen3-tied"])
def test_fused_names_match_save_pretrained(cfg: dict, tmp_path: Path) -> None:
    """transformers' own on-disk names and values equal hf_fused_to_checkpoint's."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = HFModelDims.from_hf_config(cfg)
    torch.manual_seed(0)
    conf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(conf)
    model.save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    ours = hf_fused_to_checkpoint(model.state_dict(), dims)
    assert sorted(disk) == list(ours) == list(dims.hf_shapes())
    for name, t in disk.items():
        assert torch.equal(ours[name], t), name
    fused = hf_checkpoint_to_fused(ours, dims)
    for name, t in model.state_dict().items():
        assert torch.equal(fused[name], t), name
