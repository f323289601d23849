"""The native kernels' library (models/csrc/): built once per machine, cached, loaded through ctypes, switched on
or off for the process. The kernels' Python entries are in models/native.py (attention, RMSNorm) and
models/native_matmul.py (matmuls).

The build: `$CC` (default gcc, else cc) with -O3 -march=native (built and run on the same machine; the CPU's
flags are part of the cache key, so a cache shared by different machines never serves a wrong build) and
OpenMP when the compiler has it (the library then needs libgomp.so.1, which resolves to the copy PyTorch's CPU
wheel has already loaded: one thread pool). Output below the compile cache (TORCHINDUCTOR_CACHE_DIR, as the graphs):
`<cache>/bucketserve-native/<key>/kernels.so`, written to a temporary name and renamed (processes building at
once do not see a partial file). `--no-native-kernels` turns them off: the runner sets the process-wide switch
(`configure`, from models/module_swaps.py), as inductor's settings are process-wide too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "decode_attention.c", _CSRC / "decode_avx2.c", _CSRC / "small_matmul.c", _CSRC / "amx_matmul.c",
           _CSRC / "piece_attention.c", _CSRC / "linear.c", _CSRC / "rms_norm.c",
           _CSRC / "tiled_matmul.c", _CSRC / "run_attention.c", _CSRC / "run_vec.c", _CSRC / "argmax.c",
           _CSRC / "layer_math.c", _CSRC / "piece_avx2.c", _CSRC / "greedy_head.c", _CSRC / "exact_codes.c")
HEADERS = (_CSRC / "vec16.h", _CSRC / "vec8.h", _CSRC / "vexp.h", _CSRC / "piece_products.h",
           _CSRC / "attention_common.h", _CSRC / "amx_tiles.h")
_FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300
_LOCK = threading.Lock()
# "lib": the loaded library (None: unavailable), "parallel": built with OpenMP, "matmul": has the small matmul,
# "amx": has the AMX matmul and Linux lets this process use the tiles, "f32": has the fp32 vector matmul on its
# tile copy (AVX-512, or AVX2 with FMA)
_state: dict[str, object] = {}


class _Switch(dict[str, bool]):
    """{"on": bool}, its state also in a C int that the C++ op kernels read at every call (models/native_dispatch.py):
    configure() and tests' `monkeypatch.setitem(_switch, "on", ...)` reach both."""

    def __init__(self) -> None:
        super().__init__()
        self.flag = ctypes.c_int(1)
        self["on"] = True

    def __setitem__(self, key: str, value: bool) -> None:
        super().__setitem__(key, value)
        self.flag.value = int(bool(value))


_switch = _Switch()


def configure(enabled: bool) -> None:
    """Use the kernels (True, the default) or PyTorch's SDPA and oneDNN everywhere (False), for this process."""
    _switch["on"] = enabled


def switch_address() -> int:
    """The address of the switch's C int (1: on), for the C++ op kernels; valid for the process's lifetime."""
    return ctypes.addressof(_switch.flag)


def enabled() -> bool:
    return _switch["on"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def native_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "bucketserve-native"


def build_shared(commands: Sequence[Sequence[str]], out: Path, what: str) -> None:
    """Run the first of `commands` (each a compiler command line that writes the library to its last argument,
    appended here) that succeeds, into `out`: written to a temporary name and renamed (processes building at once
    do not see a partial file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for command in commands:
        fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([*command, tmp], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode == 0:
                os.chmod(tmp, 0o755)  # mkstemp makes it 0600: another user sharing the cache could not load it
                os.replace(tmp, out)  # atomic: a process loading at the same time sees the whole file or none
                return
            log.debug("%s build failed (%s): %s", what, " ".join(command), done.stderr[-2000:])
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"{commands[0][0]} could not build {what}")


def _build(cc: str, out: Path) -> None:
    """Compile SOURCES into `out` (with OpenMP when the compiler has it, else without)."""
    base = (cc, *_FLAGS)
    build_shared([(*base, "-fopenmp", *map(str, SOURCES), "-o"), (*base, *map(str, SOURCES), "-o")], out,
                 ", ".join(p.name for p in SOURCES))


def _load() -> None:
    """Build (once per machine and source) and load the kernels into _state; on any failure (no compiler, a
    read-only cache, a failed build) record None, log it once, and let the callers use SDPA and oneDNN."""
    _state.update(lib=None, parallel=False, matmul=False, amx=False, f32=False, f32_rows=0, f32_mkl_rows=0, piece_f32=False,
                  shortest_run=0, shortest_run_f32=0, greedy_head=False, exact_codes=False)
    try:
        cc = _compiler()
        if cc is None:
            raise RuntimeError("no C compiler (set CC)")
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        sources = "\0".join(p.read_text() for p in (*SOURCES, *HEADERS))
        key = hashlib.sha256("\0".join((sources, cc, version, " ".join(_FLAGS), platform.machine(),
                                        _cpu_flags())).encode()).hexdigest()[:20]
        path = native_cache_dir() / key / "kernels.so"
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except Exception as exc:  # noqa: BLE001  any failure here means: run without the kernels
        log.warning("native kernels unavailable (%s); using SDPA and oneDNN", exc)
        return
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.bucketserve_decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                                 ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.bucketserve_decode_attention.restype = ctypes.c_int
    lib.bucketserve_small_matmul_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.bucketserve_small_matmul_bf16.restype = ctypes.c_int
    lib.bucketserve_mask_extents.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr]
    lib.bucketserve_mask_extents.restype = ctypes.c_int
    lib.bucketserve_amx_matmul_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.bucketserve_amx_matmul_bf16.restype = ctypes.c_int
    lib.bucketserve_amx_matmul_q8.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.bucketserve_amx_matmul_q8.restype = ctypes.c_int
    lib.bucketserve_piece_attention.argtypes = [ptr, ptr, ptr, ptr, *[i64] * 11, ctypes.c_float, ctypes.c_int,
                                                 ctypes.c_int, ctypes.c_int]
    lib.bucketserve_piece_attention.restype = ctypes.c_int
    lib.bucketserve_decode_attention_masked.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_int,
                                                        *[i64] * 7, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.bucketserve_decode_attention_masked.restype = ctypes.c_int
    lib.bucketserve_linear.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.bucketserve_linear.restype = ctypes.c_int
    lib.bucketserve_gated_bf16.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int,
                                           ctypes.c_int]
    lib.bucketserve_gated_bf16.restype = ctypes.c_int
    lib.bucketserve_rms_norm_bf16.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.bucketserve_rms_norm_bf16.restype = ctypes.c_int
    lib.bucketserve_argmax.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ctypes.c_int]
    lib.bucketserve_argmax.restype = ctypes.c_int
    lib.bucketserve_rotary_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.bucketserve_rotary_bf16.restype = ctypes.c_int
    lib.bucketserve_add_bf16.argtypes = [ptr, ptr, ptr, i64]
    lib.bucketserve_add_bf16.restype = ctypes.c_int
    amx = bool(lib.bucketserve_amx_supported())
    _state.update(lib=lib, parallel=bool(lib.bucketserve_native_openmp()),
                  matmul=bool(lib.bucketserve_small_matmul_supported()), amx=amx,
                  f32=lib.bucketserve_tiled_f32_rows() > 0, f32_rows=int(lib.bucketserve_tiled_f32_rows()),
                  f32_mkl_rows=int(lib.bucketserve_f32_mkl_rows()),
                  piece_f32=bool(lib.bucketserve_small_matmul_supported() or lib.bucketserve_piece_f32x8_supported()),
                  decode_bf16=bool(lib.bucketserve_decode_fast(0)), decode_f32=bool(lib.bucketserve_decode_fast(1)),
                  shortest_run=2 if amx else 3 if lib.bucketserve_run_vec_supported() else 0,
                  shortest_run_f32=2 if lib.bucketserve_run_f32x8_supported() else 0,
                  greedy_head=bool(lib.bucketserve_greedy_head_supported()),
                  exact_codes=bool(lib.bucketserve_exact_codes_supported()))
    log.info("native kernels loaded from %s (OpenMP: %s, small matmul: %s, AMX: %s)", path, _state["parallel"],
             _state["matmul"], _state["amx"])


def available() -> bool:
    """The kernels are switched on, built and loaded (building them on the first call)."""
    if not enabled():
        return False
    if "lib" not in _state:
        with _LOCK:
            if "lib" not in _state:
                _load()
    return _state["lib"] is not None


def threads() -> int | None:
    """The compute threads to use, or None when the build is serial and PyTorch would use more threads."""
    threads = torch.get_num_threads()
    return None if threads > 1 and not _state["parallel"] else threads


def openmp() -> bool:
    """The loaded kernels were built with OpenMP (call after available() returned True)."""
    return bool(_state["parallel"])


def tiled_f32_rows() -> int:
    """The most rows of a float32 step the fp32 vector matmul takes ahead of oneDNN on this build (tiled_matmul.c:
    32 with AVX-512, 128 with AVX2 only; 0: none); call after available() returned True."""
    rows = _state.get("f32_rows", 0)
    return rows if isinstance(rows, int) else 0


def f32_mkl_rows() -> int:
    """The fewest rows of a float32 step that read MKL's matmul on the plain weight rather than oneDNN's packed copy
    (tiled_matmul.c: 129 with AVX2 only, where MKL's ran 5-12% faster at 256-1024 rows; 0: never)."""
    rows = _state.get("f32_mkl_rows", 0)
    return rows if isinstance(rows, int) else 0


def has(feature: str) -> bool:
    """The loaded library has `feature` ("matmul": the small matmul, "amx": the AMX matmul usable here, "f32": the
    fp32 vector matmul, "piece_f32": a fp32 prompt-piece attention kernel (AVX-512's, or AVX2's piece_avx2.c),
    "decode_bf16" / "decode_f32": a decode attention kernel for that element type that beats
    SDPA here, "greedy_head": the fp32 lm_head of greedy steps, greedy_head.c; "exact_codes": fp32 matmuls on exact
    4- or 8-bit copies, exact_codes.c); call after available() returned
    True."""
    return bool(_state[feature])


def shortest_run() -> int:
    """The fewest tokens of one slot at consecutive positions (a verify step's row and its drafts) that attend as a
    run, reading the slot's K/V once (0: none; bf16 only): 2 on AMX tiles (run_attention.c), 3 on vector dot products
    (run_vec.c: a run of 2 costs about what two decoding rows do, one of 4 ~0.65x; docs/performance.md). Call after
    available() returned True."""
    shortest = _state["shortest_run"]
    assert isinstance(shortest, int)
    return shortest


def shortest_run_f32() -> int:
    """The same for float32 runs (0: none): 2 on AVX2 builds without AVX-512 (decode_avx2.c, whose decode kernel a
    run's queries share, so each token's output has the bits of its decoding row). Call after available() returned
    True."""
    shortest = _state["shortest_run_f32"]
    assert isinstance(shortest, int)
    return shortest


def lib() -> ctypes.CDLL:
    lib = _state["lib"]
    assert isinstance(lib, ctypes.CDLL)
    return lib
