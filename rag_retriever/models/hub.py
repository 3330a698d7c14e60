"""Where a model's files are: a local folder, or a Hugging Face hub id read from the local cache.

    >>> model_directory("BAAI/bge-small-en-v1.5", what="embedding model",
    ...                 setting="RAG_EMBED_MODEL")  # doctest: +SKIP
    PosixPath('~/.cache/huggingface/hub/models--BAAI--bge-small-en-v1.5/snapshots/<commit>')

transformers' `from_pretrained("org/name")` asks the hub about every file even when the cache
holds it, and with no network it retries each request with back-off before it falls back to the
cache or gives up: on a machine with no route to the hub, an id that is not cached took 85 s to
fail in the tokenizer alone (2026-12-07), and the model's load would have retried again.

Here an id whose config, tokenizer and whole weights are in the cache (at its `main` revision,
however they got there: transformers, `hf download`, this module) is read from there with no
network, and never refreshed from the hub. Only an id the cache lacks is asked of the hub: its
file list, with a time limit (no network: an error in seconds), then its config and tokenizer
files and one copy of its top-level weights (safetensors where the repository has them, else
PyTorch's .bin), not the other frameworks' copies nor the weights in sub-folders.
`HF_HUB_OFFLINE=1` keeps it from asking at all.

Does not handle: revisions other than `main`, private repositories' tokens beyond what
huggingface_hub reads itself (HF_TOKEN), or models whose code lives in the repository.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rag_retriever.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Weights:
    """The top-level weight files transformers reads in one format: one file, or shards and the
    index that names them."""

    single: str
    shards: str  # a pattern
    index: str

    @property
    def patterns(self) -> tuple[str, str, str]:
        return (self.single, self.shards, self.index)


SAFETENSORS = Weights(
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json"
)
PYTORCH_BIN = Weights(
    "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json"
)
# the config and tokenizer files are the top level's .json, .txt and .model files
SMALL_FILES = ("*.json", "*.txt", "*.model")
# One of these says a tokenizer is there (fast, or a slow one's vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "*.model")
# Seconds the hub has to list a repository's files (huggingface_hub waits without limit: a
# network that drops packets held a connect for about two minutes). The download's own requests
# that follow have no limit of ours.
HUB_TIMEOUT_S = 10.0


def model_directory(source: str, *, what: str, setting: str) -> Path:
    """The folder holding `source`'s files: `source` itself when it is a folder, else the hub
    id's snapshot in the Hugging Face cache (no network), else that snapshot downloaded.
    ModelLoadError names `what` ("embedding model") and the `setting` that chooses it."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import validate_repo_id

    def refuse(reason: str) -> ModelLoadError:
        return ModelLoadError(
            f"cannot load {what} {source!r}: {reason}. Set {setting} to a local folder, or to a "
            f"hub id in the Hugging Face cache ({constants.HF_HUB_CACHE}) or, with a network, "
            f"on the hub"
        )

    try:
        validate_repo_id(source)
    except ValueError as exc:  # HFValidationError
        raise refuse(f"neither a folder nor a hub id ({exc})") from None
    try:
        cached = cached_snapshot(source)
    except OSError as exc:  # an unreadable cache
        raise refuse(f"its Hugging Face cache cannot be read: {exc}") from None
    if cached is not None:
        return cached
    if huggingface_hub.is_offline_mode():
        raise refuse("not a folder, not in the Hugging Face cache, and HF_HUB_OFFLINE is set")
    try:
        return _download(source)
    except Exception as exc:
        # any: the hub client's errors are its HTTP library's own types (httpx2's in
        # huggingface_hub 2.x, httpx's before), its own, and OSError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise refuse(
            f"not in the Hugging Face cache, and the hub did not give it: {reason}"
        ) from None


def cached_snapshot(source: str) -> Path | None:
    """The cached snapshot of hub id `source` at `main` when it holds what a model loads from: a
    config, a tokenizer and whole top-level weights (every shard its index names). A snapshot an
    interrupted download left short of them is not one (None), so the hub is asked again."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(source, "config.json")
    if not isinstance(config, str):
        return None
    directory = Path(config).parent
    # a cached file is a link into the cache's blobs: exists() follows it
    tokenizer = any(p.exists() for pattern in TOKENIZER_FILES for p in directory.glob(pattern))
    return directory if tokenizer and _whole_weights(directory) else None


def _whole_weights(directory: Path) -> bool:
    for weights in (SAFETENSORS, PYTORCH_BIN):
        if (directory / weights.single).exists():
            return True
        index = directory / weights.index
        if index.exists():
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (ValueError, KeyError, AttributeError):
                continue  # not an index transformers could read either
            if shards and all((directory / name).exists() for name in shards):
                return True
    return False


def _download(source: str) -> Path:
    import huggingface_hub

    info = huggingface_hub.HfApi().model_info(source, timeout=HUB_TIMEOUT_S)
    names = [s.rfilename for s in info.siblings or []]
    has_safetensors = SAFETENSORS.single in names or fnmatch.filter(names, SAFETENSORS.shards)
    weights = SAFETENSORS if has_safetensors else PYTORCH_BIN
    # top level only: fnmatch's "*" also matches "/", so each pattern is matched against names
    # without one
    wanted = [
        n
        for n in names
        if "/" not in n and any(fnmatch.fnmatch(n, p) for p in (*SMALL_FILES, *weights.patterns))
    ]
    log.info("%s is not in the Hugging Face cache: downloading %d files", source, len(wanted))
    return Path(huggingface_hub.snapshot_download(repo_id=source, allow_patterns=wanted))
