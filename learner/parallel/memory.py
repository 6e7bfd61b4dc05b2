"""Memory model of the TTT attention per GPU under context parallelism (docs/context_parallel.md).

Bytes per GPU for K passes over one batch of T tokens split over CP ranks (``t = T / CP`` local
tokens), heads Hq, kv heads Hkv, head dim D, activations of ``b`` bytes (bf16: 2):

* saved for backward (what K ring Functions hold once the K forward passes are done):
  ``S = t * K * (2 b Hq D + 4 Hq + 2 b Hkv D)``: per pass the query and the output
  (``b Hq D`` each), the fp32 log-sum-exp (``4 Hq``), the pass's key and value;
* transient, one pass at a time (the peak is in a backward, while every pass is still saved):
  ``W = t * [(8 + 3 b) Hq D + 4 b Hkv D + 8 Hq] + [CP > 1] * t * (4 b + 16) Hkv D``: the
  incoming gradient, the fp32 dq accumulator, the flash kernel's fp32 dq buffer and its dq,
  the pass's input gradients; under CP two K/V shards in flight (``4 b Hkv D``) and the fp32
  dK/dV accumulators sent and received (``16 Hkv D``). The branch adds nothing per token: it
  runs in fixed-size row chunks;
* peak ``~ S + W``.

Two designs to compare against, at the same T, K and CP:

* gather: each rank all-gathers the whole trunk's K/V of every pass and keeps it for backward:
  ``S + K * 2 b Hkv D * T`` (the last term does not shrink with CP);
* dense mask: the TTT mask over all passes' keys, materialised as bool for the local queries:
  ``(K t) * (K T)`` bytes, before any score matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class AttnShape:
    """The draft attention's shape. Default: the draft of an 8B-class Llama target
    (Llama-3.1-8B: 32 query heads, 8 kv heads, head dim 128), bf16 activations."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2


def local_tokens(tokens: int, cp: int) -> int:
    """Tokens per rank after padding the document to a multiple of 2 x cp."""
    return -(-tokens // (2 * cp)) * 2


def saved_bytes(tokens: int, cp: int, passes: int, s: AttnShape = AttnShape()) -> int:
    b, a, kv = s.dtype_bytes, s.heads * s.head_dim, s.kv_heads * s.head_dim
    return local_tokens(tokens, cp) * passes * (2 * b * a + 4 * s.heads + 2 * b * kv)


def transient_bytes(tokens: int, cp: int, s: AttnShape = AttnShape()) -> int:
    b, a, kv = s.dtype_bytes, s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_token = (8 + 3 * b) * a + 4 * b * kv + 8 * s.heads
    if cp > 1:
        per_token += (4 * b + 16) * kv
    return local_tokens(tokens, cp) * per_token


def peak_bytes(tokens: int, cp: int, passes: int, s: AttnShape = AttnShape()) -> int:
    return saved_bytes(tokens, cp, passes, s) + transient_bytes(tokens, cp, s)


def gather_bytes(tokens: int, cp: int, passes: int, s: AttnShape = AttnShape()) -> int:
    """Per GPU when every rank keeps the whole trunk's gathered K/V of every pass."""
    full_kv = passes * 2 * s.dtype_bytes * s.kv_heads * s.head_dim * tokens
    return peak_bytes(tokens, cp, passes, s) + full_kv


def dense_mask_bytes(tokens: int, cp: int, passes: int) -> int:
    """The bool TTT mask of the local queries of all passes over all passes' keys."""
    return passes * local_tokens(tokens, cp) * passes * tokens


def table(tokens: int = 262144, passes: int = 3, cps: range = range(1, 9)) -> str:
    """The markdown table of docs/context_parallel.md (GiB per GPU)."""
    rows = [
        "| CP | tokens / GPU | saved S | transient W | ring peak S + W | gather K/V | dense mask |",
        "| --: | --: | --: | --: | --: | --: | --: |",
    ]
    for cp in cps:
        rows.append(
            f"| {cp} | {local_tokens(tokens, cp)} | {saved_bytes(tokens, cp, passes) / GIB:.2f} "
            f"| {transient_bytes(tokens, cp) / GIB:.2f} "
            f"| {peak_bytes(tokens, cp, passes) / GIB:.2f} "
            f"| {gather_bytes(tokens, cp, passes) / GIB:.2f} "
            f"| {dense_mask_bytes(tokens, cp, passes) / GIB:.0f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
