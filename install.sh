#!/usr/bin/env bash
# Installs hpcrl into ./.venv (CPU build of torch; never a CUDA build, never sglang/transformer-engine).
#   bash install.sh          # runtime
#   bash install.sh --test   # runtime + test tools
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${HPCRL_VENV:-.venv}"
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip wheel
fi
# torch first and exactly pinned, so nothing later can pull a CUDA build.
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q -e ".$extras"
"$VENV/bin/python" - <<'PY'
import torch
assert torch.version.cuda is None, f"a CUDA build of torch was installed ({torch.__version__}); hpcrl's CPU install needs torch==2.13.0+cpu"
PY
echo "hpcrl installed in $VENV"
