"""The controller's preemption clock: signal grace budget and the job's end time."""

import os
import signal
import time

import pytest

import hpcrl.controller.preemption as preemption
from hpcrl.controller.preemption import PreemptionWatch, record_early_signals, slurm_end_time


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    for s in saved:  # a signal PreemptionWatch leaves alone must fail the test, not end pytest
        signal.signal(s, lambda *_: None)
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_end_time_from_the_environment_bounds_the_time_left(monkeypatch, restore_signals):
    monkeypatch.setenv("HPCRL_JOB_END_TIME", str(time.time() + 100))
    watch = PreemptionWatch(grace_s=60)
    assert not watch.requested
    assert 95 < watch.seconds_left() <= 100


def test_no_slurm_no_end_time(monkeypatch, restore_signals):
    monkeypatch.delenv("HPCRL_JOB_END_TIME", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm_end_time() is None
    assert PreemptionWatch(grace_s=60).seconds_left() == float("inf")


@pytest.mark.parametrize("launcher, sig, counts", [
    ("", signal.SIGUSR1, True),          # Slurm: --signal=B:USR1 forwarded to the ranks
    ("", signal.SIGTERM, True),
    ("", signal.SIGUSR2, True),          # submitit's preemption signal (Job._interrupt, scancel --full)
    ("mpiexec", signal.SIGTERM, True),   # hpcrl run forwards USR1/USR2/TERM as TERM
    ("mpiexec", signal.SIGUSR2, True),   # a USR2 sent to the controller itself still means "save"
    ("mpiexec", signal.SIGUSR1, False),  # Hydra's dead-rank notice is not a preemption
])
def test_which_signals_mean_preemption(monkeypatch, restore_signals, launcher, sig, counts):
    monkeypatch.delenv("HPCRL_JOB_END_TIME", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("HPCRL_LAUNCHER", launcher)
    monkeypatch.setenv("HPCRL_SIGNAL_DELAY_S", "30")
    watch = PreemptionWatch(grace_s=60)
    assert watch.grace_s == 30  # the smaller of the --signal delay and checkpoint.grace_s
    os.kill(os.getpid(), sig)
    time.sleep(0.05)
    assert watch.requested is counts
    if counts:
        assert 29 < watch.seconds_left() <= 30 and watch.signal_name == signal.Signals(sig).name


def test_the_grace_is_the_smaller_of_the_signal_delay_and_checkpoint_grace(monkeypatch, restore_signals):
    """Under Slurm a preemption's kill follows after the partition's GraceTime (checkpoint.grace_s),
    however early the --signal lead would come before the time limit: the step was finished on a
    budget of 120 s with 30 left."""
    monkeypatch.setenv("HPCRL_SIGNAL_DELAY_S", "120")
    assert PreemptionWatch(grace_s=30).grace_s == 30


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_before_the_watch_is_recorded_not_fatal(monkeypatch, restore_signals, sig):
    """Slurm may preempt while the ranks import and form their world (minutes at scale): Python's
    default USR1 ended every rank and the job FAILED instead of being requeued. From a rank's start
    the signal is recorded, and the controller's watch takes it as its own."""
    monkeypatch.delenv("HPCRL_LAUNCHER", raising=False)
    monkeypatch.setattr(preemption, "_EARLY", [])
    record_early_signals()
    os.kill(os.getpid(), sig)
    time.sleep(0.05)
    watch = PreemptionWatch(grace_s=60)
    assert watch.requested and watch.signal_name == signal.Signals(sig).name

