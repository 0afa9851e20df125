"""resources.cpu_bind: the core plan of a local run, and the binding the kernel then reports."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hpcrl import cpu_bind
from hpcrl.cpu_bind import CpuPlan, make_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_grpo.yaml"


@pytest.mark.parametrize(("cores", "trainer", "engines", "per_rank", "service", "blocks"), [
    ([0, 1], 1, 1, 1, (0,), ((1,),)),                      # the tiny example on 2 cores
    ([0, 1, 2, 3], 2, 1, 1, (0, 1), ((2,), (3,))),         # 2 trainer ranks, engine 0 beside rank 1
    ([7, 4, 6, 5], 1, 2, 1, (4, 5), ((6,), (7,))),         # taskset -c 4-7: sorted, highest for blocks
    ([0, 1, 2, 3, 4], 1, 2, 2, (0,), ((1, 2), (3, 4))),    # blocks of cpus_per_rank
])
def test_plan_gives_each_trainer_rank_and_engine_pair_a_block(cores, trainer, engines, per_rank, service,
                                                             blocks):
    plan, why = make_plan(cores, trainer, engines, per_rank)
    assert why == "" and plan == CpuPlan(service, blocks)
    assert plan.for_rank(0, trainer) == service                     # controller
    assert [plan.for_rank(r, trainer) for r in range(1, trainer + 1)] == list(blocks[:trainer])
    assert plan.for_rank(trainer + 1, trainer) == service           # the first engine's host rank
    assert [plan.for_engine(i) for i in range(engines)] == list(blocks[:engines])
    assert CpuPlan.from_env({cpu_bind.ENV: plan.to_env()}) == plan


@pytest.mark.parametrize(("cores", "trainer", "engines", "per_rank"), [
    ([0], 1, 1, 1), ([0, 1], 2, 1, 1), ([0, 1, 2, 3], 1, 1, 4)])
def test_too_few_cores_leaves_the_run_unbound_saying_why(cores, trainer, engines, per_rank):
    plan, why = make_plan(cores, trainer, engines, per_rank)
    assert plan is None
    assert f"{len(cores)} usable core(s)" in why and f"{per_rank} cpus_per_rank" in why, why
    assert CpuPlan.from_env({}) is None


def test_describe_names_who_runs_where():
    plan, _ = make_plan([0, 1, 2, 3], 2, 1, 1)
    assert plan.describe(2, 1) == ("controller on cores 0,1; trainer rank 1 + engine 0 on core 2; "
                                   "trainer rank 2 on core 3")


def _usable() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores to tell bindings apart")
def test_bind_process_moves_threads_already_running_and_the_report_reads_the_kernel():
    """A child process (so the test's own binding is untouched) starts a thread, binds itself, then
    starts another: the kernel shows all three threads on the core."""
    last = _usable()[-1]
    code = (
        "import threading, time\n"
        "from hpcrl import cpu_bind\n"
        "stop = threading.Event()\n"
        "early = threading.Thread(target=stop.wait); early.start()\n"
        f"cpu_bind.bind_process([{last}])\n"
        "late = threading.Thread(target=stop.wait); late.start()\n"
        "print(cpu_bind.report_line('probe'))\n"
        "print(sorted(set(cpu_bind.thread_cores().values())))\n"
        "stop.set()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout.splitlines()
    assert out[0].startswith("cpu_bind: probe (pid ") and out[0].endswith(f"3 threads on core {last}"), out
    assert out[1] == f"[({last},)]", out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores to tell bindings apart")
def test_report_shows_each_thread_when_they_differ():
    first = _usable()[0]
    ready, stop = threading.Event(), threading.Event()

    def pinned():
        os.sched_setaffinity(0, [first])
        ready.set()
        stop.wait()

    t = threading.Thread(target=pinned)
    t.start()
    try:
        ready.wait(10)
        line = cpu_bind.report_line("mixed")
    finally:
        stop.set()
        t.join()
    assert f"thread {t.native_id} core {first}" in line and " | " in line, line


def test_kernel_cpu_lists_parse():
    assert cpu_bind._parse_list("0-2,5") == (0, 1, 2, 5)
    assert cpu_bind._parse_list("3") == (3,)


@pytest.mark.parametrize("case", ["default", "auto", "auto, too few cores"])
def test_hpcrl_run_plans_the_cores_when_asked_and_says_so(capsys, case):
    from hpcrl.config import load_job
    from hpcrl.runner import plan_cores

    usable = sorted(os.sched_getaffinity(0))
    if case == "auto" and len(usable) < 2:
        pytest.skip("needs 2 usable cores for a plan")
    auto = ["resources.cpu_bind=auto"]
    overrides = {"default": [], "auto": auto,
                 "auto, too few cores": [*auto, f"rollout.num_engines={len(usable)}"]}[case]
    env = {cpu_bind.ENV: "stale"}
    plan_cores(load_job(str(EXAMPLE), overrides), env)
    out = capsys.readouterr().out
    if case == "auto":
        plan, _ = make_plan(usable, 1, 1, 1)
        assert CpuPlan.from_env(env) == plan and out == f"cpu_bind: {plan.describe(1, 1)}\n"
    else:
        assert cpu_bind.ENV not in env
        assert out == ("" if case == "default" else
                       f"cpu_bind: not bound: {make_plan(usable, 1, len(usable), 1)[1]}\n"), out


def test_report_of_a_process_that_is_gone_says_so_instead_of_raising():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    line = cpu_bind.report_line("engine 0", proc.pid)
    assert line.startswith(f"cpu_bind: engine 0 (pid {proc.pid}): cores unknown ("), line
