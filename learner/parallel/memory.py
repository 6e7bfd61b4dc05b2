"""Memory model of the TTT attention per GPU under context parallelism (docs/context_parallel.md),
and of the whole TTT step: what it keeps for backward (`step_saved_bytes_per_token`) and its
peak (`step_peak_bytes`).

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


# ------------------------------------------------------------------------- the whole step
@dataclass(frozen=True)
class StepShape:
    """The draft's shape for the whole TTT step. Default: the draft of Llama-3.1-8B (hidden
    4,096, MLP 14,336, 32 / 8 heads of 128, three taps, a 32,000-token draft vocab), its
    taps and the teacher's logits in bf16 (`taps_bytes`, `teacher_bytes`: their dtype's size),
    as a bf16 target sends and computes them."""

    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    taps_width: int = 3 * 4096
    draft_vocab: int = 32000
    taps_bytes: int = 2
    teacher_bytes: int = 2


def step_saved_bytes_per_token(
    passes: int,
    s: StepShape = StepShape(),
    *,
    autocast: bool = True,
    recompute_mlp: bool = False,
    cp: int = 1,
) -> int:
    """Bytes per local token that the TTT step (codraft.learner.ttt, as the Trainer runs it)
    keeps for backward once its K passes and their losses are computed: what grows with the
    tokens (the bf16 copies of the weights that autocast keeps are a constant, left out).

    `autocast`: the GPU trainer's bf16 autocast over fp32 weights (activations `a` = 2 bytes);
    False: fp32 throughout (a = 4). Per pass, read off the step's autograd graph:

    * RMSNorm (codraft.models.layers) of an input that needs grad: the input itself, and 1/rms
      (4 bytes): ``aH + 4``, where the input is not kept already; of the embeddings (no
      grad): only the normed value (fp32, as the embeddings), ``4H``;
    * the hidden-state norm's input is the pass's input h (fc's output, or the previous
      pass's): ``aH + 4``; q, k, v projections: their one input ``2H a`` (under autocast cast
      to bf16 once, not by each projection: codraft.draft.model); RoPE's cos and sin: ``2 D a``;
    * attention (codraft.learner.attention): q and its output ``2 Hq D a``, fp32 lse ``4 Hq``,
      the pass's k and v ``2 Hkv D a`` (the figure `saved_bytes` models, with the CP shards);
    * o_proj: nothing new (its input is the attention output, kept already);
    * the post-attention RMSNorm of the residual ``aH + 4`` and the MLP: its input ``H a``
      (cast once, as the q/k/v input), gate, silu, up and their product ``4 I a``;
      with `recompute_mlp` nothing: backward runs them again from the attention output and
      h, both kept already;
    * the loss (codraft.learner.chunked_loss: logits never kept): the valid rows' index (8),
      their h (``aH``) for the final RMSNorm (+ 4), the normed rows in the matmuls' dtype
      ``aH`` and the index of their teacher rows (8: the loss reads the teacher's logits where
      they lie); under context parallelism (`cp` > 1) some of those rows come from other
      ranks, and the loss keeps the gathered copy instead, ``teacher_bytes V_draft``;

    and once per step the taps in the activations' dtype for `fc`, ``taps_width a``, unless
    they came in it (bf16 taps under autocast: nothing)."""
    a, H, inter = (2 if autocast else 4), s.hidden, s.intermediate
    norm = a * H + 4
    qkv = 2 * H * a
    attention = (2 * s.heads + 2 * s.kv_heads) * s.head_dim * a + 4 * s.heads
    mlp = 0 if recompute_mlp else norm + H * a + 4 * inter * a
    loss = 8 + norm + a * H + (s.teacher_bytes * s.draft_vocab if cp > 1 else 8)
    per_pass = 4 * H + norm + qkv + 2 * s.head_dim * a + attention + mlp + loss
    return passes * per_pass + (s.taps_width * a if s.taps_bytes != a else 0)


def step_peak_bytes(
    tokens: int,
    passes: int,
    s: StepShape = StepShape(),
    *,
    recompute_mlp: bool = False,
    loss_chunk: int = 4096,
    cp: int = 1,
) -> int:
    """The TTT step's peak on one GPU under bf16 autocast, above what was allocated before it
    (the weights, their gradients and optimizer state, and the batch's own features: taps,
    last hidden states, ids): bytes for `tokens` tokens (the rank's share under CP).

    Per local token: what backward keeps (`step_saved_bytes_per_token`), the teacher's logits
    of the draft vocab that the step computes from the last hidden states (``teacher_bytes
    V_draft``), and the working set of the moment the peak falls in, the larger of two (read
    off the allocator's history at the peak, scripts/bench_cp_train.py --memory-history, and
    fitted to the peaks measured on the H200 from 16K to 256K tokens):

    * the loss's backward of the last pass: its fp32 gradient of the normed rows, ``4H``, and
      a constant, the chunk's fp32 [chunk, V_draft] buffers (the logits, their softmax, the
      teacher's softmax, the logits' gradient: ``16 chunk V_draft``): the peak at small T;
    * the MLP's backward of the last pass: the gradients of gate and up, ``2 I a``, and an
      fp32 H-wide one, ``4H``; with `recompute_mlp` the MLP run again there, gate, up, silu and
      their product, and two gradients of that width: ``6 I a`` (a = 2).

    Checked against every peak measured on the H200 (tests/test_memory_model.py). Under CP the
    ring attention's own transient (`transient_bytes`) is smaller than either working set and
    is left out."""
    t = local_tokens(tokens, cp) if cp > 1 else tokens
    a, H, inter = 2, s.hidden, s.intermediate
    per_token = step_saved_bytes_per_token(passes, s, recompute_mlp=recompute_mlp, cp=cp)
    per_token += s.teacher_bytes * s.draft_vocab
    loss = t * (per_token + 4 * H) + 16 * min(loss_chunk, t) * s.draft_vocab
    mlp = t * (per_token + (6 * inter * a if recompute_mlp else 4 * H + 2 * inter * a))
    return max(loss, mlp)


def step_table(
    tokens: tuple[int, ...] = (16384, 65536, 131072), passes: int = 3, s: StepShape = StepShape()
) -> str:
    """Markdown: what one GPU keeps for backward in the TTT step and the step's peak above
    its inputs (GiB, cp = 1, bf16 autocast), and the attention's part (`saved_bytes`)."""
    attn = AttnShape(s.heads, s.kv_heads, s.head_dim, 2)
    full = step_saved_bytes_per_token(passes, s)
    lean = step_saved_bytes_per_token(passes, s, recompute_mlp=True)
    rows = [
        "| tokens | kept for backward | peak | with recompute_mlp: kept | peak "
        "| of which attention |",
        "| --: | --: | --: | --: | --: | --: |",
    ]
    for t in tokens:
        peak = step_peak_bytes(t, passes, s) / GIB
        peak_lean = step_peak_bytes(t, passes, s, recompute_mlp=True) / GIB
        rows.append(
            f"| {t} | {t * full / GIB:.1f} | {peak:.1f} | {t * lean / GIB:.1f} "
            f"| {peak_lean:.1f} | {saved_bytes(t, 1, passes, attn) / GIB:.1f} |"
        )
    return "\n".join(rows)


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
    print()
    print(step_table())
