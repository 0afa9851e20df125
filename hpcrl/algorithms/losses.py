"""Policy losses the trainer runs, chosen by the algorithm by name or import path: one contract for
the built-ins and for a user's own.

    @policy_loss(metrics=("pg_loss", "clip_frac"))
    def my_loss(b: LossBatch, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
        ...  # a scalar loss (carrying the gradient through b.logp_BT) and the declared metrics

The trainer calls the loss once per micro-batch on the last pipeline stage. `LossBatch` holds the
micro-batch's log-probs under the current weights (`logp_BT`, the only tensor with a gradient), the
old and reference log-probs, the response mask, and every named tensor the controller sent with the
batch (`tensors`: "advantages" [B] or [B, T], and whatever else the algorithm adds). Means must use
the *global* counts (`num_tokens`, `num_seqs`: the whole batch over all data-parallel ranks; see
`aggregation.aggregate`) so that the micro-batch losses add up to the full-batch loss; declared
metrics are summed the same way, so they too must be global means. Shape legend: B sequences, T
response positions.

Rollout correction (`algorithm.rollout_correction`): with `mis` the trainer has already taken the
rejected sequences (or tokens) out of `b.mask_BT`, `b.num_tokens` and `b.num_seqs`, so every loss
leaves them out of every term and denominator without doing anything. With `tis`, `b.correction_BT`
holds the truncated importance weights of the old log-probs against the engine's (behaviour) ones,
and the loss must multiply its policy-gradient term by them (`b.corrected(pg_BT)`); `call_loss`
stops the step naming the loss when it never read them (the weights would not be applied, and the
train/tis_* metrics would describe a correction that did not happen).

Built-ins: `grpo` (PPO clip + KL to the reference, `grpo.grpo_loss`), `dr_grpo` (the same with
`seq-mean-token-sum-norm`), `sft` (cross-entropy), `gspo` (sequence-level ratio and clip), `ppo` (the clipped
surrogate on token-level advantages with decoupled clip, as REINFORCE++ and PPO use it). A user's
loss is `package.module:function`, resolved once per trainer rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from hpcrl.algorithms.aggregation import aggregate
from hpcrl.algorithms.grpo import GRPOLossConfig, grpo_loss
from hpcrl.algorithms.gspo import gspo_loss
from hpcrl.algorithms.policy_loss import ppo_clip_loss
from hpcrl.user_module import import_user_module

SIGNATURE = "def loss(b: LossBatch, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]"


@dataclass
class LossBatch:
    """One micro-batch as a loss sees it (see the module docstring)."""

    logp_BT: torch.Tensor
    old_logp_BT: torch.Tensor
    ref_logp_BT: torch.Tensor | None
    mask_BT: torch.Tensor
    num_tokens: float
    num_seqs: float
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    correction: InitVar[torch.Tensor | None] = None
    """algorithm.rollout_correction tis: the detached per-token importance weights for the policy-
    gradient term (read them as `correction_BT`, or apply them with `corrected`); None otherwise."""
    _weights_BT: torch.Tensor | None = field(init=False, repr=False, default=None)
    _weights_read: bool = field(init=False, repr=False, default=False)

    def __post_init__(self, correction: torch.Tensor | None) -> None:
        self._weights_BT = correction

    @property
    def correction_BT(self) -> torch.Tensor | None:
        """The TIS weights (None without them); reading them counts as applying them."""
        self._weights_read = True
        return self._weights_BT

    def corrected(self, pg_BT: torch.Tensor) -> torch.Tensor:
        """`pg_BT` times the rollout-correction weights (unchanged when there are none)."""
        weights_BT = self.correction_BT
        return pg_BT if weights_BT is None else pg_BT * weights_BT

    def correction_ignored(self) -> bool:
        """Whether there are weights the loss never read (so never applied)."""
        return self._weights_BT is not None and not self._weights_read

    def advantages_BT(self) -> torch.Tensor:
        """The batch's "advantages" as [B, T] (a per-sequence [B] tensor is broadcast over T)."""
        adv = self.tensors["advantages"].to(self.logp_BT.dtype)
        return adv.unsqueeze(1).expand_as(self.logp_BT) if adv.dim() == 1 else adv


@dataclass(frozen=True)
class PolicyLoss:
    """A loss function and the names of the metrics it returns (in this order)."""

    name: str
    fn: Callable[[LossBatch, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    metrics: tuple[str, ...]


def policy_loss(metrics: tuple[str, ...] = ()) -> Callable:
    """Decorator declaring the metric names a loss returns (every rank must know them up front)."""
    def mark(fn: Callable) -> Callable:
        fn.loss_metrics = tuple(metrics)  # type: ignore[attr-defined]
        return fn
    return mark


def _needs_ref(b: LossBatch, cfg: Any, name: str) -> None:
    if cfg.kl_coef > 0 and b.ref_logp_BT is None:
        raise ValueError(f"loss {name!r} with algorithm.kl_coef > 0 needs the reference log-probs "
                         "(rl.update_policy(..., ref_logprobs=rl.ref_logprobs(rollout)))")


def _cfg(cfg: Any, loss_agg: str | None = None) -> GRPOLossConfig:
    return GRPOLossConfig(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high or None,
                          clip_ratio_c=cfg.clip_ratio_c, kl_coef=cfg.kl_coef,
                          kl_estimator=cfg.kl_estimator, loss_agg=loss_agg or cfg.loss_agg,
                          loss_agg_norm=cfg.loss_agg_norm or None)


def _per_sequence(b: LossBatch, loss: str) -> torch.Tensor:
    """The batch's advantages, which `loss` takes per sequence ([B]); ValueError naming the shape if not."""
    adv = b.tensors["advantages"]
    if adv.dim() != 1:
        raise ValueError(f"loss {loss!r} takes per-sequence advantages [B], got shape {tuple(adv.shape)}")
    return adv


@policy_loss(metrics=("pg_loss", "kl", "clip_frac"))
def grpo(b: LossBatch, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped loss (clip range [1 - clip_eps, 1 + clip_eps_high]) with the KL penalty
    (`hpcrl.algorithms.grpo.grpo_loss`), aggregated per `algorithm.loss_agg`."""
    _needs_ref(b, cfg, "grpo")
    return grpo_loss(b.logp_BT, b.old_logp_BT, b.ref_logp_BT, _per_sequence(b, "grpo"), b.mask_BT, _cfg(cfg),
                     num_tokens=b.num_tokens, num_seqs=b.num_seqs, weights_BT=b.correction_BT)


@policy_loss(metrics=("pg_loss", "clip_frac"))
def gspo(b: LossBatch, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the length-normalised sequence ratio, clipped per sequence to [1 - clip_eps,
    1 + clip_eps_high] (`gspo.gspo_loss`; the paper uses 3e-4 and 4e-4), each sequence weighted
    equally (seq-mean-token-mean)."""
    pg_BT, m = gspo_loss(b.logp_BT, b.old_logp_BT, b.advantages_BT(), b.mask_BT,
                         clip_eps_low=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high or cfg.clip_eps)
    pg = aggregate(b.corrected(pg_BT), b.mask_BT, "seq-mean-token-mean", b.num_tokens, b.num_seqs)
    clip = aggregate(m["clip_frac"], b.mask_BT, "token-mean", b.num_tokens)
    return pg, {"pg_loss": pg.detach(), "clip_frac": clip.detach()}


@policy_loss(metrics=("pg_loss", "clip_frac"))
def ppo(b: LossBatch, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate on token-level advantages (REINFORCE++, PPO), aggregated per
    `algorithm.loss_agg`; clip range [1 - clip_eps, 1 + clip_eps_high] (DAPO's clip-higher when
    clip_eps_high > clip_eps), dual clip at algorithm.clip_ratio_c when set. No KL term: those
    algorithms put the KL penalty into the reward."""
    c = _cfg(cfg)
    pg_BT, m = ppo_clip_loss(b.logp_BT, b.old_logp_BT, b.advantages_BT(), clip_eps_low=c.clip_eps,
                             clip_eps_high=c.clip_eps_high, clip_ratio_c=c.clip_ratio_c)
    pg = aggregate(b.corrected(pg_BT), b.mask_BT, c.loss_agg, b.num_tokens, b.num_seqs, c.loss_agg_norm)
    clip = aggregate(m["clip_frac"], b.mask_BT, "token-mean", b.num_tokens)
    return pg, {"pg_loss": pg.detach(), "clip_frac": clip.detach()}


@policy_loss(metrics=("pg_loss", "kl", "clip_frac"))
def dr_grpo(b: LossBatch, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's loss aggregated as Dr. GRPO: each sequence's token sum over the constant
    algorithm.loss_agg_norm (`seq-mean-token-sum-norm`), whatever algorithm.loss_agg says."""
    _needs_ref(b, cfg, "dr_grpo")
    return grpo_loss(b.logp_BT, b.old_logp_BT, b.ref_logp_BT, _per_sequence(b, "dr_grpo"), b.mask_BT,
                     _cfg(cfg, "seq-mean-token-sum-norm"), num_tokens=b.num_tokens, num_seqs=b.num_seqs,
                     weights_BT=b.correction_BT)


@policy_loss(metrics=("nll",))
def sft(b: LossBatch, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised fine-tuning: the negative log-likelihood of the response tokens, a mean over every
    token of the batch (advantages unused)."""
    nll = aggregate(-b.logp_BT, b.mask_BT, "token-mean", b.num_tokens)
    return nll, {"nll": nll.detach()}


BUILTIN_LOSSES = {"grpo": grpo, "dr_grpo": dr_grpo, "gspo": gspo, "ppo": ppo, "sft": sft}


def resolve_loss(spec: str) -> PolicyLoss:
    """The loss named by `spec`: a built-in name or `package.module:function`; ValueError with the
    fix when it cannot be used."""
    fn = BUILTIN_LOSSES.get(spec)
    if fn is None:
        module_name, sep, attr = spec.partition(":")
        if not sep:
            raise ValueError(f"loss {spec!r} is neither a built-in loss ({', '.join(BUILTIN_LOSSES)}) nor an "
                             f"import path 'package.module:function' of `{SIGNATURE}`")
        module = import_user_module(module_name, f"loss {spec!r}", "put it on PYTHONPATH")
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"loss {spec!r}: module {module_name!r} has no function {attr!r}")
    return PolicyLoss(spec, fn, tuple(getattr(fn, "loss_metrics", ())))


def call_loss(loss: PolicyLoss, b: LossBatch, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss` on one micro-batch, held to its contract: a scalar loss, every declared metric, and the
    TIS weights of `b` applied (ValueError naming the loss otherwise)."""
    value, metrics = loss.fn(b, cfg)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise ValueError(f"loss {loss.name!r} returned {type(value).__name__} of shape "
                         f"{tuple(getattr(value, 'shape', ()))}; it must return a scalar tensor")
    missing = [k for k in loss.metrics if k not in metrics]
    if missing:
        raise ValueError(f"loss {loss.name!r} declared metrics {missing} but did not return them")
    if b.correction_ignored():
        raise ValueError(f"loss {loss.name!r} never applied algorithm.rollout_correction: tis (its "
                         "importance weights): multiply its policy-gradient term by them with "
                         "b.corrected(pg_BT), or set algorithm.rollout_correction: none (mis needs nothing "
                         "of a loss)")
    return value, metrics
