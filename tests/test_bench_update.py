"""bench_update's command line refuses what it cannot run: exit 2 with the reason, nothing
written."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_update import main


@pytest.mark.parametrize("content", [None, "not json", "[1, 2]"])
def test_edit_constants_needs_a_constants_file(
    content: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "capacity.json"
    if content is not None:
        target.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["--edit-constants", str(target)])
    assert exit_info.value.code == 2
    assert "not a constants file" in capsys.readouterr().err
    assert (target.read_text() if content is not None else None) == content


def test_server_vocabulary_sizes_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--sizes", "--server-vocabulary", "1000", "0"])
    assert exit_info.value.code == 2
    assert "at least 1" in capsys.readouterr().err
