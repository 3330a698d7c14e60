"""Files the stores write beside the engine's: atomic replacement and JSON reads.

Example:
    >>> write_atomic(Path("aliases/docs.json"), b'{"collection": "docs__m-384__v2"}')  # doctest: +SKIP

Nothing here knows what the files hold.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a reader (or a crash) sees the old or the new file:
    write a temporary file, fsync it, rename it over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
