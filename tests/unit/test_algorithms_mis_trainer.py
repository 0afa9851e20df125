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


def _worker() -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.policy import MegatronPolicy

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    cfg = load_hf_config("tiny-qwen3-moe", None)
    g = torch.Generator().manual_seed(0)
    lens = [3, 5, 4, 0, 6, 2, 5, 3]  # row 3: an empty response (counted as a sequence either way)
    batch = TrainBatch.from_lists([torch.randint(1, 60, (3,), generator=g).tolist() for _ in lens],
                                  [torch.randint(1, 60, (n,), generator=g).tolist() for n in lens])
    adv = torch.tensor([1.0, -0.5, 0.3, 0.0, -1.2, 0.8, 0.4, -0.7])

    def policy(loss_agg: str, **algo) -> MegatronPolicy:
        p = MegatronPolicy(cfg, TrainerConfig(micro_batch_size=3),
                           AlgorithmConfig(lr=1e-2, adam_eps=1e-6, aux_loss_coef=0.0, kl_coef=0.05,
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
        rows = [b for b in range(8) if b not in rejected]
        kept = TrainBatch(batch.tokens_BL[rows], batch.prompt_lens_B[rows], batch.response_lens_B[rows])
        ref_kept = plain.compute_logprobs(kept, "ref")
        p = plain.update(kept, adv[rows], ref_kept)
        for key in ("loss", "pg_loss", "kl", "entropy"):  # float32 sums in another order: ~1e-7
            assert abs(m[key] - p[key]) < 1e-6 * max(1.0, abs(p[key])), (loss_agg, key, m[key], p[key])
        assert abs(m["grad_norm"] - p["grad_norm"]) < 1e-5 * p["grad_norm"], (m["grad_norm"], p["grad_norm"])
        a, b = mis.export_hf_state_dict(), plain.export_hf_state_dict()
        # Adam divides by sqrt(v) + eps: float-order noise in tiny grads moves weights by ~lr * 1e-4
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 2e-5

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
    assert keep.sum() == int(mask.sum()) - 3 and abs(m["pg_loss"] - expected.item()) < 1e-6, (m, expected)
    assert m["mis_masked_frac"] == pytest.approx(3 / int(mask.sum()))

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
