#!/usr/bin/env bash
# One-shot check of hpcrl's GPU tests on a lent CUDA machine that has no network.
#
#   bash dev/gpu_check.sh            # in the repo root; the wheels travel in the ignored folder .whl
#
# The machine's python3 holds a CUDA torch; everything else hpcrl imports that the image lacks (or has
# at another version) comes from .whl (README of the device tool: cp312 manylinux wheels fetched with
# `pip download --no-deps`). The script
#   1. installs .whl/*.whl into /tmp/site (pip --target, no deps, no bytecode) except mpich, whose
#      wheel keeps mpiexec and libmpi in its .data folder: pip --target drops that lib/ folder, so it
#      is unpacked by hand into /tmp/mpich and MPI4PY_LIBMPI points mpi4py at its libmpi;
#   2. unpacks .whl/sglang-0.5.23-cache.tar.xz (SGLang's wheel sources, as the conformance suite caches
#      them, plus a cp312 msgspec) and points HPCRL_SGLANG_CACHE at it, so the conformance test runs
#      without a download;
#   3. puts the repo root on PYTHONPATH (workers start with `python -P -m ...`, so the working directory
#      is not on their path) and /tmp/mpich/bin first on PATH (launch/local.py takes the mpiexec beside
#      sys.executable, else the first on PATH);
#   4. prints the GPU, torch and package versions, checks F.grouped_mm on CUDA in float32 and bfloat16
#      and runs an MPI smoke test (reported, not fatal); on a one-GPU machine probes whether NCCL takes
#      two processes on the same GPU (nccl_on_one_gpu);
#   5. runs the GPU tests and the weight-group join conformance test under `timeout`, the log teed to
#      $OUT/gpu.log;
#   6. copies each hpcrl run's metrics.jsonl and the tails of its logs into $OUT (8 files at most) and
#      kills what the tests left running (the run's MPI world is started in a session of its own).
# Env: OUT (default /tmp/gpu_check_out); PYTEST_TIMEOUT_S (default 480, cut so that the whole script
# ends within GPU_CHECK_BUDGET_S, default 530 s); GPU_CHECK_TESTS (the test files, default below);
# GPU_CHECK_PYTEST_FLAGS (default -x; empty: run on after a failure); GPU_CHECK_NCCL_HOSTID
# (auto|on|off, see nccl_on_one_gpu); for a dry run elsewhere: PYTHON, WHEELS (default .whl) and a
# PYTHONPATH, which is kept after /tmp/site and the repo.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=/tmp/site
MPICH=/tmp/mpich
SGL_CACHE=/tmp/sglang-cache/sglang-0.5.23
BASETEMP=/tmp/gpu_check_pt
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-480}
BUDGET_S=${GPU_CHECK_BUDGET_S:-530}  # the whole script: pytest gets what set-up left, 20 s kept for the end
PYTEST_FLAGS=${GPU_CHECK_PYTEST_FLAGS--x}
TESTS=${GPU_CHECK_TESTS:-"tests/gpu/test_reference_nccl.py tests/gpu/test_gpu_example.py \
tests/gpu/test_sglang_example.py tests/gpu/test_sglang_kv_pool.py tests/conformance/test_weight_group_join.py"}

stamp() { echo "=== [$(date +%T), ${SECONDS}s] $*"; }

install() {
  stamp "install wheels into $SITE"
  local wheels=()
  for w in "$WHEELS"/*.whl; do
    [[ $(basename "$w") == mpich-* ]] || wheels+=("$w")
  done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$SITE" "${wheels[@]}" || return 1
  stamp "unpack mpich into $MPICH, SGLang's sources into $SGL_CACHE"
  "$PY" - "$MPICH" "$SGL_CACHE" "$WHEELS"/mpich-*.whl "$WHEELS"/sglang-0.5.23-cache.tar.xz <<'PY' || return 1
import os, shutil, sys, tarfile, zipfile
mpich, cache, wheel, sgl = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
prefix = next(n for n in names if n.endswith(".data/data/bin/mpiexec"))[:-len("bin/mpiexec")]
shutil.rmtree(mpich, ignore_errors=True)
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        if info.filename.startswith(prefix) and not info.is_dir():
            dest = os.path.join(mpich, info.filename[len(prefix):])
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(dest, (info.external_attr >> 16) & 0o777 or 0o644)
shutil.rmtree(cache, ignore_errors=True)
os.makedirs(cache)
with tarfile.open(sgl) as tf:
    tf.extractall(cache, filter="data")
print("mpiexec:", os.path.join(mpich, "bin", "mpiexec"), "SGLang cache:", sorted(os.listdir(cache)))
PY
}

report_env() {
  stamp "machine"
  nvidia-smi || true
  "$PY" - <<'PY'
import importlib.metadata as md, os, shutil, sys
import torch
print("python", sys.version.split()[0], sys.executable)
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
      torch.cuda.nccl.version() if gpus else None, "GPUs", gpus)
for name in ("megatron-core", "transformers", "huggingface-hub", "tokenizers", "safetensors", "mpi4py",
             "numpy", "h5py", "pyarrow", "tensorboard", "psutil", "submitit", "math-verify", "orjson",
             "pytest", "pytest-timeout", "regex", "jinja2", "pyyaml", "sympy"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
print("mpiexec hpcrl will use:", beside if os.path.exists(beside) else shutil.which("mpiexec"),
      "(WARNING: not the mpich wheel's)" if os.path.exists(beside) else "")
import hpcrl.cli, transformers  # noqa: F401
from hpcrl.trainer import megatron_compat
megatron_compat.apply()  # asserts megatron-core 0.16.1, installs the TE-less MoE fix
print("hpcrl from", os.path.dirname(hpcrl.__file__))
print("transformers from", os.path.dirname(transformers.__file__))
try:
    import sitecustomize
    print("sitecustomize:", sitecustomize.__file__)
except ImportError:
    print("sitecustomize: none")
# F.grouped_mm carries the trainer's experts (megatron_compat patch 10) and the reference engine's MoE
# (direct_forward): hpcrl uses it in float32 and bfloat16, with transposed expert weights
for dt in (torch.float32, torch.bfloat16) if gpus else ():
    try:
        x = torch.randn(24, 64, device="cuda", dtype=dt, requires_grad=True)
        w = torch.randn(4, 32, 64, device="cuda", dtype=dt).transpose(1, 2).requires_grad_()
        ends = [5, 12, 12, 24]
        y = torch.nn.functional.grouped_mm(x, w, offs=torch.tensor(ends, device="cuda", dtype=torch.int32))
        y.float().sum().backward()
        ref = torch.cat([x[a:b] @ w[i] for i, (a, b) in enumerate(zip([0] + ends[:-1], ends))])
        diff = (y - ref).abs().max().item()
        print(f"grouped_mm {dt} on CUDA: ok, max |diff| vs per-group matmul {diff:.3g}")
    except Exception as exc:  # report and go on: the tests show what it breaks
        print(f"grouped_mm {dt} on CUDA: FAILED {type(exc).__name__}: {str(exc)[:400]}")
PY
  stamp "MPI smoke test (2 ranks)"
  timeout 60 mpiexec -launcher fork -n 2 "$PY" -c \
    "from mpi4py import MPI; c = MPI.COMM_WORLD; s = c.allreduce(c.rank + 1); \
print(c.rank, c.size, s, MPI.Get_library_version().splitlines()[0])"
}

collect() {
  stamp "collect run dirs from $BASETEMP"
  "$PY" - "$BASETEMP" "$OUT" <<'PY'
import pathlib, re, sys
base, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
budget = 8 - sum(1 for p in out.iterdir() if p.is_file())  # gpu.log and junit.xml are already there
def name(p):
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(p.relative_to(base)))[:120]
for metrics in sorted(base.glob("**/metrics.jsonl")):
    if budget > 0:
        (out / ("metrics_" + name(metrics.parent) + ".jsonl")).write_bytes(metrics.read_bytes())
        budget -= 1
for logdir in sorted({p.parent for p in base.glob("**/*.log")}):
    if budget <= 0:
        break
    parts = []
    for log in sorted(logdir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        parts.append(f"===== {log} ({len(lines)} lines, last 150)\n" + "\n".join(lines[-150:]) + "\n")
    (out / ("logs_" + name(logdir) + ".txt")).write_text("".join(parts))
    budget -= 1
for p in sorted(out.iterdir()):
    print(" ", p.name, p.stat().st_size)
PY
}

cleanup() {
  # the run's MPI world and the reference engines run in sessions of their own: end those the tests
  # started (their command lines name the pytest base dir), by pid
  "$PY" - "$BASETEMP" <<'PY'
import os, signal, sys, time
import psutil
me = os.getpid()
left = [p for p in psutil.process_iter(["cmdline"])
        if p.pid != me and sys.argv[1] in " ".join(p.info["cmdline"] or [])]
for sig in (signal.SIGTERM, signal.SIGKILL):
    for p in left:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
    left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if not left:
        break
    time.sleep(3)
print("left running after the tests:", len(left))
PY
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv || true
}

nccl_probe() {
  # two processes on GPU 0 in one NCCL group (what a one-GPU machine gives the trainer rank and the
  # engine with resources.share_gpus); $1=hostid gives each its own NCCL_HOSTID. 0 when both sum right.
  local probe=/tmp/gpu_check_nccl_probe.py port r rc=0 pids=()
  cat >"$probe" <<'PY'
import datetime, sys
import torch
import torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
                        timeout=datetime.timedelta(seconds=45))
t = torch.full((1 << 20,), float(rank + 1), device="cuda")
dist.all_reduce(t)
print(f"rank {rank}: all_reduce gives {t[0].item()} (2 ranks: 1 + 2 = 3)")
ok = t[0].item() == 3.0
dist.destroy_process_group()
sys.exit(0 if ok else 1)
PY
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for r in 0 1; do
    if [[ $1 == hostid ]]; then
      NCCL_HOSTID=gpu-check-probe-$r timeout 60 "$PY" "$probe" $r "$port" >"/tmp/nccl_probe_$1_$r.log" 2>&1 &
    else
      timeout 60 "$PY" "$probe" $r "$port" >"/tmp/nccl_probe_$1_$r.log" 2>&1 &
    fi
    pids+=($!)
  done
  for r in 0 1; do
    wait "${pids[$r]}" || rc=1
    echo "--- probe $1 rank $r:"; grep -v "^\s*$" "/tmp/nccl_probe_$1_$r.log" | tail -6
  done
  return $rc
}

nccl_on_one_gpu() {
  # NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected", checked by
  # host hash and bus id). With GPU_CHECK_NCCL_HOSTID=auto (default) and one GPU, the probe decides:
  # if the plain group fails and one with a distinct NCCL_HOSTID per process works, every Python
  # process of the tests gets its own NCCL_HOSTID (a sitecustomize on PYTHONPATH), so NCCL sees
  # separate hosts and talks over its socket transport. on/off force it.
  local mode=${GPU_CHECK_NCCL_HOSTID:-auto}
  if [[ $mode == auto ]]; then
    if [[ $("$PY" -c 'import torch; print(torch.cuda.device_count())') != 1 ]]; then
      mode=off
    else
      stamp "NCCL probe: 2 processes on GPU 0, plain"
      if nccl_probe plain; then
        mode=off
      else
        stamp "NCCL probe: 2 processes on GPU 0, each its own NCCL_HOSTID"
        if nccl_probe hostid; then mode=on; else mode=off; fi
      fi
    fi
  fi
  if [[ $mode == on ]]; then
    mkdir -p /tmp/gpu_check_hostid
    printf '%s\n' "import os" "os.environ['NCCL_HOSTID'] = f'gpu-check-{os.getpid()}'  # gpu_check.sh" \
      >/tmp/gpu_check_hostid/sitecustomize.py
    export PYTHONPATH=/tmp/gpu_check_hostid:$PYTHONPATH
  fi
  stamp "NCCL_HOSTID per process: $mode (GPU_CHECK_NCCL_HOSTID=${GPU_CHECK_NCCL_HOSTID:-auto})"
}

main() {
  stamp "gpu_check in $REPO at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  install || { echo "gpu_check: install failed"; return 3; }
  export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH} PATH=$MPICH/bin:$SITE/bin:$PATH
  export MPI4PY_LIBMPI=$MPICH/lib/libmpi.so.12
  export HPCRL_SGLANG_CACHE=$SGL_CACHE PYTHONUNBUFFERED=1
  unset CI HPCRL_SGLANG_PYTHON
  # MPICH's Hydra looks up this host's name; a bare VM may not resolve it
  if ! getent hosts "$(hostname)" >/dev/null 2>&1; then
    echo "127.0.0.1 $(hostname)" >>/etc/hosts && echo "gpu_check: added $(hostname) to /etc/hosts"
  fi
  report_env || echo "gpu_check: WARNING: the environment check failed (above); running the tests anyway"
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  nccl_on_one_gpu
  local limit=$(( BUDGET_S - SECONDS - 20 ))
  (( limit > PYTEST_TIMEOUT_S )) && limit=$PYTEST_TIMEOUT_S
  (( limit < 60 )) && limit=60
  stamp "pytest (timeout ${limit}s): $TESTS"
  rm -rf "$BASETEMP"
  # shellcheck disable=SC2086  # PYTEST_FLAGS and TESTS are word lists
  timeout -k 10 "$limit" "$PY" -m pytest $PYTEST_FLAGS -q -s -p no:cacheprovider \
    --basetemp "$BASETEMP" --durations=0 --junitxml "$OUT/junit.xml" $TESTS
  local rc=$?
  stamp "pytest exit $rc"
  cleanup
  collect
  stamp "done"
  return $rc
}

main 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
