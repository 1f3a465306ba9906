"""Fixtures shared by tests/exec/ipfs/ and tests/exec/worker/ (the attackers' arena)."""

from tests.exec.ipfs.fixtures import outsider_node  # noqa: F401 (a fixture)
