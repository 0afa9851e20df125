"""A bf16 tiny-deepseek-v3 model directory with its MTP layer, laid out as the official DeepSeek-V3
release stores one (nothing is downloaded): what the MTP export tests start from.

    bf16_deepseek_dir(out, seed)    # config.json (dtype bfloat16); save_pretrained's shards with every
                                    # weight in bf16 and the router biases in float32; the MTP layer
                                    # (model.layers.{L}.*) in model-mtp.safetensors, named in the index
    load_dir(path)                  # every tensor of a directory, by name (tiny models only)
    add_shard(out, tensors, file)   # more tensors in a shard file of their own, named in the index
    kimi_k2_config()                # tiny-deepseek-v3 as Kimi-K2's config.json says it
    deepseek_v2_config()            # tiny-deepseek-v3 as DeepSeek-V2-Lite's config.json says it

transformers' save_pretrained writes no MTP tensors, so `mtp_tensors` draws them: for layer
L = num_hidden_layers, embed_tokens, enorm, hnorm, eh_proj [H, 2H], shared_head.norm and
shared_head.head, plus a whole MoE decoder layer under its checkpoint names (per-expert tensors,
router, float32 e_score_correction_bias), all random and non-zero. A float32 router bias drawn at
random is almost never a bf16 value, so an export that rounds it to bf16 changes its bits.
Importable from every test folder (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
MTP_FILE = "model-mtp.safetensors"


def kimi_k2_config() -> dict:
    """tiny-deepseek-v3 where moonshotai/Kimi-K2-Instruct's config.json differs from DeepSeek-V3's:
    model_type kimi_k2 with its auto_map (DeepSeek's modeling code), one expert group (n_group =
    topk_group = 1), YaRN with beta_fast = beta_slow = 1 (DeepSeek-V3: 32 and 1) and factor 32,
    routed_scaling_factor 2.827, no MTP layer."""
    from hpcrl.models.presets import load_hf_config

    cfg = load_hf_config("tiny-deepseek-v3", None)
    rope = {**cfg["rope_scaling"], "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0}
    return {**cfg, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1, "rope_scaling": rope,
            "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
            "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModel": "modeling_deepseek.DeepseekV3Model",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}


def deepseek_v2_config() -> dict:
    """tiny-deepseek-v3 where deepseek-ai/DeepSeek-V2-Lite's config.json differs from DeepSeek-V3's:
    model_type deepseek_v2, greedy softmax routing (topk_method greedy, scoring_func softmax,
    norm_topk_prob false, no e_score_correction_bias, one expert group), a plain q_proj (q_lora_rank
    null), YaRN with V2-Lite's mscale = mscale_all_dim = 0.707 (the attention's softmax scale takes
    mscale_all_dim's factor, the rotary none) and betas 32 / 1, no MTP layer. routed_scaling_factor is
    2.0 (V2-Lite's is 1.0) so that a router that drops the scaling computes something else."""
    from hpcrl.models.presets import load_hf_config

    cfg = load_hf_config("tiny-deepseek-v3", None)
    rope = {**cfg["rope_scaling"], "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    return {**cfg, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": 2.0, "q_lora_rank": None, "rope_scaling": rope,
            "num_nextn_predict_layers": 0}


def keeps_float32(name: str) -> bool:
    """Whether a DeepSeek-V3 checkpoint stores `name` in float32 in a bf16 release (router biases)."""
    return name.endswith(".mlp.gate.e_score_correction_bias")


def load_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors (index or single file), sorted by name."""
    from safetensors.torch import load_file

    d = Path(path)
    files = (sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values())) if (d / INDEX).is_file()
             else ["model.safetensors"])
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(d / f)))
    return dict(sorted(out.items()))


def mtp_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer of a DeepSeek-V3 config (see the module docstring), bf16 with float32 biases."""
    from moe.hf_megatron import HFModelDims

    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    shapes = {"embed_tokens.weight": (V, H), "enorm.weight": (H,), "hnorm.weight": (H,),
              "eh_proj.weight": (H, 2 * H), "shared_head.norm.weight": (H,),
              "shared_head.head.weight": (V, H)}
    last = f"model.layers.{L - 1}."  # a MoE layer: the MTP layer's decoder block has its tensors
    shapes |= {n[len(last):]: s for n, s in HFModelDims.from_hf_config(cfg).hf_shapes().items()
               if n.startswith(last)}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        full = f"model.layers.{L}.{name}"
        t = 0.3 * torch.randn(shape, generator=g) + 0.05
        out[full] = t if keeps_float32(full) else t.to(torch.bfloat16)
    return out


def add_shard(out: Path, tensors: dict[str, torch.Tensor], file: str) -> None:
    """Write `tensors` into the safetensors file `file` of the directory `out` and name them in its
    index (weight map sorted, total_size grown), as a sharded download has them."""
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / file), metadata={"format": "pt"})
    index = json.loads((out / INDEX).read_text())
    index["weight_map"] = dict(sorted({**index["weight_map"], **{n: file for n in tensors}}.items()))
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def bf16_deepseek_dir(out: Path, seed: int, max_shard_size: str = "150KB") -> Path:
    """The tiny-deepseek-v3 preset saved by save_pretrained (weights perturbed by 0.3 * N(0, 1): norms
    and router biases are not their 1 / 0 init), cast to bf16 except the float32 router biases,
    with config.json's dtype bfloat16 and the MTP layer added in a file of its own. Returns `out`."""
    from hf_fixtures import model_dir
    from safetensors.torch import load_file, save_file

    from hpcrl.models.presets import load_hf_config

    cfg = load_hf_config("tiny-deepseek-v3", None)
    model_dir(out, config=cfg, seed=seed, tokenizer=False, max_shard_size=max_shard_size, perturb=0.3)
    index = json.loads((out / INDEX).read_text())
    total = 0
    for f in sorted(set(index["weight_map"].values())):
        tensors = {n: t if keeps_float32(n) or not t.is_floating_point() else t.to(torch.bfloat16)
                   for n, t in load_file(str(out / f)).items()}
        save_file(tensors, str(out / f), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index["metadata"]["total_size"] = total
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    add_shard(out, mtp_tensors(cfg, seed + 1), MTP_FILE)
    written = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k != "torch_dtype"}
    (out / "config.json").write_text(json.dumps({**written, "dtype": "bfloat16"}, indent=2) + "\n")
    return out
