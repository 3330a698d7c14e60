"""What every command shares: which settings each kind of command reads (their flags derive
from settings.py), the settings a command runs with, `--where` filters and durations."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rag_retriever.errors import ConfigError, RagError
from rag_retriever.records import MAX_EXACT_INT
from rag_retriever.settings import (
    Settings,
    choices_of,
    env_name,
    flag_of,
    shown_default,
)

# The settings each kind of command reads. Their flags, types, choices, help and defaults derive
# from the one declaration in settings.py; settings.ENV_ONLY have no flag.
STORE = ("data_dir", "qdrant_url", "log_level", "tracing", "otlp_endpoint")
MODEL = ("embed_model", "device", "dtype", "embed_batch_size")
QUERY = (
    "fusion",
    "dense_top_n",
    "bm25_top_n",
    "rrf_k",
    "rrf_weights",
    "rerank_model",
    "rerank_candidates",
    "rerank_fusion",
    "rerank_batch_size",
    "rerank_max_length",
    "diversity_candidates",
    "expand_tokens",
)
WRITE = (
    "chunk_tokens",
    "chunk_overlap_tokens",
    "keep_versions",
    "retention_grace_s",
    "bm25_rebase_drift",
    "compaction",
    "base_shard_points",
    "hnsw_ef_construct",
    "max_document_chars",
    "qdrant_shards",
    "qdrant_replicas",
    "qdrant_write_consistency",
)
LIMITS = ("default_k", "max_k", "max_query_chars", "max_batch_size", "max_body_bytes")


def setting_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    """One flag per setting in `names`, overriding its RAG_* variable."""
    group = parser.add_argument_group("settings (each flag overrides its RAG_* variable)")
    parser.set_defaults(setting_flags=names)
    for name in names:
        group.add_argument(
            flag_of(name),
            dest=name,
            choices=choices_of(name),
            type=str.upper if name == "log_level" else str,
            metavar=None if choices_of(name) else name.upper(),
            help=f"{env_name(name)}: {Settings.model_fields[name].description} (default {shown_default(name)})",
        )


def command_settings(args: argparse.Namespace, **extra: Any) -> Settings:
    """The environment's settings with the flags given on the command line (values are checked
    by Settings, as environment values are)."""
    overrides = {name: getattr(args, name) for name in getattr(args, "setting_flags", ())}
    overrides.update(extra)
    return Settings.from_env(**overrides)


def parse_where(items: Sequence[str]) -> dict[str, str | int | bool]:
    equals: dict[str, str | int | bool] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RagError(f"--where expects FIELD=VALUE, got {item!r}")
        value: str | int | bool = raw
        if raw in ("true", "false"):
            value = raw == "true"
        elif _INTEGER.fullmatch(raw) and abs(int(raw)) <= MAX_EXACT_INT:
            # ASCII digits only ("٣" and "３" are text), no leading zero ("02139" stays text),
            # and an integer JSON and Qdrant keep exact (a 20-digit account number is text)
            value = int(raw)
        if key in equals and (type(equals[key]), equals[key]) != (type(value), value):
            raise RagError(
                f"--where {key}= given twice ({equals[key]!r} and {value!r}): one value a field "
                f"(both at once match nothing; --filter takes an `in` list)"
            )
        equals[key] = value
    return equals


_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")


def parse_duration(text: str) -> float:
    """Seconds in "90s", "45m", "2h" or a bare number of seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a duration like 45m, 2h or 90s: {text!r}"
        ) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"the budget must be positive: {text!r}")
    return seconds


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `minimum` (a usage error, exit 2, otherwise:
    a batch size of 0 hung a training, a negative --max-questions dropped questions)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (a temperature of 0 made the loss NaN)."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def reads_files(parser: argparse.ArgumentParser, *dests: str) -> None:
    """The flags of `parser` that name a file its command reads (labelled questions): `main`
    checks them before the command runs, so a missing one is refused before any model loads
    (not at parse time: a documented command still parses where its files are not)."""
    parser.set_defaults(reads_files=dests)


def check_files(args: argparse.Namespace) -> None:
    """ConfigError (exit 2) for a file flag of `reads_files` that names no file."""
    for dest in getattr(args, "reads_files", ()):
        path: Path | None = getattr(args, dest, None)
        if path is not None and not path.is_file():
            why = "is a folder" if path.is_dir() else "does not exist"
            raise ConfigError(f"--{dest.replace('_', '-')} {path} {why}: expected a file")
