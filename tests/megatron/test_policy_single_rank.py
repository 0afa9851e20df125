"""MegatronPolicy on one rank, in process: the Megatron model computes what HF transformers computes
(Qwen3-MoE and Mixtral, arbitrary weights), gradient accumulation equals one big batch, grad
clipping works on CPU, bad input raises clear errors.

Megatron and HF (or two micro-batchings) sum in other orders: log-probs are compared within
numerics.logprob_bound of logit_bound (n = the config's longest reduction, 1 + 7 L reductions,
max|logit|), after checking that no router near-tie lies within the bound (`hf_forward`); a train
step's metrics, grad norm and weights by the chains they end (D reductions forward, D + 1 back, Adam
with eps = lr). Computations that are the same ops on the same inputs are compared bit for bit.
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch
from numerics import (U_FP32, forward_depth, hf_routing, logit_bound, logprob_bound, longest_reduction,
                      reordered)


pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

MIXTRAL = {"model_type": "mixtral", "vocab_size": 48, "hidden_size": 32, "intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1e6, "sliding_window": None,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def world1():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def qwen_config() -> dict:
    from hpcrl.models.presets import load_hf_config

    return load_hf_config("tiny-qwen3-moe", None)


def deepseek_config(q_lora: bool = True) -> dict:
    """tiny-deepseek-v3 (MLA with q_lora, YaRN, 1 dense + 2 MoE layers, 8 routed + 1 shared expert,
    4 groups, top-2 groups, top-4); without q_lora: DeepSeek-V2-Lite's plain q_proj and plain RoPE."""
    from hpcrl.models.presets import load_hf_config

    cfg = load_hf_config("tiny-deepseek-v3", None)
    if not q_lora:
        cfg = {**cfg, "q_lora_rank": None}
        cfg.pop("rope_scaling")
    return cfg


def make_policy(hf_config: dict, **algo):  # -> MegatronPolicy
    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.trainer.policy import MegatronPolicy

    trainer_kw = {k: algo.pop(k) for k in list(algo)
                  if k in ("micro_batch_size", "max_tokens_per_micro_batch", "logprob_micro_batch_size")
                  or k.startswith("recompute_")}
    replay = algo.pop("routing_replay", "none")
    return MegatronPolicy(hf_config, TrainerConfig(**trainer_kw), AlgorithmConfig(**algo), routing_replay=replay)


def random_batch(vocab: int, rows: int = 8, seed: int = 0):  # -> TrainBatch
    from hpcrl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    responses = [torch.randint(1, vocab, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(rows)]
    responses[0] = responses[0] or [1]
    return TrainBatch.from_lists(prompts, responses)


def perturbed_hf(hf_config: dict, seed: int) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """Checkpoint-named weights with every tensor (norms included) randomised, and the HF model
    holding them."""
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import HFModelDims, hf_checkpoint_to_fused, hf_fused_to_checkpoint

    dims = HFModelDims.from_hf_config(hf_config)
    model = build_hf_model(hf_config, seed)
    g = torch.Generator().manual_seed(seed)
    sd = {k: (v + 0.1 * torch.randn(v.shape, generator=g)).contiguous()
          for k, v in hf_fused_to_checkpoint(model.state_dict(), dims).items()}
    model.load_state_dict(hf_checkpoint_to_fused(sd, dims))
    return sd, model


def hf_forward(model: torch.nn.Module, batch) -> torch.Tensor:
    """HF's logits [B, L, V] of the batch, after checking that every real token's routing is clear of
    near-ties within the rounding bound: another evaluation (Megatron's) then routes it alike."""
    out, ratio = hf_routing(model, batch)
    assert ratio > 1, f"a router near-tie within the rounding bound ({ratio:.2f}): use other inputs"
    return out.logits.float()


def hf_logprobs(model: torch.nn.Module, batch, temperature: float = 1.0) -> tuple[torch.Tensor, float]:
    """HF's log-probs of the response tokens [B, T] (0 on padding), and how far another evaluation's
    may lie from them (logprob_bound of logit_bound)."""
    logits_BLV = hf_forward(model, batch)
    cfg = model.config.to_dict()
    apart = logit_bound(cfg, logits_BLV.abs().max().item(), batch.seq_len)
    return response_logprobs(logits_BLV, batch, temperature), logprob_bound(apart, cfg["vocab_size"], temperature)


def response_logprobs(logits_BLV: torch.Tensor, batch, temperature: float = 1.0) -> torch.Tensor:
    """The response tokens' log-probs [B, T] under `logits_BLV` at `temperature` (0 on padding)."""
    logp_BLV = torch.log_softmax(logits_BLV / temperature, dim=-1)
    pos_BT = batch.logit_positions_BT()
    logp_BTV = logp_BLV.gather(1, pos_BT.unsqueeze(-1).expand(-1, -1, logp_BLV.shape[-1]))
    logp_BT = logp_BTV.gather(2, batch.response_tokens_BT().unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.response_mask_BT(), logp_BT, 0.0)


def assert_logprobs_close(ours: torch.Tensor, model: torch.nn.Module, batch, temperature: float = 1.0
                          ) -> None:
    want, bound = hf_logprobs(model, batch, temperature)
    diff = (ours - want).abs().max().item()
    assert diff <= bound, f"log-probs {diff:.3g} from HF's > bound {bound:.3g}"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_moe-tied", "deepseek_v3",
                                    "deepseek_v3-no-q-lora", "kimi_k2", "deepseek_v2", "deepseek_v3-every-group"])
def test_megatron_matches_hf_on_arbitrary_weights(world1, family: str) -> None:
    """kimi_k2: Kimi-K2's config (one expert group, its YaRN betas) computed by transformers'
    DeepseekV3ForCausalLM, the model SGLang 0.5.23 builds for model_type kimi_k2. deepseek_v2:
    DeepSeek-V2-Lite's config (greedy softmax top-k, not renormalised, routed_scaling_factor 2.0, no
    q_lora, YaRN with mscale_all_dim 0.707) computed by transformers' DeepseekV2ForCausalLM;
    test_deepseek_v2_bound_sees_a_renormalising_router shows the bound tells its router from V3's
    weighting. deepseek_v3-every-group: n_group groups all kept (topk_group = n_group) is plain top-k."""
    from deepseek_dirs import deepseek_v2_config, kimi_k2_config

    cfg = {"qwen3_moe": qwen_config(), "mixtral": MIXTRAL,
           "qwen3_moe-tied": {**qwen_config(), "tie_word_embeddings": True},
           "deepseek_v3": deepseek_config(), "deepseek_v3-no-q-lora": deepseek_config(q_lora=False),
           "kimi_k2": kimi_k2_config(), "deepseek_v2": deepseek_v2_config(),
           # top-2 from 4 groups, all 4 kept: plain top-k (was refused: 2 // topk_group is not 2)
           "deepseek_v3-every-group": {**deepseek_config(), "topk_group": 4, "num_experts_per_tok": 2}}[family]
    policy = make_policy(cfg, kl_coef=0.1)
    sd, model = perturbed_hf(cfg, seed=4)
    policy.load_hf_state_dict(sd, model="both")
    # Inputs whose routing is clear of near-ties (hf_forward checks it): batch seed 1 puts one of
    # kimi_k2's ungrouped top-4 choices within the rounding bound, and one of deepseek_v2's at its
    # MLA depths (ratio 0.68; seed 5: 5.4).
    batch = random_batch(cfg["vocab_size"], rows=6, seed={"kimi_k2": 2, "deepseek_v2": 5}.get(family, 1))
    if family == "deepseek_v2":
        assert hf_routing(model, batch)[1] > 1.5, "a router near-tie within the rounding bound"
        c = policy.gpt.config  # softmax over all experts, then top-k, times routed_scaling_factor
        assert (c.moe_router_score_function, c.moe_router_pre_softmax, c.moe_router_enable_expert_bias,
                c.moe_router_num_groups, c.moe_router_topk_scaling_factor) == ("softmax", True, False, None, 2.0)
    for temperature in (1.0, 0.6):
        ours = policy.compute_logprobs(batch, temperature=temperature)
        assert_logprobs_close(ours, model, batch, temperature)
    assert torch.equal(policy.compute_logprobs(batch, "ref"), policy.compute_logprobs(batch))
    exported = policy.export_hf_state_dict()
    assert list(exported) == sorted(sd)
    assert all(torch.equal(exported[k], sd[k]) for k in sd)


def test_deepseek_v2_bound_sees_a_renormalising_router(monkeypatch) -> None:
    """The deepseek_v2 case of test_megatron_matches_hf_on_arbitrary_weights would fail for a router
    that weighs the chosen experts otherwise: transformers' DeepSeek-V2 with its top-k weights
    renormalised (V3's rule, and Megatron's softmax after top-k), or without routed_scaling_factor,
    moves a log-prob by more than 10x that test's bound. The bound: logprob_bound of logit_bound,
    2 * (2 n u D max|logit|) with n = 96 (the dense FFN), u = 2^-24, D = 1 + 10 * 3 = 31 and
    max|logit| ~ 2.7: about 2e-3. The top-4 of 8 softmax weights sum to 0.61-0.93 here, so
    renormalising scales the routed experts' output by 1.1-1.6x, and dropping the factor 2.0 halves
    it: log-probs move by about 0.2 and 0.28, some 100x the bound."""
    from deepseek_dirs import deepseek_v2_config
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2

    cfg = deepseek_v2_config()
    _, model = perturbed_hf(cfg, seed=4)
    batch = random_batch(cfg["vocab_size"], rows=6, seed=5)
    want, bound = hf_logprobs(model, batch)
    forward = v2.DeepseekV2TopkRouter.forward

    def renormalised(self, hidden_states):
        logits, weights, indices = forward(self, hidden_states)
        return logits, weights / weights.sum(-1, keepdim=True) * self.routed_scaling_factor, indices

    def unscaled(self, hidden_states):
        logits, weights, indices = forward(self, hidden_states)
        return logits, weights / self.routed_scaling_factor, indices

    for mutation in (renormalised, unscaled):
        monkeypatch.setattr(v2.DeepseekV2TopkRouter, "forward", mutation)
        with torch.no_grad():  # no near-tie check: the mutated model may route otherwise, which counts too
            got = response_logprobs(model(batch.tokens_BL).logits.float(), batch)
        assert (got - want).abs().max().item() > 10 * bound, mutation.__name__
    monkeypatch.undo()
    assert torch.equal(hf_logprobs(model, batch)[0], want)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_trainer_reads_a_model_directory_as_transformers_does(world1, tmp_path, family: str) -> None:
    """Mixtral from transformers 5.x's fused expert files, Qwen3-MoE from per-expert files (with the
    `num_local_experts` key transformers now writes): the trainer's log-probs equal
    `from_pretrained(dir)`'s, and the policy hash is that of the directory's checkpoint-named tensors."""
    import json

    from hf_fixtures import model_dir
    from transformers import AutoModelForCausalLM

    from moe.digest import state_dict_digest
    from moe.hf_checkpoint import HFCheckpoint
    from moe.hf_megatron import HFModelDims

    path = model_dir(tmp_path / family, family, seed=9, fused=family == "mixtral", tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    policy = make_policy(cfg, kl_coef=0.1)
    policy.load_hf_dir(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    batch = random_batch(cfg["vocab_size"], rows=6, seed=2)
    assert_logprobs_close(policy.compute_logprobs(batch), model, batch)
    assert torch.equal(policy.compute_logprobs(batch, "ref"), policy.compute_logprobs(batch))
    with HFCheckpoint(path, HFModelDims.from_hf_config(cfg)) as ckpt:
        assert policy.policy_sha256() == state_dict_digest({n: ckpt.read(n) for n in ckpt.expected})


def hf_model_of(policy) -> torch.nn.Module:
    """HF transformers' model holding the policy's current weights."""
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import HFModelDims, hf_checkpoint_to_fused

    model = build_hf_model(policy.hf_config, 0)
    model.load_state_dict(hf_checkpoint_to_fused(policy.export_hf_state_dict(),
                                                 HFModelDims.from_hf_config(policy.hf_config)))
    return model


@pytest.mark.parametrize("split", [dict(micro_batch_size=3),
                                   dict(micro_batch_size=8, max_tokens_per_micro_batch=16)])
def test_micro_batches_give_the_same_step_as_one_batch(world1, split: dict) -> None:
    """8 rows in one micro-batch vs 3 micro-batches of 3 (one dummy pad row), or vs micro-batches of at
    most 16 tokens, each padded to its own longest row (trainer.max_tokens_per_micro_batch: rows sorted
    by length: 6 micro-batches of 1 or 2 rows, of lengths 11, 10, 9, 7, 6 and 2 here): the same update, up to the order of
    the sums (other GEMM shapes). Adam's eps = lr makes the update Lipschitz in the
    gradient (lr * g / (|g| + lr) on the first step, slope <= 1): with eps << |g| it is lr * sign(g),
    and rounding noise in a gradient near zero would flip a weight's step, which no bound covers."""
    cfg = qwen_config()
    algo = dict(aux_loss_coef=0.0, loss_agg="seq-mean-token-mean", lr=1e-2, adam_eps=1e-2)
    big, small = make_policy(cfg, micro_batch_size=8, **algo), make_policy(cfg, **split, **algo)
    big.init_from_seed(2)
    small.init_from_seed(2)
    batch = random_batch(64, rows=8, seed=3)
    if "max_tokens_per_micro_batch" in split:
        micro = small._plan(batch).ranks[0]
        assert len(micro) > 1 and len({m.seq_len for m in micro}) > 1 and max(len(m.rows) for m in micro) > 1
    logp = big.compute_logprobs(batch)
    _, bound = hf_logprobs(hf_model_of(big), batch)  # also: no router near-tie
    assert (logp - small.compute_logprobs(batch)).abs().max().item() <= bound
    adv = torch.randn(8, generator=torch.Generator().manual_seed(0))
    m_big, m_small = big.train_step(batch, adv, logp), small.train_step(batch, adv, logp)
    # D reductions to a log-prob (the log-sum-exp too), and as many back to each gradient; n: the
    # longest reduction or the batch's positions. Metrics are means over tokens of functions of
    # log-probs with slope <= 1 + max|log p| (entropy's: 2 H <= 2 log V); grad_norm: per-tensor norms.
    D = forward_depth(cfg["num_hidden_layers"]) + 1
    n = max(longest_reduction(cfg, batch.seq_len), batch.batch_size * batch.seq_len)
    slope = 1 + logp.abs().max().item()
    numel = max(p.numel() for p in big.gpt.parameters())
    for key in ("loss", "pg_loss", "entropy"):
        assert abs(m_big[key] - m_small[key]) <= slope * reordered(n, D + 1, max(1.0, abs(m_big[key]))), key
    g = m_big["grad_norm"]
    assert abs(g - m_small["grad_norm"]) <= reordered(n, 2 * D + 1, g) + reordered(numel, 2, g)
    # Each update moves by at most its gradient's error (slope <= 1), plus one rounding of w - update.
    grad = max(p.main_grad.abs().max().item() for p in big.gpt.parameters())
    a, b = big.export_hf_state_dict(), small.export_hf_state_dict()
    weights = reordered(n, 2 * D + 1, grad) + 2.0 ** -23 * max(v.abs().max().item() for v in a.values())
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= weights
    assert "aux_loss" not in m_big


def test_forwards_without_a_backward_take_their_own_micro_batches(world1) -> None:
    """trainer.logprob_micro_batch_size: the log-prob forwards and the critic's values run one
    micro-batch of all 8 rows where training runs 3 of 3 (counted model forwards); the log-probs equal
    the training split's up to the bound of the HF check (other GEMM shapes), and r2's recording
    forward puts its one micro-batch's routes back in place as the split of 3 does, token for token."""
    from hpcrl.config.schema import AlgorithmConfig, CriticConfig
    from hpcrl.trainer.critic import MegatronCritic

    cfg = qwen_config()
    batch = random_batch(64, rows=8, seed=3)
    own = make_policy(cfg, micro_batch_size=3, logprob_micro_batch_size=8, routing_replay="r2")
    same = make_policy(cfg, micro_batch_size=3, routing_replay="r2")
    calls = {}
    for name, policy in (("own", own), ("same", same)):
        policy.init_from_seed(2)
        policy.critic = MegatronCritic(policy, CriticConfig(lr=1e-9), AlgorithmConfig())
        for model in (policy.gpt, policy.critic.gpt):
            model.register_forward_pre_hook(lambda *_, key=(name, model is policy.gpt): calls.update(
                {key: calls.get(key, 0) + 1}))
    logp = {name: p.compute_logprobs(batch) for name, p in (("own", own), ("same", same))}
    for name, p in (("own", own), ("same", same)):
        p.critic.values(batch)
    assert calls == {("own", True): 1, ("own", False): 1, ("same", True): 3, ("same", False): 3}, calls
    _, bound = hf_logprobs(hf_model_of(own), batch)  # also: no router near-tie
    assert (logp["own"] - logp["same"]).abs().max().item() <= bound
    fed_BL = torch.arange(batch.seq_len) < (batch.prompt_lens_B + batch.response_lens_B - 1).unsqueeze(1)
    routes = [p._recorded_routes(batch, 1.0)[1].routes_BLNK for p in (own, same)]
    assert torch.equal(routes[0][fed_BL], routes[1][fed_BL])


def test_on_policy_step_equals_a_step_with_separate_old_logprobs(world1) -> None:
    """The on-policy step takes its old log-probs from its own forward: the same update, bit for
    bit, as passing the log-probs of a separate forward, and it returns those log-probs."""
    cfg = qwen_config()
    separate, fused = make_policy(cfg, lr=1e-2), make_policy(cfg, lr=1e-2)
    separate.init_from_seed(4)
    fused.init_from_seed(4)
    sha_init = fused.policy_sha256()
    batch = random_batch(64, rows=8, seed=7)
    adv = torch.randn(8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second step runs on moved weights and Adam state
        old = separate.compute_logprobs(batch)
        m_sep = separate.train_step(batch, adv, old)
        m_fused = fused.train_step(batch, adv, on_policy=True)
        assert torch.equal(m_fused.pop("logprobs_BT"), old)
        assert torch.equal(m_sep.pop("logprobs_BT"), old)
        assert m_sep == m_fused
    assert separate.policy_sha256() == fused.policy_sha256() != sha_init


def test_ppo_style_update_takes_old_logprobs_once_then_mini_batch_steps(world1) -> None:
    """update(epochs=2, mini_batch_size=4) on 8 rows: the old log-probs of the batch before any step,
    then 4 optimizer steps on rows 0-3, 4-7, 0-3, 4-7, exactly as by hand; the ratio moves (the clip
    acts) after the first step. One pass over the whole batch is the on-policy step."""
    cfg = qwen_config()
    auto, manual, single = (make_policy(cfg, lr=5e-2, micro_batch_size=4) for _ in range(3))
    for p in (auto, manual, single):
        p.init_from_seed(6)
    batch = random_batch(64, rows=8, seed=9)
    adv = torch.randn(8, generator=torch.Generator().manual_seed(2))
    out = auto.update(batch, adv, epochs=2, mini_batch_size=4)
    old = manual.compute_logprobs(batch)
    assert torch.equal(out.pop("logprobs_BT"), old) and out["num_updates"] == 4
    clip = []
    for _ in range(2):
        for rows in (slice(0, 4), slice(4, 8)):
            sub = type(batch)(batch.tokens_BL[rows], batch.prompt_lens_B[rows], batch.response_lens_B[rows])
            m = manual.train_step(sub, adv[rows], old[rows, :sub.response_width])
            clip.append(m["clip_frac"])
    assert auto.policy_sha256() == manual.policy_sha256()
    assert clip[0] == 0.0 and max(clip[1:]) > 0, clip
    assert out["clip_frac"] == sum(clip) / 4  # the same steps' values, summed in the same order
    one = single.update(batch, adv)  # the shortcut: the same as train_step(on_policy=True)
    assert "num_updates" not in one and torch.equal(one["logprobs_BT"], old)
    with pytest.raises(ValueError, match="mini_batch_size=3 does not divide the batch of 8 rows"):
        single.update(batch, adv, epochs=2, mini_batch_size=3)


def test_entropy_bonus_gradient_is_the_entropy_gradient_of_hf(world1) -> None:
    """algorithm.entropy_coef: with zero advantages the step's gradient is -coef times the gradient
    of the response tokens' mean entropy, which the HF model with the same weights gives (norms
    compared: both sides hold every weight once); the update raises the entropy, and without the
    bonus the same step has no gradient at all."""
    cfg = qwen_config()
    sd, model = perturbed_hf(cfg, seed=4)
    batch = random_batch(cfg["vocab_size"], rows=6, seed=1)
    zero = torch.zeros(6)
    hf_forward(model, batch)  # no router near-tie: Megatron routes every token as HF does
    logits_BLV = model(batch.tokens_BL).logits.float()
    pos_BT, mask_BT = batch.logit_positions_BT(), batch.response_mask_BT()
    logits_BTV = logits_BLV.gather(1, pos_BT.unsqueeze(-1).expand(-1, -1, logits_BLV.shape[-1]))
    logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
    entropy = (-(logp_BTV.exp() * logp_BTV).sum(-1) * mask_BT).sum() / mask_BT.sum()
    entropy.backward()
    hf_grad_norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()
    hf_grad_norm = hf_grad_norm.item()
    # A token's entropy H moves by at most 2 H <= 2 log V times max|d logit| (dH/dz_j = -p_j (log p_j +
    # H)), plus its V-term sum's and the token mean's rounding. A gradient element ends D reductions
    # forward and D + 1 back (the weight gradient's sum over positions), n <= N; the norm is taken per
    # tensor (<= numel terms) and over the tensors, on both sides.
    V, D = cfg["vocab_size"], forward_depth(cfg["num_hidden_layers"]) + 1
    N = max(longest_reduction(cfg, batch.seq_len), batch.batch_size * batch.seq_len)
    apart = logit_bound(cfg, logits_BLV.abs().max().item(), batch.seq_len)
    h_bound = 2 * math.log(V) * apart + reordered(V, 1, math.log(V)) + reordered(int(mask_BT.sum()), 1,
                                                                                math.log(V))
    numel = max(p.numel() for p in model.parameters())
    for coef in (0.5, 0.0):
        # adam_eps = lr: the update is Lipschitz in the gradient (see the micro-batch test)
        policy = make_policy(cfg, entropy_coef=coef, aux_loss_coef=0.0, lr=1e-2, adam_eps=1e-2)
        policy.load_hf_state_dict(sd, model="policy")
        first = policy.train_step(batch, zero, on_policy=True)
        assert abs(first["entropy"] - entropy.item()) <= h_bound
        loss_bound = coef * h_bound + reordered(2, 1, abs(first["loss"]))  # + one add of the loss terms
        assert abs(first["loss"] + coef * entropy.item()) <= loss_bound
        g = coef * hf_grad_norm
        grad_bound = reordered(N, 2 * D + 1, g) + reordered(numel, 2, g)
        assert abs(first["grad_norm"] - g) <= grad_bound, (coef, first)
        second = policy.train_step(batch, zero, on_policy=True)
        if coef:  # more than both entropies' rounding
            assert second["entropy"] > first["entropy"] + 2 * h_bound
        else:  # no gradient at all: the same weights, bit for bit
            assert second["entropy"] == first["entropy"]


def test_the_load_balancing_coefficient_is_the_models_unless_the_job_sets_one(world1) -> None:
    """algorithm.aux_loss_coef null: config.json's router_aux_loss_coef (Qwen3-MoE), 0 for DeepSeek-V3
    and V2; a value set wins. What Megatron's routers read (the policy's TransformerConfig) and the
    policy's own value, which decides whether the aux_loss metric is logged."""
    from deepseek_dirs import deepseek_v2_config

    for cfg, aux, want in ((dict(qwen_config(), router_aux_loss_coef=0.003), None, 0.003),
                           (deepseek_config(), None, 0.0), (deepseek_config(), 0.02, 0.02),
                           (deepseek_v2_config(), None, 0.0)):
        policy = make_policy(cfg, aux_loss_coef=aux)
        assert policy.gpt.config.moe_aux_loss_coeff == policy.aux_loss_coef == want, (cfg["model_type"], aux)


def test_the_optimizer_is_torchs_adam_where_megatron_would_build_fusedadam(world1, monkeypatch) -> None:
    """With transformer-engine or apex importable, Megatron's factory builds their FusedAdam (the step
    in the param group, not per parameter: hpcrl's checkpoints lost a bf16 run's moments and failed an
    fp32 save). Here the factory is set up as it is then, with a FusedAdam that must not be built."""
    import megatron.core.optimizer as factory

    class FusedAdam:
        def __init__(self, *args, **kwargs):
            raise AssertionError("Megatron built the FusedAdam of transformer-engine/apex")

    monkeypatch.setattr(factory, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(factory, "Adam", FusedAdam)
    policy = make_policy(qwen_config())
    inner = policy.optimizer.optimizer
    assert type(inner) in (torch.optim.AdamW, torch.optim.Adam), type(inner)
    assert factory.USING_PYTORCH_OPTIMIZER is False  # as found: only the build is steered


def test_grad_clipping_scales_grads_on_cpu(world1) -> None:
    policy = make_policy(qwen_config(), grad_clip=0.05)
    policy.init_from_seed(0)
    batch = random_batch(64, seed=5)
    metrics = policy.train_step(batch, torch.linspace(-1, 1, 8), policy.compute_logprobs(batch))
    assert metrics["grad_norm"] > 0.05
    clipped = sum(p.main_grad.double().pow(2).sum() for p in policy.gpt.parameters()).sqrt().item()
    # The grads were scaled by 0.05 / (grad_norm + 1e-6), grad_norm Megatron's fp32 norm (per tensor,
    # <= numel terms, then over the tensors): off from the exact norm by half of reordered(numel, 2),
    # relative; one more rounding per scaled element; the exact norm of the result here in float64.
    numel = max(p.numel() for p in policy.gpt.parameters())
    relative = reordered(numel, 2, 1.0) / 2 + U_FP32 + 1e-6 / metrics["grad_norm"]
    assert abs(clipped - 0.05) <= 0.05 * relative, (clipped, metrics["grad_norm"])


def test_bad_input_raises(world1) -> None:
    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.trainer.policy import MegatronPolicy

    cfg = qwen_config()
    from hpcrl.trainer.model import check_layout

    with pytest.raises(ValueError, match="does not fit num_procs=1"):
        MegatronPolicy(cfg, TrainerConfig(tp=1, etp=2), AlgorithmConfig())
    with pytest.raises(ValueError, match="trainer.ep=1 needs trainer.etp == trainer.tp"):
        check_layout(cfg, tp=2, pp=1, ep=1, etp=1, dispatcher="alltoall")
    with pytest.raises(ValueError, match="uneven"):
        check_layout(cfg, tp=2, pp=1, ep=2, etp=2, dispatcher="alltoall")
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp=4"):
        check_layout(cfg, tp=4, pp=1, ep=1, etp=4, dispatcher="allgather")
    with pytest.raises(ValueError, match="num_procs=2"):
        MegatronPolicy(cfg, TrainerConfig(num_procs=2), AlgorithmConfig())
    with pytest.raises(ValueError, match="dispatcher"):
        MegatronPolicy(cfg, TrainerConfig(dispatcher="deepep"), AlgorithmConfig())
    policy = make_policy(cfg)
    batch = random_batch(64, seed=6)
    with pytest.raises(RuntimeError, match="init_from_seed"):
        policy.compute_logprobs(batch)
    policy.init_from_seed(0)
    with pytest.raises(ValueError, match="kl_coef=0"):
        policy.compute_logprobs(batch, "ref")
    with pytest.raises(ValueError, match=r"old_logp_BT has shape \(8, 99\)"):
        policy.train_step(batch, torch.zeros(8), torch.zeros(8, 99))
    with pytest.raises(ValueError, match=r"old_logp_BT is None; pass .* shape \(8, \d+\) or on_policy=True"):
        policy.train_step(batch, torch.zeros(8))
    with pytest.raises(ValueError, match="old_logp_BT given with on_policy=True"):
        policy.train_step(batch, torch.zeros(8), torch.zeros(8, batch.response_width), on_policy=True)
    with pytest.raises(KeyError, match="lm_head.weight"):
        policy.load_hf_state_dict({})
    with pytest.raises(ValueError, match=r"tensors\['advantages'\] has shape \(3,\), expected \(8,\) or"):
        policy.train_step(batch, torch.zeros(3), on_policy=True)
    with pytest.raises(ValueError, match="neither a built-in loss"):
        policy.train_step(batch, torch.zeros(8), on_policy=True, loss="nope")


def test_a_loss_must_return_a_scalar(world1, tmp_path, monkeypatch) -> None:
    (tmp_path / "vector_loss.py").write_text("def loss(b, cfg):\n    return b.logp_BT.sum(dim=1), {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    policy = make_policy(qwen_config())
    policy.init_from_seed(0)
    with pytest.raises(ValueError, match=r"loss 'vector_loss:loss' returned Tensor of shape \(8,\); it must "
                                         "return a scalar tensor"):
        policy.train_step(random_batch(64, seed=6), torch.zeros(8), on_policy=True, loss="vector_loss:loss")


def random_routes(batch, num_moe_layers: int, experts: int, top_k: int, seed: int) -> list[torch.Tensor]:
    """Per row [P + R - 1, N, K]: K distinct random experts per token and MoE layer."""
    g = torch.Generator().manual_seed(seed)
    lengths = (batch.prompt_lens_B + batch.response_lens_B).tolist()
    return [torch.rand(n - 1, num_moe_layers, experts, generator=g).argsort(-1)[..., :top_k] for n in lengths]


def used_routes(policy, batch) -> dict[int, torch.Tensor]:
    """MoE layer j -> the bool routing map [B * L, E] (rows b-major) the policy's routers used in one
    compute_logprobs of `batch` (one micro-batch: L is the batch's own)."""
    policy.replay.observe()
    policy.compute_logprobs(batch)
    maps = policy.replay.observed_routes()
    L = batch.seq_len
    # the router sees [L, B] sequence-major rows: reorder to b-major
    return {j: m[0].view(L, batch.batch_size, -1).transpose(0, 1).reshape(batch.batch_size * L, -1)
            for j, m in maps.items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_replay_routes_every_token_to_the_given_experts(world1, family: str) -> None:
    """rollout.routing_replay r3: each MoE layer sends each token to exactly the experts the batch
    gives (random K distinct experts, not what the router would choose), the real positions and the
    filler ones; swapping two tokens' routes is seen. Without replay the same model routes by itself."""
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.routing_replay import agreement
    from moe.hf_megatron import HFModelDims

    cfg = qwen_config() if family == "qwen3_moe" else deepseek_config()
    dims = HFModelDims.from_hf_config(cfg)
    N = len(dims.moe_layers)
    policy = make_policy(cfg, routing_replay="r3", micro_batch_size=8)
    policy.init_from_seed(3)
    plain = random_batch(cfg["vocab_size"], rows=6, seed=4)
    routes = random_routes(plain, N, dims.num_experts, dims.top_k, seed=5)
    rows = zip(plain.tokens_BL.tolist(), plain.prompt_lens_B.tolist(), plain.response_lens_B.tolist())
    prompts, responses = zip(*((row[:p], row[p: p + n]) for row, p, n in rows))
    batch = TrainBatch.from_lists(prompts, responses, routes)
    wanted = batch.routes_BLNK.reshape(-1, N, dims.top_k)
    every = torch.ones(wanted.shape[0], dtype=torch.bool)
    used = used_routes(policy, batch)
    assert sorted(used) == list(range(N))
    for j, map_TE in used.items():
        assert agreement(map_TE, wanted[:, j], every) == (every.numel(),) * 2, j
    swapped = [r.clone() for r in routes]
    swapped[0][[0, 1]] = swapped[0][[1, 0]]  # two tokens of row 0 trade routes
    assert not torch.equal(swapped[0], routes[0])
    moved = TrainBatch.from_lists(prompts, responses, swapped)
    hits = [agreement(m, wanted[:, j], every)[0] for j, m in used_routes(policy, moved).items()]
    assert min(hits) < every.numel()
    free = [agreement(m, wanted[:, j], every)[0] for j, m in used_routes(policy, plain).items()]
    assert max(free) < every.numel() // 2  # the router's own choice is not the random routes


def own_routes(policy, plain) -> list[torch.Tensor]:
    """Per row [P + R - 1, N, K]: the routes `policy`'s routers take on `plain` (one micro-batch)."""
    used = used_routes(policy, plain)  # bool maps [B * L, E] b-major
    return [torch.stack([m.view(plain.batch_size, plain.seq_len, -1)[b, : int(p + n) - 1].nonzero()[:, 1]
                         .view(int(p + n) - 1, -1) for m in used.values()], dim=1)
            for b, (p, n) in enumerate(zip(plain.prompt_lens_B, plain.response_lens_B))]


def split_rows(plain) -> tuple[list[list[int]], list[list[int]]]:
    rows = zip(plain.tokens_BL.tolist(), plain.prompt_lens_B.tolist(), plain.response_lens_B.tolist())
    prompts, responses = zip(*((row[:p], row[p: p + n]) for row, p, n in rows))
    return list(prompts), list(responses)


def test_router_agreement_counts_the_training_forwards_routes(world1) -> None:
    """mismatch/router_agreement: the share of real (token, MoE layer) routes the training forward
    took as the engine did. Given the routes the model itself takes (recorded from its own forward),
    observe mode measures 1; given random ones it measures what random sets of 2 of 4 share with its
    own choice (< 1); replaying them (r3) measures 1 again."""
    from hpcrl.trainer.batch import TrainBatch

    cfg = qwen_config()
    plain = random_batch(cfg["vocab_size"], rows=6, seed=4)
    prompts, responses = split_rows(plain)
    adv = torch.linspace(-1, 1, 6)
    got = {}
    for mode in ("observe", "r3"):
        policy = make_policy(cfg, routing_replay=mode, micro_batch_size=8, lr=0.0)
        policy.init_from_seed(3)
        own_batch = TrainBatch.from_lists(prompts, responses, own_routes(policy, plain))
        random = TrainBatch.from_lists(prompts, responses, random_routes(plain, 2, 4, 2, seed=6))
        got[mode] = [policy.train_step(b, adv, policy.compute_logprobs(b))["router_agreement"]
                     for b in (own_batch, random)]
        policy.compute_logprobs(random)
        # counted where the routers run and read back once, not per router (a GPU would stall)
        assert isinstance(policy.replay.same, torch.Tensor), type(policy.replay.same)
    assert got["observe"][0] == 1.0 and got["observe"][1] < 0.8
    assert got["r3"] == [1.0, 1.0]


@pytest.mark.parametrize("mode", ["observe", "r2"])
def test_router_agreement_of_an_update_is_the_old_forwards(world1, mode: str) -> None:
    """update() in 2 epochs x 2 mini-batches at an lr that moves the routers, given the routes the
    model takes at the engine's (its own, unmoved) weights: observe measures 1, as the forward with
    those weights sees it (the mean over the steps, which route with moved weights, was 0.375 in the
    audit's run); r2's engines return no routes, so it reports none (it compared the trainer's own
    recorded routes with themselves: always 1)."""
    from hpcrl.trainer.batch import TrainBatch

    cfg = qwen_config()
    plain = random_batch(cfg["vocab_size"], rows=8, seed=7)
    policy = make_policy(cfg, routing_replay=mode, micro_batch_size=8, lr=0.3, adam_eps=1e-8)
    policy.init_from_seed(3)
    batch = TrainBatch.from_lists(*split_rows(plain), own_routes(policy, plain) if mode == "observe" else None)
    policy.replay.observe()
    out = policy.update(batch, torch.linspace(-1, 1, 8), epochs=2, mini_batch_size=4)
    maps = policy.replay.observed_routes()
    L = plain.seq_len  # the old forward: one micro-batch [L, 8]; then 4 steps of [L, 4] (rows 0-3, 4-7, ...)
    moved = [not torch.equal(m[1 + step].view(L, 4, -1), m[0].view(L, 8, -1)[:, 4 * (step % 2):][:, :4])
             for m in maps.values() for step in range(4)]
    if mode == "observe":
        assert any(moved)  # the later steps route elsewhere: the old mean could not be 1
        assert out["router_agreement"] == 1.0
    else:
        assert "router_agreement" not in out


def test_routes_that_do_not_fit_the_model_are_named(world1) -> None:
    """Routes of another model's layers or top_k, ids out of range or a (token, layer) sent to one
    expert twice (SGLang's zero rows) are a ValueError naming what is wrong; a top_k + 1 was replayed
    without a word and an id out of range failed deep inside Megatron."""
    from hpcrl.trainer.batch import TrainBatch

    cfg = qwen_config()  # 2 MoE layers, 4 experts, top-2
    plain = random_batch(cfg["vocab_size"], rows=4, seed=4)
    prompts, responses = split_rows(plain)
    policy = make_policy(cfg, routing_replay="r3", micro_batch_size=8)
    policy.init_from_seed(3)
    good = random_routes(plain, 2, 4, 2, seed=6)
    assert policy.compute_logprobs(TrainBatch.from_lists(prompts, responses, good)) is not None
    twice = [r.clone() for r in good]
    twice[1][0, 1] = twice[1][0, 1, :1]
    for routes, match in [(random_routes(plain, 2, 4, 3, seed=6), r"top_k=2"),
                          (random_routes(plain, 3, 4, 2, seed=6), r"2 MoE layers"),
                          ([r + 3 for r in good], r"expert ids in \[\d, 6\]; this model has 4 experts"),
                          (twice, "to one expert twice")]:
        with pytest.raises(ValueError, match=match):
            policy.compute_logprobs(TrainBatch.from_lists(prompts, responses, routes))


@pytest.mark.parametrize("mode", ["none", "r2"])
def test_r2_replays_the_old_forwards_routes_in_every_epoch(world1, mode: str) -> None:
    """rollout.routing_replay r2: two epochs in two mini-batches, at an lr that moves the routers.
    With r2 every training forward routes each token as the old-log-prob forward did; without, the
    moved weights route some tokens elsewhere (the check can fail)."""
    cfg = qwen_config()
    policy = make_policy(cfg, routing_replay=mode, micro_batch_size=4, lr=0.3, adam_eps=1e-8)
    policy.init_from_seed(3)
    batch = random_batch(cfg["vocab_size"], rows=8, seed=7)
    policy.replay.observe()
    policy.update(batch, torch.linspace(-1, 1, 8), epochs=2, mini_batch_size=4)
    maps = policy.replay.observed_routes()
    # the old forward: 2 micro-batches of 4 rows; then 4 training steps (2 epochs x 2 mini-batches),
    # each one micro-batch of 4 rows: mini-batch i is old micro-batch i
    same = [torch.equal(m[2 + step], m[step % 2]) for m in maps.values() for step in range(4)]
    assert all(same) if mode == "r2" else not all(same)


def test_r2_records_the_same_routes_under_a_split_by_tokens(world1) -> None:
    """rollout.routing_replay r2 records each router's own routes from the old-log-prob forward and puts
    every micro-batch's rows back in place: with micro-batches of other rows and lengths
    (trainer.max_tokens_per_micro_batch), the same routes, token for token (this batch's routing is clear
    of near-ties: hf_forward checks it) at every position a row's tokens fed forward (padding positions
    route as their micro-batch's length has them)."""
    cfg = qwen_config()
    batch = random_batch(cfg["vocab_size"], rows=8, seed=3)
    routes = []
    for split in (dict(micro_batch_size=8), dict(micro_batch_size=8, max_tokens_per_micro_batch=16)):
        policy = make_policy(cfg, routing_replay="r2", **split)
        policy.init_from_seed(2)
        routes.append(policy._recorded_routes(batch, 1.0)[1].routes_BLNK)
    hf_forward(hf_model_of(policy), batch)
    fed_BL = torch.arange(batch.seq_len) < (batch.prompt_lens_B + batch.response_lens_B - 1).unsqueeze(1)
    assert torch.equal(routes[0][fed_BL], routes[1][fed_BL])
    assert not torch.equal(routes[0], routes[1])  # padding positions differ: the masked check compares


def test_mini_batches_split_by_tokens_narrower_than_their_batch(world1) -> None:
    """PPO mini-batches keep their batch's width (TrainBatch.mini_batches): split by tokens, a mini-batch
    without the longest row pads to the batch's width, not its own longest (an assertion failed there).
    At lr 0 every step computes on the same weights, so the policy's and the critic's updates give the
    fixed split's metrics up to the forward's reordering (D + 1 reductions; a mean over tokens, slope
    <= 1 + max|log p|; the critic's value head adds one)."""
    from hpcrl.config.schema import AlgorithmConfig, CriticConfig
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.critic import MegatronCritic

    cfg = qwen_config()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 64, (3,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(1, 64, (1 if b < 4 else 6,), generator=g).tolist() for b in range(8)]
    batch = TrainBatch.from_lists(prompts, responses)  # rows 0-3: one response token; 4-7: six
    out = []
    for split in (dict(micro_batch_size=8), dict(micro_batch_size=8, max_tokens_per_micro_batch=12)):
        policy = make_policy(cfg, lr=0.0, aux_loss_coef=0.0, **split)
        policy.init_from_seed(2)
        policy.critic = MegatronCritic(policy, CriticConfig(lr=1e-9), AlgorithmConfig())
        m = policy.update(batch, torch.linspace(-1, 1, 8), epochs=1, mini_batch_size=4)
        values = policy.critic.values(batch)
        returns = torch.where(batch.response_mask_BT(), 1.0, 0.0)
        out.append((m, policy.critic.update(batch, returns, values, epochs=1, mini_batch_size=4)))
    (fixed, critic_fixed), (tokens, critic_tokens) = out
    D = forward_depth(cfg["num_hidden_layers"]) + 1
    n = max(longest_reduction(cfg, batch.seq_len), batch.batch_size * batch.seq_len)
    slope = 1 + fixed["logprobs_BT"].abs().max().item()
    assert (tokens.pop("logprobs_BT") - fixed.pop("logprobs_BT")).abs().max().item() <= \
        reordered(n, D, slope)
    for key in ("loss", "pg_loss", "entropy"):
        assert abs(tokens[key] - fixed[key]) <= slope * reordered(n, D + 1, max(1.0, abs(fixed[key]))), key
    for key in ("vf_loss", "values_mean"):
        assert abs(critic_tokens[key] - critic_fixed[key]) <= \
            reordered(n, D + 2, max(1.0, abs(critic_fixed[key]))), key
