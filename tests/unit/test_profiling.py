"""A trainer rank's step traces (logging.profile_steps, hpcrl/profiling.py): a profiled step's trace
runs from its first command to the first command of a later step, with each command a named span,
and is written once; other steps are not traced."""

import gzip
import json

import torch

from hpcrl.profiling import StepTrace, step_dir


def _ops(path) -> list[str]:
    return [e["name"] for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]


def _command(trace: StepTrace, step: int, op: str, n: int) -> None:
    trace.at(step)
    with trace.span(op):
        x = torch.ones(8, 8)
        for _ in range(n):
            x = x @ x / 8


def test_a_profiled_step_is_traced_from_its_first_command_to_a_later_steps(tmp_path):
    trace = StepTrace([1, 3], tmp_path, rank=2, cuda=False)
    _command(trace, 0, "train", 1)
    assert not (tmp_path / "profile").exists()
    _command(trace, 1, "train", 3)
    _command(trace, 1, "sync", 2)
    assert not step_dir(tmp_path, 1).exists()  # written when the step ends
    _command(trace, 2, "train", 5)  # ends step 1's trace; step 2 is not profiled
    ops = _ops(step_dir(tmp_path, 1) / "trainer_rank2.trace.json.gz")
    assert ops.count("aten::mm") == 5 and ops.count("hpcrl.train") == 1 and ops.count("hpcrl.sync") == 1
    _command(trace, 1, "save", 1)  # a late command of a traced step starts no second trace
    _command(trace, 3, "train", 4)
    trace.close()  # shutdown ends the last one
    assert _ops(step_dir(tmp_path, 3) / "trainer_rank2.trace.json.gz").count("aten::mm") == 4
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step_000001", "step_000003"]
    assert _ops(step_dir(tmp_path, 1) / "trainer_rank2.trace.json.gz") == ops  # not rewritten
