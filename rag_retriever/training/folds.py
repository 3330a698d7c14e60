"""K folds of labelled questions, by document: no gold document has questions in two folds.

Example:
    >>> from rag_retriever.eval.questions import Question
    >>> qs = [Question(str(i), "q", (f"d{i % 6}",), (), (), i) for i in range(12)]
    >>> [len(f) for f in folds_by_document(qs, 3, seed=0)]
    [4, 4, 4]

Questions are grouped by document (`document_groups`: two questions that share any gold
document are in one group, as `split_by_document` does), the groups are shuffled with `seed` and each goes to the fold that holds the fewest questions so far, so the
folds are as even as the groups allow. Questions keep their input order inside a fold.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rag_retriever.errors import InvalidRequest
from rag_retriever.eval.questions import Question


def document_groups(questions: Sequence[Question]) -> dict[str, list[int]]:
    """The questions' indices grouped so that no gold document has questions in two groups: a
    question with several gold documents joins their groups (grouped by its first alone, a
    claim citing two abstracts left the second on the other side of a split). A question
    without gold is a group of its own. Keyed by each group's smallest document id (or the
    question's id)."""
    parent: dict[str, str] = {}

    def root(doc: str) -> str:
        while parent.setdefault(doc, doc) != doc:
            parent[doc] = parent[parent[doc]]  # path halving
            doc = parent[doc]
        return doc

    for q in questions:
        for doc in q.gold_doc_ids[1:]:
            a, b = root(q.gold_doc_ids[0]), root(doc)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        key = root(q.gold_doc_ids[0]) if q.gold_doc_ids else f"question {q.id}"
        groups.setdefault(key, []).append(i)
    return groups


def folds_by_document(questions: Sequence[Question], k: int, *, seed: int) -> list[list[Question]]:
    """`k` folds of `questions`; InvalidRequest when there are fewer documents than folds."""
    groups = document_groups(questions)
    if k < 2 or len(groups) < k:
        raise InvalidRequest(
            f"{k} folds need at least 2 folds and one document per fold; the questions have "
            f"{len(groups)} gold documents"
        )
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    members: list[list[int]] = [[] for _ in range(k)]
    for key in keys:
        smallest = min(range(k), key=lambda f: len(members[f]))
        members[smallest].extend(groups[key])
    return [[questions[i] for i in sorted(fold)] for fold in members]
