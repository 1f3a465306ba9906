"""Warnings of dropped messages: a flood from one peer, or from many, writes a bounded
number of lines, and the lines say how many were not written."""

from __future__ import annotations

import logging

from gridgraph.exec.safety.droplog import DropLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_from_one_peer_is_two_lines_per_interval_counting_the_rest(caplog):
    clock = Clock()
    drops = DropLog(logging.getLogger("test.drops"), every=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test.drops"):
        for i in range(5000):
            clock.now = i / 500  # 500 a second for 10 s
            drops.warning("mallory", "dropped a message from %s: %s", "mallory", f"bad {i}")
        clock.now = 9.99
        drops.warning("mallory", "dropped a message from %s: %s", "mallory", "other")
        clock.now = 10.0
        drops.warning("mallory", "dropped a message from %s: %s", "mallory", "bad 5000")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "dropped a message from mallory: bad 0",
        "dropped a message from mallory: bad 1",
        "dropped a message from mallory: other",  # (not alike: its own lines)
        "dropped a message from mallory: bad 5000 (and 4998 more like it from mallory not logged)",
    ]


def test_each_kind_of_warning_and_each_peer_gets_its_line(caplog):
    drops = DropLog(logging.getLogger("test.drops"), clock=Clock())
    with caplog.at_level(logging.WARNING, "test.drops"):
        assert drops.warning("a", "too large: %d", 5)
        assert drops.warning("a", "too large: %d", 6)
        assert drops.warning("a", "malformed: %s", "x")
        assert drops.warning("b", "too large: %d", 6)
        assert not drops.warning("a", "too large: %d", 7)
    assert len(caplog.records) == 4


def test_many_peers_share_a_bounded_number_of_lines(caplog):
    clock = Clock()
    drops = DropLog(logging.getLogger("test.drops"), every=10.0, lines=20, kept=64, clock=clock)
    with caplog.at_level(logging.WARNING, "test.drops"):
        for i in range(7270):  # one tiny malformed announcement each from as many peer IDs
            clock.now = i / 727
            drops.warning(f"peer{i}", "ignored a discovery message from %s", f"peer{i}")
    # 20 at once, then 2 a second: 38 lines in 10 s, not 5,083
    assert 20 <= len(caplog.records) <= 40
    assert "other warnings of dropped messages not logged" in caplog.records[-1].getMessage()
    assert len(drops._last) <= 64
