"""What the host offers, read once at start-up: native bfloat16 on this CPU, how many compute threads to use, and
how much memory is left (for the weights' extra copies: models/module_swaps.py).

`--dtype auto` picks bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX-BF16: oneDNN then runs bf16
GEMMs at several times the float32 rate and the weights take half the bytes) and float32 elsewhere, where bf16
would be emulated and slower. Accelerators (cuda, neuron) always take bfloat16.

Compute threads: an OpenMP pool that spans every core collapses as soon as anything else wants one (our own
event loop, a co-located client): its barriers spin while a thread waits for a core. So the default leaves one
core to the HTTP side and the rest to the model: max(1, cores - 1) (docs/performance.md has the measurement).
"""

from __future__ import annotations

import os
from pathlib import Path

DTYPES = ("float32", "bfloat16")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The `flags` of the first processor in /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def has_native_bf16(flags: frozenset[str]) -> bool:
    return bool(flags & NATIVE_BF16_FLAGS)


def resolve_dtype(name: str, device: str, flags: frozenset[str] | None = None) -> str:
    """"auto" -> a concrete dtype name for `device`; explicit names pass through."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {DTYPES}, got {name!r}")
        return name
    if device != "cpu":
        return "bfloat16"
    return "bfloat16" if has_native_bf16(cpu_flags() if flags is None else flags) else "float32"


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Cores this process may use: its affinity mask (taskset, cpusets), further capped by a cgroup v2 CPU
    quota (a Kubernetes CPU limit of 2 on a 64-core node is 2 cores, rounded up), whichever is smaller."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cpu_max)
    return max(1, min(cores, quota)) if quota is not None else cores


def cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """cpu.max holds "<quota> <period>" (or "max <period>": no limit); the quota in whole cores, rounded up."""
    try:
        with open(path) as fh:
            quota, period = fh.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, -(-int(quota) // int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def resolve_num_threads(requested: int, cores: int | None = None) -> int:
    """0 -> one core left for the event loop and clients: max(1, cores - 1); otherwise as requested."""
    if requested < 0:
        raise ValueError(f"num_threads must be >= 0, got {requested}")
    if requested:
        return requested
    return max(1, (usable_cores() if cores is None else cores) - 1)


MAX_COMPILE_WORKERS = 4  # each one holds a copy of the weights; beyond the cores they only contend


def resolve_compile_workers(requested: int, cores: int | None = None) -> int:
    """0 -> one compiling process per usable core, at most MAX_COMPILE_WORKERS; otherwise as requested."""
    if requested < 0:
        raise ValueError(f"compile_workers must be >= 0, got {requested}")
    if requested:
        return requested
    return max(1, min(MAX_COMPILE_WORKERS, usable_cores() if cores is None else cores))


# Left free by every optional use of memory (the weights' packed copies, the compile builders): activations, the
# compile workers' start, the HTTP side.
MEMORY_RESERVE = 1 << 30


def resident_memory(statm: str = "/proc/self/statm") -> int | None:
    """Bytes of RAM this process holds now (its resident set); None where /proc cannot be read."""
    try:
        with open(statm) as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def processes_that_fit(wanted: int, each: int | None, free: int | None) -> int:
    """How many of `wanted` processes of `each` bytes fit in `free` bytes leaving MEMORY_RESERVE free; all of them
    where either figure is unknown."""
    if each is None or free is None or each <= 0:
        return wanted
    return max(0, min(wanted, (free - MEMORY_RESERVE) // each))


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process can still allocate without swapping or an OOM kill: the kernel's MemAvailable, capped by
    a cgroup v2 memory limit (memory.max less memory.current: a Kubernetes memory limit) where one is set. None
    where neither can be read (not Linux)."""
    limits: list[int] = []
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)  # kB
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{cgroup}/memory.max") as fh:
            cap = fh.read().strip()
        with open(f"{cgroup}/memory.current") as fh:
            used = int(fh.read().strip())
        if cap != "max":
            limits.append(max(0, int(cap) - used))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None
