"""hpcrl.controller.phase_file: in-place records the launcher can always parse."""

from __future__ import annotations

from pathlib import Path

from hpcrl.controller.phase_file import PhaseFile
from launch.local import _read_json


def test_each_record_replaces_the_last_whole(tmp_path: Path) -> None:
    path = tmp_path / ".phase.json"
    f = PhaseFile(path)
    f.write(-1, "startup")
    assert _read_json(path) == {"step": -1, "phase": "startup"}
    long_phase = "x" * 300  # longer than the padded size: the record grows ...
    f.write(3, long_phase)
    assert _read_json(path) == {"step": 3, "phase": long_phase}
    f.write(4, "sync")  # ... and a shorter one after it leaves no tail of the long one
    assert _read_json(path) == {"step": 4, "phase": "sync"}
    assert len(path.read_bytes()) >= len(long_phase)
    f.close()
    f.close()  # idempotent
    assert _read_json(path) == {"step": 4, "phase": "sync"}


def test_a_new_run_starts_from_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / ".phase.json"
    path.write_text('{"step": 99, "phase": "from an older run"}' + " " * 500)
    f = PhaseFile(path)
    f.write(0, "generate")
    assert _read_json(path) == {"step": 0, "phase": "generate"}
    assert len(path.read_bytes()) == PhaseFile.MIN_SIZE
    f.close()
