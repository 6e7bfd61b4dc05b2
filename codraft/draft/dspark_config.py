"""`DSparkConfig`: a DFlash backbone with DSpark's sequential Markov head, and its config.json
in the form vLLM's `Qwen3DSparkModel` reads.

DSpark (Cheng et al., "DSpark: Confidence-Scheduled Speculative Decoding with Semi-Autoregressive
Generation", 2026) keeps DFlash's parallel backbone and adds a small sequential stage: the draft
logits of each position get a bias from the token proposed just before it,
``markov_w2 @ markov_w1[previous token]`` (a rank-``markov_rank`` transition matrix over the
vocabulary), and the block is then sampled left to right. The backbone's block layout changes
too (vLLM's ``sample_from_anchor``, the default of its DSpark speculator): the block is
``[anchor, noise, ..., noise]`` of ``block_size`` queries at the positions from the anchor on,
and *every* query predicts the token after its own position (the anchor predicts the first
proposal), so a block of ``block_size`` queries proposes ``block_size`` tokens, where DFlash's
``1 + k`` slots propose ``k``. vLLM serves DSpark with ``num_speculative_tokens == block_size``
(fewer queries than trained change every slot's output: the block attends to itself
bidirectionally).

vLLM serves DSpark only in its V2 model runner, which needs Triton: on CUDA (vLLM 0.26 has it),
not in the CPU build. Everything else (target layer ids, the noise token, the Qwen3 layers, the
target's embedding and lm_head) is DFlash's, read from the same ``dflash_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from codraft.draft.config import _as_int
from codraft.draft.dflash_config import DFlashConfig

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"


@dataclass
class DSparkConfig(DFlashConfig):
    """A DSpark draft: `DFlashConfig` plus the Markov head's rank. `block_size` is the number
    of queries, and of proposals, per block."""

    markov_rank: int = 64

    kind = "dspark"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.markov_rank = _as_int("markov_rank", self.markov_rank)
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {self.markov_rank}")

    @property
    def proposals(self) -> int:
        """Tokens one block proposes: every query predicts the token after it."""
        return self.block_size

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that stock vLLM (0.26 and later, V2 model runner) loads with
        `{"method": "dspark"}`."""
        out = super().to_hf_dict()
        out["architectures"] = [DSPARK_ARCHITECTURE]
        out.update(
            markov_rank=self.markov_rank,
            markov_head_type="vanilla",
            sample_from_anchor=True,  # vLLM 0.32's name for the layout above
            dspark_bonus_anchor=False,  # vLLM 0.26's
            dspark_block_size=self.block_size,  # 0.26 refuses num_speculative_tokens below it
        )
        return out

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> DSparkConfig:
        """Read a DSpark draft config.json (the kind `to_hf_dict` writes)."""
        archs = hf.get("architectures") or []
        if DSPARK_ARCHITECTURE not in archs:
            raise ValueError(f"architectures is {archs}, expected [{DSPARK_ARCHITECTURE!r}]")
        if hf.get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(
                f"markov_head_type is {hf.get('markov_head_type')!r}; codraft's DSpark draft "
                "has the vanilla (low-rank transition) head"
            )
        if hf.get("sample_from_anchor") is False or hf.get("dspark_bonus_anchor"):
            raise ValueError(
                "a DSpark draft with the 1 + N fill-in block (sample_from_anchor false) is not "
                "what codraft trains: every query, the anchor's too, predicts the next token"
            )
        if "markov_rank" not in hf:
            raise ValueError("config has no markov_rank")
        base = DFlashConfig.from_hf_dict({**hf, "architectures": ["DFlashDraftModel"]})
        return cls(**base.to_dict(), markov_rank=hf["markov_rank"])
