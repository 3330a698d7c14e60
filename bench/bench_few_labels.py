"""What else a few hundred labelled questions could buy on SciFact, beside fine-tuning the
embedder (issue 21, item 7): three cheap ways to use them, each judged as `improve` judges, on
claims about abstracts never trained on.

Usage:
    python -m bench.bench_few_labels [--out bench-out] [--folds 4]

SciFact's 809 training claims are split by document into `--folds` folds (seed 0, the learning
curve's folds); each way is fitted on the other folds' claims and judged on the fold's claims at
document level: nDCG@10 of the dense list and of the hybrid list (the version's fusion), next to
the stock model's on the same claims, from the same BM25 lists:

- `adapter`: a linear map added to the query vector (q + qW), fitted by a softmax over every
  chunk of the corpus towards each claim's best gold chunk (its other gold chunks masked), with
  weight decay `lam`. The passages keep their vectors: nothing is re-encoded.
- `prf`: needs no labels (they would only choose `k` and `alpha`): the query vector moved
  towards the mean vector of its first `k` hybrid hits (Rocchio), searched and fused again.
- `ltr`: a linear learning-to-rank of the fused top 50, fitted with a listwise softmax loss
  (any chunk of a gold document is relevant) on 12 features per chunk: the fused, dense and BM25
  scores and ranks, the share of the claim's terms in the chunk and in its title, whether it is
  its document's first chunk, and its document's best dense and BM25 scores and number of
  chunks in each list's top 20.

The dense lists are exact (every chunk scored), the stock model's too, so the comparison is like
for like. Results go to `<out>/few_labels.json`; the printed table is the mean over folds.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.bench_common import shared_path
from rag_retriever.eval.metrics import ndcg_at_k
from rag_retriever.eval.questions import Question, load_questions
from rag_retriever.ingest.loaders import load_documents
from rag_retriever.ingest.writer import ingest_documents
from rag_retriever.query.fusion import Fusion
from rag_retriever.query.retriever import Retriever
from rag_retriever.settings import Settings
from rag_retriever.training.folds import folds_by_document

ALIAS = "scifact"
DEPTH = 100  # each list's depth (the retriever's default)
TEMPERATURE = 0.05  # train-embedder's
LTR_CANDIDATES = 50
ADAPTER_DECAY = (0.01, 0.1)
PRF = ((1, 0.7), (3, 0.7), (5, 0.3))  # (k, alpha)
LTR_DECAY = (0.0, 0.1)
log = logging.getLogger("bench.few_labels")

Ranked = list[tuple[str, float]]


@dataclass
class SciFact:
    """The corpus' chunk vectors, the claims' vectors, BM25 lists and gold documents, and the
    version's fusion: every ranking below is made from these."""

    claims: list[Question]
    chunk_ids: list[str]
    doc_of: dict[str, str]
    first_chunk: set[str]
    vectors: np.ndarray  # one unit row per chunk
    chunk_terms: dict[str, set[str]]
    title_terms: dict[str, set[str]]  # per document
    queries: np.ndarray  # one unit row per claim
    query_terms: list[set[str]]
    bm25: list[Ranked]
    gold: list[set[str]]
    fusion: Fusion

    def dense(self, queries: np.ndarray) -> list[Ranked]:
        scores = queries @ self.vectors.T
        top = np.argsort(-scores, axis=1, kind="stable")[:, :DEPTH]
        return [
            [(self.chunk_ids[j], float(scores[i, j])) for j in row] for i, row in enumerate(top)
        ]

    def fused(self, dense: Sequence[Ranked], rows: Sequence[int]) -> list[Ranked]:
        return [self.fusion.fuse(d, self.bm25[i]) for d, i in zip(dense, rows, strict=True)]

    def search(self, queries: np.ndarray, rows: Sequence[int]) -> tuple[list[Ranked], list[Ranked]]:
        """The dense and fused lists of claims `rows` searched with `queries` (made unit length)
        in place of their own vectors."""
        dense = self.dense(queries / np.linalg.norm(queries, axis=1, keepdims=True))
        return dense, self.fused(dense, rows)

    def ndcg(self, rankings: Sequence[Ranked], rows: Sequence[int]) -> float:
        return float(
            np.mean(
                [
                    ndcg_at_k([self.doc_of[c] for c, _ in ranked], [{d} for d in self.gold[i]], 10)
                    for ranked, i in zip(rankings, rows, strict=True)
                ]
            )
        )


def load(settings: Settings) -> SciFact:
    retriever = Retriever.from_settings(settings.replace(rerank_model=None), mode="hybrid")
    if ALIAS not in retriever.store.aliases():
        ingest_documents(
            load_documents(shared_path("scifact", "docs.jsonl")),
            alias=ALIAS,
            encoder=retriever.encoder,
            store=retriever.store,
        )
    claims = load_questions(shared_path("scifact", "questions_train.jsonl"))[0]
    opened = retriever.open_collection(ALIAS)
    store, name, tokenize = retriever.store, opened.name, retriever.tokenizer.tokenize
    ids = sorted(r.id for r in store.scroll(name))
    chunks = retriever.chunks(name, ids)
    vectors = {
        r.id: r.dense
        for r in store.retrieve(name, ids, with_dense=True, with_payload=False)
        if r.dense is not None
    }
    _, traces = retriever.trace([c.question for c in claims], mode="bm25", collection=ALIAS)
    data = SciFact(
        claims=claims,
        chunk_ids=ids,
        doc_of={i: chunks[i].doc_id for i in ids},
        first_chunk={i for i in ids if chunks[i].chunk_index == 0},
        vectors=np.stack([vectors[i] for i in ids]).astype(np.float32),
        chunk_terms={i: set(tokenize(chunks[i].embed_text)) for i in ids},
        title_terms={chunks[i].doc_id: set(tokenize(chunks[i].title)) for i in ids},
        queries=retriever.encoder.encode_queries([c.question for c in claims]).vectors,
        query_terms=[set(tokenize(c.question)) for c in claims],
        bm25=[[(cid, s.score) for cid, s in t.bm25 or []] for t in traces],
        gold=[set(c.gold_doc_ids) for c in claims],
        fusion=retriever.fusion_for(opened),
    )
    store.close()
    return data


def fit_adapter(data: SciFact, train: Sequence[int], decay: float, steps: int = 100) -> np.ndarray:
    """W of q + qW, fitted on the training claims (module docstring)."""
    docs = np.array([data.doc_of[c] for c in data.chunk_ids])
    x = torch.from_numpy(data.queries[list(train)])
    corpus = torch.from_numpy(data.vectors)
    gold = torch.from_numpy(np.stack([np.isin(docs, list(data.gold[i])) for i in train]))
    positive = (x @ corpus.T).masked_fill(~gold, -2.0).argmax(dim=1)
    other_gold = gold.clone()
    other_gold[torch.arange(len(train)), positive] = False
    w = torch.zeros(x.shape[1], x.shape[1], requires_grad=True)
    optimizer = torch.optim.Adam([w], lr=1e-3)
    for _ in range(steps):
        moved = torch.nn.functional.normalize(x + x @ w, dim=-1)
        logits = (moved @ corpus.T / TEMPERATURE).masked_fill(other_gold, -1e4)
        loss = torch.nn.functional.cross_entropy(logits, positive) + decay * (w**2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return w.detach().numpy()


def moved_towards(
    data: SciFact, rows: Sequence[int], hits: Sequence[Ranked], k: int, alpha: float
) -> np.ndarray:
    """Rocchio: each claim's vector plus `alpha` times the mean vector of its first `k` hits."""
    row = {cid: i for i, cid in enumerate(data.chunk_ids)}
    centroid = np.stack(
        [data.vectors[[row[c] for c, _ in ranked[:k]]].mean(axis=0) for ranked in hits]
    )
    return data.queries[list(rows)] + alpha * centroid


def features(data: SciFact, i: int, dense: Ranked, fused: Ranked) -> np.ndarray:
    """The 12 features (module docstring) of claim `i`'s fused top LTR_CANDIDATES."""
    bm25 = data.bm25[i]
    d_rank = {c: (r, s) for r, (c, s) in enumerate(dense, start=1)}
    b_rank = {c: (r, s) for r, (c, s) in enumerate(bm25, start=1)}
    d_top, d_low = dense[0][1], dense[-1][1]
    b_top = bm25[0][1] if bm25 else 1.0
    doc_dense: dict[str, float] = {}
    doc_bm25: dict[str, float] = {}
    n_dense: dict[str, int] = {}
    n_bm25: dict[str, int] = {}
    for ranked, best, count in ((dense, doc_dense, n_dense), (bm25, doc_bm25, n_bm25)):
        for c, s in ranked[:20]:
            doc = data.doc_of[c]
            best[doc] = max(best.get(doc, s), s)
            count[doc] = count.get(doc, 0) + 1
    terms = data.query_terms[i] or {""}
    rows = []
    for rank, (c, _) in enumerate(fused[:LTR_CANDIDATES], start=1):
        doc = data.doc_of[c]
        dr, ds = d_rank.get(c, (2 * DEPTH, d_low))
        br, bs = b_rank.get(c, (2 * DEPTH, 0.0))
        rows.append(
            [
                1 / (60 + rank),
                ds - d_top,
                bs / b_top,
                1 / (10 + dr),
                1 / (10 + br),
                len(terms & data.chunk_terms[c]) / len(terms),
                len(terms & data.title_terms[doc]) / len(terms),
                float(c in data.first_chunk),
                doc_dense.get(doc, d_low) - d_top,
                doc_bm25.get(doc, 0.0) / b_top,
                n_dense.get(doc, 0) / 5,
                n_bm25.get(doc, 0) / 5,
            ]
        )
    return np.array(rows, dtype=np.float32)


def fit_ltr(
    data: SciFact,
    train: Sequence[int],
    dense: Sequence[Ranked],
    fused: Sequence[Ranked],
    decay: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, mean, std) of a linear scorer over standardised features (module docstring)."""
    xs = [features(data, i, dense[i], fused[i]) for i in train]
    stacked = np.concatenate(xs)
    mean, std = stacked.mean(axis=0), stacked.std(axis=0) + 1e-6
    lists = []
    for i, x in zip(train, xs, strict=True):
        relevant = torch.tensor(
            [data.doc_of[c] in data.gold[i] for c, _ in fused[i][:LTR_CANDIDATES]]
        )
        if relevant.any():
            lists.append((torch.from_numpy((x - mean) / std), relevant))
    w = torch.zeros(stacked.shape[1])
    w[0] = 1.0  # start from the fused order
    w.requires_grad_(True)
    optimizer = torch.optim.Adam([w], lr=0.05)
    for _ in range(300):
        loss = sum(
            torch.logsumexp(x @ w, 0) - torch.logsumexp((x @ w)[relevant], 0)
            for x, relevant in lists
        )
        loss = loss / len(lists) + decay * (w**2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return w.detach().numpy(), mean, std


def reordered(
    data: SciFact, i: int, dense: Ranked, fused: Ranked, model: tuple[np.ndarray, ...]
) -> Ranked:
    w, mean, std = model
    scores = ((features(data, i, dense, fused) - mean) / std) @ w
    head = fused[:LTR_CANDIDATES]
    return [head[j] for j in np.argsort(-scores, kind="stable")] + fused[LTR_CANDIDATES:]


def measure(data: SciFact, folds: int) -> list[dict[str, Any]]:
    n = len(data.gold)
    stock_dense = data.dense(data.queries)
    stock_fused = data.fused(stock_dense, range(n))
    position = {c.id: i for i, c in enumerate(data.claims)}
    out = []
    for f, held in enumerate(folds_by_document(data.claims, folds, seed=0)):
        test = [position[c.id] for c in held]
        train = sorted(set(range(n)) - set(test))

        def judged(
            dense: Sequence[Ranked], fused: Sequence[Ranked], test: list[int] = test
        ) -> dict[str, float]:
            return {
                "dense": round(data.ndcg(dense, test), 4),
                "hybrid": round(data.ndcg(fused, test), 4),
            }

        fold: dict[str, Any] = {
            "claims": len(test),
            "stock": judged([stock_dense[i] for i in test], [stock_fused[i] for i in test]),
        }
        for decay in ADAPTER_DECAY:
            w = fit_adapter(data, train, decay)
            q = data.queries[test]
            fold[f"adapter, lam {decay}"] = judged(*data.search(q + q @ w, test))
        for k, alpha in PRF:
            moved = moved_towards(data, test, [stock_fused[i] for i in test], k, alpha)
            fold[f"prf, k {k}, alpha {alpha}"] = judged(*data.search(moved, test))
        for decay in LTR_DECAY:
            model = fit_ltr(data, train, stock_dense, stock_fused, decay)
            fused = [reordered(data, i, stock_dense[i], stock_fused[i], model) for i in test]
            fold[f"ltr, lam {decay}"] = {
                "dense": fold["stock"]["dense"],
                "hybrid": round(data.ndcg(fused, test), 4),
            }
        log.warning("fold %d of %d: %s", f + 1, folds, fold)
        out.append(fold)
    return out


def run(out: Path, folds: int = 4) -> list[dict[str, Any]]:
    """Every way on every fold; SciFact is ingested under `<out>/few-labels-data` on the first
    run and reused after."""
    torch.manual_seed(0)
    settings = Settings.from_env(data_dir=out / "few-labels-data", collection=ALIAS)
    results = measure(load(settings), folds)
    (out / "few_labels.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def report(folds: Sequence[dict[str, Any]]) -> list[str]:
    """Mean nDCG@10 over folds per way, against stock (the peer, measured in the same run)."""
    stock = {m: float(np.mean([f["stock"][m] for f in folds])) for m in ("dense", "hybrid")}
    lines = [
        f"SciFact train, {len(folds)} folds by document, nDCG@10 at document level (mean over folds)",
        f"  {'way':<24} {'dense':>8} {'vs stock':>9} {'hybrid':>8} {'vs stock':>9}",
    ]
    for way in folds[0]:
        if way == "claims":
            continue
        mean = {m: float(np.mean([f[way][m] for f in folds])) for m in ("dense", "hybrid")}
        lines.append(
            f"  {way:<24} {mean['dense']:>8.4f} {mean['dense'] - stock['dense']:>+9.4f} "
            f"{mean['hybrid']:>8.4f} {mean['hybrid'] - stock['hybrid']:>+9.4f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_few_labels", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--folds", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    print("\n".join(report(run(args.out, args.folds))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
