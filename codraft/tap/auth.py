"""ZeroMQ CURVE on the tap: who may send the learner tap messages, and who may read them.

The tap carries the target's hidden states and decides what the learner trains on, so off the
loopback interface it is encrypted and authenticated with ZeroMQ's CURVE (the CurveZMQ
handshake: each side proves it holds the secret key of its public key, and the stream is
encrypted). The learner's PULL socket is the CURVE server: it holds the learner's key pair
and accepts only the servers whose public keys lie in its allowed-keys folder, checked by a ZAP
handler (`zmq.auth.thread.ThreadAuthenticator`) before any message is delivered. A server's
PUSH socket is the CURVE client: it holds the server's key pair and the learner's public key,
so it talks to that learner only.

Keys are zmq.auth's certificate files (`zmq.auth.create_certificates(dir, name)`, or
`codraft tap-keys DIR`): `NAME.key` holds the public key, `NAME.key_secret` the public and
the secret key. Each side reads them in the process that opens the socket; only their paths
travel in settings, never a key.

When it is on: whenever an endpoint leaves the host (a learner binding anything but a
loopback address, a server connecting to any host but a loopback one) keys are required, and
a missing one is an error naming the setting to give; on loopback, and for ipc:// and
inproc:// endpoints (which never leave the host), CURVE is on exactly when keys are given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from codraft.loopback import is_loopback_host

ZAP_DOMAIN = "codraft.tap"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


def _host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (brackets of an IPv6 address removed, an interface or
    source address before ';' dropped); None for ipc:// and inproc://."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None
    rest = rest.rsplit(";", 1)[-1]  # tcp://source;host:port names the peer last
    host = rest.rpartition(":")[0] or rest
    return host.strip("[]")


def is_local_endpoint(endpoint: str) -> bool:
    """Whether every endpoint of `endpoint` (comma-separated) stays on this host: ipc://,
    inproc://, or tcp:// to or on a loopback address ('localhost', 127.0.0.0/8, ::1). A wildcard
    bind (tcp://*:P, tcp://0.0.0.0:P) or any other host leaves it."""
    for part in (p.strip() for p in endpoint.split(",")):
        if not part:
            continue
        host = _host(part)
        if host is not None and not is_loopback_host(host):
            return False
    return True


@dataclass(frozen=True)
class TapKeys:
    """Paths to one side's tap keys (never the keys).

    `own`: this side's secret certificate (a `*.key_secret` file, or a folder holding exactly
    one). `peers`: the learner's, a folder of the servers' public certificates (`*.key`) it
    accepts; the server's, the learner's public certificate (a `*.key` file, or a `*.key_secret`
    file, of which only the public key is read). `own_flag`/`peers_flag` name the settings in
    errors (the command-line flags of the side)."""

    own: str | None = None
    peers: str | None = None
    own_flag: str = "--tap-key"
    peers_flag: str = "--tap-allowed-keys"

    @property
    def given(self) -> bool:
        return self.own is not None or self.peers is not None

    def required(self, endpoint: str, role: str) -> bool:
        """Whether CURVE is on for `endpoint` (module doc); ValueError when it must be and a
        key is missing, or when a given path is not there. `role` says in errors what the
        endpoint is ("the learner binds", "the server connects to"). Reads no key."""
        local = is_local_endpoint(endpoint)
        if local and not self.given:
            return False
        pairs = ((self.own_flag, self.own), (self.peers_flag, self.peers))
        missing = [flag for flag, path in pairs if path is None]
        if missing:
            why = (
                f"{role} {endpoint!r}, which leaves this host, so the tap must be authenticated"
                if not local
                else f"CURVE is on for {endpoint!r} because one tap key is given"
            )
            raise ValueError(
                f"{why}: missing {' and '.join(missing)}. Make key pairs with `codraft tap-keys "
                "DIR` (zmq.auth certificate files): the learner takes its own secret "
                "certificate (--tap-key) and a folder of the servers' public certificates "
                "(--tap-allowed-keys); a server takes its own secret certificate (--tap-key) "
                "and the learner's public certificate (--tap-learner-key). Or keep the "
                "endpoint on loopback (127.0.0.1)"
            )
        for flag, path in pairs:
            if not Path(path).exists():
                raise ValueError(f"{flag} {path}: no such file or folder")
        return True


def load_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) key of a secret certificate file, or of the one `*.key_secret` file in
    folder `path`. ValueError saying what was found otherwise."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*" + SECRET_SUFFIX))
        if len(found) != 1:
            raise ValueError(
                f"tap key folder {p} holds {len(found)} secret certificates (*{SECRET_SUFFIX}), "
                "expected exactly one: give the file itself"
            )
        p = found[0]
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the tap key {p}: {e}") from None
    if secret is None:
        raise ValueError(
            f"tap key {p} holds a public key only: give the secret certificate "
            f"(NAME{SECRET_SUFFIX}, written next to NAME{PUBLIC_SUFFIX} by `codraft tap-keys`)"
        )
    return public, secret


def load_public(path: str | os.PathLike) -> bytes:
    """The public key of certificate file `path`."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p} is a folder: give the peer's public certificate file (*.key)")
    try:
        return zmq.auth.load_certificate(p)[0]
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the tap public key {p}: {e}") from None


def allowed_folder(path: str | os.PathLike) -> Path:
    """The folder of accepted public certificates; ValueError unless it holds at least one."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(
            f"--tap-allowed-keys {p}: expected a folder of the servers' public certificates "
            f"(*{PUBLIC_SUFFIX})"
        )
    if not any(p.glob("*" + PUBLIC_SUFFIX)):
        raise ValueError(
            f"--tap-allowed-keys {p} holds no public certificate (*{PUBLIC_SUFFIX}): no server "
            "could send taps; copy each server's NAME.key there"
        )
    return p


class CurveServer:
    """The learner's side: its key pair on a socket, and a ZAP handler on the socket's own
    context that admits the public keys in `allowed` only. Start it before the socket binds."""

    def __init__(self, context: zmq.Context, keys: TapKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.public, self._secret = load_secret(keys.own)
        self.allowed = allowed_folder(keys.peers)
        self.auth = ThreadAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve(domain=ZAP_DOMAIN, location=str(self.allowed))

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)

    def stop(self) -> None:
        self.auth.stop()


def curve_client(sock: zmq.Socket, keys: TapKeys) -> None:
    """The server's side: its key pair and the learner's public key on a PUSH socket (before
    it connects)."""
    public, secret = load_secret(keys.own)
    server = load_public(keys.peers)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server)


def create_keys(folder: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """A new key pair as zmq.auth certificate files under `folder`: (public, secret) paths. The
    secret file is readable by its owner only; an existing pair is never overwritten."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{name}{PUBLIC_SUFFIX}", out / f"{name}{SECRET_SUFFIX}"
    for p in (public, secret):
        if p.exists():
            raise FileExistsError(f"{p} exists: remove it or choose another name")
    old = os.umask(0o077)
    try:
        made = zmq.auth.create_certificates(out, name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return Path(made[0]), Path(made[1])
