"""Host detection: the dtype and thread defaults that make the fast configuration the default."""

from __future__ import annotations

import os

import pytest

from models.hardware import (
    MEMORY_RESERVE,
    available_memory,
    cgroup_cpu_quota,
    cpu_flags,
    processes_that_fit,
    resident_memory,
    resolve_compile_workers,
    resolve_dtype,
    resolve_num_threads,
    usable_cores,
)

XEON = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n\nprocessor\t: 1\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"


def test_cpu_flags_parse_first_processor() -> None:
    assert {"avx512_bf16", "amx_bf16"} <= cpu_flags(XEON)
    assert cpu_flags("") == frozenset()


def test_auto_dtype_is_bf16_only_with_native_support() -> None:
    assert resolve_dtype("auto", "cpu", cpu_flags(XEON)) == "bfloat16"
    assert resolve_dtype("auto", "cpu", cpu_flags("flags: avx512_bf16")) == "bfloat16"
    assert resolve_dtype("auto", "cpu", cpu_flags(OLD)) == "float32"
    assert resolve_dtype("auto", "neuron", frozenset()) == "bfloat16"
    assert resolve_dtype("float32", "cpu", cpu_flags(XEON)) == "float32"  # explicit always wins
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float16", "cpu")


def test_threads_leave_one_core_for_http() -> None:
    assert [resolve_num_threads(0, cores) for cores in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert resolve_num_threads(3, 2) == 3
    with pytest.raises(ValueError):
        resolve_num_threads(-1)


@pytest.mark.parametrize("content,expected", [
    ("200000 100000\n", 2), ("150000 100000\n", 2), ("50000 100000\n", 1), ("max 100000\n", None), ("junk", None),
])
def test_cgroup_cpu_quota_in_whole_cores(tmp_path, content: str, expected: int | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(content)
    assert cgroup_cpu_quota(str(path)) == expected
    cores = usable_cores(str(path))
    assert cores >= 1 and (expected is None or cores <= expected)
    assert cgroup_cpu_quota(str(tmp_path / "missing")) is None


def test_compile_workers_default_to_the_cores_capped() -> None:
    assert resolve_compile_workers(0, cores=2) == 2
    assert resolve_compile_workers(0, cores=64) == 4
    assert resolve_compile_workers(0, cores=1) == 1
    assert resolve_compile_workers(3, cores=1) == 3
    with pytest.raises(ValueError):
        resolve_compile_workers(-1)


def test_available_memory_is_memavailable_capped_by_the_cgroup_limit(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert available_memory(str(meminfo), str(cgroup)) == 20000000 * 1024  # no cgroup files: MemAvailable
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert available_memory(str(meminfo), str(cgroup)) == 20000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{4 << 30}\n")
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert available_memory(str(meminfo), str(cgroup)) == 3 << 30  # a 4 GiB limit with 1 GiB used
    assert available_memory(str(tmp_path / "none"), str(cgroup)) == 3 << 30
    assert available_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_resident_memory_reads_the_resident_pages(tmp_path) -> None:
    statm = tmp_path / "statm"
    statm.write_text("1000 250 30 1 0 200 0\n")  # size, resident, shared, ... in pages
    assert resident_memory(str(statm)) == 250 * os.sysconf("SC_PAGE_SIZE")
    assert resident_memory(str(tmp_path / "none")) is None
    own = resident_memory()
    assert own is not None and own > 10 << 20  # this interpreter, with torch imported by the suite


def test_processes_that_fit_leave_the_reserve_free() -> None:
    each = 2 << 30
    assert processes_that_fit(3, each, MEMORY_RESERVE + 2 * each) == 2
    assert processes_that_fit(3, each, MEMORY_RESERVE + 2 * each - 1) == 1
    assert processes_that_fit(3, each, MEMORY_RESERVE - 1) == 0
    assert processes_that_fit(1, each, 100 << 30) == 1
    assert processes_that_fit(2, None, 1) == 2 and processes_that_fit(2, each, None) == 2  # unknown: as asked
