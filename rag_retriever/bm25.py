"""BM25 (Okapi, exactly as rank-bm25 scores it) over an inverted index, plus its tokenizer.

Example:
    >>> tok = Tokenizer()
    >>> texts = ["red apples", "green pears", "red wine"]
    >>> index = BM25Index.build([tok.tokenize(t) for t in texts])
    >>> [int(i) for i in index.top_k(tok.tokenize("red"), 2).indices]
    [0, 2]

`rank_bm25.BM25Okapi.get_scores` walks every document for every query term in Python (~300 ms
at 100k chunks). Here each term keeps a posting list of (document, precomputed term score), so
a query only touches documents that contain one of its terms. The term scores are computed with
the same float64 expression, in the same order, as rank-bm25 (idf floor `epsilon * average_idf`
included), and the per-document sums add terms in query order, so scores are bit-identical to
`get_scores` (a test checks this on a real corpus). Documents that contain no query term are not
returned (their score is 0 in rank-bm25 too).

Tokenizer `en-snowball-v1`: NFKC, lower-case, `\\w+` words, an English stop-word list, Snowball
English stemming (PyStemmer). The same tokenizer is used at ingest and at query time; its name is
stored with each index and checked on load. It does not handle CJK word segmentation.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import Stemmer

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


@dataclass(frozen=True)
class TopK:
    indices: np.ndarray  # int64 document indices, best first
    scores: np.ndarray  # float64 BM25 scores


class BM25Index:
    """An inverted index with rank-bm25's Okapi scores precomputed per posting."""

    def __init__(
        self,
        *,
        vocab: list[str],
        indptr: np.ndarray,
        postings: np.ndarray,
        impacts: np.ndarray,
        doc_len: np.ndarray,
        idf: np.ndarray,
        avgdl: float,
        average_idf: float,
        k1: float = K1,
        b: float = B,
        epsilon: float = EPSILON,
        tokenizer: str = TOKENIZER_NAME,
    ) -> None:
        self.vocab = vocab
        self.term_ids = {t: i for i, t in enumerate(vocab)}
        self.indptr = indptr
        self.postings = postings
        self.impacts = impacts
        self.doc_len = doc_len
        self.idf = idf
        self.avgdl = avgdl
        self.average_idf = average_idf
        self.k1, self.b, self.epsilon = k1, b, epsilon
        self.tokenizer = tokenizer

    @property
    def n_docs(self) -> int:
        return len(self.doc_len)

    @classmethod
    def build(
        cls,
        corpus: Sequence[Sequence[str]],
        *,
        k1: float = K1,
        b: float = B,
        epsilon: float = EPSILON,
        tokenizer: str = TOKENIZER_NAME,
    ) -> BM25Index:
        """Index tokenised documents; replicates rank_bm25.BM25Okapi's statistics exactly."""
        if not corpus:
            raise ValueError("cannot build a BM25 index over zero documents")
        term_ids: dict[str, int] = {}
        doc_freq: list[int] = []
        rows: list[np.ndarray] = []
        docs: list[np.ndarray] = []
        tfs: list[np.ndarray] = []
        doc_len = np.fromiter((len(d) for d in corpus), dtype=np.int64, count=len(corpus))
        for d, document in enumerate(corpus):
            # Counter keeps first-occurrence order, as rank-bm25's `frequencies` dict does;
            # the vocabulary order (and so the float sum behind average_idf) follows from it.
            freqs = Counter(document)
            ids = np.empty(len(freqs), dtype=np.int64)
            for k, word in enumerate(freqs):
                tid = term_ids.get(word)
                if tid is None:
                    tid = term_ids[word] = len(doc_freq)
                    doc_freq.append(0)
                doc_freq[tid] += 1
                ids[k] = tid
            rows.append(ids)
            docs.append(np.full(len(freqs), d, dtype=np.int64))
            tfs.append(np.fromiter(freqs.values(), dtype=np.int64, count=len(freqs)))
        n_docs = len(corpus)
        # rank-bm25: avgdl = num_doc / corpus_size with an integer numerator.
        avgdl = int(doc_len.sum()) / n_docs
        idf = np.empty(len(doc_freq), dtype=np.float64)
        idf_sum = 0.0
        negative = []
        for tid, freq in enumerate(doc_freq):
            value = math.log(n_docs - freq + 0.5) - math.log(freq + 0.5)
            idf[tid] = value
            idf_sum += value
            if value < 0:
                negative.append(tid)
        average_idf = idf_sum / len(doc_freq)
        idf[negative] = epsilon * average_idf

        term = np.concatenate(rows)
        doc = np.concatenate(docs)
        tf = np.concatenate(tfs)
        order = np.lexsort((doc, term))  # postings grouped by term, documents ascending
        term, doc, tf = term[order], doc[order], tf[order]
        indptr = np.zeros(len(doc_freq) + 1, dtype=np.int64)
        np.cumsum(np.bincount(term, minlength=len(doc_freq)), out=indptr[1:])
        dl = doc_len[doc]
        # The exact expression of BM25Okapi.get_scores, evaluated once per posting.
        impacts = idf[term] * (tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)))
        vocab = [""] * len(term_ids)
        for word, tid in term_ids.items():
            vocab[tid] = word
        return cls(
            vocab=vocab,
            indptr=indptr,
            postings=doc.astype(np.int32 if n_docs < 2**31 else np.int64),
            impacts=impacts,
            doc_len=doc_len,
            idf=idf,
            avgdl=avgdl,
            average_idf=average_idf,
            k1=k1,
            b=b,
            epsilon=epsilon,
            tokenizer=tokenizer,
        )

    # -- scoring ----------------------------------------------------------------------------

    def _accumulate(self, query: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        scores = np.zeros(self.n_docs, dtype=np.float64)
        touched = np.zeros(self.n_docs, dtype=bool)
        # Terms are added in query order, repeats included, as rank-bm25 does.
        for word in query:
            tid = self.term_ids.get(word)
            if tid is None:
                continue
            lo, hi = self.indptr[tid], self.indptr[tid + 1]
            ids = self.postings[lo:hi]
            scores[ids] += self.impacts[lo:hi]
            touched[ids] = True
        return scores, touched

    def scores(self, query: Sequence[str]) -> np.ndarray:
        """Scores of every document, equal to rank_bm25.BM25Okapi(corpus).get_scores(query)."""
        return self._accumulate(query)[0]

    def top_k(self, query: Sequence[str], k: int, mask: np.ndarray | None = None) -> TopK:
        """The k best documents containing a query term, ties broken by document index.

        `mask` (bool, one per document) restricts the candidates, e.g. to a metadata filter.
        """
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        scores, touched = self._accumulate(query)
        if mask is not None:
            touched &= mask
        candidates = np.flatnonzero(touched)
        if len(candidates) > k:
            values = scores[candidates]
            kth = np.partition(values, len(values) - k)[len(values) - k]
            candidates = candidates[values >= kth]
        order = np.lexsort((candidates, -scores[candidates]))[:k]
        best = candidates[order]
        return TopK(best.astype(np.int64), scores[best])

    def matched_terms(self, query: Sequence[str], doc: int) -> list[str]:
        """The query terms (index form) that occur in document `doc`, in query order."""
        found = []
        for word in dict.fromkeys(query):
            tid = self.term_ids.get(word)
            if tid is None:
                continue
            ids = self.postings[self.indptr[tid] : self.indptr[tid + 1]]
            pos = int(np.searchsorted(ids, doc))
            if pos < len(ids) and ids[pos] == doc:
                found.append(word)
        return found

    # -- persistence ------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(
            directory / "bm25.npz",
            indptr=self.indptr,
            postings=self.postings,
            impacts=self.impacts,
            doc_len=self.doc_len,
            idf=self.idf,
        )
        meta = {
            "tokenizer": self.tokenizer,
            "k1": self.k1,
            "b": self.b,
            "epsilon": self.epsilon,
            "avgdl": self.avgdl,
            "average_idf": self.average_idf,
            "vocab": self.vocab,
        }
        (directory / "bm25.json").write_text(json.dumps(meta), encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> BM25Index:
        meta = json.loads((directory / "bm25.json").read_text(encoding="utf-8"))
        if meta["tokenizer"] != TOKENIZER_NAME:
            raise ValueError(
                f"BM25 index in {directory} was built with tokenizer {meta['tokenizer']!r}, "
                f"this version uses {TOKENIZER_NAME!r}; rebuild it by re-ingesting"
            )
        arrays = np.load(directory / "bm25.npz")
        return cls(
            vocab=list(meta["vocab"]),
            indptr=arrays["indptr"],
            postings=arrays["postings"],
            impacts=arrays["impacts"],
            doc_len=arrays["doc_len"],
            idf=arrays["idf"],
            avgdl=float(meta["avgdl"]),
            average_idf=float(meta["average_idf"]),
            k1=float(meta["k1"]),
            b=float(meta["b"]),
            epsilon=float(meta["epsilon"]),
            tokenizer=str(meta["tokenizer"]),
        )
