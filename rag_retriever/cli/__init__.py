"""The `rag-retriever` command line: ingest, search, collections, promote, rollback, serve, train.

One module per family of commands (`ingest`: ingest, update, compact; `query`: search and the
versions; `operate`: serve, doctor, questions; `train`: training and improve; `common`: the
settings each reads); this module builds the parser from them and runs one command.

Example:
    rag-retriever ingest docs/ --collection demo
    rag-retriever search "how are chunks sized?" --collection demo -k 5

Settings come from `RAG_*` environment variables; flags override them. Errors print one line
(what, why, the fix) and exit with status 2; a refused promotion exits with 3.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from rag_retriever import __version__, tracing
from rag_retriever.cli.common import check_files, command_settings
from rag_retriever.cli.ingest import add_ingest, add_update
from rag_retriever.cli.operate import add_doctor, add_plan, add_questions, add_serve
from rag_retriever.cli.query import add_search, add_versions, format_result
from rag_retriever.cli.train import (
    EXIT_WORSE,
    add_improve,
    add_train_embedder,
    add_train_reranker,
    add_tune_fusion,
    training_verdict,
)
from rag_retriever.errors import RagError

__all__ = ["EXIT_WORSE", "build_parser", "format_result", "main", "training_verdict"]


# -- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rag-retriever",
        description="Retrieval backend for RAG: ingest, search, evaluate, serve.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_ingest(sub)
    add_update(sub)
    add_questions(sub)
    add_doctor(sub)
    add_search(sub)
    add_versions(sub)
    add_train_embedder(sub)
    add_train_reranker(sub)
    add_tune_fusion(sub)
    add_improve(sub)
    add_serve(sub)
    add_plan(sub)
    return parser


# What a stop keeps, for the commands that write: an ingest removes its unfinished version before
# it exits (the alias is only ever moved to a complete one); training writes its model only when
# it is done; improve saves each finished step. Other commands (serve, search, ...) keep nothing.
_TRAINING_STOP = "no model was written (a model is written only when training is done)"
_STOP_NOTES = {
    "ingest": "nothing unfinished was kept (an unpromoted partial version is removed, the alias "
    "serves what it served before, the ingest lock is released)",
    "train-embedder": _TRAINING_STOP,
    "train-reranker": _TRAINING_STOP,
    "tune-fusion": "nothing was stored",
    "improve": "each finished step is saved; run the same command again to resume",
}


def _stopped(how: str, command: str) -> str:
    note = _STOP_NOTES.get(command)
    return f"{how}: {note}" if note else how


class Stopped(BaseException):
    """SIGTERM arrived (`docker stop`, systemd): unwinds like Ctrl-C, so cleanup runs."""


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise Stopped()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        check_files(args)  # a file the command reads, refused before it loads anything
        settings = command_settings(args)
        logging.basicConfig(
            level=getattr(logging, settings.log_level.upper(), logging.INFO),
            format="%(levelname)s %(name)s: %(message)s",
        )
        tracing.configure_from(settings)
        return int(args.func(args))
    except RagError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_stopped("interrupted", args.command), file=sys.stderr)
        return 130
    except Stopped:
        print(_stopped("stopped by SIGTERM", args.command), file=sys.stderr)
        return 143
    except BrokenPipeError:  # `rag-retriever search ... | head`: the reader left, not an error
        sys.stderr.close()
        return 0
