"""The benchmarks' results file (benchmarks/RESULTS.md): one `## name` section per benchmark."""

from __future__ import annotations

from pathlib import Path


def append_to_section(path: Path, heading: str, text: str) -> None:
    """Append `text` at the end of the `heading` section (e.g. "## reshard_cpu") of the markdown
    file `path`, between blank lines; the section (and the file) is created at the end if missing."""
    body = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = body.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        path.write_text(body.rstrip("\n") + f"\n\n{heading}\n\n" + text.rstrip("\n") + "\n")
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    new = (lines[:end] + ([""] if lines[end - 1].strip() else []) + text.rstrip("\n").splitlines()
           + ([""] if end < len(lines) else []) + lines[end:])
    path.write_text("\n".join(new).rstrip("\n") + "\n")
