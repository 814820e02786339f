"""The Colab notebooks in colab/: each runs top to bottom (nbclient, a fresh kernel, the small
configuration that LLMJAX_NOTEBOOK_SMOKE=1 selects), is committed without outputs, opens with
what it shows and how long it takes on a CPU runtime, and closes with pointers into the code that
still exist (`path.py::Name.attr`, checked against the source).

    pytest tests/test_notebooks.py -k 02      # one notebook
"""

from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))
POINTER = re.compile(r"`([\w./-]+\.py)(?:::([\w.]+))?`")


def _ids(paths):
    return [p.stem for p in paths]


def _read(path):
    return nbformat.read(str(path), as_version=4)


def test_there_are_notebooks():
    names = {p.stem for p in NOTEBOOKS}
    for prefix in ("01_", "02_", "03_", "04_", "05_", "06_", "07_", "08_"):
        assert any(n.startswith(prefix) for n in names), (prefix, names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_without_outputs(path):
    nb = _read(path)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} cell {i} has outputs: clear them before committing"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_opens_with_what_and_how_long(path):
    first = _read(path).cells[0]
    assert first.cell_type == "markdown"
    text = first.source.lower()
    assert "cpu runtime" in text and re.search(r"\d+\s*(s|seconds|min|minutes)\b", text), (
        f"{path.name}: the first cell must say how long the notebook takes on a CPU runtime"
    )


def _defines(source: str, dotted: str) -> bool:
    """Whether module `source` defines `dotted` (a top-level name, or Class.attr...)."""
    body = ast.parse(source).body
    for part in dotted.split("."):
        found = None
        for node in body:
            names = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            if part in names:
                found = node
                break
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_closes_with_pointers_that_exist(path):
    last = _read(path).cells[-1]
    assert last.cell_type == "markdown"
    pointers = POINTER.findall(last.source)
    assert len(pointers) >= 3, f"{path.name}: the last cell must point into the code"
    for file, name in pointers:
        source = ROOT / file
        assert source.is_file(), f"{path.name} points to a missing file {file}"
        if name:
            assert _defines(source.read_text(), name), f"{path.name}: {file} has no {name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_runs_top_to_bottom(path, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("LLMJAX_NOTEBOOK_SMOKE", "1")
    # notebooks ask for devices themselves; XLA's -O0 (conftest.py) and the run's compilation
    # cache (JAX_COMPILATION_CACHE_DIR) stay
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    nb = _read(path)
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError with the failing cell and its traceback


def test_docs_and_docstrings_point_at_code_that_exists():
    """Every source path (`llmjax/.../x.py`, scripts/, tests/, kernels_*/, configs/) that
    README.md, docs/, the notebooks and the package docstrings mention exists, and a
    `path.py::Name` defines that name (a split that moves code must move its pointers)."""
    pointer = re.compile(
        r"(?<![\w./])((?:llmjax|scripts|tests|kernels_\w+|configs)/[\w/]*\w\.py)(?:::([\w.]+))?"
    )
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *NOTEBOOKS]
    sources += list((ROOT / "llmjax").rglob("*.py"))
    seen = set()
    for doc in sources:
        for file, name in set(pointer.findall(doc.read_text())):
            seen.add(file)
            source = ROOT / file
            assert source.is_file(), f"{doc.relative_to(ROOT)} points to a missing file {file}"
            if name:
                assert _defines(source.read_text(), name), f"{doc.name}: {file} has no {name}"
    assert len(seen) > 50
