"""SGLang's own code for the conformance tests: the pinned wheel, downloaded once and cached.

`wheel_root()` returns a directory holding the wheel's Python sources (`src/sglang/...`) and
msgspec (`site/msgspec`, the one third-party module SGLang's request schema needs), fetched with
`pip download --no-deps` (never installed) and unpacked under `$HPCRL_SGLANG_CACHE` or
`~/.cache/hpcrl/sglang-<version>`. Under CI (env CI=true) a wheel that cannot be fetched is a test
failure; elsewhere the tests skip and say why. `load_file(root, relpath, name)` imports one module
of the wheel by path (no package `__init__` runs), for modules that need only torch/msgspec such as
the tensor bucket.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

SGLANG_VERSION = "0.5.23"
"""The SGLang release hpcrl is checked against (docs/sglang_install.md, notes/sglang_0.5.23.md)."""
MSGSPEC_VERSION = "0.23.0"
"""msgspec for SGLang's generated request schema (sglang/api/v1/api_types.py); SGLang leaves it unpinned."""
DOWNLOAD_TIMEOUT_S = 600.0


def cache_dir() -> Path:
    """Where the unpacked wheels live: $HPCRL_SGLANG_CACHE, else ~/.cache/hpcrl/sglang-<version>."""
    env = os.environ.get("HPCRL_SGLANG_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hpcrl" / f"sglang-{SGLANG_VERSION}"


def _unpack(wheel: Path, dest: Path, keep) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if keep(info.filename):
                zf.extract(info, dest)


def fetch(dest: Path | None = None) -> Path:
    """Download and unpack both wheels into `dest` (default `cache_dir()`) unless already there.

    Atomic: files are unpacked into a temporary sibling that is renamed into place, so a crashed or
    concurrent fetch never leaves a half-filled cache. Raises RuntimeError naming pip's output."""
    dest = dest or cache_dir()
    if (dest / "COMPLETE").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", str(tmp / "wheels"), f"sglang=={SGLANG_VERSION}", f"msgspec=={MSGSPEC_VERSION}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        wheels = sorted((tmp / "wheels").glob("*.whl"))
        if out.returncode or len(wheels) != 2:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        for wheel in wheels:
            if wheel.name.startswith("sglang-"):
                _unpack(wheel, tmp / "src", lambda n: n.endswith((".py", "METADATA")))
            else:
                _unpack(wheel, tmp / "site", lambda n: n.startswith("msgspec/"))
        shutil.rmtree(tmp / "wheels")
        (tmp / "COMPLETE").write_text(SGLANG_VERSION + "\n")
        try:
            tmp.rename(dest)
        except OSError:  # another process got there first
            if not (dest / "COMPLETE").is_file():
                raise
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_ROOT: list[Path | BaseException] = []


def wheel_root() -> Path:
    """The unpacked wheel directory, fetched at most once per process; skips (fails under CI) if
    it cannot be had."""
    if not _ROOT:
        try:
            _ROOT.append(fetch())
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            _ROOT.append(exc)
    root = _ROOT[0]
    if isinstance(root, Path):
        return root
    why = f"the SGLang {SGLANG_VERSION} wheel could not be fetched into {cache_dir()}: {root}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why} (CI=true: the conformance suite must run in CI)")
    pytest.skip(why)


def load_file(root: Path, relpath: str, name: str) -> ModuleType:
    """Import `root/src/relpath` as module `name` (a name outside the `sglang` package, so no package
    `__init__` of the wheel runs); for files whose only imports are torch and msgspec."""
    if str(root / "site") not in sys.path:
        sys.path.append(str(root / "site"))  # msgspec from the cache; appended, so installed modules win
    spec = importlib.util.spec_from_file_location(name, root / "src" / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def parse_with_sglang(sglang_root: Path, argvs: list[list[str]], work_dir: Path, timeout_s: float = 300) -> dict:
    """SGLang's own server-argument parser run on each argv (tests/conformance/_sglang_probe.py
    parse-args, in a subprocess): its report, {"options": flag -> field, "results": [per argv]}."""
    import json

    argv_file = work_dir / "argv.json"
    argv_file.write_text(json.dumps(argvs))
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "_sglang_probe.py"), "parse-args",
                          str(sglang_root), str(argv_file)], capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])
