"""`hpcrl export RUN_DIR --step N --out DIR`: a checkpoint's policy as a HuggingFace model directory.

Writes `model.safetensors` (HF checkpoint names, the on-disk names `save_pretrained` uses, which
`transformers` and SGLang load) and `config.json` (the run's model config). Reads only the
`policy/` tensors of the checkpoint; works for any trainer layout the checkpoint was saved under.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl.config.errors import ConfigError

POLICY_PREFIX = "policy/"


def export_checkpoint(run_dir: str, step: int | None, out_dir: str) -> Path:
    """Export; returns the output directory. ConfigError (exit 2) for a bad run dir or step."""
    from safetensors.torch import save_file

    from checkpoints import CheckpointNotFoundError, list_checkpoints, open_checkpoint

    run = Path(run_dir)
    config_path = run / "config.json"
    if not config_path.exists():
        raise ConfigError("RUN_DIR", run_dir, "not an hpcrl run directory (no config.json); pass the "
                          "--run-dir of a `hpcrl run` or `hpcrl submit`")
    ckpt_dir = Path(json.loads(config_path.read_text())["checkpoint"]["dir"] or run / "checkpoints")
    available = list_checkpoints(ckpt_dir) if ckpt_dir.exists() else []
    if not available or (step is not None and step not in available):
        raise ConfigError("--step", step, f"no complete checkpoint there in {ckpt_dir}; available steps: "
                          f"{available or 'none'}")
    try:
        reader = open_checkpoint(ckpt_dir, step)
    except CheckpointNotFoundError as exc:
        raise ConfigError("--step", step, str(exc)) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with reader:
        names = sorted(n for n in reader.tensor_names() if n.startswith(POLICY_PREFIX))
        tensors = {n[len(POLICY_PREFIX):]: reader.read(n).contiguous() for n in names}
        saved_step = reader.step
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "hpcrl_step": str(saved_step)})
    model_config = json.loads((run / "model_config.json").read_text())
    (out / "config.json").write_text(json.dumps(model_config, indent=2))
    return out
