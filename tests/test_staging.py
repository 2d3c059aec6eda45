"""The staging arenas of the per-step host-to-device copies (vllm_evict/staging.py)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_evict.staging import Staging, is_staging, to_device


def test_copies_arrive_whole_and_aligned():
    staging = Staging(torch.device("cpu"), capacity=8)
    staging.begin_step()
    arrays = [np.arange(3), np.arange(10, 16).reshape(2, 3), np.array([7])]
    out = staging.to_device(*arrays)
    for got, want in zip(out, arrays):
        assert got.dtype == torch.int64 and got.tolist() == want.tolist()
        assert got.data_ptr() % 16 == 0, "every array starts 16 bytes aligned"


def test_an_arena_is_reused_only_two_turns_later_and_grows_without_moving_queued_data():
    staging = Staging(torch.device("cpu"), capacity=4)
    staging.begin_step()
    first = staging._reserve(4)
    first_arena = staging._arenas[staging._turn]
    grown = staging._reserve(6)  # outgrows the arena within the turn: the old one stays alive
    assert first_arena in staging._retired[staging._turn] and grown.numel() == 6
    assert is_staging(first) and is_staging(grown)
    turn = staging._turn
    staging.begin_step()
    assert staging._turn != turn and staging._retired[turn], "the other turn's arenas are untouched"
    staging.begin_step()
    assert staging._turn == turn and not staging._retired[turn]


def test_copy_into_an_existing_device_tensor():
    staging = Staging(torch.device("cpu"))
    staging.begin_step()
    out = torch.zeros(5, dtype=torch.int64)
    staging.copy_into(out[1:4], np.array([4, 5, 6]))
    assert out.tolist() == [0, 4, 5, 6, 0]


def test_without_an_arena():
    a, b = to_device(np.arange(3), np.ones((2, 2), dtype=np.int64), device=torch.device("cpu"))
    assert a.tolist() == [0, 1, 2] and b.tolist() == [[1, 1], [1, 1]]
    assert not is_staging(torch.zeros(3))
