"""Which BLAS MLX's CPU backend runs on: switch it to MKL on Linux, and report it from facts.

Why: the Linux ``mlx[cpu]`` wheel links the reference netlib BLAS it bundles
(``mlx_cpu.libs/libblas-*.so``), whose SGEMM runs at ~7 GFLOP/s. ``libmlx.so`` binds
``cblas_sgemm`` through the dynamic linker, which searches the process's global scope
before libmlx's own dependencies. So loading MKL's ``libmkl_rt`` (PyPI ``mkl``, extra
``fast-cpu``) with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported makes every MLX GEMM
(and LAPACK call) bind to MKL: ~10x faster. After the import it is too late: CPython
imports extensions with ``RTLD_NOW``, so the bindings are fixed at import time.
``harness/__init__.py`` calls :func:`configure`, so any ``import harness...`` that happens
before ``import mlx`` gets MKL.

Selection: env ``KVBENCH_BLAS`` = ``mkl`` (default; silently falls back to the reference
BLAS when MKL is not installed) or ``reference`` (leave MLX as shipped). An explicit
``mkl`` that cannot be met raises, so a benchmark never runs 10x slower than asked.
macOS needs nothing: MLX links Accelerate there (and uses Metal for the GPU).

Threads: MKL's default thread count is left alone. MKL sizes its OpenMP pool to the
physical cores in the process's CPU affinity mask (2 on the reference box: ~80 GFLOP/s
on one thread, 166-180 on two), honours ``MKL_NUM_THREADS`` / ``OMP_NUM_THREADS`` if the
user sets them, and keeps ``MKL_DYNAMIC`` on, so it drops to one thread when called from
inside another parallel region. Nothing else competes in-process: MLX's CPU stream calls
BLAS from a single thread, and numpy's OpenBLAS uses prefixed symbols
(``scipy_cblas_*``), so MKL does not replace it and the two pools are never active at once.
The remaining oversubscription risk is several processes each running an all-cores MKL
pool at once; kvbench's benchmarks run their subprocesses one after another, and anyone
running parallel workers should set ``MKL_NUM_THREADS`` to cores / workers.
Other processes' load is the same risk: a GEMM waits at its barrier for a pool thread the
OS has descheduled. Beside two busy loops on the 2-core reference box, a test file
(tests/engine/test_kv_quant.py, tiny model) ran in 139.7 s with MKL's two threads against
48.6 s with ``MKL_NUM_THREADS=1``; beside one, 40-42 s against 31 s; quiet, 28.5-31.5 s
either way (the tiny model's GEMMs gain nothing from a second thread). The test suite
therefore runs MKL on one thread (tests/conftest.py); benchmarks keep the default and say
which (``info()["threads"]``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import platform
import struct
import sys
import warnings
from typing import Any

ENV_VAR = "KVBENCH_BLAS"
CHOICES = ("mkl", "reference")
DEFAULT = "mkl"

# The handle of the libmkl_rt this module loaded (None until configure() loads it), and
# whether the "mlx was imported first" warning was already given.
_mkl: ctypes.CDLL | None = None
_warned = False


def requested() -> str:
    """The BLAS asked for through ``KVBENCH_BLAS`` (default ``mkl``); ValueError if invalid."""
    value = os.environ.get(ENV_VAR, DEFAULT).strip().lower() or DEFAULT
    if value not in CHOICES:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not valid; accepted values: "
            f"{', '.join(CHOICES)} (default {DEFAULT})"
        )
    return value


def loaded_mkl() -> ctypes.CDLL | None:
    """The handle of the libmkl_rt that :func:`configure` loaded, or None if it loaded none."""
    return _mkl


def find_mkl() -> str | None:
    """Path of MKL's ``libmkl_rt.so*`` in the running environment, or None (non-Linux too).

    PyPI ``mkl`` installs it under the environment's ``lib/`` (``sys.prefix/lib``), not
    site-packages; the highest soname version wins if there are several.
    """
    if not sys.platform.startswith("linux"):
        return None
    found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    return found[-1] if found else None


def configure() -> None:
    """Load MKL globally before ``mlx.core`` is imported, so MLX's GEMM binds to it.

    Idempotent; cheap after the first call. Validates ``KVBENCH_BLAS`` on every call.
    Warns once (does not raise) if ``mlx.core`` was imported before this ran, since the
    binding can then no longer be changed.
    """
    global _mkl, _warned
    choice = requested()
    if _mkl is not None or choice == "reference" or not sys.platform.startswith("linux"):
        return
    path = find_mkl()
    if path is None:
        # Asked for explicitly: do not quietly run 10x slower than requested.
        if os.environ.get(ENV_VAR, "").strip():
            raise RuntimeError(
                f"{ENV_VAR}=mkl but libmkl_rt was not found in {sys.prefix}/lib; install "
                f"it with `pip install 'kvbench[fast-cpu]'` or set {ENV_VAR}=reference"
            )
        return
    if "mlx.core" in sys.modules:
        if not _warned:
            _warned = True
            warnings.warn(
                "harness.platform.blas: mlx.core was imported before harness, so MLX's CPU GEMM "
                "stays on the bundled reference BLAS (~10x slower). Import harness (or "
                "call harness.platform.blas.configure()) before the first `import mlx`, or set "
                f"{ENV_VAR}=reference to run on the reference BLAS deliberately.",
                RuntimeWarning,
                stacklevel=2,
            )
        return
    _mkl = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def info() -> dict[str, Any]:
    """Which BLAS MLX's CPU GEMM actually calls, for the run's machine info.

    Decided from facts, not from what was requested: on Linux it imports ``mlx.core``
    (so call :func:`configure` first; ``import harness`` does), reads the GOT slot that
    ``libmlx.so`` calls ``cblas_sgemm`` through, and asks the dynamic linker (``dladdr``)
    which loaded library that address lies in. ``blas`` is ``mkl`` if that is libmkl_rt,
    ``reference`` if it is MLX's bundled ``libblas``, ``openblas`` / the library's name
    otherwise, and ``unknown`` (with ``note``) if the probe cannot run. On macOS it is
    ``accelerate``, the library MLX's macOS builds link, which is not probed.

    Keys: blas, library (path or None), requested, platform, threads (MKL's thread count
    when blas is mkl, else None), evidence (how it was decided), note (or None).
    """
    try:
        req: str | None = requested()
    except ValueError:
        req = os.environ.get(ENV_VAR)  # report the bad value rather than fail the run
    out: dict[str, Any] = {
        "blas": "unknown",
        "library": None,
        "requested": req,
        "platform": f"{sys.platform}-{platform.machine()}",
        "threads": None,
        "evidence": None,
        "note": None,
    }
    if sys.platform == "darwin":
        out.update(blas="accelerate", evidence="MLX macOS builds link Accelerate (not probed)")
        return out
    if not sys.platform.startswith("linux"):
        out["note"] = "BLAS probe implemented for Linux only"
        return out
    try:
        import mlx.core as mx  # noqa: F401  (maps libmlx.so and binds its symbols)

        libmlx = _mapped("/libmlx.so")
        if libmlx is None:
            raise OSError("libmlx.so is not mapped in this process")
        target = _bound_library(libmlx, "cblas_sgemm")
    except (ImportError, OSError, ValueError, struct.error) as exc:
        out["note"] = f"probe failed: {exc}"
        return out
    name = os.path.basename(target)
    if name.startswith("libmkl"):
        out["blas"] = "mkl"
        out["threads"] = _mkl_threads(target)
    elif name.startswith("libblas") and "mlx" in target:
        out["blas"] = "reference"
    elif "openblas" in name:
        out["blas"] = "openblas"
    else:
        out["blas"] = name.split(".so")[0].removeprefix("lib")
    out["library"] = target
    out["evidence"] = f"cblas_sgemm in {libmlx} is bound to {target}"
    if out["blas"] == "reference" and find_mkl() is None:
        out["note"] = "MKL not installed: pip install 'kvbench[fast-cpu]' for ~10x faster GEMM"
    elif out["blas"] == "reference" and req == "mkl":
        out["note"] = "MKL installed but loaded too late: import harness before mlx"
    return out


def _mapped(suffix: str) -> str | None:
    """Path of the first file mapped into this process whose path ends with ``suffix``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n").endswith(suffix):
                return fields[5].rstrip("\n")
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


class _LinkMap(ctypes.Structure):
    # Only the leading field of glibc's struct link_map: the load bias of the object.
    _fields_ = [("l_addr", ctypes.c_size_t)]


def _libdl() -> ctypes.CDLL:
    """glibc >= 2.34 has dlinfo/dladdr in libc itself; older ones in libdl."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "dlinfo"):
        return libc
    return ctypes.CDLL(ctypes.util.find_library("dl") or "libdl.so.2")


def _bound_library(lib_path: str, symbol: str) -> str:
    """Path of the library that ``lib_path``'s call to ``symbol`` currently jumps into.

    The GOT slot sits at load bias + the relocation's offset; its contents is where the
    dynamic linker bound the symbol, and dladdr names the library holding that address.
    """
    slot_offset = _got_offset(lib_path, symbol)
    dl = _libdl()
    # RTLD_NOLOAD: a handle to the already-loaded copy, never a second load.
    handle = ctypes.CDLL(lib_path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    link_map = ctypes.POINTER(_LinkMap)()
    rtld_di_linkmap = 2
    if dl.dlinfo(ctypes.c_void_p(handle), rtld_di_linkmap, ctypes.byref(link_map)) != 0:
        raise OSError(f"dlinfo failed for {lib_path}")
    target = ctypes.c_void_p.from_address(link_map.contents.l_addr + slot_offset).value
    found = _DlInfo()
    if not target or not dl.dladdr(ctypes.c_void_p(target), ctypes.byref(found)):
        raise OSError(f"{symbol} in {lib_path} is not bound to any loaded library")
    name = os.path.realpath(os.fsdecode(found.dli_fname))
    if name == os.path.realpath(lib_path):
        # A lazy PLT slot not yet resolved still points back into lib_path itself.
        raise OSError(f"{symbol} in {lib_path} is not bound yet (lazy binding)")
    return name


@functools.lru_cache(maxsize=8)
def _got_offset(lib_path: str, symbol: str) -> int:
    """Offset (from load bias) of the GOT slot through which ``lib_path`` calls ``symbol``.

    A minimal ELF64 little-endian reader: walks the SHT_RELA sections, resolving each
    relocation's symbol name through the linked dynamic symbol and string tables.
    """
    with open(lib_path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise ValueError(f"{lib_path} is not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", header, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
        f.seek(shoff)
        raw = f.read(shentsize * shnum)
        # (type, offset, size, link, entsize) of every section header
        sections = [struct.unpack_from("<4xI16xQQI12xQ", raw, i * shentsize) for i in range(shnum)]

        def read(index: int) -> bytes:
            _, offset, size, _, _ = sections[index]
            f.seek(offset)
            return f.read(size)

        want = symbol.encode()
        for index, (sh_type, _, _, link, _) in enumerate(sections):
            if sh_type != 4 or not link:  # SHT_RELA with a symbol table
                continue
            rela = read(index)
            symtab = read(link)
            strtab = read(sections[link][3])
            for r_offset, r_info, _ in struct.iter_unpack("<QQq", rela):
                sym = r_info >> 32
                if not sym:
                    continue
                (st_name,) = struct.unpack_from("<I", symtab, sym * 24)
                if strtab[st_name : strtab.index(b"\0", st_name)] == want:
                    return r_offset
    raise ValueError(f"{lib_path} has no relocation for {symbol}")


def _mkl_threads(path: str) -> int | None:
    """MKL's maximum thread count, from the already-loaded library at ``path``."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return int(lib.MKL_Get_Max_Threads())
    except (OSError, AttributeError):
        return None
