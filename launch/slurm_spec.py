"""The parameters of hpcrl's sbatch templates (`SlurmJobSpec`) and their rendering.

`SlurmJobSpec` is the single source of the parameters of `slurm_templates/hetjob.sbatch.j2` (two
components: 0 = trainer nodes plus the controller, 1 = rollout nodes) and
`slurm_templates/single.sbatch.j2` (one component: small or colocated jobs); a unit test checks that
the set of variables each template reads equals the set of fields here. `render(spec)` validates
nothing beyond the dataclass (validation happens in `__post_init__`, with messages naming the field,
the bad value and the fix) and renders with `StrictUndefined`, so a template that reads a parameter
the spec does not have fails loudly instead of writing an empty string into a job script.
The Jinja delimiters are `<% %>`, `<{ }>` and `<# #>` because the defaults clash with bash
(`{#` starts a Jinja comment but is also the start of `${#arr[@]}`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path

import jinja2

import slurm_templates
from launch.result import REQUEUE_EXIT_CODE

TEMPLATE_DIR = Path(slurm_templates.__file__).parent
HETJOB_TEMPLATE = "hetjob.sbatch.j2"
SINGLE_TEMPLATE = "single.sbatch.j2"
MPI_PLUGINS = ("pmi2", "pmix")

# sbatch options the spec writes itself, long and short spellings -> the field to set instead.
_MANAGED_SBATCH = {
    "account": "account", "A": "account", "chdir": "run_dir", "D": "run_dir",
    "cpus-per-task": "components[i].cpus_per_task", "c": "components[i].cpus_per_task",
    "error": "log_dir", "e": "log_dir", "output": "log_dir", "o": "log_dir",
    "gpus-per-node": "components[i].gpus_per_node", "job-name": "job_name", "J": "job_name",
    "mem": "components[i].mem_gb", "nodes": "components[i].nodes", "N": "components[i].nodes",
    "ntasks-per-node": "components[i].ntasks_per_node", "open-mode": "(always append)",
    "partition": "partition", "p": "partition", "qos": "qos", "q": "qos",
    "requeue": "(always set)", "no-requeue": "(requeue is required for preemption)",
    "signal": "signal_delay_s", "time": "time_limit_min", "t": "time_limit_min",
}
_MANAGED_SRUN = {"het-group": "(set by the template)", "mpi": "mpi"}
# Values that end up in #SBATCH lines: sbatch does not parse shell quoting there, and '%' would be
# expanded as a file-name pattern in paths.
_TOKEN_RE = re.compile(r"^[^\s'\"%\\]+$")
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_limit(text: str, field_name: str = "time") -> int:
    """Minutes (rounded up) of a Slurm time string: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.

    Raises ValueError naming `field_name` and the accepted formats when `text` is not one of them.
    """
    m = _TIME_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(
            f"{field_name}={text!r} is not a Slurm time; use minutes ('90'), 'HH:MM:SS' ('04:00:00') "
            "or 'D-HH:MM:SS' ('1-12:00:00')")
    days, a, b, c = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # H:M:S
        seconds = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # M:S
        seconds = int(a) * 60 + int(b)
    else:  # M
        seconds = int(a) * 60
    if seconds <= 0:
        raise ValueError(f"{field_name}={text!r} is zero; give a positive time limit such as '01:00:00'")
    return -(-seconds // 60)


def format_time_limit(minutes: int) -> str:
    """Slurm `--time` text for `minutes`: 'HH:MM:00', or 'D-HH:MM:00' from one day on."""
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def _fail(name: str, value: object, fix: str) -> None:
    raise ValueError(f"{name}={value!r}: {fix}")


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        _fail(name, value, f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))


def _check_token(name: str, value: object) -> None:
    if not isinstance(value, str) or not _TOKEN_RE.match(value):
        _fail(name, value, "must be a non-empty string without whitespace, quotes, backslashes or '%'")


def _check_lines(name: str, value: tuple[str, ...]) -> None:
    for i, line in enumerate(value):
        if not isinstance(line, str) or "\n" in line or "\r" in line:
            _fail(f"{name}[{i}]", line, "must be one line of text; split multi-line entries into several items")


def _check_options(name: str, value: tuple[str, ...], managed: dict[str, str], tool: str) -> None:
    _check_lines(name, value)
    for i, opt in enumerate(value):
        if opt.lstrip().startswith("#"):
            _fail(f"{name}[{i}]", opt, f"give the bare {tool} option (e.g. '--constraint=h100'), without '#SBATCH'")
        if not opt.startswith("-"):
            _fail(f"{name}[{i}]", opt, f"must be a {tool} option starting with '-' (e.g. '--exclusive')")
        # '--name=value' / '--name value' / '-Xvalue' / '-X value'
        key = re.split(r"[=\s]", opt[2:], maxsplit=1)[0] if opt.startswith("--") else opt[1:2]
        if key in managed:
            _fail(f"{name}[{i}]", opt, f"hpcrl writes this {tool} option itself; set {managed[key]} instead")


@dataclass(frozen=True, kw_only=True)
class SlurmComponent:
    """One component of the Slurm job: `nodes` nodes with `ntasks_per_node` MPI ranks each.

    `gpus_per_node=0` omits `--gpus-per-node`; `mem_gb=None` omits `--mem` (partition default) and
    `mem_gb=0` asks for all memory of each node. `extra_sbatch_options` are bare sbatch options
    ('--constraint=h100', '--exclusive') written unchanged as `#SBATCH` lines of this component.
    """

    nodes: int
    ntasks_per_node: int
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: int | None = None
    extra_sbatch_options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_sbatch_options", tuple(self.extra_sbatch_options))
        _check_int("nodes", self.nodes, 1)
        _check_int("ntasks_per_node", self.ntasks_per_node, 1)
        _check_int("gpus_per_node", self.gpus_per_node, 0)
        _check_int("cpus_per_task", self.cpus_per_task, 1)
        if self.mem_gb is not None:
            _check_int("mem_gb", self.mem_gb, 0)
        _check_options("extra_sbatch_options", self.extra_sbatch_options, _MANAGED_SBATCH, "sbatch")

    @property
    def num_tasks(self) -> int:
        """MPI ranks this component contributes to the world."""
        return self.nodes * self.ntasks_per_node


@dataclass(frozen=True, kw_only=True)
class SlurmJobSpec:
    """Every parameter of hpcrl's sbatch templates; `render(spec)` turns it into the job script.

    `components` has one entry (single.sbatch.j2) or two (hetjob.sbatch.j2: component 0 runs the
    trainer ranks and the controller, component 1 the rollout ranks). `command` is the full command
    line of the one `srun --mpi=<mpi>` step (every rank runs it). `run_dir` becomes the job's working
    directory and `log_dir` receives `slurm-%j.out/.err` (the batch script, appended across requeues)
    and one `<jobid>-attempt<N>.log` per attempt with the step's output; both must be absolute, and
    the caller creates `log_dir` before sbatch (Slurm does not). Slurm sends USR1 to the batch script
    `signal_delay_s` seconds before the time limit and at preemption; the script forwards it to the
    step (USR2, submitit's preemption signal, is forwarded as USR1 too). A step that exits with
    `requeue_exit_code` (after saving a checkpoint) is requeued with `scontrol requeue`: a job that
    merely exits during the preemption grace time would be COMPLETED. `env_setup` lines (module
    loads, venv or conda activation) run unchanged before the step.
    """

    job_name: str
    partition: str
    time_limit_min: int
    components: tuple[SlurmComponent, ...]
    command: str
    run_dir: str
    log_dir: str
    account: str | None = None
    qos: str | None = None
    env_setup: tuple[str, ...] = ()
    mpi: str = "pmi2"
    signal_delay_s: int = 120
    # Not settable: the controller exits with this one constant (launch.result.REQUEUE_EXIT_CODE).
    requeue_exit_code: int = field(default=REQUEUE_EXIT_CODE, init=False)
    # kill-on-bad-exit=0: with 1, the first rank that exits with the requeue code gets the ranks
    # still exiting killed, and srun then returns 143 instead of the requeue code (measured). A crashed
    # rank is handled by the controller's deadlines and MPI Abort instead.
    extra_srun_options: tuple[str, ...] = field(default=("--kill-on-bad-exit=0",))
    # Writes the job's outcome as submitit's <jobid>_0_result.pkl in log_dir (launch/result.py); run
    # with two arguments appended: the step's exit code ('' while it still runs) and why the job
    # stops ('' after the step's final exit). The script runs it on every way out it sees: after the
    # step's final exit, and when the job stops without finishing (Slurm ending it: cancelled or past
    # its time limit, a failed requeue, `max_requeues`). '' writes nothing.
    result_command: str = ""
    # Runs as it is after the step's final exit, before `result_command`; it reads and may set the
    # shell variable `rc` (hpcrl's export of the final checkpoint, launch/export_step.py).
    export_command: str = ""
    # Requeues allowed in a row for attempts that ended with the same latest complete checkpoint they
    # started from (`checkpoint_step_command` prints it; without one, no attempt counts as progress);
    # past it the job stops instead, saying why. 0: never requeue without progress.
    max_requeues: int = 3
    checkpoint_step_command: str = ""
    # hpcrl's worker only: rerun the step up to this many times when it failed before its MPI world
    # formed (rank 0 of hpcrl.worker_main writes WORLD_FORMED_FILE in the run dir once every rank is
    # through MPI_Init). srun's pmi2 plugin parses a PMI-1 request from one read() of 1024 bytes, and
    # PyPI mpich (PMI-1 only) sometimes sends longer puts: a rank then aborts inside MPI_Init and the
    # others wait out resources.startup_timeout_s (dev/LOG.md). 0: the step runs once.
    world_retries: int = 0

    def __post_init__(self) -> None:
        for name in ("components", "env_setup", "extra_srun_options"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                _fail(name, value, "must be a list")
            object.__setattr__(self, name, tuple(value))
        _check_token("job_name", self.job_name)
        _check_token("partition", self.partition)
        for name in ("account", "qos"):
            if getattr(self, name) is not None:
                _check_token(name, getattr(self, name))
        _check_int("time_limit_min", self.time_limit_min, 1)
        if len(self.components) not in (1, 2):
            _fail("components", self.components,
                  "give 1 component (single job) or 2 (component 0 trainer+controller, component 1 rollout)")
        for i, comp in enumerate(self.components):
            if not isinstance(comp, SlurmComponent):
                _fail(f"components[{i}]", comp, "must be a SlurmComponent")
        if not isinstance(self.command, str) or not self.command.strip() or "\n" in self.command:
            _fail("command", self.command, "must be one non-empty command line, e.g. 'python -m hpcrl.worker_main ...'")
        for name in ("run_dir", "log_dir"):
            _check_token(name, getattr(self, name))
            if not getattr(self, name).startswith("/"):
                _fail(name, getattr(self, name), "must be an absolute path (sbatch resolves relative paths "
                      "against the submit directory); pass Path(...).resolve()")
        for name in ("result_command", "export_command", "checkpoint_step_command"):
            value = getattr(self, name)
            if not isinstance(value, str) or "\n" in value:
                _fail(name, value, "must be one command line (or '' for none)")
        _check_lines("env_setup", self.env_setup)
        if self.mpi not in MPI_PLUGINS:
            _fail("mpi", self.mpi, f"choose one of {', '.join(MPI_PLUGINS)} (pmi2 works with PyPI mpich)")
        _check_int("signal_delay_s", self.signal_delay_s, 1, 65535)
        _check_int("world_retries", self.world_retries, 0, 10)
        _check_int("max_requeues", self.max_requeues, 0)
        _check_options("extra_srun_options", self.extra_srun_options, _MANAGED_SRUN, "srun")

    @property
    def template_name(self) -> str:
        """The template `render` uses: the hetjob one for two components, the single one for one."""
        return HETJOB_TEMPLATE if len(self.components) == 2 else SINGLE_TEMPLATE

    @property
    def world_size(self) -> int:
        """Ranks of the one MPI world the step starts (all tasks of all components)."""
        return sum(c.num_tasks for c in self.components)


WORLD_FORMED_FILE = ".hpcrl_world_formed"
"""Written into the run dir by hpcrl.worker_main's rank 0 once the MPI world has formed."""


def spec_field_names() -> set[str]:
    """The names of `SlurmJobSpec`'s fields, i.e. exactly the variables every template may read."""
    return {f.name for f in fields(SlurmJobSpec)}


def environment() -> jinja2.Environment:
    """The Jinja environment of the templates: bash-safe delimiters, StrictUndefined, two filters."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        block_start_string="<%", block_end_string="%>",
        variable_start_string="<{", variable_end_string="}>",
        comment_start_string="<#", comment_end_string="#>",
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False,
    )
    env.filters["slurm_time"] = format_time_limit
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    return env


def option_name(opt: str) -> str:
    """'--name=value' / '--name value' -> 'name'; '-Xvalue' / '-X value' -> 'X'."""
    return re.split(r"[=\s]", opt[2:], maxsplit=1)[0] if opt.startswith("--") else opt[1:2]


def render(spec: SlurmJobSpec) -> str:
    """The sbatch script for `spec` (the hetjob template for 2 components, the single one for 1)."""
    if not isinstance(spec, SlurmJobSpec):
        raise TypeError(f"render(spec): expected a SlurmJobSpec, got {type(spec).__name__}")
    template = environment().get_template(spec.template_name)
    return template.render({f.name: getattr(spec, f.name) for f in fields(spec)})
