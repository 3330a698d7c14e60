"""Every shell command of README.md and docs/*.md is run here, or named in NOT_RUN: docs cannot drift.

A command is a line of a ```bash, ```sh, ```shell or ```console block (in a console block, the
lines that start with `$ `), with `\\` continuation lines joined; comment lines are not commands.

Each page's commands run in order, in a folder of their own that holds copies of `docs/`, `eval/`
and `examples/` and the placeholder files of FILES, with `.venv/bin` first on PATH and the tiny
encoder of conftest.py as `RAG_EMBED_MODEL` (ingest, search, eval and serve then take seconds; the
real model's figures are checked by `make demo` and tests/test_readme.py), except the pages of
REAL_MODEL_PAGES (marked `model`). A page may need something an earlier page made: SETUP runs it
first. The commands are the docs' own, with one
edit: the HTTP service's port (8000 in the docs) becomes a free one. How each runs:

- `rag-retriever serve ...` (with or without `&`) starts in the background and must answer
  `/healthz`; it stops when the next `serve` starts or the page ends.
- `rag-retriever ...` and `python SCRIPT.py ...` without shell syntax run in this process, through
  the console script's entry point or the script itself, with the page's environment and folder
  (torch is imported once instead of once a command).
- Everything else (`export`, `source`, `curl`, pipes, redirections, `$(...)`) runs in bash; what
  it exports is carried to the next command.

Each must exit 0, print nothing that looks like a traceback or a JSON error, and match EXPECT
where a cheap check says something about its output. A command that is not run is matched by
exactly one entry of NOT_RUN, which says why and what covers it instead; its arguments are parsed
by its own argument parser where it has one, so a renamed flag fails here too. Every entry must
match a command (no stale entries), and a command that is neither listed nor runnable fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = ("bash", "sh", "shell", "console")
DOCS_PORT = "8000"  # the port the docs' commands use; the one edit is a free port instead
# A serving process imports torch and loads a model: generous on 2 busy cores.
SERVER_START_S = 120.0
COMMAND_TIMEOUT_S = 300.0

# Commands not run by this test: (pattern matched at the start of a command, why not, what covers
# it instead). Patterns are regular expressions; each must match at least one command.
SHARED = r"(RAG_[A-Z_]+=\S+ )*"
NOT_RUN: list[tuple[str, str, str]] = [
    (
        r"make demo$",
        "creates .venv and installs the project from PyPI (minutes)",
        "its three commands are the README tour's steps 1-3, run here; `make demo` prints the demo's eval",
    ),
    (
        r"make test$",
        "runs the whole suite, this test included",
        "CI runs it",
    ),
    (
        r"(cp -r docs docker/corpus && )?docker compose ",
        "no Docker engine on the development machine",
        "tests/test_docker.py (compose files and Dockerfiles parsed, their commands parsed by the CLI)",
    ),
    (
        r"python -m bench\b",
        "benchmarks take minutes to about an hour and need ../shared/data; arguments parsed here",
        "`make bench`; each figure in docs/benchmarks.md names its run",
    ),
    (
        SHARED + r"(rag-retriever (ingest|tune-fusion|improve|train-embedder|train-reranker)|"
        r"python eval/recall_at_k\.py) .*(\.\./shared/data|models/minilm-s|models/reranker-s)",
        "the SQuAD and SciFact sets (../shared/data) with the real model: minutes to hours; "
        "arguments parsed here",
        "the same commands run here on docs/ (README tour, docs/versions.md, docs/evaluation.md); "
        "training and tuning on tiny models in tests/test_train_embedder.py, "
        "tests/test_train_reranker.py, tests/test_improve.py, tests/test_fusion_tuning.py",
    ),
    (
        r"export RAG_(DATA_DIR=squad-data|EMBED_MODEL=models/minilm-squad)$",
        "the environment of the SQuAD training commands, which are listed above",
        "`export` runs here in the README tour",
    ),
]

# Placeholder files that the docs' commands name (your corpus, your questions).
FILES: dict[str, str] = {
    "corpus.jsonl": "\n".join(
        json.dumps(row)
        for row in [
            {"id": "old-page", "title": "Old page", "text": "The red river runs to the sea."},
            {"id": "guide", "title": "Guide", "text": "Apples and pears grow on the mountain."},
            {"id": "faq", "title": "FAQ", "text": "To undo a bad update, roll the alias back."},
        ]
    )
    + "\n",
    "changed.jsonl": json.dumps(
        {"id": "guide", "title": "Guide", "text": "Green apples grow by the river."}
    )
    + "\n",
    "new-folder/intro.md": "# Intro\n\nBlue wine from the hotel by the river.\n",
    "gone.txt": "faq\n",
    "questions.jsonl": "\n".join(
        json.dumps(row)
        for row in [
            {"id": "q1", "question": "Where do apples grow?", "gold_doc_ids": ["guide"]},
            {"id": "q2", "question": "How do I undo a bad update?", "gold_doc_ids": ["faq"]},
        ]
    )
    + "\n",
}

# What a page needs that another page made (the tour's collection, a running service).
INGEST_DEMO = "rag-retriever ingest docs --collection demo"
SETUP: dict[str, list[str]] = {
    "docs/evaluation.md": [INGEST_DEMO],
    "docs/serving.md": [INGEST_DEMO],
    "docs/operating.md": [INGEST_DEMO],
    "docs/querying.md": [INGEST_DEMO, "rag-retriever serve --collection demo"],
}

# Pages run with the real all-MiniLM-L6-v2 instead of the tiny encoder, and why.
REAL_MODEL_PAGES: dict[str, str] = {
    "docs/operating.md": "`doctor` exits 1 when a check fails, and the tiny encoder's random "
    "vectors are all near-duplicates by design; with the real model every check passes",
}

# Cheap checks of what a command printed: (pattern of the command, pattern its output must match).
EXPECT: list[tuple[str, str]] = [
    (r"rag-retriever ingest .*--no-promote", r"not promoted|not served|built"),
    (r"rag-retriever (ingest|update) ", r"documents +\d+ upserted"),
    (r"rag-retriever search .*--json", r'"hits": \[\s*\{'),
    (r"rag-retriever search ", r"\d+ hits"),
    (r"rag-retriever collections", r"__v\d+"),
    (r"rag-retriever (rollback|promote) ", r"__v\d+"),
    (r"python eval/recall_at_k\.py ", r"recall@1"),
    (r"python examples/chat_app\.py ", r"\[1\]"),
    (r"curl .*/v1/search -H", r'"hits": ?\[\{|^$'),
    (r"curl .*/metrics", r"^rag_"),
    (r"rag-retriever questions ", r"questions +[1-9]\d* written"),
    (r"rag-retriever doctor ", r"^ok +near-duplicates"),
    (r"curl .*/documents", r'"status":"committed"'),
    (r"curl .*/v1/feedback", r'"status":"recorded"'),
]
FAILURE_SIGNS = re.compile(r"Traceback \(most recent call last\)|^\{\"error\"", re.MULTILINE)


# ---------------------------------------------------------------- extracting the commands


@dataclass(frozen=True)
class Command:
    page: str  # relative to the repository root
    line: int  # where the command starts in the page
    text: str  # continuation lines joined, a trailing comment dropped (as bash does)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def strip_comment(line: str) -> str:
    """The line without a bash comment: `#` at the start of a word, outside quotes."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands_of(page: Path) -> list[Command]:
    name = page.relative_to(ROOT).as_posix()
    commands: list[Command] = []
    fence: str | None = None
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if fence is None:
            match = re.match(r"```(\w+)", raw)
            if match and match.group(1) in SHELL_FENCES:
                fence = match.group(1)
            elif raw.startswith("```"):
                fence = ""  # a block of another language: skipped whole
            continue
        if raw.startswith("```"):
            assert not pending, f"{name}:{start}: a block ends inside a continued command"
            fence = None
            continue
        if fence == "":
            continue
        line = raw
        if fence == "console" and not pending:
            if not line.startswith("$ "):
                continue  # the output of the command above it
            line = line[2:]
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line.strip())
        commands.append(Command(name, start, strip_comment(" ".join(pending))))
        pending = []
    assert fence is None, f"{name}: a code block is never closed"
    return commands


def all_commands() -> list[Command]:
    return [command for page in PAGES for command in commands_of(page)]


def listed(command: Command) -> list[tuple[str, str, str]]:
    return [entry for entry in NOT_RUN if re.match(entry[0], command.text)]


# ---------------------------------------------------------------- running them


def words(command: str) -> list[str]:
    lexer = shlex.shlex(strip_comment(command), posix=True, punctuation_chars=True)
    lexer.commenters = ""
    lexer.whitespace_split = True
    return list(lexer)


SHELL_SYNTAX = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "(", ")", "2>&1"}


def split_assignments(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 prog args` -> ({A: 1, B: 2}, [prog, args])."""
    assignments: dict[str, str] = {}
    rest = list(argv)
    while rest and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", rest[0]):
        key, _, value = rest.pop(0).partition("=")
        assignments[key] = value
    return assignments, rest


def is_serve(command: str) -> bool:
    _, argv = split_assignments(words(command))
    return argv[:2] == ["rag-retriever", "serve"]


def in_process(command: str) -> bool:
    """A `rag-retriever` command (not `serve`) or a `python SCRIPT.py` without shell syntax."""
    if "$" in command or "`" in command:
        return False
    argv_all = words(command)
    if SHELL_SYNTAX & set(argv_all):
        return False
    _, argv = split_assignments(argv_all)
    if argv[:1] == ["rag-retriever"]:
        return argv[1:2] != ["serve"]
    return len(argv) >= 2 and argv[0] == "python" and argv[1].endswith(".py")


@dataclass
class Result:
    command: str
    code: int
    output: str


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def rag_retriever_main() -> Any:
    (script,) = entry_points(group="console_scripts", name="rag-retriever")
    return script.load()


def run_argv_in_process(argv: list[str], env: Mapping[str, str], cwd: Path) -> tuple[int, str]:
    out = io.StringIO()
    saved_argv, saved_cwd = sys.argv, Path.cwd()
    code: object = 0
    try:
        os.chdir(cwd)
        with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if argv[0] == "rag-retriever":
                    code = rag_retriever_main()(argv[1:])
                else:
                    sys.argv = argv[1:]
                    runpy.run_path(argv[1], run_name="__main__")
            except SystemExit as stop:
                code = stop.code
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    return status, out.getvalue()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Workspace:
    """One page's folder, environment, and the HTTP service its commands started."""

    folder: Path
    env: dict[str, str]
    port: int
    server: subprocess.Popen[bytes] | None = None
    server_log: Path | None = None
    results: list[Result] = field(default_factory=list)

    def with_port(self, command: str) -> str:
        command = re.sub(rf"(localhost|127\.0\.0\.1):{DOCS_PORT}\b", rf"\1:{self.port}", command)
        command = re.sub(rf"--port {DOCS_PORT}\b", f"--port {self.port}", command)
        if is_serve(command) and "--port" not in command:
            body = strip_comment(command).rstrip()
            background = body.endswith("&")
            body = body.rstrip("&").rstrip()
            command = f"{body} --port {self.port}" + (" &" if background else "")
        return command

    def run(self, command: str) -> Result:
        command = self.with_port(command)
        if is_serve(command):
            result = self.start_server(command)
        elif in_process(command):
            assignments, argv = split_assignments(words(command))
            code, output = run_argv_in_process(argv, {**self.env, **assignments}, self.folder)
            result = Result(command, code, output)
        else:
            result = self.run_shell(command)
        self.results.append(result)
        return result

    def run_shell(self, command: str) -> Result:
        env_file = self.folder / ".env-after"
        script = f'set -a\n{command}\n__rc=$?\nenv -0 > "{env_file}"\nexit $__rc\n'
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        if env_file.exists():
            carried = dict(
                item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item
            )
            self.env = {k: v for k, v in carried.items() if not k.startswith("__")}
            env_file.unlink()
        return Result(command, done.returncode, done.stdout + done.stderr)

    def start_server(self, command: str) -> Result:
        self.stop_server()
        body = strip_comment(command).rstrip().rstrip("&").rstrip()
        self.server_log = self.folder / f".serve-{len(self.results)}.log"
        with self.server_log.open("wb") as log:
            self.server = subprocess.Popen(
                ["bash", "-c", f"set -a\n{body}"],
                cwd=self.folder,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                return Result(command, self.server.returncode or 1, self.server_log.read_text())
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).is_success:
                    return Result(command, 0, "")
            time.sleep(0.25)
        return Result(command, 124, f"no /healthz within {SERVER_START_S} s")

    def stop_server(self) -> None:
        if self.server is None:
            return
        if self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        self.server = None


def make_workspace(folder: Path, encoder_dir: Path | None) -> Workspace:
    """The page's folder and environment: `encoder_dir` is the embedder (None: the default)."""
    for name in ("docs", "eval", "examples"):
        copy_tree(ROOT / name, folder / name)
    for name, text in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    bin_dir = Path(sys.executable).parent
    activate = bin_dir / "activate"
    (folder / ".venv").mkdir()
    if activate.exists():
        (folder / ".venv" / "bin").symlink_to(bin_dir)
    else:  # a Python that is not a virtualenv: activating it only puts it first on PATH
        (folder / ".venv" / "bin").mkdir()
        (folder / ".venv" / "bin" / "activate").write_text(f'PATH="{bin_dir}:$PATH"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAG_")}
    if encoder_dir is not None:
        env["RAG_EMBED_MODEL"] = str(encoder_dir)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        RAG_DEVICE="cpu",
        RAG_LOG_LEVEL="WARNING",
        RAG_COMPACTION=os.environ.get("RAG_COMPACTION", "inline"),
        TQDM_DISABLE="1",
    )
    return Workspace(folder, env, free_port())


def copy_tree(source: Path, target: Path) -> None:
    for path in source.rglob("*"):
        if "__pycache__" in path.parts or path.is_dir():
            continue
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(path.read_bytes())


def check(result: Result, where: Command | str) -> None:
    assert result.code == 0, f"{where}\nexit {result.code}\n{result.output[-3000:]}"
    assert not FAILURE_SIGNS.search(result.output), f"{where}\n{result.output[-3000:]}"
    for pattern, expected in EXPECT:
        if re.match(pattern, result.command):
            assert re.search(expected, result.output, flags=re.MULTILINE), (
                f"{where}\nexpected /{expected}/ in:\n{result.output[-3000:]}"
            )
            break


def runnable_pages() -> list[str]:
    pages = {c.page for c in all_commands() if not listed(c)}
    return sorted(pages)


# ---------------------------------------------------------------- the tests


def test_the_pages_have_commands_and_every_listed_entry_is_used() -> None:
    commands = all_commands()
    assert any(c.page == "README.md" and c.text.startswith("make demo") for c in commands)
    assert len({c.page for c in commands}) >= 5, "no shell block found: is the parser broken?"
    for pattern, why, covered_by in NOT_RUN:
        assert why and covered_by
        assert any(re.match(pattern, c.text) for c in commands), f"stale NOT_RUN entry: {pattern}"
    for page in SETUP:
        assert (ROOT / page).exists(), f"SETUP names a missing page: {page}"


def test_each_command_is_run_or_listed_once() -> None:
    for command in all_commands():
        entries = listed(command)
        assert len(entries) <= 1, f"{command} is matched by {len(entries)} NOT_RUN entries"
        if not entries:
            assert command.page in runnable_pages()
            assert words(command.text), f"{command}: nothing to run"


def test_the_readme_opens_with_make_demo_and_make_test() -> None:
    first = commands_of(ROOT / "README.md")[:2]
    assert [c.text for c in first] == ["make demo", "make test"]


class _Parsed(Exception):
    """Raised by argparse once the arguments parsed: the program itself does not run."""


def parse_only(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.chdir(ROOT)
    with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(_Parsed):
        try:
            if argv[0] == "rag-retriever":
                rag_retriever_main()(argv[1:])
            elif argv[:2] == ["python", "-m"]:
                monkeypatch.setattr(sys, "argv", [argv[2], *argv[3:]])
                monkeypatch.syspath_prepend(str(ROOT))
                runpy.run_module(argv[2], run_name="__main__", alter_sys=False)
            else:
                monkeypatch.setattr(sys, "argv", argv[1:])
                runpy.run_path(str(ROOT / argv[1]), run_name="__main__")
        except SystemExit as stop:
            message = f"{argv}: refused by its parser ({stop.code}): {err.getvalue()}"
            raise AssertionError(message) from None


@pytest.mark.parametrize(
    "command",
    [
        c
        for c in all_commands()
        if listed(c)
        and (lambda argv: argv[:1] == ["rag-retriever"] or argv[:1] == ["python"])(
            split_assignments(words(c.text))[1]
        )
    ],
    ids=str,
)
def test_listed_commands_parse(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    _, argv = split_assignments(words(command.text))
    parse_only(argv, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=[pytest.mark.model] if page in REAL_MODEL_PAGES else [])
        for page in runnable_pages()
    ],
)
def test_page_commands_run(page: str, tmp_path: Path, tiny_encoder_dir: Path) -> None:
    encoder = None if page in REAL_MODEL_PAGES else tiny_encoder_dir
    workspace = make_workspace(tmp_path, encoder)
    try:
        for setup in SETUP.get(page, []):
            check(workspace.run(setup), f"setup of {page}: {setup}")
        to_run = [command for command in commands_of(ROOT / page) if not listed(command)]
        assert to_run
        for command in to_run:
            check(workspace.run(command.text), command)
    finally:
        workspace.stop_server()
