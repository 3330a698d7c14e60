"""The command line on a tiny model: bad input writes nothing, errors are one line, exit codes."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import pytest

from rag_retriever.cli import build_parser, main
from rag_retriever.cli.common import command_settings
from rag_retriever.settings import ENV_ONLY, Settings, flag_of
from rag_retriever.store import EdgeStore
from rag_retriever.store.base import QDRANT_EF_CONSTRUCT
from tests.conftest import write_jsonl


def collections(data: Path) -> list[str]:
    if not (data / "edge").exists():
        return []
    store = EdgeStore(data / "edge")
    try:
        return store.collection_names()
    finally:
        store.close()


def test_invalid_input_writes_nothing(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "fine"}\n{"id": "a", "text": "dup"}\n', encoding="utf-8")
    assert main(["ingest", str(bad), "--collection", "kb", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 1 problem(s) in") and "duplicate id 'a'" in err
    assert collections(env) == []


def test_ingest_search_collections_rollback(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_jsonl(
        tmp_path / "docs.jsonl",
        [
            {"id": "a", "title": "Apples", "text": "Red apples.", "lang": "en"},
            {"id": "b", "text": "River city.", "lang": "fr"},
        ],
    )
    for _ in range(2):
        assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "unchanged: no new version" in out and "kb__tiny-bert-32__v2" not in out
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress", "--full"]) == 0
    out = capsys.readouterr().out
    assert "kb__tiny-bert-32__v2" in out and "2 reused" in out
    assert (
        main(
            [
                "search",
                "apples",
                "--collection",
                "kb",
                "--mode",
                "bm25",
                "--where",
                "lang=en",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert [h["doc_id"] for h in result["hits"]] == ["a"]
    assert main(["collections", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert (
        listing["kb"]["serving"] == "kb__tiny-bert-32__v2" and len(listing["kb"]["versions"]) == 2
    )
    assert [v["quantization"] for v in listing["kb"]["versions"]] == ["none", "none"]
    # a rollback waits for a write in flight (its lock), up to RAG_LOCK_WAIT_S: a write that
    # finished after it would move the alias off the version rolled back to
    from rag_retriever.ingest.lock import IngestLock

    with pytest.MonkeyPatch.context() as patch, IngestLock(env, "kb"):
        patch.setenv("RAG_LOCK_WAIT_S", "0")
        assert main(["rollback", "kb"]) != 0
    assert "another write of 'kb' is running" in capsys.readouterr().err
    assert main(["rollback", "kb"]) == 0
    assert capsys.readouterr().out.strip() == "kb -> kb__tiny-bert-32__v1"
    assert main(["search", "apples", "--collection", "nope"]) == 2
    err = capsys.readouterr().err
    assert f"does not exist in the data dir {env.resolve()} (RAG_DATA_DIR); existing: kb" in err


def test_collections_says_how_a_version_holds_its_vectors(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "Red apples."}])
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 0
    argv = ["ingest", str(corpus), "--collection", "kb", "--no-progress", "--full"]
    assert main([*argv, "--quantization", "binary2"]) == 0
    capsys.readouterr()
    assert main(["collections"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # only the quantized version has the line, beneath its own
    assert lines[0] == "kb -> kb__tiny-bert-32__v2"
    at = next(i for i, line in enumerate(lines) if line.startswith("  * v2 "))
    assert lines[at + 1].strip() == "vectors: binary2 (float32 originals on disk)"
    assert sum("vectors:" in line for line in lines) == 1


def test_collections_says_a_graph_width_other_than_the_one_new_shards_build_at(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "Red apples."}])
    argv = ["ingest", str(corpus), "--collection", "kb", "--no-progress", "--full"]
    assert main([*argv, "--hnsw-ef-construct", "200"]) == 0
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["collections", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [v["graph_widths"] for v in listing["kb"]["versions"]] == [[200], [QDRANT_EF_CONSTRUCT]]
    assert main(["collections"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # only v1, built wider than new shards are now, has the line, beneath its own
    at = next(i for i, line in enumerate(lines) if line.startswith("    v1 "))
    assert lines[at + 1].strip() == (
        f"graph width: 200 (new shards build at {QDRANT_EF_CONSTRUCT}, RAG_HNSW_EF_CONSTRUCT; a "
        "full build, `ingest --full`, rebuilds every graph at it)"
    )
    assert sum("graph width" in line for line in lines) == 1
    # asked to build at 200 from now on, the listing names v2's width instead
    monkeypatch.setenv("RAG_HNSW_EF_CONSTRUCT", "200")
    assert main(["collections"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0].strip() for line in lines if "graph width" in line] == [
        f"graph width: {QDRANT_EF_CONSTRUCT}"
    ]


def test_bad_setting_is_a_one_line_error(
    env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RAG_DENSE_TOP_N", "lots")
    assert main(["collections"]) == 2
    assert "RAG_DENSE_TOP_N='lots' is invalid" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name", ["../../victim", "/tmp/abs", "made/by/collection/x", "docs__model__v1"]
)
def test_traversing_collection_names_write_nothing(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "A river."}])
    victim = tmp_path / "victim.lock"
    victim.write_text("keep me", encoding="utf-8")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["ingest", str(corpus), "--collection", name, "--no-progress"]) == 2
    assert "collection name" in capsys.readouterr().err
    assert victim.read_text(encoding="utf-8") == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (tmp_path / "made").exists()


def test_a_data_dir_from_0_1_is_refused_with_the_fix(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (env / "qdrant").mkdir(parents=True)
    (env / "indexes").mkdir()
    assert main(["collections"]) == 2
    err = capsys.readouterr().err
    assert "written by rag-retriever 0.1" in err and "Re-ingest" in err


def test_version_and_a_bare_command_answer_without_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rag_retriever import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"rag-retriever {__version__}"
    # the package says the version it was released as (pyproject.toml)
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert __version__ == pyproject["project"]["version"]
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rag-retriever") and "serve" in out and "ingest" in out


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_flag_of_every_command_says_what_it_does() -> None:
    """Each subcommand lists its own flags, each with help; a setting's help names its variable
    and its default, as declared once in settings.py."""
    with_flags = {n for p in _subcommands().values() for n in p.get_default("setting_flags")}
    assert with_flags == set(Settings.model_fields) - ENV_ONLY  # as docs/configuration.md says
    for command, parser in _subcommands().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (command, action.dest)
            if action.option_strings and action.default not in (None, False, []):
                assert str(action.default) in action.help, (command, action.dest)
            if action.dest in parser.get_default("setting_flags"):
                assert f"RAG_{action.dest.upper()}:" in action.help, (command, action.dest)
                assert "(default " in action.help, (command, action.dest)
    flags = {
        c: {o for a in p._actions for o in a.option_strings} for c, p in _subcommands().items()
    }
    assert "--chunk-tokens" in flags["ingest"] and "--chunk-tokens" not in flags["search"]
    assert "--rerank-model" in flags["serve"] and "--rerank-model" not in flags["collections"]
    assert not any("--api-key" in f or "--qdrant-api-key" in f for f in flags.values())


def test_a_bad_flag_value_is_refused_like_a_bad_variable(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:  # a choice: argparse answers
        main(["collections", "--log-level", "loud"])
    assert exit_info.value.code == 2 and "invalid choice: 'LOUD'" in capsys.readouterr().err
    assert main(["search", "q", "--rrf-k", "sixty"]) == 2
    assert "RAG_RRF_K='sixty' is invalid" in capsys.readouterr().err
    assert main(["search", "q", "--otlp-endpoint", "localhost:4318"]) == 2
    err = capsys.readouterr().err  # given as a flag: the message names it too
    assert (
        "RAG_OTLP_ENDPOINT='localhost:4318' is invalid" in err and "(flag --otlp-endpoint)" in err
    )


@pytest.mark.parametrize("name", ["embed_batch_size", "rerank_batch_size"])
def test_a_batch_size_flag_takes_a_number_as_its_variable_does(name: str) -> None:
    flag = flag_of(name)
    args = build_parser().parse_args(["search", "q", flag, "64"])
    assert getattr(command_settings(args), name) == 64
    args = build_parser().parse_args(["search", "q", flag, "auto"])
    assert getattr(command_settings(args), name) == "auto"


@pytest.mark.parametrize(
    "command",
    [
        ["ingest", "{corpus}", "--collection", "kb", "--gate", "{missing}"],
        ["doctor", "--collection", "kb", "--questions", "{missing}"],
        ["tune-fusion", "--collection", "kb", "--questions", "{missing}", "--dry-run"],
        ["improve", "--collection", "kb", "--questions", "{missing}", "--budget", "1m"],
        ["train-embedder", "--collection", "kb", "--questions", "{missing}", "--out", "m"],
        ["train-reranker", "--collection", "kb", "--questions", "{missing}", "--out", "m"],
    ],
)
def test_a_missing_questions_file_is_a_usage_error_before_any_model(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    monkeypatch.setenv("RAG_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RAG_EMBED_MODEL", str(tmp_path / "no-such-model"))  # loading it fails
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "A river."}])
    missing = tmp_path / "questions.jsonl"
    argv = [a.format(corpus=corpus, missing=missing) for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{missing} does not exist: expected a file" in err, err
    assert not (tmp_path / "data").exists()
    build_parser().parse_args(argv)  # a documented command still parses where its files are not


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--questions", "{bad}"], "--questions: "),  # drift against nothing: not a FAIL
        (["--questions", "{empty}"], "holds no questions"),
        (["--duplicate-similarity", "5"], "--duplicate-similarity must be between -1 and 1"),
        (["--max-duplicate-share", "-1"], "--max-duplicate-share must be between 0 and 1"),
    ],
)
def test_doctor_refuses_a_bad_questions_file_or_threshold_before_any_model(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    message: str,
) -> None:
    monkeypatch.setenv("RAG_EMBED_MODEL", str(tmp_path / "no-such-model"))  # loading it fails
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "q1", "question": "where?"}\n', encoding="utf-8")  # no gold ids
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    argv = ["doctor", "--collection", "kb", *(a.format(bad=bad, empty=empty) for a in extra)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_data_dir_that_cannot_be_created_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAG_DATA_DIR", "/proc/rag-retriever-test")  # /proc takes no new folder
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "A river."}])
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot create /proc/rag-retriever-test/locks" in err, err


@pytest.mark.parametrize("module", ["rag_retriever.cli", "rag_retriever.client"])
def test_the_cli_and_the_client_import_without_torch(module: str) -> None:
    """`--help`, `--version` and the httpx client must not pay for torch and transformers."""
    import subprocess
    import sys

    code = (
        f"import sys, {module}; "
        "heavy = sorted({'torch', 'transformers', 'fastapi', 'qdrant_client', 'qdrant_edge'} "
        "& set(sys.modules)); print(','.join(heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_ingest_and_eval_install_under_the_project_namespace(tmp_path: Path) -> None:
    """No global `ingest` or `eval` package: from any directory they are rag_retriever's."""
    import subprocess
    import sys

    code = (
        "import importlib.util as u, rag_retriever.ingest.writer, rag_retriever.eval.evaluation; "
        "print(u.find_spec('ingest') is None, u.find_spec('eval') is None)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert done.stdout.split() == ["True", "True"]


def test_bm25_search_collections_and_rollback_load_no_model(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They start fast: BM25 needs no embedder, listing and moving an alias need no model at all,
    so torch is not even imported."""
    import subprocess
    import sys

    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "Red apples."}])
    for extra in ([], ["--full"]):  # two versions, for the rollback
        assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress", *extra]) == 0
    capsys.readouterr()
    commands = [
        ["search", "apples", "--collection", "kb", "--mode", "bm25", "--json"],
        ["collections"],
        ["rollback", "kb"],
    ]
    for argv in commands:
        code = (
            "import sys; from rag_retriever.cli import main; status = main(sys.argv[1:]); "
            "print('torch' in sys.modules, status, file=sys.stderr)"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True
        )
        assert done.stderr.split()[-2:] == ["False", "0"], (argv, done.stderr)


@pytest.mark.parametrize(
    "rows",
    [[{"id": "a", "title": "the", "text": "the of and"}], [{"id": "a", "text": "# S"}]],
)
def test_a_corpus_of_stop_words_is_one_line_and_exit_2(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: list[dict[str, object]]
) -> None:
    corpus = write_jsonl(tmp_path / "stop.jsonl", rows)
    assert main(["ingest", str(corpus), "--collection", "kb", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no document has a word to index" in err
    assert "Traceback" not in err and collections(env) == []


def test_a_data_dir_that_is_a_file_is_one_line_and_exit_2(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("not a folder", encoding="utf-8")
    for data_dir in (tmp_path / "a-file", tmp_path / "a-file" / "below"):
        monkeypatch.setenv("RAG_DATA_DIR", str(data_dir))
        assert main(["collections"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is a file; point it at a folder" in err, err


def test_a_second_ingest_reports_the_lock_before_loading_anything(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first ingest holds the lock; the second must say so at once, not after loading its
    documents and model (here neither could even be loaded)."""
    from rag_retriever.ingest.lock import IngestLock

    monkeypatch.setenv("RAG_EMBED_MODEL", str(tmp_path / "no-such-model"))
    with IngestLock(env, "kb"):
        assert main(["ingest", str(tmp_path / "missing.jsonl"), "--collection", "kb"]) == 2
    assert "another write of 'kb' is running" in capsys.readouterr().err


def test_serve_stopped_by_sigterm_says_nothing_about_ingests(
    env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import signal

    from rag_retriever.service import server

    def serve_until_stopped(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # what `docker stop` sends

    monkeypatch.setattr(server, "serve", serve_until_stopped)
    assert main(["serve"]) == 143
    err = capsys.readouterr().err
    assert err.strip() == "stopped by SIGTERM", err


def test_an_ingest_prints_its_final_progress_line_once(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Off a terminal (capsys is none): one plain line per stage, no bar's escapes."""
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "Red apples."}])
    assert main(["ingest", str(corpus), "--collection", "kb"]) == 0
    err = capsys.readouterr().err
    assert "\x1b[" not in err and "\r" not in err, repr(err)
    stages = [line.split(":")[0].split()[0] for line in err.splitlines()]
    assert sorted(stages) == ["chunking", "embedding", "tokenising", "writing"], err


def test_metadata_the_engine_cannot_store_is_exit_2_and_writes_nothing(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The inputs of issue 39, from a file and from argv: refused as the HTTP writes refuse them
    (tests/test_write_api.py), before anything is written."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"id": "a", "text": "alpha apple"}])
    assert main(["ingest", str(good), "--collection", "kb", "--no-progress"]) == 0
    before = collections(env)
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    deep = "[" * 200 + "]" * 200
    bad.write_text(
        f'{{"id": "b", "text": "bravo", "score": NaN}}\n{{"id": "c", "text": "c", "k": {deep}}}\n'
        '{"id": "d", "text": "delta", "tag": "\\ud800"}\n',
        encoding="utf-8",
    )
    for argv, expected in (
        (
            ["ingest", str(bad), "--collection", "other", "--no-progress"],
            "metadata['score'] is nan",
        ),
        (["update", "--upsert", str(bad), "--collection", "kb"], "nests deeper than 16 levels"),
        (["update", "--delete", "a\udcff", "--collection", "kb"], "id 'a\\udcff' is not valid"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, err
        assert "nothing was" in err and expected in err, err
    assert collections(env) == before


def test_a_missing_collection_or_reranker_is_refused_before_the_embedder_loads(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedder named here cannot load: had it been loaded first, the error would say so."""
    monkeypatch.setenv("RAG_EMBED_MODEL", str(tmp_path / "no-model"))
    assert main(["doctor", "--collection", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope' does not exist" in err and "no-model" not in err
    assert main(["search", "anything", "--mode", "rerank"]) == 2
    err = capsys.readouterr().err
    assert "mode 'rerank' needs a reranker" in err and "no-model" not in err
