"""The wheel holds what an editable install imports: rag_retriever and its ingest and eval
subpackages, and no top-level package of its own (no global `ingest`, `eval`, `bench`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_built_wheel_imports_the_evaluation_library_from_another_directory(
    tmp_path: Path,
) -> None:
    # Build from a copy (links followed), so the checkout gets no build/ or egg-info.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "rag_retriever", source / "rag_retriever", symlinks=False)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run(
        [*pip, "--quiet", "-w", str(tmp_path / "dist"), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("rag_retriever-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        top = {name.split("/")[0] for name in zf.namelist()}
        assert "rag_retriever/ops/capacity.json" in zf.namelist()  # what `plan` reads
    assert {t for t in top if not t.endswith(".dist-info")} == {"rag_retriever"}

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import rag_retriever.eval.metrics as m, rag_retriever.ingest.loaders as l; "
        "print(m.__file__); print(l.__file__); print(m.recall_at_k(['a', 'b'], [{'b'}], 2))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(wheel)],
        capture_output=True,
        text=True,
        check=True,
        cwd=elsewhere,
    )
    metrics_file, loaders_file, recall = done.stdout.split()
    assert metrics_file.startswith(str(wheel)) and loaders_file.startswith(str(wheel))
    assert float(recall) == 1.0


def test_the_package_root_exports_one_list_of_names() -> None:
    """`__all__`, the lazy imports and the imports type checkers read name the same things."""
    import ast

    import rag_retriever

    tree = ast.parse((ROOT / "rag_retriever" / "__init__.py").read_text())
    typed = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module != "typing"
        for alias in node.names
        if node.module.startswith("rag_retriever.")
    }
    assert set(rag_retriever.__all__) == typed
    for name in rag_retriever.__all__:
        assert getattr(rag_retriever, name).__name__ == name
