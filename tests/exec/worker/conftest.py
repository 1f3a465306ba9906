"""Fixtures of the adversarial suite and the fuzzer: `arena`, on each transport."""

from tests.exec.worker.arena import arena_fixture  # noqa: F401 (a fixture)
