"""CURVE on the tap, over real ZeroMQ sockets on 127.0.0.1 with keys given (so CURVE is on).

The learner's PULL socket admits only the servers whose public certificates lie in its allowed
folder: a server with a listed key delivers, a server without keys or with an unlisted key
delivers nothing (its handshake fails; counted under "auth"). Off loopback, missing keys are a
ValueError naming the flag, raised before anything binds or connects."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import zmq

from codraft.learner.online.buffer import BufferPolicy, SampleBuffer
from codraft.learner.online.ingest import TapIngest
from codraft.server.engine_config import EngineConfig
from codraft.server.publisher import TapPublisher
from codraft.server.tap_switch import TapSwitch
from codraft.server.weights import SwapError
from codraft.tap import TapMessage
from codraft.tap.auth import TapKeys, create_keys, is_local_endpoint, load_secret

H, TAPS = 8, (1, 2)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tap-keys")
    out = {}
    for name in ("learner", "server", "stranger"):
        public, secret = create_keys(root / name, name)
        out[name], out[name + "_secret"] = public, secret
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "server.key").write_bytes(out["server"].read_bytes())
    out["allowed"] = allowed
    return out


def _msg(i: int) -> TapMessage:
    g = torch.Generator().manual_seed(i)
    return TapMessage.build(
        torch.randint(0, 50, (6,), generator=g, dtype=torch.int32),
        taps=torch.randn(6, len(TAPS) * H, generator=g),
        last_hidden=torch.randn(6, H, generator=g),
        tap_layers=TAPS,
        prompt_len=2,
        request_id=f"r{i}",
    )


def _learner(keys: dict[str, Path]) -> TapIngest:
    buf = SampleBuffer(BufferPolicy(holdout_fraction=0.0))
    learner_keys = TapKeys(str(keys["learner_secret"]), str(keys["allowed"]))
    return TapIngest("tcp://127.0.0.1:*", buf, keys=learner_keys).start()


def _send(endpoint: str, keys: TapKeys | None, n: int = 5) -> TapPublisher:
    pub = TapPublisher(endpoint, keys=keys, linger_ms=200)
    for i in range(n):
        pub.put(_msg(i), wait_s=1.0)
    return pub


def _until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_listed_server_delivers(keys) -> None:
    ing = _learner(keys)
    try:
        assert ing.curve
        pub = _send(ing.bound, TapKeys(str(keys["server_secret"]), str(keys["learner"])))
        assert _until(lambda: ing.stats.accepted == 5), dict(ing.stats.rejected)
        pub.close()
        assert pub.curve and pub.totals().messages_sent == 5
    finally:
        ing.stop()


@pytest.mark.parametrize("who", ["no keys", "unlisted key", "wrong learner key"])
def test_a_stranger_delivers_nothing(keys, who) -> None:
    ing = _learner(keys)
    try:
        if who == "no keys":  # plaintext against a CURVE server: a mechanism mismatch
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.connect(ing.bound)
            for i in range(5):
                push.send_multipart([bytes(f) for f in _encode(_msg(i))], flags=zmq.NOBLOCK)
            closers = [lambda: push.close(linger=0)]
        else:
            own = keys["stranger_secret"] if who == "unlisted key" else keys["server_secret"]
            peer = keys["learner"] if who == "unlisted key" else keys["stranger"]
            pub = _send(ing.bound, TapKeys(str(own), str(peer)))
            closers = [pub.close]
        if who == "unlisted key":  # the learner saw the handshake and refused it
            assert _until(lambda: ing.stats.rejected["auth"] > 0), dict(ing.stats.rejected)
        else:
            time.sleep(1.5)
        assert ing.stats.accepted == 0 and len(ing.buffer) == 0
        for close in closers:
            close()
    finally:
        ing.stop()


def _encode(msg: TapMessage) -> list:
    from codraft.tap import encode

    return encode(msg)


def test_without_the_allowed_list_a_stranger_would_get_through(keys, monkeypatch) -> None:
    """Planted bug: a ZAP handler that admits any key. The unlisted server then delivers, so
    the test above sees the allowed folder's work."""
    import codraft.tap.auth as auth

    real = auth.CurveServer.__init__

    def admit_any(self, context, tap_keys):
        real(self, context, tap_keys)
        self.auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)

    monkeypatch.setattr(auth.CurveServer, "__init__", admit_any)
    ing = _learner(keys)
    try:
        pub = _send(ing.bound, TapKeys(str(keys["stranger_secret"]), str(keys["learner"])))
        assert _until(lambda: ing.stats.accepted == 5), dict(ing.stats.rejected)
        pub.close()
    finally:
        ing.stop()


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def test_missing_keys_off_loopback_are_an_error_before_binding(keys, tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    buf = SampleBuffer()
    with pytest.raises(ValueError, match="--tap-allowed-keys"):
        TapIngest(f"tcp://0.0.0.0:{port}", buf, keys=TapKeys(str(keys["learner_secret"])))
    with pytest.raises(ValueError, match="--tap-key and --tap-allowed-keys"):
        TapIngest(f"tcp://*:{port}", buf)
    assert _port_is_free(port)  # nothing was bound
    with pytest.raises(ValueError, match="--tap-key"):
        TapIngest(f"tcp://0.0.0.0:{port}", buf, keys=TapKeys(None, str(keys["allowed"])))
    with pytest.raises(ValueError, match="no such file"):
        TapIngest(f"tcp://0.0.0.0:{port}", buf, keys=TapKeys(str(tmp_path / "x"), "/nope"))
    # the learner's config says the same before anything starts
    from codraft.learner.online.daemon import OnlineConfig

    with pytest.raises(ValueError, match="--tap-key and --tap-allowed-keys"):
        OnlineConfig(tap=f"tcp://0.0.0.0:{port}")
    # the server's: its settings, its publisher, and the tap switch at run time
    with pytest.raises(ValueError, match="--tap-learner-key"):
        EngineConfig(tap_endpoint="tcp://learner-0.learner:5557", tap_key=str(keys["server"]))
    with pytest.raises(ValueError, match="--tap-key and --tap-learner-key"):
        TapPublisher(f"tcp://10.1.2.3:{port}")
    from codraft.server.serve_config import ServeConfig

    with pytest.raises(ValueError, match="--tap-key and --tap-learner-key"):
        ServeConfig(tap_endpoint="tcp://learner:5557")
    switch = TapSwitch(EngineConfig(), flush=lambda: None)
    with pytest.raises(SwapError, match="--tap-key and --tap-learner-key"):
        switch.set(enabled=True, endpoint="tcp://learner:5557")
    assert switch.publisher is None


def test_loopback_runs_without_keys_and_other_hosts_need_them() -> None:
    for e in ("tcp://127.0.0.1:5557", "tcp://localhost:1", "tcp://[::1]:5", "ipc:///tmp/x",
              "inproc://t", "tcp://127.0.0.1:1,tcp://127.0.0.2:2"):  # fmt: skip
        assert is_local_endpoint(e), e
    for e in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://learner:5557", "tcp://10.0.0.1:1",
              "tcp://127.0.0.1:1,tcp://learner:2", "tcp://eth0:5557"):  # fmt: skip
        assert not is_local_endpoint(e), e
    assert not TapKeys().required("tcp://127.0.0.1:5557", "binds")


def test_key_files_are_zmq_certificates(keys) -> None:
    public, secret = load_secret(keys["learner_secret"])
    assert len(public) == 40 and len(secret) == 40  # Z85
    assert load_secret(keys["learner_secret"].parent) == (public, secret)  # a folder of one
    assert zmq.auth.load_certificate(keys["learner"]) == (public, None)
    assert (keys["learner_secret"].stat().st_mode & 0o077) == 0
    with pytest.raises(ValueError, match="public key only"):
        load_secret(keys["learner"])
    with pytest.raises(FileExistsError):
        create_keys(keys["learner"].parent, "learner")


def test_the_cli_writes_a_key_pair(tmp_path, capsys) -> None:
    from codraft.cli import build_parser

    args = build_parser().parse_args(["tap-keys", str(tmp_path), "--name", "server-a"])
    assert args._commands[args.command](args) == 0
    assert (tmp_path / "server-a.key").is_file() and (tmp_path / "server-a.key_secret").is_file()
    load_secret(tmp_path / "server-a.key_secret")
    assert "server-a.key" in capsys.readouterr().out


def test_the_tap_process_reads_the_keys_and_sends_over_curve(keys) -> None:
    """vLLM's default assembly: the tap process opens the socket, so the key paths travel to it
    (never the keys) and it reads them; a listed server's messages arrive over CURVE."""
    from test_capture_steps import Harness, NewRequest, _sp

    from codraft.server.tap_process import RemotePublisher

    ing = _learner(keys)
    h = Harness(assembly="process", handshake=False)
    try:
        h.pub.close()  # the harness's plaintext publisher, to its own socket
        server = TapKeys(str(keys["server_secret"]), str(keys["learner"]), "--tap-key",
                         "--tap-learner-key")  # fmt: skip
        pub = RemotePublisher(h.cap.assembler, ing.bound, queue_size=16, hwm=100,
                              linger_ms=500, keys=server)  # fmt: skip
        time.sleep(0.5)  # the handshake
        new = [NewRequest(f"r{i}", [1, 2, 3], _sp(max_tokens=1), "full") for i in range(4)]
        h.cap.on_step(h.record([(f"r{i}", 0, [1, 2, 3], 0) for i in range(4)], new=new),
                      [[4]] * 4)  # fmt: skip
        assert h.cap.flush()
        # decoded whole; the harness's requests have no completion token to learn on
        delivered = lambda: ing.stats.accepted + ing.stats.rejected["no_loss_tokens"]  # noqa: E731
        assert _until(lambda: delivered() == 4), (dict(ing.stats.rejected), pub.totals())
        assert ing.stats.rejected_total == ing.stats.rejected["no_loss_tokens"]
        half = TapKeys(str(keys["server_secret"]), None, "--tap-key", "--tap-learner-key")
        with pytest.raises(ValueError, match="--tap-learner-key"):  # checked in this process
            RemotePublisher(h.cap.assembler, "tcp://learner:5557", queue_size=1, hwm=1,
                            linger_ms=0, keys=half)  # fmt: skip
        pub.close()
    finally:
        h.cap.close()
        h.sock.close(linger=0)
        h.zctx.term()
        ing.stop()
