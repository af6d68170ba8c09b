"""cpu_library: a kernel's C++ source compiled once per machine, for the CPU it runs on, and loaded
with ctypes.

Each source is a few hundred lines (about a second to build). The library is keyed by a hash of
the source and the headers beside it, the flags (the target among them) and the CPU's model and
flags, and written atomically under a per-user folder of the system's temporary one, so processes
that start at once share one build. Where there is no compiler, the folder cannot be written or
the library cannot be loaded, the caller is told why and keeps its torch path.

A build is marked used each time it loads; the builds of the same source that none has loaded for
STALE_AFTER_S (earlier versions', other CPUs' or targets' no process here runs) are removed then,
so the folder does not grow with every upgrade.

Workers build for the CPU they run on (`-march=native`). Tests also build for a baseline target
(BASELINE: AVX2 and FMA, no AVX-512) where this CPU runs it, so that the paths an AVX2-only CPU
takes are checked on an AVX-512 machine too.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Self

import torch

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
NATIVE = "native"  # the -march of a worker's build: this CPU
BASELINE = "x86-64-v3"  # AVX2, FMA, F16C: the kernels' fallback paths, without AVX-512


STALE_AFTER_S = 30 * 24 * 3600  # a build no process has loaded for this long is removed

# the suffix each source's exported functions take for a dtype
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class CompiledKernel:
    """A kernel whose C++ source (the subclass's SOURCE) is built once per machine and loaded with
    ctypes; the subclass is made from the library."""

    SOURCE: Path
    # Declined where its build has no AVX-512 (cpu_vec.h's vec_in_one_register), as slower there
    # than its torch path.
    AVX512_ONLY = False

    @classmethod
    def load(cls, directory: Path | None = None, target: str = NATIVE) -> "tuple[Self | None, str]":
        """The kernel, built for `target` (-march) into `directory` (load_cpu_library's default: a
        per-user folder) unless this machine's build is there; (None, why) where it cannot be or
        is declined (AVX512_ONLY)."""
        library, why = load_cpu_library(cls.SOURCE, directory, target)
        if library is not None and cls.AVX512_ONLY and not library.vec_in_one_register():
            return None, (
                f"{why}, and declined: without AVX-512 (-march={target}) its vectors are two "
                "registers, and torch's path is faster"
            )
        return (cls(library) if library else None), why


def dtype_functions(library: ctypes.CDLL, prefix: str, pointers: int) -> dict:
    """dtype -> the library's function `prefix`_<dtype name> for it, taking `pointers` pointers."""
    functions = {dtype: getattr(library, f"{prefix}_{suffix}") for dtype, suffix in DTYPE_NAMES.items()}
    return taking_pointers(functions, pointers)


def present_functions(library: ctypes.CDLL, names: dict) -> dict:
    """key -> the library's function of that name, for the names it has (a build for a CPU
    without AVX512-BF16 has no bf16 ones; an earlier commit's build, fewer)."""
    return {key: getattr(library, name) for key, name in names.items() if hasattr(library, name)}


def taking_pointers(functions: dict, pointers: int) -> dict:
    """`functions`, each declared to take `pointers` pointers (its shape's, then its tensors'), so
    that tensors pass as ints (data_ptr())."""
    for function in functions.values():
        function.argtypes = (ctypes.c_void_p,) * pointers
    return functions


def load_cpu_library(
    source: Path, directory: Path | None = None, target: str = NATIVE
) -> tuple[ctypes.CDLL | None, str]:
    """The library built from `source` for `target` (-march) into `directory` (default: a
    per-user folder under the system's temporary one) unless this machine's build is there;
    (None, why) where it cannot be."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler (c++ or g++) on PATH"
    directory = directory or Path(tempfile.gettempdir()) / f"loramux-kernels-{os.getuid()}"
    flags = (*FLAGS, f"-march={target}")
    library = directory / f"{source.stem}-{_build_key(compiler, flags, source)}.so"
    try:
        error = "" if library.exists() else _build(compiler, flags, source, library)
        if error:
            return None, error
        loaded = ctypes.CDLL(str(library))
        _tidy(library, source.stem)
        return loaded, f"built with {compiler} at {library}"
    except OSError as e:  # a folder not writable, a library not loadable (noexec)
        return None, f"cannot build or load {library}: {e}"


def _tidy(library: Path, stem: str) -> None:
    """Marks `library` used now and removes the other builds of source `stem` beside it that no
    process has loaded for STALE_AFTER_S; best effort (a folder this process may read but not
    write, or a build another process removes first, is left as it is)."""
    try:
        os.utime(library)
        stale_before = library.stat().st_mtime - STALE_AFTER_S
        for other in library.parent.glob(f"{stem}-*.so"):
            if other != library and other.stat().st_mtime < stale_before:
                other.unlink(missing_ok=True)
    except OSError:
        pass


def _build_key(compiler: str, flags: tuple[str, ...], source: Path) -> str:
    """Names the build of this source and the headers beside it, by these flags, on this CPU."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join((compiler, *flags, platform.machine(), _cpu_signature())).encode())
    return digest.hexdigest()[:16]


def _cpu_signature() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return platform.processor()
    lines = cpuinfo.read_text().splitlines()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _build(compiler: str, flags: tuple[str, ...], source: Path, library: Path) -> str:
    """Compiles `source` into `library`, atomically (processes may build it at once); '' or why not."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        partial = Path(scratch) / library.name
        done = subprocess.run(
            [compiler, *flags, "-o", str(partial), str(source)], capture_output=True, text=True
        )
        if done.returncode != 0:
            return f"{compiler} failed to build {source.name}: {done.stderr.strip()[-2000:]}"
        os.replace(partial, library)
    return ""
