"""`codraft status | draft load|prepare|rollback | policy load | tap set`: the control API from a
shell, through the Python client (`codraft.client.commands`, also `python -m codraft.client`)."""

from __future__ import annotations

from typing import Any


def register(sub: Any, commands: dict[str, Any]) -> None:
    from codraft.client.commands import add_client_commands

    add_client_commands(sub, commands)
