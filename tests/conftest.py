"""Shared fixtures: `grid` runs a test on every transport (in-process, and Kubo PubSub)."""

from __future__ import annotations

import pytest

import gridgraph as gg

try:  # the Kubo fixtures: real daemons and worker processes, started once per session
    from tests.exec.ipfs.fixtures import ipfs_grid, ipfs_workers, kubo_nodes  # noqa: F401
except ImportError:  # pragma: no cover - only while the IPFS fixtures are missing
    ipfs_grid = None


@pytest.fixture
def local_grid():
    with gg.local_grid(3) as grid:
        yield grid


@pytest.fixture(params=["local", pytest.param("ipfs", marks=pytest.mark.ipfs)])
def grid(request):
    """A 3-worker grid on each transport; the same test body runs on both."""
    if request.param == "local":
        with gg.local_grid(3) as g:
            yield g
    else:
        if ipfs_grid is None:
            pytest.skip("IPFS fixtures are not available")
        yield request.getfixturevalue("ipfs_grid")
