"""checkpoints.hf_safetensors: files planned like save_pretrained's, written box by box in any split
and order, read back by safetensors/transformers bit for bit; the directory digest is the policy hash."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from checkpoints._dtypes import to_storage
from checkpoints.hf_safetensors import (INDEX, ShardWriter, create_files, dir_digest, parse_size, plan_shards,
                                        remove_stale, write_index)
from moe.digest import state_dict_digest
from moe.slices import Box


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(6, 10, generator=g), "b.bias": torch.randn(7, generator=g),
            "c.weight": torch.randn(4, 3, 6, generator=g).to(torch.bfloat16), "d.scale": torch.tensor(2.5),
            "e.empty": torch.zeros(0, 4), "f.big": torch.randn(40, 8, generator=g)}


def _boxes(shape: tuple[int, ...]) -> list[Box]:
    """A partition of the tensor into boxes that are neither whole rows nor whole tensors."""
    full = Box.full(shape)
    if len(shape) < 2 or 0 in shape:
        return [full]
    out = []
    for r in (full.split(0, 2, 0), full.split(0, 2, 1)):
        if shape[1] % 2 == 0 or len(shape) == 3:
            axis = 1 if shape[1] % 2 == 0 else 2
            if shape[axis] % 2 == 0:
                out += [r.split(axis, 2, 0), r.split(axis, 2, 1)]
                continue
        out.append(r)
    return out


@pytest.mark.parametrize("max_shard", [10**9, 200])
def test_write_boxes_in_any_order_reads_back(tmp_path, max_shard: int) -> None:
    sd = _tensors()
    plan = plan_shards([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in sd.items()],
                       max_shard, {"step": "3"})
    create_files(tmp_path, plan)
    jobs = [(n, b) for n, t in sd.items() for b in _boxes(tuple(t.shape))]
    # Two writers (as two ranks would), interleaved, boxes in reverse order.
    with ShardWriter(tmp_path, plan) as w0, ShardWriter(tmp_path, plan) as w1:
        for k, (n, b) in enumerate(reversed(jobs)):
            (w0 if k % 2 else w1).write(n, b, to_storage(sd[n][b.index].contiguous()))
    write_index(tmp_path, plan)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if max_shard > 10**6:
        assert files == ["model.safetensors"] and not (tmp_path / INDEX).exists()
    else:
        assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        index = json.loads((tmp_path / INDEX).read_text())
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
        assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(files)
        assert index["weight_map"]["f.big"] not in {index["weight_map"][n] for n in sd if n != "f.big"}
    back = {}
    for f in files:
        back.update(load_file(str(tmp_path / f)))
        with safe_open(str(tmp_path / f), "pt") as fh:
            assert fh.metadata() == {"format": "pt", "step": "3"}
        assert (tmp_path / f).stat().st_size == next(p.size for p in plan.files if p.name == f)
        assert len((tmp_path / f).read_bytes()[:8]) == 8
        assert int.from_bytes((tmp_path / f).read_bytes()[:8], "little") % 8 == 0
    assert set(back) == set(sd)
    for n, t in sd.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n
    assert dir_digest(tmp_path, chunk_bytes=24) == state_dict_digest(sd)
    remove_stale(tmp_path)
    assert not list(tmp_path.glob("*.safetensors")) and not (tmp_path / INDEX).exists()


def test_parse_size_and_bad_writes(tmp_path) -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("150KB") == 150_000 and parse_size(7) == 7
    assert parse_size("2MiB") == 2 * 2**20 and parse_size("1.5 kb") == 1500
    for bad in ("five", "0", "3 parsecs", -1):
        with pytest.raises(ValueError):
            parse_size(bad)
    plan = plan_shards([("w", "float32", (2, 3))], 100)
    create_files(tmp_path, plan)
    with ShardWriter(tmp_path, plan) as w:
        with pytest.raises(ValueError, match="C-contiguous"):
            w.write("w", Box.full((2, 3)), np.zeros((3, 2), np.float32))
        with pytest.raises(ValueError, match="not inside"):
            w.write("w", Box((1, 0), (2, 3)), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="no safetensors type"):
        plan_shards([("c", "complex64", (2,))], 100)
