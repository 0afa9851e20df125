"""The true peak resident memory (RSS) of one phase of this process, from the kernel's high-water mark.

    with peak_rss() as m:
        policy.export_hf_dir(out, 1 << 30)
    print(m.peak_bytes, m.rise_bytes)        # peak RSS during the phase; peak minus RSS at its start

Linux keeps the highest RSS a process has reached (VmHWM in /proc/self/status). Writing "5" to
/proc/self/clear_refs resets it to the current RSS (Linux >= 4.0; checked on 6.18: after a 200 MB
allocation is freed, VmHWM drops from 228 MB to the 29 MB RSS, then a 50 MB allocation reads 78 MB),
so reading VmHWM after the phase gives its peak exactly, however brief, with no sampling. Where
clear_refs cannot be written (another process's /proc, a locked-down container), the context falls
back to sampling VmRSS every `interval_s` on a thread: `exact` is then False and a peak shorter
than the interval can be missed. RSS counts anonymous memory and file pages mapped and touched
(mmap'ed safetensors count; the page cache behind read()/pwrite() does not). One process only:
combine ranks' numbers yourself (e.g. a MAX all-reduce of peak_bytes).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from types import TracebackType

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(field: str) -> int:
    with open(STATUS) as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{STATUS} has no {field} line (not Linux?)")
    return int(m.group(1))


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _status_kib("VmRSS") * 1024


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS; False if not permitted."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakRSS:
    """Context manager measuring the peak RSS of the code inside it (fields set on exit)."""

    interval_s: float = 0.001
    start_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0
    exact: bool = True

    @property
    def rise_bytes(self) -> int:
        """How far the peak rose above the RSS at the start of the phase."""
        return self.peak_bytes - self.start_bytes

    def __enter__(self) -> PeakRSS:
        self.exact = reset_peak()
        self.start_bytes = rss_bytes()
        self._stop = threading.Event()
        self._sampled = self.start_bytes
        if not self.exact:
            self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sampled = max(self._sampled, rss_bytes())

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.end_bytes = rss_bytes()
        if self.exact:
            self.peak_bytes = max(_status_kib("VmHWM") * 1024, self.end_bytes)
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self._sampled, self.end_bytes)


def peak_rss(interval_s: float = 0.001) -> PeakRSS:
    """`with peak_rss() as m: ...` then m.peak_bytes / m.rise_bytes / m.exact (see the module doc)."""
    return PeakRSS(interval_s=interval_s)
