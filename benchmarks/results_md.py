"""The benchmarks' results file (benchmarks/RESULTS.md): one `## name` section per benchmark."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_heading(command: str) -> str:
    """The `### <UTC time> (commit <short hash>): `command`` line that opens a run's entry."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"### {stamp} (commit {commit}): `{command}`"


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


def replace_section(path: Path, heading: str, body: str) -> None:
    """Make `body` the whole text under `heading` (e.g. "## e2e_vs_trl") in the markdown file `path`,
    leaving every other section as it is; the section (and the file) is created at the end if missing."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines()
    section = [heading, ""] + body.strip("\n").splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(section) + "\n")
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    new = lines[:start] + section + ([""] if end < len(lines) else []) + lines[end:]
    path.write_text("\n".join(new).rstrip("\n") + "\n")


def publish(text: str, results: Path | None, section: str, script: str, argv: list[str]) -> None:
    """Print a benchmark's `text` and, given a results file, append it under `## section` with the
    command (`python <script> <argv>`) and commit it ran at."""
    print(text)
    if results:
        command = f"python {script} " + " ".join(argv)
        append_to_section(results, f"## {section}", run_heading(command.strip()) + "\n\n" + text)
