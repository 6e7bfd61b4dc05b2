"""`codraft serve` settings: one dataclass with defaults that work, filled from the CLI, and
their translation into vLLM's serve arguments (model, initial draft, speculative config, the
worker extension and its settings in `additional_config`).

Anything `codraft serve` does not know is handed to vLLM's own argument parser unchanged
(e.g. `--max-num-seqs 32`), so every vLLM serving option stays reachable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from codraft.control_token import TOKEN_ENV, check_token_sources, resolve_control_token
from codraft.drafters import SERVED_DRAFTERS
from codraft.loopback import is_loopback_host

log = logging.getLogger("codraft.serve")

TOKEN_FLAGS = ("--control-token", "--control-token-file")
TAP_MODES = ("full", "ids", "off")
ENGINES = ("vllm", "sglang")
WEIGHT_TRANSFER = ("ipc", "nccl")  # vLLM's backends codraft serves the routes of


@dataclass
class ServeConfig:
    """Everything `codraft serve` needs. Defaults: SmolLM2, an untrained draft, 127.0.0.1."""

    model: str = "smollm2"  # 'smollm2' (prepared offline) or a model folder
    engine: str = "vllm"  # vllm | sglang (codraft.server.sglang.serve; GPU machines only)
    draft: str | None = None  # draft folder; None builds an untrained one (version 0)
    drafter: str | None = None  # the draft's kind, eagle3 | dflash: None = --draft's, or eagle3
    num_speculative_tokens: int = 3
    draft_vocab_size: int = 8192  # only for a draft built here
    tap_endpoint: str | None = None  # ZeroMQ endpoint the learner PULLs on; None: tap off
    tap_mode: str = "full"  # full | ids | off
    tap_sample_rate: float = 1.0
    # CURVE on the tap, required when tap_endpoint leaves the host (codraft.tap.auth): this
    # server's secret certificate (NAME.key_secret) and the learner's public one (NAME.key)
    tap_key: str | None = None
    tap_learner_key: str | None = None
    control_token: str | None = None
    control_token_file: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    control_host: str | None = None  # default: same as host
    control_port: int | None = None  # None: control routes on the OpenAI port
    # Host names the control routes answer besides the bound address and loopback (without a
    # token; with one any Host is accepted): codraft.server.cross_site
    control_allowed_hosts: list[str] = field(default_factory=list)
    max_connections: int = 1024  # OpenAI port: past this many open connections, 503
    control_max_connections: int = 128  # control port, counted apart from the OpenAI port
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (both ports)
    dtype: str = "auto"
    max_model_len: int | None = 4096
    work_dir: str = "runs/serve"  # a draft built here, the committed-draft record
    checkpoint_root: str | None = None  # if set, POSTed draft/policy paths must lie inside it
    resume_draft: bool = True  # a restart serves the newest committed draft (server.committed)
    # serve vLLM's RL weight-sync routes (codraft.server.weight_sync) with this backend
    weight_transfer: str | None = None  # None | "ipc" | "nccl"
    worker_extension_cls: str = "codraft.server.worker_ext.CodraftWorkerExtension"
    vllm_args: list[str] = field(default_factory=list)  # passed through to vLLM

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if self.drafter is not None and self.drafter not in SERVED_DRAFTERS:
            raise ValueError(
                f"drafter must be one of {SERVED_DRAFTERS}, got {self.drafter!r}"
                + (f": {DSPARK_NOT_SERVED}" if self.drafter == "dspark" else "")
            )
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.weight_transfer is not None and self.weight_transfer not in WEIGHT_TRANSFER:
            raise ValueError(
                f"weight_transfer must be one of {WEIGHT_TRANSFER}, got {self.weight_transfer!r}"
            )
        if self.tap_mode not in TAP_MODES:
            raise ValueError(f"tap_mode must be one of {TAP_MODES}, got {self.tap_mode!r}")
        if not 0.0 <= self.tap_sample_rate <= 1.0:
            raise ValueError(f"tap_sample_rate must be in [0, 1], got {self.tap_sample_rate}")
        check_token_sources(self.control_token, self.control_token_file, TOKEN_FLAGS)
        for name in ("port", "control_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if self.tap_endpoint is not None:
            from codraft.server.engine_config import TAP_ROLE
            from codraft.tap.auth import TapKeys

            keys = TapKeys(self.tap_key, self.tap_learner_key, "--tap-key", "--tap-learner-key")
            keys.required(self.tap_endpoint, TAP_ROLE)
        for name in ("max_connections", "control_max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if self.control_port is not None and self.control_port == self.port != 0:
            raise ValueError(f"control_port {self.control_port} equals port: pick another")

    @property
    def effective_control_host(self) -> str:
        return self.control_host or self.host

    def resolve_token(self) -> str | None:
        """The control token from --control-token, --control-token-file or $CODRAFT_CONTROL_TOKEN
        (first set wins); None when none is configured (`codraft.control_token`)."""
        return resolve_control_token(self.control_token, self.control_token_file, flags=TOKEN_FLAGS)

    def check_exposure(self, token: str | None) -> None:
        """Refuse to expose unauthenticated control routes beyond the loopback interface."""
        if token is None and not is_loopback_host(self.effective_control_host):
            raise ValueError(
                f"control routes would listen on {self.effective_control_host} without a token: "
                f"set --control-token-file (or ${TOKEN_ENV}), or bind them to 127.0.0.1 "
                "(--control-host 127.0.0.1 --control-port PORT)"
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    p.add_argument("--model", default=d.model, help="'smollm2' or a model folder")
    p.add_argument(
        "--engine",
        default=d.engine,
        choices=ENGINES,
        help="the serving engine: vLLM, or SGLang (EAGLE-3, GPU; docs/sglang.md); arguments "
        "codraft serve does not know go to the engine's own parser",
    )
    p.add_argument("--draft", default=None, help="initial draft folder (default: untrained)")
    p.add_argument(
        "--drafter",
        default=None,
        choices=SERVED_DRAFTERS,
        help="the draft's kind (default: --draft's, or eagle3 for an untrained one)",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens)
    p.add_argument(
        "--draft-vocab-size", type=int, default=d.draft_vocab_size, help="for a draft built here"
    )
    p.add_argument("--tap-endpoint", default=None, help="ZeroMQ endpoint, e.g. tcp://host:5557")
    p.add_argument("--tap-mode", default=d.tap_mode, choices=TAP_MODES)
    p.add_argument("--tap-sample-rate", type=float, default=d.tap_sample_rate)
    p.add_argument(
        "--tap-key",
        default=None,
        metavar="FILE",
        help="this server's secret tap certificate (NAME.key_secret from `codraft tap-keys`); "
        "with --tap-learner-key the tap runs over CURVE, which a --tap-endpoint off loopback "
        "requires",
    )
    p.add_argument(
        "--tap-learner-key",
        default=None,
        metavar="FILE",
        help="the learner's public tap certificate (NAME.key): the only peer the tap sends to",
    )
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--control-token",
        default=None,
        help=f"control bearer token (visible in `ps`: prefer the file or ${TOKEN_ENV})",
    )
    tok.add_argument("--control-token-file", default=None, help="file holding the control token")
    p.add_argument("--host", default=d.host, help="OpenAI API address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--control-host", default=None, help="control API address (default: --host)")
    p.add_argument("--control-port", type=int, default=None, help="serve control on its own port")
    p.add_argument(
        "--control-allowed-hosts",
        nargs="+",
        default=[],
        metavar="HOST",
        help="Host names the control routes answer without a control token, besides the bound "
        "address, localhost, 127.0.0.1 and ::1 ('*': any); requests naming another host (a "
        "browser page rebinding its name) get 403",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections the OpenAI port serves at once; past that, requests get 503",
    )
    p.add_argument(
        "--control-max-connections",
        type=int,
        default=d.control_max_connections,
        help="the same for the control port, counted apart (a full OpenAI port leaves the "
        "probes and the control routes answering)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=d.header_timeout_s,
        help="seconds a connection may take to send a request's headers (after it opens, or "
        "after its previous response) before it is closed, on both ports",
    )
    p.add_argument("--dtype", default=d.dtype, help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument(
        "--work-dir", default=d.work_dir, help="a draft built here, the committed-draft record"
    )
    p.add_argument(
        "--checkpoint-root",
        default=None,
        help="only load drafts and policies from inside this folder (symlinks resolved)",
    )
    p.add_argument(
        "--resume-draft",
        action=argparse.BooleanOptionalAction,
        default=d.resume_draft,
        help="serve the newest draft this server committed before it stopped, when newer than "
        "--draft (recorded under --work-dir)",
    )
    p.add_argument(
        "--weight-transfer",
        default=None,
        choices=WEIGHT_TRANSFER,
        help="serve vLLM's RL weight-sync routes (/init_weight_transfer_engine, "
        "/start_weight_update, ..., /sleep, /wake_up) behind the control token, with this "
        "vLLM weight-transfer backend (docs/rl.md)",
    )
    p.add_argument("--worker-extension-cls", default=d.worker_extension_cls, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace, vllm_args: list[str] | None = None) -> ServeConfig:
    names = {f.name for f in fields(ServeConfig)} - {"vllm_args"}
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return ServeConfig(**values, vllm_args=list(vllm_args or []))


# ----------------------------------------------------------------------------- to vLLM
def resolve_model(name: str) -> Path:
    if name == "smollm2":
        from codraft.prepare import prepare_smollm2

        return prepare_smollm2().path
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name!r}: expected 'smollm2' or a folder with config.json")
    return path.resolve()


DSPARK_NOT_SERVED = (
    "codraft serve does not serve DSpark drafts (vLLM serves them only in its V2 model runner, "
    "on CUDA); serve the draft with stock vLLM (speculative_config method 'dspark', "
    "num_speculative_tokens = its block_size), or serve a DFlash or EAGLE-3 draft"
)


def draft_kind(path: Path) -> str:
    """ "eagle3", "dflash" or "dspark": the kind of the draft folder `path` (its config.json's
    architecture)."""
    from codraft.draft.checkpoint import config_from_hf

    try:
        return config_from_hf(json.loads((path / "config.json").read_text())).kind
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f"draft {path}: expected an EAGLE-3, DFlash or DSpark checkpoint folder, its "
            f"config.json is unusable: {e}"
        ) from None


def resolve_draft(cfg: ServeConfig, model: Path) -> Path:
    """The --draft folder, or an untrained draft (version 0) of kind cfg.drafter under
    cfg.work_dir: deterministic (seed 0; EAGLE-3: the first draft_vocab_size token ids), so it
    is built once per target and settings and reused by later starts."""
    if cfg.draft is not None:
        path = Path(cfg.draft)
        if not (path / "config.json").is_file():
            raise ValueError(f"--draft {cfg.draft!r}: expected a draft checkpoint folder")
        kind = draft_kind(path)
        if kind not in SERVED_DRAFTERS:
            raise ValueError(f"--draft {cfg.draft} is a {kind} draft: {DSPARK_NOT_SERVED}")
        if cfg.drafter is not None and kind != cfg.drafter:
            raise ValueError(
                f"--drafter {cfg.drafter} but --draft {cfg.draft} is a {kind} draft: drop "
                "--drafter (the draft's own kind is used) or give a draft of that kind"
            )
        return path.resolve()
    import hashlib

    from codraft.draft.checkpoint import DraftCheckpointError, check_draft
    from codraft.draft.dflash_config import DFlashConfig
    from codraft.draft.init import write_new_draft
    from codraft.models.config import TargetConfig

    target = TargetConfig.from_pretrained(model)
    drafter = cfg.drafter or "eagle3"
    kwargs: dict[str, Any] = {"drafter": drafter}
    if drafter == "eagle3":
        kwargs["draft_vocab_size"] = min(cfg.draft_vocab_size, target.vocab_size)
    else:
        kwargs["block_size"] = max(DFlashConfig.block_size, cfg.num_speculative_tokens + 1)
    if cfg.dtype in ("float32", "bfloat16", "float16"):
        kwargs["dtype"] = cfg.dtype
    elif target.dtype:
        kwargs["dtype"] = target.dtype
    # (an EAGLE-3 draft's key leaves the kind out: folders built before DFlash keep their names)
    named = {k: v for k, v in kwargs.items() if not (k == "drafter" and v == "eagle3")}
    key = (model / "config.json").read_bytes() + json.dumps(named, sort_keys=True).encode()
    out = Path(cfg.work_dir) / f"draft-v0-untrained-{hashlib.sha256(key).hexdigest()[:12]}"
    try:
        check_draft(out)
    except DraftCheckpointError:
        try:
            write_new_draft(
                out, model, version=0, overwrite=out.exists(), target_config=target, **kwargs
            )
        except FileExistsError:  # another server wrote it meanwhile
            check_draft(out)
    log.warning("no --draft given: serving an untrained %s draft (version 0) at %s", drafter, out)
    return out.resolve()


def engine_settings(cfg: ServeConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's additional_config carrying the worker extension's settings
    (codraft.server.engine_config): the tap flags, under any `codraft` keys given in a
    passed-through --additional-config (those win: it is how to reach the engine settings that
    have no flag here)."""
    from codraft.server.engine_config import ADDITIONAL_CONFIG_KEY, EngineConfig

    extra = dict(extra or {})
    given = extra.get(ADDITIONAL_CONFIG_KEY) or {}
    if not isinstance(given, dict):
        raise ValueError(f"--additional-config's {ADDITIONAL_CONFIG_KEY!r} entry must be a dict")
    ours = EngineConfig(
        tap_endpoint=cfg.tap_endpoint, tap_mode=cfg.tap_mode, tap_sample_rate=cfg.tap_sample_rate,
        tap_key=_absolute(cfg.tap_key), tap_learner_key=_absolute(cfg.tap_learner_key),
    ).to_additional_config()[ADDITIONAL_CONFIG_KEY]  # fmt: skip
    merged = EngineConfig.from_dict({**ours, **given})  # validates, names unknown keys
    extra[ADDITIONAL_CONFIG_KEY] = dataclasses.asdict(merged)
    return extra


def _absolute(path: str | None) -> str | None:
    """A key path as the engine's processes read it (they may run in another folder)."""
    return None if path is None else str(Path(path).absolute())


def _pop_flag(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """argv without `flag VALUE` / `flag=VALUE`, and that value (None when absent)."""
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == flag and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, value


def _has_flag(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def vllm_argv(cfg: ServeConfig, model: Path, draft: Path) -> list[str]:
    """The vLLM serve command line for `cfg` (cfg.vllm_args appended last).

    The engine runs as vLLM runs it by default (torch.compile, CUDA graphs, async scheduling,
    the model runner vLLM picks): the worker extension configures its capture when the model
    is loaded, before any of that. In "full" tap mode prefix caching is off unless the extra
    arguments turn it on: a prefix-cache hit skips the prompt's forward pass, so the request's
    features could not be captured (the engine counts it in requests_incomplete instead).
    """
    for flag in (
        "--speculative-config", "--worker-extension-cls", "--model", "--weight-transfer-config"
    ):  # fmt: skip
        if any(a == flag or a.startswith(flag + "=") for a in cfg.vllm_args):
            raise ValueError(f"{flag} is set by codraft serve; remove it from the extra arguments")
    passthrough, extra_json = _pop_flag(list(cfg.vllm_args), "--additional-config")
    try:
        extra = json.loads(extra_json) if extra_json else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--additional-config is not valid JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ValueError("--additional-config must be a JSON object")
    spec = {
        "method": draft_kind(draft),
        "model": str(draft),
        "num_speculative_tokens": cfg.num_speculative_tokens,
    }
    argv = [
        "--model", str(model),
        "--speculative-config", json.dumps(spec),
        "--worker-extension-cls", cfg.worker_extension_cls,
        "--additional-config", json.dumps(engine_settings(cfg, extra)),
        "--dtype", cfg.dtype,
        "--host", cfg.host,
        "--port", str(cfg.port),
    ]  # fmt: skip
    if cfg.max_model_len is not None:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.weight_transfer is not None:
        # ipc: vLLM's IPC engine reading JSON handles (codraft.server.ipc_json), no pickle
        backend = "codraft_ipc" if cfg.weight_transfer == "ipc" else cfg.weight_transfer
        argv += ["--weight-transfer-config", json.dumps({"backend": backend})]
    if cfg.tap_mode == "full" and not _has_flag(
        passthrough, "--enable-prefix-caching", "--no-enable-prefix-caching"
    ):
        argv.append("--no-enable-prefix-caching")
    from codraft.server.compat import default_serve_args

    # the installed release's engine defaults (codraft.server.compat.Traits), unless given
    return argv + default_serve_args(passthrough) + passthrough


def parse_vllm_args(argv: list[str]) -> argparse.Namespace:
    from codraft.server.compat import serve_api

    api = serve_api()
    parser = api.make_arg_parser(api.FlexibleArgumentParser(prog="codraft serve (vLLM arguments)"))
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    api.validate_parsed_serve_args(args)
    return args


def offline_engine_kwargs(cfg: ServeConfig, model: Path, draft: Path) -> dict[str, Any]:
    """`codraft serve`'s engine as keyword arguments of an offline `vllm.LLM`: its vLLM command
    line (`vllm_argv`) parsed by vLLM's own parser, the engine arguments that differ from
    vLLM's defaults. The same engine, without the HTTP servers (benchmarks, notebooks)."""
    from dataclasses import fields as dc_fields

    from vllm.engine.arg_utils import EngineArgs

    parsed = EngineArgs.from_cli_args(parse_vllm_args(vllm_argv(cfg, model, draft)))
    defaults = EngineArgs(model=parsed.model)
    out: dict[str, Any] = {"model": parsed.model}
    for f in dc_fields(EngineArgs):
        value, default = getattr(parsed, f.name), getattr(defaults, f.name)
        # the parser spells some unset options None or "" where the dataclass says False/None
        if f.name != "model" and value != default and (value or default):
            out[f.name] = value
    return out
