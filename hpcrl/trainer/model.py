"""Megatron-core GPTModel (MoE) for a HuggingFace Qwen3-MoE / Mixtral / DeepSeek config and a parallel layout.

`transformer_config` translates the HF config.json dict plus the trainer layout into a
`TransformerConfig` that computes what HF's implementation computes: RMSNorm with the HF eps, q/k
RMSNorm over the head dim (Qwen3), non-interleaved RoPE with the HF theta, grouped-query
attention, a softmax router (top-k logits then softmax == HF's renormalised top-k softmax when
`norm_topk_prob`; softmax then top-k otherwise), SwiGLU experts, no biases, no dropout. Every
fusion is off (they need CUDA kernels). Parameters are fp32, or bf16 with `dtype="bfloat16"` (Megatron's
mixed precision: the policy trains them through Float16Module with fp32 main parameters,
hpcrl/trainer/policy.py `ddp_and_adam`). `build_gpt_model` builds the
module of this rank's pipeline stage with Megatron's own random init, which the policy then
overwrites with HF weights (`MegatronPolicy.init_from_seed` / `load_hf_state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moe.hf_megatron import HFModelDims, RankCoords, family_of, transformers_model_type

DISPATCHERS = ("alltoall", "allgather")
PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""`model.dtype` -> the Megatron parameter dtype the trainer builds."""


def check_layout(hf_config: Mapping, *, tp: int, pp: int, ep: int, etp: int, dispatcher: str,
                 device: str = "cpu", first_stage_layers: int = 0, last_stage_layers: int = 0) -> None:
    """Raise ValueError (naming the trainer field) for a layout this trainer cannot run."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"trainer.dispatcher={dispatcher!r}; valid: {', '.join(DISPATCHERS)}")
    if dispatcher == "alltoall" and etp > 1 and device == "cpu":
        # gloo cannot all_gather tensors of unequal size, which the alltoall path does under ETP.
        raise ValueError("trainer.dispatcher='alltoall' with trainer.etp > 1 fails on gloo (uneven "
                         "all_gather); use etp=1 or dispatcher='allgather' on CPU")
    if ep == 1 and etp != tp:
        # With EP=1 Megatron treats expert weights as dense params and reduces their grads over
        # the dense DP group, which is wrong when ETP != TP (replicas see different tokens).
        raise ValueError(f"trainer.ep=1 needs trainer.etp == trainer.tp (got etp={etp}, tp={tp}); "
                         "set etp to tp, or use ep > 1")
    dims = HFModelDims.from_hf_config(hf_config)
    if dims.tied_embeddings and pp > 1 and device == "cpu":
        # language_module.py:244 moves the shared embedding copy with Tensor.cuda().
        raise ValueError("tie_word_embeddings=true with trainer.pp > 1 is not supported on CPU; use pp=1")
    RankCoords(tp=tp, pp=pp, ep=ep, etp=etp, first_stage_layers=first_stage_layers,
               last_stage_layers=last_stage_layers).check(dims)


DEFAULT_ROUTER_AUX_LOSS_COEF = 0.001
"""transformers' router_aux_loss_coef of Qwen3MoeConfig and MixtralConfig, for a config.json without one."""


def aux_loss_coef_of(hf_config: Mapping, aux_loss_coef: float | None) -> float:
    """The batch-wise load-balancing loss coefficient the trainer uses: `aux_loss_coef`
    (algorithm.aux_loss_coef) when set, else the model's own. Qwen3-MoE and Mixtral train with that
    loss at config.json's router_aux_loss_coef (mbridge, verl's HF-to-Megatron bridge, reads the same
    key, though most of its bridges then set the balancing type to none for RL). DeepSeek-V3 balances
    with its score-correction bias; its hub config's sequence-wise loss (aux_loss_alpha with seq_aux)
    is not built here and transformers' config drops it: 0. DeepSeek-V2 likewise: 0 (its hub config's
    aux_loss_alpha with seq_aux is that same unbuilt sequence-wise loss, and it has no
    router_aux_loss_coef whose default would stand in for it); algorithm.aux_loss_coef turns
    Megatron's batch-wise loss on for either."""
    if aux_loss_coef is not None:
        return float(aux_loss_coef)
    if family_of(hf_config.get("model_type")) in ("deepseek_v3", "deepseek_v2"):  # as HFModelDims validates
        return 0.0
    return float(hf_config.get("router_aux_loss_coef", DEFAULT_ROUTER_AUX_LOSS_COEF))


def transformer_config(hf_config: Mapping, *, tp: int, pp: int, ep: int, etp: int, dispatcher: str,
                       aux_loss_coef: float, device: str = "cpu", dtype: str = "float32",
                       first_stage_layers: int = 0, last_stage_layers: int = 0,
                       routing_replay: bool = False, recompute: Recompute | None = None,
                       variable_seq_lengths: bool = False):  # -> TransformerConfig
    """The TransformerConfig of `hf_config` under the layout (tp, pp, ep, etp), with parameters
    of `dtype` ("float32" or "bfloat16"; the router and softmax compute in fp32 either way), and
    `recompute`'s activation recomputation in training forwards (none by default).
    `variable_seq_lengths`: micro-batches of several shapes (pipeline stages exchange each one's shape).

    Sequence parallelism is on whenever tp > 1 (Megatron requires it for MoE with TP).
    Raises ValueError for an unknown dispatcher or a model that does not split over the layout.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_layout(hf_config, tp=tp, pp=pp, ep=ep, etp=etp, dispatcher=dispatcher, device=device,
                 first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"model.dtype={dtype!r}; valid: {', '.join(PARAM_DTYPES)}")
    params_dtype = PARAM_DTYPES[dtype]
    dims = HFModelDims.from_hf_config(hf_config)
    config_class, family_kwargs = ((MLATransformerConfig, _deepseek_kwargs(dims)) if dims.mla
                                   else (TransformerConfig, {}))
    kwargs = dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.moe_ffn_size,
        normalization="RMSNorm",
        layernorm_epsilon=dims.rms_norm_eps,
        qk_layernorm=dims.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE
        num_moe_experts=dims.num_experts,
        moe_ffn_hidden_size=dims.moe_ffn_size,
        moe_router_topk=dims.top_k,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not dims.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=aux_loss_coef,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        # layout
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=first_stage_layers or None if pp > 1 else None,
        num_layers_in_last_pipeline_stage=last_stage_layers or None if pp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
        # numerics: fp32 or bf16 params (bf16: fp32 softmax, router and main params), every CUDA fusion off
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        moe_router_dtype="fp32" if params_dtype == torch.bfloat16 else None,
        use_cpu_initialization=device == "cpu",
        # The init functions also set the `tensor_model_parallel` attributes that the grad-norm
        # dedup reads; without them TP shards count as replicas. The values are overwritten.
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    kwargs.update(family_kwargs)
    # every router gets a RouterReplay (hpcrl/trainer/routing_replay.py); only the policy replays
    kwargs["moe_enable_routing_replay"] = routing_replay
    kwargs.update((recompute or Recompute()).megatron_kwargs())
    kwargs["variable_seq_lengths"] = variable_seq_lengths
    return config_class(**kwargs)


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation (trainer.recompute_*, Megatron's names): granularity none | full |
    selective; full: `method` uniform | block over `num_layers`; selective: `modules`."""

    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1
    modules: tuple[str, ...] = ("core_attn",)

    @classmethod
    def of(cls, trainer: Any) -> Recompute:
        """trainer.recompute_* of a TrainerConfig."""
        return cls(trainer.recompute_granularity, trainer.recompute_method, trainer.recompute_num_layers,
                   tuple(trainer.recompute_modules))

    def megatron_kwargs(self) -> dict:
        """The TransformerConfig fields: Megatron takes method and num_layers with full only."""
        if self.granularity == "none":
            return {"recompute_granularity": None}
        if self.granularity == "full":
            return {"recompute_granularity": "full", "recompute_method": self.method,
                    "recompute_num_layers": self.num_layers}
        return {"recompute_granularity": "selective", "recompute_modules": list(self.modules)}


def _deepseek_kwargs(dims: HFModelDims) -> dict:
    """TransformerConfig fields of DeepSeek-V3 / V2 on top of the shared ones: MLA with its latent norms
    (`qk_layernorm` builds them), YaRN or plain RoPE (MLA's softmax scale takes the YaRN mscale only
    when the scaling factor is > 1), dense first layers, a shared expert, and the router the dims
    describe, times the routed scaling factor: V3's sigmoid scores with a frozen score-correction bias
    (update rate 0), group-limited top-k and renormalised weights; V2's softmax over all experts then
    top-k, not renormalised (pre-softmax), no bias, no groups."""
    mla, yarn = dims.mla, dict(dims.yarn or ())
    rope = ({"rope_type": "yarn", "rotary_scaling_factor": yarn["factor"],
             "original_max_position_embeddings": int(yarn["original_max_position_embeddings"]),
             "beta_fast": yarn["beta_fast"], "beta_slow": yarn["beta_slow"], "mscale": yarn["mscale"],
             "mscale_all_dim": yarn["mscale_all_dim"]} if yarn else
            {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0})
    return dict(
        q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_dim,
        qk_pos_emb_head_dim=mla.qk_rope_dim, v_head_dim=mla.v_head_dim, qk_layernorm=True,
        rotary_base=dims.rope_theta, **rope,
        ffn_hidden_size=dims.dense_ffn_size,
        moe_layer_freq=[0] * dims.first_dense_layers + [1] * (dims.num_layers - dims.first_dense_layers),
        moe_shared_expert_intermediate_size=dims.shared_ffn_size or None,
        moe_router_score_function=dims.score_function,
        moe_router_pre_softmax=dims.score_function == "softmax" and not dims.norm_topk_prob,
        moe_router_enable_expert_bias=dims.expert_bias, moe_router_bias_update_rate=0.0,
        moe_router_num_groups=dims.n_group if dims.n_group > 1 else None,
        moe_router_group_topk=dims.topk_group if dims.n_group > 1 else None,
        moe_router_topk_scaling_factor=dims.routed_scaling_factor)


def build_gpt_model(hf_config: Mapping, config) -> torch.nn.Module:  # config: TransformerConfig
    """This rank's pipeline stage of the GPTModel (call after initialize_model_parallel)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    dims = HFModelDims.from_hf_config(hf_config)
    if dims.mla is not None:  # dense and MoE layers, MLA: Megatron's block spec, with the TE-free core attention
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from hpcrl.trainer.mla_attention import mla_layer_spec

        spec = mla_layer_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                         normalization="RMSNorm"))
    else:
        spec = get_gpt_layer_local_spec(num_experts=dims.num_experts, moe_grouped_gemm=False,
                                        qk_layernorm=dims.qk_norm, normalization="RMSNorm")
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=dims.vocab_size,
        max_sequence_length=dims.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=dims.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=dims.rope_theta,
    )
    # Norms without TE are torch modules made in fp32 whatever params_dtype says; a bf16 model is
    # bf16 throughout (Float16Module would convert the policy's; the reference's too, here).
    if not config.use_cpu_initialization:
        # Torch norms (no TE) and MLA's duplicated down projections are made on the CPU; on a GPU
        # the fp32 model's first forward stopped there (RuntimeError: weight is on cpu; H200, dev/LOG.md).
        gpt.cuda(torch.cuda.current_device())
    return keep_expert_bias_fp32(gpt.bfloat16()) if config.bf16 else gpt


EXPERT_BIAS = "router.expert_bias"
"""Megatron's name (suffix) of DeepSeek-V3's score-correction bias: a buffer, not a parameter."""


def keep_expert_bias_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its routers' expert-bias buffers back in fp32 after a `.bfloat16()` (Megatron's
    router computes in fp32 and keeps the bias so; HF checkpoints store it in fp32). Returns `module`."""
    for name, buf in module.named_buffers():
        if name.endswith(EXPERT_BIAS) and buf.dtype != torch.float32:
            buf.data = buf.data.float()
    return module


def weight_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor `moe.hf_megatron.local_params` names, by Megatron name: the parameters plus the
    routers' frozen expert-bias buffers (DeepSeek-V3), which load, checkpoint, sync and export as
    weights but never train."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    out.update((name, buf) for name, buf in module.named_buffers() if name.endswith(EXPERT_BIAS))
    return out


def build_hf_model(hf_config: Mapping, seed: int) -> torch.nn.Module:
    """The HF transformers model of `hf_config` (fp32, CPU, eval mode) with weights drawn from
    `seed`, leaving the global RNG state untouched. For tiny models: it allocates the full model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in hf_config.items() if k != "model_type"}
    conf = AutoConfig.for_model(transformers_model_type(hf_config["model_type"]), **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    return model.eval()
