"""trainer.recompute_*: Megatron's activation recomputation on one rank, in process.

Recomputation runs a training forward's layers (or parts of them) again in the backward instead of
keeping their activations, so a step must come out as it does without it: the same ops on the same
inputs, bit for bit, over several micro-batches, with the load-balancing loss on (its padding mask is
what Megatron's block method dropped) and the routes replayed (r3). Recomputing the norms is the one
exception: the norm's output gradient then sums its consumers' contributions in another order, so its
step is compared within that reordering's bound. The memory side is measured: the bytes a training
forward leaves saved for the backward in the decoder layers (autograd's saved-tensor hooks; distinct
storages, parameters excluded: hpcrl/trainer/saved_activations.py).
"""

from __future__ import annotations

import pytest
import torch
from numerics import forward_depth, layer_depth, longest_reduction, reordered
from hpcrl.trainer.saved_activations import SavedActivations, allocated_peak
from test_policy_single_rank import (deepseek_config, make_policy, own_routes, qwen_config, random_batch,  # noqa: F401
                                     split_rows, world1)

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

FULL = dict(recompute_granularity="full")
SETTINGS = {
    "full-uniform-1": FULL,
    "full-uniform-all": {**FULL, "recompute_num_layers": 0},  # 0: the model's layer count (below)
    "full-block-1": {**FULL, "recompute_method": "block"},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
}
DEEPSEEK_ONLY = {"selective-mla": dict(recompute_granularity="selective",
                                       recompute_modules=["mla_up_proj", "shared_experts", "mlp"])}
ALGO = dict(lr=1e-2, adam_eps=1e-2, aux_loss_coef=0.01, micro_batch_size=3)


def two_steps(cfg: dict, batch, **settings) -> tuple[list[dict], str, int]:
    """Two on-policy steps (the second on moved weights and Adam state) of a policy with `settings`:
    their metrics (log-probs included), the weights' hash after them, and the bytes each micro-batch's
    forward of the first step saved in the decoder layers, the most of any micro-batch."""
    policy = make_policy(cfg, **ALGO, **settings)
    policy.init_from_seed(2)
    adv = torch.randn(batch.batch_size, generator=torch.Generator().manual_seed(0))
    with SavedActivations(policy.gpt) as saved:
        first = policy.train_step(batch, adv, on_policy=True)
    second = policy.train_step(batch, adv, on_policy=True)
    totals = saved.per_forward
    assert len(totals) == 3  # one forward per micro-batch
    if settings.get("recompute_granularity") == "full" and "recompute_method" not in settings:
        assert len(set(totals)) == 1, totals  # the layers' inputs only: as much in each micro-batch
    return [first, second], policy.policy_sha256(), max(totals)  # (else the experts' token counts vary)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_recompute_gives_the_same_steps_and_keeps_less(world1, family: str) -> None:  # noqa: F811
    cfg = qwen_config() if family == "qwen3_moe" else deepseek_config()
    layers, H, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    batch = random_batch(cfg["vocab_size"], rows=8, seed=3)
    mb, L = ALGO["micro_batch_size"], batch.seq_len
    steps, sha, kept = two_steps(cfg, batch)
    saved = {}
    settings = {**SETTINGS, **(DEEPSEEK_ONLY if family == "deepseek_v3" else {})}
    for name, setting in settings.items():
        if setting.get("recompute_num_layers") == 0:
            setting = {**setting, "recompute_num_layers": layers}
        got, got_sha, saved[name] = two_steps(cfg, batch, **setting)
        for a, b in zip(got, steps, strict=True):
            assert torch.equal(a.pop("logprobs_BT"), b["logprobs_BT"]), name
            assert a == {k: v for k, v in b.items() if k != "logprobs_BT"}, name
        assert got_sha == sha, name
        assert saved[name] < kept, name
    # Full recompute keeps each chunk's input and nothing inside it: one chunk of every layer keeps
    # layers - 1 hidden-state inputs [L, mb, H] fewer (fp32) than chunks of one layer each, as
    # `hpcrl plan` counts them (moe/activation_memory.py).
    assert saved["full-uniform-1"] - saved["full-uniform-all"] == (layers - 1) * L * mb * H * 4
    assert saved["full-uniform-1"] - saved["full-uniform-all"] == \
        planned(cfg, L, batch.response_width, mb, recompute_num_layers=1)["layer_inputs_bytes"] - \
        planned(cfg, L, batch.response_width, mb, recompute_num_layers=layers)["layer_inputs_bytes"]
    # Without it, every layer keeps at least its attention probabilities [mb, heads, L, L].
    assert kept - saved["full-uniform-1"] >= layers * mb * heads * L * L * 4
    # core_attn recomputes those probabilities; moe its experts' SwiGLU products, [tokens * top_k, ffn]
    # in each MoE layer (Megatron keeps them for the down projection).
    moe_layers = layers - cfg.get("first_k_dense_replace", 0)
    ffn, top_k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    assert kept - saved["selective"] >= layers * mb * heads * L * L * 4 + moe_layers * L * mb * top_k * ffn * 4


def test_recomputed_norms_step_within_the_reordering_bound(world1) -> None:  # noqa: F811
    """recompute_modules [layernorm]: the forward is the same computation (loss, entropy, log-probs bit
    for bit); the norm's output gradient sums its consumers' contributions (q/k/v, or the router and the
    experts) in another order, so the gradient and the update differ by rounding: the weights within
    the backward chain's reordering bound (2 D + 1 reductions of at most n terms, as
    test_micro_batches_give_the_same_step_as_one_batch derives it; Adam with eps = lr moves each
    weight by at most its gradient's error), and the saved bytes drop by at least the two norms'
    outputs [L, mb, H] per layer."""
    cfg = qwen_config()
    batch = random_batch(cfg["vocab_size"], rows=8, seed=3)
    steps, _, kept = two_steps(cfg, batch)
    base = make_policy(cfg, **ALGO)
    norms = make_policy(cfg, **ALGO, recompute_granularity="selective", recompute_modules=["layernorm"])
    adv = torch.randn(batch.batch_size, generator=torch.Generator().manual_seed(0))
    for policy in (base, norms):
        policy.init_from_seed(2)
    a = base.train_step(batch, adv, on_policy=True)
    with SavedActivations(norms.gpt) as saved:
        b = norms.train_step(batch, adv, on_policy=True)
    assert torch.equal(a.pop("logprobs_BT"), b.pop("logprobs_BT"))
    for key in ("loss", "entropy", "pg_loss", "aux_loss"):
        assert a[key] == b[key], key
    D = forward_depth(cfg["num_hidden_layers"], layer_depth(cfg)) + 1
    n = max(longest_reduction(cfg, batch.seq_len), batch.batch_size * batch.seq_len)
    numel = max(p.numel() for p in base.gpt.parameters())
    assert abs(a["grad_norm"] - b["grad_norm"]) <= reordered(n, 2 * D + 1, a["grad_norm"]) + \
        reordered(numel, 2, a["grad_norm"])
    grad = max(p.main_grad.abs().max().item() for p in base.gpt.parameters())
    wa, wb = base.export_hf_state_dict(), norms.export_hf_state_dict()
    bound = reordered(n, 2 * D + 1, grad) + 2.0 ** -23 * max(v.abs().max().item() for v in wa.values())
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= bound
    L, mb, H = batch.seq_len, ALGO["micro_batch_size"], cfg["hidden_size"]
    assert kept - max(saved.per_forward) >= 2 * cfg["num_hidden_layers"] * L * mb * H * 4


@pytest.mark.parametrize("setting", ["full-uniform-1", "selective"])
def test_recompute_replays_the_routes_it_was_given(world1, setting: str) -> None:  # noqa: F811
    """r3 under recompute: the recomputed routers replay the micro-batch's own routes again (random ones,
    not the router's choice: a free recompute would route elsewhere), so the step equals r3's without
    recompute bit for bit and the training forward's agreement is 1, counted once per route."""
    from hpcrl.trainer.batch import TrainBatch
    from test_policy_single_rank import random_routes

    cfg = qwen_config()
    plain = random_batch(cfg["vocab_size"], rows=8, seed=4)
    batch = TrainBatch.from_lists(*split_rows(plain), random_routes(plain, 2, 4, 2, seed=6))
    adv = torch.linspace(-1, 1, 8)
    out = []
    for settings in ({}, SETTINGS[setting]):
        policy = make_policy(cfg, routing_replay="r3", **ALGO, **settings)
        policy.init_from_seed(3)
        policy.replay.observe()
        m = policy.train_step(batch, adv, on_policy=True)
        observed = policy.replay.observed_routes()
        out.append((m, policy.policy_sha256(), {j: len(maps) for j, maps in observed.items()}))
    (a, sha_a, seen_a), (b, sha_b, seen_b) = out
    assert torch.equal(a.pop("logprobs_BT"), b.pop("logprobs_BT"))
    assert a == b and a["router_agreement"] == 1.0
    assert sha_a == sha_b
    assert seen_a == seen_b == {0: 3, 1: 3}  # one map per micro-batch and layer: the recompute is not observed


def test_the_critic_recomputes_as_the_policy_does(world1) -> None:  # noqa: F811
    """PPO's critic takes the policy's layout, recompute included: its step is the same bit for bit,
    keeping fewer bytes for its backward (so the recompute ran)."""
    from hpcrl.config.schema import AlgorithmConfig, CriticConfig
    from hpcrl.trainer.critic import MegatronCritic

    cfg = qwen_config()
    batch = random_batch(cfg["vocab_size"], rows=8, seed=3)
    out = []
    for settings in ({}, FULL):
        policy = make_policy(cfg, **ALGO, **settings)
        policy.init_from_seed(2)
        policy.critic = MegatronCritic(policy, CriticConfig(lr=1e-3), AlgorithmConfig())
        values = policy.critic.values(batch)
        returns = torch.where(batch.response_mask_BT(), torch.linspace(-1, 1, values.numel()).view_as(values), 0.0)
        with SavedActivations(policy.critic.gpt) as saved:
            step = policy.critic.train_step(batch, returns, values)
        out.append((step, policy.critic.sha256(), max(saved.per_forward)))
    assert out[0][:2] == out[1][:2]
    # as for the policy: without recompute each layer keeps at least its attention probabilities
    L, mb = batch.seq_len, ALGO["micro_batch_size"]
    assert out[0][2] - out[1][2] >= cfg["num_hidden_layers"] * mb * cfg["num_attention_heads"] * L * L * 4


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_the_log_prob_head_keeps_one_float32_array_per_vocab_entry(world1, entropy_coef: float) -> None:  # noqa: F811
    """The loss's log-probs over the vocab (hpcrl/trainer/policy.py _logp_and_entropy) keep for the
    backward, per micro-batch, the softmax's exp [mb, T, v] in float32 and nothing else that grows
    with the vocab (with the entropy bonus, its logits [mb, T, v] in float32 too): the bytes saved
    outside the decoder block at two vocab sizes differ by exactly 4 * mb * T (8 * mb * T) per added
    vocab entry. With gather, its backward kept the logits of every position [mb, L, v] at the
    model's dtype and the float32 [mb, T, v] as well: 4 * mb * (L + 2T) per entry, here over twice
    as much. This is the term `hpcrl plan` counts for the last stage (moe/activation_memory.py)."""
    cfg = qwen_config()
    batch = random_batch(64, rows=6, seed=3)  # tokens below both vocab sizes
    adv = torch.randn(batch.batch_size, generator=torch.Generator().manual_seed(0))
    mb, T = ALGO["micro_batch_size"], batch.response_width
    head = {}
    for vocab in (64, 192):
        policy = make_policy({**cfg, "vocab_size": vocab}, **{**ALGO, "entropy_coef": entropy_coef})
        policy.init_from_seed(2)
        with SavedActivations(policy.gpt) as saved:
            policy.train_step(batch, adv, on_policy=True)
        assert len(saved.per_head) == batch.batch_size // mb, saved.per_head  # one per micro-batch
        head[vocab] = saved.per_head
    per_entry = 8 if entropy_coef else 4
    assert [b - a for a, b in zip(head[64], head[192], strict=True)] == [per_entry * mb * T * 128] * 2, head
    plan = {vocab: planned({**cfg, "vocab_size": vocab}, batch.seq_len, T, mb, entropy_grad=entropy_coef > 0)
            for vocab in (64, 192)}
    assert plan[192]["head_bytes"] - plan[64]["head_bytes"] == head[192][0] - head[64][0]


def planned(cfg: dict, seq_len: int, response_len: int, mb: int, **step) -> dict:
    """What `hpcrl plan` counts for one rank (pp 1, tp 1) of this float32 step: its one stage."""
    from moe.activation_memory import StepShape, activation_memory
    from moe.layouts import TrainerLayout
    from moe.specs import spec_from_config

    recompute = {"recompute": "full"} if "recompute_num_layers" in step else {}
    shape = StepShape(seq_len=seq_len, response_len=response_len, micro_batch_size=mb, num_micro_batches=2,
                      **recompute, **step)
    return activation_memory(spec_from_config(cfg).dims, TrainerLayout(vocab_divisible_by=1), shape, 4)["per_stage"][0]


def test_the_log_prob_forward_computes_no_entropy(world1) -> None:  # noqa: F811
    """compute_logprobs discards the entropy, so it does not compute it: no float32 product exp * z
    [mb, T, v] per micro-batch (nor, under TP, its all-reduce). Measured with the profiler's CPU
    allocations: no multiplication allocates that many bytes (the model's own are [L * mb, H]-sized)."""
    cfg = {**qwen_config(), "vocab_size": 4096}
    batch = random_batch(64, rows=6, seed=3)
    mb, T = ALGO["micro_batch_size"], batch.response_width
    policy = make_policy(cfg, **ALGO)
    policy.init_from_seed(2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        policy.compute_logprobs(batch)
    exps = [e.cpu_memory_usage for e in prof.events() if e.name == "aten::exp"]
    muls = [e.cpu_memory_usage for e in prof.events() if e.name == "aten::mul"]
    assert exps.count(4 * mb * T * 4096) == 2, exps  # the softmax's exp of each micro-batch: the measure works
    assert max(muls) < 4 * mb * T * 4096, sorted(muls)[-4:]


def test_the_log_prob_head_computes_its_positions_a_chunk_at_a_time(world1, monkeypatch) -> None:  # noqa: F811
    """The head's transients (the float32 logits of the positions, their shift, the entropy's product)
    exist one chunk of positions at a time (HEAD_CHUNK_BYTES): at two positions a chunk the peak
    allocated drops from the picked bf16 logits + three float32 [B, T, v] arrays to chunk-sized
    arrays without the backward, and to the picked logits + what the backward keeps (the
    exp, and with the entropy bonus the float32 logits) with it, with the same log-probs, entropies
    and gradients bit for bit. (B, T, v = 2, 64, 2048; the [B, L, v] logits exist before; small:
    per-position vectors.)"""
    import hpcrl.trainer.policy as policy_module
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():  # a policy made in this world made it
        ps.initialize_model_parallel()
    B, L, T, v = 2, 96, 64, 2048
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, L, v, generator=g).to(torch.bfloat16)
    pos = (L - T - 1 + torch.arange(T)).expand(B, T).contiguous()
    tgt = torch.randint(0, v, (B, T), generator=g)
    unit, picked, small, chunk = B * T * v * 4, B * T * v * 2, 64 * B * T * 8, 4 * B * v * 2
    peaks, results = {}, {}
    for name, chunk_bytes in (("whole", 1 << 40), ("chunked", chunk)):
        monkeypatch.setattr(policy_module, "HEAD_CHUNK_BYTES", chunk_bytes)
        for grad in (False, True):
            x = logits.clone().requires_grad_(grad)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as p:
                with torch.set_grad_enabled(grad):
                    lp, ent = policy_module._logp_and_entropy(x, pos, tgt, 0.7, entropy_grad=grad)
                    if grad:
                        (lp.sum() + 0.1 * ent.sum()).backward()
            peaks[name, grad] = allocated_peak(p.events())
            results[name, grad] = (lp.detach(), ent.detach(), x.grad)
    for grad in (False, True):
        for a, b in zip(results["whole", grad], results["chunked", grad], strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    assert peaks["whole", False] >= picked + 3 * unit and peaks["whole", True] >= picked + 3 * unit, peaks
    assert peaks["chunked", False] <= 4 * chunk + small, peaks  # each chunk picks its own positions
    assert peaks["chunked", True] <= picked + 2 * unit + 4 * chunk + small, peaks
