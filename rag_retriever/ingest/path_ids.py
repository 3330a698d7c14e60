"""Folder upserts that would make a second document of a file the collection already holds.

Example:
    >>> alternatives("returns.md", Path("/srv/kb/policies"))
    ['kb/policies/returns.md', 'policies/returns.md', 'srv/kb/policies/returns.md']

A folder's ids are its files' paths relative to the folder passed (or to `--root`). Ingest
`kb/` and then upsert `kb/policies/` without `--root kb`, and `policies/returns.md` comes back as
`returns.md`: a new id, so a second document beside the first, both served. `id_clashes` finds
such ids before anything is written: an id the live version does not hold whose same file, seen
from a folder above or below the one passed, the live version does hold. It reads only those
candidate ids (an indexed lookup), never the whole collection.

Does not catch a file moved to another folder (its old id is another path; delete it) or
ids made in another way (.jsonl ids are the caller's own).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path, PurePosixPath

from rag_retriever.errors import DocumentError
from rag_retriever.records import SearchFilter
from rag_retriever.store import Store

# Ids per filtered read of the live version.
LOOKUP_BATCH = 256


def alternatives(doc_id: str, folder: Path) -> list[str]:
    """The ids the same file would have had with the root one or more folders higher (the
    folder's own trailing names before it) or lower (the id's leading folders dropped)."""
    out: set[str] = set()
    names = [n for n in folder.resolve().parts[1:] if n]  # without the filesystem root
    for k in range(1, len(names) + 1):
        out.add("/".join([*names[-k:], doc_id]))
    parts = PurePosixPath(doc_id).parts
    for j in range(1, len(parts)):
        out.add("/".join(parts[j:]))
    out.discard(doc_id)
    return sorted(out)


def id_clashes(
    store: Store, live_name: str, base: Path, ids: Sequence[str], *, deleting: Collection[str] = ()
) -> list[str]:
    """One line per id (a path relative to the folder `base`) that is new to `live_name` while
    the same file under another root is there (and not deleted by the same change): "returns.md
    would be a second document beside policies/returns.md", then a line saying what to do;
    empty when none."""
    wanted = {i: alternatives(i, base) for i in ids}
    live = _present(store, live_name, [*ids, *(a for alts in wanted.values() for a in alts)])
    lines = []
    for doc_id, alts in wanted.items():
        if doc_id in live:
            continue
        there = [a for a in alts if a in live and a not in deleting]
        if there:
            lines.append(f"{doc_id} would be a second document beside {', '.join(there)}")
    if lines:
        lines.append(
            f"ids are file paths relative to {base}: pass --root with the folder the collection "
            f"was ingested from (e.g. `--upsert kb/policies --root kb` after `ingest kb`), or "
            f"delete the old ids in the same update if the files really moved"
        )
    return lines


def refuse_second_copies(
    store: Store,
    alias: str,
    folder_ids: Mapping[Path, Sequence[str]],
    *,
    deleting: Collection[str] = (),
) -> None:
    """DocumentError naming every clash of these folders' ids (each folder's ids relative to its
    key: the folder passed, or the root) with the version `alias` serves; nothing when none."""
    live_name = store.resolve(alias)
    lines: list[str] = []
    for base, ids in folder_ids.items():
        lines += id_clashes(store, live_name, base, ids, deleting=deleting)
    if lines:
        raise DocumentError("nothing was written:\n  " + "\n  ".join(lines))


def _present(store: Store, name: str, ids: Sequence[str]) -> set[str]:
    """Which of these document ids `name` holds."""
    unique = sorted(set(ids))
    found: set[str] = set()
    for at in range(0, len(unique), LOOKUP_BATCH):
        flt = SearchFilter(doc_ids=tuple(unique[at : at + LOOKUP_BATCH]))
        found.update(str(r.payload["doc_id"]) for r in store.scroll(name, flt=flt))
    return found
