"""The training loss's log-probs over the vocab (hpcrl/trainer/policy.py `_logp_and_entropy`): what a
micro-batch keeps for its backward and what its forward + backward cost, against picking the
response positions with gather (hpcrl's head before, as written below) side by side in one process.

    .venv/bin/python benchmarks/logprob_head.py [--reps 5] [--rows 2] [--prompt 512] [--response 1536]
                                                [--vocab 37984] [--results benchmarks/RESULTS.md]

One rank (a one-process gloo world, Megatron's parallel state at TP 1), one torch thread. The logits
are bfloat16 [rows, prompt + response, vocab] as a bf16 trainer's output layer gives them; the vocab
default is one TP rank's shard of Qwen3's 151,936 at TP 4. gather's backward keeps its whole input:
the logits of every position and the float32 [rows, response, vocab] the target logit is read from.
The bytes are the storages autograd saves (exact, any host) and the most allocated at once during a
forward + backward (the profiler's CPU allocations: hpcrl/trainer/saved_activations.py
`allocated_peak`; hpcrl's head runs its positions in chunks of HEAD_CHUNK_BYTES); the times are
medians of alternating forward + backward passes. Both give the same log-probs and logit gradients bit for bit, or the
benchmark stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from one_rank import one_rank_world
from results_md import publish


def gather_head(logits_BLv: torch.Tensor, pos_BT: torch.Tensor, tgt_BT: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """The baseline: hpcrl's head before (TP 1), positions and targets picked with gather."""
    v = logits_BLv.shape[-1]
    z_BTv = logits_BLv.gather(1, pos_BT.unsqueeze(-1).expand(-1, -1, v)).float() / temperature
    max_BT = z_BTv.detach().amax(dim=-1)
    exp_BTv = torch.exp(z_BTv - max_BT.unsqueeze(-1))
    logz_BT = max_BT + torch.log(exp_BTv.sum(dim=-1))
    return z_BTv.gather(-1, tgt_BT.unsqueeze(-1)).squeeze(-1) - logz_BT


def saved_bytes(fn, logits: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves while `fn(logits)` runs. The logits count where
    they are saved: in the model they are the output layer's output, freed after the forward unless
    the backward keeps them."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits)
    return sum(storages.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=37984)
    ap.add_argument("--results", type=Path, default=None, help="append the table to this RESULTS.md")
    args = ap.parse_args()
    one_rank_world()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hpcrl.trainer.policy import HEAD_CHUNK_BYTES, _logp_and_entropy
    from hpcrl.trainer.saved_activations import allocated_peak

    ps.initialize_model_parallel()
    B, L, T, v = args.rows, args.prompt + args.response, args.response, args.vocab
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, L, v, generator=g).to(torch.bfloat16).requires_grad_()
    pos = (args.prompt - 1 + torch.arange(T)).expand(B, T).contiguous()
    tgt = torch.randint(0, v, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)
    heads = {"gather (before)": lambda x: gather_head(x, pos, tgt, 0.7),
             "index (hpcrl)": lambda x: _logp_and_entropy(x, pos, tgt, 0.7)[0]}

    def step(fn) -> tuple[torch.Tensor, torch.Tensor]:
        logits.grad = None
        logp = fn(logits)
        logp.backward(upstream)
        return logp.detach(), logits.grad

    results = {name: step(fn) for name, fn in heads.items()}
    (want_lp, want_grad), (got_lp, got_grad) = results.values()
    if not (torch.equal(want_lp, got_lp) and torch.equal(want_grad, got_grad)):
        sys.exit("the two heads differ: log-probs or logit gradients")
    saved = {name: saved_bytes(fn, logits) for name, fn in heads.items()}
    peak = {}
    for name, fn in heads.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step(fn)
        peak[name] = allocated_peak(prof.events())
    times: dict[str, list[float]] = {name: [] for name in heads}
    for _ in range(args.reps):
        for name, fn in heads.items():
            t0 = time.perf_counter()
            step(fn)
            times[name].append(time.perf_counter() - t0)
    base = "gather (before)"
    med = {name: statistics.median(t) for name, t in times.items()}
    lines = [f"bf16 logits [{B}, {args.prompt} + {T}, {v}], response positions {T} (hpcrl: chunks of "
             f"{max(1, HEAD_CHUNK_BYTES // (4 * B * v))}), 1 thread, median of {args.reps} alternating forward + "
             "backward passes; log-probs and logit gradients equal bit for bit; the peak allocated from the logits "
             "on (the profiler's CPU allocations)",
             "", "| head | saved for the backward (MiB) | vs gather | peak allocated (MiB) | vs gather | fwd + bwd (s) "
             "| vs gather |", "|---|---|---|---|---|---|---|"]
    for name in heads:
        lines.append(f"| {name} | {saved[name] / 2**20:.1f} | {saved[name] / saved[base]:.3f} | "
                     f"{peak[name] / 2**20:.1f} | {peak[name] / peak[base]:.3f} | {med[name]:.3f} | "
                     f"{med[name] / med[base]:.2f} |")
    publish("\n".join(lines), args.results, "logprob_head", "benchmarks/logprob_head.py", sys.argv[1:])
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
