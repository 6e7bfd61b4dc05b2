"""Whether a host name or address stays on this machine: the one rule every listener and client
of codraft applies (the tap's CURVE requirement, the control port's token requirement, the
cross-site Host check, the learner's plaintext-token warning)."""

from __future__ import annotations

import ipaddress


def is_loopback_host(name: str) -> bool:
    """True for 'localhost' (and names under .localhost, which resolve to loopback by RFC 6761),
    127.0.0.0/8 and ::1 (brackets allowed); False for anything else, wildcards included."""
    name = name.strip("[]")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
