"""Validation of a job's `slurm:` section on its own (no cluster needed; `hpcrl submit` checks the
cluster): names, the time limit, the MPI plugin, the checkpoint signal, and extra sbatch/srun options
checked by launch/slurm_spec.py's own rules, so validation accepts exactly what the templates render.

It lives outside `hpcrl.config` because it needs `launch`, and `hpcrl.config` is imported by code
that must not pull `launch` in (the engine-side weight loader's closure stays small:
tests/unit/test_import_closure.py). `hpcrl.config.validate` calls `check_slurm`.
"""

from __future__ import annotations

import re

from hpcrl.config.errors import ConfigError, did_you_mean
from hpcrl.config.schema import JobConfig
from launch.slurm_spec import MPI_PLUGINS, SlurmComponent, SlurmJobSpec, option_name, parse_time_limit

# sbatch/srun options hpcrl writes itself (launch/slurm_spec.py) -> what to do instead, in job-file terms.
SLURM_OWNED_OPTIONS = {
    "sbatch": {
        **dict.fromkeys(("account", "A"), "set slurm.account instead"),
        **dict.fromkeys(("chdir", "D"), "the job runs in the run dir; set logging.run_dir or --run-dir"),
        **dict.fromkeys(("cpus-per-task", "c"), "set resources.cpus_per_rank instead"),
        "cpus-per-gpu": "set resources.cpus_per_rank instead (sbatch refuses it beside the --cpus-per-task "
                        "hpcrl writes)",
        **dict.fromkeys(("error", "e", "output", "o"),
                        "the logs go to RUN_DIR/logs (see docs/on_disk_layout.md)"),
        **dict.fromkeys(("gpus-per-node", "gres", "gpus", "G", "gpus-per-task"),
                        "set resources.gpus_per_node instead (hpcrl asks for --gpus-per-node)"),
        **dict.fromkeys(("mem-per-cpu", "mem-per-gpu"), "set slurm.mem_gb instead (sbatch refuses it beside "
                                                        "the --mem hpcrl writes)"),
        **dict.fromkeys(("array", "a"), "remove it: each array task would run the same job into one run dir; "
                                        "submit one job per run"),
        **dict.fromkeys(("job-name", "J"), "set name instead"),
        "mem": "set slurm.mem_gb instead",
        **dict.fromkeys(("nodes", "N"), "set resources.nodes / resources.rollout_nodes instead"),
        **dict.fromkeys(("ntasks-per-node", "ntasks", "n", "ntasks-per-gpu"),
                        "hpcrl places the ranks; set trainer.num_procs, rollout.num_engines and resources.nodes"),
        "open-mode": "remove it: the logs are always appended across requeues",
        **dict.fromkeys(("partition", "p"), "set slurm.partition instead"),
        **dict.fromkeys(("qos", "q"), "set slurm.qos instead"),
        **dict.fromkeys(("requeue", "no-requeue"), "remove it: hpcrl always passes --requeue (preemption)"),
        "signal": "set slurm.signal_delay_s instead",
        **dict.fromkeys(("time", "t"), "set slurm.time instead"),
    },
    "srun": {
        "het-group": "remove it: the step spans every component", "mpi": "set slurm.mpi instead",
        **dict.fromkeys(("ntasks", "n", "ntasks-per-node", "nodes", "N"),
                        "remove it: the step runs one rank per task the job asked for"),
        **dict.fromkeys(("output", "o", "error", "e"), "remove it: the ranks' logs go to RUN_DIR/logs"),
        **dict.fromkeys(("chdir", "D"), "remove it: the step runs in the run dir"),
        **dict.fromkeys(("kill-on-bad-exit", "K"), "remove it: hpcrl passes --kill-on-bad-exit=0 and stops "
                                                   "the world itself, naming the rank that failed"),
    },
}


def _check_slurm_options(key: str, options: list[str], tool: str) -> None:
    for i, opt in enumerate(options):
        if "\n" in opt or "\r" in opt:
            raise ConfigError(f"{key}[{i}]", opt, "must be one line; give one option per list item")
        if opt.lstrip().startswith("#"):
            raise ConfigError(f"{key}[{i}]", opt, f"give the bare {tool} option (e.g. '--constraint=h100'), "
                                                  "without '#SBATCH'")
        if not opt.startswith("-"):
            raise ConfigError(f"{key}[{i}]", opt, f"must be a {tool} option starting with '-' "
                                                  "(e.g. '--exclusive'); one option per list item")
        name, owned = option_name(opt), SLURM_OWNED_OPTIONS[tool]
        fix = owned.get(name)
        if fix is not None:
            raise ConfigError(f"{key}[{i}]", opt, f"hpcrl writes this {tool} option itself; {fix}")
        # sbatch and srun take a prefix of a long option for the option (none of theirs is a prefix of
        # one hpcrl writes: a prefix here is an abbreviation, or ambiguous, which they refuse)
        full = sorted(o for o in owned if len(o) > 1 and opt.startswith("--") and len(name) >= 2
                      and o.startswith(name))
        if full:
            raise ConfigError(f"{key}[{i}]", opt, f"{tool} reads '--{name}' as an abbreviation of '--{full[0]}', "
                                                  f"which hpcrl writes itself; {owned[full[0]]}")
    try:  # the template's own checks, so validate accepts exactly what launch/slurm_spec.py renders
        if tool == "sbatch":
            SlurmComponent(nodes=1, ntasks_per_node=1, extra_sbatch_options=tuple(options))
        else:
            SlurmJobSpec(job_name="x", partition="x", time_limit_min=1, command="x", run_dir="/x",
                         log_dir="/x", components=(SlurmComponent(nodes=1, ntasks_per_node=1),),
                         extra_srun_options=options)
    except ValueError as exc:
        raise ConfigError(key, options, str(exc)) from None


def check_slurm(job: JobConfig) -> None:
    """The `slurm:` section on its own (no cluster needed); `hpcrl submit` checks the cluster."""
    s = job.slurm
    for leaf in ("partition", "account", "qos"):
        value = getattr(s, leaf)
        if value is not None and not re.fullmatch(r"[^\s'\"%\\]+", value):
            raise ConfigError(f"slurm.{leaf}", value, "must be a name without whitespace, quotes, "
                                                      "backslashes or '%', or null for the cluster's default")
    try:
        minutes = parse_time_limit(s.time, "slurm.time")
    except ValueError as exc:
        hint = ("a zero time limit; give a positive one such as '01:00:00'" if "zero" in str(exc) else
                "not a Slurm time limit; use minutes ('90'), 'HH:MM:SS' ('04:00:00') or 'D-HH:MM:SS' "
                "('1-12:00:00')")
        raise ConfigError("slurm.time", s.time, hint) from None
    if s.mem_gb < -1:
        raise ConfigError("slurm.mem_gb", s.mem_gb, "must be >= 0 (GB per node; 0 asks for all of each "
                                                    "node's memory) or -1 for the partition's default")
    if s.mpi not in MPI_PLUGINS:
        raise ConfigError("slurm.mpi", s.mpi, f"must be one of: {', '.join(MPI_PLUGINS)} (pmi2 works with "
                                              f"PyPI mpich){did_you_mean(s.mpi, MPI_PLUGINS)}")
    if not 1 <= s.signal_delay_s <= 65535:
        raise ConfigError("slurm.signal_delay_s", s.signal_delay_s, "must be in [1, 65535] seconds")
    if s.max_requeues < 0:
        raise ConfigError("slurm.max_requeues", s.max_requeues, "must be >= 0 (requeues in a row without a "
                                                                "newer checkpoint), e.g. 3")
    if s.signal_delay_s >= minutes * 60:
        raise ConfigError("slurm.signal_delay_s", s.signal_delay_s,
                          f"the checkpoint signal would come at or before the start of an attempt of "
                          f"slurm.time={s.time!r} ({minutes * 60} s); use a delay below {minutes * 60} s "
                          "or a longer slurm.time")
    if s.python is not None and not s.python.strip():
        raise ConfigError("slurm.python", s.python, "must be an interpreter path or name (e.g. 'python'), "
                                                    "or null for the one running hpcrl submit")
    for i, line in enumerate(s.env_setup):
        if "\n" in line or "\r" in line:
            raise ConfigError(f"slurm.env_setup[{i}]", line, "must be one line; give one shell line per "
                                                             "list item")
    _check_slurm_options("slurm.extra_sbatch_options", s.extra_sbatch_options, "sbatch")
    _check_slurm_options("slurm.rollout_extra_sbatch_options", s.rollout_extra_sbatch_options, "sbatch")
    _check_slurm_options("slurm.extra_srun_options", s.extra_srun_options, "srun")
