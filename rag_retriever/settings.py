"""Configuration: `RAG_*` environment variables, overridable by CLI flags, validated at start-up.

Example:
    >>> s = Settings.from_env({"RAG_DENSE_TOP_N": "50"})
    >>> s.dense_top_n
    50

Each setting is declared once, below: name, type, default, validation and help text. The
environment variable (`RAG_<NAME>`), the CLI flag (`--<name>`, its help and default), and the
query path's `RetrievalConfig` all derive from that declaration. An invalid value raises
ConfigError naming the variable and what it accepts. This module does not read files or load
models (it only checks that the data dir is not a file).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, NonNegativeInt, PositiveInt, ValidationError, field_validator
from pydantic import model_validator as _model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources import EnvSettingsSource

from rag_retriever.errors import ConfigError
from rag_retriever.records import FusionMethod, Quantization, check_collection
from rag_retriever.tracing import TracingMode

log = logging.getLogger(__name__)

Device = Literal["auto", "cpu", "cuda"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
Dtype = Literal["auto", "fp32", "bf16", "fp16"]
Pooling = Literal["mean", "cls"]
# How `rerank` mode orders the reranked candidates (see rag_retriever/query/retriever.py).
RerankFusion = Literal["none", "rrf"]
WriteProcess = Literal["auto", "true", "false"]
Compaction = Literal["background", "deferred", "inline"]
DEVICES: tuple[str, ...] = get_args(Device)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
DTYPES: tuple[str, ...] = get_args(Dtype)
RERANK_FUSIONS: tuple[RerankFusion, ...] = get_args(RerankFusion)

_TWO_WEIGHTS = "must be two finite non-negative numbers, not both 0 (dense,bm25)"
# Read from the environment only: secrets (a flag would show them in the process list) and the
# overrides of a model's profile (they belong with the model, not with one command).
ENV_ONLY = frozenset(
    {"api_key", "write_api_key", "qdrant_api_key", "query_prefix", "passage_prefix", "pooling"}
)
# Settings whose empty value is a value ("no prefix"); elsewhere an empty variable is unset.
_EMPTY_IS_A_VALUE = frozenset({"query_prefix", "passage_prefix"})


# The most tokens of context `expand` returns around one hit.
EXPAND_TOKENS_MAX = 8192


def _setting(default: Any, help: str, *, flag: str | None = None) -> Any:
    """One setting's default and help text; `flag` renames its CLI flag (default --<name>)."""
    return Field(default, description=help, json_schema_extra={"flag": flag} if flag else None)


class Settings(BaseSettings):
    """Every setting of the product. `Settings(...)` takes only what it is given (defaults for the
    rest); `Settings.from_env()` reads the `RAG_*` variables first."""

    model_config = SettingsConfigDict(env_prefix="RAG_", frozen=True, extra="forbid")

    data_dir: Path = _setting(
        Path("rag-data"), "where embedded Qdrant (Edge shards, aliases) and the ingest locks live"
    )
    qdrant_url: str | None = _setting(
        None, "a Qdrant server (http://host:6333); unset = embedded Qdrant Edge"
    )
    qdrant_api_key: str | None = _setting(None, "API key of the Qdrant server")
    # New collections on a server or cluster: shards, copies of each shard, and how many copies
    # must acknowledge a write. None = the server's default (1 each).
    qdrant_shards: PositiveInt | None = _setting(
        None, "shards of each new version on a server or cluster; unset = the server's default"
    )
    qdrant_replicas: PositiveInt | None = _setting(
        None, "copies of each shard on a cluster; unset = the server's default"
    )
    qdrant_write_consistency: PositiveInt | None = _setting(
        None, "copies that must acknowledge a write; unset = the server's default"
    )
    collection: str = _setting("docs", "the alias (or version) a command uses when it names none")

    embed_model: str = _setting(
        "all-MiniLM-L6-v2",
        "embedding model: a known name, a local directory or a hub id",
        flag="--model",
    )
    # Overrides of the model profile; None = take the profile's value.
    query_prefix: str | None = _setting(None, "prefix of questions; unset = the model profile's")
    passage_prefix: str | None = _setting(None, "prefix of chunks; unset = the model profile's")
    pooling: Pooling | None = _setting(
        None, "pooling of token vectors (mean or cls); unset = the model profile's"
    )
    device: Device = _setting("auto", "where models run; auto = CUDA when present")
    dtype: Dtype = _setting(
        "auto", "model precision; auto = fp16 on CUDA, bf16 on CPUs with native bf16, else fp32"
    )
    # auto = 32 on the CPU (measured fastest on 2 cores), 256 on CUDA (rag_retriever/models/device.py,
    # AUTO_BATCH_SIZE); an out-of-memory on CUDA halves it.
    embed_batch_size: PositiveInt | Literal["auto"] = _setting(
        "auto", "texts per forward pass of the encoder; auto = 32 on the CPU, 256 on CUDA"
    )

    # 200 leaves room for a title and the model's special tokens inside all-MiniLM-L6-v2's
    # 256-token window, and holds one SQuAD paragraph (median ~150 tokens) whole.
    chunk_tokens: PositiveInt = _setting(
        200, "token budget of a chunk body (the embedder's tokenizer)"
    )
    chunk_overlap_tokens: NonNegativeInt = _setting(
        48, "tokens shared by consecutive chunks (one or two sentences)", flag="--overlap-tokens"
    )

    # The fusion of the dense and BM25 lists a version serves until `tune-fusion` stores its own
    # (rag_retriever/query/fusion.py, METHODS). "adaptive" (z-scores, each list weighted per query by
    # how far its best score stands out; equal weights, no other parameter) was at least as good
    # as the better single list at recall@1/@5/@10 on SQuAD dev and train (chunk and document
    # level) and SciFact, and chosen again on each held-out half; RRF k=60 lost 5.1 points of
    # recall@1 to BM25 on SQuAD dev (`python -m bench --only fusion`, docs/querying.md
    # "Choosing the default fusion").
    fusion: FusionMethod = _setting(
        "adaptive", "how the dense and BM25 lists are fused untuned (a tuned version uses its own)"
    )
    dense_top_n: PositiveInt = _setting(100, "depth of the dense list before fusion")
    bm25_top_n: PositiveInt = _setting(100, "depth of the BM25 list before fusion")
    # Reciprocal rank fusion constant (Cormack, Clarke & Buettcher, SIGIR 2009).
    rrf_k: PositiveInt = _setting(
        60, "the reciprocal rank fusion constant (a tuned version uses its own fusion)"
    )
    rrf_weights: Annotated[tuple[float, float], NoDecode] = _setting(
        (1.0, 1.0), "DENSE,BM25 weights of the lists in the untuned fusion (1,0 = dense order)"
    )
    rerank_model: str | None = _setting(
        None, "cross-encoder directory or hub id; unset turns reranking off"
    )
    rerank_candidates: PositiveInt = _setting(50, "fused candidates the cross-encoder reorders")
    # "rrf": the final order of the candidates is the RRF (k = rrf_k) of the cross-encoder's order
    # and their hybrid order; "none": the cross-encoder's order alone. rrf measured better with a
    # reranker from `train-reranker` (SQuAD dev, 5,708 questions, 20 candidates: recall@1 hybrid
    # 0.720, none 0.776, rrf 0.791) and bounds the damage of a weak one.
    rerank_fusion: RerankFusion = _setting(
        "rrf",
        "rrf = the RRF of the cross-encoder's and the hybrid order; none = the cross-encoder's alone",
    )
    # auto = 32 on the CPU, 128 on CUDA (rag_retriever/models/device.py, AUTO_RERANK_BATCH_SIZE).
    rerank_batch_size: PositiveInt | Literal["auto"] = _setting(
        "auto", "pairs per forward pass of the cross-encoder; auto = 32 on the CPU, 128 on CUDA"
    )
    rerank_max_length: PositiveInt = _setting(
        256, "tokens of question plus chunk; longer chunks are cut and counted"
    )
    # Deep enough to find a different document for each of 10 slots; MMR over 50 costs < 1 ms.
    diversity_candidates: PositiveInt = _setting(
        50, "ranked hits that MMR chooses from when a request asks for diversity"
    )
    # A hit and a neighbour on each side at the default 200-token chunks; 3 such hits are about a
    # fifth of a 4k-token prompt.
    expand_tokens: Annotated[int, Field(ge=1, le=EXPAND_TOKENS_MAX)] = _setting(
        600, "tokens of context per hit when a request asks to expand (chunks counted whole)"
    )
    default_k: PositiveInt = _setting(10, "hits returned when a request gives no k")
    max_k: PositiveInt = _setting(100, "the most hits a request may ask for")
    max_query_chars: PositiveInt = _setting(2000, "longest accepted question, in characters")

    # Such a file is usually a dump to split, and one document is held in memory while chunked.
    max_document_chars: PositiveInt = _setting(
        10_000_000, "ingest refuses a longer document (split it)"
    )
    keep_versions: PositiveInt = _setting(
        2, "collection versions kept after each promotion (the live one included)"
    )
    # So that a process that resolved the alias just before the swap finishes its queries on it.
    retention_grace_s: NonNegativeInt = _setting(
        60, "seconds a version that stopped serving is kept before retention may delete it"
    )
    # BM25's document side is normalised with the average chunk length of the lineage's last full
    # build; deltas keep it, so scores are rank-bm25's with that average. Past this relative drift
    # of the real average, the next update re-bases with a full build (vectors reused).
    bm25_rebase_drift: Annotated[float, Field(gt=0, le=1)] = _setting(
        0.02, "relative drift of the average chunk length after which an update rebuilds BM25 fully"
    )
    quantization: Quantization = _setting(
        "none",
        "how a new version holds its dense vectors in memory: none (float32), int8 (4x "
        "smaller), binary (1 bit a dimension, 32x) or binary2 (2 bits, 16x, searched with 8-bit "
        "queries), the float32 originals on disk rescoring the top candidates; a change "
        "re-ingests in full, like a model change",
    )
    # When a delta's shards outgrow the base (embedded store), they are merged into a new base:
    # in a child process (the CLI: a detached `rag-retriever compact`), left to the caller
    # (`deferred`: run `rag-retriever compact`), or inside the write itself (`inline`).
    compaction: Compaction = _setting(
        "background",
        "how an update's outgrown delta shards are merged: background, deferred or inline",
    )
    # A full build (or a base merge) past this many chunks is written as several base shards,
    # each sealed on its own: a build's memory is one shard's (binary, 2 cores, a writer process
    # a shard: 1M peaks at 1.9 GB private / 9.2 GB RSS, 2M at 3.1 / 18.2 GB). Each shard is one
    # engine call a query, so bigger shards answer faster (2M as one shard: hybrid p50 0.66x two
    # of 1M); 1M keeps a build within a 16 GB machine. docs/benchmarks.md "Bigger base shards".
    base_shard_points: PositiveInt = _setting(
        1_000_000,
        "most chunks in one shard of an embedded version's base: a bigger full build is "
        "written and sealed as several shards, so its memory is one shard's",
    )
    # Qdrant's default 100 unless set; a version's graph keeps the width it was built with.
    hnsw_ef_construct: Annotated[int, Field(ge=4, le=4096)] = _setting(
        100,
        "how wide a new shard's HNSW graph is built (Qdrant's ef_construct): wider holds more "
        "of an exact search's neighbours and takes longer to build",
    )
    # A write that finds another write of the same alias running waits this long for it (two
    # updates in a row each see the other's documents: no lost update).
    lock_wait_s: NonNegativeInt = _setting(
        600, "seconds an update waits for another write of the same alias (0 = fail at once)"
    )

    # HTTP service.
    api_key: str | None = _setting(
        None, "when set, the HTTP service requires it on every endpoint but the health probes"
    )
    write_api_key: str | None = _setting(
        None,
        "when set, the HTTP service offers the document write endpoints, which require this key "
        "(the read key does not allow writes); unset = no write endpoints",
    )
    keys_file: Path | None = _setting(
        None,
        "a JSON-lines file of scoped API keys (tenants, collections, read/write, an access "
        "filter; docs/tenants.md), read again when it changes; unset = RAG_API_KEY alone",
    )
    # Writes that arrive within this window are committed as one version (group commit): a burst
    # of single-document edits costs one version, not one each.
    write_window_ms: NonNegativeInt = _setting(
        200, "milliseconds the HTTP service gathers document writes into one version"
    )
    # Each version costs every serving process a load of its new shards, and Qdrant Edge's load
    # holds Python's GIL (4-20 ms, every thread stopped). At 10x the brief's edit rate (2.3 a
    # second) a version every ~0.4 s doubled the p95 of 50 queries/s; one a second at most kept
    # it within 1.2x (docs/benchmarks.md, "The brief under load").
    write_interval_ms: NonNegativeInt = _setting(
        1000,
        "fewest milliseconds between the starts of two versions the HTTP service commits for "
        "one collection (writes that arrive meanwhile join the next; 0 = no minimum)",
    )
    # auto: on in `rag-retriever serve` on Qdrant Edge; off in an app made with create_app
    # (its Retriever's models live in its own process) and on a Qdrant server.
    write_process: WriteProcess = _setting(
        "auto",
        "commit the HTTP service's writes in a process of its own that runs only on idle CPU "
        "(auto: in `serve` on embedded Qdrant Edge)",
    )
    # Longer than the idle expiry of clients' and proxies' connection pools (httpx 5 s, nginx
    # upstream and cloud load balancers 60 s): with uvicorn's 5 s the server closed a pooled
    # connection as a client sent on it, and the client read a reset (httpx.ReadError: 1 of
    # 3,013 queries in `bench.bench_brief`, a known race: uvicorn's and httpx's both 5 s).
    keep_alive_s: PositiveInt = _setting(
        75, "seconds the HTTP service keeps an idle client connection open"
    )
    max_batch_size: PositiveInt = _setting(64, "most questions in one batch request")
    max_body_bytes: PositiveInt = _setting(1_000_000, "largest accepted HTTP request body")

    # Operating it: the query log, feedback and metrics (rag_retriever/query/querylog.py, metrics.py).
    query_log: Path | None = _setting(
        None, "a directory: log every query (and feedback) there as JSON lines; unset = no log"
    )
    query_log_text: bool = _setting(
        True, "log the query text (false: only its sha256; `questions --from-log` then has none)"
    )
    # Opt-in: a repeated question is answered from memory (rag_retriever/query/cache.py). 0.99 from the
    # measured near pairs of SQuAD dev (different questions reach 0.989 with all-MiniLM-L6-v2).
    cache_size: NonNegativeInt = _setting(0, "questions the semantic query cache keeps; 0 = off")
    cache_threshold: Annotated[float, Field(gt=0, le=1)] = _setting(
        0.99, "cosine at which a cached question answers a new one (with the same question words)"
    )
    metrics_port: NonNegativeInt = _setting(
        0,
        "also serve /metrics on this port of its own, without a key, for a scraper (on serve's "
        "--host interface); 0 = only on the app's port, behind a key",
    )

    # OpenTelemetry spans of a search, an ingest, an update and a compaction
    # (rag_retriever/tracing.py, docs/operating.md "Traces"). Off: no OpenTelemetry import, and a
    # span costs one check of a global.
    tracing: TracingMode = _setting(
        "off",
        "OpenTelemetry spans: off, on (the host application's OpenTelemetry setup), console "
        "(stderr) or otlp (RAG_OTLP_ENDPOINT); console and otlp need rag-retriever[tracing]",
    )
    otlp_endpoint: str | None = _setting(
        None,
        "base URL of the OTLP/HTTP collector of RAG_TRACING=otlp (http://host:4318); "
        "unset = OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else "
        "http://localhost:4318",
    )

    log_level: LogLevel = _setting("INFO", "logging level")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment is read by from_env only, so that Settings(...) means what it says.
        return (init_settings,)

    @field_validator("rrf_weights", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = tuple(float(part) for part in value.split(","))
        if isinstance(value, tuple | list) and len(value) != 2:
            raise ValueError(_TWO_WEIGHTS)
        return value

    @field_validator("rrf_weights", mode="after")
    @classmethod
    def _some_weight(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(math.isfinite(w) and w >= 0 for w in value) or not any(value):
            raise ValueError(_TWO_WEIGHTS)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("collection", mode="after")
    @classmethod
    def _valid_alias(cls, value: str) -> str:
        check_collection(value)
        return value

    @field_validator("data_dir", mode="after")
    @classmethod
    def _a_folder(cls, value: Path) -> Path:
        # It is created when missing; a file on the way to it would fail at the first write.
        for path in (value, *value.parents):
            if path.exists():
                if not path.is_dir():
                    raise ValueError(f"{path} is a file; point it at a folder (created if missing)")
                break
        return value

    @field_validator("qdrant_url", "otlp_endpoint", mode="after")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value

    @_model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.chunk_overlap_tokens >= self.chunk_tokens:
            raise ValueError(
                f"RAG_CHUNK_OVERLAP_TOKENS must be in [0, RAG_CHUNK_TOKENS={self.chunk_tokens}), "
                f"got {self.chunk_overlap_tokens}"
            )
        if self.default_k > self.max_k:
            raise ValueError(
                f"RAG_DEFAULT_K ({self.default_k}) must not exceed RAG_MAX_K ({self.max_k})"
            )
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read `RAG_<NAME>` variables, then apply keyword overrides (CLI flags), then validate.

        Overrides that are None are ignored, so CLI flags that were not given do not reset
        environment values.
        """
        unknown = sorted(set(overrides) - set(cls.model_fields))
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]!r}")
        environ = os.environ if environ is None else environ
        _warn_unknown(environ)
        values = _Environment(cls, environ)()
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)

    @classmethod
    def check(cls, **values: Any) -> None:
        """Validate some settings on their own, by the rules of their declaration and the rules
        across settings, without reading the environment or checking the others; ConfigError
        like Settings(...). (RetrievalConfig checks its fields with it.)"""
        probe = cls.model_construct(**values)
        try:
            for name, value in values.items():
                cls.__pydantic_validator__.validate_assignment(probe, name, value)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    def replace(self, **changes: Any) -> Settings:
        """A copy with `changes`, validated like any other; a setting that was not given stays
        not given (`model_fields_set`), so it can still defer to a collection's own models."""
        given = {name: getattr(self, name) for name in self.model_fields_set}
        return type(self)(**{**given, **changes})

    @property
    def edge_dir(self) -> Path:
        """Qdrant Edge shards and aliases of the embedded store."""
        return self.data_dir / "edge"


def env_name(name: str) -> str:
    """The environment variable of setting `name`."""
    return f"RAG_{name.upper()}"


def default_of(name: str) -> Any:
    """The declared default of setting `name`."""
    return Settings.model_fields[name].default


def bounds_of(name: str) -> tuple[Any, Any]:
    """The least and greatest value setting `name` declares (`ge`, `le`; None where it
    declares none)."""
    low = high = None
    for rule in Settings.model_fields[name].metadata:
        low = getattr(rule, "ge", low)
        high = getattr(rule, "le", high)
    return low, high


def choices_of(name: str) -> tuple[str, ...] | None:
    """The values a Literal-typed setting accepts (or an optional one); None for any other,
    a number that may also be "auto" among them: a flag's choices would refuse the number."""
    annotation = Settings.model_fields[name].annotation
    if getattr(annotation, "__origin__", None) is Literal:
        return get_args(annotation)
    members = [arg for arg in get_args(annotation) if arg is not type(None)]
    if members and all(getattr(arg, "__origin__", None) is Literal for arg in members):
        return tuple(value for arg in members for value in get_args(arg))
    return None


def shown_default(name: str) -> str:
    """The default of setting `name` as a user would type it."""
    default = default_of(name)
    if isinstance(default, tuple):
        return ",".join(f"{x:g}" for x in default)
    return "unset" if default is None else str(default)


def markdown_table() -> str:
    """The settings as docs/configuration.md lists them (`python -m rag_retriever.settings`)."""
    rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        flag = "-" if name in ENV_ONLY else f"`{flag_of(name)}`"
        default = shown_default(name)
        default = default if default == "unset" else f"`{default}`"
        rows.append(f"| `{env_name(name)}` | {flag} | {default} | {field.description} |")
    return "\n".join(rows) + "\n"


def flag_of(name: str) -> str:
    """The CLI flag of setting `name`."""
    extra = Settings.model_fields[name].json_schema_extra
    flag = extra.get("flag") if isinstance(extra, dict) else None
    return str(flag) if flag else "--" + name.replace("_", "-")


class _Environment(EnvSettingsSource):
    """pydantic-settings' reading of `RAG_*` variables, from a given mapping (tests, compose
    files) as well as from os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = {
            key.lower(): value
            for key, value in environ.items()
            if key.startswith("RAG_")
            and (value != "" or key[len("RAG_") :].lower() in _EMPTY_IS_A_VALUE)
        }
        super().__init__(settings_cls, case_sensitive=False)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return self._environ


# The RAG_* variables of this process's environment already warned about (once each).
_WARNED_UNKNOWN: set[str] = set()
# What Kubernetes puts in a pod's environment for a Service named `rag` (enableServiceLinks).
_SERVICE_LINK = re.compile(r"RAG_(PORT|SERVICE_HOST|SERVICE_PORT)(_[A-Z0-9_]+)?")


def _warn_unknown(environ: Mapping[str, str]) -> None:
    """A warning for each `RAG_*` variable that is no setting, with the nearest setting's name:
    a misspelt one (`RAG_QUERYLOG_TEXT=false`) is otherwise ignored without a word, and the
    setting it meant keeps its default (here: every query text logged)."""
    known = {env_name(name) for name in Settings.model_fields}
    for key in sorted(environ):
        # read without regard to case, as the settings are; Kubernetes' service links of a
        # Service named `rag` (RAG_PORT, RAG_SERVICE_HOST, ...) are no misspellings
        if (
            not key.startswith("RAG_")
            or key.upper() in known
            or _SERVICE_LINK.fullmatch(key.upper())
            or key in _WARNED_UNKNOWN
        ):
            continue
        _WARNED_UNKNOWN.add(key)
        near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        log.warning(
            "%s is not a setting of rag-retriever and is ignored%s",
            key,
            f"; did you mean {near[0]}?" if near else "",
        )


def _flag_note(name: str) -> str:
    """Where a setting given by a flag came from, for a message that names its variable."""
    if name not in Settings.model_fields or name in ENV_ONLY:
        return ""
    return f" (flag {flag_of(name)})"


def _explain(exc: ValidationError) -> str:
    """The first problem, naming the variable and what it accepts."""
    error = exc.errors()[0]
    if not error["loc"]:  # a rule across settings: its message names them
        return str(error["msg"]).removeprefix("Value error, ")
    name = str(error["loc"][0])
    value = error.get("input")
    choices = choices_of(name) if name in Settings.model_fields else None
    if choices and error["type"] == "literal_error":
        return (
            f"{env_name(name)} must be one of {', '.join(choices)}; got {value!r}{_flag_note(name)}"
        )
    reason = str(error["msg"]).removeprefix("Value error, ")
    return f"{env_name(name)}={value!r} is invalid: {reason}{_flag_note(name)}"


if __name__ == "__main__":
    print(markdown_table(), end="")
