"""hpcrl.memwatch: the peak RSS of a phase is the kernel's high-water mark after a reset, so a brief
allocation inside the phase shows, and one made before the phase (then freed) does not."""

import mmap
import time

import numpy as np

from hpcrl import memwatch
from hpcrl.memwatch import peak_rss

MB = 1 << 20


def _touch(nbytes: int) -> None:
    """Make `nbytes` of fresh pages resident, then free them. An anonymous mmap of its own: a heap
    allocation could reuse pages an earlier test left resident (glibc raises its mmap threshold
    after large frees), and then the RSS would not rise at all."""
    with mmap.mmap(-1, nbytes) as m:
        np.frombuffer(m, dtype=np.uint8)[::mmap.PAGESIZE] = 1  # one write per page


def test_peak_rises_by_what_the_phase_allocates() -> None:
    _touch(200 * MB)  # an earlier peak the phase must not report
    with peak_rss() as m:
        _touch(80 * MB)
    assert m.exact, "clear_refs did not reset VmHWM on this kernel"
    assert 75 * MB <= m.rise_bytes <= 100 * MB, m
    assert m.end_bytes < m.start_bytes + 20 * MB
    with peak_rss() as small:
        _touch(10 * MB)
    assert 8 * MB <= small.rise_bytes <= 25 * MB, small


def test_sampling_fallback_when_clear_refs_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(memwatch, "CLEAR_REFS", "/proc/self/no-such-file")
    with peak_rss(interval_s=0.0005) as m:
        a = np.ones(60 * MB // 8)
        time.sleep(0.2)  # the sampler needs the memory to stay a while (2 shared cores: be generous)
        del a
    assert not m.exact and 50 * MB <= m.rise_bytes <= 80 * MB, m
