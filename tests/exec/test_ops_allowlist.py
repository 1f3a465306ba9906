"""The worker's op rules: which ops resolve, and the bounds check on every op's result."""

from __future__ import annotations

import pytest
import torch

from gridgraph.exec.ops import ViewOutOfBounds, check_view

aten = torch.ops.aten


def test_views_inside_their_storage_pass():
    x = torch.arange(12.0)
    for view in (x, x[3:], x.view(3, 4).t(), x.expand(5, 12), x[:0], torch.empty(0, 3)[:, 1:]):
        check_view(view)
    check_view((x, None, x[1:]))


def test_a_view_past_its_storage_is_refused():
    x = torch.zeros(4)
    view = aten._reshape_alias.default(x, [100], [1])  # built with no bounds check
    with pytest.raises(ViewOutOfBounds, match="needs 400 bytes of a storage of 16"):
        check_view(view)
    with pytest.raises(ViewOutOfBounds):
        check_view([x, view])
