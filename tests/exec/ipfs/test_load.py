"""Many clients at once on the same Kubo workers: every computation succeeds, exactly.

Before replies were kept until acknowledged, 8 client processes x 100 concurrent small
computations on 3 Kubo workers failed 27-37% of them ("request already served; its reply is
no longer kept", false WorkerLost, raw KuboError), though every value that came back was
exact. bench/bench_load.py runs the full 8 x 100 and prints throughput and latencies.
"""

from __future__ import annotations

import pytest

from tests.exec.ipfs.load import run_load

pytestmark = pytest.mark.ipfs


def test_concurrent_clients_and_threads_get_every_computation_right(kubo_nodes, ipfs_workers):
    apis = [node.api for node in kubo_nodes]
    load = run_load(apis, [w.name for w in ipfs_workers], processes=4, threads=50)
    assert load.errors == []
    assert len(load.seconds) == 4 * 50
