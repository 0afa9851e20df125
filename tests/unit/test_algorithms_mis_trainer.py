"""Rollout correction in the trainer. MIS rejection (algorithm.rollout_correction: mis): the rejected
sequences leave every term of the loss (policy gradient, KL to the reference, entropy bonus) and its
token and sequence counts, so a step with them rejected is the step on the batch without them; at
the token level only the rejected tokens leave. TIS: a user's loss that never applies the weights
stops the step naming it. A real one-rank Megatron policy in a fresh process (its own gloo world),
run by this file itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


def test_rejected_sequences_and_tokens_leave_the_loss_and_its_counts():
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0 and out.stdout.strip().endswith("MIS OK"), out.stderr[-3000:]


def plain_loss(b, cfg):  # a user's loss that ignores b.correction_BT
    pg = -(b.advantages_BT() * b.logp_BT * b.mask_BT).sum() / b.num_tokens
    return pg, {}


def routing_clear(policy, batch) -> float:
    """numerics.hf_routing's margin ratio under `policy`'s weights: above 1.5 every summation order
    routes every token alike, on any host."""
    from numerics import hf_routing

    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import hf_checkpoint_to_fused

    model = build_hf_model(policy.hf_config, 0)
    model.load_state_dict(hf_checkpoint_to_fused(policy.export_hf_state_dict(), policy.dims))
    return hf_routing(model, batch)[1]


def _worker() -> None:
    import datetime
    from pathlib import Path

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: numerics
    from numerics import forward_depth, longest_reduction, reordered

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.policy import MegatronPolicy

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    cfg = load_hf_config("tiny-qwen3-moe", None)
    g = torch.Generator().manual_seed(25)  # rows clear of router near-ties (routing_clear); seed 0's were not
    lens = [3, 5, 4, 0, 6, 2, 5, 3]  # row 3: an empty response (counted as a sequence either way)
    batch = TrainBatch.from_lists([torch.randint(1, 60, (3,), generator=g).tolist() for _ in lens],
                                  [torch.randint(1, 60, (n,), generator=g).tolist() for n in lens])
    adv = torch.tensor([1.0, -0.5, 0.3, 0.0, -1.2, 0.8, 0.4, -0.7])

    def policy(loss_agg: str, **algo) -> MegatronPolicy:
        p = MegatronPolicy(cfg, TrainerConfig(micro_batch_size=3),
                           AlgorithmConfig(lr=1e-2, adam_eps=1e-2, aux_loss_coef=0.0, kl_coef=0.05,
                                           entropy_coef=0.01, loss_agg=loss_agg, **algo))
        p.init_from_seed(3)
        sd = p.export_hf_state_dict()
        noise = torch.Generator().manual_seed(1)
        p.load_hf_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=noise) for k, v in sd.items()},
                             model="ref")  # a reference apart from the policy: the KL term is not 0
        return p

    # Sequence level: rows 1 and 4 have an engine ratio e^5 and e^6 (> mis_high), the others e^0.
    rejected = [1, 4]
    for loss_agg in ("token-mean", "seq-mean-token-mean"):
        mis = policy(loss_agg, rollout_correction="mis", mis_low=0.5, mis_high=2.0)
        plain = policy(loss_agg)
        old = mis.compute_logprobs(batch)
        behaviour = old - torch.tensor([1.0 if b in rejected else 0.0 for b in range(8)])[:, None]
        behaviour = behaviour * batch.response_mask_BT()
        m = mis.update(batch, adv, mis.compute_logprobs(batch, "ref"), tensors={"behaviour_logp": behaviour})
        assert m["mis_masked_frac"] == 2 / 8, m
        # the log ratios tested: 5 and 6 (a 1 per token of rows 1 and 4) over 8 sequences; k1 of
        # KL(mu || pi_old) is the token mean of -d over the 28 response tokens
        assert m["mis_log_ratio_mean"] == pytest.approx(11 / 8) and m["mismatch_kl_k1"] == pytest.approx(-11 / 28)
        rows = [b for b in range(8) if b not in rejected]
        kept = TrainBatch(batch.tokens_BL[rows], batch.prompt_lens_B[rows], batch.response_lens_B[rows])
        ref_kept = plain.compute_logprobs(kept, "ref")
        assert routing_clear(plain, kept) > 1.5, "a router near-tie: pick other rows"
        p = plain.update(kept, adv[rows], ref_kept)
        # The same sums in other orders (8 rows against 6: other GEMM shapes), tests/numerics.py: D
        # reductions to a log-prob and as many back to a gradient, n the longest reduction or the
        # batch's positions; the metrics are means over tokens of functions of log-probs with slope
        # <= 1 + max|log p|; grad_norm adds the per-tensor norms; adam_eps = lr makes the update
        # Lipschitz in the gradient (slope <= 1), so a weight moves by at most its gradient's error
        # plus one rounding of w - update.
        D = forward_depth(cfg["num_hidden_layers"]) + 1
        n = max(longest_reduction(cfg, batch.seq_len), batch.batch_size * batch.seq_len)
        slope = 1 + old.abs().max().item()
        for key in ("loss", "pg_loss", "kl", "entropy"):
            bound = slope * reordered(n, D + 1, max(1.0, abs(p[key])))
            assert abs(m[key] - p[key]) <= bound, (loss_agg, key, m[key], p[key], bound)
        numel = max(t.numel() for t in plain.gpt.parameters())
        g = p["grad_norm"]
        assert abs(m["grad_norm"] - g) <= reordered(n, 2 * D + 1, g) + reordered(numel, 2, g), (m, p)
        a, b = mis.export_hf_state_dict(), plain.export_hf_state_dict()
        grad = max(t.main_grad.abs().max().item() for t in plain.gpt.parameters())
        weights = reordered(n, 2 * D + 1, grad) + 2.0 ** -23 * max(v.abs().max().item() for v in a.values())
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= weights

    # Token level: tokens (0, 1), (2, 0), (2, 3) have ratio e, the others 1; on-policy (ratio 1) the
    # policy-gradient term is -(sum of A over the kept tokens) / (number of kept tokens).
    mis = policy("token-mean", rollout_correction="mis", mis_low=0.5, mis_high=2.0, mis_level="token")
    old = mis.compute_logprobs(batch)
    d = torch.zeros_like(old)
    for b, t in ((0, 1), (2, 0), (2, 3)):
        d[b, t] = 1.0
    mask = batch.response_mask_BT()
    m = mis.update(batch, adv, mis.compute_logprobs(batch, "ref"),
                   tensors={"behaviour_logp": (old - d) * mask})
    keep = mask & (d == 0)
    expected = -(adv[:, None] * keep).sum() / keep.sum()
    # a mean of |A| <= 1.2 over the kept tokens, in another order; the ratio is 1 up to exp(logp - old)
    # of the same forward (0 here): reordered(tokens, 1, 1.2) plus one division's rounding
    bound = reordered(int(keep.sum()), 1, 1.2) + 2.0 ** -24 * abs(expected.item())
    assert keep.sum() == int(mask.sum()) - 3 and abs(m["pg_loss"] - expected.item()) <= bound, (m, expected)
    assert m["mis_masked_frac"] == pytest.approx(3 / int(mask.sum()))
    assert m["mis_log_ratio_mean"] == pytest.approx(3 / int(mask.sum()))  # token level: the mean of d

    tis = policy("token-mean", rollout_correction="tis", tis_cap=2.0)
    try:
        tis.update(batch, adv, tis.compute_logprobs(batch, "ref"), loss="__main__:plain_loss",
                   tensors={"behaviour_logp": (tis.compute_logprobs(batch) - d) * mask})
        raise AssertionError("a loss that ignores the TIS weights ran")
    except ValueError as exc:
        assert "loss '__main__:plain_loss' never applied algorithm.rollout_correction: tis" in str(exc), exc
    dist.destroy_process_group()
    print("MIS OK")


if __name__ == "__main__":
    _worker()
