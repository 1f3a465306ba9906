"""Refusals a peer draws are logged a bounded number of times.

Every refused request wrote a warning line: a peer sending requests the worker refuses (of
an unknown kind, past its rate, past its share of the memory budget) wrote one line per
request into the worker's log, up to its refusal rate (500 a second by default).
"""

from __future__ import annotations

import logging

import gridgraph as gg
from gridgraph.exec.safety.limits import Limits
from tests.exec.local_peer import Peer


def test_a_peer_drawing_thousands_of_refusals_writes_a_few_log_lines(caplog):
    with gg.local_grid(1, limits=Limits(max_worker_memory=64 << 20)) as grid:
        mallory = Peer(grid)
        with caplog.at_level(logging.WARNING, logger="gridgraph.worker"):
            caplog.clear()
            for _ in range(3000):  # an unknown kind, then past its rate, each refused
                mallory.send("w0", {"kind": "nonsense"})
            mallory.request("w0", {"kind": "ping"}, timeout=20)  # (answered: the rest were)
            lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        print(f"{len(lines)} lines logged for 3000 refusals")
        assert 1 <= len(lines) <= 25, lines[:3]  # (the next line says how many were not)
        assert any("unknown request kind" in line for line in lines)
