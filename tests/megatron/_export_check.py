"""mpiexec body of test_export (2 ranks, EP=2): train a Megatron policy 2 steps, save a checkpoint
through the trainer's checkpoint I/O, hash the policy (no gather), export it twice without a gather
(the trainer's collective `export_hf_dir`, its peak RSS measured; `hpcrl export` of the checkpoint
into several small files, with the tokenizer of the run's model.path) and check both against the
trainer. argv: WORK_DIR. Rank 0 prints `RESULT <json>`."""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: hf_fixtures, numerics
from numerics import logit_bound, logprob_bound, longest_reduction, routing_margin_ratio  # noqa: E402

SHARD = "200KB"  # the tiny model is ~330 KB of float32: two or more files


def make_source(src: Path) -> None:
    """A model directory's non-weight files, as `model.path` would name: tokenizer + generation config."""
    from hf_fixtures import train_tokenizer
    from transformers import GenerationConfig

    tok = train_tokenizer(src)
    GenerationConfig(eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>")]).save_pretrained(str(src))


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from mpi4py import MPI

    from hpcrl.dist import init_torch_distributed

    init_torch_distributed(MPI.COMM_WORLD, "gloo", timeout_s=240)
    import torch.distributed as dist

    from checkpoints.hf_safetensors import dir_digest
    from hpcrl.config import to_dict
    from hpcrl.config.schema import AlgorithmConfig, JobConfig, TrainerConfig
    from hpcrl.memwatch import peak_rss
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer import checkpoint_io
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.policy import MegatronPolicy

    work, rank = Path(sys.argv[1]), dist.get_rank()
    hf = load_hf_config("tiny-qwen3-moe", None)
    policy = MegatronPolicy(hf, TrainerConfig(ep=2, num_procs=2), AlgorithmConfig(lr=1e-2))
    policy.init_from_seed(7)
    g = torch.Generator().manual_seed(5)  # its batch routes clear of near-ties (ratio 20; seed 0: 1.01)
    prompts = [torch.randint(3, 50, (3,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(3, 50, (4,), generator=g).tolist() for _ in range(8)]
    batch = TrainBatch.from_lists(prompts, responses)
    for _ in range(2):
        old = policy.compute_logprobs(batch)
        policy.train_step(batch, torch.randn(8, generator=g), old)
    run, src = work / "run", work / "source"
    if rank == 0:
        (run / "checkpoints").mkdir(parents=True)
        job = JobConfig()
        job.model.path = str(src)
        (run / "config.json").write_text(json.dumps(to_dict(job)))
        (run / "model_config.json").write_text(json.dumps(hf))
        make_source(src)
    dist.barrier()
    checkpoint_io.save(policy, str(run / "checkpoints"), 1, "attempt", 3, {"step": 1})
    sha = policy.policy_sha256()
    with peak_rss() as mem:
        policy.export_hf_dir(str(work / "trainer_hf"), 150_000, str(src))
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (mem.exact, mem.rise_bytes))
    full = policy.export_hf_state_dict()  # gathered on rank 0: debug size, for the comparison only
    trainer = policy.compute_logprobs(batch)
    if rank != 0:
        dist.barrier()
        return
    (run / "final.json").write_text(json.dumps({"policy_sha256": sha, "num_steps": 2}))
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "export", str(run), "--step", "1", "--out",
                          str(work / "hf"), "--max-shard-size", SHARD], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe.digest import state_dict_digest
    from moe.hf_megatron import HFModelDims, hf_fused_to_checkpoint

    result: dict = {"stdout": out.stdout, "peaks": peaks, "sha": sha}
    for name in ("hf", "trainer_hf"):
        d = work / name
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        loaded = hf_fused_to_checkpoint(model.state_dict(), HFModelDims.from_hf_config(hf))
        with torch.no_grad():
            out = model(batch.tokens_BL, output_router_logits=True)  # no padding: every position is real
            logp = torch.log_softmax(out.logits.float(), -1)
        pos, tgt = batch.logit_positions_BT(), batch.response_tokens_BT()
        hf_lp = logp[torch.arange(8)[:, None], pos].gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        # The trainer (EP2) and HF sum in other orders: logit_bound, the preset's longest reduction
        # over the batch's 7 positions; comparable if no router near-tie lies within the bound.
        apart = logit_bound(hf, out.logits.abs().max().item(), batch.seq_len)
        result[name] = {
            "files": sorted(p.name for p in d.iterdir()),
            "index": json.loads((d / "model.safetensors.index.json").read_text()),
            "maxdiff": (hf_lp - trainer).abs()[batch.response_mask_BT()].max().item(),
            "bound": logprob_bound(apart, hf["vocab_size"]),
            "routing_ratio": routing_margin_ratio(list(out.router_logits), hf["num_experts_per_tok"],
                                                  longest_reduction(hf, batch.seq_len)),
            "weights_equal": list(loaded) == list(full)
            and all(torch.equal(loaded[k], full[k]) for k in full),
            "digest": dir_digest(d), "loaded_digest": state_dict_digest(loaded),
            "tokenizer_eos": AutoTokenizer.from_pretrained(str(d)).eos_token,
        }
    result["total_size"] = sum(t.numel() * t.element_size() for t in full.values())
    result["changed"] = bool((full["lm_head.weight"] != 0).any())
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()


if __name__ == "__main__":
    from hpcrl.worker_main import finalize_and_exit

    main()
    finalize_and_exit(0)  # as hpcrl's ranks end: no gloo/Megatron teardown at interpreter exit
