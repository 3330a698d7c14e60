"""The tree reads as the flow: no symlinked package, no import circle, no module past ~800 lines
without a reason at its top, the old import paths still working, and the card's top-level
folders as entry points.

The layer contract itself (nothing imports upward) is `lint-imports` in `make test`.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rag_retriever"
# Past this many lines a module says at its top why it is one module (a reader looking for two
# things in it is the sign it should be two).
LONG_MODULE_LINES = 800
LONG_MODULE_REASON = "Why one module:"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(name)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a.b")
    graph.add_import(importer="a.d", imported="a.b")
    assert _cycles(graph) == [["a.b", "a.c"]]


def test_the_package_has_no_import_circle() -> None:
    """Function-level imports count too (the store factory's were a circle); imports under
    TYPE_CHECKING do not run, so they do not."""
    graph = grimp.build_graph("rag_retriever", exclude_type_checking_imports=True)
    assert _cycles(graph) == []


def test_no_package_folder_is_a_symlink() -> None:
    links = [
        p.relative_to(ROOT)
        for top in ("rag_retriever", "ingest", "eval")
        for p in [ROOT / top, *(ROOT / top).rglob("*")]
        if p.is_symlink()
    ]
    assert links == []


def test_long_modules_say_why_they_are_one_module() -> None:
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > LONG_MODULE_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if LONG_MODULE_REASON not in doc:
                unexplained.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert unexplained == []


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("rag_retriever.retriever", "rag_retriever.query.retriever", "Retriever"),
        ("rag_retriever.server", "rag_retriever.service.server", "create_app"),
        ("rag_retriever.encoder", "rag_retriever.models.encoder", "Encoder"),
        ("rag_retriever.reranker", "rag_retriever.models.reranker", "CrossEncoderReranker"),
    ],
)
def test_the_0_2_import_paths_still_work(old: str, new: str, name: str) -> None:
    assert getattr(importlib.import_module(old), name) is getattr(
        importlib.import_module(new), name
    )


def test_the_package_root_exports_what_it_lists() -> None:
    import rag_retriever

    for name in rag_retriever.__all__:
        assert getattr(rag_retriever, name) is not None, name


@pytest.mark.parametrize("script", ["ingest/ingest.py", "eval/recall_at_k.py"])
def test_the_card_s_top_level_folders_hold_their_commands(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "--collection" in done.stdout
