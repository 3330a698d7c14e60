"""BM25 (Okapi, exactly as rank-bm25 scores it) as sparse vectors, plus its tokenizer.

Example:
    >>> tok = Tokenizer()
    >>> corpus = [tok.tokenize(t) for t in ["red apples", "green pears", "red wine"]]
    >>> model = BM25Model.build(corpus)
    >>> doc = model.document_vector(corpus[2])
    >>> query = model.query_vector(tok.tokenize("red wine"))
    >>> round(sparse_dot(query, doc), 4)
    0.5874

A collection version is immutable, so the document side of BM25 can hold the final Okapi term
weights of that version's corpus: `idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))`,
with rank-bm25's IDF (its own `_calc_idf`, the `epsilon * average_idf` floor included). The query
side holds how often each query term occurs, so the engine's sparse dot product is exactly
`rank_bm25.BM25Okapi(corpus).get_scores(query)` (stored as float32: equal to ~1e-6 relative).

A term's sparse index is a stable 32-bit hash of the analysed term, so a serving process needs no
vocabulary. Two terms of one version's vocabulary that hash alike are found at build time; the
later one (in sorted order) moves to the next free index and the move is kept in the version's
metadata (`BM25Model.moved`), so every vocabulary term keeps its own weight. Not handled: a query
term that is in no document of the version but hashes like one that is (probability about
vocabulary size / 2^32 per such term, e.g. 1e-5 at 40k terms) adds that term's weight.

Tokenizer `en-snowball-v1`: NFKC, lower-case, `\\w+` words, an English stop-word list, Snowball
English stemming (PyStemmer). The same tokenizer is used at ingest and at query time; its name is
stored with each version and checked when it is opened. It does not handle CJK word segmentation.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import Stemmer
from rank_bm25 import BM25Okapi

TOKENIZER_NAME = "en-snowball-v1"

# rank-bm25's defaults for BM25Okapi.
K1 = 1.5
B = 0.75
EPSILON = 0.25

# Function words that carry no topical signal; kept short so that question words that do
# (e.g. "first", "most") still count.
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "been",
        "being",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "for",
        "from",
        "had",
        "has",
        "have",
        "having",
        "he",
        "her",
        "hers",
        "him",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "itself",
        "me",
        "my",
        "of",
        "on",
        "or",
        "our",
        "ours",
        "she",
        "should",
        "so",
        "than",
        "that",
        "the",
        "their",
        "theirs",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "to",
        "too",
        "us",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "about",
        "above",
        "after",
        "again",
        "against",
        "all",
        "any",
        "because",
        "before",
        "below",
        "between",
        "both",
        "during",
        "each",
        "few",
        "further",
        "here",
        "just",
        "more",
        "most",
        "nor",
        "not",
        "now",
        "off",
        "once",
        "only",
        "other",
        "out",
        "over",
        "own",
        "same",
        "some",
        "such",
        "through",
        "under",
        "until",
        "up",
        "very",
        "s",
        "t",
    ]
)

_WORD = re.compile(r"\w+")


class Tokenizer:
    """The BM25 analyzer; `analyze` keeps each term's surface word for explanations."""

    name = TOKENIZER_NAME

    def __init__(self) -> None:
        self._stemmer = Stemmer.Stemmer("english")

    def analyze(self, text: str) -> list[tuple[str, str]]:
        """(surface word, index term) pairs, stop words removed."""
        words = [w for w in _WORD.findall(unicodedata.normalize("NFKC", text).lower())]
        words = [w for w in words if w not in STOPWORDS]
        return list(zip(words, self._stemmer.stemWords(words), strict=True))

    def tokenize(self, text: str) -> list[str]:
        return [term for _, term in self.analyze(text)]

    def tokenize_many(self, texts: Sequence[str]) -> list[list[str]]:
        return [self.tokenize(t) for t in texts]


# Qdrant's sparse vector indices are unsigned 32-bit integers.
INDEX_SPACE = 2**32


def term_index(term: str) -> int:
    """The default sparse index of an analysed term: the first 4 bytes of its BLAKE2b digest."""
    digest = hashlib.blake2b(term.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class SparseVector:
    """Sorted, distinct indices and their values (the engine's sparse vector)."""

    indices: tuple[int, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.indices) != len(self.values):
            raise ValueError("a sparse vector needs one value per index")

    @property
    def is_empty(self) -> bool:
        return not self.indices


def sparse_dot(a: SparseVector, b: SparseVector) -> float:
    """The dot product the engine computes (for tests and docs)."""
    weights = dict(zip(b.indices, b.values, strict=True))
    return sum(v * weights.get(i, 0.0) for i, v in zip(a.indices, a.values, strict=True))


def _sorted_vector(weights: Mapping[int, float]) -> SparseVector:
    order = sorted(weights)
    return SparseVector(tuple(order), tuple(float(weights[i]) for i in order))


@dataclass(frozen=True)
class BM25Model:
    """One version's BM25: corpus statistics, parameters and the term -> index table.

    `idf` is only known while the version is built (the document side needs it); a model read
    back from a version's metadata (`from_json`) encodes queries only.
    """

    n_docs: int
    avgdl: float
    k1: float = K1
    b: float = B
    epsilon: float = EPSILON
    tokenizer: str = TOKENIZER_NAME
    # Vocabulary terms that moved off a hash shared with another term: term -> index.
    moved: Mapping[str, int] = field(default_factory=dict)
    idf: Mapping[str, float] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        corpus: Iterable[Sequence[str]],
        *,
        k1: float = K1,
        b: float = B,
        epsilon: float = EPSILON,
    ) -> BM25Model:
        """Statistics of a tokenised corpus, read once (so a generator of any size will do)."""
        doc_freq: dict[str, int] = {}  # first-occurrence order, as rank-bm25's `nd`
        n_docs = total = 0
        for document in corpus:
            n_docs += 1
            total += len(document)
            for word in dict.fromkeys(document):
                doc_freq[word] = doc_freq.get(word, 0) + 1
        if n_docs == 0:
            raise ValueError("cannot build BM25 over zero documents")
        return cls(
            n_docs=n_docs,
            # rank-bm25: avgdl = num_doc / corpus_size with an integer numerator.
            avgdl=total / n_docs,
            k1=k1,
            b=b,
            epsilon=epsilon,
            moved=_resolve_collisions(doc_freq),
            idf=_rank_bm25_idf(doc_freq, n_docs, k1=k1, b=b, epsilon=epsilon),
        )

    def index_of(self, term: str) -> int:
        moved = self.moved.get(term)
        return term_index(term) if moved is None else moved

    def document_vector(self, terms: Sequence[str]) -> SparseVector:
        """Each distinct term's Okapi weight in this document, in rank-bm25's float64 expression."""
        if not self.idf:
            raise ValueError("this BM25 model has no IDF table: it can encode queries only")
        k1, b = self.k1, self.b
        norm = k1 * (1 - b + b * len(terms) / self.avgdl)
        weights: dict[int, float] = {}
        for term, tf in Counter(terms).items():
            idf = self.idf.get(term)
            if idf is None:
                raise KeyError(f"term {term!r} is not in this version's vocabulary")
            weights[self.index_of(term)] = idf * (tf * (k1 + 1) / (tf + norm))
        return _sorted_vector(weights)

    def query_vector(self, terms: Sequence[str]) -> SparseVector:
        """How often each term occurs in the query: rank-bm25 adds a repeated term again."""
        counts: dict[int, float] = {}
        for term in terms:
            index = self.index_of(term)
            counts[index] = counts.get(index, 0.0) + 1.0
        return _sorted_vector(counts)

    def to_json(self) -> dict[str, Any]:
        return {
            "n_docs": self.n_docs,
            "avgdl": self.avgdl,
            "k1": self.k1,
            "b": self.b,
            "epsilon": self.epsilon,
            "tokenizer": self.tokenizer,
            "moved": dict(self.moved),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BM25Model:
        if data.get("tokenizer") != TOKENIZER_NAME:
            raise ValueError(
                f"this version's BM25 was built with tokenizer {data.get('tokenizer')!r}, this "
                f"rag-retriever uses {TOKENIZER_NAME!r}; re-ingest the collection"
            )
        return cls(
            n_docs=int(data["n_docs"]),
            avgdl=float(data["avgdl"]),
            k1=float(data["k1"]),
            b=float(data["b"]),
            epsilon=float(data["epsilon"]),
            tokenizer=str(data["tokenizer"]),
            moved={str(k): int(v) for k, v in dict(data.get("moved") or {}).items()},
        )


def _rank_bm25_idf(
    doc_freq: dict[str, int], n_docs: int, *, k1: float, b: float, epsilon: float
) -> dict[str, float]:
    """IDF exactly as rank-bm25 computes it: its own `_calc_idf` over the document frequencies.

    `BM25Okapi(corpus)` would also keep a dict per document (gigabytes at a million chunks);
    the IDF needs only the document frequencies, so only they are handed over.
    """
    reference = BM25Okapi.__new__(BM25Okapi)
    reference.k1, reference.b, reference.epsilon = k1, b, epsilon
    reference.corpus_size = n_docs
    reference.idf = {}
    reference._calc_idf(doc_freq)
    return dict(reference.idf)


def _resolve_collisions(vocabulary: Iterable[str]) -> dict[str, int]:
    """Give every term its own index: the later of two same-hash terms (sorted) moves to the next
    free index. Returns only the terms that moved."""
    owner: dict[int, str] = {}
    clashing: list[str] = []
    for term in sorted(vocabulary):
        index = term_index(term)
        if index in owner:
            clashing.append(term)
        else:
            owner[index] = term
    moved: dict[str, int] = {}
    for term in clashing:
        index = term_index(term)
        while index in owner:
            index = (index + 1) % INDEX_SPACE
        owner[index] = term
        moved[term] = index
    return moved
