"""An outsider's flood: messages whose header costs time to decode, published at a steady
rate from a peer of its own (on a local bus, or on its own Kubo node), and the latency a
well-behaved client sees meanwhile. Used by the flood tests and bench/bench_flood.py.

The attack (issue 34): ~0.9 MB announcements whose msgpack header is ~900k empty lists, 20
a second, on the discovery topic and on a worker's own topic. Each took ~80 ms to decode,
holding the interpreter lock, before any check of who sent it.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gridgraph.exec import wire
from gridgraph.exec.ipfs import secure
from gridgraph.exec.ipfs.kubo import Kubo, KuboError
from gridgraph.exec.ipfs.transport import SEALED_INLINE, GridTransport
from gridgraph.exec.protocol import DISCOVERY_TOPIC, worker_topic
from tests.exec.hostile import frame

EMPTY_LISTS = 900_000


def costly(kind: str = "announce", n: int = EMPTY_LISTS) -> bytearray:
    """A message of ~`n` bytes whose header is `n` empty lists (the worst shape to decode)."""
    return frame({"kind": kind, "name": "w0", "instance": "x", "id": "1", "session": "s",
                  "pad": [[]] * n})  # fmt: skip


class Flood(threading.Thread):
    """Calls each of `publishers` `rate` times a second until `stop()`; counts the calls."""

    def __init__(self, publishers: list[Callable[[], None]], rate: float = 20.0) -> None:
        super().__init__(name="flood", daemon=True)
        self.publishers, self.rate = publishers, rate
        self.sent = self.failed = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        due = time.monotonic()
        while not self._stop_event.is_set():
            for publish in self.publishers:
                try:
                    publish()
                    self.sent += 1
                except (KuboError, RuntimeError):
                    self.failed += 1
            due += 1 / self.rate
            self._stop_event.wait(max(0.0, due - time.monotonic()))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


def kubo_publishers(
    outsider_api: str, worker_identity: str, name: str = "w0", random: bool = False
) -> list:
    """What one outsider Kubo node publishes, each call one ~0.9 MB message: on the discovery
    topic an announcement (its own key, as any peer may) of the costly message, and on
    worker `name`'s topic the costly message sealed for that worker (whose key is public,
    in its heartbeat) and the raw one unsealed. `random`: random bytes in place of the
    costly message, as many (what the flood costs Kubo alone, whatever its bytes say)."""
    kubo = Kubo(outsider_api)
    channel = secure.Channel(kubo.id())
    payload = os.urandom(len(costly())) if random else bytes(costly())
    announcement = channel.announcement(payload)
    topic = worker_topic(name)
    wire_topic = secure.blind_topic(topic)
    raw = payload if random else bytes(frame([[]] * EMPTY_LISTS))

    def discovery() -> None:
        kubo.pubsub_pub(DISCOVERY_TOPIC, announcement)

    def sealed() -> None:  # (sealed afresh each time: a replayed counter is dropped early)
        kubo.pubsub_pub(wire_topic, channel.seal(worker_identity, topic, SEALED_INLINE + payload))

    def unsealed() -> None:
        kubo.pubsub_pub(wire_topic, raw)

    return [discovery, sealed, unsealed]


def p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20)[-1]


def latencies(step: Callable[[], None], seconds: float, at_least: int = 20) -> list[float]:
    """Wall time of each call of `step`, called for `seconds` s (and at least `at_least` times)."""
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(out) < at_least:
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


class LineCounter(logging.Handler):
    """Counts the log records of gridgraph's loggers while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: list[str] = []  # the first few lines

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 20:
            self.first.append(record.getMessage()[:300])

    def __enter__(self) -> LineCounter:
        logging.getLogger("gridgraph").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("gridgraph").removeHandler(self)


def kubo_flood(
    api: str, worker_identity: str, name: str, seconds: float, rate: float, random: bool = False
) -> Flood:
    """Run the outsider's flood through the Kubo node at `api` for `seconds` s: the costly
    announcement and the sealed costly message on `name`'s topic, each `rate` times a
    second, and the unsealed one a quarter as often."""
    discovery, sealed, unsealed = kubo_publishers(api, worker_identity, name, random)
    flood, garbage = Flood([discovery, sealed], rate), Flood([unsealed], rate / 4)
    flood.start()
    garbage.start()
    time.sleep(seconds)
    flood.stop()
    garbage.stop()
    flood.sent += garbage.sent
    flood.failed += garbage.failed
    return flood


def start_outsider(api: str, worker_identity: str, name: str, seconds: float,
                   rate: float = 20.0, random: bool = False) -> subprocess.Popen:  # fmt: skip
    """The flood from a process of its own, as an outsider's would be (not the client's
    interpreter lock): `finish` it for the count of messages sent."""
    args = [sys.executable, "-m", "tests.exec.flood", api, worker_identity, name,
            str(seconds), str(rate), "random" if random else "costly"]  # fmt: skip
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=root, env=env)


def finish(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[int, int]:
    """(messages sent, publishes that failed) of a flood `start_outsider` started."""
    out, _ = proc.communicate(timeout=timeout)
    sent, failed = out.split()[-2:]
    return int(sent), int(failed)


if __name__ == "__main__":
    api, identity, worker_name, seconds, rate, kind = sys.argv[1:7]
    done = kubo_flood(api, identity, worker_name, float(seconds), float(rate), kind == "random")
    print(done.sent, done.failed, flush=True)


@contextmanager
def announcing(api: str, name: str, instance: str) -> Iterator[None]:
    """A peer of node `api` announcing itself as worker `name` about 3 times a second, as any
    peer may, and never serving it."""
    transport = GridTransport(api)
    stop = threading.Event()

    def announce() -> None:
        seq = 0
        while not stop.is_set():
            msg = {"kind": "announce", "name": name, "instance": instance, "lease": 300.0,
                   "seq": seq}  # fmt: skip
            transport.publish(DISCOVERY_TOPIC, wire.encode(msg), False)
            seq += 1
            stop.wait(0.3)

    thread = threading.Thread(target=announce, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        transport.close()
