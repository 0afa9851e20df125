"""`hpcrl plan` as a user runs it, on the two full-scale example jobs: a subprocess, no GPU, no
child processes; text and --json reports with sane numbers; bad layouts exit 2 with one line naming
the job key and the nearest valid values; a layout that does not fit GPU memory is shown, then fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, load_job
from hpcrl.models.presets import load_hf_config

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
DEEPSEEK = REPO / "examples" / "deepseek_v3_671b.yaml"
QWEN = REPO / "examples" / "qwen3_235b.yaml"
EXAMPLES = {"deepseek_v3_671b": (DEEPSEEK, 671e9, 256, 128), "qwen3_235b": (QWEN, 235e9, 128, 64)}
EXAMPLES_CONFIG = {"deepseek_v3_671b": REPO / "moe" / "configs" / "deepseek-v3.json",
                   "qwen3_235b": REPO / "moe" / "configs" / "qwen3-235b-a22b.json"}
GIB = 2**30

# Runs `hpcrl plan` with every way of starting a process or touching a GPU made to fail loudly.
GUARDED = textwrap.dedent("""
    import multiprocessing, os, subprocess, sys
    def refuse(*a, **k):
        raise RuntimeError("hpcrl plan tried to start a process")
    subprocess.Popen.__init__ = refuse
    os.fork = os.posix_spawn = os.posix_spawnp = os.system = refuse
    multiprocessing.Process.start = refuse
    from hpcrl.cli import main
    rc = main(sys.argv[1:])
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError("hpcrl plan imported mpi4py.MPI (MPI_Init)")
    import torch
    assert not torch.cuda.is_initialized(), "hpcrl plan initialised CUDA"
    sys.exit(rc)
""")


def hpcrl_plan(*args: str, guarded: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", GUARDED, "plan", *args] if guarded else [sys.executable, "-m", "hpcrl.cli",
                                                                          "plan", *args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module", params=list(EXAMPLES))
def json_report(request):
    path, published, trainer_gpus, rollout_gpus = EXAMPLES[request.param]
    out = hpcrl_plan(str(path), "--json", guarded=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), published, trainer_gpus, rollout_gpus


def test_json_report_has_the_required_keys_and_sane_values(json_report):
    r, published, trainer_gpus, rollout_gpus = json_report
    for key in ("total_params", "lower_bound_s", "estimate_s", "baseline_broadcast_s",
                "max_recv_bytes_per_gpu", "must_hold_bytes_per_gpu", "max_send_bytes_per_gpu",
                "mean_send_bytes_per_gpu", "mean_recv_bytes_per_gpu"):
        assert key in r, key
    assert abs(r["total_params"] - published) / published < 0.005
    assert r["estimate_s"] >= r["lower_bound_s"] > 0
    assert r["baseline_broadcast_s"] > r["estimate_s"]
    # hpcrl's SGLang path: many sources, so a smaller gather than the baseline's, but every rollout
    # GPU still receives the whole model (SGLang loads whole tensors on every TP rank)
    sg = r["sglang_broadcast_terms"]
    assert sg["num_sources"] > 1 and sg["broadcast_s"] == pytest.approx(r["baseline_terms"]["broadcast_s"])
    assert r["sglang_broadcast_s"] == pytest.approx(sg["gather_s"] + sg["broadcast_s"])
    assert r["estimate_s"] < r["sglang_broadcast_s"] <= r["baseline_broadcast_s"]
    t, ro = r["trainer"], r["rollout"]
    assert (t["world_size"], ro["world_size"]) == (trainer_gpus, rollout_gpus)
    # Each figure is the max over trainer GPUs (possibly of different GPUs), so the parts bound the total.
    # The broadcast route adds the largest share a source gathers and keeps: at least the mean share.
    buffers = t["sync_buffer_bytes_per_gpu"]
    assert r["total_bytes"] / sg["num_sources"] <= buffers < r["total_bytes"]
    parts = (t["params_bytes_per_gpu"], t["grads_bytes_per_gpu"], t["optimizer_bytes_per_gpu"])
    activations = t["activations_bytes_per_gpu"]
    assert min(parts) > 0 and max(parts) + buffers + activations < t["total_bytes_per_gpu"] <= \
        sum(parts) + buffers + activations
    _check_activations(t, r["trainer"]["layout"], load_hf_config(None, str(EXAMPLES_CONFIG[r["job"]])))
    # model.dtype bfloat16: bf16 params, fp32 grads, fp32 main params + Adam m, v sharded over DP; no
    # reference model (kl_coef 0). The float32 build (model.dtype: float32) is shown beside it.
    assert t["build"]["param_dtype"] == "bfloat16" and t["build"]["distributed_optimizer"]
    assert t["build"]["main_params"] and t["build"]["built_by_run_today"]
    assert t["build"]["note"] == "what hpcrl run builds"
    assert t["reference_bytes_per_gpu"] == 0
    assert t["grads_bytes_per_gpu"] == pytest.approx(2 * t["params_bytes_per_gpu"])
    assert t["adam_state_bytes_per_gpu"] == pytest.approx(2 * t["main_params_bytes_per_gpu"])
    assert t["optimizer_bytes_per_gpu"] == pytest.approx(t["adam_state_bytes_per_gpu"]
                                                         + t["main_params_bytes_per_gpu"])
    o = t["other_build"]
    assert o["build"]["param_dtype"] == "float32" and o["build"]["built_by_run_today"]
    assert o["build"]["note"] == "what hpcrl run builds with model.dtype: float32"
    assert not o["build"]["distributed_optimizer"] and o["main_params_bytes_per_gpu"] == 0
    assert o["params_bytes_per_gpu"] == pytest.approx(2 * t["params_bytes_per_gpu"])
    assert o["optimizer_bytes_per_gpu"] == pytest.approx(2 * o["grads_bytes_per_gpu"])  # m, v replicated
    # The times, grouped by route: both examples use SGLang, which takes the broadcast route.
    assert r["weight_sync"] == {"rollout_backend": "sglang", "weight_sync": "auto", "route": "broadcast"}
    assert r["routes"]["shard"]["engines"] == ("hpcrl reference engine; SGLang (Qwen3-MoE) through hpcrl's "
                                               "loader")
    assert r["routes"]["shard"]["estimate_s"] == r["estimate_s"]
    assert r["routes"]["broadcast"]["sglang_broadcast_s"] == r["sglang_broadcast_s"]
    assert r["routes"]["broadcast"]["baseline_broadcast_s"] == r["baseline_broadcast_s"]
    # Every trainer GPU holds a piece; together they hold at least the whole model once.
    assert t["params_bytes_per_gpu"] * trainer_gpus >= r["total_bytes"]
    assert ro["weights_bytes_per_gpu"] * rollout_gpus >= r["total_bytes"]
    assert t["fits"] and ro["fits"] and r["fits"] and r["memory_errors"] == {}
    assert max(t["total_bytes_per_gpu"], ro["weights_bytes_per_gpu"]) <= 80 * GIB
    # Each rollout GPU receives exactly what it must hold, once (bf16 weights of its shard).
    assert r["max_recv_bytes_per_gpu"] == pytest.approx(r["must_hold_bytes_per_gpu"])
    assert 0 < r["mean_recv_bytes_per_gpu"] <= r["max_recv_bytes_per_gpu"]
    assert 0 < r["mean_send_bytes_per_gpu"] <= r["max_send_bytes_per_gpu"]
    # Every byte the rollout GPUs receive crosses a NIC or an NVLink exactly once.
    moved = r["plan"]["nic_bytes"] + r["plan"]["nvlink_bytes"]
    assert moved == pytest.approx(r["mean_recv_bytes_per_gpu"] * rollout_gpus)
    assert r["network"] == {"gpus_per_node": 8, "nics_per_node": 8, "nic_gbit_per_s": 400.0,
                            "nvlink_gbyte_per_s": 450.0, "colocated": False, "round_latency_s": 0.0}


def _check_activations(t: dict, layout: dict, hf: dict) -> None:
    """The examples recompute fully, one layer per chunk (as slime's scripts): every stage keeps, per
    micro-batch in flight (1F1B: pp - stage, at most the step's), one bf16 input [L / (cp * tp), mb, H]
    per layer (sequence parallel); the last stage adds the log-prob head's float32 exp [mb, T / cp,
    V / tp]. The bf16 build's figures are half the float32 build's."""
    act, o = t["activations"], t["other_build"]["activations"]
    step = act["step"]
    assert (step["recompute"], step["recompute_method"], step["recompute_num_layers"]) == ("full", "uniform", 1)
    tp, cp, pp = layout["tp"], layout["cp"], layout["pp"]
    H, V, mb = hf["hidden_size"], hf["vocab_size"], step["micro_batch_size"]
    per_input = -(-step["seq_len"] // (cp * tp)) * mb * H * 2
    head = 4 * mb * -(-step["response_len"] // cp) * -(-V // tp)
    assert [st["layers"] for st in act["per_stage"]] == [len(r) for r in _stage_layers(layout, hf)]
    for s, st in enumerate(act["per_stage"]):
        assert st["in_flight"] == min(pp - s, step["num_micro_batches"]) > 0
        assert st["layer_inputs_bytes"] == st["in_flight"] * st["layers"] * per_input
        assert st["head_bytes"] == (head if s == pp - 1 else 0)
        assert o["per_stage"][s]["layer_inputs_bytes"] == 2 * st["layer_inputs_bytes"]
    assert act["bytes_per_gpu"] == max(st["bytes"] for st in act["per_stage"]) == t["activations_bytes_per_gpu"]
    assert "data.task=copy's" in act["prompt_from"] and "decoder layers" not in act["not_counted"]


def _stage_layers(layout: dict, hf: dict) -> list[range]:
    from moe.layouts import TrainerLayout

    keys = ("tp", "pp", "ep", "etp", "dp", "cp", "first_stage_layers", "last_stage_layers")
    return TrainerLayout(**{k: layout[k] for k in keys if k in layout}).stage_layers(hf["num_hidden_layers"])


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_text_report(name):
    path, published, trainer_gpus, rollout_gpus = EXAMPLES[name]
    out = hpcrl_plan(str(path))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    text = out.stdout
    assert f"{published / 1e9:.0f}" in text.splitlines()[1]  # e.g. "671.03B params"
    for needle in (f"trainer          {trainer_gpus} GPUs", f"rollout          {rollout_gpus} GPUs",
                   "params ", "grads ", "optimizer ", "weights ", "(fits)", "line-rate lower bound",
                   "broadcast baseline", "send max", "mean", "receive max",
                   "  build          bfloat16 params, fp32 grads", "(distributed optimizer)",
                   "  float32 build  params ", "what hpcrl run builds with model.dtype: float32",
                   "this job's run takes the broadcast route (rollout.backend sglang"):
        assert needle in text, needle
    assert "DOES NOT FIT" not in text
    # rollout.backend sglang: the route SGLang can take comes first, the shard figure is labelled
    # as the reference engine's only.
    lines = text.splitlines()
    labels = ("  broadcast      ", "  shard          ")
    routes = [i for i, line in enumerate(lines) if line.startswith(labels)]
    broadcast, shard = (lines[i] for i in routes)
    assert routes[1] == routes[0] + 1 and lines[routes[0] - 1].startswith("weight sync      ")
    assert broadcast.startswith("  broadcast      SGLang's update_weights_from_distributed")
    assert "hpcrl " in broadcast
    assert "broadcast baseline" in broadcast
    assert shard.startswith("  shard          trainer shards straight to the engines (reference engine; "
                            "SGLang Qwen3-MoE via hpcrl's loader): estimate ")
    assert "line-rate lower bound" in shard


@pytest.mark.parametrize(("example", "override", "expected"), [
    (DEEPSEEK, "trainer.ep=32", "trainer.ep=32: ep=32 with etp=1 does not divide tp*cp*dp=16"),
    (DEEPSEEK, "trainer.ep=12", "trainer.ep=12: ep=12 does not divide num_experts=256; nearest valid ep: [4, 8, 16]"),
    (DEEPSEEK, "trainer.pp=7", "trainer.pp=7: 61 decoder layers do not split over pp=7"),
    (DEEPSEEK, "trainer.num_procs=250", "trainer.num_procs=250: must be a multiple of tp*cp*pp=16"),
    (DEEPSEEK, "rollout.dp_attention=3",
     "rollout.dp_attention=3: dp_attention=3 must divide tp_per_engine=32"),
    (QWEN, "trainer.tp=3", "trainer.tp=3: tp=3 must divide num_heads=64 and num_kv_heads=4"),
    (QWEN, "trainer.etp=5", "trainer.etp=5: etp=5 does not divide moe_intermediate_size=1536"),
    (QWEN, "rollout.ep=3", "rollout.ep=3: ep=3 must divide tp_per_engine=8"),
], ids=["ep", "ep-experts", "pp", "num_procs", "dp_attention", "tp", "etp", "rollout-ep"])
def test_bad_layout_exits_2_naming_the_key_and_valid_values(example, override, expected):
    out = hpcrl_plan(str(example), "--set", override)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hpcrl plan: error: {expected}"), out.stderr
    assert "nearest valid" in lines[0]
    assert out.stdout == ""


def test_layout_that_does_not_fit_is_shown_then_fails():
    out = hpcrl_plan(str(QWEN), "--set", "network.gpu_memory_gb=40")
    assert out.returncode == 2, out.stderr
    assert "(DOES NOT FIT)" in out.stdout and "broadcast baseline" in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hpcrl plan: error: rollout='num_engines=8 tp_per_engine=8"), lines
    assert "> gpu memory 40.0 GiB" in lines[0] and "network.gpu_memory_gb=40" in lines[0]


def test_plan_purpose_loads_deepseek_while_run_refuses_plan_only_keys():
    job = load_job(DEEPSEEK, purpose="plan")
    assert (job.trainer.first_stage_layers, job.rollout.dp_attention) == (3, 32)
    # hpcrl validate/run/submit: the trainer reads DeepSeek-V3 (stages of 3, 14 x 4 and 2 layers),
    # the engines' EP32 and DP attention 32 split it, and the resources check speaks: an engine of 32
    # GPUs does not fit a node of 8 unless it spans nodes (rollout.nodes_per_engine, 4 in the example)
    load_job(DEEPSEEK)
    with pytest.raises(ConfigError) as exc:
        load_job(DEEPSEEK, ["rollout.nodes_per_engine=1"])
    assert exc.value.path == "rollout.nodes_per_engine"
    assert "an engine node's 32 GPUs (rollout.tp_per_engine / nodes_per_engine) are more than the 8" in \
        exc.value.hint
    with pytest.raises(ConfigError) as exc:  # plan-only keys are named before the model
        load_job(DEEPSEEK, ["trainer.cp=2"])
    assert exc.value.path == "trainer.cp" and "`hpcrl plan` only" in exc.value.hint


TINY = REPO / "examples" / "tiny_moe_grpo.yaml"


@pytest.mark.parametrize(("overrides", "first"), [([], "shard"), (["rollout.backend=sglang"], "broadcast"),
                                                  (["resources.device=cuda"], "broadcast")])
def test_the_route_the_run_takes_is_listed_first(overrides, first):
    """The reference engine on CPU takes the shard route (auto); SGLang, or any engine on GPUs, takes
    the broadcast route. Either way the shard line says it is the reference engine's only."""
    from hpcrl.plan_cmd import plan_job, render

    report = plan_job(load_job(TINY, overrides, purpose="plan"))
    assert report["weight_sync"]["route"] == first
    lines = render(report).splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("weight sync      "))
    assert f"this job's run takes the {first} route" in lines[heading]
    assert lines[heading + 1].startswith(f"  {first:<15}")
    second = lines[heading + 2]
    assert second.startswith("  broadcast      " if first == "shard" else "  shard          ")
    shard = next(line for line in lines if line.startswith("  shard          "))
    assert "(reference engine; SGLang Qwen3-MoE via hpcrl's loader)" in shard


def test_tiny_plan_counts_the_reference_model_when_kl_coef_is_set():
    from hpcrl.plan_cmd import plan_job, render

    without = plan_job(load_job(TINY, purpose="plan"))["trainer"]
    report = plan_job(load_job(TINY, ["algorithm.kl_coef=0.05"], purpose="plan"))
    t, n = report["trainer"], 82_816
    assert (without["params_bytes_per_gpu"], without["reference_bytes_per_gpu"]) == (4 * n, 0)
    assert (t["params_bytes_per_gpu"], t["grads_bytes_per_gpu"], t["optimizer_bytes_per_gpu"],
            t["reference_bytes_per_gpu"]) == (4 * n, 4 * n, 8 * n, 4 * n)
    assert t["total_bytes_per_gpu"] == without["total_bytes_per_gpu"] + 4 * n
    assert t["build"]["reference_model"] and "frozen reference model" in t["build"]["description"]
    assert "+ reference 0.32 MiB + activations >= 0.06 MiB = 1.64 MiB  (fits)" in render(report)


def test_trainer_that_does_not_fit_is_shown_then_fails():
    from hpcrl.plan_cmd import plan_job, run_plan

    overrides = ["algorithm.kl_coef=0.1", "network.gpu_memory_gb=36"]
    report = plan_job(load_job(QWEN, overrides, purpose="plan"))
    assert not report["trainer"]["fits"] and report["trainer"]["total_bytes_per_gpu"] > 36 * GIB
    msg = report["memory_errors"]["trainer"]
    assert "+ reference " in msg and "> gpu memory 36.0 GiB; increase pp, ep or tp (fits with " in msg
    with pytest.raises(ConfigError) as exc:
        run_plan(QWEN, overrides, as_json=False, out=open(os.devnull, "w"))
    assert exc.value.path == "trainer" and "network.gpu_memory_gb=36" in exc.value.hint


def test_activations_count_toward_the_gpu_memory():
    """Long responses: the trainer's weights, grads and optimizer fit 39 GiB, the activations they keep do not
    (16 Ki-token responses after 2 Ki-token prompts; the last stage's log-prob head alone is
    4 * 8192 * 75968 bytes: 16384 / cp response positions, 151936 / tp vocab entries)."""
    from hpcrl.plan_cmd import plan_job, render, run_plan

    long = ["rollout.max_new_tokens=16384", "data.max_prompt_tokens=2048"]
    short, report = (plan_job(load_job(QWEN, o + ["network.gpu_memory_gb=39"], purpose="plan"))
                     for o in ([], long))
    t = report["trainer"]
    static = t["total_bytes_per_gpu"] - t["activations_bytes_per_gpu"]
    assert short["trainer"]["fits"] and static < 39 * GIB < t["total_bytes_per_gpu"] and not t["fits"]
    act = t["activations"]
    assert act["per_stage"][-1]["head_bytes"] == 4 * 8192 * 75968
    assert act["step"]["seq_len"] == 18432 and act["prompt_from"] == "data.max_prompt_tokens=2048"
    assert "activations >= " in report["memory_errors"]["trainer"]
    assert "micro-batches of 1 x 18432 tokens (data.max_prompt_tokens=2048 + 16384 response tokens)" in \
        render(report)
    with pytest.raises(ConfigError) as exc:
        run_plan(QWEN, long + ["network.gpu_memory_gb=39"], as_json=False, out=open(os.devnull, "w"))
    assert exc.value.path == "trainer" and "+ activations >= " in exc.value.hint


@pytest.mark.parametrize("overrides, shape", [
    ([], (6, 4, 64, 2)),  # 16 prompts x 8 completions on one DP rank, 64 per micro-batch
    (["trainer.max_tokens_per_micro_batch=60"], (6, 4, 10, 13)),  # 60 // 6 sequences per micro-batch
    (["algorithm.name=ppo", "algorithm.mini_batch_size=32"], (6, 4, 32, 1)),  # one update per mini-batch
    (["trainer.num_procs=2", "trainer.ep=2", "trainer.tp=2", "trainer.etp=2", "trainer.micro_batch_size=16"],
     (6, 4, 16, 8)),  # tp 2: 6 tokens pad to 6; dp 1
    (["data.max_prompt_tokens=7", "trainer.tp=2", "trainer.etp=2", "trainer.num_procs=2"], (12, 4, 64, 2)),
], ids=["fixed", "by-tokens", "mini-batches", "tp2", "max-prompt-tp2"])
def test_the_step_shape_plan_counts(overrides, shape):
    """(padded sequence, response positions, sequences per micro-batch, micro-batches per update and
    DP rank) of the tiny example: its copy task's 2-token prompts + 4 new tokens, padded to tp."""
    from hpcrl.plan_cmd import longest_prompt, step_shape

    job = load_job(TINY, overrides, purpose="plan")
    got = step_shape(job, longest_prompt(job)[0])
    assert (got.seq_len, got.response_len, got.micro_batch_size, got.num_micro_batches) == shape


def test_responses_that_fill_the_context_are_refused_naming_max_new_tokens():
    """A data file's prompts (not read by the plan) get the context less the responses: none left
    was a traceback (a negative prompt length)."""
    out = hpcrl_plan(str(TINY), "--set", "data.task=null", "--set", "data.path=prompts.jsonl",
                     "--set", "rollout.max_new_tokens=100")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "rollout.max_new_tokens=100: leaves no room for a prompt: the model's context " \
           "(max_position_embeddings=64 of preset 'tiny-qwen3-moe' - rollout.max_new_tokens=100 - 7 = -43 tokens); " \
           "use max_new_tokens <= 56" in out.stderr, out.stderr


def _job_with_model_dir(tmp_path: Path, config: dict | None, name: str = "Tiny-MoE") -> Path:
    if config is not None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    job = tmp_path / "job.yaml"
    job.write_text(f"name: from_dir\nmodel:\n  path: {name}\n")
    return job


def test_plan_reads_model_path_config_json(tmp_path):
    from hpcrl.models.presets import load_hf_config
    from hpcrl.plan_cmd import plan_job

    config = {**load_hf_config("tiny-qwen3-moe", None), "num_hidden_layers": 3}
    report = plan_job(load_job(_job_with_model_dir(tmp_path, config), purpose="plan"))
    assert report["model"] == "qwen3_moe/Tiny-MoE"
    assert report["total_params"] > 82_816  # the directory's 3 layers, not the preset's 2


@pytest.mark.parametrize("what", ["no directory", "no config.json", "not JSON"])
def test_model_path_problems_name_model_path(tmp_path, what):
    from hpcrl.config import job_from_dict
    from hpcrl.models.job_model import build_spec
    from hpcrl.plan_cmd import plan_job

    if what == "no config.json":
        (tmp_path / "Tiny-MoE").mkdir()
    elif what == "not JSON":
        (tmp_path / "Tiny-MoE").mkdir()
        (tmp_path / "Tiny-MoE" / "config.json").write_text("{not json")
    job_file = _job_with_model_dir(tmp_path, None)
    with pytest.raises(ConfigError) as exc:  # validation or the plan: either names model.path
        plan_job(load_job(job_file, purpose="plan"))
    assert exc.value.path == "model.path"
    with pytest.raises(ConfigError) as exc:  # the plan's own reading, without validation
        build_spec(job_from_dict({"model": {"path": "Tiny-MoE"}}, tmp_path))
    assert exc.value.path == "model.path"
    assert {"no directory": "no such directory", "no config.json": "no config.json",
            "not JSON": "is not a JSON file"}[what] in exc.value.hint


def test_plan_counts_the_routes_of_routing_replay():
    """rollout.routing_replay: the plan shows the routes' bytes: per token MoE layers x top_k ids of
    one byte (<= 256 experts), per sample the context's tokens but the last, per step all samples."""
    from hpcrl.plan_cmd import plan_job

    job = load_job(TINY, ["rollout.routing_replay=r3"], purpose="plan")
    routes = plan_job(job)["routing_replay"]
    assert routes["bytes_per_token"] == 2 * 2  # tiny-qwen3-moe: 2 MoE layers, top-2, uint8
    assert routes["bytes_per_sample"] == 4 * routes["max_tokens_per_sample"]
    assert routes["bytes_per_step"] == routes["bytes_per_sample"] * job.data.num_prompts_per_step * \
        job.algorithm.group_size
    assert plan_job(load_job(TINY, purpose="plan"))["routing_replay"] is None
    assert routes["held_by"] == "the controller and trainer rank 0"
    async_job = ["rollout.max_staleness=1"]
    observe, r2 = (plan_job(load_job(TINY, [f"rollout.routing_replay={m}", *async_job], purpose="plan"))
                   for m in ("observe", "r2"))
    # r2's routes are the trainer's own, recorded by its old forward: not the engines', not buffered
    assert r2["routing_replay"]["held_by"] == "every trainer rank (r2)"
    assert observe["async"]["bytes_per_batch"] - r2["async"]["bytes_per_batch"] == \
        routes["bytes_per_step"]


def test_an_engine_tp_that_does_not_split_the_heads_names_tp_per_engine():
    """Attention TP is tp_per_engine / dp_attention: with dp_attention 1 the job set only the first."""
    out = hpcrl_plan(str(QWEN), "--set", "rollout.tp_per_engine=3", "--set", "rollout.ep=1")
    assert out.returncode == 2 and out.stderr.startswith(
        "hpcrl plan: error: rollout.tp_per_engine=3: attention TP tp/dp_attention=3 does not divide num_heads=64"), \
        out.stderr


def test_an_async_plan_of_a_config_without_max_position_embeddings(tmp_path):
    """A data file's prompts are bounded by the context (the plan reads no data file): the async
    buffer's bytes read it from config.json directly, a KeyError for a config that leaves
    max_position_embeddings out (transformers, and now hpcrl, read Qwen3-MoE's 32768 then)."""
    from hpcrl.config.validate_data import CONTEXT_RESERVE
    from hpcrl.models.presets import load_hf_config
    from hpcrl.plan_cmd import plan_job

    cfg = {k: v for k, v in load_hf_config("tiny-qwen3-moe", None).items() if k != "max_position_embeddings"}
    (tmp_path / "model.json").write_text(json.dumps(cfg))
    job = load_job(TINY, [f"model.config_path={tmp_path / 'model.json'}", "model.preset=null", "data.task=null",
                          f"data.path={tmp_path / 'prompts.jsonl'}", "rollout.max_staleness=1"], purpose="plan")
    report = plan_job(job)["async"]
    new = job.rollout.max_new_tokens
    assert report["bytes_per_batch"] == (8 * (32768 - CONTEXT_RESERVE - new) + 16 * new) * \
        job.data.num_prompts_per_step * job.algorithm.group_size


def test_a_synthetic_tasks_prompts_size_the_routes_and_the_async_buffer():
    """The copy task's 2-token prompts, not the model's context (40960 tokens for Qwen3-235B: the
    routes of one step were shown as 40x what they are), bound a sample's tokens; a data file's
    prompts without data.max_prompt_tokens are bounded by the context."""
    from hpcrl.plan_cmd import plan_job

    r = plan_job(load_job(QWEN, ["rollout.routing_replay=r3", "rollout.max_staleness=1"], purpose="plan"))
    assert r["routing_replay"]["max_tokens_per_sample"] == 2 + 1024 - 1
    assert r["async"]["bytes_per_batch"] == (8 * 2 + 16 * 1024 + r["routing_replay"]["bytes_per_sample"]) * 16 * 32
    capped = plan_job(load_job(QWEN, ["rollout.routing_replay=r3", "data.max_prompt_tokens=100"], purpose="plan"))
    assert capped["routing_replay"]["max_tokens_per_sample"] == 100 + 1024 - 1


def test_an_unknown_algorithm_name_is_refused_as_validate_refuses_it():
    # plan sizes ppo's critic by algorithm.name: a typo ("pp0") planned a job without one
    out = hpcrl_plan(str(QWEN), "--set", "algorithm.name=pp0")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcrl plan: error: algorithm.name='pp0'"), out.stderr
    assert "did you mean" in lines[0] and "ppo" in lines[0], lines[0]
    assert out.stdout == ""


def test_a_kl_coef_the_algorithm_refuses_is_not_planned_as_a_reference_model():
    # validate refuses it; plan counted a reference model the run would never build
    out = hpcrl_plan(str(QWEN), "--set", "algorithm.name=gspo", "--set", "algorithm.kl_coef=0.1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("hpcrl plan: error: algorithm.kl_coef=0.1: gspo's loss has no KL term"), out.stderr
