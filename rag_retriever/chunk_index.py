"""The per-version sidecar of a collection: its chunk table and its BM25 index.

Example:
    >>> index = ChunkIndex.build(chunks, collection="docs__m-384__v1")      # doctest: +SKIP
    >>> index.save(Path("rag-data/indexes"))                                # doctest: +SKIP

Row i of the chunk table is document i of the BM25 index, and the chunk's Qdrant point id maps to
its row, so dense and lexical results meet on the same chunk records. The directory is written
under a temporary name and renamed into place, so a reader sees a whole index or none. When it is
missing (e.g. a server-mode replica that did not run the ingest), `rebuild` recreates it from the
Qdrant payloads, which hold the same chunk records.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rag_retriever.bm25 import BM25Index, Tokenizer
from rag_retriever.records import Chunk, SearchFilter

MANIFEST = "manifest.json"
CHUNKS = "chunks.jsonl"


@dataclass(frozen=True)
class LexicalHit:
    row: int
    rank: int
    score: float
    matched_terms: tuple[str, ...]


class ChunkIndex:
    def __init__(self, collection: str, chunks: Sequence[Chunk], bm25: BM25Index) -> None:
        if bm25.n_docs != len(chunks):
            raise ValueError(
                f"BM25 index has {bm25.n_docs} documents but the chunk table {len(chunks)} rows"
            )
        self.collection = collection
        self.chunks = list(chunks)
        self.bm25 = bm25
        self.tokenizer = Tokenizer()
        self.row_of = {c.id: i for i, c in enumerate(self.chunks)}
        self._doc_rows: dict[str, list[int]] = {}
        for i, c in enumerate(self.chunks):
            self._doc_rows.setdefault(c.doc_id, []).append(i)
        self._field_values: dict[str, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.chunks)

    @classmethod
    def build(cls, chunks: Sequence[Chunk], *, collection: str) -> ChunkIndex:
        tokenizer = Tokenizer()
        corpus = [tokenizer.tokenize(c.embed_text) for c in chunks]
        return cls(collection, chunks, BM25Index.build(corpus, tokenizer=tokenizer.name))

    @classmethod
    def rebuild(cls, payloads: Iterable[dict[str, Any]], *, collection: str) -> ChunkIndex:
        """Rebuild from Qdrant payloads; rows ordered by (doc id, chunk index) as at ingest."""
        chunks = sorted(
            (Chunk.from_payload(p) for p in payloads), key=lambda c: (c.doc_id, c.chunk_index)
        )
        return cls.build(chunks, collection=collection)

    # -- persistence ------------------------------------------------------------------------

    def save(self, root: Path) -> Path:
        final = root / self.collection
        tmp = root / f".{self.collection}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir(parents=True)
        try:
            with (tmp / CHUNKS).open("w", encoding="utf-8") as fh:
                for c in self.chunks:
                    fh.write(json.dumps(c.to_payload(), ensure_ascii=False) + "\n")
            self.bm25.save(tmp)
            manifest = {"collection": self.collection, "chunks": len(self.chunks)}
            (tmp / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    @classmethod
    def load(cls, root: Path, collection: str) -> ChunkIndex | None:
        """The saved index of `collection`, or None when there is none (or it is incomplete)."""
        directory = root / collection
        if not (directory / MANIFEST).is_file():
            return None
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        with (directory / CHUNKS).open(encoding="utf-8") as fh:
            chunks = [Chunk.from_payload(json.loads(line)) for line in fh]
        if manifest.get("chunks") != len(chunks):
            return None
        return cls(collection, chunks, BM25Index.load(directory))

    @staticmethod
    def remove(root: Path, collection: str) -> None:
        shutil.rmtree(root / collection, ignore_errors=True)

    # -- filtering and lexical search -------------------------------------------------------

    def mask(self, flt: SearchFilter | None) -> np.ndarray | None:
        """Rows allowed by the filter (None = all), computed like the Qdrant filter."""
        if flt is None or flt.is_empty:
            return None
        allowed = np.ones(len(self.chunks), dtype=bool)
        if flt.doc_ids is not None:
            doc_mask = np.zeros(len(self.chunks), dtype=bool)
            for doc_id in flt.doc_ids:
                doc_mask[self._doc_rows.get(doc_id, [])] = True
            allowed &= doc_mask
        for key, value in flt.equals.items():
            field_mask = np.zeros(len(self.chunks), dtype=bool)
            field_mask[self._rows_with(key, value)] = True
            allowed &= field_mask
        return allowed

    def _rows_with(self, key: str, value: object) -> np.ndarray:
        values = self._field_values.get(key)
        if values is None:
            grouped: dict[str, list[int]] = {}
            for i, c in enumerate(self.chunks):
                if key not in c.metadata:
                    continue
                value_or_list = c.metadata[key]
                # Like Qdrant, a list field matches when any of its elements does.
                items = value_or_list if isinstance(value_or_list, list) else [value_or_list]
                for item in items:
                    grouped.setdefault(_value_key(item), []).append(i)
            values = {k: np.asarray(v, dtype=np.int64) for k, v in grouped.items()}
            self._field_values[key] = values
        return values.get(_value_key(value), np.zeros(0, dtype=np.int64))

    def search_bm25(
        self, query: str, top_n: int, flt: SearchFilter | None = None
    ) -> list[LexicalHit]:
        analyzed = self.tokenizer.analyze(query)
        terms = [term for _, term in analyzed]
        surface: dict[str, str] = {}
        for word, term in analyzed:
            surface.setdefault(term, word)
        if not terms:
            return []
        top = self.bm25.top_k(terms, top_n, self.mask(flt))
        return [
            LexicalHit(
                row=int(row),
                rank=rank,
                score=float(score),
                matched_terms=tuple(surface[t] for t in self.bm25.matched_terms(terms, int(row))),
            )
            for rank, (row, score) in enumerate(zip(top.indices, top.scores, strict=True), start=1)
        ]


def _value_key(value: object) -> str:
    """Qdrant matches `true` and `1` as different values; so does this key."""
    return json.dumps(value, sort_keys=True)
