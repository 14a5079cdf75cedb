"""A step's flags (``ampddp.training.step_agreement``): read from the host's loss, or computed where an accelerator's is."""

import pytest
import torch

from ampddp.training.step_agreement import _flags


@pytest.mark.parametrize(("loss", "non_finite"), [(2.5, 0.0), (float("inf"), 1.0), (float("-inf"), 1.0), (float("nan"), 1.0)])
@pytest.mark.parametrize("vote", [0.0, 1.0])
def test_the_flags_are_the_vote_and_whether_the_loss_is_not_finite(vote, loss, non_finite):
    flags = _flags(vote, torch.tensor(loss))
    assert flags.dtype == torch.float32 and flags.tolist() == [vote, non_finite]


def test_off_the_host_the_flags_are_computed_where_the_loss_is_without_reading_it():
    flags = _flags(1.0, torch.tensor(2.5, device="meta"))  # a meta tensor has no value: reading it would raise
    assert flags.device.type == "meta" and flags.shape == (2,) and flags.dtype == torch.float32
