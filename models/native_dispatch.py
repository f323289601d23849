"""The CPU kernels of `bucketserve::linear`, `gated_silu`, `attention`, `rms_norm`, `mixed_attention` and
`causal_attention` in C++ (models/csrc/dispatch.cpp), and of the fused decoder layer's `qkv_rope` and `attn_mlp` and
the whole stack's `decoder_stack` (models/csrc/layer_ops.cpp, which calls the others' kernels directly:
models/fused_layer.py).

Why: a decode step calls these ops ~180 times (SmolLM2-135M: 121 linears, 30 MLPs, 30 attentions). Registered as
Python kernels, each call goes op -> dispatcher -> Python -> ctypes: a linear 8.7 us against 1.7 us for a C++
kernel doing the same (one thread, AMD EPYC, a 32x16 weight). A 30-layer model with tiny weights, where a decode
step is nothing but these costs, ran a step in 3.5 ms (Python kernels) against 2.5 ms (the C++ linear alone).

How: the library is compiled once per machine, torch version and source with the C++ compiler against torch's
headers (~7 s), kept beside the native kernels in the compile cache, and loaded with `torch.ops.load_library`.
`install()` then swaps the op kernels: the Python ones (registered on PY_CPU by models/prepack.py,
models/gated_mlp.py, models/attention.py and models/mixed_attention.py) are removed and the C++ ones registered; the
packed weights' entries (models/prepack.py's Packed: oneDNN's copy and which native kernel each step size reads) are
mirrored into the library as they are made and dropped as their weights are freed. The C++ kernels make the same
choices as the Python ones, so the outputs are the same bits; where attention's one-call decode path declines, its
C++ kernel calls the rest of the Python one (`bucketserve::attention_general`). The C++ linear and gated MLP also
leave rows of zeros out of the tiled kernels' calls (a decode batch's free slots: dispatch.cpp's on_live_rows); the
Python ones compute those rows, to the same zeros. Where the library cannot be built (no C++ compiler, no torch
headers) the Python kernels stay, with a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from models import native_library

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCE = _CSRC / "dispatch.cpp"
# the fused decoder layer's two ops (models/fused_layer.py), built into the same library
SOURCES = (SOURCE, _CSRC / "layer_ops.cpp")
HEADER = _CSRC / "dispatch.h"
# PyTorch's headers need C++17; they warn at it, hence -w.
_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-w")
# The Python kernels the C++ ones replace (models/prepack.py, models/gated_mlp.py register on it).
PY_CPU = torch.library.Library("bucketserve", "IMPL", "CPU")  # type: ignore[no-untyped-call]
KERNELS = ("linear", "gated_silu", "attention", "rms_norm", "mixed_attention", "causal_attention", "qkv_rope",
           "attn_mlp", "decoder_stack")
_LOCK = threading.Lock()
_state: dict[str, bool] = {}  # "installed": the C++ kernels serve the ops (absent: install() not tried yet)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _command(cxx: str) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [cxx, *_FLAGS, abi, *includes, *map(str, SOURCES), *[f"-L{p}" for p in libs],
            *[f"-Wl,-rpath,{p}" for p in libs], "-ltorch", "-ltorch_cpu", "-lc10", "-o"]


def _library() -> Path:
    """Build (once per machine, compiler, torch and source) and return the library's path."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    command = _command(cxx)
    texts = (p.read_text() for p in (*SOURCES, HEADER))
    key = hashlib.sha256("\0".join((*texts, version, " ".join(command), torch.__version__,
                                    torch.__file__)).encode()).hexdigest()[:20]
    path = native_library.native_cache_dir() / key / "dispatch.so"
    if not path.exists():
        native_library.build_shared([command], path, ", ".join(p.name for p in SOURCES))
    return path


def install() -> bool:
    """Serve the ops in KERNELS with the C++ kernels (once a process; needs the native kernels loaded). True when
    they serve them; False (logged once) when the Python kernels stay."""
    with _LOCK:
        if "installed" in _state:
            return _state["installed"]
        _state["installed"] = False
        if not native_library.available():
            return False
        try:
            torch.ops.load_library(str(_library()))  # type: ignore[no-untyped-call]
        except Exception as exc:  # noqa: BLE001 - any failure: the Python kernels stay
            log.warning("C++ op kernels unavailable (%s); the ops keep their Python kernels", exc)
            return False
        lib = native_library.lib()
        address = ctypes.cast(lib.bucketserve_linear, ctypes.c_void_p).value
        gated = ctypes.cast(lib.bucketserve_gated_bf16, ctypes.c_void_p).value
        attention = ctypes.cast(lib.bucketserve_decode_attention_masked, ctypes.c_void_p).value
        rms = ctypes.cast(lib.bucketserve_rms_norm_bf16, ctypes.c_void_p).value
        piece = ctypes.cast(lib.bucketserve_piece_attention, ctypes.c_void_p).value
        decode = ctypes.cast(lib.bucketserve_decode_attention, ctypes.c_void_p).value
        # short runs (a verify step's row and its drafts): on the tiles where usable, else on vector dot products
        run = 0
        if native_library.shortest_run():
            runs = lib.bucketserve_run_attention if native_library.has("amx") else lib.bucketserve_run_attention_vec
            run = ctypes.cast(runs, ctypes.c_void_p).value or 0
        run_f32 = (ctypes.cast(lib.bucketserve_run_attention_f32x8, ctypes.c_void_p).value or 0) \
            if native_library.shortest_run_f32() else 0
        ops = torch.ops.bucketserve_dispatch
        ops.bind(address, gated, attention, rms, piece, decode, run, native_library.shortest_run(), run_f32,
                 native_library.shortest_run_f32(),
                 native_library.openmp(), native_library.has("amx"), native_library.f32_mkl_rows(),
                 native_library.switch_address())
        ops.bind_layer(ctypes.cast(lib.bucketserve_rotary_bf16, ctypes.c_void_p).value,
                       ctypes.cast(lib.bucketserve_add_bf16, ctypes.c_void_p).value)
        # every module whose Python kernel is on PY_CPU, imported before it goes (they import this module)
        import models.attention  # noqa: F401
        import models.fused_layer  # noqa: F401
        import models.gated_mlp  # noqa: F401
        import models.rms_norm  # noqa: F401

        PY_CPU._destroy()  # type: ignore[no-untyped-call]  # first: one kernel per op and key, no override
        ops.install()
        _state["installed"] = True
        log.info("bucketserve::%s run C++ kernels (%s)", ", ".join(KERNELS), ", ".join(p.name for p in SOURCES))
        return True


def installed() -> bool:
    return _state.get("installed", False)


def remember(address: int, shape: torch.Size, dtype: torch.dtype, onednn: torch.Tensor,
             one: tuple[int, int, int] | None, few: tuple[int, int, int] | None, few_max: int) -> None:
    """Mirror one packed weight (models/prepack.py's Packed: the weight at `address`, [N, K] `shape`, oneDNN's
    copy, the kernels of one row and of 2..few_max rows) into the C++ kernels' table; a no-op before install."""
    if installed():
        one, few = one or (-1, 0, 0), few or (-1, 0, 0)
        torch.ops.bucketserve_dispatch.remember(address, shape[0], shape[1], dtype, onednn, *one, *few, few_max)


def forget(address: int) -> None:
    """Drop the entry of the weight that lived at `address` (freed: the address may be reused)."""
    if installed():
        torch.ops.bucketserve_dispatch.forget(address)


def remembered() -> int:
    """How many packed weights the C++ kernels know (tests)."""
    return int(torch.ops.bucketserve_dispatch.remembered()) if installed() else 0
