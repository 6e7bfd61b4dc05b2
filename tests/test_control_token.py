"""The control token is found and checked by one function (codraft.control_token) for the
server (`ServeConfig.resolve_token`), the learner (`codraft learn --server`) and the client (the
SDK and its CLI): same precedence, same refusals."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from codraft.client import CodraftClient, InvalidRequest
from codraft.client.settings import resolve_token as client_token
from codraft.control_token import TOKEN_ENV, resolve_control_token
from codraft.learner.cli import add_arguments, online_config_from_args
from codraft.server.serve_config import ServeConfig


def _server(token=None, token_file=None):
    return ServeConfig(control_token=token, control_token_file=token_file).resolve_token()


def _learner(token=None, token_file=None):
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--server", "http://127.0.0.1:1", "--target", "t", "--out", "o"]
    argv += ["--token", token] if token is not None else []
    argv += ["--token-file", str(token_file)] if token_file is not None else []
    return online_config_from_args(p.parse_args(argv)).token


def _client(token=None, token_file=None):
    return client_token(token, token_file)


WAYS = {"server": _server, "learner": _learner, "client": _client}


@pytest.mark.parametrize("way", WAYS)
def test_precedence_token_then_file_then_environment(way, tmp_path: Path, monkeypatch) -> None:
    resolve = WAYS[way]
    file = tmp_path / "token"
    file.write_text("  from-file \n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert resolve() is None
    assert resolve(token_file=file) == "from-file"
    monkeypatch.setenv(TOKEN_ENV, " from-env\n")
    assert resolve() == "from-env"
    assert resolve(token_file=file) == "from-file"
    assert resolve(token="given") == "given"


@pytest.mark.parametrize("way", WAYS)
def test_the_same_refusals_everywhere(way, tmp_path: Path, monkeypatch) -> None:
    resolve = WAYS[way]
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.write_text("\n")
    for kwargs, message in (
        ({"token": "a", "token_file": empty}, "not both"),
        ({"token": " "}, "is empty"),
        ({"token": "a b"}, "no whitespace"),
        ({"token": "a\x00"}, "printable"),
        ({"token_file": empty}, "is empty"),
        ({"token_file": missing}, "cannot read the token file"),
    ):
        with pytest.raises(ValueError, match=message):  # InvalidRequest is a ValueError too
            resolve(**kwargs)
    monkeypatch.setenv(TOKEN_ENV, "   ")
    with pytest.raises(ValueError, match=r"\$CODRAFT_CONTROL_TOKEN\) is empty"):
        resolve()


def test_the_messages_name_the_options_of_each_command(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give --control-token or --control-token-file"):
        ServeConfig(control_token="a", control_token_file="f")
    with pytest.raises(InvalidRequest, match="give --token or --token-file"):
        client_token("a", tmp_path)
    with pytest.raises(ValueError, match=r"\(--control-token-file\) is empty"):
        (tmp_path / "e").write_text("")
        _server(token_file=tmp_path / "e")
    with pytest.raises(InvalidRequest, match="must be printable"):
        CodraftClient("http://127.0.0.1:1", "two words")
    assert resolve_control_token(environ={TOKEN_ENV: "x"}) == "x"
