"""Builds and loads kvllm's CPU kernels as one torch op library: csrc/kvllm_cpu.cpp (paged attention, int8 and packed
float32 linear), csrc/layer_ops.cpp (RMSNorm, RoPE, SiLU-multiply, K/V writes), csrc/bf16_linear.cpp and
csrc/quant_panels.cpp (linears on bfloat16 and on quantized panels) and csrc/decoder_layers.cpp (a decoder stack in
one call through those), with csrc/simd.h, csrc/ops.h and csrc/panels.h.

The library is compiled with one direct compiler call (no ninja, no pybind11: the ops are registered with
TORCH_LIBRARY and loaded with torch.ops.load_library). Its file name carries a hash of the sources, the compile
command and the torch version, so a changed source or another torch never loads a stale build: it is rebuilt on
first use. `make install` builds it ahead (`python -m engine.attention.cpu_ext`) so
tests and servers do not pay the compile; without a compiler the engine falls back to the torch backend.

Build directory: $KVLLM_BUILD_DIR, else <repo>/build/cpu_ext (git-ignored), else ~/.cache/kvllm/cpu_ext.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("kvllm.attention")

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
SOURCES = [CSRC / "kvllm_cpu.cpp", CSRC / "layer_ops.cpp", CSRC / "decoder_layers.cpp", CSRC / "bf16_linear.cpp",
           CSRC / "quant_panels.cpp"]
HEADERS = [CSRC / "simd.h", CSRC / "ops.h", CSRC / "panels.h"]
_NAME = "kvllm_cpu"

_lock = threading.Lock()
_ops = None  # torch.ops.kvllm_cpu once loaded
_error: str | None = None  # why it could not be built / loaded (cached: one attempt per process)


class ExtensionUnavailable(RuntimeError):
    pass


def build_dir() -> Path:
    env = os.environ.get("KVLLM_BUILD_DIR")
    if env:
        return Path(env)
    local = REPO / "build" / "cpu_ext"
    try:
        local.mkdir(parents=True, exist_ok=True)
        if os.access(local, os.W_OK):
            return local
    except OSError:
        pass
    return Path.home() / ".cache" / "kvllm" / "cpu_ext"


def compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("c++") or shutil.which("g++")


def _command(cxx: str, srcs: list[Path], out: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    incs = [f"-I{p}" for p in cpp_extension.include_paths()]
    # No -march: AVX2 code is compiled per function (#pragma GCC target) and picked at run time, so the library
    # built on one machine runs on any x86-64 (and non-x86 takes the portable path). -fopenmp only makes the
    # at::parallel_for header use OpenMP: libgomp.so.1 resolves to the copy torch already loaded (one pool).
    return [cxx, "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-DNDEBUG", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-fvisibility=hidden", *incs, *map(str, srcs), "-o", str(out), f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{torch_lib}"]


def library_path(cxx: str | None = None) -> Path:
    """Where the library for the current source / torch / compiler lives (it may not exist yet)."""
    import torch

    cxx = cxx or compiler() or "c++"
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join(_command(Path(cxx).name, [Path(f.name) for f in SOURCES], Path("out"))).encode())
    h.update(torch.__version__.encode())
    h.update(sys.platform.encode())
    return build_dir() / f"{_NAME}_{h.hexdigest()[:16]}.so"


def build(verbose: bool = False, retry: bool = False) -> Path:
    """Compile the library unless an up-to-date build exists; returns its path. Raises ExtensionUnavailable.
    A failed compile leaves <library>.failed so later processes do not spend the compile time again on the same
    source (`retry=True`, as `python -m engine.attention.cpu_ext` does, tries anyway)."""
    missing = [str(f) for f in SOURCES + HEADERS if not f.exists()]
    if missing:
        raise ExtensionUnavailable(f"{', '.join(missing)} not found (kvllm is not installed from its source tree)")
    cxx = compiler()
    out = library_path(cxx)
    if out.exists():  # a prebuilt library needs no compiler (the Docker image ships it without one)
        return out
    if cxx is None:
        raise ExtensionUnavailable("no C++ compiler found (set CXX or install g++)")
    failed = out.with_suffix(".failed")
    if failed.exists() and not retry:
        raise ExtensionUnavailable(f"an earlier compile of this source failed (rerun `python -m "
                                   f"engine.attention.cpu_ext` to retry):\n{failed.read_text()[-2000:]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock_file:
        import fcntl

        fcntl.flock(lock_file, fcntl.LOCK_EX)  # another process may be building the same library
        if out.exists():
            return out
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = _command(cxx, SOURCES, Path(tmp))
        if verbose:
            print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            failed.write_text(" ".join(cmd) + "\n" + proc.stderr[-4000:])
            raise ExtensionUnavailable(f"compiling {', '.join(f.name for f in SOURCES)} failed:\n"
                                       f"{proc.stderr[-4000:]}")
        os.chmod(tmp, 0o755)  # mkstemp made it 0600: other users (the Docker image's runtime user) must load it
        os.replace(tmp, out)  # atomic: a concurrent loader sees the old state or the whole library
        failed.unlink(missing_ok=True)
        for old in out.parent.glob(f"{_NAME}_*"):  # builds (and failure notes) of older sources
            if old.with_suffix("") != out.with_suffix(""):
                with contextlib.suppress(OSError):
                    old.unlink()
    return out


def load():
    """torch.ops.kvllm_cpu, building the library first if needed. Raises ExtensionUnavailable (cached)."""
    global _ops, _error
    with _lock:
        if _ops is not None:
            return _ops
        if _error is not None:
            raise ExtensionUnavailable(_error)
        try:
            import torch

            path = build()
            torch.ops.load_library(str(path))
            _ops = torch.ops.kvllm_cpu
            return _ops
        except Exception as exc:  # noqa: BLE001 - any failure means: use the torch backend
            _error = str(exc)
            raise ExtensionUnavailable(_error) from exc


def converts_fp8_in_hardware() -> bool:
    """Whether the kernel widens fp8 K/V with F16C instructions (its AVX2 and AVX-512 levels, csrc/simd.h); the
    portable level would convert every element in software."""
    return load().isa_level() >= 1


def is_available() -> bool:
    try:
        load()
        return True
    except ExtensionUnavailable:
        return False


def main() -> int:
    try:
        path = build(verbose=True, retry=True)
    except ExtensionUnavailable as exc:
        print(f"warning: CPU kernels not built, the torch backend and torch ops will be used: {exc}", file=sys.stderr)
        return 1
    print(f"CPU kernels: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
