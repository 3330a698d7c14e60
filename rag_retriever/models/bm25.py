"""BM25 (Okapi, exactly as rank-bm25 scores it) as sparse vectors, plus its tokenizer.

Example:
    >>> tok = Tokenizer()
    >>> corpus = [tok.tokenize(t) for t in ["red apples", "green pears", "red wine"]]
    >>> model = BM25Model.build(corpus)
    >>> doc = model.document_vector(corpus[2])
    >>> query = model.query_vector(tok.tokenize("red wine"))
    >>> round(sparse_dot(query, doc), 4)
    0.5874

Okapi's score is a sum over query terms of `idf(t) * sat(t, d)`, with the saturated,
length-normalised term frequency `sat = tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))`.
The document side of a version's sparse vectors holds `sat` alone; the IDF belongs to the query
side (`query_vector` = term counts x IDF), computed from the document frequencies the version
records. So a document's weights do not change when other documents do: a delta writes only the
points it adds, and the engine's sparse dot product is still exactly
`rank_bm25.BM25Okapi(corpus).get_scores(query)` (IDF with rank-bm25's `epsilon * average_idf`
floor; stored as float32: equal to ~1e-6 relative). `avgdl` is the lineage's: the average length
of the full build the document side was normalised with (`BM25Stats.avgdl`); after deltas the
scores are rank-bm25's with that average length, and `BM25Stats.drift` says how far the real
average has moved (the writer re-bases with a full build past a threshold).

A term's sparse index is a stable 32-bit hash of the analysed term (`TERM_HASH`), so a serving
process needs no vocabulary. Two vocabulary terms that hash alike are found when they enter the
vocabulary; the later one moves to the next free index and the move is kept in the version's
statistics (`BM25Stats.moved`), so every vocabulary term keeps its own weight. A query term that
is in no document of the version has IDF 0 in rank-bm25 and is left out of the query vector.

Tokenizer `en-snowball-v1`: NFKC, lower-case, `\\w+` words, an English stop-word list, Snowball
English stemming (PyStemmer). The same tokenizer is used at ingest and at query time; its name and
the hash scheme are stored with each version and checked when it is opened. It does not handle
CJK word segmentation.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any, Protocol

import numpy as np
import Stemmer

from rag_retriever.errors import DocumentError, UpdateRefused, VersionIncompatible

TOKENIZER_NAME = "en-snowball-v1"
# The term -> sparse index scheme (`term_index`): part of every version's statistics.
TERM_HASH = "blake2b-32le-v1"
# What the document side of a version's sparse vectors holds (saturated tf, the IDF on the query
# side). Versions written with the IDF on the document side (rag-retriever 0.2) are refused.
WEIGHTING = "okapi-sat-tf/query-idf-v1"

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


# Words whose analysis a tokenizer remembers (a word -> its term, or None for a stop word): a
# corpus repeats its words, and stemming each again was a third of an ingest's BM25 analysis.
# Past this many the memory starts again (a few tens of MB at most).
MEMO_WORDS = 500_000


class Tokenizer:
    """The BM25 analyzer; `analyze` keeps each term's surface word for explanations. Safe to
    share between threads."""

    name = TOKENIZER_NAME

    def __init__(self) -> None:
        self._stemmer = Stemmer.Stemmer("english")
        self._memo: dict[str, str | None] = {}

    def analyze(self, text: str) -> list[tuple[str, str]]:
        """(surface word, index term) pairs, stop words removed."""
        words = _words(text)
        return [(w, t) for w, t in zip(words, self._terms(words), strict=True) if t is not None]

    def tokenize(self, text: str) -> list[str]:
        return [t for t in self._terms(_words(text)) if t is not None]

    def tokenize_many(self, texts: Sequence[str]) -> list[list[str]]:
        return [self.tokenize(t) for t in texts]

    def _terms(self, words: list[str]) -> list[str | None]:
        """Each word's term (None: a stop word), from the memory; the words it lacks are
        analysed together and learnt. Reads only its own `terms` after a miss, so another
        thread that starts the memory again meanwhile changes nothing here."""
        memo = self._memo
        try:
            return [memo[w] for w in words]
        except KeyError:
            pass
        terms = {w: memo.get(w, _UNKNOWN) for w in words}
        new = [w for w, t in terms.items() if t is _UNKNOWN and w not in STOPWORDS]
        learnt: dict[str, str | None] = dict.fromkeys(
            (w for w, t in terms.items() if t is _UNKNOWN and w in STOPWORDS), None
        )
        learnt.update(zip(new, self._stemmer.stemWords(new), strict=True))
        if len(memo) + len(learnt) > MEMO_WORDS:
            memo.clear()
        memo.update(learnt)
        terms.update(learnt)
        return [terms[w] for w in words]  # no word is left unknown


_UNKNOWN: Any = object()


def _words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


# Qdrant's sparse vector indices are unsigned 32-bit integers.
INDEX_SPACE = 2**32


@lru_cache(maxsize=1 << 20)
def term_index(term: str) -> int:
    """The default sparse index of an analysed term: the first 4 bytes of its BLAKE2b digest
    (remembered: an ingest asks again for each chunk holding the term)."""
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
class BM25Stats:
    """What a version records of its BM25 (besides the document frequencies): the corpus size and
    length, the average length its document side was normalised with, the parameters, and the
    analysis and hashing schemes. Pure statistics: the IDF comes from the document frequencies.
    """

    n_docs: int
    total_terms: int
    avgdl: float
    k1: float = K1
    b: float = B
    epsilon: float = EPSILON
    tokenizer: str = TOKENIZER_NAME
    term_hash: str = TERM_HASH
    weighting: str = WEIGHTING
    # Vocabulary terms that moved off a hash shared with another term: term -> index.
    moved: Mapping[str, int] = field(default_factory=dict)

    @property
    def real_avgdl(self) -> float:
        """The average length of the corpus as it is now (after deltas)."""
        return self.total_terms / self.n_docs if self.n_docs else 0.0

    @property
    def drift(self) -> float:
        """How far the real average length moved from the one the documents were normalised with
        (0.02 = 2%)."""
        return abs(self.real_avgdl / self.avgdl - 1.0) if self.avgdl else 0.0

    def index_of(self, term: str) -> int:
        moved = self.moved.get(term)
        return term_index(term) if moved is None else moved

    def document_vector(self, terms: Sequence[str]) -> SparseVector:
        """Each distinct term's saturated, length-normalised frequency in this document, in
        rank-bm25's float64 expression (the IDF is the query's)."""
        k1, b = self.k1, self.b
        norm = k1 * (1 - b + b * len(terms) / self.avgdl)
        scale = k1 + 1
        index_of = self.index_of
        counts = {index_of(t): tf for t, tf in Counter(terms).items()}
        order = sorted(counts)
        return SparseVector(
            tuple(order), tuple(counts[i] * scale / (counts[i] + norm) for i in order)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "n_docs": self.n_docs,
            "total_terms": self.total_terms,
            "avgdl": self.avgdl,
            "k1": self.k1,
            "b": self.b,
            "epsilon": self.epsilon,
            "tokenizer": self.tokenizer,
            "term_hash": self.term_hash,
            "weighting": self.weighting,
            "moved": dict(self.moved),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BM25Stats:
        """Refuses statistics written under another tokenizer, hash or weighting scheme."""
        ours = {"tokenizer": TOKENIZER_NAME, "term_hash": TERM_HASH, "weighting": WEIGHTING}
        for key, expected in ours.items():
            if data.get(key) != expected:
                raise VersionIncompatible(
                    f"this version's BM25 was written with {key} {data.get(key)!r}, this "
                    f"rag-retriever uses {expected!r}; re-ingest the collection "
                    f"(rag-retriever ingest PATH --collection ALIAS --full)"
                )
        return cls(
            n_docs=int(data["n_docs"]),
            total_terms=int(data["total_terms"]),
            avgdl=float(data["avgdl"]),
            k1=float(data["k1"]),
            b=float(data["b"]),
            epsilon=float(data["epsilon"]),
            moved={str(k): int(v) for k, v in dict(data.get("moved") or {}).items()},
        )


def okapi_idf_of(df: int, n_docs: int) -> float:
    """Okapi IDF of a term in `df` of `n_docs` documents, in rank-bm25's expression (negative for
    a term in more than half of them: see `floor_idf`)."""
    return math.log(n_docs - df + 0.5) - math.log(df + 0.5)


def floor_idf(histogram: Mapping[int, int], n_docs: int, epsilon: float) -> float:
    """rank-bm25's IDF for a term in more than half of the documents: `epsilon` times the average
    IDF over the vocabulary, from the histogram of document frequencies (df -> number of terms),
    so it costs the number of distinct frequencies (thousands), not the vocabulary (millions)."""
    terms = sum(histogram.values())
    if not terms:
        return 0.0
    df = np.fromiter(histogram.keys(), dtype=np.float64, count=len(histogram))
    count = np.fromiter(histogram.values(), dtype=np.float64, count=len(histogram))
    idf = np.log(n_docs - df + 0.5) - np.log(df + 0.5)
    return epsilon * float(count @ idf) / terms


def okapi_idf(doc_freqs: Mapping[str, int], n_docs: int, epsilon: float) -> dict[str, float]:
    """Every term's Okapi IDF as rank-bm25 computes it (`okapi_idf_of`, and `floor_idf` for a
    term whose IDF is negative). For tests and offline jobs: a query needs its terms' only."""
    terms = dict(doc_freqs.items())  # one pass over a layered table
    floor = floor_idf(Counter(terms.values()), n_docs, epsilon)
    idf = {t: okapi_idf_of(n, n_docs) for t, n in terms.items()}
    return {t: floor if value < 0 else value for t, value in idf.items()}


class TermTable(Protocol):
    """An immutable term -> document frequency table that a version's `DocFreqs` are layered
    on, read term by term: a delta looks up only the terms it touches."""

    def __len__(self) -> int: ...

    def lookup(self, terms: Collection[str]) -> dict[str, int]:
        """The frequencies of those of `terms` the table holds."""
        ...

    def holders(self, hashes: Collection[int]) -> dict[int, list[str]]:
        """The table's terms whose `term_index` is one of `hashes` (hash -> terms)."""
        ...

    def items(self) -> Iterator[tuple[str, int]]: ...

    def histogram(self) -> dict[int, int]:
        """Document frequency -> how many of the table's terms have it."""
        ...


class DictTable:
    """A `TermTable` in memory (a full build's frequencies, or a store's that keeps them whole)."""

    def __init__(self, doc_freqs: Mapping[str, int]) -> None:
        self._terms = dict(doc_freqs)

    def __len__(self) -> int:
        return len(self._terms)

    def lookup(self, terms: Collection[str]) -> dict[str, int]:
        return {t: self._terms[t] for t in terms if t in self._terms}

    def holders(self, hashes: Collection[int]) -> dict[int, list[str]]:
        wanted = set(hashes)
        out: dict[int, list[str]] = {}
        for term in self._terms:  # every term hashed: O(vocabulary), as a table in memory is
            index = term_index(term)
            if index in wanted:
                out.setdefault(index, []).append(term)
        return out

    def items(self) -> Iterator[tuple[str, int]]:
        return iter(self._terms.items())

    def histogram(self) -> dict[int, int]:
        return dict(Counter(self._terms.values()))


class DocFreqs(Mapping[str, int]):
    """A version's document frequencies: a `TermTable` (written at a full build, shared by the
    versions made from it by deltas) and the `changes` since it (term -> frequency now, 0 = no
    longer in any document). A delta reads and writes what it touches, not the vocabulary; so
    does a query, which needs its terms' frequencies and the `histogram` (for the IDF floor)."""

    def __init__(
        self,
        base: TermTable,
        changes: Mapping[str, int] | None = None,
        size: int | None = None,
        histogram: Mapping[int, int] | None = None,
    ) -> None:
        self.base = base
        self.changes = dict(changes or {})
        if size is None:
            held = base.lookup(self.changes)
            size = len(base) + sum((n > 0) - (t in held) for t, n in self.changes.items())
        self.size = size
        if histogram is not None:
            self.__dict__["histogram"] = dict(histogram)

    @cached_property
    def histogram(self) -> dict[int, int]:
        """Document frequency -> how many terms have it (the table's, with the changes)."""
        held = self.base.lookup(self.changes)
        return _moved(self.base.histogram(), held, self.changes)

    def __getitem__(self, term: str) -> int:
        n = self.lookup((term,)).get(term)
        if n is None:
            raise KeyError(term)
        return n

    def lookup(self, terms: Collection[str]) -> dict[str, int]:
        """The frequencies of those of `terms` some document holds."""
        out = self.base.lookup([t for t in terms if t not in self.changes])
        out.update((t, self.changes[t]) for t in terms if self.changes.get(t))
        return out

    def items(self) -> Iterator[tuple[str, int]]:  # type: ignore[override]
        changes = self.changes
        for term, n in self.base.items():
            if term not in changes:
                yield term, n
        yield from ((t, n) for t, n in changes.items() if n)

    def __iter__(self) -> Iterator[str]:
        return (term for term, _ in self.items())

    def __len__(self) -> int:
        return self.size

    def changed(self, now: Mapping[str, int], before: Mapping[str, int]) -> DocFreqs:
        """These frequencies with `now` (term -> frequency, 0 = gone) applied; `before` = the
        frequencies here of those of its terms that some document held."""
        size = self.size + sum((n > 0) - (t in before) for t, n in now.items())
        histogram = _moved(self.histogram, before, now)
        return DocFreqs(self.base, {**self.changes, **now}, size, histogram)


def _moved(
    histogram: Mapping[int, int], before: Mapping[str, int], now: Mapping[str, int]
) -> dict[int, int]:
    """`histogram` after the terms of `now` went from their `before` frequency (absent: none)
    to their `now` one (0: none)."""
    out = dict(histogram)
    for term, n in now.items():
        for df, step in ((before.get(term, 0), -1), (n, 1)):
            if df:
                out[df] = out.get(df, 0) + step
                if not out[df]:
                    del out[df]
    return out


def as_doc_freqs(doc_freqs: Mapping[str, int]) -> DocFreqs:
    return doc_freqs if isinstance(doc_freqs, DocFreqs) else DocFreqs(DictTable(doc_freqs))


class BM25Counts:
    """A corpus's BM25 counts, one document at a time (`add`), for a model once it is all seen
    (`model`): what a full build keeps while its chunks stream past, the vocabulary's document
    frequencies and two totals, not the documents."""

    def __init__(self) -> None:
        self.doc_freq: dict[str, int] = {}  # first-occurrence order, as rank-bm25's `nd`
        self.n_docs = 0
        self.total = 0

    def add(self, document: Sequence[str]) -> None:
        self.n_docs += 1
        self.total += len(document)
        doc_freq = self.doc_freq
        for word in dict.fromkeys(document):
            doc_freq[word] = doc_freq.get(word, 0) + 1

    def model(self, *, k1: float = K1, b: float = B, epsilon: float = EPSILON) -> BM25Model:
        if self.n_docs == 0:
            raise DocumentError("cannot build BM25 over zero documents")
        if self.total == 0:
            raise DocumentError(
                "cannot build BM25: no document has a searchable term (only stop words, "
                "punctuation or nothing)"
            )
        stats = BM25Stats(
            n_docs=self.n_docs,
            total_terms=self.total,
            # rank-bm25: avgdl = num_doc / corpus_size with an integer numerator.
            avgdl=self.total / self.n_docs,
            k1=k1,
            b=b,
            epsilon=epsilon,
            moved=_place_new_terms(lambda _: set(), {}, self.doc_freq),
        )
        return BM25Model(stats, self.doc_freq)


@dataclass(frozen=True)
class BM25Model:
    """One version's BM25: its statistics and document frequencies, and the IDF derived from them.

    Built from a corpus (`build`), changed by a delta (`with_delta`: documents added and removed,
    the average length kept), or read back from a version (`BM25Model(stats, doc_freqs)`).
    """

    stats: BM25Stats
    doc_freqs: Mapping[str, int] = field(repr=False, compare=False)  # held as a DocFreqs

    def __post_init__(self) -> None:
        object.__setattr__(self, "doc_freqs", as_doc_freqs(self.doc_freqs))

    @cached_property
    def idf(self) -> Mapping[str, float]:
        """Every term's IDF (tests and offline jobs; a query reads its own terms' only)."""
        return okapi_idf(self.doc_freqs, self.stats.n_docs, self.stats.epsilon)

    @cached_property
    def idf_floor(self) -> float:
        """The IDF of a term in more than half of the documents (see `floor_idf`)."""
        doc_freqs = as_doc_freqs(self.doc_freqs)
        return floor_idf(doc_freqs.histogram, self.stats.n_docs, self.stats.epsilon)

    def idf_of(self, terms: Collection[str]) -> dict[str, float]:
        """The IDF of those of `terms` some document holds: their frequencies are looked up, so
        opening a version for queries reads no vocabulary (a 2M-term one took 3.0-5.9 s to open
        with every IDF computed up front; README, "Incremental versions")."""
        found = as_doc_freqs(self.doc_freqs).lookup(terms)
        idf = {t: okapi_idf_of(n, self.stats.n_docs) for t, n in found.items()}
        return {t: self.idf_floor if value < 0 else value for t, value in idf.items()}

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
        counts = BM25Counts()
        for document in corpus:
            counts.add(document)
        return counts.model(k1=k1, b=b, epsilon=epsilon)

    def with_delta(
        self, added: Iterable[Sequence[str]], removed: Iterable[Sequence[str]]
    ) -> BM25Model:
        """This model after documents were added and removed (each a list of terms); the average
        length the documents are normalised with stays the lineage's. Reads and writes the
        frequencies of the terms the delta touches only (and who holds the indices new terms
        would take), not the whole vocabulary."""
        step: Counter[str] = Counter()
        n_docs, total = self.stats.n_docs, self.stats.total_terms
        for document in removed:
            n_docs -= 1
            total -= len(document)
            step.subtract(set(document))
        for document in added:
            n_docs += 1
            total += len(document)
            step.update(set(document))
        if n_docs <= 0:
            raise UpdateRefused(
                "a version cannot be left with zero documents: keep at least one, or ingest "
                "the new corpus whole"
            )
        doc_freqs = as_doc_freqs(self.doc_freqs)
        before = doc_freqs.lookup(list(step))
        now = {t: before.get(t, 0) + n for t, n in step.items() if n}
        wrong = sorted(t for t, n in now.items() if n < 0)
        if wrong:
            raise ValueError(f"removed documents hold terms the version does not: {wrong[:5]}")
        leaving = {t for t, n in now.items() if n == 0}
        entering = [t for t, n in now.items() if n > 0 and t not in before]
        moved = {t: i for t, i in self.stats.moved.items() if t not in leaving}
        stats = self.stats
        changes = doc_freqs.changes
        # the indices the terms changed since the base table that stay hold (O(changes), so
        # only when a term enters)
        changed_held = (
            {stats.index_of(t) for t, n in changes.items() if n and t not in leaving}
            if entering
            else set()
        )

        def held(indices: Collection[int]) -> set[int]:
            """Of `indices`, those a term staying in the vocabulary holds by its hash (a moved
            term holds `moved`'s index instead, which `_place_new_terms` counts)."""
            out = {
                index
                for index, terms in doc_freqs.base.holders(indices).items()
                if any(t not in changes and t not in leaving and t not in moved for t in terms)
            }
            return out | (changed_held & set(indices))

        moved.update(_place_new_terms(held, moved, entering))
        new_stats = replace(stats, n_docs=n_docs, total_terms=total, moved=moved)
        return BM25Model(new_stats, doc_freqs.changed(now, before))

    def rebased(self) -> BM25Model:
        """The same corpus normalised with its real average length (a full build's)."""
        return BM25Model(replace(self.stats, avgdl=self.stats.real_avgdl), self.doc_freqs)

    def index_of(self, term: str) -> int:
        return self.stats.index_of(term)

    def document_vector(self, terms: Sequence[str]) -> SparseVector:
        return self.stats.document_vector(terms)

    def query_vector(self, terms: Sequence[str]) -> SparseVector:
        """Each query term's count x its IDF (rank-bm25 adds a repeated term again). A term of no
        document adds nothing and is left out; a term whose IDF is 0 (in half the documents) is
        kept with weight 0, so the documents holding it still come back, last, as before."""
        weights: dict[int, float] = {}
        idfs = self.idf_of(set(terms))
        for term in terms:
            idf = idfs.get(term)
            if idf is not None:
                index = self.stats.index_of(term)
                weights[index] = weights.get(index, 0.0) + idf
        return _sorted_vector(weights)


def _place_new_terms(
    held: Callable[[Collection[int]], set[int]],
    moved: Mapping[str, int],
    new_terms: Iterable[str],
) -> dict[str, int]:
    """Indices for terms entering a vocabulary: each new term (in sorted order) takes its hash,
    or the next free index when that is taken. `held(indices)` = those of `indices` a term of the
    vocabulary holds by its hash; `moved` = the terms that hold another index. Returns the new
    terms that moved."""
    wanted = {t: term_index(t) for t in new_terms}
    owner = set(moved.values()) | held(set(wanted.values()))
    placed: dict[str, int] = {}
    clashing: list[str] = []
    for term in sorted(wanted):
        if wanted[term] in owner:
            clashing.append(term)
        else:
            owner.add(wanted[term])
    for term in clashing:
        index = wanted[term]
        while index in owner or held((index,)):
            index = (index + 1) % INDEX_SPACE
        owner.add(index)
        placed[term] = index
    return placed
