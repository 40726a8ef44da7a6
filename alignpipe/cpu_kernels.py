"""Which CPU kernels compute a local stage's floats, pinned so that x86-64 CPUs of either vendor,
with AVX2 or AVX-512, compute the same bytes (README.md, "Reproducibility").

Two libraries inside torch's x86-64 wheels pick their kernels by the CPU they run on:

- ATen's own vectorised kernels: AVX-512 where the CPU has it, else AVX2.
  ``ATEN_CPU_CAPABILITY=avx2`` makes every x86-64 CPU with AVX2 run the AVX2 ones.
- The MKL bundled for matrix products and vector math: on Intel CPUs a path per instruction
  set, on AMD CPUs one path of its own. MKL's reproducibility switch (``MKL_CBWR``) offers no
  branch both vendors share but SSE2 ("COMPATIBLE"), which doubled sft's time; so on Intel
  CPUs MKL is made to take the path it takes on AMD, by answering its two vendor queries
  (``mkl_serv_intel_cpu_true``, ``mkl_serv_cpuiszen``) from a two-line shared object loaded
  before torch. Built once with the system's C compiler into the user cache.

``ALIGNPIPE_CPU_KERNELS=native`` leaves both to the CPU (faster on AVX-512 Intel CPUs, other
bytes). What is in effect (``chosen()``) is recorded in every artifact a local stage writes, and
it, not the CPU's name, decides whether two runs must agree byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SETTING = "ALIGNPIPE_CPU_KERNELS"  # portable (default) or native

# MKL's vendor queries, answered as on an AMD CPU: not Intel, a Zen core.
_AMD_PATH_SOURCE = (
    "int mkl_serv_intel_cpu_true(void) { return 0; }\nint mkl_serv_cpuiszen(void) { return 1; }\n"
)

_amd_path_loaded = False  # this process answers MKL's vendor queries as on AMD


def _cpu() -> tuple[str, set[str]]:
    """The vendor and instruction-set flags of this CPU (Linux), else ("", set())."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    vendor, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return vendor, flags


def _amd_path_library() -> Path | None:
    """The shared object answering MKL's vendor queries as on AMD, built once; None without a C
    compiler."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "alignpipe" / "cpu-kernels"
    digest = hashlib.sha256(_AMD_PATH_SOURCE.encode()).hexdigest()[:12]
    library = cache / f"mkl-amd-path-{digest}.so"
    if library.is_file():
        return library
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then moved: stages run in parallel
        built = Path(tmp) / library.name
        proc = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-x", "c", "-", "-o", str(built)],
            input=_AMD_PATH_SOURCE, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            return None
        os.replace(built, library)
    return library


def pin() -> None:
    """Before torch is imported: the portable kernels, unless ``ALIGNPIPE_CPU_KERNELS=native``,
    the user set ``ATEN_CPU_CAPABILITY``, or this is no x86-64 Linux CPU with AVX2."""
    global _amd_path_loaded
    vendor, flags = _cpu()
    if (
        os.environ.get(SETTING, "portable") == "native"
        or platform.machine() != "x86_64"
        or "avx2" not in flags
    ):
        return
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")  # read at torch's first kernel dispatch
    if vendor != "AuthenticAMD" and not _amd_path_loaded and "torch" not in sys.modules:
        import ctypes

        if (library := _amd_path_library()) is not None:
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)  # ahead of torch's MKL in symbol lookup
            _amd_path_loaded = True


def chosen() -> dict[str, str]:
    """The kernels in effect, with the torch build: two runs with equal values compute equal
    bytes. ``mkl``: ``amd`` (MKL's AMD path), ``intel-<isa>`` (its Intel path for that
    instruction set), ``none`` (no MKL: not x86-64)."""
    import torch

    vendor, flags = _cpu()
    if platform.machine() != "x86_64":
        mkl = "none"
    elif vendor == "AuthenticAMD" or _amd_path_loaded:
        mkl = "amd"
    else:
        mkl = "intel-avx512" if "avx512f" in flags else "intel-avx2"
    return {
        "aten": torch.backends.cpu.get_cpu_capability().lower(),
        "mkl": mkl,
        "torch": torch.__version__,
    }
