#!/usr/bin/env bash
# Installs hpcrl into ./.venv (never sglang or transformer-engine: SGLang gets its own environment,
# docs/sglang_install.md).
#   bash install.sh          # runtime, CPU build of torch (laptops, CI, CPU nodes); on Linux, where pip's
#                            # index offers only PyPI's CUDA wheel, from PyTorch's CPU index (or
#                            # HPCRL_TORCH_INDEX=<a CPU wheel index of torch>)
#   bash install.sh --test   # runtime + test tools (wandb included: the W&B logger's tests)
#   bash install.sh --wandb  # runtime + wandb (logging.wandb_project)
#   bash install.sh --cuda   # the trainer's environment on GPU nodes: the CUDA build of torch==2.13.0
#                            # (PyPI's Linux wheel, or HPCRL_TORCH_INDEX=<a CUDA wheel index of torch>)
# Flags combine (--cuda --test --wandb). Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${HPCRL_VENV:-.venv}"
extras="" cuda=0
for arg in "$@"; do
  case "$arg" in
    --test) extras="${extras:+$extras,}test" ;;
    --wandb) extras="${extras:+$extras,}wandb" ;;
    --cuda) cuda=1 ;;
    *) echo "install.sh: unknown option '$arg'; use --test, --wandb and/or --cuda" >&2; exit 2 ;;
  esac
done
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip wheel
fi
# torch first and exactly pinned, so nothing later can pull another build.
if (( cuda )); then
  "$VENV/bin/pip" install -q "torch==2.13.0" ${HPCRL_TORCH_INDEX:+--index-url "$HPCRL_TORCH_INDEX"}
else
  index="${HPCRL_TORCH_INDEX:-}"
  # PyPI's Linux wheel of torch 2.13.0 is a CUDA build (GBs of CUDA libraries): ask pip what it would
  # take, and where that is not a +cpu build, take PyTorch's CPU index. macOS wheels are CPU builds.
  if [[ -z "$index" && "$(uname -s)" == Linux ]]; then
    picked=$("$VENV/bin/pip" install -q --dry-run --ignore-installed --no-deps --report - "torch==2.13.0" \
             | "$VENV/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])')
    [[ "$picked" == *+cpu ]] || index="https://download.pytorch.org/whl/cpu"
  fi
  "$VENV/bin/pip" install -q "torch==2.13.0" ${index:+--index-url "$index"}
fi
"$VENV/bin/pip" install -q -e ".${extras:+[$extras]}"
HPCRL_WANT_CUDA=$cuda "$VENV/bin/python" - <<'PY'
import os
import torch
if os.environ["HPCRL_WANT_CUDA"] == "1":
    assert torch.version.cuda is not None, (
        f"install.sh --cuda: torch {torch.__version__} is a CPU build; remove .venv and point "
        "HPCRL_TORCH_INDEX at a CUDA wheel index of torch 2.13.0 (docs/sglang_install.md)")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs here: {torch.cuda.device_count()}")
else:
    assert torch.version.cuda is None, (
        f"a CUDA build of torch was installed ({torch.__version__}); hpcrl's CPU install needs "
        "torch==2.13.0+cpu: remove .venv and set HPCRL_TORCH_INDEX to a CPU wheel index of torch "
        "(https://download.pytorch.org/whl/cpu), or use --cuda on GPU nodes")
PY
echo "hpcrl installed in $VENV"
