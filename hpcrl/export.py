"""`hpcrl export RUN_DIR --step N --out DIR`: a checkpoint's policy as a HuggingFace model directory.

Writes HF-sharded safetensors (`model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` above `--max-shard-size`, default 5GB as in transformers) under the
HF checkpoint names (per-expert tensors, what `save_pretrained` writes and transformers and SGLang
load), `config.json` (the run's model_config.json) and, when the run started from a model
directory (`model.path`), that directory's tokenizer files and generation_config.json. Works for
any trainer layout the checkpoint was saved under. Each tensor keeps the dtype it was saved at:
model.dtype, DeepSeek-V3's router score-correction biases float32. A DeepSeek-V3 model.path's MTP
layers (`model.layers.{L + k}.*`, which the trainer does not hold) are copied after the policy's
tensors, streamed a block of rows at a time: unquantized ones byte for byte, FP8 ones dequantized
to model.dtype without their `_scale_inv` (hpcrl/trainer/mtp_tensors.py). Memory stays bounded:
the files are planned up front and each stored slice of the checkpoint is copied in blocks of rows
(the checkpoint's checksum blocks, 16 MiB by default) straight to its offsets
(checkpoints/hf_safetensors.py). The exported weights hash (`checkpoints.hf_safetensors.dir_digest`)
to the run's policy_sha256 computed with the MTP tensors (`MegatronPolicy.policy_sha256(model.path)`;
without MTP layers, the final.json value).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.config.errors import ConfigError
from hpcrl.runner import is_run_config

if TYPE_CHECKING:
    from hpcrl.trainer.mtp_tensors import MTPSource

POLICY_PREFIX = "policy/"
DEFAULT_MAX_SHARD_SIZE = "5GB"
# What a HF model directory holds besides config.json and the weights, copied when present.
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
               "tokenizer.model", "tiktoken.model", "generation_config.json")


def copy_model_files(source_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files, generation_config.json and the directory's own Python code (the
    `*.py` files auto_map names, e.g. Kimi-K2's tokenization_kimi.py and modeling_deepseek.py, as
    save_pretrained copies a custom model's code) of a HF model directory, those present; returns
    their names."""
    src, out = Path(source_dir), Path(out_dir)
    copied = []
    for name in [*MODEL_FILES, *sorted(p.name for p in src.glob("*.py"))]:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    return copied


def _run_config(run: Path, run_dir: str) -> dict:
    config_path = run / "config.json"
    fix = "pass the --run-dir of a `hpcrl run` or `hpcrl submit`"
    if not config_path.is_file():
        raise ConfigError("RUN_DIR", run_dir, f"not an hpcrl run directory (no config.json); {fix}")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("RUN_DIR", run_dir, f"its config.json is not JSON ({exc}); {fix}") from None
    if not is_run_config(config):
        raise ConfigError("RUN_DIR", run_dir, f"its config.json is not an hpcrl run's (no checkpoint section: "
                                              f"a HuggingFace model directory?); {fix}")
    return config


def _check_out_dir(out: Path, run: Path, source: str | None) -> None:
    """ConfigError (exit 2) for an --out that export would damage: a file, a run directory (its
    config.json would be replaced), the run's model.path (an earlier export the run started from:
    its MTP layer and tokenizer are read while the export replaces the files), or a directory with
    safetensors files an export did not write (export replaces its own earlier files: these would be
    deleted)."""
    from checkpoints.hf_safetensors import foreign_weights

    if out.exists() and not out.is_dir():
        raise ConfigError("--out", str(out), "is a file; give a directory (created if missing)")
    if source and out.exists() and Path(source).is_dir() and out.samefile(source):
        raise ConfigError("--out", str(out), f"is the run's model.path ({source}), which the export reads (its "
                                             "MTP layer, tokenizer files) while it replaces the weights: give "
                                             "another directory")
    if out.resolve() == run.resolve() or (out / "checkpoints").is_dir() and (out / "config.yaml").is_file():
        raise ConfigError("--out", str(out), "is an hpcrl run directory, whose config.json the export would "
                                             "replace; give another directory, e.g. RUN_DIR/hf")
    foreign = foreign_weights(out)
    if foreign is not None:
        raise ConfigError("--out", str(out), f"holds {foreign.name}, which hpcrl export did not write: the "
                                             "export would delete it; give an empty or new directory")


def _mtp_source(config: dict, model_config: dict, source: str | None) -> MTPSource:
    """The MTPSource of the run's model.path (none when the model has no MTP layers, or when the path
    is gone or holds no safetensors files, with a warning then); ConfigError (exit 2) for a source
    whose MTP tensors cannot be read."""
    from hpcrl.trainer.model import PARAM_DTYPES
    from hpcrl.trainer.mtp_tensors import MTPSource
    from moe.hf_checkpoint import CheckpointFormatError
    from moe.hf_megatron import HFModelDims

    mtp_layers = int(model_config.get("num_nextn_predict_layers") or 0)
    lost = f" its {mtp_layers} MTP layer(s) (SGLang's speculative decoding)" if mtp_layers else ""
    if source and not Path(source).is_dir():
        print(f"warning: the run's model.path {source} is gone; its tokenizer files{' and' if lost else ''}"
              f"{lost} are not copied", file=sys.stderr)
        source = None
    elif source and mtp_layers and not any(Path(source).glob("*.safetensors")):
        # the weights deleted after the run, config.json and the tokenizer kept: as if gone
        print(f"warning: the run's model.path {source} holds no *.safetensors any more;{lost} are not copied",
              file=sys.stderr)
        return MTPSource(None, None)
    if not source or not mtp_layers:
        return MTPSource(None, None)
    dtype = PARAM_DTYPES[(config.get("model") or {}).get("dtype") or "float32"]
    try:
        return MTPSource(source, HFModelDims.from_hf_config(model_config), dtype)
    except CheckpointFormatError as exc:
        raise ConfigError("model.path", source, f"its MTP layer cannot be exported: {exc}") from None


def export_checkpoint(run_dir: str, step: int | None, out_dir: str,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Export; returns the output directory. ConfigError (exit 2) for a bad run dir, step or size,
    or a model.path whose MTP tensors cannot be read."""
    from checkpoints import CheckpointNotFoundError, CorruptCheckpointError, list_checkpoints, open_checkpoint
    from checkpoints._dtypes import dtype_name
    from checkpoints.hf_safetensors import (EXPORT_TAG, create_files, parse_size, plan_shards, remove_stale,
                                            write_index)
    from hpcrl.trainer.hf_export import config_at_dtype
    from hpcrl.trainer.mtp_tensors import exported_config
    from moe.hf_megatron import is_router_bias

    try:
        max_shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise ConfigError("--max-shard-size", max_shard_size, str(exc)) from None
    run = Path(run_dir)
    config = _run_config(run, run_dir)
    ckpt_dir = Path(config["checkpoint"]["dir"] or run / "checkpoints")
    available = list_checkpoints(ckpt_dir) if ckpt_dir.exists() else []
    if not available:  # nothing to export, whichever step
        raise ConfigError("RUN_DIR", run_dir, f"has no complete checkpoint in {ckpt_dir}: the run saved none "
                          "(checkpoint.interval_steps, or it stopped before its first save); export a run that did")
    if step is not None and step not in available:
        raise ConfigError("--step", step, f"no complete checkpoint there in {ckpt_dir}; available steps: "
                          f"{available}")
    try:
        reader = open_checkpoint(ckpt_dir, step)
    except CheckpointNotFoundError as exc:
        raise ConfigError("--step", step, str(exc)) from None
    except CorruptCheckpointError as exc:  # its manifest: the shards are checked as they are read
        others = [s for s in available if s != (step if step is not None else available[-1])]
        raise ConfigError("--step", step, f"{exc}; export another step (--step, complete steps: {others})") \
            from None
    model_config = json.loads((run / "model_config.json").read_text())
    source = (config.get("model") or {}).get("path")
    out = Path(out_dir)
    _check_out_dir(out, run, source)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--out", out_dir, f"cannot create it ({exc.strerror}); give a writable directory") \
            from None
    with reader, _mtp_source(config, model_config, source) as mtp:
        names = [n for n in reader.tensor_names() if n.startswith(POLICY_PREFIX)]
        if not names:
            raise ConfigError("--step", reader.step, f"checkpoint {reader.step} in {ckpt_dir} holds no "
                              f"{POLICY_PREFIX} tensors (not a policy checkpoint)")
        entries = [(n[len(POLICY_PREFIX):], dtype_name(reader.dtype(n)), reader.global_shape(n))
                   for n in names]
        entries += [(name, dtype_name(dtype), shape) for name, dtype, shape in mtp.entries()]
        plan = plan_shards(entries, max_shard_bytes, {"hpcrl_step": str(reader.step), EXPORT_TAG: "checkpoint"})
        # the weights' dtype(s), for config.json: not the router biases, float32 in every run
        dtypes = {dtype_name(reader.dtype(n)) for n in names
                  if not is_router_bias(n[len(POLICY_PREFIX):])}
        remove_stale(out)
        create_files(out, plan)
        try:
            _write_tensors(out, plan, reader, names, mtp)
        except CorruptCheckpointError as exc:
            remove_stale(out)  # the files of this export, half written
            raise ConfigError("--step", reader.step, f"{exc}; export another step (--step)") from None
        write_index(out, plan)
        model_config = exported_config(model_config, mtp)
    (out / "config.json").write_text(config_at_dtype(model_config, dtypes))
    if source and Path(source).is_dir():
        copy_model_files(source, out)
    return out


def _write_tensors(out: Path, plan, reader, names: list[str], mtp: MTPSource) -> None:
    """The policy's tensors of the checkpoint, a checksum block of rows at a time, then the MTP ones."""
    from checkpoints._dtypes import to_storage
    from checkpoints.hf_safetensors import ShardWriter
    from moe.slices import Box

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
        for t in mtp.tensors:
            for box, block in mtp.blocks(t):
                writer.write(t.name, box, to_storage(block))
