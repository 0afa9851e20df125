"""hpcrl's Megatron train step against a plain HuggingFace train step of the same model (what TRL
runs), alternating in one process: where the tiny run's train phase loses to TRL's.

The tiny-qwen3-moe preset as a MegatronPolicy (`train_step(on_policy=True)`: forward, grpo loss,
backward, Megatron DDP, Adam) and as transformers' Qwen3MoeForCausalLM with torch's fused Adam,
one step each on the same 64 rows (prompt 2 tokens, responses 1-4): the HF step is the clipped
surrogate with token-mean aggregation plus the router aux loss, as TRL computes it. Steps alternate
(which model goes first alternates too), so the host's drift cancels; each is timed back to back
and right after a 30 ms sleep (hpcrl's trainer sleeps through generation, TRL's does not).
Per-part times come from wrapping Megatron's and transformers' own methods (attention and MoE
forward per layer, the model forward, the backward); "rest" is the step less its parts (hpcrl:
batch split, DDP grad sync, optimizer; HF: optimizer). One torch thread, a one-rank gloo world.

    .venv/bin/python benchmarks/train_step_vs_hf.py [--steps 60] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import time
from pathlib import Path

import torch

from results_md import append_to_section, run_heading
from tiny_train_batch import one_rank_world, tiny_rows

PARTS = ("attention forward", "MoE forward", "model forward", "loss", "backward", "rest")


def _timed(owner: object, name: str, part: str, acc: dict[str, float]) -> None:
    """Wrap owner.name so that its wall time adds to acc[part]."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[part] += time.perf_counter() - t0

    setattr(owner, name, wrapped)


def _models(acc: dict[str, dict[str, float]]):
    import megatron.core.models.gpt.gpt_model as gpt_model
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.transformer_layer as transformer_layer
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.policy import MegatronPolicy

    config = load_hf_config("tiny-qwen3-moe", None)
    policy = MegatronPolicy(config, TrainerConfig(micro_batch_size=64), AlgorithmConfig(aux_loss_coef=0.01))
    policy.init_from_seed(1234)
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "dtype")}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **kwargs),
                                          dtype=torch.float32).train()
    adam = torch.optim.Adam(hf.parameters(), lr=5e-3, fused=True)

    prompts, responses, adv_B = tiny_rows(config["vocab_size"])
    batch = TrainBatch.from_lists(prompts, responses)
    width = 2 + max(map(len, responses))
    ids_BL = torch.zeros(64, width, dtype=torch.long)
    mask_BL = torch.zeros(64, width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids_BL[i, :len(p) + len(r)] = torch.tensor(p + r)
        mask_BL[i, :len(p) + len(r)] = 1
    resp_mask_BT = mask_BL[:, 2:].float()

    mg, hp = acc["hpcrl"], acc["hf"]
    _timed(transformer_layer.TransformerLayer, "_forward_attention", "attention forward", mg)
    _timed(transformer_layer.TransformerLayer, "_forward_mlp", "MoE forward", mg)
    _timed(gpt_model.GPTModel, "forward", "model forward", mg)
    _timed(schedules, "forward_step", "forward step", mg)
    _timed(schedules, "backward_step", "backward", mg)
    _timed(hf_qwen.Qwen3MoeAttention, "forward", "attention forward", hp)
    _timed(hf_qwen.Qwen3MoeSparseMoeBlock, "forward", "MoE forward", hp)
    _timed(hf_qwen.Qwen3MoeForCausalLM, "forward", "model forward", hp)

    def hpcrl_step() -> None:
        policy.train_step(batch, adv_B, on_policy=True)

    def hf_step() -> None:
        out = hf(input_ids=ids_BL, attention_mask=mask_BL, output_router_logits=True)
        t0 = time.perf_counter()
        logp_BT = torch.log_softmax(out.logits[:, 1:-1].float(), -1).gather(-1, ids_BL[:, 2:, None])[..., 0]
        ratio_BT = torch.exp(logp_BT - logp_BT.detach())
        pg_BT = -torch.min(ratio_BT * adv_B[:, None], ratio_BT.clamp(0.8, 1.2) * adv_B[:, None])
        loss = (pg_BT * resp_mask_BT).sum() / resp_mask_BT.sum() + 0.01 * out.aux_loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        adam.step()
        adam.zero_grad()
        hp["loss"] += t1 - t0
        hp["backward"] += t2 - t1

    return hpcrl_step, hf_step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="measured rounds (each: 2 steps of each model)")
    ap.add_argument("--results", type=Path, help="append the tables under '## train_step_vs_hf' here")
    args = ap.parse_args()
    if args.steps < 10:
        ap.error(f"--steps={args.steps}: need >= 10")
    one_rank_world()
    acc: dict[str, dict[str, float]] = {k: collections.defaultdict(float) for k in ("hpcrl", "hf")}
    steps = dict(zip(("hpcrl", "hf"), _models(acc)))
    for _ in range(15):
        for step in steps.values():
            step()
    load0 = os.getloadavg()[0]
    times: dict[str, list[float]] = {f"{k} {w}": [] for k in steps for w in ("warm", "after sleep")}
    for k in acc:
        acc[k].clear()
    for i in range(args.steps):
        for name in (("hpcrl", "hf") if i % 2 else ("hf", "hpcrl")):
            t0 = time.perf_counter()
            steps[name]()
            times[f"{name} warm"].append(time.perf_counter() - t0)
            time.sleep(0.03)
            t0 = time.perf_counter()
            steps[name]()
            times[f"{name} after sleep"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    per_step = {k: {p: v / (2 * args.steps) * 1e3 for p, v in a.items()} for k, a in acc.items()}
    mg = per_step["hpcrl"]
    mg["loss"] = mg.pop("forward step") - mg["model forward"]
    for k, parts in per_step.items():
        mean_step = sum(times[f"{k} warm"] + times[f"{k} after sleep"]) / (2 * args.steps) * 1e3
        parts["rest"] = mean_step - sum(parts[p] for p in ("model forward", "loss", "backward"))
        parts["model forward"] -= parts["attention forward"] + parts["MoE forward"]
    rows = [f"| {p if p != 'model forward' else 'rest of the model forward'} | {per_step['hpcrl'][p]:.2f} | "
            f"{per_step['hf'][p]:.2f} | {per_step['hpcrl'][p] / per_step['hf'][p]:.2f} |" for p in PARTS]
    text = "\n".join([
        run_heading(f".venv/bin/python benchmarks/train_step_vs_hf.py --steps {args.steps}"), "",
        f"One torch thread; load average (1 min) {load0:.1f} before, {os.getloadavg()[0]:.1f} after.", "",
        "| step (median ms) | hpcrl (Megatron) | HF (TRL's kind) | hpcrl / HF |", "|---|---|---|---|",
        *(f"| {w} | {med[f'hpcrl {w}']:.2f} | {med[f'hf {w}']:.2f} | "
          f"{med[f'hpcrl {w}'] / med[f'hf {w}']:.2f} |" for w in ("warm", "after sleep")),
        f"| hpcrl after sleep / HF warm (the e2e situation) | {med['hpcrl after sleep']:.2f} | "
        f"{med['hf warm']:.2f} | {med['hpcrl after sleep'] / med['hf warm']:.2f} |", "",
        "Mean ms per step by part (both step kinds):", "",
        "| part | hpcrl (Megatron) | HF | hpcrl / HF |", "|---|---|---|---|", *rows, ""])
    print(text)
    if args.results:
        append_to_section(args.results, "## train_step_vs_hf", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
