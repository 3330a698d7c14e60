"""Metadata conditions of a search filter: `equals`, `in`, ranges, and `all`/`any`/`not` nesting.

Example:
    >>> c = parse({"all": [{"field": "team", "in": ["support", "sales"]},
    ...                    {"not": {"field": "year", "range": {"lt": 2020}}}]})
    >>> sorted((name, use) for name, use, _ in fields(c))
    [('team', 'match'), ('year', 'range')]
    >>> to_json(c) == {"all": [{"field": "team", "in": ["support", "sales"]},
    ...                        {"not": {"field": "year", "range": {"lt": 2020}}}]}
    True

The JSON form (HTTP `filter.where`, the CLI's `--where`, `SearchFilter(where=...)`) is one
object per condition with exactly one operator:

- `{"field": F, "equals": V}`: metadata field F equals V (a string, integer or boolean; a list
  field matches when any element does);
- `{"field": F, "in": [V, ...]}`: F equals one of the values (1 to MAX_VALUES, one kind);
- `{"field": F, "range": {"gt"|"gte"|"lt"|"lte": N, ...}}`: F is a number within the bounds;
- `{"all": [C, ...]}`, `{"any": [C, ...]}`: every / at least one condition holds;
- `{"not": C}`: C does not hold (a chunk without the field satisfies it).

It maps one to one onto Qdrant's filter model (must / should / must_not, MatchValue, MatchAny,
Range), so every branch of a search applies it inside the engine. Bad input is a ValueError
saying what is allowed: an unknown key or operator, two operators in one object, an empty list,
values of mixed kinds, a range without bounds or with crossed ones, non-finite numbers, nesting
deeper than MAX_DEPTH or more than MAX_CONDITIONS conditions.

Does not do: geo, full-text or null conditions (Qdrant has them; nothing here stores such
fields), or matching floats exactly (use a range).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["All", "AnyOf", "Condition", "Match", "Not", "Range", "fields", "parse", "to_json"]

# Nesting and size bounds: a filter is part of every request, and the engine walks it per point.
MAX_DEPTH = 8
MAX_CONDITIONS = 64
MAX_VALUES = 1024
# The largest integer a JSON client (a float64) and Qdrant (int64) both hold exactly.
MAX_EXACT_INT = 2**53 - 1

MatchValue = str | int | bool
FieldUse = Literal["match", "range"]
BOUNDS = ("gt", "gte", "lt", "lte")


@dataclass(frozen=True)
class Match:
    """`field` equals one of `values` (one value: `equals`; several: `in`)."""

    field: str
    values: tuple[MatchValue, ...]


@dataclass(frozen=True)
class Range:
    field: str
    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    lte: float | None = None


@dataclass(frozen=True)
class All:
    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class AnyOf:
    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class Not:
    condition: Condition


Condition = Match | Range | All | AnyOf | Not


def parse(data: Any) -> Condition:
    """The condition of its JSON form; ValueError naming what is wrong and what is allowed."""
    counter = [0]
    return _parse(data, "where", 1, counter)


def _parse(data: Any, at: str, depth: int, counter: list[int]) -> Condition:
    if depth > MAX_DEPTH:
        raise ValueError(f"{at}: conditions nest at most {MAX_DEPTH} levels")
    counter[0] += 1
    if counter[0] > MAX_CONDITIONS:
        raise ValueError(f"a filter holds at most {MAX_CONDITIONS} conditions")
    if not isinstance(data, Mapping):
        raise ValueError(f"{at}: a condition is an object, got {type(data).__name__}")
    ops = [k for k in data if k in ("equals", "in", "range", "all", "any", "not")]
    unknown = sorted(set(data) - {"field", *ops})
    if unknown:
        raise ValueError(
            f"{at}: unknown key(s) {unknown}; a condition is {{'field', and one of 'equals', "
            f"'in', 'range'}} or one of 'all', 'any', 'not'"
        )
    if len(ops) != 1:
        raise ValueError(
            f"{at}: a condition has exactly one operator (equals, in, range, all, any, not), "
            f"got {ops or 'none'}"
        )
    op = ops[0]
    if op in ("all", "any", "not"):
        if "field" in data:
            raise ValueError(f"{at}: '{op}' combines conditions and takes no 'field'")
        if op == "not":
            return Not(_parse(data["not"], f"{at}.not", depth + 1, counter))
        items = data[op]
        if not isinstance(items, list) or not items:
            raise ValueError(f"{at}.{op}: a non-empty list of conditions")
        parts = tuple(
            _parse(item, f"{at}.{op}[{i}]", depth + 1, counter) for i, item in enumerate(items)
        )
        return All(parts) if op == "all" else AnyOf(parts)
    field = data.get("field")
    if not isinstance(field, str) or not field:
        raise ValueError(f"{at}: '{op}' needs 'field', a non-empty metadata field name")
    _check_text(field, f"{at}.field")
    if op == "range":
        return _range(field, data["range"], f"{at}.range")
    values = [data["equals"]] if op == "equals" else data["in"]
    if op == "in" and (not isinstance(values, list) or not 1 <= len(values) <= MAX_VALUES):
        raise ValueError(f"{at}.in: a list of 1 to {MAX_VALUES} values")
    for value in values:
        _check_value(value, f"{at}.{op}")
    kinds = {_kind(v) for v in values}
    if len(kinds) > 1:
        raise ValueError(f"{at}.in: values of one kind (strings, integers or booleans), got mixed")
    return Match(field, tuple(dict.fromkeys(values)))


def _range(field: str, bounds: Any, at: str) -> Range:
    if not isinstance(bounds, Mapping) or not bounds:
        raise ValueError(f"{at}: an object of bounds, some of {list(BOUNDS)}")
    unknown = sorted(set(bounds) - set(BOUNDS))
    if unknown:
        raise ValueError(f"{at}: unknown bound(s) {unknown}; use {list(BOUNDS)}")
    for name, value in bounds.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{at}.{name}: a number, got {type(value).__name__}")
        if isinstance(value, int) and abs(value) > MAX_EXACT_INT:  # past a float: OverflowError
            raise ValueError(
                f"{at}.{name}: integers lie within ±{MAX_EXACT_INT}, got one of "
                f"{value.bit_length()} bits (write a float)"
            )
        if not math.isfinite(value):
            raise ValueError(f"{at}.{name}: a finite number, got {value}")
    if ("gt" in bounds and "gte" in bounds) or ("lt" in bounds and "lte" in bounds):
        raise ValueError(f"{at}: one lower bound (gt or gte) and one upper bound (lt or lte)")
    low = bounds.get("gt", bounds.get("gte"))
    high = bounds.get("lt", bounds.get("lte"))
    if low is not None and high is not None and low > high:
        raise ValueError(f"{at}: the lower bound {low} is above the upper bound {high}")
    return Range(field, **{k: float(v) for k, v in bounds.items()})


def _check_value(value: Any, at: str) -> None:
    if isinstance(value, bool | str):
        if isinstance(value, str):
            _check_text(value, at)
        return
    if isinstance(value, int):
        if abs(value) > MAX_EXACT_INT:
            raise ValueError(f"{at}: integers lie within ±{MAX_EXACT_INT}, got {value}")
        return
    hint = "; match a float with a range" if isinstance(value, float) else ""
    raise ValueError(f"{at}: a string, integer or boolean, got {type(value).__name__}{hint}")


def _check_text(text: str, at: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{at}: not valid Unicode (a lone surrogate)") from None


def _kind(value: MatchValue) -> str:
    return "bool" if isinstance(value, bool) else type(value).__name__


def fields(condition: Condition) -> Iterator[tuple[str, FieldUse, tuple[MatchValue, ...]]]:
    """Each (field, how it is used, the values it is matched with) in the condition."""
    if isinstance(condition, Match):
        yield condition.field, "match", condition.values
    elif isinstance(condition, Range):
        yield condition.field, "range", ()
    elif isinstance(condition, Not):
        yield from fields(condition.condition)
    else:
        for part in condition.conditions:
            yield from fields(part)


def to_json(condition: Condition) -> dict[str, Any]:
    """The JSON form `parse` reads (a one-value match as `equals`)."""
    if isinstance(condition, Match):
        if len(condition.values) == 1:
            return {"field": condition.field, "equals": condition.values[0]}
        return {"field": condition.field, "in": list(condition.values)}
    if isinstance(condition, Range):
        bounds = {b: _number(getattr(condition, b)) for b in BOUNDS}
        return {
            "field": condition.field,
            "range": {b: v for b, v in bounds.items() if v is not None},
        }
    if isinstance(condition, Not):
        return {"not": to_json(condition.condition)}
    op = "all" if isinstance(condition, All) else "any"
    return {op: [to_json(c) for c in condition.conditions]}


def _number(value: float | None) -> float | int | None:
    """A bound as JSON writes it: a whole number as an integer where one holds it exactly (past
    MAX_EXACT_INT it stays a float: as an integer, parsing it back refused it)."""
    if value is not None and value.is_integer() and abs(value) <= MAX_EXACT_INT:
        return int(value)
    return value
