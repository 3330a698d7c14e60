"""Cross-encoder reranking: score (query, chunk) pairs jointly and reorder the candidates.

Example:
    >>> reranker = CrossEncoderReranker.load("models/my-reranker")       # doctest: +SKIP
    >>> reranker.score("who ruled Normandy?", ["Rollo ...", "Alps ..."]).scores  # doctest: +SKIP
    array([ 4.1, -3.2], dtype=float32)

The model is any `AutoModelForSequenceClassification` with one logit (its score) or two (the
positive class's log-odds, label 1's logit minus label 0's). Each pair is tokenised once; pairs are scored in batches sorted by
token length (to cut padding), on CUDA with fp16 weights when present (the scores stay on the
device until one copy at the end), else on the CPU (bf16 autocast where the CPU has native bf16).
Pairs longer than `max_length` are truncated on the chunk side and counted. The scores only
order candidates of one query; they are not probabilities and not comparable across queries.

`Scorer` is the one-method protocol the retriever needs, so a test can plug in an oracle.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch
import transformers

from rag_retriever.errors import ModelLoadError
from rag_retriever.models.device import (
    AUTO_RERANK_BATCH_SIZE,
    Precision,
    batch_size_for,
    choose_precision,
    for_inference,
    forward,
)
from rag_retriever.models.encoder import Tokens, tokenize_once
from rag_retriever.models.hub import model_directory
from rag_retriever.models.profiles import looks_like_path
from rag_retriever.models.quiet import quiet_transformers
from rag_retriever.settings import Settings

if TYPE_CHECKING:  # the record is the store's; only its type is needed here
    from rag_retriever.store.record import VersionRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairScores:
    scores: np.ndarray  # float32, one per passage, in input order
    truncated: int  # pairs whose passage was cut to fit max_length


class Scorer(Protocol):
    """Scores passages against one query; higher is more relevant."""

    def score(self, query: str, passages: Sequence[str]) -> PairScores: ...


def _check_is_classifier(source: str, directory: Path) -> int:
    """The number of labels, or a ModelLoadError if `source` (read from `directory`) is not a
    sequence classifier."""
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load reranker {source!r}: {exc}. Set RAG_RERANK_MODEL to a local directory "
            f"or a hub id, or unset it to turn reranking off."
        ) from None
    architectures = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ModelLoadError(
            f"reranker {source!r} is not a sequence-classification model (architectures: "
            f"{architectures or 'none'}); a cross-encoder must be saved as "
            f"*ForSequenceClassification with 1 or 2 labels. Train one with "
            f"`rag-retriever train-reranker`."
        )
    num_labels = int(config.num_labels)
    if num_labels not in (1, 2):
        raise ModelLoadError(
            f"reranker {source!r} has {num_labels} labels; expected 1 (a relevance logit) or 2 "
            f"(the positive class is label 1)"
        )
    return num_labels


class CrossEncoderReranker:
    def __init__(
        self,
        model: transformers.PreTrainedModel,
        tokenizer: Any,
        *,
        name: str,
        precision: Precision,
        batch_size: int | Literal["auto"] = "auto",
        max_length: int = 256,
    ) -> None:
        if max_length <= 0:
            raise ValueError("max_length must be positive")
        self.model = model.to(precision.device).eval()  # type: ignore[arg-type]  # transformers types .to() oddly
        self.tokenizer = tokenizer
        self.name = name
        self.precision = precision
        self.batch_size = batch_size_for(precision.device, batch_size, AUTO_RERANK_BATCH_SIZE)
        self.num_labels = int(model.config.num_labels or 1)
        self._warned_oom = False
        window = int(getattr(model.config, "max_position_embeddings", max_length))
        self.max_length = min(max_length, window)

    @classmethod
    def from_settings(
        cls, settings: Settings, version: VersionRecord | None = None
    ) -> CrossEncoderReranker | None:
        """RAG_RERANK_MODEL loaded with the RAG_RERANK_* settings. When the setting is not given,
        the reranker that `version` (a collection version's metadata) names, if any (`improve`
        records the one it trained); None for no reranker."""
        source = settings.rerank_model
        if source is None and "rerank_model" not in settings.model_fields_set and version:
            source = (version.reranker or {}).get("source")
        if not source:
            return None
        return cls.load(
            source,
            device=settings.device,
            dtype=settings.dtype,
            batch_size=settings.rerank_batch_size,
            max_length=settings.rerank_max_length,
        )

    @classmethod
    def load(
        cls,
        source: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int | Literal["auto"] = "auto",
        max_length: int = 256,
    ) -> CrossEncoderReranker:
        source = str(source)
        if looks_like_path(source) and not Path(source).expanduser().is_dir():
            raise ModelLoadError(
                f"reranker {source!r}: no such directory; set RAG_RERANK_MODEL (--rerank-model) "
                f"to a cross-encoder directory, e.g. one written by `rag-retriever train-reranker`"
            )
        directory = model_directory(
            source, what="reranker", setting="RAG_RERANK_MODEL (or unset it: no reranking)"
        )
        _check_is_classifier(source, directory)
        try:
            with quiet_transformers():
                tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
                model = transformers.AutoModelForSequenceClassification.from_pretrained(directory)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load reranker {source!r}: {exc}") from None
        name = source
        meta = directory / "rag_reranker.json"
        if meta.is_file():
            name = json.loads(meta.read_text(encoding="utf-8")).get("name", source)
        precision = choose_precision(device, dtype)
        return cls(
            for_inference(model, precision),  # type: ignore[arg-type]  # a PreTrainedModel still
            tokenizer,
            name=name,
            precision=precision,
            batch_size=batch_size,
            max_length=max_length,
        )

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The relevance score of each pair in a tokenised batch (differentiable): the logit of
        a one-label model; of a two-label one, the positive class's log-odds l1 - l0 (ordered as
        its softmax probability; the raw l1 is not: (5, 3) is less likely than (0, 2))."""
        out = self.model(**batch).logits.float()
        return out[:, 0] if self.num_labels == 1 else out[:, 1] - out[:, 0]

    def encode_pairs(
        self, query: str, passages: Sequence[str]
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Tokenise (query, passage) pairs into one padded batch, truncating passages only;
        count truncated pairs."""
        tokens = self.tokenize_pairs(query, passages)
        (batch,) = list(tokens.batches(len(passages)))
        order = np.argsort(batch.rows, kind="stable")  # back to the passages' order
        return {k: v[order] for k, v in batch.tensors.items()}, tokens.truncated

    def tokenize_pairs(self, query: str, passages: Sequence[str]) -> Tokens:
        """Each (query, passage) pair tokenised once; the few longer than `max_length` again,
        with the tokenizer's own truncation of the passage (or of both, when the query alone
        nearly fills the window)."""

        def strategy() -> str:
            query_len = len(self.tokenizer(query, verbose=False)["input_ids"])
            # A query that alone fills the window leaves no room for passage-only truncation.
            return "only_second" if query_len < self.max_length - 8 else "longest_first"

        return tokenize_once(
            self.tokenizer, [[query] * len(passages), passages], self.max_length, strategy
        )

    def score(self, query: str, passages: Sequence[str]) -> PairScores:
        """The pairs' scores in `passages`' order. A CUDA out-of-memory halves the batch size
        for the rest of this reranker's life, with one warning, and the query is scored again
        (after the failed pass is let go), as the encoder does."""
        if not passages:
            return PairScores(np.zeros(0, dtype=np.float32), 0)
        tokens = self.tokenize_pairs(query, passages)
        while True:
            size = self.batch_size
            scores = self._scores_in(tokens, len(passages), size)
            if scores is not None:
                return PairScores(scores, tokens.truncated)
            self.batch_size = max(1, size // 2)
            if self.precision.device.type == "cuda":
                torch.cuda.empty_cache()
            if not self._warned_oom:
                log.warning(
                    "reranker out of memory at %d pairs per batch on %s; using %d (set "
                    "RAG_RERANK_BATCH_SIZE lower to start there)",
                    size,
                    self.precision.describe(),
                    self.batch_size,
                )
                self._warned_oom = True

    def _scores_in(self, tokens: Tokens, n: int, size: int) -> np.ndarray | None:
        """The scores of `tokens`' pairs in batches of `size`; None when the device ran out of
        memory (raised at one pair: nothing smaller to try)."""
        rows: list[np.ndarray] = []
        logits: list[torch.Tensor] = []
        pin = self.precision.device.type == "cuda"
        try:
            for batch in tokens.batches(size, pin=pin):
                rows.append(batch.rows)
                on_device = batch.to(self.precision.device)
                pass_ = partial(self.logits, on_device)
                logits.append(forward(self.precision, self.model, pass_, tokens=batch.n_padded))
        except torch.OutOfMemoryError:
            if size == 1:
                raise
            return None
        scores = np.empty(n, dtype=np.float32)
        # one device-to-host copy (one wait for the device) per call, not one per batch
        scores[np.concatenate(rows)] = torch.cat(logits).cpu().numpy()
        return scores
