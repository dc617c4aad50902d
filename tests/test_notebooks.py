"""The notebooks run top to bottom, and what git holds of them stays reviewable.

Every ``notebooks/*.ipynb`` is paired with a jupytext percent-format ``.py`` next to
it (the file to read and review) and is committed without outputs. These tests fail if

- a notebook has no ``.py`` twin, or the two differ in any cell (edit the ``.py`` and
  run ``jupytext --update --to ipynb notebooks/NAME.py``, which keeps the cell ids;
  after editing the ``.ipynb`` in Jupyter or Colab, run ``jupytext --to py:percent
  notebooks/NAME.ipynb``);
- a committed ``.ipynb`` carries outputs or execution counts (``jupytext --to ipynb
  notebooks/NAME.py``, without ``--update``, rewrites it without them);
- any cell raises when the notebook is executed in a fresh kernel (the notebooks end
  with assertions, so a silently broken notebook fails too).

The kernels run this interpreter, inherit this process's environment (conftest.py:
8 fake CPU devices) with ``JAMP_NOTEBOOK_SIZE=small``, and start in a temporary
directory, so run directories written by a notebook do not land in the repository.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
PAIRED = sorted(NOTEBOOK_DIR.glob("*.py"))
CELL_TIMEOUT_S = 600


def _cells(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


def test_every_notebook_is_paired():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"
    assert [p.stem for p in NOTEBOOKS] == [p.stem for p in PAIRED], (
        "Each notebooks/*.ipynb needs a jupytext twin notebooks/*.py (percent format) and "
        "vice versa: run `jupytext --set-formats ipynb,py:percent notebooks/NAME.ipynb`."
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_pair_in_sync(path: Path):
    py = path.with_suffix(".py")
    assert py.exists(), f"{py.name} is missing: jupytext --to py:percent notebooks/{path.name}"
    from_py = jupytext.read(py)
    from_ipynb = nbformat.read(path, as_version=4)
    assert _cells(from_py) == _cells(from_ipynb), (
        f"{path.name} and {py.name} differ. After editing {py.name}: "
        f"`jupytext --update --to ipynb notebooks/{py.name}`; after editing {path.name} in "
        f"Jupyter/Colab: `jupytext --to py:percent notebooks/{path.name}`."
    )
    formats = from_ipynb.metadata.get("jupytext", {}).get("formats", "")
    assert formats == "ipynb,py:percent", f"{path.name}: jupytext pairing metadata is {formats!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (
        f"{path.name}: cells {dirty} carry outputs or execution counts. Strip them before "
        f"committing: `jupytext --to ipynb notebooks/{path.with_suffix('.py').name}`."
    )
    assert "widgets" not in nb.metadata, f"{path.name}: widget state in the metadata"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_colab_ready(path: Path):
    """An "Open in Colab" badge pointing at this very file, and the guarded install cell."""
    nb = nbformat.read(path, as_version=4)
    badge = f"colab.research.google.com/github/jamp-dev/jamp/blob/main/notebooks/{path.name}"
    assert nb.cells[0].cell_type == "markdown" and badge in nb.cells[0].source, (
        f"{path.name}: the first cell needs the Colab badge linking to .../{badge}")
    setup = next(cell.source for cell in nb.cells if cell.cell_type == "code")
    assert 'if "google.colab" in sys.modules:' in setup and "JAMP_REPO = " in setup, (
        f"{path.name}: the first code cell must install jamp from JAMP_REPO on Colab only")


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory) -> KernelSpecManager:
    """A kernelspec that runs *this* interpreter, whatever else is installed."""
    root = tmp_path_factory.mktemp("kernels")
    spec_dir = root / "jamp-test"
    spec_dir.mkdir()
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jamp test kernel",
        "language": "python",
    }))
    return KernelSpecManager(kernel_dirs=[str(root)], ensure_native_kernel=False)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: Path, tmp_path: Path, kernel_specs, monkeypatch):
    monkeypatch.setenv("JAMP_NOTEBOOK_SIZE", "small")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="jamp-test", kernel_spec_manager=kernel_specs)
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    try:
        client.execute()  # raises CellExecutionError, with the cell and traceback, on error
    finally:
        # The executed copy (with outputs) helps when a cell fails.
        nbformat.write(nb, tmp_path / path.name)
    print(f"{path.name}: {time.perf_counter() - start:.0f} s")
