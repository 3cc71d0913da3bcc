"""`kvwatch init` on the command line: what it cannot look at stops it before anything is written."""

from __future__ import annotations

import pytest

from kvwatch.cli.main import main
from processes import free_port


def test_a_gateway_that_does_not_answer_exits_1_and_writes_nothing(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["init", url, "--dir", str(tmp_path / "setup")]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"kvwatch init: GET {url}/models failed: ") and "refused" in error.lower()
    assert not (tmp_path / "setup").exists()


def test_an_unset_key_variable_is_a_bad_argument(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVWATCH_NO_SUCH_KEY", raising=False)
    assert (
        main(["init", "http://127.0.0.1:1", "--api-key-env", "KVWATCH_NO_SUCH_KEY", "--dir", str(tmp_path)])
        == 2
    )
    assert "environment variable KVWATCH_NO_SUCH_KEY is not set or empty" in capsys.readouterr().err


def test_the_key_itself_is_never_taken_from_argv(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["init", "http://127.0.0.1:1", "--api-key", "sk-secret"])
    assert exit.value.code == 2 and "sk-secret" not in capsys.readouterr().err
