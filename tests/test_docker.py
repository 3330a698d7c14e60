"""The Docker files, checked without a Docker engine: the compose file parsed with PyYAML, the
Dockerfiles parsed instruction by instruction, their commands parsed by the real CLI parser and
their health checks run against a real server."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rag_retriever import cli
from rag_retriever.service.server import create_app, serve_in_thread
from rag_retriever.settings import Settings

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value)
    return value


def parser() -> Any:
    return cli.build_parser()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` / `${VAR}` substitution, for the variables used here."""

    def sub(match: re.Match[str]) -> str:
        return env.get(match["name"]) or (match["default"] or "")

    return re.sub(r"\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}", sub, value)


def port_pairs(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host binding, container port) of each short-syntax port."""
    pairs = []
    for spec in service.get("ports", []):
        host, _, container = str(spec).rpartition(":")
        pairs.append((host, int(container)))
    return pairs


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """target -> (source, mode) of each short-syntax volume."""
    out = {}
    for spec in service.get("volumes", []):
        source, target, *mode = str(spec).split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


# -- compose ------------------------------------------------------------------------------------


def test_compose_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"qdrant", "retriever", "ingest"}
    assert set(compose["volumes"]) == {"qdrant-storage", "rag-data"}


def test_qdrant_service_has_collection_metadata_ports_and_storage(compose: dict[str, Any]) -> None:
    qdrant = compose["services"]["qdrant"]
    repo, _, tag = qdrant["image"].partition(":")
    assert repo == "qdrant/qdrant"
    version = tuple(int(x) for x in re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", tag).groups())  # type: ignore[union-attr]
    assert version >= (1, 16, 0)  # collection metadata (our version state) arrived in 1.16
    assert {port for _, port in port_pairs(qdrant)} == {6333, 6334}
    assert all(host == "127.0.0.1:" + str(port) for host, port in port_pairs(qdrant))
    assert mounts(qdrant)["/qdrant/storage"][0] == "qdrant-storage"


def test_retriever_service(compose: dict[str, Any]) -> None:
    retriever = compose["services"]["retriever"]
    assert retriever["build"]["dockerfile"] == "docker/Dockerfile"
    assert (DOCKER / retriever["build"]["context"] / retriever["build"]["dockerfile"]).is_file()
    env = {k: interpolate(str(v), {}) for k, v in retriever["environment"].items()}
    assert env["RAG_QDRANT_URL"] == "http://qdrant:6333"  # the service name, on the compose network
    settings = Settings.from_env(env)  # the environment is valid as the service will read it
    assert settings.qdrant_url == "http://qdrant:6333" and settings.api_key is None
    assert (
        Settings.from_env(
            {**env, "RAG_API_KEY": interpolate("${RAG_API_KEY:-}", {"RAG_API_KEY": "k"})}
        ).api_key
        == "k"
    )
    data = mounts(retriever)[env["RAG_DATA_DIR"]]
    assert data[0] in compose["volumes"]  # RAG_DATA_DIR is a named volume
    assert port_pairs(retriever) == [("127.0.0.1:8000", 8000)]
    assert "qdrant" in retriever["depends_on"]
    argv = retriever["command"]
    args = parser().parse_args(argv[1:])
    assert argv[0] == "rag-retriever" and args.command == "serve"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    test = retriever["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and "/healthz" in test[3]


def test_ingest_is_a_one_shot_job_on_the_same_image_and_data(compose: dict[str, Any]) -> None:
    ingest = compose["services"]["ingest"]
    retriever = compose["services"]["retriever"]
    assert ingest["restart"] == "no" and "ingest" in ingest["profiles"]
    assert ingest["image"] == retriever["image"] and ingest["build"] == retriever["build"]
    assert ingest["environment"] == retriever["environment"]
    assert mounts(ingest)["/corpus"] == ("./corpus", "ro")
    assert mounts(ingest)["/data"] == mounts(retriever)["/data"]  # BM25 sidecars are shared
    argv = ingest["command"]
    args = parser().parse_args(argv[1:])
    assert argv[0] == "rag-retriever" and args.command == "ingest"
    assert (args.path, args.collection) == (Path("/corpus"), "docs")


# -- Dockerfiles --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_as_a_non_root_user_after_installing(name: str) -> None:
    steps = instructions(DOCKER / name)
    users = [i for i, (kw, _) in enumerate(steps) if kw == "USER"]
    assert users, f"{name} has no USER line"
    assert steps[users[-1]][1] not in ("root", "0")
    last_run = max(i for i, (kw, _) in enumerate(steps) if kw == "RUN")
    assert users[-1] > last_run  # nothing runs as root after the switch... and the app does not
    assert any(kw == "RUN" and "useradd" in args for kw, args in steps)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_cmd_is_a_real_serve_command(name: str) -> None:
    steps = instructions(DOCKER / name)
    [cmd] = [args for kw, args in steps if kw == "CMD"]
    argv = exec_form(cmd)
    assert argv[0] == "rag-retriever"
    args = parser().parse_args(argv[1:])
    assert args.command == "serve" and (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.func.__name__ == "cmd_serve"
    assert ("EXPOSE", "8000") in steps


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_torch_then_the_project_with_the_model(name: str) -> None:
    steps = instructions(DOCKER / name)
    runs = [args for kw, args in steps if kw == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "torch==2.13.0" in r)
    project_at = next(i for i, r in enumerate(runs) if 'pip install ".[tracing]"' in r)
    assert torch_at < project_at  # with the tracing extra: RAG_TRACING=otlp works in the image
    assert "Encoder.load('all-MiniLM-L6-v2'" in runs[project_at]  # the baked-in model loads
    env = " ".join(args for kw, args in steps if kw == "ENV")
    assert "RAG_DATA_DIR=/data" in env and "HF_HUB_OFFLINE=1" in env
    assert "/models/reranker" in (DOCKER / name).read_text()


def test_cpu_and_cuda_specifics() -> None:
    cpu = instructions(DOCKER / "Dockerfile")
    assert cpu[0] == ("FROM", "python:3.11-slim")
    torch_run = next(args for kw, args in cpu if kw == "RUN" and "torch==" in args)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_run
    assert "RAG_DEVICE=cpu" in " ".join(a for k, a in cpu if k == "ENV")
    cuda = instructions(DOCKER / "Dockerfile.cuda")
    base = next(args for kw, args in cuda if kw == "ARG" and args.startswith("CUDA_BASE="))
    assert base.split("=", 1)[1].startswith(("nvidia/cuda:", "pytorch/pytorch:"))
    assert "runtime" in base
    assert "RAG_DEVICE=cuda" in " ".join(a for k, a in cuda if k == "ENV")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copied_paths_exist_and_are_not_dockerignored(name: str) -> None:
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [
        src
        for kw, args in instructions(DOCKER / name)
        if kw == "COPY"
        for src in shlex.split(args)[:-1]
    ]
    # Everything `pip install .` reads: the readme and license files pyproject.toml names (a
    # missing license file fails the build) and the packages it finds.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = {
        "pyproject.toml",
        project["project"]["readme"],
        *project["project"].get("license-files", []),
        *(pattern.rstrip("*") for pattern in packages),
    }
    assert needed <= set(sources), needed - set(sources)
    for src in sources:
        assert (REPO / src).exists(), src
        assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), src
    assert ".venv" in ignored and ".git" in ignored


# -- health checks, run for real ----------------------------------------------------------------


def healthcheck_code(name: str) -> str:
    [args] = [a for kw, a in instructions(DOCKER / name) if kw == "HEALTHCHECK"]
    assert "--interval=" in args and "CMD" in args
    argv = exec_form(args[args.index("CMD") + len("CMD") :].strip())
    assert argv[:2] == ["python", "-c"]
    return argv[2]


@pytest.fixture(scope="module")
def live_url(tiny_encoder: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.test_server import build_retriever

    retriever, _ = build_retriever(tiny_encoder, tmp_path_factory.mktemp("docker-idx"))
    # With a key set: the health check must not need it.
    with serve_in_thread(create_app(retriever, Settings(api_key="k"))) as url:
        yield url


@pytest.mark.parametrize("source", [*DOCKERFILES, "docker-compose.yml"])
def test_healthcheck_passes_on_a_live_server_and_fails_without_one(
    source: str, live_url: str, compose: dict[str, Any]
) -> None:
    if source == "docker-compose.yml":
        code = compose["services"]["retriever"]["healthcheck"]["test"][3]
    else:
        code = healthcheck_code(source)
    assert "http://127.0.0.1:8000/healthz" in code
    port = live_url.rsplit(":", 1)[1]
    up = subprocess.run([sys.executable, "-c", code.replace(":8000/", f":{port}/")], timeout=30)
    assert up.returncode == 0
    down = subprocess.run(
        [sys.executable, "-c", code.replace(":8000/", ":9/")], capture_output=True, timeout=30
    )
    assert down.returncode != 0


def test_cluster_override_is_three_nodes_joined_to_the_first(compose: dict[str, Any]) -> None:
    cluster = yaml.safe_load((DOCKER / "docker-compose.cluster.yml").read_text())
    services = cluster["services"]
    nodes = {"qdrant", "qdrant-node-2", "qdrant-node-3"}
    assert nodes <= set(services) and set(services) - nodes <= set(compose["services"])
    for name in nodes:
        node = services[name]
        assert node["environment"]["QDRANT__CLUSTER__ENABLED"] == "true"
        argv = node["command"]
        assert argv[0] == "./qdrant" and argv[argv.index("--uri") + 1] == f"http://{name}:6335"
        if name != "qdrant":
            assert argv[argv.index("--bootstrap") + 1] == "http://qdrant:6335"
            assert node["profiles"] == ["cluster"]
            assert node["image"] == compose["services"]["qdrant"]["image"]
            ((source, _),) = mounts(node).values()
            assert source in cluster["volumes"]
    for job in ("retriever", "ingest"):
        # compose merges the override's environment into the base file's
        base_env = {
            k: interpolate(str(v), {}) for k, v in compose["services"][job]["environment"].items()
        }
        settings = Settings.from_env({**base_env, **services[job]["environment"]})
        assert (settings.qdrant_shards, settings.qdrant_replicas) == (3, 2)
        assert settings.qdrant_write_consistency == 1
