"""Which `improve` run the options ask for: one held-out part (`Improve`, improve.py) or
k-fold decisions (`KFoldImprove`, improve_kfold.py).

Example:
    >>> run = improver(settings, Path("questions.jsonl"), work_dir=Path("improve-out"),
    ...                options=ImproveOptions(steps=("fusion",)))       # doctest: +SKIP
    >>> run.run()                                                        # doctest: +SKIP

It lives above both runs so that neither imports the other's module back (improve_kfold.py
builds on improve.py). It does not run anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rag_retriever.errors import ConfigError
from rag_retriever.eval.questions import load_questions
from rag_retriever.settings import Settings
from rag_retriever.store import open_store
from rag_retriever.training.improve import Improve, ImproveOptions
from rag_retriever.training.improve_kfold import KFoldImprove

# Below this many labelled questions a held-out part is too small to judge a step by, and too
# costly to train without: each step is judged by k-fold cross-validation instead (issue 21:
# on SciFact's 809 claims an embedder trained on 404 was dropped, one trained on all 809 helps).
KFOLD_BELOW = 2000
KFOLDS_DEFAULT = 5
MAX_FOLDS = 10


def improver(
    settings: Settings,
    questions_path: Path,
    *,
    work_dir: Path,
    options: ImproveOptions,
    say: Callable[[str], None] = print,
) -> Improve:
    """The run `options` ask for: k-fold decisions (KFoldImprove) or one held-out part
    (Improve); with `folds` unset, k folds for fewer than KFOLD_BELOW questions."""
    folds = options.folds
    if folds is None:
        folds = KFOLDS_DEFAULT if len(load_questions(questions_path)[0]) < KFOLD_BELOW else 1
    if not 1 <= folds <= MAX_FOLDS:
        raise ConfigError(
            f"--folds takes 1 (one held-out part) to {MAX_FOLDS} (k-fold decisions), got {folds}"
        )
    split = (options.held_out, options.fusion_part)
    if folds > 1 and split != (ImproveOptions.held_out, ImproveOptions.fusion_part):
        raise ConfigError(
            f"--held-out and --fusion-part shape the three-part split of --folds 1; with {folds} "
            "folds every question is judged out of fold (add --folds 1 to split instead)"
        )
    if folds == 1:
        options = dataclasses.replace(options, folds=1)
        return Improve(settings, questions_path, work_dir=work_dir, options=options, say=say)
    # k-fold decisions judge fusions of first-stage lists: a live version that serves a reranker
    # was compared, reranked, with hybrid figures, and its reranker passed to the candidate
    # unjudged
    reranker = _served_reranker(settings)
    if reranker is None:
        options = dataclasses.replace(options, folds=folds)
        return KFoldImprove(settings, questions_path, work_dir=work_dir, options=options, say=say)
    if options.folds is not None:
        raise ConfigError(
            f"{settings.collection} serves a reranker ({reranker.get('source')}), which k-fold "
            f"decisions cannot judge (they score fusions of the first-stage lists): pass "
            f"--folds 1 (one held-out part, judged in the mode the version serves)"
        )
    say(
        f"folds      1: {settings.collection} serves a reranker, which k-fold decisions cannot "
        f"judge (one held-out part instead)"
    )
    options = dataclasses.replace(options, folds=1)
    return Improve(settings, questions_path, work_dir=work_dir, options=options, say=say)


def _served_reranker(settings: Settings) -> dict[str, Any] | None:
    """The reranker the version `settings.collection` serves names, if any."""
    store = open_store(settings)
    try:
        reranker = store.record(store.resolve(settings.collection)).reranker
    finally:
        store.close()
    return None if reranker is None else dict(reranker)
