"""Every pinned dependency in pyproject.toml is imported where it serves (or is a tool or plugin
that is run rather than imported, listed below with what runs it), so a pin nothing uses cannot
come back unnoticed."""

import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("llmjax", "kernels_pallas", "configs", "scripts", "tests", "colab")

# distribution name -> the module it is imported as, where they differ
IMPORT_NAMES = {
    "absl-py": "absl",
    "orbax-checkpoint": "orbax",
    "prometheus-client": "prometheus_client",
    "mooncake-transfer-engine-non-cuda": "mooncake",
}
# pinned, but run rather than imported
NOT_IMPORTED = {
    "jaxlib": "jax's compiled backend, pinned to jax's version",
    "ipykernel": "the kernel nbclient starts to execute the notebooks",
    "pytest-timeout": "pytest plugin: the `timeout` setting in pyproject.toml",
    "pytest-xdist": "pytest plugin: `make test` runs `pytest -n`",
    "ruff": "the linter `make lint` runs",
}


def _pins() -> dict[str, str]:
    """{distribution name: pin} of the dependencies and every extra (not self-references)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += [s for s in extra if not s.startswith("llmjax")]
    pins = {}
    for spec in specs:
        name = re.match(r"[A-Za-z0-9_.\-]+", spec).group(0)
        assert "==" in spec, f"{spec!r} is not pinned"
        pins[name.lower()] = spec
    return pins


def _imported_modules() -> set[str]:
    found = set()
    pattern = re.compile(
        r"^\s*(?:\"\s*)?(?:from|import)\s+([A-Za-z_]\w*)"  # import x / from x (notebooks: "...)
        r"|importorskip\(\s*[\"'](\w+)",  # pytest.importorskip("x")
        re.M,
    )
    for top in SOURCES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".ipynb")):
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        found |= {a or b for a, b in pattern.findall(f.read())}
    return found


def test_every_pin_is_imported_or_run():
    pins, imported = _pins(), _imported_modules()
    unused = [
        spec
        for name, spec in pins.items()
        if name not in NOT_IMPORTED
        and IMPORT_NAMES.get(name, name.replace("-", "_")) not in imported
    ]
    assert not unused, f"pinned but never imported (use them or drop the pin): {unused}"
    stale = sorted(set(NOT_IMPORTED) - set(pins))
    assert not stale, f"NOT_IMPORTED lists what is no longer pinned: {stale}"
