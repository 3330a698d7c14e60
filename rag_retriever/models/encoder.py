"""The bi-encoder: text -> L2-normalised vectors with the model profile's prefixes and pooling.

Example:
    >>> enc = Encoder.load("all-MiniLM-L6-v2")              # doctest: +SKIP
    >>> enc.encode_queries(["who founded Normandy?"]).vectors.shape  # doctest: +SKIP
    (1, 384)

What it guarantees: pooling is the *masked* mean (or CLS) so a vector does not depend on its
batch-mates' padding; vectors have unit length, so cosine = dot product; inputs longer than the
model's window are counted, never truncated silently. Smart batching sorts by length to cut
padding and restores the input order. It does not cache vectors or talk to Qdrant.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import transformers

from rag_retriever.errors import ModelLoadError
from rag_retriever.models.device import (
    BACKGROUND,
    URGENT,
    Precision,
    batch_size_for,
    choose_precision,
    for_inference,
    forward,
)
from rag_retriever.models.hub import model_directory
from rag_retriever.models.profiles import (
    Fingerprint,
    ModelProfile,
    ResolvedModel,
    resolve_model,
)
from rag_retriever.models.quiet import quiet_transformers
from rag_retriever.models.token_counter import TokenizerCounter
from rag_retriever.progress import progress as progress_of
from rag_retriever.settings import Settings

if TYPE_CHECKING:  # the record is the store's; only its type is needed here
    from rag_retriever.store.record import VersionRecord

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class Encoded:
    vectors: np.ndarray  # float32, shape (n, dim), unit rows
    truncated: int  # inputs longer than the model window (their tail was not embedded)
    n_tokens: int  # tokens embedded, special tokens included


def masked_mean(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens only: padding positions get weight zero."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1.0)
    return summed / counts


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "cls":
        # each row's first real token: position 0 is padding where the tokenizer pads on the
        # left (argmax returns the first 1 of the mask)
        first = attention_mask.argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]
    return masked_mean(hidden, attention_mask)


def hash_weights(directory: Path) -> str:
    """sha256 over the weight files of a model directory (names and bytes, in name order)."""
    files = sorted(
        p for p in directory.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
    )
    if not files:
        raise ModelLoadError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {directory}")
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(directory)).encode("utf-8"))
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def read_max_seq_length(directory: Path, config: Any, tokenizer: Any) -> int:
    """The model window: sentence-transformers' setting if present, else the tokenizer's cap."""
    st_config = directory / "sentence_bert_config.json"
    if st_config.is_file():
        value = json.loads(st_config.read_text(encoding="utf-8")).get("max_seq_length")
        if value:
            return int(value)
    limits = [int(tokenizer.model_max_length)]
    if getattr(config, "max_position_embeddings", None):
        limits.append(int(config.max_position_embeddings))
    return min(limit for limit in limits if limit > 0)


class Encoder:
    """A Hugging Face encoder with a model profile. Build with `Encoder.load`."""

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        tokenizer: Any,
        profile: ModelProfile,
        *,
        precision: Precision,
        weights_sha256: str,
        max_seq_length: int,
        batch_size: int | Literal["auto"] = "auto",
        source: str | None = None,
        trainable: bool = False,
    ) -> None:
        self.batch_size = batch_size_for(precision.device, batch_size)
        # A model about to be trained keeps fp32 weights (encoding runs under autocast then).
        self.model = for_inference(model, precision, half_weights=not trainable)
        self.tokenizer = tokenizer
        self.profile = profile
        self.precision = precision
        # Lowered by a CUDA out-of-memory (see _forward), for the rest of this encoder's life.
        self._max_rows = self.batch_size
        self._warned_oom = False
        self.max_seq_length = max_seq_length
        self.token_counter = TokenizerCounter(tokenizer)
        # Where the weights came from (a directory or hub id), recorded with collections so the
        # promotion gate can load the live version's model again.
        self.source = source
        self.dim = int(model.config.hidden_size)
        self.fingerprint = Fingerprint(
            model=profile.name,
            weights_sha256=weights_sha256,
            pooling=profile.pooling,
            query_prefix=profile.query_prefix,
            passage_prefix=profile.passage_prefix,
            dim=self.dim,
            max_seq_length=max_seq_length,
        )

    @classmethod
    def load(
        cls,
        spec: str | ResolvedModel,
        *,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int | Literal["auto"] = "auto",
        trainable: bool = False,
    ) -> Encoder:
        resolved = resolve_model(spec) if isinstance(spec, str) else spec
        log.info("loading the embedding model %s", resolved.source)
        directory = model_directory(
            resolved.source, what="embedding model", setting="RAG_EMBED_MODEL"
        )
        try:
            with quiet_transformers():
                tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
                model = transformers.AutoModel.from_pretrained(directory)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"cannot load embedding model {resolved.source!r}: {exc}. Set RAG_EMBED_MODEL to "
                f"a local model directory or a hub id."
            ) from None
        max_len = resolved.profile.max_seq_length or read_max_seq_length(
            directory, model.config, tokenizer
        )
        return cls(
            model,
            tokenizer,
            resolved.profile,
            precision=choose_precision(device, dtype),
            weights_sha256=hash_weights(directory),
            max_seq_length=max_len,
            batch_size=batch_size,
            source=resolved.source,
            trainable=trainable,
        )

    # -- token counting (used by the chunker) -------------------------------------------------

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text without special tokens (additive across whitespace joins)."""
        return self.token_counter(texts)

    @property
    def special_tokens(self) -> int:
        """Tokens the tokenizer adds around one sequence ([CLS] and [SEP] for BERT)."""
        return int(self.tokenizer.num_special_tokens_to_add(pair=False))

    # -- encoding -----------------------------------------------------------------------------

    def encode_queries(self, queries: Sequence[str], *, progress: bool = False) -> Encoded:
        return self._encode([self.profile.query_prefix + q for q in queries], progress, URGENT)

    def encode_passages(self, passages: Sequence[str], *, progress: bool = False) -> Encoded:
        texts = [self.profile.passage_prefix + p for p in passages]
        return self._encode(texts, progress, BACKGROUND)

    def prepare_passages(self, passages: Sequence[str]) -> Tokens:
        """The first half of `encode_passages`, on the CPU: the passages tokenised (with the
        passage prefix), for `encode_prepared`. The ingest runs it in its own pipeline stage, so
        the device never waits for the tokenizer."""
        texts = [self.profile.passage_prefix + p for p in passages]
        return tokenize(self.tokenizer, texts, self.max_seq_length)

    def encode_prepared(self, tokens: Tokens, *, progress: bool = False) -> Encoded:
        """The second half: vectors of what `prepare_passages` tokenised (the same vectors as
        `encode_passages` of the same passages)."""
        counts = TokenCounts(tokens.truncated, tokens.n_tokens)
        pin = self.precision.device.type == "cuda"
        batches = tokens.batches(self.batch_size, pin=pin)
        return self._run(batches, len(tokens.ids), counts, progress, BACKGROUND)

    def _encode(self, texts: list[str], progress: bool, priority: int) -> Encoded:
        counts = TokenCounts()
        return self._run(self._batches(texts, counts), len(texts), counts, progress, priority)

    def _run(
        self,
        batches: Iterator[TokenBatch],
        n: int,
        counts: TokenCounts,
        progress: bool,
        priority: int,
    ) -> Encoded:
        """The forward passes over `batches` (prepared in a thread, `PREFETCH_BATCHES` ahead),
        each at `priority` on the CPU's compute thread; `counts` is complete once `batches` is
        exhausted."""
        if not n:
            return Encoded(np.zeros((0, self.dim), dtype=np.float32), 0, 0)
        out = np.empty((n, self.dim), dtype=np.float32)
        results = DeviceResults(out, self.precision.device)
        prefetch = Prefetch(batches, depth=PREFETCH_BATCHES)
        bar = progress_of(total=n, desc="embedding", unit="text", enabled=progress)
        try:
            for batch in prefetch:
                vectors = forward(
                    self.precision,
                    self.model,
                    partial(self._forward, batch),
                    priority,
                    tokens=batch.n_padded,
                )
                results.add(batch.rows, vectors)
                bar.update(len(batch.rows))
            results.flush()
        finally:
            prefetch.close()
            bar.close()
        truncated, n_tokens = counts.truncated, counts.n_tokens
        if truncated:  # in the result, which callers report: a debug line here, not a second report
            log.debug("%d of %d inputs exceeded %d tokens", truncated, n, self.max_seq_length)
        return Encoded(out, truncated, n_tokens)

    def _batches(self, texts: list[str], counts: TokenCounts) -> Iterator[TokenBatch]:
        """The texts tokenised once, window by window, each window sorted longest first and cut
        into padded batches (pinned on CUDA). Runs in the prefetch thread."""
        window = self.batch_size * SORT_WINDOW_BATCHES
        pin = self.precision.device.type == "cuda"
        for first in range(0, len(texts), window):
            tokens = tokenize(self.tokenizer, texts[first : first + window], self.max_seq_length)
            counts.truncated += tokens.truncated
            counts.n_tokens += tokens.n_tokens
            yield from tokens.batches(self.batch_size, offset=first, pin=pin)

    def _forward(self, batch: TokenBatch) -> torch.Tensor:
        """The batch's unit vectors, on the device. A CUDA out-of-memory halves the batch for
        the rest of this encoder's life, with one warning, and the batch runs in halves. The
        retry runs after the failed pass is let go (a retry inside the `except` block ran while
        its traceback still held that pass's activations)."""
        while True:
            size = min(self._max_rows, len(batch.rows))
            parts = self._embed_in(batch, size)
            if parts is not None:
                return parts[0] if len(parts) == 1 else torch.cat(parts)
            self._max_rows = max(1, size // 2)
            if self.precision.device.type == "cuda":
                torch.cuda.empty_cache()
            if not self._warned_oom:
                log.warning(
                    "out of memory at %d texts per batch on %s; using %d (set "
                    "RAG_EMBED_BATCH_SIZE lower to start there)",
                    size,
                    self.precision.describe(),
                    self._max_rows,
                )
                self._warned_oom = True

    def _embed_in(self, batch: TokenBatch, size: int) -> list[torch.Tensor] | None:
        """The batch's vectors in slices of `size` rows; None when the device ran out of memory
        (raised at one row: nothing smaller to try)."""
        try:
            return [
                embed_tokens(
                    self.model,
                    batch.slice(at, at + size).to(self.precision.device),
                    self.profile.pooling,
                )
                for at in range(0, len(batch.rows), size)
            ]
        except torch.OutOfMemoryError:
            if size == 1:
                raise
            return None


# Batches tokenised ahead of the one on the device (the prefetch queue's bound).
PREFETCH_BATCHES = 4
# Texts are sorted by length (smart batching) within windows of this many batches, so the next
# window is tokenised while the device runs the current one instead of all before the first.
SORT_WINDOW_BATCHES = 32
# Vectors kept on the device before one copy to the host (256 MiB; 174k MiniLM vectors).
DEVICE_RESULT_BYTES = 256 << 20


@dataclass
class TokenCounts:
    truncated: int = 0  # texts longer than the model window
    n_tokens: int = 0  # tokens embedded, special tokens included


class DeviceResults:
    """Vectors gathered on the device and copied to the host in as few copies as memory allows
    (one per call up to DEVICE_RESULT_BYTES), instead of one synchronising copy per batch."""

    def __init__(self, out: np.ndarray, device: torch.device) -> None:
        self.out, self.device = out, device
        self._rows: list[np.ndarray] = []
        self._vectors: list[torch.Tensor] = []
        self._bytes = 0

    def add(self, rows: np.ndarray, vectors: torch.Tensor) -> None:
        if self.device.type == "cpu":  # already in host memory: no copy to save
            self.out[rows] = vectors.numpy()
            return
        self._rows.append(rows)
        self._vectors.append(vectors)
        self._bytes += vectors.numel() * vectors.element_size()
        if self._bytes >= DEVICE_RESULT_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._vectors:
            return
        self.out[np.concatenate(self._rows)] = torch.cat(self._vectors).cpu().numpy()
        self._rows, self._vectors, self._bytes = [], [], 0


@dataclass(frozen=True)
class TokenBatch:
    """One padded batch: `rows` are the texts' positions in the caller's list."""

    rows: np.ndarray
    tensors: dict[str, torch.Tensor]

    def slice(self, start: int, stop: int) -> TokenBatch:
        if start == 0 and stop >= len(self.rows):
            return self
        return TokenBatch(
            self.rows[start:stop], {k: v[start:stop] for k, v in self.tensors.items()}
        )

    @property
    def n_padded(self) -> int:
        """Tokens a forward pass over the batch computes: rows x padded length."""
        return self.tensors["input_ids"].numel()

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        # non_blocking: from pinned memory (CUDA) the copy overlaps the work queued before it
        return {k: v.to(device, non_blocking=True) for k, v in self.tensors.items()}


@dataclass(frozen=True)
class Tokens:
    """A list of texts tokenised once, special tokens in, each cut at the model window.
    `lengths` are the untruncated lengths (for the counts); `ids` are what is embedded."""

    ids: list[list[int]]
    type_ids: list[list[int]] | None
    lengths: list[int]
    max_length: int
    pad_id: int
    pad_type_id: int
    pad_left: bool

    @property
    def truncated(self) -> int:
        return sum(1 for n in self.lengths if n > self.max_length)

    @property
    def n_tokens(self) -> int:
        return sum(min(n, self.max_length) for n in self.lengths)

    def batches(self, size: int, *, offset: int = 0, pin: bool = False) -> Iterator[TokenBatch]:
        """Padded batches, longest texts first (so each batch pads to a similar length and the
        first shows the peak memory); `rows` are positions + `offset`."""
        order = np.argsort([-n for n in self.lengths], kind="stable")
        for start in range(0, len(order), size):
            idx = order[start : start + size]
            tensors = {"input_ids": self._pad([self.ids[i] for i in idx], self.pad_id)}
            tensors["attention_mask"] = self._pad([[1] * len(self.ids[i]) for i in idx], 0)
            if self.type_ids is not None:
                tensors["token_type_ids"] = self._pad(
                    [self.type_ids[i] for i in idx], self.pad_type_id
                )
            if pin:
                tensors = {k: v.pin_memory() for k, v in tensors.items()}
            yield TokenBatch(idx + offset, tensors)

    def _pad(self, rows: list[list[int]], value: int) -> torch.Tensor:
        width = max(len(r) for r in rows)
        out = np.full((len(rows), width), value, dtype=np.int64)
        for i, row in enumerate(rows):
            if self.pad_left:
                out[i, width - len(row) :] = row
            else:
                out[i, : len(row)] = row
        return torch.from_numpy(out)


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int) -> Tokens:
    """Tokenise `texts` once: the full encoding gives each length (and so the truncation count);
    only the few texts over `max_length` are tokenised again, with the tokenizer's own
    truncation, so what is embedded is exactly what `tokenizer(..., truncation=True)` gives."""
    return tokenize_once(tokenizer, [texts], max_length)


def tokenize_once(
    tokenizer: Any,
    columns: Sequence[Sequence[str]],
    max_length: int,
    truncation: Callable[[], str | bool] = lambda: True,
) -> Tokens:
    """`columns` tokenised once (one column of texts, or two of pairs); the rows longer than
    `max_length` again with `truncation()` (asked for only when a row is too long)."""
    want_types = "token_type_ids" in tokenizer.model_input_names
    full = tokenizer(
        *[list(c) for c in columns],
        truncation=False,
        return_attention_mask=False,
        return_token_type_ids=want_types,
        verbose=False,
    )
    ids: list[list[int]] = full["input_ids"]
    type_ids: list[list[int]] | None = full["token_type_ids"] if want_types else None
    lengths = [len(x) for x in ids]
    long = [i for i, n in enumerate(lengths) if n > max_length]
    if long:
        cut = tokenizer(
            *[[c[i] for i in long] for c in columns],
            truncation=truncation(),
            max_length=max_length,
            return_attention_mask=False,
            return_token_type_ids=want_types,
        )
        for j, i in enumerate(long):
            ids[i] = cut["input_ids"][j]
            if type_ids is not None:
                type_ids[i] = cut["token_type_ids"][j]
    return Tokens(
        ids,
        type_ids,
        lengths,
        max_length,
        pad_id=int(tokenizer.pad_token_id or 0),
        pad_type_id=int(getattr(tokenizer, "pad_token_type_id", 0) or 0),
        pad_left=tokenizer.padding_side == "left",
    )


class Prefetch:
    """Runs an iterator of token batches in a thread, at most `depth` batches ahead, so the CPU
    prepares batch n+1 while the device runs batch n. Counts truncation as it goes; an error
    in the thread is raised in the consumer; `close` stops the thread early."""

    def __init__(self, batches: Iterator[TokenBatch], *, depth: int) -> None:
        self._queue: queue.Queue[TokenBatch | BaseException | None] = queue.Queue(depth)
        self._stop = threading.Event()
        self._source = batches
        self._thread = threading.Thread(target=self._run, name="encoder-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self._source:
                if not self._put(batch):
                    return
            self._put(None)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(exc)

    def _put(self, item: TokenBatch | BaseException | None) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[TokenBatch]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def embed_batch(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    pooling: str,
    max_length: int,
    device: torch.device | str,
) -> torch.Tensor:
    """The one embedding forward pass of training: tokenise (truncated at `max_length`), then
    `embed_tokens`. Gradients flow when the caller has them on."""
    batch = tokenizer(
        list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    ).to(device)
    return embed_tokens(model, dict(batch), pooling)


def embed_tokens(model: Any, batch: Mapping[str, torch.Tensor], pooling: str) -> torch.Tensor:
    """The forward pass shared by serving and training: run the model on a tokenised batch,
    pool over the real tokens (in fp32), L2-normalise."""
    hidden = model(**batch).last_hidden_state.float()
    return torch.nn.functional.normalize(
        pool(hidden, batch["attention_mask"], pooling), p=2, dim=-1
    )


# The settings that choose the embedding model. When none of them is set, a collection version
# is served (and re-ingested) with the model that built it, recorded in its metadata.
MODEL_SETTINGS = frozenset({"embed_model", "query_prefix", "passage_prefix", "pooling"})


def load_encoder(settings: Settings, version: VersionRecord | None = None) -> Encoder:
    """The embedding model the settings describe (RAG_EMBED_MODEL and the profile overrides);
    when they name none and `version` (a collection version's record) says where the model that
    built it was loaded from, that model."""
    if version and version.model_source and not MODEL_SETTINGS & settings.model_fields_set:
        return encoder_of_version(version, settings)
    resolved = resolve_model(
        settings.embed_model,
        query_prefix=settings.query_prefix,
        passage_prefix=settings.passage_prefix,
        pooling=settings.pooling,
    )
    return Encoder.load(
        resolved,
        device=settings.device,
        dtype=settings.dtype,
        batch_size=settings.embed_batch_size,
    )


def encoder_of_version(version: VersionRecord, settings: Settings) -> Encoder:
    """The model that embedded a collection version (its `model_source` and fingerprint)."""
    fingerprint = version.fingerprint
    source = version.model_source
    name = f"{version.alias} version {version.version}"
    if not source:
        raise ModelLoadError(
            f"{name} was embedded with {fingerprint.model} and its model location was "
            f"not recorded; set RAG_EMBED_MODEL to that model"
        )
    profile = ModelProfile(
        name=fingerprint.model,
        query_prefix=fingerprint.query_prefix,
        passage_prefix=fingerprint.passage_prefix,
        pooling=fingerprint.pooling,
        max_seq_length=fingerprint.max_seq_length,
    )
    encoder = Encoder.load(
        ResolvedModel(str(source), profile),
        device=settings.device,
        dtype=settings.dtype,
        batch_size=settings.embed_batch_size,
    )
    if encoder.fingerprint.id != fingerprint.id:
        raise ModelLoadError(
            f"the model at {source} no longer matches the fingerprint of {name} "
            f"({encoder.fingerprint.describe()} vs {fingerprint.describe()})"
        )
    return encoder
