"""Building the CPU kernels (`csrc/*.cc`) into one shared library, at first use, with the system
C++ compiler, and registering them as XLA FFI targets.

The library is compiled for this machine (`-O3 -march=native`, so AVX-512 / VNNI paths are taken
where the CPU has them) against the XLA FFI headers that jaxlib ships, into
`$XDG_CACHE_HOME/llmjax/kernels_cpu/<key>/`, where the key hashes the sources, the compiler, the
flags, jaxlib's version and the CPU's feature flags: later processes load it in milliseconds, and
concurrent ones (test workers) build it once (a lock file; the library is renamed into place
complete). The compiler runs once per translation unit, all at once (`UNITS`: the attention
kernel in nine parts), then links: 41 s on this 2-core VM against 57.5 s for one compiler
process over the three sources. `LLMJAX_CPU_KERNELS=0` turns the kernels off; `CXX` picks the
compiler. When no compiler works, `load()` raises `KernelsUnavailable` with the reason, and
callers fall back to the plain-jnp paths.

`engines()` names the code paths the library was compiled with for this CPU. The matmul kernels
are written for AVX-512 (VNNI, bf16 dots, AMX); on a CPU without it (AVX2 only: AMD Zen 2/3,
Intel before Skylake-SP) the dense kernel runs its AVX2 engine, and the qmatmul kernel its
portable scalar loops, 3-25x slower than XLA's own dot (scripts/bench_dense_matmul.py,
bench_qmatmul.py), so the model takes each only where it measured faster
(llmjax/model/quant.py). The attention kernel's portable path still beats the jnp reference;
with VNNI it scores an int8 KV cache in int8 (`int8_scores`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = ("ragged_paged_attention.cc", "qmatmul.cc", "dense_matmul.cc")
# What each compiler process builds (a source and its defines), all at once: the attention
# kernel's (q dtype, KV dtype) instantiations, most of the build's time, in parts of their own
# (LLMJAX_RPA_PART, ragged_paged_attention.cc), 0 its FFI handler.
UNITS = (
    *(("ragged_paged_attention.cc", (f"-DLLMJAX_RPA_PART={k}",)) for k in range(9)),
    ("qmatmul.cc", ()),
    ("dense_matmul.cc", ()),
)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
LIBRARY = "libllmjax_cpu.so"
# FFI handler symbols in the library -> the XLA custom-call target names they are registered as.
# The engines each kernel may be compiled with, by the number its `<symbol>Engine()` returns.
ENGINES = {
    "dense_matmul": (
        "LlmjaxDenseMatmulEngine",
        ("portable", "avx512", "avx512_bf16", "amx", "avx2"),
    ),
    "qmatmul": ("LlmjaxQmatmulEngine", ("portable", "avx512", "avx512_vnni", "amx")),
    "ragged_paged_attention": (
        "LlmjaxRaggedPagedAttentionEngine",
        ("portable", "avx512", "avx512_vnni"),
    ),
}
TARGETS = {
    "LlmjaxRaggedPagedAttention": "llmjax_cpu_ragged_paged_attention",
    "LlmjaxQmatmul": "llmjax_cpu_qmatmul",
    "LlmjaxDenseMatmul": "llmjax_cpu_dense_matmul",
    "LlmjaxGroupedQmatmul": "llmjax_cpu_grouped_qmatmul",
    "LlmjaxGroupedDenseMatmul": "llmjax_cpu_grouped_dense_matmul",
}


class KernelsUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here (the message says why)."""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelsUnavailable("no C++ compiler found (install g++, or set CXX)")
    return cxx


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _include_dir() -> str:
    import jaxlib

    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    if not os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
        raise KernelsUnavailable(f"jaxlib ships no XLA FFI headers under {include}")
    return include


def _cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(base, "llmjax", "kernels_cpu")


def _key(cxx: str) -> str:
    import jaxlib

    h = hashlib.sha256()
    for name in sorted(os.listdir(CSRC)):
        with open(os.path.join(CSRC, name), "rb") as f:
            h.update(name.encode() + f.read())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h.update("\0".join([version, *FLAGS, repr(UNITS), jaxlib.__version__, _cpu_flags()]).encode())
    return h.hexdigest()[:16]


def build() -> str:
    """The library's path, compiled now if this machine has none yet."""
    cxx = _compiler()
    out_dir = os.path.join(_cache_root(), _key(cxx))
    path = os.path.join(out_dir, LIBRARY)
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it
        if os.path.exists(path):
            return path
        with tempfile.TemporaryDirectory(dir=out_dir) as work:
            tmp = os.path.join(work, LIBRARY)
            _compile_and_link(cxx, work, tmp)
            os.replace(tmp, path)
    return path


def _compile_and_link(cxx: str, work: str, out: str) -> None:
    """Each of `UNITS` compiled to an object at once (one compiler process each: they build
    in parallel on the cores that are free), then linked into `out`."""
    compile_flags = [f for f in FLAGS if f != "-shared"]
    procs, objects = [], []
    for i, (source, defines) in enumerate(UNITS):
        obj = os.path.join(work, f"{i}_{source}.o")
        cmd = [cxx, *compile_flags, *defines, "-c", "-I", _include_dir(), "-I", CSRC]
        cmd += [os.path.join(CSRC, source), "-o", obj]
        logger.info("building the CPU kernels: %s", " ".join(cmd))
        procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
        objects.append(obj)
    errors = [p.communicate()[1] for p in procs]  # (each waits for its process)
    if any(p.returncode for p in procs):
        stderr = "\n".join(e for p, e in zip(procs, errors, strict=True) if p.returncode)
        raise KernelsUnavailable(f"compiling the CPU kernels failed:\n{stderr[-4000:]}")
    done = subprocess.run([cxx, *FLAGS, *objects, "-o", out], capture_output=True, text=True)
    if done.returncode != 0:
        raise KernelsUnavailable(f"linking the CPU kernels failed:\n{done.stderr[-4000:]}")


def load() -> str:
    """Build (if needed), load and register the kernels once per process; returns the library's
    path. Raises KernelsUnavailable (every call, after one attempt)."""
    path, _, error = _load_once()
    if error is not None:
        raise KernelsUnavailable(error)
    return path


def engines() -> dict[str, str]:
    """The engine each kernel was compiled with here (ENGINES' names, e.g.
    {'dense_matmul': 'avx512_bf16', 'qmatmul': 'amx', 'ragged_paged_attention': 'avx512_vnni'});
    raises KernelsUnavailable."""
    load()
    return dict(_load_once()[1])


def vectorized(kernel: str) -> bool:
    """Whether `kernel` ('dense_matmul' or 'qmatmul') loads here with a vector engine (not the
    portable scalar loops)."""
    try:
        return engines()[kernel] != "portable"
    except KernelsUnavailable:
        return False


def _engine_name(names: tuple[str, ...], number: int) -> str:
    return names[number] if 0 <= number < len(names) else f"unknown-{number}"


@functools.cache
def _load_once() -> tuple[str | None, tuple, str | None]:
    if os.environ.get("LLMJAX_CPU_KERNELS", "1") == "0":
        return None, (), "turned off by LLMJAX_CPU_KERNELS=0"
    import ctypes

    import jax

    try:
        path = build()
        library = ctypes.cdll.LoadLibrary(path)
        for symbol, target in TARGETS.items():
            capsule = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(target, capsule, "cpu")
        found = tuple(
            (kernel, _engine_name(names, getattr(library, symbol)()))
            for kernel, (symbol, names) in ENGINES.items()
        )
    except (KernelsUnavailable, OSError, AttributeError) as e:
        return None, (), str(e)
    logger.info("CPU kernels loaded from %s: %s", path, dict(found))
    return path, found, None


def available() -> bool:
    """Whether the kernels load here (the reason is logged once when they do not)."""
    try:
        load()
        return True
    except KernelsUnavailable as e:
        _warn_once(str(e))
        return False


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("CPU kernels unavailable, using the jnp paths: %s", message)
