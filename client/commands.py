"""`codraft status | draft load|prepare|rollback | policy load | tap set`: the control API from a
shell.

Exit codes: 0 done; 1 the server refused or failed (its message is printed); 2 usage (bad
arguments, unreadable token file or checkpoint folder); 3 the server could not be reached.

Every subcommand takes --server URL (default $CODRAFT_SERVER, else http://127.0.0.1:8000) and a
token from --token, --token-file or $CODRAFT_CONTROL_TOKEN (in that order).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from codraft.client.client import CodraftClient
from codraft.client.errors import (
    CodraftConnectionError,
    CodraftError,
    CodraftHTTPError,
    InvalidRequest,
    NotReady,
)
from codraft.client.models import DraftInfo, TapInfo
from codraft.client.settings import DEFAULT_SERVER, SERVER_ENV, TOKEN_ENV, resolve_token
from codraft.client.status import collect_status, render

OK, REFUSED, USAGE, UNREACHABLE = 0, 1, 2, 3
Command = Callable[[argparse.Namespace], int]
Action = Callable[[CodraftClient, argparse.Namespace], int]


class LocalRefusal(CodraftError):
    """Refused before asking the server, for the reason the server would give (exit 1)."""


# ------------------------------------------------------------------------------ arguments
def _version(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _sha256(text: str) -> str:
    value = text.strip().lower()
    if len(value) != 64 or set(value) - set("0123456789abcdef"):
        raise argparse.ArgumentTypeError(f"expected 64 hex digits, got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("server")
    g.add_argument(
        "--server",
        metavar="URL",
        default=None,
        help=f"codraft server (its control port, if separate); default ${SERVER_ENV}, "
        f"else {DEFAULT_SERVER}",
    )
    g.add_argument(
        "--token",
        default=None,
        help=f"control token (visible in ps: prefer --token-file or ${TOKEN_ENV})",
    )
    g.add_argument("--token-file", metavar="FILE", default=None, help="file holding the token")
    g.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds to wait for an answer (default 30, loads 600)",
    )
    return p


def add_client_commands(sub: argparse._SubParsersAction, commands: dict[str, Command]) -> None:
    """Add status, draft load|prepare|rollback, policy load and tap set to the `codraft` CLI."""
    common = _common()

    sp = sub.add_parser(
        "status", parents=[common], help="what the server serves: draft, policy, tap, health"
    )
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sp.set_defaults(_client_action=_status)
    commands["status"] = run

    sp = sub.add_parser("draft", help="load a draft into the server, or roll back")
    actions = sp.add_subparsers(
        dest="draft_action", required=True, metavar="{load,prepare,rollback}"
    )
    for name, action, help_text in (
        (
            "load",
            _draft_load,
            "POST /v1/draft/prepare, then POST /v1/draft once staged: swap in a newer draft",
        ),
        ("prepare", _draft_prepare, "POST /v1/draft/prepare: stage a draft for a later load"),
    ):
        a = actions.add_parser(
            name,
            parents=[common],
            help=help_text,
            description="The sha256 is computed from DIR/model.safetensors and checked against "
            "DIR/codraft.json when DIR is readable here; the server checks it again.",
        )
        a.add_argument(
            "--version",
            type=_version,
            default=None,
            help="draft version (default: the one in DIR/codraft.json)",
        )
        a.add_argument("--path", required=True, metavar="DIR", help="checkpoint folder, as "
                       "the server sees it")  # fmt: skip
        a.add_argument("--sha256", type=_sha256, default=None, help="sha256 of model.safetensors")
        a.set_defaults(_client_action=action)
    a = actions.add_parser(
        "rollback", parents=[common], help="POST /v1/draft/rollback: back to the previous draft"
    )
    a.add_argument("--reason", default="manual", help="why (logged by the server)")
    a.set_defaults(_client_action=_draft_rollback)
    commands["draft"] = run

    sp = sub.add_parser("policy", help="load new target (policy) weights into the server")
    actions = sp.add_subparsers(dest="policy_action", required=True, metavar="{load}")
    a = actions.add_parser("load", parents=[common], help="POST /v1/policy")
    a.add_argument("--version", type=_version, required=True, help="policy version")
    a.add_argument("--path", required=True, metavar="DIR", help="weights folder, as the "
                   "server sees it")  # fmt: skip
    a.set_defaults(_client_action=_policy_load)
    commands["policy"] = run

    sp = sub.add_parser("tap", help="change the server's tap (the stream to the learner)")
    actions = sp.add_subparsers(dest="tap_action", required=True, metavar="{set}")
    a = actions.add_parser("set", parents=[common], help="PUT /v1/tap; unset options stay")
    on = a.add_mutually_exclusive_group()
    on.add_argument(
        "--enabled", dest="enabled", action="store_const", const=True, default=None, help="stream"
    )
    on.add_argument(
        "--disabled", dest="enabled", action="store_const", const=False, help="stop streaming"
    )
    a.add_argument(
        "--mode",
        choices=["full", "ids", "off"],
        default=None,
        help="full: taps + last hidden; ids: token ids only; off: disabled",
    )
    a.add_argument("--sample-rate", type=_rate, default=None, metavar="F", help="0..1")
    a.add_argument("--endpoint", default=None, metavar="E", help="e.g. tcp://learner:5557")
    a.set_defaults(_client_action=_tap_set)
    commands["tap"] = run


# ------------------------------------------------------------------------------ running
def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    print(f"{_name(args)}: {message}", file=sys.stderr)
    return code


def _name(args: argparse.Namespace) -> str:
    parts = ["codraft", getattr(args, "command", None) or ""]
    for key in ("draft_action", "policy_action", "tap_action"):
        if getattr(args, key, None):
            parts.append(getattr(args, key))
    return " ".join(p for p in parts if p)


def _client(args: argparse.Namespace) -> CodraftClient:
    token = resolve_token(args.token, args.token_file)
    timeout = (
        {} if args.timeout is None else {"timeout": args.timeout, "load_timeout": args.timeout}
    )
    return CodraftClient(args.server, token, **timeout)


def run(args: argparse.Namespace) -> int:
    """Run the client action chosen on the command line; errors become exit codes."""
    action: Action = args._client_action
    try:
        with _client(args) as client:
            return action(client, args)
    except InvalidRequest as e:
        return _fail(args, str(e), USAGE)
    except (CodraftHTTPError, LocalRefusal) as e:
        return _fail(args, str(e), REFUSED)
    except (CodraftConnectionError, NotReady) as e:
        return _fail(args, str(e), UNREACHABLE)
    except CodraftError as e:  # an answer that is not the control API's
        return _fail(args, str(e), REFUSED)


# ------------------------------------------------------------------------------ actions
def _status(client: CodraftClient, args: argparse.Namespace) -> int:
    status = collect_status(client)
    render(status, as_json=args.json)
    return REFUSED if status.refused else OK


def _draft_line(d: DraftInfo) -> str:
    kept = "none kept" if d.previous_version is None else f"v{d.previous_version} kept"
    return (
        f"draft v{d.version} serving ({d.kind + ', ' if d.kind else ''}sha256 "
        f"{(d.sha256 or '?')[:12]}…, tap layers {d.tap_layers}); rollback: {kept}"
    )


def checkpoint_args(
    path: str, version: int | None, sha256: str | None
) -> tuple[str, int, str | None]:
    """(path, version, sha256) to send for checkpoint folder `path`.

    Readable here: the path made absolute, the version from codraft.json when not given (and
    checked when given), the sha256 of model.safetensors (checked against codraft.json). Not
    readable here (the folder lives on the server's side): sent as given, with --version
    required and the sha256 left to the server (it checks codraft.json's)."""
    from_here = Path(path)
    if not from_here.is_dir():
        if version is None:
            raise InvalidRequest(
                f"{path} is not a folder here, so its codraft.json cannot give the version: "
                "pass --version (and --sha256 to have the server check it)"
            )
        print(
            f"note: {path} is not readable here; sending it as the server's path", file=sys.stderr
        )
        return path, version, sha256
    from codraft.draft.checkpoint import (  # torch: imported only here
        WEIGHTS_NAME,
        DraftCheckpointError,
        read_meta,
        sha256_file,
    )

    try:
        meta = read_meta(from_here)
    except DraftCheckpointError as e:
        raise LocalRefusal(f"not a draft checkpoint: {e}") from None
    if version is None:
        version = meta.version
    elif version != meta.version:
        raise LocalRefusal(
            f"--version {version} but {path}/codraft.json says version {meta.version}; the "
            "server refuses a mismatch: pass the checkpoint's own version"
        )
    if sha256 is None:
        weights = from_here / WEIGHTS_NAME
        if not weights.is_file():
            raise LocalRefusal(f"{weights} is missing; a draft checkpoint holds {WEIGHTS_NAME}")
        sha256 = sha256_file(weights)
        if meta.weights_sha256 and meta.weights_sha256 != sha256:
            raise LocalRefusal(
                f"{weights} hashes to {sha256} but codraft.json records {meta.weights_sha256}: "
                "the checkpoint is corrupt or still being copied; publish it again"
            )
    return os.path.abspath(from_here), version, sha256


def _draft_load(client: CodraftClient, args: argparse.Namespace) -> int:
    path, version, sha256 = checkpoint_args(args.path, args.version, args.sha256)
    print(_draft_line(client.publish_draft(version, path, sha256)))
    return OK


def _draft_prepare(client: CodraftClient, args: argparse.Namespace) -> int:
    path, version, sha256 = checkpoint_args(args.path, args.version, args.sha256)
    staged = client.prepare_draft(path, version, sha256)
    print(
        f"draft v{version} being staged from {path} (ticket {staged.ticket}); "
        "`codraft draft load` with the same --path installs it"
    )
    return OK


def _draft_rollback(client: CodraftClient, args: argparse.Namespace) -> int:
    print("rolled back: " + _draft_line(client.rollback_draft(args.reason)))
    return OK


def _policy_load(client: CodraftClient, args: argparse.Namespace) -> int:
    path = os.path.abspath(args.path) if Path(args.path).is_dir() else args.path
    p = client.load_policy(args.version, path)
    print(f"policy v{p.version} serving, from {p.path} (loaded {p.loaded_at})")
    return OK


def _tap_line(t: TapInfo) -> str:
    state = "on" if t.enabled else "off"
    return f"tap {state}, mode {t.mode}, sample rate {t.sample_rate}, endpoint {t.endpoint}"


def _tap_set(client: CodraftClient, args: argparse.Namespace) -> int:
    change = {
        "enabled": args.enabled,
        "mode": args.mode,
        "sample_rate": args.sample_rate,
        "endpoint": args.endpoint,
    }
    if all(v is None for v in change.values()):
        raise InvalidRequest(
            "nothing to set: give --enabled/--disabled, --mode, --sample-rate or --endpoint"
        )
    print(_tap_line(client.set_tap(**change)))
    return OK


# ------------------------------------------------------------------------------ standalone
def build_parser() -> argparse.ArgumentParser:
    """The client subcommands alone (`python -m codraft.client ...`); `codraft` has them too."""
    p = argparse.ArgumentParser(prog="codraft", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    commands: dict[str, Command] = {}
    add_client_commands(sub, commands)
    p.set_defaults(_commands=commands)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._commands[args.command](args)
