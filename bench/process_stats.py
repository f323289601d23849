"""What a server process uses, read from /proc (Linux): its peak resident memory and the CPU seconds it has
used, each for the process alone or summed over its live descendants (vLLM's engine core, llama.cpp's workers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def _vm_hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes(pid: int, tree: bool = False) -> int | None:
    """Peak resident set (VmHWM from /proc, Linux) of the process; with `tree`, summed over its live
    descendants too (an upper bound: their peaks need not coincide, and forked pages count twice)."""
    return _tree_sum(pid, _vm_hwm) if tree else _vm_hwm(pid)


def _tree_sum(pid: int, measure: Callable[[int], int | None]) -> int | None:
    """`measure` summed over a process and its live descendants; None when the process is gone."""
    total, found, seen, stack = 0, False, set(), [pid]
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        value = measure(p)
        if value is not None:
            total, found = total + value, True
            stack += _children(p)
    return total if found else None


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime of one process, in clock ticks (/proc/PID/stat fields 14 and 15)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces
    return int(fields[11]) + int(fields[12])


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds used so far by a process and its live descendants (an engine in a child process, like
    vLLM's engine core, counts too)."""
    ticks = _tree_sum(pid, _cpu_ticks)
    return ticks / os.sysconf("SC_CLK_TCK") if ticks is not None else None
