"""SFT: supervised fine-tuning on the data's answers, the smallest dataflow and a warm start before
RL. Each step takes the next block of prompts with their reference answers (then a stop token) as
the responses, and minimises the answers' negative log-likelihood (`sft` loss, a mean over tokens);
no generation. Evaluation (eval.*) and checkpoints work as for RL; `hpcrl export` then gives the
model.path of an RL run."""

from __future__ import annotations

import numpy as np

from hpcrl.controller.api import RL

DEFAULTS = {"loss_agg": "token-mean"}
"""The only per-algorithm key SFT reads (hpcrl/dataflows/_declared.py): no ratio to clip, no KL."""
FIXED = ("loss_agg",)
"""The `sft` loss is the mean over every answer token of the batch."""


def step(rl: RL, step: int) -> None:
    batch = rl.demonstrations()
    rl.update_policy(batch, np.zeros(len(batch.response_ids), dtype=np.float32), loss="sft")
    rl.sync_weights()  # the engines serve evaluation with the trained weights
