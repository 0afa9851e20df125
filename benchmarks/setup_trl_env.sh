#!/usr/bin/env bash
# Creates ./.venv-bench, the benchmark-only environment with TRL (never installed in hpcrl's .venv).
#   bash benchmarks/setup_trl_env.sh
# Order matters: torch 2.13.0 (the CPU build on this machine's local wheel) goes in first and alone,
# then every other package is pinned exactly and checked with `pip install --dry-run` so that
# nothing can replace torch with a multi-GB CUDA build. hpcrl itself is NOT installed here:
# benchmarks/trl_grpo_tiny.py imports its tokenizer, task and reward from the repository path.
# Idempotent: a second run only re-checks the pins.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HPCRL_BENCH_VENV:-.venv-bench}"
PY="${PYTHON:-python3}"

TORCH="torch==2.13.0"
# trl 1.16.0 is the newest release; it installs with transformers 5.24.0 and torch 2.13.0.
PINS=(
  "transformers==5.24.0"
  "trl==1.16.0"
  "accelerate==1.15.0"
  "datasets==5.2.0"
  "py-spy==0.4.3"
)

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip wheel
fi
"$VENV/bin/pip" install -q "$TORCH"

# Refuse to go on if the resolver would touch torch (a CUDA build would wreck the environment).
plan="$("$VENV/bin/pip" install --dry-run "$TORCH" "${PINS[@]}" 2>&1)" || { echo "$plan"; exit 1; }
if grep -E "^Would install.* torch-" <<<"$plan" >/dev/null; then
  echo "setup_trl_env.sh: the pins would replace torch 2.13.0; refusing. Resolver said:" >&2
  echo "$plan" >&2
  exit 1
fi
"$VENV/bin/pip" install -q "$TORCH" "${PINS[@]}"

"$VENV/bin/python" - <<'PY'
import torch, transformers, trl
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, (
    f"{torch.__version__} (cuda {torch.version.cuda}): the benchmark env needs torch 2.13.0+cpu")
assert transformers.__version__ == "5.24.0", transformers.__version__
print(f"benchmark env ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"trl {trl.__version__}")
PY
