"""HF checkpoint names <-> Megatron-core local parameter names and slices, for MoE decoders.

Pure tensor bookkeeping (no torch.distributed, no hpcrl): given a HuggingFace config.json dict
(Qwen3-MoE, Mixtral, DeepSeek-V3 or DeepSeek-V2) and one rank's coordinates in a Megatron layout
(TP/PP/EP/ETP), say which global box of which HF *checkpoint-named* tensor each entry of that rank's
Megatron state dict holds. From that one table follow `hf_to_megatron` (full HF tensors -> one rank's shards) and
`megatron_to_hf` (the shards of all ranks -> full HF tensors), and the resharding engine can plan
transfers from the same `Piece`s.

Megatron layout facts used here (megatron-core 0.16.1, local layer spec, SequentialMLP experts):
  * `linear_qkv` [ng*(nq/ng+2)*hd, H] is grouped by query group: for each KV group g the rows are
    (the nq/ng query heads of g, the key head g, the value head g). TP splits whole groups (dim 0).
  * `linear_fc1` of a GLU expert is [gate; up]; under ETP each rank holds [gate_r; up_r].
  * `linear_qkv`, `linear_fc1`, word embeddings and `output_layer` split along dim 0;
    `linear_proj` and `linear_fc2` along dim 1; norms and the router are replicated.
  * Local expert j on EP rank p is global expert p * E/ep + j; under PP the layer index in names
    is local to the stage (stage s holds layers [s*L/pp, (s+1)*L/pp)).

Shape legend: V vocab, H hidden, L layers, E experts, I expert FFN size, hd head dim,
nq query heads, ng KV heads (query groups).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe.slices import Box

if TYPE_CHECKING:
    import torch  # the tensor functions import it when called: config validation stays torch-free

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2")
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
"""config.json model types that are another family's architecture under their own name. Kimi-K2
(moonshotai/Kimi-K2-*) is DeepseekV3ForCausalLM with model_type kimi_k2, which transformers does not
know: SGLang 0.5.23 registers it as a DeepseekV3Config (utils/hf_transformers/common.py), and so
does hpcrl."""
MODEL_TYPES = (*FAMILIES, *MODEL_TYPE_ALIASES)
SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
             "n_routed_experts", "num_experts_per_tok", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
"""config.json keys that are sizes: positive integers when present (int() would take "64" or 64.5)."""


def is_size(value: object) -> bool:
    """Whether a config.json value is a size: a positive integer (not a bool, a string or a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def family_of(model_type: str | None) -> str | None:
    """The family a config.json model_type is built as (kimi_k2 -> deepseek_v3); None when unknown."""
    model_type = MODEL_TYPE_ALIASES.get(model_type or "", model_type)
    return model_type if model_type in FAMILIES else None


HF_DEFAULTS: dict[str, dict[str, object]] = {
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "tie_word_embeddings": False},
    "mixtral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False},
    "deepseek_v3": {"q_lora_rank": 1536, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                    "rope_interleave": True},
    "deepseek_v2": {"q_lora_rank": 1536, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
                    "n_shared_experts": 2, "norm_topk_prob": False, "topk_method": "greedy", "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 2048, "tie_word_embeddings": False},
}
"""What transformers' config class of each family (Qwen3MoeConfig, MixtralConfig, DeepseekV3Config,
DeepseekV2Config) puts in place of a key config.json leaves out, for the keys hpcrl reads. The engines
(SGLang, the reference engine) build their models through those classes, so the trainer and the specs
must read a trimmed config.json as they do: a missing routed_scaling_factor is 2.5 there, not 1.0
(tests/unit/test_hf_defaults.py pins the table to the installed transformers)."""


def with_hf_defaults(cfg: Mapping) -> dict:
    """`cfg` with the keys it leaves out filled as transformers fills them (HF_DEFAULTS); as it is for
    an unknown model_type. An explicit null stays null (q_lora_rank: null is no q LoRA)."""
    family = family_of(cfg.get("model_type"))
    return {**HF_DEFAULTS.get(family or "", {}), **cfg}


def transformers_model_type(model_type: str) -> str:
    """The model_type transformers' AutoConfig builds `model_type` as (kimi_k2: deepseek_v3)."""
    return MODEL_TYPE_ALIASES.get(model_type, model_type)


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass(frozen=True, slots=True)
class MLADims:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank query (None: a plain q_proj, as in
    DeepSeek-V2-Lite) and key-value projections, per-head no-position and RoPE parts."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class HFModelDims:
    """The dimensions of a Qwen3-MoE / Mixtral / DeepSeek-V3 / DeepSeek-V2 decoder, read from its HF
    config.json dict.

    DeepSeek-V3 (also Moonlight, model_type deepseek_v3, and Kimi-K2, model_type kimi_k2: `family`
    is deepseek_v3 for all) adds `mla`, `first_dense_layers` dense SwiGLU layers of `dense_ffn_size`
    before the MoE layers, a shared expert of `shared_ffn_size` per MoE layer, and a sigmoid router
    with a score-correction bias, group-limited top-k and `routed_scaling_factor`; `mtp_layers` MTP
    layers sit after the decoder on disk (`model.layers.{num_layers + k}.*`), which the trainer does
    not build (export copies them). DeepSeek-V2 (family deepseek_v2, e.g. DeepSeek-V2-Lite) is the
    same decoder with another router: softmax scores over all experts, top-k without renormalising
    (`norm_topk_prob` false), times `routed_scaling_factor`, no bias (`expert_bias` false), no groups.
    The trainer builds the router from `score_function`, `norm_topk_prob`, `expert_bias` and the
    groups, not from the family name.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_ffn_size: int
    qk_norm: bool
    norm_topk_prob: bool
    tied_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    mla: MLADims | None = None
    first_dense_layers: int = 0
    dense_ffn_size: int = 0
    shared_ffn_size: int = 0
    score_function: str = "softmax"
    expert_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float | None = None
    yarn: tuple[tuple[str, float], ...] | None = None
    mtp_layers: int = 0

    @staticmethod
    def from_hf_config(cfg: Mapping) -> HFModelDims:
        """Parse and validate a config dict; unsupported features raise ValueError naming the key.
        Keys it leaves out are read as transformers reads them (`with_hf_defaults`)."""
        cfg = with_hf_defaults(cfg)
        family = family_of(cfg.get("model_type"))
        if family is None:
            raise ValueError(f"config.json model_type={cfg.get('model_type')!r} is not supported; "
                             f"valid: {MODEL_TYPES}")
        for key in SIZE_KEYS:
            value = cfg.get(key)
            if value is not None and not is_size(value):
                raise ValueError(f"config.json {key}={value!r}: expected a positive integer")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act={cfg['hidden_act']!r}; "
                             "only 'silu' (SwiGLU) is supported")
        if cfg.get("attention_bias", False):
            raise ValueError("config.json attention_bias=true is not supported; use a bias-free model")
        if family in ("deepseek_v3", "deepseek_v2"):
            return _deepseek_dims(cfg, family)
        rope = cfg.get("rope_parameters") or {}
        if (rope_type := rope.get("rope_type", "default")) != "default" or cfg.get("rope_scaling"):
            raise ValueError(f"config.json rope_type={rope_type!r} / rope_scaling is not supported; "
                             "only plain RoPE ('default')")
        theta = _rope_theta(cfg)
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        window = cfg.get("sliding_window")
        if (cfg.get("use_sliding_window", family == "mixtral") and window is not None
                and window < max_pos):
            raise ValueError(f"config.json sliding_window={window} < max_position_embeddings={max_pos}: "
                             "sliding-window attention is not supported; set sliding_window to null")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        if family == "qwen3_moe":
            if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
                raise ValueError("config.json decoder_sparse_step != 1 or non-empty mlp_only_layers: "
                                 "dense MLP layers are not supported (every layer must be MoE)")
            # transformers 5.x writes Qwen3-MoE's expert count as num_local_experts; hub files say num_experts
            num_experts = int(cfg["num_local_experts"] if "num_experts" not in cfg and "num_local_experts" in cfg
                              else cfg["num_experts"])
            ffn = int(cfg["moe_intermediate_size"])
            norm_topk = bool(cfg.get("norm_topk_prob", False))
        else:
            num_experts, ffn = int(cfg["num_local_experts"]), int(cfg["intermediate_size"])
            norm_topk = True  # Mixtral always renormalises the top-k softmax weights
        return HFModelDims(
            family=family, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            num_experts=num_experts, top_k=int(cfg["num_experts_per_tok"]), moe_ffn_size=ffn,
            qk_norm=family == "qwen3_moe", norm_topk_prob=norm_topk,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            max_position_embeddings=max_pos)

    @property
    def moe_layers(self) -> range:
        """The decoder layers with routed experts (the others are dense SwiGLU MLPs)."""
        return range(self.first_dense_layers, self.num_layers)

    def num_params(self) -> int:
        """Parameters of the model: its HF tensors (`hf_shapes`; moe.specs' MoESpec.total_params counts
        the same)."""
        return sum(math.prod(shape) for shape in self.hf_shapes().values())

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF checkpoint tensor name the trainer holds -> global shape, in sorted name order
        (DeepSeek-V3's MTP layers are not among them)."""
        H, hd = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, H),
                                              "model.norm.weight": (H,)}
        if not self.tied_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, H)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (H,)
            shapes[p + "post_attention_layernorm.weight"] = (H,)
            if self.mla is not None:
                shapes.update(_mla_shapes(self, p + "self_attn."))
            else:
                shapes[p + "self_attn.q_proj.weight"] = (self.num_heads * hd, H)
                shapes[p + "self_attn.k_proj.weight"] = (self.num_kv_heads * hd, H)
                shapes[p + "self_attn.v_proj.weight"] = (self.num_kv_heads * hd, H)
                shapes[p + "self_attn.o_proj.weight"] = (H, self.num_heads * hd)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (hd,)
            if i < self.first_dense_layers:
                for gate_up in ("gate_proj", "up_proj"):
                    shapes[f"{p}mlp.{gate_up}.weight"] = (self.dense_ffn_size, H)
                shapes[p + "mlp.down_proj.weight"] = (H, self.dense_ffn_size)
                continue
            shapes[router_name(self, i)] = (self.num_experts, H)
            if self.expert_bias:
                shapes[router_bias_name(i)] = (self.num_experts,)
            if self.shared_ffn_size:
                for gate_up in ("gate_proj", "up_proj"):
                    shapes[f"{p}mlp.shared_experts.{gate_up}.weight"] = (self.shared_ffn_size, H)
                shapes[p + "mlp.shared_experts.down_proj.weight"] = (H, self.shared_ffn_size)
            for e in range(self.num_experts):
                gate, up, down = expert_names(self, i, e)
                shapes[gate] = shapes[up] = (self.moe_ffn_size, H)
                shapes[down] = (H, self.moe_ffn_size)
        return dict(sorted(shapes.items()))


def _rope_theta(cfg: Mapping) -> float:
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def _yarn(cfg: Mapping, family: str) -> tuple[tuple[str, float], ...] | None:
    """DeepSeek's YaRN parameters (from rope_scaling, or transformers 5.x's rope_parameters), None
    for plain RoPE; other scalings raise ValueError."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"config.json rope_scaling type={kind!r} is not supported for {family}; "
                         "valid: yarn, or no rope_scaling (plain RoPE)")
    if "factor" not in rope:
        raise ValueError("config.json rope_scaling (yarn) lacks 'factor'")
    if "attention_factor" in rope:
        raise ValueError(f"config.json rope_scaling attention_factor={rope['attention_factor']!r} is not supported "
                         "for yarn: transformers takes it as the attention scale, SGLang and Megatron derive theirs "
                         "from mscale and mscale_all_dim; remove it (DeepSeek's and Kimi's configs have none)")
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (m and m_all) and (m not in (None, 1, 1.0) or m_all not in (None, 0, 0.0)):
        # transformers scales by mscale / mscale_all_dim only when both are set, else as if mscale 1;
        # SGLang and Megatron always by mscale / mscale_all_dim (defaults 1 and 0)
        raise ValueError(f"config.json rope_scaling mscale={m!r}, mscale_all_dim={m_all!r}: give both (as "
                         "DeepSeek's configs do) or neither; with one of them transformers and SGLang scale the "
                         "attention differently")
    defaults = {"original_max_position_embeddings": cfg.get("max_position_embeddings", 4096), "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    return tuple((k, float(rope.get(k, defaults.get(k)))) for k in YARN_KEYS)


def _deepseek_dims(cfg: Mapping, family: str) -> HFModelDims:
    """DeepSeek-V3 / Kimi-K2 / Moonlight (family deepseek_v3) and DeepSeek-V2 (deepseek_v2): what
    transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM compute, refusing what the Megatron
    model cannot compute the same way (each error names the key and the fix). The two share MLA, YaRN,
    the dense first layers and the shared experts; they differ in the router (`_deepseek_v3_router`,
    `_deepseek_v2_router`) and in V2's RoPE, always DeepSeek's interleaved layout (transformers' V2
    rotates complex pairs and reads no rope_interleave)."""
    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"config.json {key}={cfg.get(key)!r}: {why}")

    if family == "deepseek_v3" and not cfg.get("rope_interleave", True):
        raise bad("rope_interleave", "only DeepSeek's interleaved RoPE layout (true, the default) is supported")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise bad("moe_layer_freq", "only 1 (every layer after first_k_dense_replace is MoE) is supported")
    experts, top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    router = (_deepseek_v3_router if family == "deepseek_v3" else _deepseek_v2_router)(cfg, bad, experts, top_k)
    if cfg.get("first_k_dense_replace", 0) > int(cfg["num_hidden_layers"]):
        raise bad("first_k_dense_replace", f"exceeds num_hidden_layers={cfg['num_hidden_layers']}")
    q_lora = cfg.get("q_lora_rank")
    mla = MLADims(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(cfg["kv_lora_rank"]),
                  qk_nope_dim=int(cfg["qk_nope_head_dim"]), qk_rope_dim=int(cfg["qk_rope_head_dim"]),
                  v_head_dim=int(cfg["v_head_dim"]))
    heads = int(cfg["num_attention_heads"])
    moe_ffn = int(cfg["moe_intermediate_size"])
    scaling = cfg.get("routed_scaling_factor", 1.0)
    return HFModelDims(
        family=family, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads,
        head_dim=mla.qk_nope_dim + mla.qk_rope_dim, num_experts=experts, top_k=top_k, moe_ffn_size=moe_ffn,
        qk_norm=False, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), mla=mla,
        first_dense_layers=int(cfg.get("first_k_dense_replace", 0)), dense_ffn_size=int(cfg["intermediate_size"]),
        shared_ffn_size=moe_ffn * int(cfg.get("n_shared_experts") or 0),
        routed_scaling_factor=None if scaling in (None, 1.0) else float(scaling), yarn=_yarn(cfg, family),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0), **router)


def _deepseek_v3_router(cfg: Mapping, bad: Callable[[str, str], ValueError], experts: int, top_k: int) -> dict:
    """HFModelDims' router fields of DeepSeek-V3's router: sigmoid scores plus the score-correction
    bias pick the top-k within the best groups; the chosen sigmoid scores are renormalised."""
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise bad("scoring_func", f"(topk_method={cfg.get('topk_method')!r}): deepseek_v3 routes with "
                                  "sigmoid scores and the score-correction bias ('sigmoid', 'noaux_tc')")
    if not cfg.get("norm_topk_prob", True):
        raise bad("norm_topk_prob", "Megatron always renormalises sigmoid top-k weights; only true is supported")
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if top_k < 2:
        raise bad("num_experts_per_tok", "top-1 sigmoid routing is not renormalised by Megatron; use >= 2")
    if experts % n_group:
        raise bad("n_group", f"must divide n_routed_experts={experts}")
    if not 1 <= topk_group <= n_group:
        raise bad("topk_group", f"must be between 1 and n_group={n_group}")
    if topk_group == n_group:  # every group kept: plain top-k, whatever ranks the groups
        n_group = topk_group = 1
    if n_group > 1 and top_k // topk_group != 2:
        # DeepSeek scores a group by the sum of its top-2 experts; Megatron by its top (top_k // topk_group).
        raise bad("num_experts_per_tok", f"with n_group={n_group} > 1, num_experts_per_tok // topk_group must "
                                         f"be 2 (DeepSeek's group score sums each group's top-2 experts, "
                                         f"Megatron's its top num_experts_per_tok // topk_group)")
    return {"score_function": "sigmoid", "norm_topk_prob": True, "expert_bias": True, "n_group": n_group,
            "topk_group": topk_group}


def _deepseek_v2_router(cfg: Mapping, bad: Callable[[str, str], ValueError], experts: int, top_k: int) -> dict:
    """HFModelDims' router fields of DeepSeek-V2's router (transformers' DeepseekV2TopkRouter): softmax
    over all experts in fp32, the top-k of those probabilities without renormalising, times
    routed_scaling_factor; Megatron's pre-softmax top-k with its scaling factor computes the same.
    V2's topk_method 'group_limited_greedy' first keeps the topk_group groups whose BEST expert scores
    highest; Megatron ranks groups by the sum of their top num_experts_per_tok // topk_group experts,
    so only the cases where no group is dropped (n_group 1, or topk_group == n_group: greedy) pass."""
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise bad("scoring_func", "deepseek_v2 routes with softmax scores over all experts (transformers' "
                                  "DeepseekV2TopkRouter); only 'softmax' is supported")
    if cfg.get("norm_topk_prob", False):
        raise bad("norm_topk_prob", "transformers' DeepSeek-V2 router never renormalises its top-k weights, "
                                    "so a model trained with it computes something else; set it to false")
    method = cfg.get("topk_method", "greedy")
    if method == "group_limited_greedy":
        n_group, topk_group = cfg.get("n_group"), cfg.get("topk_group")
        if not (is_size(n_group) and is_size(topk_group)):
            raise bad("n_group", f"topk_method 'group_limited_greedy' needs n_group and topk_group (now "
                                 f"{topk_group!r}) as positive integers; or use topk_method 'greedy'")
        if n_group != 1 and topk_group != n_group:
            raise bad("topk_method", f"with n_group={n_group}, topk_group={topk_group}: DeepSeek-V2 keeps "
                                     "the groups whose best expert scores highest, and Megatron's group-limited "
                                     "top-k ranks a group by the sum of its top num_experts_per_tok // "
                                     "topk_group experts instead; only 'greedy' (DeepSeek-V2-Lite), or "
                                     "'group_limited_greedy' with n_group 1 or topk_group == n_group (no group "
                                     "dropped: greedy) is supported")
    elif method != "greedy":
        raise bad("topk_method", "deepseek_v2 supports 'greedy' (DeepSeek-V2-Lite), or 'group_limited_greedy' "
                                 "with n_group 1 or topk_group == n_group")
    return {"score_function": "softmax", "norm_topk_prob": False, "expert_bias": False, "n_group": 1, "topk_group": 1}


def _mla_shapes(dims: HFModelDims, p: str) -> dict[str, tuple[int, ...]]:
    """The MLA projections of one layer (prefix `p` = `model.layers.{i}.self_attn.`)."""
    m, H, n = dims.mla, dims.hidden_size, dims.num_heads
    assert m is not None
    q_out = n * (m.qk_nope_dim + m.qk_rope_dim)
    shapes = {p + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_dim, H),
              p + "kv_a_layernorm.weight": (m.kv_lora_rank,),
              p + "kv_b_proj.weight": (n * (m.qk_nope_dim + m.v_head_dim), m.kv_lora_rank),
              p + "o_proj.weight": (H, n * m.v_head_dim)}
    if m.q_lora_rank is None:
        shapes[p + "q_proj.weight"] = (q_out, H)
    else:
        shapes.update({p + "q_a_proj.weight": (m.q_lora_rank, H), p + "q_a_layernorm.weight": (m.q_lora_rank,),
                       p + "q_b_proj.weight": (q_out, m.q_lora_rank)})
    return shapes


def router_bias_name(layer: int) -> str:
    """DeepSeek-V3's score-correction bias of one MoE layer (a buffer: not trained, kept as loaded)."""
    return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"


def mtp_names(names: Iterable[str], num_layers: int, num_mtp_layers: int) -> list[str]:
    """The names among `names` that belong to DeepSeek's multi-token-prediction layers, which follow
    the decoder on disk: `model.layers.{num_layers + k}.*` for k < num_mtp_layers (config.json's
    num_hidden_layers and num_nextn_predict_layers). A layer index past them is not an MTP layer."""
    out = []
    for name in names:
        m = _LAYER_RE.match(name)
        if m is not None and num_layers <= int(m.group(1)) < num_layers + num_mtp_layers:
            out.append(name)
    return out


def layers_past(names: Iterable[str], num_layers: int) -> list[int]:
    """The layer indices >= num_layers that `names` hold (`model.layers.{i}.*`), sorted; [] when one
    of `names` is not a layer tensor or belongs to a decoder layer below num_layers."""
    past = set()
    for name in names:
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) < num_layers:
            return []
        past.add(int(m.group(1)))
    return sorted(past)


def is_router_bias(name: str) -> bool:
    """Whether `name` is a DeepSeek-V3 router bias: float32 in checkpoints, in the trainer and in
    SGLang whatever the model's dtype, so it moves (sync, export) in float32."""
    return name.endswith(".mlp.gate.e_score_correction_bias")


def router_name(dims: HFModelDims, layer: int) -> str:
    block = "block_sparse_moe" if dims.family == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def expert_names(dims: HFModelDims, layer: int, expert: int) -> tuple[str, str, str]:
    """The (gate, up, down) checkpoint names of one expert."""
    if dims.family != "mixtral":
        p = f"model.layers.{layer}.mlp.experts.{expert}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"
    p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    return p + "w1.weight", p + "w3.weight", p + "w2.weight"


@dataclass(frozen=True, slots=True)
class RankCoords:
    """One rank's position in a Megatron layout (ranks and sizes of the TP, PP, EP, ETP axes)."""

    tp_rank: int = 0
    tp: int = 1
    pp_rank: int = 0
    pp: int = 1
    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1
    first_stage_layers: int = 0
    """Decoder layers of the first / last pipeline stage (Megatron's num_layers_in_{first,last}_
    pipeline_stage); 0: an even split (`stage_ranges`)."""
    last_stage_layers: int = 0

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "ep", "etp"):
            size, rank = getattr(self, axis), getattr(self, axis + "_rank")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"RankCoords {axis}={size}, {axis}_rank={rank}: need 0 <= rank < size")

    def check(self, dims: HFModelDims) -> None:
        """Raise ValueError when the model does not split evenly over this layout."""
        splits = [("num_attention_heads", dims.num_heads, "tp", self.tp),
                  ("num_key_value_heads", dims.num_kv_heads, "tp", self.tp),
                  ("vocab_size", dims.vocab_size, "tp", self.tp),
                  ("num_experts", dims.num_experts, "ep", self.ep),
                  ("moe_intermediate_size", dims.moe_ffn_size, "etp", self.etp)]
        if dims.mla is not None:
            splits += [("intermediate_size", dims.dense_ffn_size, "tp", self.tp),
                       ("moe_intermediate_size * n_shared_experts", dims.shared_ffn_size, "tp", self.tp)]
        stage_ranges(dims.num_layers, self.pp, self.first_stage_layers, self.last_stage_layers)
        for what, n, axis, size in splits:
            if n % size:
                raise ValueError(f"model {what}={n} is not divisible by {axis}={size}; "
                                 f"choose a {axis} that divides {n}")


@dataclass(frozen=True, slots=True)
class Piece:
    """`local[local_box]` of one Megatron tensor is `hf[hf_name][hf_box]`."""

    hf_name: str
    hf_box: Box
    local_box: Box


@dataclass(frozen=True, slots=True)
class LocalParam:
    """One entry of a rank's Megatron state dict: its name, local shape and HF pieces."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def stage_ranges(num_layers: int, pp: int, first: int = 0, last: int = 0) -> list[range]:
    """The decoder layers of each of `pp` pipeline stages as Megatron splits them: `first` / `last`
    layers on the first / last stage when given (> 0), the rest evenly over the other stages.
    Raises ValueError naming the trainer keys when they do not split."""
    fixed = [n for n in (first, last) if n and pp > 1]
    middle, rest = pp - len(fixed), num_layers - sum(fixed)
    if rest < 0 or (middle == 0 and rest) or (middle and (rest % middle or rest // middle == 0)):
        raise ValueError(
            f"model num_hidden_layers={num_layers} does not split over pp={pp} stages with "
            f"trainer.first_stage_layers={first}, trainer.last_stage_layers={last}; choose a pp that "
            f"divides {num_layers}, or first/last_stage_layers that leave each other stage the same count")
    sizes = [rest // middle if middle else 0] * pp
    if first and pp > 1:
        sizes[0] = first
    if last and pp > 1:
        sizes[-1] = last
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [range(start, start + n) for start, n in zip(starts, sizes)]


def layer_range(dims: HFModelDims, coords: RankCoords) -> range:
    """The global decoder layers held by this rank's pipeline stage."""
    return stage_ranges(dims.num_layers, coords.pp, coords.first_stage_layers,
                        coords.last_stage_layers)[coords.pp_rank]


def _whole(name: str, hf_name: str, shape: tuple[int, ...]) -> LocalParam:
    return LocalParam(name, shape, (Piece(hf_name, Box.full(shape), Box.full(shape)),))


def _split(name: str, hf_name: str, global_shape: tuple[int, ...], axis: int, parts: int,
           index: int) -> LocalParam:
    hf_box = Box.full(global_shape).split(axis, parts, index)
    return LocalParam(name, hf_box.shape, (Piece(hf_name, hf_box, Box.full(hf_box.shape)),))


def _gqa_params(dims: HFModelDims, coords: RankCoords, hp: str, mp: str) -> list[LocalParam]:
    """Grouped-query attention of one layer: fused linear_qkv (grouped by KV group), q/k norms, linear_proj."""
    H, hd, tp, r = dims.hidden_size, dims.head_dim, coords.tp, coords.tp_rank
    heads_per_group = dims.num_heads // dims.num_kv_heads
    groups_local = dims.num_kv_heads // tp
    rows_per_group = (heads_per_group + 2) * hd
    qkv: list[Piece] = []
    for g in range(groups_local):
        gg, off = r * groups_local + g, g * rows_per_group
        nq = heads_per_group * hd
        for hf, hf_off, local_off, n in (("q_proj", gg * nq, off, nq), ("k_proj", gg * hd, off + nq, hd),
                                        ("v_proj", gg * hd, off + nq + hd, hd)):
            qkv.append(Piece(f"{hp}self_attn.{hf}.weight", Box((hf_off, 0), (n, H)), Box((local_off, 0), (n, H))))
    out = [LocalParam(mp + "self_attention.linear_qkv.weight", (groups_local * rows_per_group, H), tuple(qkv))]
    if dims.qk_norm:
        for qk in ("q", "k"):
            out.append(_whole(f"{mp}self_attention.{qk}_layernorm.weight", f"{hp}self_attn.{qk}_norm.weight", (hd,)))
    out.append(_split(mp + "self_attention.linear_proj.weight", hp + "self_attn.o_proj.weight",
                      (H, dims.num_heads * hd), 1, tp, r))
    return out


def _mla_params(dims: HFModelDims, coords: RankCoords, hp: str, mp: str) -> list[LocalParam]:
    """Multi-latent attention of one layer. Megatron's MLA keeps HF's row orders (per head
    [nope, rope] in q and [k nope, v] in kv_up; [kv latent, k rope] in kv_down) and de-interleaves
    the RoPE dims itself, as transformers does with rope_interleave; the up projections (and a plain
    q_proj) split their rows (heads) over TP, linear_proj its columns; the down projections and the
    two latent norms are replicated (hpcrl.trainer.mla_attention says why)."""
    shapes = _mla_shapes(dims, hp + "self_attn.")
    tp, r = coords.tp, coords.tp_rank
    a, m = hp + "self_attn.", mp + "self_attention."
    rows = [("linear_kv_up_proj", "kv_b_proj")]
    whole = [("linear_kv_down_proj", "kv_a_proj_with_mqa")]
    if dims.mla.q_lora_rank is None:
        rows.append(("linear_q_proj", "q_proj"))
    else:
        rows.append(("linear_q_up_proj", "q_b_proj"))
        whole.append(("linear_q_down_proj", "q_a_proj"))
    out = [_split(f"{m}{mg}.weight", f"{a}{hf}.weight", shapes[f"{a}{hf}.weight"], 0, tp, r) for mg, hf in rows]
    out += [_whole(f"{m}{mg}.weight", f"{a}{hf}.weight", shapes[f"{a}{hf}.weight"]) for mg, hf in whole]
    out.append(_whole(m + "kv_layernorm.weight", a + "kv_a_layernorm.weight", shapes[a + "kv_a_layernorm.weight"]))
    if dims.mla.q_lora_rank is not None:
        out.append(_whole(m + "q_layernorm.weight", a + "q_a_layernorm.weight", shapes[a + "q_a_layernorm.weight"]))
    out.append(_split(m + "linear_proj.weight", a + "o_proj.weight", shapes[a + "o_proj.weight"], 1, tp, r))
    return out


def _swiglu_params(mp: str, hp: str, ffn: int, H: int, tp: int, r: int) -> list[LocalParam]:
    """A TP-split SwiGLU MLP (dense layer or shared expert): linear_fc1 = [gate_r; up_r], linear_fc2."""
    rows, local = Box((r * (ffn // tp), 0), (ffn // tp, H)), ffn // tp
    return [LocalParam(mp + "linear_fc1.weight", (2 * local, H),
                       (Piece(hp + "gate_proj.weight", rows, Box((0, 0), (local, H))),
                        Piece(hp + "up_proj.weight", rows, Box((local, 0), (local, H))))),
            _split(mp + "linear_fc2.weight", hp + "down_proj.weight", (H, ffn), 1, tp, r)]


def local_params(dims: HFModelDims, coords: RankCoords) -> list[LocalParam]:
    """Every weight of this rank's Megatron state dict (no `_extra_state`), in a fixed order."""
    coords.check(dims)
    V, H, tp, r = dims.vocab_size, dims.hidden_size, coords.tp, coords.tp_rank
    first, last = coords.pp_rank == 0, coords.pp_rank == coords.pp - 1
    out: list[LocalParam] = []
    if first:
        out.append(_split("embedding.word_embeddings.weight", "model.embed_tokens.weight", (V, H), 0, tp, r))
    E_local, I_local = dims.num_experts // coords.ep, dims.moe_ffn_size // coords.etp
    for li, i in enumerate(layer_range(dims, coords)):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{li}."
        out.append(_whole(mp + "input_layernorm.weight", hp + "input_layernorm.weight", (H,)))
        out += _mla_params(dims, coords, hp, mp) if dims.mla is not None else _gqa_params(dims, coords, hp, mp)
        out.append(_whole(mp + "pre_mlp_layernorm.weight", hp + "post_attention_layernorm.weight", (H,)))
        if i < dims.first_dense_layers:
            out += _swiglu_params(mp + "mlp.", hp + "mlp.", dims.dense_ffn_size, H, tp, r)
            continue
        out.append(_whole(mp + "mlp.router.weight", router_name(dims, i), (dims.num_experts, H)))
        if dims.expert_bias:
            out.append(_whole(mp + "mlp.router.expert_bias", router_bias_name(i), (dims.num_experts,)))
        if dims.shared_ffn_size:
            out += _swiglu_params(mp + "mlp.shared_experts.", hp + "mlp.shared_experts.", dims.shared_ffn_size,
                                  H, tp, r)
        for j in range(E_local):
            gate, up, down = expert_names(dims, i, coords.ep_rank * E_local + j)
            ep = f"{mp}mlp.experts.local_experts.{j}."
            rows = Box((coords.etp_rank * I_local, 0), (I_local, H))
            out.append(LocalParam(ep + "linear_fc1.weight", (2 * I_local, H), (
                Piece(gate, rows, Box((0, 0), (I_local, H))),
                Piece(up, rows, Box((I_local, 0), (I_local, H))))))
            out.append(_split(ep + "linear_fc2.weight", down, (H, dims.moe_ffn_size), 1, coords.etp,
                              coords.etp_rank))
    if last:
        out.append(_whole("decoder.final_layernorm.weight", "model.norm.weight", (H,)))
        # Tied embeddings: Megatron keeps no output weight on a single stage (it reuses the
        # embedding); with PP the last stage holds a synchronised copy of the embedding.
        if not dims.tied_embeddings:
            out.append(_split("output_layer.weight", "lm_head.weight", (V, H), 0, tp, r))
        elif coords.pp > 1:
            out.append(_split("output_layer.weight", "model.embed_tokens.weight", (V, H), 0, tp, r))
    return out


def hf_to_megatron(hf_sd: Mapping[str, torch.Tensor], dims: HFModelDims,
                   coords: RankCoords) -> dict[str, torch.Tensor]:
    """This rank's Megatron local state dict cut from full HF checkpoint-named tensors.

    Raises KeyError naming a missing HF tensor and ValueError for a shape mismatch.
    """
    import torch

    shapes = dims.hf_shapes()
    for name, shape in shapes.items():
        if name not in hf_sd:
            raise KeyError(f"HF state dict lacks {name!r} (expected shape {shape})")
        if tuple(hf_sd[name].shape) != shape:
            raise ValueError(f"HF tensor {name!r} has shape {tuple(hf_sd[name].shape)}, expected {shape}")
    out: dict[str, torch.Tensor] = {}
    for p in local_params(dims, coords):
        dtype = hf_sd[p.pieces[0].hf_name].dtype
        local = torch.empty(p.shape, dtype=dtype)
        for pc in p.pieces:
            local[pc.local_box.index] = hf_sd[pc.hf_name][pc.hf_box.index]
        out[p.name] = local
    return out


def megatron_to_hf(shards: Iterable[tuple[RankCoords, Mapping[str, torch.Tensor]]],
                   dims: HFModelDims) -> dict[str, torch.Tensor]:
    """Full HF checkpoint-named tensors (sorted by name) assembled from the shards of all ranks.

    Replicated pieces may appear several times (TP/DP replicas); the first one seen wins. Raises
    ValueError when some region of some HF tensor is held by no shard.
    """
    import torch

    shapes = dims.hf_shapes()
    out: dict[str, torch.Tensor] = {}
    seen: dict[str, set[Box]] = {name: set() for name in shapes}
    for coords, sd in shards:
        for p in local_params(dims, coords):
            if p.name not in sd:
                continue
            local = sd[p.name]
            assert tuple(local.shape) == p.shape, (p.name, tuple(local.shape), p.shape)
            for pc in p.pieces:
                if pc.hf_box in seen[pc.hf_name]:
                    continue
                seen[pc.hf_name].add(pc.hf_box)
                full = out.get(pc.hf_name)
                if full is None:
                    full = out[pc.hf_name] = torch.empty(shapes[pc.hf_name], dtype=local.dtype)
                full[pc.hf_box.index] = local[pc.local_box.index]
    for name, shape in shapes.items():
        covered = sum(b.numel for b in seen[name])
        total = Box.full(shape).numel
        if covered != total:
            raise ValueError(f"shards cover {covered} of {total} elements of {name!r}; "
                             "pass the shards of every TP/PP/EP/ETP rank")
    return dict(sorted(out.items()))


def hf_fused_to_checkpoint(sd: Mapping[str, torch.Tensor], dims: HFModelDims) -> dict[str, torch.Tensor]:
    """transformers 5.x in-memory names (fused 3-D experts) -> on-disk checkpoint names, sorted.

    In memory both families hold `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] (gate rows
    first) and `...mlp.experts.down_proj` [E, H, I] and the router at `...mlp.gate.weight`; on
    disk (and in SGLang's loader) experts are separate 2-D tensors. Tied embeddings drop
    `lm_head.weight` (as `save_pretrained` does). Returns views, not copies.
    """
    out = dict(sd)
    if dims.tied_embeddings:
        out.pop("lm_head.weight", None)
    I = dims.moe_ffn_size
    for i in dims.moe_layers:
        p = f"model.layers.{i}.mlp."
        gate_up_EFH, down_EHI = out.pop(p + "experts.gate_up_proj"), out.pop(p + "experts.down_proj")
        out[router_name(dims, i)] = out.pop(p + "gate.weight")
        for e in range(dims.num_experts):
            gate, up, down = expert_names(dims, i, e)
            out[gate], out[up], out[down] = gate_up_EFH[e, :I], gate_up_EFH[e, I:], down_EHI[e]
    return dict(sorted(out.items()))


def hf_checkpoint_to_fused(sd: Mapping[str, torch.Tensor], dims: HFModelDims) -> dict[str, torch.Tensor]:
    """The inverse of `hf_fused_to_checkpoint` (stacks the per-expert tensors into new tensors;
    tied embeddings get `lm_head.weight` back as the embedding)."""
    import torch

    out = dict(sd)
    if dims.tied_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    for i in dims.moe_layers:
        p = f"model.layers.{i}.mlp."
        gates, downs = [], []
        for e in range(dims.num_experts):
            gate, up, down = expert_names(dims, i, e)
            gates.append(torch.cat([out.pop(gate), out.pop(up)], dim=0))
            downs.append(out.pop(down))
        out[p + "experts.gate_up_proj"] = torch.stack(gates)
        out[p + "experts.down_proj"] = torch.stack(downs)
        out[p + "gate.weight"] = out.pop(router_name(dims, i))
    return out
