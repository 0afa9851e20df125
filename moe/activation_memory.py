"""The activations a trainer rank keeps for the backward of a training step, where they can be counted
exactly: what `hpcrl plan` adds to the trainer's memory per GPU.

`activation_memory(dims, layout, step, dtype_bytes)` counts, for each pipeline stage, per micro-batch
in flight, two terms (hpcrl's trainer as hpcrl/trainer/policy.py builds it):

    layer inputs  under full recomputation (`StepShape.recompute == "full"`), the input of each
                  recomputed chunk, [L / (cp * tp), mb, H] at the model's dtype (sequence parallel
                  splits the hidden states over tp when tp > 1): method uniform keeps one per chunk
                  of `recompute_num_layers` layers, method block one for each of the stage's first
                  `recompute_num_layers` layers (the rest keep everything, not counted here)
    log-prob head on the last stage, the softmax's exp over the rank's vocab shard, float32
                  [mb, T / cp, ceil(V / tp)] (T: the response positions); with the entropy bonus
                  (`StepShape.entropy_grad`) the float32 logits of those positions too

and the micro-batches in flight: Megatron's 1F1B schedule runs `pp - stage` forwards before the
stage's first backward (at most the step's micro-batches), one without pipelining. Both terms are
measured on CPU: tests/megatron/test_recompute.py (one [L, mb, H] input per chunk; 4 * mb * T bytes
per vocab entry, 8 with the entropy bonus) with saved-tensor hooks (hpcrl/trainer/saved_activations.py).

Not counted, so the figure is a lower bound (`not_counted` says what, for the job): the decoder
layers' own activations without full recomputation (and the layers block recomputation leaves
whole), which depend on the kernels (flash attention and transformer-engine's fused modules on GPUs
keep other tensors than the CPU path); the working set of one chunk's recomputation in the backward
and the forward's transients (the head's logits of every position and of the response positions at
the model's dtype, and one chunk of positions' float32 arrays: hpcrl/trainer/policy.py
HEAD_CHUNK_BYTES), one micro-batch at a time; the embedding's token ids
and the output layer's input (O(L * H) per micro-batch). Context parallelism (plan-only in hpcrl)
is counted as splitting every sequence's positions evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe.layouts import TrainerLayout
from moe.specs import ModelDims

__all__ = ["RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS", "StepShape", "activation_memory"]

RECOMPUTE_GRANULARITIES = ("none", "full", "selective")
"""Megatron's recompute_granularity values (trainer.recompute_granularity; hpcrl validate takes them from here)."""
RECOMPUTE_METHODS = ("uniform", "block")
"""Megatron's recompute_method values (trainer.recompute_method)."""
FP32_BYTES = 4


@dataclass(frozen=True, slots=True)
class StepShape:
    """A training step as one trainer rank runs it: its longest micro-batch and how many there are.

    `seq_len` is the padded sequence (prompt + response tokens, a multiple of tp), `response_len`
    the response positions the loss reads log-probs at, `num_micro_batches` the micro-batches of
    one optimizer step on one DP rank (the pipeline's M). `recompute` is trainer.recompute_granularity.
    """

    seq_len: int
    response_len: int
    micro_batch_size: int
    num_micro_batches: int
    entropy_grad: bool = False
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1

    def __post_init__(self) -> None:
        for name in ("seq_len", "response_len", "micro_batch_size", "num_micro_batches", "recompute_num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"StepShape.{name}={v!r} must be a positive int")
        if self.response_len > self.seq_len:
            raise ValueError(f"StepShape.response_len={self.response_len} exceeds seq_len={self.seq_len}")
        if self.recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"StepShape.recompute={self.recompute!r}; valid: {', '.join(RECOMPUTE_GRANULARITIES)}")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"StepShape.recompute_method={self.recompute_method!r}; valid: {RECOMPUTE_METHODS}")


def activation_memory(dims: ModelDims, layout: TrainerLayout, step: StepShape, dtype_bytes: int) -> dict:
    """Per stage and at most per GPU, the bytes of the counted activations (module docstring):
    {"per_stage": [{"stage", "layers", "in_flight", "layer_inputs_bytes", "head_bytes", "bytes"}],
    "bytes_per_gpu", "not_counted"}: a lower bound. `dtype_bytes` is the model's parameter dtype's size."""
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    tokens = math.ceil(step.seq_len / (cp * (tp if tp > 1 else 1))) * step.micro_batch_size
    hidden_bytes = tokens * dims.hidden_size * dtype_bytes  # one layer input [L / (cp * tp), mb, H]
    vocab_shard = math.ceil(dims.vocab_size / (layout.vocab_divisible_by * tp)) * layout.vocab_divisible_by
    head = (FP32_BYTES * (2 if step.entropy_grad else 1) * step.micro_batch_size
            * math.ceil(step.response_len / cp) * vocab_shard)
    stages = []
    whole_layers = 0  # layers whose own activations are not counted
    for s, layers in enumerate(layout.stage_layers(dims.num_layers)):
        n = len(layers)
        if step.recompute != "full":
            inputs, whole_layers = 0, whole_layers + n
        elif step.recompute_method == "uniform":
            inputs = math.ceil(n / step.recompute_num_layers)
        else:
            inputs = min(n, step.recompute_num_layers)
            whole_layers += n - inputs
        in_flight = min(pp - s, step.num_micro_batches)
        stage = {"stage": s, "layers": n, "in_flight": in_flight,
                 "layer_inputs_bytes": in_flight * inputs * hidden_bytes,
                 "head_bytes": in_flight * head if s == pp - 1 else 0}
        stage["bytes"] = stage["layer_inputs_bytes"] + stage["head_bytes"]
        stages.append(stage)
    not_counted = [("one chunk's recomputation in the backward and " if step.recompute == "full" else "")
                   + "the forward's transients, one micro-batch at a time"]
    if whole_layers:
        why = ("trainer.recompute_granularity is not full" if step.recompute != "full"
               else "the layers block recomputation leaves whole")
        not_counted.insert(0, f"the own activations of {whole_layers} decoder layers ({why}: they depend on "
                              "the kernels)")
    return {"per_stage": stages, "bytes_per_gpu": max(st["bytes"] for st in stages),
            "not_counted": "; ".join(not_counted)}
