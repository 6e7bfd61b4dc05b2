"""The policy gate: no generation from undefined target weights.

A policy load that fails after it began writing the target's weights, and whose restore of the
previous policy fails too (or a policy weight transfer that fails midway), leaves weights that
are part old, part new: any token sampled from them is nobody's policy. The engine then marks
itself `policy_broken` (codraft.server.worker_ext, codraft.server.transfer, the SGLang engine)
and every reply of it says so; `EngineControl` keeps the message. While it is set, `PolicyGate`
answers every POST of the OpenAI app (completions, chat, responses, embeddings, whatever a
release adds), and every websocket, with 503 in OpenAI's error format, the message saying what
to do; codraft's own control and weight-sync routes and vLLM's administrative ones pass, since
they are how the weights get defined again. /ready answers 503 meanwhile (codraft.server.api).
A good policy load, a completed policy transfer or a restart clears it.

The engine itself keeps stepping (its loop must not die, and requests admitted before the load
finish on whatever weights they see, as they do during any policy load); only new requests are
refused, at the edge.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from codraft.server.refusal import openai_refusal

# vLLM's routes that generate nothing and that a trainer or operator needs to mend the weights
ADMIN_PATHS = frozenset(
    {
        "/tokenize", "/detokenize", "/collective_rpc", "/start_profile", "/stop_profile",
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/scale_elastic_ep",
        "/reset_mm_cache", "/reset_encoder_cache",
    }
)  # fmt: skip


class PolicyGate:
    """503 for generation while `control.policy_broken` is set (see module doc).

    `control` is an EngineControl (anything with a `policy_broken: str | None`); `exempt` are
    the paths that always pass (codraft's control and weight-sync routes, vLLM's
    administrative ones: ADMIN_PATHS is added)."""

    def __init__(self, app: ASGIApp, control: Any, exempt: Iterable[str] = ()) -> None:
        self.app = app
        self.control = control
        self.exempt = frozenset(exempt) | ADMIN_PATHS

    def refusal(self, scope: Scope) -> str | None:
        """The message a request is refused with, or None when it passes."""
        broken = self.control.policy_broken
        if broken is None or scope["type"] not in ("http", "websocket"):
            return None
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if path in self.exempt:
            return None
        if scope["type"] == "http" and scope.get("method") != "POST":
            return None
        return f"generation refused: {broken}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = self.refusal(scope)
        if message is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1013, "reason": message[:120]})
            return
        refusal = openai_refusal(
            message, 503, "ServiceUnavailableError", headers={"Retry-After": "30"}
        )
        await refusal(scope, receive, send)
