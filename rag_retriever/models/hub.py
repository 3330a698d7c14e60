"""Where a model's files are: a local folder, or a Hugging Face hub id read from the local cache.

transformers' `from_pretrained("org/name")` asks the hub for every file even when the cache
holds it, and with no network it retries each request with back-off before it falls back to the
cache or gives up: on a machine with no route to the hub an id that is not cached took 85 s to
fail in the tokenizer alone, and the model's load would have retried again. Here an id is looked
up in the cache first, with no network; only an id the cache does not hold is asked of the hub,
once (a machine with no network fails in well under a second), and downloaded: the config,
tokenizer and weight files (safetensors where the repository has them, else PyTorch's .bin), not
the other frameworks' copies. `HF_HUB_OFFLINE=1` keeps it from asking at all.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# What a transformers model and its tokenizer are read from (fnmatch: "*" also matches "/").
SMALL_FILES = ("*.json", "*.txt", "*.model")
WEIGHTS = "*.safetensors"
FALLBACK_WEIGHTS = "*.bin"


class ModelNotFound(LookupError):
    """Neither a folder nor an id in the cache or on the hub; the message says which was tried."""


def model_directory(source: str) -> Path:
    """The folder holding `source`'s files: `source` itself when it is a folder, else the hub
    id's snapshot in the Hugging Face cache (no network), else that snapshot downloaded."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(huggingface_hub.snapshot_download(repo_id=source, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except ValueError as exc:  # not a valid repo id (HFValidationError)
        raise ModelNotFound(f"{source!r} is neither a folder nor a hub id: {exc}") from None
    where = f"not a folder, and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFound(f"{source!r} is {where}, and HF_HUB_OFFLINE is set")
    return _download(source, where)


def _download(source: str, where: str) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    log.info("%s is not in the Hugging Face cache: downloading it from the hub", source)
    try:
        directory = Path(
            huggingface_hub.snapshot_download(
                repo_id=source, allow_patterns=[*SMALL_FILES, WEIGHTS]
            )
        )
        if not any(directory.glob(f"**/{WEIGHTS}")):
            directory = Path(
                huggingface_hub.snapshot_download(
                    repo_id=source, allow_patterns=[*SMALL_FILES, FALLBACK_WEIGHTS]
                )
            )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        # no network: LocalEntryNotFoundError ("Got: ConnectError ..."); unknown id: a 401/404
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFound(
            f"{source!r} is {where}, and the hub did not give it: {reason}"
        ) from None
    return directory
