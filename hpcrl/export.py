"""`hpcrl export RUN_DIR --step N --out DIR`: a checkpoint's policy as a HuggingFace model directory.

Writes HF-sharded safetensors (`model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` above `--max-shard-size`, default 5GB as in transformers) under the
HF checkpoint names (per-expert tensors, what `save_pretrained` writes and transformers and SGLang
load), `config.json` (the run's model_config.json) and, when the run started from a model
directory (`model.path`), that directory's tokenizer files and generation_config.json. Works for
any trainer layout the checkpoint was saved under. Memory stays bounded: the files are planned up
front and each stored slice of the checkpoint is copied in blocks of rows (the checkpoint's
checksum blocks, 16 MiB by default) straight to its offsets (checkpoints/hf_safetensors.py).
The exported weights hash (`checkpoints.hf_safetensors.dir_digest`) to the run's policy_sha256.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from hpcrl.config.errors import ConfigError

POLICY_PREFIX = "policy/"
DEFAULT_MAX_SHARD_SIZE = "5GB"
# What a HF model directory holds besides config.json and the weights, copied when present.
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
               "tokenizer.model", "generation_config.json")


def copy_model_files(source_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files and generation_config.json of a HF model directory (those present);
    returns their names."""
    src, out = Path(source_dir), Path(out_dir)
    copied = []
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    return copied


def _run_config(run: Path, run_dir: str) -> dict:
    config_path = run / "config.json"
    if not config_path.exists():
        raise ConfigError("RUN_DIR", run_dir, "not an hpcrl run directory (no config.json); pass the "
                          "--run-dir of a `hpcrl run` or `hpcrl submit`")
    return json.loads(config_path.read_text())


def export_checkpoint(run_dir: str, step: int | None, out_dir: str,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Export; returns the output directory. ConfigError (exit 2) for a bad run dir, step or size."""
    from checkpoints import CheckpointNotFoundError, list_checkpoints, open_checkpoint
    from checkpoints._dtypes import dtype_name, to_storage
    from checkpoints.hf_safetensors import (ShardWriter, create_files, parse_size, plan_shards, remove_stale,
                                            write_index)
    from hpcrl.trainer.hf_export import config_at_dtype
    from moe.slices import Box

    try:
        max_shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise ConfigError("--max-shard-size", max_shard_size, str(exc)) from None
    run = Path(run_dir)
    config = _run_config(run, run_dir)
    ckpt_dir = Path(config["checkpoint"]["dir"] or run / "checkpoints")
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
        names = [n for n in reader.tensor_names() if n.startswith(POLICY_PREFIX)]
        if not names:
            raise ConfigError("--step", reader.step, f"checkpoint {reader.step} in {ckpt_dir} holds no "
                              f"{POLICY_PREFIX} tensors (not a policy checkpoint)")
        plan = plan_shards([(n[len(POLICY_PREFIX):], dtype_name(reader.dtype(n)), reader.global_shape(n))
                            for n in names], max_shard_bytes, {"hpcrl_step": str(reader.step)})
        dtypes = {dtype_name(reader.dtype(n)) for n in names}
        remove_stale(out)
        create_files(out, plan)
        with ShardWriter(out, plan) as writer:
            for n in names:
                for s in reader.manifest.tensors[n].slices:
                    rows = s.box.shape[0] if s.box.shape else 0
                    for r0 in range(0, rows, max(1, s.block_rows)):  # one checksum block at a time
                        r1 = min(rows, r0 + s.block_rows)
                        part = Box((s.box.offsets[0] + r0,) + s.box.offsets[1:], (r1 - r0,) + s.box.shape[1:])
                        writer.write(n[len(POLICY_PREFIX):], part, to_storage(reader.read(n, part)))
                    if not s.box.shape:
                        writer.write(n[len(POLICY_PREFIX):], s.box, to_storage(reader.read(n, s.box)))
        write_index(out, plan)
    (out / "config.json").write_text(config_at_dtype(json.loads((run / "model_config.json").read_text()),
                                                     dtypes))
    source = (config.get("model") or {}).get("path")
    if source:
        if Path(source).is_dir():
            copy_model_files(source, out)
        else:
            print(f"warning: the run's model.path {source} is gone; its tokenizer files are not copied",
                  file=sys.stderr)
    return out
