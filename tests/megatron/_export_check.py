"""mpiexec body of test_export (2 ranks, EP=2): train a Megatron policy 2 steps, save a checkpoint
through the trainer's checkpoint I/O, hash the policy (no gather), export it twice without a gather
(the trainer's collective `export_hf_dir`, its peak RSS measured; `hpcrl export` of the checkpoint
into several small files, with the tokenizer of the run's model.path) and check both against the
trainer. Then the same ranks build a bf16 DeepSeek-V3 policy under PP2 (`deepseek_exports`) and
export it from a bf16 directory with an MTP layer and from its FP8 copy. argv: WORK_DIR DEEPSEEK_DIR
FP8_DIR.
Rank 0 prints `RESULT <json>`."""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: hf_fixtures, numerics
from numerics import logit_bound, logprob_bound, longest_reduction, routing_margin_ratio  # noqa: E402

SHARD = "200KB"  # the tiny model is ~330 KB of float32: two or more files
DS_SHARD = 100_000  # tiny-deepseek-v3 is ~290 KB in bf16 with its MTP layer: several files


def make_source(src: Path) -> None:
    """A model directory's non-weight files, as `model.path` would name: tokenizer + generation config."""
    from hf_fixtures import train_tokenizer
    from transformers import GenerationConfig

    tok = train_tokenizer(src)
    GenerationConfig(eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>")]).save_pretrained(str(src))


def qwen_exports(work: Path) -> dict | None:
    """The tiny-qwen3-moe part (see the module docstring); rank 0 returns its checks, None elsewhere.
    Collective."""
    import torch
    import torch.distributed as dist

    from checkpoints.hf_safetensors import dir_digest
    from hpcrl.config import to_dict
    from hpcrl.config.schema import AlgorithmConfig, JobConfig, TrainerConfig
    from hpcrl.memwatch import peak_rss
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer import checkpoint_io
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.policy import MegatronPolicy

    rank = dist.get_rank()
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
        return None
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
    dist.barrier()
    return result


def check_dir(d: Path, want: dict, sha: str) -> dict:
    """An export directory against the tensors it must hold (`want`: name -> tensor, bit for bit)
    and the policy hash it must have; rank 0 only."""
    from deepseek_dirs import load_dir
    from transformers import AutoModelForCausalLM

    from checkpoints.hf_safetensors import dir_digest
    from hpcrl.rollout.hf_names import checkpoint_state_dict

    got = load_dir(d)
    config = json.loads((d / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype="auto")  # the MTP layer: unexpected keys
    loaded = checkpoint_state_dict(model)
    return {"missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)),
            "bits_differ": [n for n in want if n in got and _bytes(got[n]) != _bytes(want[n])],
            "dtype_differ": [n for n in want if n in got and got[n].dtype != want[n].dtype],
            "num_mtp": sum(n.startswith("model.layers.3.") for n in got),
            "digest_ok": dir_digest(d) == sha, "config_dtype": config.get("dtype"),
            "quantization_config": "quantization_config" in config,
            "hf_dtype": str(model.dtype), "hf_bias_dtypes": sorted({str(t.dtype) for n, t in loaded.items()
                                                                     if "e_score_correction_bias" in n}),
            # transformers keeps the router weight in float32 too (_keep_in_fp32_modules_strict)
            "hf_differ": [n for n, t in loaded.items() if n not in want or _bytes(t.to(want[n].dtype))
                          != _bytes(want[n])]}


def _bytes(t) -> bytes:
    """The raw bytes of a CPU tensor (dtype-agnostic: viewed as uint8)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def deepseek_exports(work: Path, ds_dir: Path, fp8_dir: Path) -> dict | None:
    """A bf16 DeepSeek-V3 policy (PP2) loads the bf16 directory, takes one train step at lr 0,
    exports (trainer and `hpcrl export` of its checkpoint), round-trips its checkpoint; then loads
    the FP8 copy and exports it both ways. Rank 0 returns the checks; None elsewhere. Collective."""
    import torch
    import torch.distributed as dist
    from deepseek_dirs import load_dir
    from fp8_quantize import dequantized_state_dict

    from hpcrl.config import to_dict
    from hpcrl.config.schema import AlgorithmConfig, JobConfig, TrainerConfig
    from hpcrl.export import export_checkpoint
    from hpcrl.trainer import checkpoint_io
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.model import weight_tensors
    from hpcrl.trainer.policy import MegatronPolicy
    from moe.digest import state_dict_digest

    from megatron.core import parallel_state

    rank = dist.get_rank()
    cfg = json.loads((ds_dir / "config.json").read_text())
    # PP2 (layers 0-1 | layer 2, norm, lm_head): rank 1 then sends rank 0 bf16 weights and a float32
    # bias (export_hf_state_dict's per-dtype messages) and writes its own part of the export
    parallel_state.destroy_model_parallel()  # the qwen part's EP2 groups
    trainer = TrainerConfig(pp=2, num_procs=2, last_stage_layers=1)
    policy = MegatronPolicy(cfg, trainer, AlgorithmConfig(lr=0.0, kl_coef=0.0), dtype="bfloat16")
    g = torch.Generator().manual_seed(9)
    batch = TrainBatch.from_lists([torch.randint(3, 60, (3,), generator=g).tolist() for _ in range(4)],
                                  [torch.randint(3, 60, (3,), generator=g).tolist() for _ in range(4)])
    out: dict = {}
    for kind, src in (("bf16", ds_dir), ("fp8", fp8_dir)):
        policy.load_hf_dir(str(src))
        res: dict = {}
        if kind == "bf16":
            m = policy.train_step(batch, torch.linspace(-1.0, 1.0, 4), policy.compute_logprobs(batch))
            res["grad_norm"] = None if m is None else float(m["grad_norm"])
        policy.export_hf_dir(str(work / f"ds_{kind}_trainer"), DS_SHARD, str(src))
        sha_mtp, sha = policy.policy_sha256(str(src)), policy.policy_sha256()
        sd = policy.export_hf_state_dict()
        run = work / f"ds_{kind}_run"
        if rank == 0:
            (run / "checkpoints").mkdir(parents=True)
            job = JobConfig()
            job.model.path, job.model.dtype = str(src), "bfloat16"
            (run / "config.json").write_text(json.dumps(to_dict(job)))
            (run / "model_config.json").write_text(json.dumps(cfg))
        dist.barrier()
        checkpoint_io.save(policy, str(run / "checkpoints"), 1, "attempt", 3, {"step": 1})
        if kind == "bf16":  # the round trip: every weight zeroed, then the checkpoint loaded back
            with torch.no_grad():
                for t in weight_tensors(policy.gpt).values():
                    t.zero_()
            policy.weights_changed()
            checkpoint_io.load(policy, str(run / "checkpoints"), 1)
            sd_loaded = policy.export_hf_state_dict()
        if rank != 0:
            continue
        export_checkpoint(str(run), 1, str(work / f"ds_{kind}_cli"), DS_SHARD)
        if kind == "bf16":
            want = load_dir(src)
        else:  # FP8 weights dequantized (float32, exact) and rounded once to bf16; the rest as stored
            fp8 = {n[: -len("_scale_inv")] for n in load_dir(src) if n.endswith("_scale_inv")}
            want = {n: t.to(torch.bfloat16) if n in fp8 else t
                    for n, t in dequantized_state_dict(src).items()}
            res["num_fp8"] = len(fp8)
            res["num_fp8_mtp"] = sum(n.startswith("model.layers.3.") for n in fp8)
        main = {n: t for n, t in want.items() if n in sd}
        res["state_dict_differ"] = [n for n in want if not n.startswith("model.layers.3.")
                                    and (n not in sd or _bytes(sd[n]) != _bytes(want[n])
                                         or sd[n].dtype != want[n].dtype)]
        res["sd_bias_dtypes"] = sorted({str(t.dtype) for n, t in sd.items() if "e_score_correction" in n})
        res["sha_is_state_dict_digest"] = sha == state_dict_digest(main)
        res["sha_mtp_differs"] = sha_mtp != sha
        if kind == "bf16":
            res["round_trip_differ"] = [n for n in sd if _bytes(sd_loaded[n]) != _bytes(sd[n])
                                        or sd_loaded[n].dtype != sd[n].dtype]
        for path in ("trainer", "cli"):
            res[path] = check_dir(work / f"ds_{kind}_{path}", want, sha_mtp)
        out[kind] = res
    dist.barrier()
    return out if rank == 0 else None


def main() -> None:
    import torch
    from mpi4py import MPI

    from hpcrl.dist import init_torch_distributed

    torch.set_num_threads(1)
    init_torch_distributed(MPI.COMM_WORLD, "gloo", timeout_s=240)
    work = Path(sys.argv[1])
    result = qwen_exports(work)
    deepseek = deepseek_exports(work, Path(sys.argv[2]), Path(sys.argv[3]))
    if result is not None:
        print("RESULT " + json.dumps({**result, "deepseek": deepseek}), flush=True)


if __name__ == "__main__":
    from hpcrl.worker_main import finalize_and_exit

    main()
    finalize_and_exit(0)  # as hpcrl's ranks end: no gloo/Megatron teardown at interpreter exit
