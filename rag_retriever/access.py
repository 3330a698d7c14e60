"""What a caller may see and change: the scope of an API key (docs/tenants.md).

Example:
    >>> scope = Scope("acme-staff", tenants=frozenset({"acme"}),
    ...               where=conditions.parse({"field": "groups", "equals": "staff"}))
    >>> scope.narrow(None, None).to_dict()["where"]["all"][0]
    {'field': 'tenant', 'equals': 'acme'}
    >>> scope.narrow(None, "globex")
    Traceback (most recent call last):
    ...
    rag_retriever.errors.Forbidden: key 'acme-staff' cannot read tenant 'globex'

A scope names the collections a key opens (None: all), the tenants it reads and writes (None:
all, documents of no tenant included), whether it reads and whether it writes, and an access
filter (a `where` condition, e.g. `groups` equals "staff"). Every search made with the key is
the request's filter AND the tenants' condition AND the access filter, one condition that the
engine applies inside every branch (dense, BM25, hybrid; the rerank, MMR and context windows
only ever see what the branches returned, and the cache is keyed by the whole filter), so a
request can narrow its scope and never widen it. A request that names a tenant, or a value of a
field the access filter restricts, outside the scope is refused (Forbidden, 403) rather than
silently narrowed: the caller learns what its key lacks, never what else exists.

`current()` is the scope of the request being served (a context variable the HTTP service sets),
so that the query log records each query's scope, never the key.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rag_retriever import conditions
from rag_retriever.errors import Forbidden
from rag_retriever.records import GROUPS_FIELD, TENANT_FIELD, SearchFilter

ACCESS_KINDS = ("read", "write")


@dataclass(frozen=True)
class Scope:
    name: str  # the key's name (what logs and metrics show; never the key)
    collections: frozenset[str] | None = None  # None: every collection
    tenants: frozenset[str] | None = None  # None: every tenant, and documents of none
    read: bool = True
    write: bool = False
    where: conditions.Condition | None = None  # the access filter

    @property
    def unrestricted(self) -> bool:
        """Sees every document of the collections it opens (no tenant or access filter)."""
        return self.tenants is None and self.where is None

    def label(self) -> dict[str, Any]:
        """The scope as the query log and change records show it."""
        return {
            "key": self.name,
            "tenants": None if self.tenants is None else sorted(self.tenants),
            "filtered": self.where is not None,
        }

    def check_collection(self, alias: str) -> None:
        if self.collections is not None and alias not in self.collections:
            raise Forbidden(f"key {self.name!r} cannot open collection {alias!r}")

    def check_tenant(self, tenant: str, action: str = "read") -> None:
        if self.tenants is not None and tenant not in self.tenants:
            what = f"tenant {tenant!r}" if tenant else "documents of no tenant"
            raise Forbidden(f"key {self.name!r} cannot {action} {what}")

    def write_tenant(self, tenant: str) -> str:
        """The tenant a document written with this key belongs to: the one it names, or the
        key's own when the key has exactly one; Forbidden outside the scope."""
        chosen = tenant or single_tenant(self, None) or ""
        self.check_tenant(chosen, "write")
        return chosen

    def narrow(self, flt: SearchFilter | None, tenant: str | None) -> SearchFilter | None:
        """The filter a search runs with: the request's (`flt`, and `tenant` when it names one)
        within this scope. Forbidden when the request reaches outside it."""
        if tenant is not None:
            self.check_tenant(tenant)
        if flt is not None:
            asked = [conditions.Match(f, (v,)) for f, v in (flt.equals or {}).items()]
            self._check_reach(conditions.All((*asked, *([flt.where] if flt.where else []))))
        parts: list[conditions.Condition] = []
        if tenant is not None:
            parts.append(conditions.Match(TENANT_FIELD, (tenant,)))
        elif self.tenants is not None:
            parts.append(conditions.Match(TENANT_FIELD, tuple(sorted(self.tenants))))
        if self.where is not None:
            parts.append(self.where)
        return with_conditions(flt, parts)

    def _check_reach(self, where: conditions.Condition) -> None:
        """A request condition that asks for a tenant, or for a value of a field the access
        filter restricts, outside the scope (a Match not under a `not`) is refused."""
        allowed = self._allowed_values()
        for match in _positive_matches(where):
            kept = allowed.get(match.field)
            if kept is None:
                continue
            outside = [v for v in match.values if v not in kept]
            if outside:
                raise Forbidden(
                    f"key {self.name!r} cannot read documents whose {match.field!r} is "
                    f"{outside[0]!r}: the filter reaches outside the key's scope"
                )

    def _allowed_values(self) -> dict[str, frozenset[Any]]:
        allowed: dict[str, frozenset[Any]] = {}
        if self.tenants is not None:
            allowed[TENANT_FIELD] = frozenset(self.tenants)
        if self.where is not None:
            for match in _required_matches(self.where):
                if match.field == GROUPS_FIELD:
                    # a list: a document of `staff` and `admin` is one a `staff` key reads, so
                    # asking for `admin` narrows the scope, not reaches out of it
                    continue
                allowed[match.field] = allowed.get(match.field, frozenset(match.values)) & set(
                    match.values
                )
        return allowed


def with_conditions(
    flt: SearchFilter | None, parts: list[conditions.Condition]
) -> SearchFilter | None:
    """`flt` with `parts` ANDed into its `where` (its doc ids and equals kept)."""
    if not parts:
        return flt
    base = flt or SearchFilter()
    if base.where is not None:
        parts = [*parts, base.where]
    where = parts[0] if len(parts) == 1 else conditions.All(tuple(parts))
    return SearchFilter(doc_ids=base.doc_ids, equals=base.equals, where=where)


def _positive_matches(
    where: conditions.Condition, negated: bool = False
) -> Iterator[conditions.Match]:
    """The Match conditions of `where` under an even number of `not`s (`not not x` asks for
    x)."""
    if isinstance(where, conditions.Match):
        if not negated:
            yield where
    elif isinstance(where, conditions.Not):
        yield from _positive_matches(where.condition, not negated)
    elif isinstance(where, conditions.All | conditions.AnyOf):
        for c in where.conditions:
            yield from _positive_matches(c, negated)


def _required_matches(where: conditions.Condition) -> Iterator[conditions.Match]:
    """The Match conditions every document of `where` satisfies (top level, or under `all`)."""
    if isinstance(where, conditions.Match):
        yield where
    elif isinstance(where, conditions.All):
        for c in where.conditions:
            yield from _required_matches(c)


_current: contextvars.ContextVar[tuple[Scope | None, str | None]] = contextvars.ContextVar(
    "scope", default=(None, None)
)


def current() -> Scope | None:
    """The scope of the request being served here (None: no key, or not a request)."""
    return _current.get()[0]


def current_tenant() -> str | None:
    """The one tenant the request being served searches, when it searches one."""
    return _current.get()[1]


def single_tenant(scope: Scope | None, tenant: str | None) -> str | None:
    """The one tenant a request searches: the one it names, or its key's only one."""
    if tenant is None and scope is not None and scope.tenants is not None:
        return next(iter(scope.tenants)) if len(scope.tenants) == 1 else None
    return tenant


@contextlib.contextmanager
def serving(scope: Scope | None, tenant: str | None = None) -> Iterator[None]:
    """Mark the code inside as serving a request of `scope` (see `current`) that searches
    `tenant` (or its key's only tenant; see `current_tenant`)."""
    token = _current.set((scope, single_tenant(scope, tenant)))
    try:
        yield
    finally:
        _current.reset(token)
