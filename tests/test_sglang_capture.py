"""codraft.server.sglang.capture: SGLang's steps into codraft's shared assembler.

SGLang cannot run here (no CPU build of its kernels reaches this machine; docs/sglang.md): the
steps below are written as SGLang's EAGLE worker reports them (extend lengths, k rows per
verification, accepted lengths) and the rows are staged on the CPU by codraft's own RowCopier.
The assembler, its chunking and its token-id check are the real ones. What the hooks read from
SGLang's objects is checked on the GPU (scripts/gpu_sglang/capture_probe.py)."""

from __future__ import annotations

import pytest
import torch

from codraft.server.capture import Assembler, CaptureStats, TapTarget
from codraft.server.row_copy import RowCopier
from codraft.server.sglang.capture import SGLangCapture, Step

H, TAPS = 4, (1, 2)


def feats(pos: int, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the target computes at a position for an input token: taps [T * H], last [H]."""
    base = torch.arange(H * (len(TAPS) + 1), dtype=torch.float32)
    row = base + 100.0 * pos + tok
    return row[: H * len(TAPS)], row[H * len(TAPS) :]


def stage(inputs: list[tuple[int, int]]):
    """A step's rows (token, position) staged as the hooks would stage them."""
    copier = RowCopier(torch.device("cpu"), torch.float32, 1 << 20)
    ids = torch.tensor([t for t, _ in inputs])
    pos = torch.tensor([p for _, p in inputs])
    pairs = [feats(p, t) for t, p in inputs]
    taps = torch.stack([a for a, _ in pairs])
    last = torch.stack([b for _, b in pairs])
    return copier.copy(ids, pos, [taps[:, :H], taps[:, H:]], last, [(0, len(inputs))])


def make(max_tokens: int = 64, want: str | None = "full"):
    sent, policy = [], [0]
    target = TapTarget(TAPS, H, "fp", torch.float32, 4096)
    asm = Assembler(target, sent.append, lambda: 7, max_tokens, CaptureStats(), thread=False)
    cap = SGLangCapture(asm, want=lambda rid: want, policy_version=lambda: policy[0])
    asm.put = asm.apply  # no thread: each operation applied as it comes
    return cap, asm, sent, policy


def run_two_requests(cap: SGLangCapture) -> dict[str, list[int]]:
    """a: prompt [1, 2, 3], b: prompt [7, 8]; one prefill of both, then two verifications of
    k = 3 rows: a accepts 2 then 0 drafts, b 0 then 1; returns the final sequences."""
    cap.begin("a", [1, 2, 3])
    cap.begin("b", [7, 8])
    cap.step(Step(["a", "b"], [3, 2], [3, 2], [[4], [9]],
                  stage([(1, 0), (2, 1), (3, 2), (7, 0), (8, 1)])))  # fmt: skip
    # a: [4 | drafts 5, 6 accepted] -> adds 5, 6, 10; b: [9 | 0 rejected, 0] -> adds 11
    cap.step(Step(["a", "b"], [3, 3], [3, 1], [[5, 6, 10], [11]],
                  stage([(4, 3), (5, 4), (6, 5), (9, 2), (0, 3), (0, 4)])))  # fmt: skip
    # a: [10 | 99 rejected, 98] -> adds 12; b: [11 | 13 accepted, 97 rejected] -> adds 13, 14
    cap.step(Step(["a", "b"], [3, 3], [1, 2], [[12], [13, 14]],
                  stage([(10, 6), (99, 7), (98, 8), (11, 3), (13, 4), (97, 5)])))  # fmt: skip
    finals = {"a": [1, 2, 3, 4, 5, 6, 10, 12], "b": [7, 8, 9, 11, 13, 14]}
    cap.finish("a", finals["a"][3:])
    cap.finish("b", finals["b"][2:])
    return finals


def test_final_rows_of_prefills_and_verifications_become_one_message_per_request() -> None:
    cap, asm, sent, _ = make()
    finals = run_two_requests(cap)
    by_id = {m.header.request_id: m for m in sent}
    assert sorted(by_id) == ["a", "b"] and asm.stats.requests_captured == 2
    for rid, final in finals.items():
        m = by_id[rid]
        assert m.token_ids.tolist() == final[:-1]  # every input of the final sequence
        want = [feats(p, t) for p, t in enumerate(final[:-1])]
        assert torch.equal(m.taps.reshape(len(want), -1), torch.stack([a for a, _ in want]))
        assert torch.equal(m.last_hidden, torch.stack([b for _, b in want]))
        assert m.header.policy_version == 0 and m.header.draft_version == 7
    assert by_id["a"].header.prompt_len == 3 and by_id["b"].header.prompt_len == 2


def test_planted_final_count_off_by_one_is_caught() -> None:
    """Mutation check: reading SGLang's count as accepted drafts only (one row fewer than it
    added: the likely misreading of `accept_lens`) leaves a position of each verification
    uncaptured, and the request is not sent. (One row more heals itself: the row of a rejected
    draft sits at a position the next step computes again, and the finish cuts the last.)"""
    cap, asm, sent, _ = make()
    step = cap.step

    def one_fewer(s: Step) -> None:
        if s.counts[0] == 3 and s.final != s.counts:  # the verifications
            s.final = [max(f - 1, 0) for f in s.final]
        step(s)

    cap.step = one_fewer
    run_two_requests(cap)
    assert sent == [] and asm.stats.requests_incomplete == 2


def test_long_requests_go_out_in_chunks_and_ids_mode_sends_no_features() -> None:
    cap, _, sent, _ = make(max_tokens=3)
    run_two_requests(cap)
    ids = sorted(m.header.request_id for m in sent)
    assert ids == ["a#0", "a#1", "a#2", "b#0", "b#1"]
    cap, _, sent, _ = make(want="ids")
    run_two_requests(cap)
    assert [m.taps for m in sent] == [None, None]
    assert sorted(m.token_ids.tolist() for m in sent) == [[1, 2, 3, 4, 5, 6, 10, 12],
                                                           [7, 8, 9, 11, 13, 14]]  # fmt: skip


def test_a_prefix_cache_hit_or_a_policy_change_mid_request_is_not_sent() -> None:
    cap, asm, sent, policy = make()
    cap.begin("c", [1, 2, 3, 4])
    # the radix cache held positions 0..1: the extend computes 2..3 only
    cap.step(Step(["c"], [2], [2], [[5]], stage([(3, 2), (4, 3)])))
    cap.finish("c", [5])
    cap.begin("d", [1, 2])
    cap.step(Step(["d"], [2], [2], [[3]], stage([(1, 0), (2, 1)])))
    policy[0] = 1  # a new policy arrived while d ran
    cap.step(Step(["d"], [1], [1], [[4]], stage([(3, 2)])))
    cap.finish("d", [3, 4])
    assert sent == [] and asm.stats.requests_incomplete == 2
    assert cap.rows_wanted(["d", "x"]) == [] and not cap.states


def test_a_step_that_does_not_add_up_is_refused() -> None:
    with pytest.raises(ValueError, match="within each request's rows"):
        Step(["a"], [3], [4], [[1]])
    with pytest.raises(ValueError, match="needs that many"):
        Step(["a", "b"], [3], [3], [[1]])
    with pytest.raises(ValueError, match="staged rows"):
        Step(["a"], [3], [3], [[1]], stage([(1, 0)]))
