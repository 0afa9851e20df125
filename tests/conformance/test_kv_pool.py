"""`hpcrl plan`'s SGLang KV pool (hpcrl/rollout/kv_pool.py) against SGLang 0.5.23's own code: the
mem_fraction_static heuristic, run from the wheel in a subprocess (_sglang_probe.py mem-fraction) on
the same server arguments, for GPU sizes of every tier, MLA or not, DP attention and the flags the
estimate reads. The flags are parsed by SGLang's parser there, so their spellings are checked too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.rollout.kv_pool import EngineMemoryArgs, mem_fraction_static

PROBE = Path(__file__).parent / "_sglang_probe.py"

# (server arguments, GPU MiB, tp, DP-attention groups, MLA)
CASES = [
    ([], 81920, 8, 1, False),                 # H100 80 GB, the Qwen3-235B example's engine
    ([], 81559, 2, 1, False),                 # an H100's reported capacity, tp < 4
    ([], 81920, 32, 32, True),                # the DeepSeek-V3 example's engine: DP attention over the floor
    ([], 144384, 8, 8, True),                 # H200, DP attention 8, max_bs 512 > 300
    ([], 184320, 4, 1, False),                # B200 tier
    ([], 16384, 1, 1, False),                 # T4 tier: the 10 GiB floor does not apply
    ([], 24576, 4, 1, False),
    ([], 40960, 2, 1, True),
    (["--chunked-prefill-size", "2048", "--cuda-graph-max-bs-decode", "64"], 81920, 32, 32, True),
    (["--chunked-prefill-size", "-1", "--max-prefill-tokens", "32768"], 81920, 8, 1, False),
    (["--max-running-requests", "48"], 144384, 8, 1, False),
    (["--max-total-tokens", "100"], 81920, 8, 1, False),
    (["--cuda-graph-max-bs-prefill", "512"], 81920, 8, 1, False),
    (["--disable-cuda-graph"], 81920, 8, 1, False),
    (["--disable-cuda-graph", "--cuda-graph-backend-decode", "full"], 81920, 8, 1, False),
    (["--disable-prefill-cuda-graph"], 81920, 8, 1, True),
    (["--cuda-graph-backend-decode", "disabled", "--moe-a2a-backend", "deepep"], 81920, 8, 1, False),
    (["--moe-a2a-backend", "deepep"], 81920, 8, 1, False),
    (["--moe-a2a-backend", "deepep", "--cuda-graph-backend-prefill", "full"], 81920, 8, 1, False),
    (["--mem-fraction-static", "0.9"], 81920, 8, 1, False),
]


def test_mem_fraction_static_is_sglangs(sglang_root, tmp_path):
    cases = [{"argv": [*argv, *(["--attn-dp-size", str(dp)] if dp > 1 else []), "--tp-size", str(tp)],
              "gpu_mib": mib, "mla": mla} for argv, mib, tp, dp, mla in CASES]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = subprocess.run([sys.executable, str(PROBE), "mem-fraction", str(sglang_root),
                          str(tmp_path / "cases.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sglang = json.loads(out.stdout.splitlines()[-1])
    ours = [mem_fraction_static(mib, tp, dp, mla, EngineMemoryArgs.from_server_args(argv))[0]
            for argv, mib, tp, dp, mla in CASES]
    assert ours == sglang, [(c[0], c[1:], o, s) for c, o, s in zip(CASES, ours, sglang, strict=True)
                            if o != s]
    # the cases reach distinct branches: no two flag sets on one engine give the same fraction by accident
    h100_tp8 = [s for (argv, mib, tp, dp, mla), s in zip(CASES, sglang, strict=True)
                if (mib, tp, dp, mla) == (81920, 8, 1, False)]
    assert len(set(h100_tp8)) == len(h100_tp8), h100_tp8


@pytest.mark.parametrize("argv", [["--mem-fraction-static", "most"], ["--page-size=big"]])
def test_a_bad_number_names_the_server_arg(argv):
    from hpcrl.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        EngineMemoryArgs.from_server_args(["--tp-size", "8", *argv])
    assert exc.value.path == "rollout.server_args[2]" and "takes a number" in str(exc.value)


def _function(path: Path, name: str):
    import ast

    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_longest_input_hpcrl_reads_is_sglangs(sglang_root):
    """hpcrl/controller/engine_limits.py reads /server_info max_req_input_len (and max_total_num_tokens):
    the scheduler's init info, which /server_info merges in (utils/common.py `build_server_info`), holds
    both; max_req_input_len = min(context_len - 1, KV pool - 1) - 5 (managers/tp_worker.py
    `get_worker_info`), the reference engine's context_len - 6."""
    import ast

    srt = sglang_root / "src" / "sglang" / "srt"
    init = _function(srt / "managers" / "scheduler.py", "get_init_info")
    keys = {k.value for n in ast.walk(init) if isinstance(n, ast.Dict)
            for k in n.keys if isinstance(k, ast.Constant)}
    assert {"max_total_num_tokens", "max_req_input_len"} <= keys, keys
    merged = ast.unparse(_function(srt / "utils" / "common.py", "build_server_info"))
    assert "result.update(scheduler_info)" in merged and "server_args.resolved_dict()" in merged
    worker = ast.unparse(_function(srt / "managers" / "tp_worker.py", "get_worker_info"))
    assert "max_req_len = min(self.model_config.context_len - 1, kv_capacity - 1)" in worker, worker
    assert "max_req_input_len = max_req_len - 5" in worker
