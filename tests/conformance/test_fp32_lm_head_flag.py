"""rollout.fp32_lm_head against SGLang 0.5.23 (issue 33): hpcrl's launch command with it parses, in
SGLang's own server-argument parser, to enable_fp32_lm_head=True (False without it), and SGLang's
LM head under that flag is the float32 matmul of the hidden states that the reference engine
computes (hpcrl/rollout/direct_forward.py `lm_head_logits`)."""

from __future__ import annotations

import ast
from pathlib import Path

from sglang_wheel import parse_with_sglang

from hpcrl.config import JobConfig
from hpcrl.rollout.worker import FP32_LM_HEAD_FLAG, sglang_command



def _argv(tmp_path: Path, fp32_lm_head: bool) -> list[str]:
    job = JobConfig()
    job.model.dtype, job.rollout.backend, job.resources.device = "bfloat16", "sglang", "cuda"
    job.rollout.fp32_lm_head = fp32_lm_head
    cmd = sglang_command(job, tmp_path, "10.0.0.7", 31234)
    argv = cmd[cmd.index("sglang.launch_server") + 1:]
    keys = Path(argv[argv.index("--config") + 1])
    keys.write_text("api-key: a\nadmin-api-key: b\n")  # the job's key file hpcrl writes at start-up
    return argv


def test_sglang_parses_the_flag_hpcrl_adds(sglang_root, tmp_path):
    (tmp_path / "model_config.json").write_text("{}")
    argvs = [_argv(tmp_path, True), _argv(tmp_path, False)]
    assert argvs[0].count(FP32_LM_HEAD_FLAG) == 1 and FP32_LM_HEAD_FLAG not in argvs[1]
    report = parse_with_sglang(sglang_root, argvs, tmp_path, timeout_s=240)
    assert report["options"][FP32_LM_HEAD_FLAG] == "enable_fp32_lm_head"
    on, off = report["results"]
    assert "error" not in on, on
    assert on["enable_fp32_lm_head"] is True and off["enable_fp32_lm_head"] is False


def test_sglangs_fp32_head_is_an_fp32_matmul(sglang_root):
    """LogitsProcessor._compute_lm_head's plain-weight branch under use_fp32_lm_head (the CPU path;
    on CUDA a bf16 mm with out_dtype float32: the same products, each exact in fp32) and where the
    flag sets it."""
    source = (sglang_root / "src/sglang/srt/layers/logits_processor.py").read_text()
    tree = ast.parse(source)
    head = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_compute_lm_head")
    branches = [n for n in ast.walk(head)
                if isinstance(n, ast.If) and ast.unparse(n.test) == "self.use_fp32_lm_head"]
    assert len(branches) == 2, "SGLang's fp32 LM head changed shape; update this test"
    bodies = {ast.unparse(b.body[0]) for b in branches}  # the weight's branch and GGUF's
    want = "logits = torch.matmul(hidden_states.to(torch.float32), lm_head.weight.to(torch.float32).T)"
    assert want in bodies
    assert "self.use_fp32_lm_head = get_exec().features.enable_fp32_lm_head" in source
