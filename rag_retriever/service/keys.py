"""The API keys of the HTTP service and their scopes, from RAG_API_KEY, RAG_WRITE_API_KEY and the
keys file (RAG_KEYS_FILE), reloaded when the file changes.

Example:
    $ printf %s "$KEY" | sha256sum      # the hash that goes into the file, never the key
    $ cat keys.jsonl
    {"name": "acme-app", "sha256": "9f86d0...", "tenants": ["acme"], "access": ["read", "write"]}
    {"name": "acme-staff", "sha256": "60303a...", "tenants": ["acme"],
     "where": {"field": "groups", "equals": "staff"}}

    >>> ring = KeyRing.from_lines(['{"name": "a", "sha256": "' + sha256_hex("k") + '"}'], "keys")
    >>> ring.lookup("k").name, ring.lookup("other")
    ('a', None)

One JSON object a line (blank lines and lines starting with '#' are skipped): `name` (what logs
and metrics show, unique), `sha256` (hex of the key's UTF-8 bytes: the file holds no key),
`collections` (aliases, default all), `tenants` (default all, documents of no tenant included),
`access` (["read"] by default; "write" for the write routes), `where` (an access filter,
rag_retriever/conditions.py's JSON). A key with an access filter cannot write: writes are
bounded by tenant, and a filter bounds what a key reads. A malformed file is a ConfigError naming
the line and the reason (the service does not start); a changed file is read again within
RELOAD_CHECK_S, and a bad new file keeps the old keys and logs why. The keys of RAG_API_KEY
(read, every collection and tenant) and RAG_WRITE_API_KEY (write, the same) stay valid beside it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Send
from starlette.types import Scope as AsgiScope

from rag_retriever import conditions
from rag_retriever.access import ACCESS_KINDS, Scope
from rag_retriever.errors import ConfigError
from rag_retriever.records import check_alias, check_tenant
from rag_retriever.service.auth import offered_keys

log = logging.getLogger(__name__)

# How often a request may look at the keys file's modification time.
RELOAD_CHECK_S = 1.0
KEY_FIELDS = ("name", "sha256", "collections", "tenants", "access", "where")
LEGACY_READ = "RAG_API_KEY"
LEGACY_WRITE = "RAG_WRITE_API_KEY"
# The scope of a request when the service needs no key for it (no RAG_API_KEY, no keys file).
OPEN = Scope("none")


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class KeyRing:
    """Scopes by the sha256 of their key; `legacy` names the two single keys of the settings."""

    by_hash: dict[str, Scope]

    @classmethod
    def from_lines(cls, lines: Iterable[str], source: str) -> KeyRing:
        by_hash: dict[str, Scope] = {}
        names: set[str] = set()
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                digest, scope = _parse_line(text)
                if scope.name in names or scope.name in (LEGACY_READ, LEGACY_WRITE):
                    raise ValueError(f"the name {scope.name!r} is used twice")
                if digest in by_hash:
                    raise ValueError(f"the same key as {by_hash[digest].name!r}")
            except ValueError as exc:
                raise ConfigError(f"{source} line {number}: {exc}") from None
            names.add(scope.name)
            by_hash[digest] = scope
        return cls(by_hash)

    def lookup(self, key: str) -> Scope | None:
        digest = sha256_hex(key)
        # constant time over the digests: which key matched shows in nothing but the result
        found = None
        for known, scope in self.by_hash.items():
            if hmac.compare_digest(known, digest):
                found = scope
        return found


def _parse_line(text: str) -> tuple[str, Scope]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError("a key is a JSON object")
    unknown = sorted(set(data) - set(KEY_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; a key has {', '.join(KEY_FIELDS)}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 64 or not name.isprintable():
        raise ValueError("'name' must be a printable string of 1-64 characters")
    digest = data.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64 or not _is_hex(digest):
        raise ValueError(
            "'sha256' must be the 64 hex digits of the key's sha256 (printf %s KEY | sha256sum)"
        )
    access = data.get("access", ["read"])
    if not isinstance(access, list) or not access or any(a not in ACCESS_KINDS for a in access):
        raise ValueError(f"'access' must be a non-empty list of {list(ACCESS_KINDS)}")
    where = None if data.get("where") is None else conditions.parse(data["where"])
    if where is not None and "write" in access:
        raise ValueError(
            "a key with an access filter ('where') cannot write: writes are bounded by tenant; "
            "give the writer a key of its own"
        )
    scope = Scope(
        name=name,
        collections=_names(data, "collections", check_alias),
        tenants=_names(data, "tenants", check_tenant),
        read="read" in access,
        write="write" in access,
        where=where,
    )
    return digest.lower(), scope


def _names(data: dict[str, Any], field: str, check: Any) -> frozenset[str] | None:
    values = data.get(field)
    if values is None or values == "*":
        return None
    if not isinstance(values, list) or not values:
        raise ValueError(f'{field!r} must be a non-empty list of names, or "*" for all')
    return frozenset(check(v) for v in values)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


class Keys:
    """The keys a service accepts: the keys file's (reloaded when it changes) and the single keys
    of RAG_API_KEY and RAG_WRITE_API_KEY."""

    def __init__(
        self,
        *,
        read_key: str | None = None,
        write_key: str | None = None,
        keys_file: Path | None = None,
    ) -> None:
        self.read_key = read_key
        self.write_key = write_key
        self.keys_file = keys_file
        self.reloads = 0
        self.failed_reloads = 0
        self._lock = threading.Lock()
        self._checked = 0.0
        self._stamp: tuple[int, int, int] | None = None
        self._ring = KeyRing({})
        if keys_file is not None:
            self._ring, self._stamp = _read(keys_file)
            self._checked = time.monotonic()

    @property
    def enabled(self) -> bool:
        """Does any request need a key? (The write routes always do.)"""
        return bool(self.read_key or self.keys_file)

    @property
    def may_write(self) -> bool:
        """Can any key write (so that the service offers the write routes)?"""
        return bool(self.write_key) or self.keys_file is not None

    def lookup(self, offered: Iterable[str]) -> Scope | None:
        """The scope of the first offered key that is known, else None."""
        self._maybe_reload()
        ring = self._ring
        for key in offered:
            if self.read_key and hmac.compare_digest(key.encode(), self.read_key.encode()):
                return Scope(LEGACY_READ)
            if self.write_key and hmac.compare_digest(key.encode(), self.write_key.encode()):
                return Scope(LEGACY_WRITE, read=False, write=True)
            scope = ring.lookup(key)
            if scope is not None:
                return scope
        return None

    def _maybe_reload(self) -> None:
        if self.keys_file is None or time.monotonic() - self._checked < RELOAD_CHECK_S:
            return
        with self._lock:
            now = time.monotonic()
            if now - self._checked < RELOAD_CHECK_S:
                return
            self._checked = now
            try:
                stamp = _stamp(self.keys_file)
                if stamp == self._stamp:
                    return
                ring, stamp = _read(self.keys_file)
            except (ConfigError, OSError) as exc:
                if self._stamp is not None:  # say it once per change of the file
                    self.failed_reloads += 1
                    log.error("keys file not reloaded, the previous keys stay in force: %s", exc)
                    self._stamp = None
                return
            self._ring, self._stamp = ring, stamp
            self.reloads += 1
            log.info("keys file %s reloaded: %d key(s)", self.keys_file, len(ring.by_hash))


def _stamp(path: Path) -> tuple[int, int, int]:
    """What tells a changed file: a file moved over it (a new inode) with the same time and
    size included."""
    st = path.stat()
    return st.st_mtime_ns, st.st_size, st.st_ino


def _read(path: Path) -> tuple[KeyRing, tuple[int, int, int]]:
    try:
        stamp = _stamp(path)
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"RAG_KEYS_FILE {path}: cannot be read ({exc})") from None
    return KeyRing.from_lines(text.splitlines(), f"RAG_KEYS_FILE {path}"), stamp


def access_of(request: Request) -> Scope:
    """The scope KeyCheck found for this request (OPEN when no key was needed)."""
    scope = getattr(request.state, "access", None)
    return scope if isinstance(scope, Scope) else OPEN


# The paths that reach the document write routes (service/writes.py): a route's `$` also
# matches before a final newline, so an `endswith` test once let `/documents%0A` reach the
# write route as a read.
_WRITE_PATH = re.compile(
    r"/v1/changes/.*|/v1/collections/[^/]+/documents(?::delete)?\n?", re.DOTALL
)
# Characters no route's path holds (controls, DEL): such a path is refused before any routing.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_write_path(path: str) -> bool:
    """The paths of the document write routes (service/writes.py), which need write access."""
    return _WRITE_PATH.fullmatch(path) is not None


class KeyCheck:
    """Finds the scope of each request's key (`request.state.access`): 401 for a missing or
    unknown key where one is needed, 403 for a known key without the access the route needs
    (read, or write on the write routes). The public paths (the probes) need none; the read
    routes need none when no read key is configured (no RAG_API_KEY, no keys file)."""

    def __init__(self, app: ASGIApp, *, keys: Keys, public: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.public = public

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        if _CONTROL.search(scope["path"]):  # decoded %0A and the like: no route has one
            await _send_json(
                send,
                404,
                {"error": "not_found", "detail": "no route has a control character in its path"},
            )
            return
        writing = is_write_path(scope["path"])
        if writing and not self.keys.may_write:  # no write routes: the app answers 404
            await self.app(scope, receive, send)
            return
        if not writing and not self.keys.enabled:  # the read routes are open
            await self.app(scope, receive, send)
            return
        found = self.keys.lookup(offered_keys(scope))
        refusal = _refusal(found, writing)
        if refusal is not None:
            status, body = refusal
            await _send_json(send, status, body)
            return
        scope.setdefault("state", {})["access"] = found
        await self.app(scope, receive, send)


def _refusal(found: Scope | None, writing: bool) -> tuple[int, dict[str, str]] | None:
    need = "write" if writing else "read"
    legacy = found is not None and found.name in (LEGACY_READ, LEGACY_WRITE)
    if found is None or (legacy and not getattr(found, need)):
        # the two single keys keep their meaning: the read key does not open the write routes,
        # nor the write key the read routes; either is "the wrong key" there
        setting = (
            f"{LEGACY_WRITE} or a key of RAG_KEYS_FILE that can write"
            if writing
            else (f"{LEGACY_READ} or RAG_KEYS_FILE")
        )
        return 401, {
            "error": "unauthorized",
            "detail": f"missing or wrong {'write' if writing else 'API'} key; send "
            f"'Authorization: Bearer <key>' or 'X-API-Key: <key>' with a key the server has in "
            f"{setting}",
        }
    if not getattr(found, need):
        return 403, {"error": "forbidden", "detail": f"key {found.name!r} cannot {need}"}
    return None


async def _send_json(send: Send, status: int, body: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
