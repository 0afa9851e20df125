"""Subprocess body of test_export: train a 1-rank Megatron policy for 2 steps, save a checkpoint
through the trainer's checkpoint I/O, export it with `hpcrl export`, and compare the exported HF
model's log-probs with the trainer's on the same tokens. argv: WORK_DIR. Prints MAXDIFF <x>."""

import datetime
import json
import subprocess
import sys
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist

    from hpcrl.dist import free_port

    work = Path(sys.argv[1])
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    from hpcrl.config import to_dict
    from hpcrl.config.schema import AlgorithmConfig, JobConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer import checkpoint_io
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.policy import MegatronPolicy

    hf = load_hf_config("tiny-qwen3-moe", None)
    policy = MegatronPolicy(hf, TrainerConfig(), AlgorithmConfig(lr=1e-2))
    policy.init_from_seed(7)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (3,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(3, 50, (4,), generator=g).tolist() for _ in range(8)]
    batch = TrainBatch.from_lists(prompts, responses)
    for _ in range(2):
        old = policy.compute_logprobs(batch)
        policy.train_step(batch, torch.randn(8, generator=g), old)
    job = JobConfig()
    run = work / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(job)))
    (run / "model_config.json").write_text(json.dumps(hf))
    checkpoint_io.save(policy, str(run / "checkpoints"), 1, "attempt", 3, {"step": 1})
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "export", str(run), "--step", "1", "--out",
                          str(work / "hf")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(work / "hf"), dtype=torch.float32).eval()
    trainer = policy.compute_logprobs(batch)
    with torch.no_grad():
        logits = model(batch.tokens_BL).logits
    logp = torch.log_softmax(logits.float(), -1)
    pos, tgt = batch.logit_positions_BT(), batch.response_tokens_BT()
    hf_lp = logp[torch.arange(8)[:, None], pos, ].gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    mask = batch.response_mask_BT()
    print(f"MAXDIFF {(hf_lp - trainer).abs()[mask].max().item():.3e}", flush=True)
    print(f"CHANGED {(policy.export_hf_state_dict()['lm_head.weight'] != 0).any().item()}", flush=True)


if __name__ == "__main__":
    main()
