"""Prometheus text exposition -> {sample: value}, for `metrics()`.

Keys are sample names, with their labels in exposition form when they have any:
`codraft_draft_swaps_total`, `codraft_draft_acceptance_length{version="3"}`. prometheus_client's
parser is used when installed; otherwise a small line parser that handles what codraft and vLLM
write (no escaped quotes inside label values).
"""

from __future__ import annotations

import math
import re


def sample_key(name: str, labels: dict[str, str]) -> str:
    """`name` or `name{a="x",b="y"}` (labels sorted), the key `metrics()` uses."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_metrics(text: str) -> dict[str, float]:
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return _parse_lines(text)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[sample_key(s.name, dict(s.labels))] = float(s.value)
    return out


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')
_SPECIAL = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


def _parse_lines(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None or line.lstrip().startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            number = _SPECIAL[value] if value in _SPECIAL else float(value)
        except ValueError:
            continue
        out[sample_key(name, dict(_LABEL.findall(labels)))] = number
    return out
