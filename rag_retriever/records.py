"""The values that flow through rag-retriever: documents, chunks, hits.

Every record is a frozen dataclass. Stages build new records instead of editing the ones they
were given (`dataclasses.replace`), so a hit's dense score can never be overwritten by a later
stage.

Example:
    >>> doc = Document(id="a.md", title="A", text="One.\\n\\nTwo.")
    >>> chunk_point_id("a.md", 0) == chunk_point_id("a.md", 0)
    True
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from rag_retriever import conditions

# A fixed namespace so that chunk ids are the same on every machine and every run:
# re-ingesting the same document overwrites its points instead of duplicating them.
CHUNK_ID_NAMESPACE = uuid.UUID("5b1c0f8e-7a52-4b8e-9d1c-2f4e6a7b8c90")
# Chunks of a tenant's documents take their ids from another namespace, so that no document id of
# one tenant (or of no tenant) can give the point id of another tenant's chunk.
TENANT_CHUNK_ID_NAMESPACE = uuid.UUID("0f3a6d2e-41c7-4b7f-8e0a-6b2d9c5e1a47")

# The metadata fields of document-level access (docs/tenants.md). A tenant is a named partition
# of a collection: a document id is unique within its tenant, and a document of tenant "acme" is
# a different document from one of the same id in "globex". `groups` lists who may read it.
TENANT_FIELD = "tenant"
GROUPS_FIELD = "groups"
# Tenant names: lowercase ASCII letters, digits, '_' and '-', 1-64 characters, starting with a
# letter or digit. ASCII only, so no two names look alike; no '/', '.' or '\\', so none looks
# like a path; they appear in logs, metrics labels and key files as they are.
TENANT_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
TENANT_SCHEMA_PATTERN = "^[a-z0-9][a-z0-9_-]{0,63}$"
MAX_GROUP_CHARS = 128
MAX_GROUPS = 64

# A document's identity: (tenant, id), the tenant "" for a document of no tenant.
DocKey = tuple[str, str]

Mode = Literal["dense", "bm25", "hybrid", "rerank"]
# The fusions of the dense and BM25 lists (each one entry of rag_retriever.query.fusion.METHODS); named
# here because the settings (below the fusion layer) validate the untuned one.
FusionMethod = Literal["rrf", "dbsf", "minmax", "zscore", "adaptive"]
MODES: tuple[Mode, ...] = ("dense", "bm25", "hybrid", "rerank")
# How a version holds its dense vectors in memory (docs/versions.md "Quantized vectors"): float32
# (none), int8 (4x smaller), 1 bit a dimension (binary, 32x) or 2 bits searched with 8-bit
# queries (binary2, 16x), the float32 originals on disk rescoring the top candidates. Part of a
# version, like the model: never mixed inside one.
Quantization = Literal["none", "int8", "binary", "binary2"]
QUANTIZATIONS: tuple[Quantization, ...] = get_args(Quantization)
# Vectors as the model gives them (what every version written before 0.3 holds).
UNQUANTIZED: Quantization = "none"


# Collection (alias) names become file names of the embedded store and Qdrant collection names:
# a letter or digit, then letters, digits, '.', '_' or '-', at most 64 characters, and no '__'
# (which separates a version's parts: `<alias>__<model>__v<N>`).
ALIAS_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The same names as JSON Schema (ECMA regex, no look-around) can say them, with maxLength 64.
ALIAS_SCHEMA_PATTERN = "^[A-Za-z0-9](?:[A-Za-z0-9.-]|_[A-Za-z0-9.-])*_?$"


# White space as JSON Schema's (ECMAScript's) `\s` knows it; a query made only of these is empty,
# for the HTTP schema and the retriever alike.
BLANK_CHARS = (
    "\\t\\n\\v\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"
)
_BLANK = re.compile(f"[{BLANK_CHARS}]*")


def is_blank(text: str) -> bool:
    """True when `text` holds nothing but white space (or nothing)."""
    return _BLANK.fullmatch(text) is not None


# One version of an alias: `<alias>__<model slug>__v<N>`, a plain file name.
_VERSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_VERSION_TAIL = re.compile(r"[A-Za-z0-9._-]+__v[0-9]+")


def check_collection(name: object) -> str:
    """`name` if it is an alias (check_alias) or the name of one version of an alias.

    >>> check_collection("docs__all-minilm-l6-v2-384__v3")
    'docs__all-minilm-l6-v2-384__v3'
    """
    if isinstance(name, str) and "__" in name:
        alias, _, tail = name.partition("__")
        valid = ALIAS_PATTERN.fullmatch(alias) and _VERSION_TAIL.fullmatch(tail)
        if valid and _VERSION_NAME.fullmatch(name):
            return name
        raise ValueError(
            f"collection name {name!r} is not allowed: an alias (1-64 letters, digits, '.', '_' "
            f"or '-', without '__') or a version name (ALIAS__MODEL__vN)"
        )
    return check_alias(name)


def check_alias(name: object) -> str:
    """`name` if it is a valid collection name, else ValueError saying what is allowed.

    >>> check_alias("docs")
    'docs'
    """
    if not isinstance(name, str) or not ALIAS_PATTERN.fullmatch(name) or "__" in name:
        raise ValueError(
            f"collection name {name!r} is not allowed: use 1-64 letters, digits, '.', '_' or "
            f"'-', starting with a letter or digit, without '__' (reserved for versions)"
        )
    return name


def chunk_point_id(doc_id: str, chunk_index: int, tenant: str = "") -> str:
    """The Qdrant point id of a chunk: uuid5 of the document id and the chunk's position (and of
    the tenant, in a namespace of their own, for a tenant's document)."""
    if tenant:
        return str(uuid.uuid5(TENANT_CHUNK_ID_NAMESPACE, f"{tenant}\x00{doc_id}\x00{chunk_index}"))
    return str(uuid.uuid5(CHUNK_ID_NAMESPACE, f"{doc_id}\x00{chunk_index}"))


def check_tenant(name: object) -> str:
    """`name` if it is a tenant name (TENANT_PATTERN), else ValueError saying what is allowed."""
    if isinstance(name, str) and TENANT_PATTERN.fullmatch(name):
        return name
    shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:80]) + "..."
    raise ValueError(
        f"tenant {shown} is not a tenant name: use 1-64 lowercase ASCII letters, digits, '_' or "
        f"'-', starting with a letter or digit (no paths, spaces or look-alike characters)"
    )


def tenant_of(metadata: Mapping[str, Any]) -> str:
    """The tenant a document's (or chunk's) metadata names, "" for none."""
    tenant = metadata.get(TENANT_FIELD)
    return tenant if isinstance(tenant, str) else ""


def doc_key(ref: str | DocKey) -> DocKey:
    """A document reference as (tenant, id): a bare id is a document of no tenant."""
    return ("", ref) if isinstance(ref, str) else ref


def show_key(key: DocKey) -> str:
    """How messages name a document: its id, with its tenant when it has one."""
    tenant, doc_id = key
    return f"{doc_id!r} (tenant {tenant!r})" if tenant else repr(doc_id)


def content_hash(text: str) -> str:
    """sha256 of the exact text that is embedded; equal hashes mean a vector can be reused."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def embed_text(title: str, body: str, section: str = "") -> str:
    """The text that is embedded and BM25-indexed for a chunk: its heading path (the title, then
    the section's headings: `Title > Section > Subsection`), a blank line, the body.

    >>> embed_text("Guide", "Run it.", "Install > Linux")
    'Guide > Install > Linux\\n\\nRun it.'
    """
    heading = HEADING_SEPARATOR.join(h for h in (title, section) if h)
    return f"{heading}\n\n{body}" if heading else body


# Between the levels of a heading path in a chunk's prefix (title > section > subsection).
HEADING_SEPARATOR = " > "


@dataclass(frozen=True)
class Heading:
    """A heading inside a document's text: where its line starts, its level (1 = top), its text."""

    start: int
    level: int
    text: str


@dataclass(frozen=True)
class Document:
    """One input document; `metadata` keeps every extra field of the input line.

    `headings` (markdown and HTML files; in text order, the title's own heading left out) give
    each chunk its heading path (`Chunk.section`)."""

    id: str
    title: str
    text: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    headings: tuple[Heading, ...] = ()

    @property
    def key(self) -> DocKey:
        """Its identity: (tenant, id)."""
        return (tenant_of(self.metadata), self.id)


def section_at(headings: Sequence[Heading], position: int) -> str:
    """The heading path in force at `position`: each heading before it that no later heading
    of the same or a higher level replaced, top level first.

    >>> hs = [Heading(0, 2, "Install"), Heading(20, 3, "Linux"), Heading(40, 2, "Use")]
    >>> section_at(hs, 30), section_at(hs, 45), section_at(hs, 0)
    ('Install > Linux', 'Use', 'Install')
    """
    stack: list[Heading] = []
    for heading in headings:
        if heading.start > position:
            break
        while stack and stack[-1].level >= heading.level:
            stack.pop()
        stack.append(heading)
    return HEADING_SEPARATOR.join(h.text for h in stack)


@dataclass(frozen=True)
class Chunk:
    """A span of a document's text, `document.text[start:end] == text`."""

    id: str
    doc_id: str
    title: str
    chunk_index: int
    start: int
    end: int
    text: str
    n_tokens: int
    content_hash: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # The headings above the chunk's start below the title ("Install > Linux"), for markdown and
    # HTML documents; "" when the document has none.
    section: str = ""

    @property
    def embed_text(self) -> str:
        return embed_text(self.title, self.text, self.section)

    @property
    def doc_key(self) -> DocKey:
        """Its document's identity: (tenant, id)."""
        return (tenant_of(self.metadata), self.doc_id)

    def to_payload(self) -> dict[str, Any]:
        """The Qdrant payload (and the row of the chunk table): everything but the vector."""
        return {
            "chunk_id": self.id,
            "doc_id": self.doc_id,
            "title": self.title,
            "chunk_index": self.chunk_index,
            "start": self.start,
            "end": self.end,
            "text": self.text,
            "n_tokens": self.n_tokens,
            "content_hash": self.content_hash,
            "metadata": dict(self.metadata),
            # only when there is one: versions of documents without headings keep their payloads
            **({"section": self.section} if self.section else {}),
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Chunk:
        return cls(
            id=str(payload["chunk_id"]),
            doc_id=str(payload["doc_id"]),
            title=str(payload["title"]),
            chunk_index=int(payload["chunk_index"]),
            start=int(payload["start"]),
            end=int(payload["end"]),
            text=str(payload["text"]),
            n_tokens=int(payload["n_tokens"]),
            content_hash=str(payload["content_hash"]),
            metadata=dict(payload.get("metadata") or {}),
            section=str(payload.get("section") or ""),
        )


@dataclass(frozen=True)
class Context:
    """The span around a hit that `expand` returns: consecutive chunks of its document merged
    without repeating their overlap, `document.text[start:end] == text` (see context.py)."""

    text: str
    start: int
    end: int
    first_chunk: int  # chunk_index of the first chunk in the span
    last_chunk: int

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Context:
        return cls(
            text=str(data["text"]),
            start=int(data["start"]),
            end=int(data["end"]),
            first_chunk=int(data["first_chunk"]),
            last_chunk=int(data["last_chunk"]),
        )


@dataclass(frozen=True)
class StageScore:
    """Where one stage put a chunk: 1-based rank and that stage's own score."""

    rank: int
    score: float


@dataclass(frozen=True)
class Hit:
    """A retrieved chunk with its provenance and what every stage that saw it said.

    A stage that did not run, or did not return this chunk, is None, never zero.
    `score` is the score of the stage that produced the final order (cosine for `dense`,
    BM25 for `bm25`, the fusion's score for `hybrid` (RAG_FUSION), for `rerank` the RRF of the
    cross-encoder's and the hybrid order by default (RAG_RERANK_FUSION=rrf) or the
    cross-encoder's logit (none); the MMR value when the request asked for `diversity`).
    """

    chunk_id: str
    doc_id: str
    title: str
    text: str
    start: int
    end: int
    chunk_index: int
    rank: int
    score: float
    dense: StageScore | None = None
    bm25: StageScore | None = None
    fused: StageScore | None = None
    rerank: StageScore | None = None
    # Where maximal marginal relevance put the hit, when the request asked for `diversity`.
    mmr: StageScore | None = None
    matched_terms: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    section: str = ""  # the chunk's heading path below the title (markdown, HTML)
    # The neighbouring chunks merged around the hit, when the request asked to `expand`.
    context: Context | None = None

    @classmethod
    def of_chunk(cls, chunk: Chunk, **stages: Any) -> Hit:
        """A hit for `chunk`: its provenance fields, plus rank, score and the stages given."""
        provenance = {n: getattr(chunk, n) for n in _CHUNK_FIELDS_OF_HIT}
        return cls(chunk_id=chunk.id, **provenance, **stages)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (HTTP, `--json`): every field; stages as {rank, score} or null."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in HIT_STAGES:
                value = None if value is None else {"rank": value.rank, "score": value.score}
            elif isinstance(value, Context):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Hit:
        """The inverse of `to_dict` (what the HTTP clients read)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = data.get(f.name)
            if f.name in HIT_STAGES:
                values[f.name] = (
                    None if raw is None else StageScore(int(raw["rank"]), float(raw["score"]))
                )
            elif f.name == "matched_terms":
                values[f.name] = tuple(raw or ())
            elif f.name == "metadata":
                values[f.name] = dict(raw or {})
            elif f.name == "context":
                values[f.name] = None if raw is None else Context.from_dict(raw)
            elif f.name == "section":  # absent from the answers of older servers
                values[f.name] = str(raw or "")
            else:
                values[f.name] = _SCALARS[str(f.type)](data[f.name])
        return cls(**values)


# The stages a hit reports, in pipeline order (each a StageScore or None).
HIT_STAGES = ("dense", "bm25", "fused", "rerank", "mmr")
# A hit's provenance fields copied from its chunk (the chunk's `id` becomes `chunk_id`).
_CHUNK_FIELDS_OF_HIT = (
    "doc_id",
    "title",
    "text",
    "start",
    "end",
    "chunk_index",
    "metadata",
    "section",
)
_SCALARS: dict[str, Any] = {"str": str, "int": int, "float": float}


@dataclass(frozen=True)
class SearchFilter:
    """Restricts both the dense and the BM25 branch to the same chunks.

    `doc_ids`: keep chunks of these documents. `equals`: keep chunks whose document metadata
    field equals the value (all pairs must match). `where`: a condition on metadata fields with
    `in`, ranges, `not` and `all`/`any` nesting (rag_retriever/conditions.py), as a Condition or
    its JSON form. All three must hold.
    """

    doc_ids: tuple[str, ...] | None = None
    equals: Mapping[str, str | int | bool] = field(default_factory=dict)
    where: conditions.Condition | None = None

    def __post_init__(self) -> None:
        if self.where is not None and not isinstance(self.where, _CONDITION_TYPES):
            # the JSON form, parsed (and checked) here
            object.__setattr__(self, "where", conditions.parse(self.where))
        if isinstance(self.doc_ids, str):  # ("a") for ("a",): one id per character, 0 hits
            raise TypeError(
                f"SearchFilter.doc_ids must be a tuple of strings, not one string: write "
                f"doc_ids=({self.doc_ids!r},)"
            )
        if self.doc_ids is not None and not all(isinstance(d, str) for d in self.doc_ids):
            raise TypeError("SearchFilter.doc_ids must be a tuple of strings")
        for doc_id in self.doc_ids or ():
            if not _utf8(doc_id):
                raise ValueError(
                    f"filter doc id {doc_id!r} is not valid Unicode (a lone surrogate)"
                )
        for key, value in self.equals.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"filter field names must be non-empty strings, got {key!r}")
            # Each part named as what it is: a bad field name is not a bad value.
            if not _utf8(key):
                raise ValueError(
                    f"filter field name {key!r} is not valid Unicode (a lone surrogate)"
                )
            if isinstance(value, str) and not _utf8(value):
                raise ValueError(
                    f"filter value for {key!r} is not valid Unicode (a lone surrogate)"
                )
            if isinstance(value, int) and abs(value) > MAX_EXACT_INT:
                raise ValueError(
                    f"filter value for {key!r} is {value}; integers must lie within "
                    f"±{MAX_EXACT_INT} (what JSON clients and Qdrant both keep exact)"
                )
            # Qdrant's exact match takes keywords, integers and booleans (not floats).
            if not isinstance(value, str | int | bool):
                raise TypeError(
                    f"filter value for {key!r} must be a string, integer or boolean, "
                    f"got {type(value).__name__}"
                )

    @property
    def is_empty(self) -> bool:
        return self.doc_ids is None and not self.equals and self.where is None

    def field_uses(self) -> list[tuple[str, conditions.FieldUse, tuple[Any, ...]]]:
        """Each metadata field the filter reads: (name, "match" or "range", matched values)."""
        uses: list[tuple[str, conditions.FieldUse, tuple[Any, ...]]] = [
            (key, "match", (value,)) for key, value in self.equals.items()
        ]
        if self.where is not None:
            uses.extend(conditions.fields(self.where))
        return uses

    @classmethod
    def of(cls, value: SearchFilter | Mapping[str, Any] | None) -> SearchFilter | None:
        """A search call's `filter` argument: a SearchFilter, its dict form (`from_dict`, as the
        HTTP API takes it) or None; anything else is a ValueError naming both forms."""
        if value is None or isinstance(value, SearchFilter):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ValueError(
            f"filter must be a SearchFilter or its dict form ({{'doc_ids': [...], 'equals': "
            f"{{...}}, 'where': {{...}}}}), got {type(value).__name__}"
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> SearchFilter:
        """Build from `{"doc_ids": [...], "equals": {...}, "where": {...}}` (the HTTP and CLI
        form)."""
        if not data:
            return cls()
        unknown = set(data) - {"doc_ids", "equals", "where"}
        if unknown:
            raise ValueError(
                f"unknown filter keys {sorted(unknown)}; expected 'doc_ids', 'equals' and/or "
                f"'where'"
            )
        doc_ids = data.get("doc_ids")
        if "doc_ids" in data and doc_ids is None:
            raise ValueError("filter 'doc_ids' must be a list of strings, not null")
        if doc_ids is not None and (
            not isinstance(doc_ids, list | tuple) or not all(isinstance(d, str) for d in doc_ids)
        ):
            raise ValueError("filter 'doc_ids' must be a list of strings")
        equals = data.get("equals", {})
        if not isinstance(equals, Mapping):
            raise ValueError(
                f"filter 'equals' must be an object of field: value, got {type(equals).__name__}"
            )
        where = data.get("where")
        return cls(
            doc_ids=None if doc_ids is None else tuple(doc_ids),
            equals=dict(equals),
            where=None if where is None else conditions.parse(where),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.doc_ids is not None:
            out["doc_ids"] = list(self.doc_ids)
        if self.equals:
            out["equals"] = dict(self.equals)
        if self.where is not None:
            out["where"] = conditions.to_json(self.where)
        return out


MAX_EXACT_INT = conditions.MAX_EXACT_INT
_CONDITION_TYPES = (
    conditions.Match,
    conditions.Range,
    conditions.All,
    conditions.AnyOf,
    conditions.Not,
)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class SearchResult:
    """Hits plus what the caller should know about how they were made."""

    query: str
    mode: Mode
    collection: str
    hits: tuple[Hit, ...]
    timings_ms: Mapping[str, float]
    query_truncated: bool = False
    notices: tuple[str, ...] = ()
    # The fusion that merged the dense and BM25 lists (hybrid and rerank modes), e.g.
    # "rrf k=60 weights(dense,bm25)=1,1 depths=100,100"; tuned per version by `tune-fusion`.
    fusion: str | None = None
    # Names this query in the query log and in feedback (`POST /v1/feedback`).
    query_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "query_id": self.query_id,
            "query": self.query,
            "mode": self.mode,
            "collection": self.collection,
            "hits": [h.to_dict() for h in self.hits],
            "timings_ms": dict(self.timings_ms),
            "query_truncated": self.query_truncated,
            "notices": list(self.notices),
            "fusion": self.fusion,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SearchResult:
        mode = data["mode"]
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        return cls(
            query=str(data["query"]),
            mode=mode,
            collection=str(data["collection"]),
            hits=tuple(Hit.from_dict(h) for h in data["hits"]),
            timings_ms={str(k): float(v) for k, v in data["timings_ms"].items()},
            query_truncated=bool(data.get("query_truncated", False)),
            notices=tuple(data.get("notices") or ()),
            fusion=data.get("fusion"),
            query_id=data.get("query_id"),
        )
