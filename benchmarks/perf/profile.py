"""Profiling the gateway under load: py-spy samples the gateway process while a load generator runs.

Theory of operation: `py-spy record --format raw` writes collapsed stacks (`frame;frame;... count`), one line
per distinct stack. `summarize` turns them into the two tables that guided each optimisation: self time (the
frame at the top of the stack) and inclusive time (any frame of the stack, counted once per sample), as shares
of all samples. Frames are `function (file:line)`; lines are dropped so one function is one row.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ("ProfileSummary", "py_spy_path", "record", "summarize")

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileSummary:
    samples: int
    self_top: list[tuple[str, float]]  # (frame, share of samples)
    inclusive_top: list[tuple[str, float]]

    def render(self, title: str, rows: int = 15) -> str:
        lines = [f"{title}: {self.samples} samples", "", "| self % | function |", "| ---: | --- |"]
        lines += [f"| {share * 100:.1f} | `{frame}` |" for frame, share in self.self_top[:rows]]
        lines += ["", "| inclusive % | function |", "| ---: | --- |"]
        lines += [f"| {share * 100:.1f} | `{frame}` |" for frame, share in self.inclusive_top[:rows]]
        return "\n".join(lines)


def py_spy_path() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record(pid: int, out: Path, *, duration_s: float, rate: int = 250) -> subprocess.Popen[bytes] | None:
    """Start py-spy on `pid` for `duration_s`; returns the recorder (wait on it), or None without py-spy."""
    py_spy = py_spy_path()
    if py_spy is None:
        return None
    command = [
        py_spy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(duration_s))),
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--nonblocking",
        "--output",
        str(out),
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _short(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    path = match.group("file")
    for marker in ("site-packages/", "src/", "lib/python3"):
        at = path.find(marker)
        if at >= 0:
            path = path[at + len(marker) :]
            break
    return f"{match.group('func')} ({path})"


def summarize(raw: str, *, top: int = 25) -> ProfileSummary:
    """Self and inclusive shares per function from py-spy's raw (collapsed) output."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith("process ")]
        frames = [f for f in frames if not f.startswith("thread ")]
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if total == 0:
        return ProfileSummary(samples=0, self_top=[], inclusive_top=[])
    return ProfileSummary(
        samples=total,
        self_top=[(f, c / total) for f, c in self_counts.most_common(top)],
        inclusive_top=[(f, c / total) for f, c in inclusive.most_common(top)],
    )
