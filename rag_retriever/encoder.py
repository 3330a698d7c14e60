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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from rag_retriever.device import Precision, choose_precision, inference
from rag_retriever.errors import ModelLoadError
from rag_retriever.profiles import (
    Fingerprint,
    ModelProfile,
    ResolvedModel,
    resolve_model,
)
from rag_retriever.quiet import quiet_transformers
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
        return hidden[:, 0]
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


def local_model_dir(source: str) -> Path:
    """The directory holding a model's files: the source itself, or its hub cache snapshot."""
    path = Path(source)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id=source, local_files_only=True))


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
        batch_size: int = 64,
        source: str | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.model = model.to(precision.device).eval()  # type: ignore[arg-type]  # transformers types .to() oddly
        self.tokenizer = tokenizer
        self.profile = profile
        self.precision = precision
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length
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
        batch_size: int = 64,
    ) -> Encoder:
        resolved = resolve_model(spec) if isinstance(spec, str) else spec
        try:
            with quiet_transformers():
                tokenizer = transformers.AutoTokenizer.from_pretrained(resolved.source)
                model = transformers.AutoModel.from_pretrained(resolved.source)
            directory = local_model_dir(resolved.source)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"cannot load embedding model {resolved.source!r}: {exc}. Set RAG_EMBED_MODEL to "
                f"a local model directory or an id that is in the Hugging Face cache."
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
        )

    # -- token counting (used by the chunker) -------------------------------------------------

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text without special tokens (additive across whitespace joins)."""
        if not texts:
            return []
        ids = self.tokenizer(
            list(texts), add_special_tokens=False, truncation=False, verbose=False
        )["input_ids"]
        return [len(x) for x in ids]

    @property
    def special_tokens(self) -> int:
        """Tokens the tokenizer adds around one sequence ([CLS] and [SEP] for BERT)."""
        return int(self.tokenizer.num_special_tokens_to_add(pair=False))

    # -- encoding -----------------------------------------------------------------------------

    def encode_queries(self, queries: Sequence[str], *, progress: bool = False) -> Encoded:
        return self._encode([self.profile.query_prefix + q for q in queries], progress)

    def encode_passages(self, passages: Sequence[str], *, progress: bool = False) -> Encoded:
        return self._encode([self.profile.passage_prefix + p for p in passages], progress)

    def _encode(self, texts: list[str], progress: bool) -> Encoded:
        if not texts:
            return Encoded(np.zeros((0, self.dim), dtype=np.float32), 0, 0)
        lengths = [
            len(ids)
            for ids in self.tokenizer(
                texts, add_special_tokens=True, truncation=False, verbose=False
            )["input_ids"]
        ]
        truncated = sum(1 for n in lengths if n > self.max_seq_length)
        # Smart batching: longest first, so each batch pads to a similar length and the
        # first batch shows the peak memory; `order` restores the caller's order.
        order = np.argsort([-n for n in lengths], kind="stable")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        bar = tqdm(total=len(texts), desc="embedding", unit="text", disable=not progress)
        with inference(self.precision):
            for start in range(0, len(texts), self.batch_size):
                idx = order[start : start + self.batch_size]
                normed = embed_batch(
                    self.model,
                    self.tokenizer,
                    [texts[i] for i in idx],
                    pooling=self.profile.pooling,
                    max_length=self.max_seq_length,
                    device=self.precision.device,
                )
                out[idx] = normed.cpu().numpy()
                bar.update(len(idx))
        bar.close()
        n_tokens = sum(min(n, self.max_seq_length) for n in lengths)
        if truncated:
            log.info(
                "%d of %d inputs exceeded %d tokens", truncated, len(texts), self.max_seq_length
            )
        return Encoded(out, truncated, n_tokens)


def embed_batch(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    pooling: str,
    max_length: int,
    device: torch.device | str,
) -> torch.Tensor:
    """The one embedding forward pass, for serving and training alike: tokenise (truncated at
    `max_length`), run the model, pool over the real tokens, L2-normalise. Gradients flow when
    the caller has them on."""
    batch = tokenizer(
        list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    ).to(device)
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
