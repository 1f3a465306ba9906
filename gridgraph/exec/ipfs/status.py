"""`gridgraph status`: the workers a client would see through a Kubo node, as a table.

It listens on the discovery topic as `connect` does (asking every worker to announce itself
at once), for `wait` s, and prints what each live worker announced (discovery.ANNOUNCED):
name, peer ID, whether a client with `trust` would use it, its lease, its sessions, the
memory they hold and what each client may hold, its message limit and its load (seconds
serving per second: 1.0 is one core busy). Nothing is sent to the workers themselves.

Example:
    print(render(survey("/ip4/127.0.0.1/tcp/5001"), trust=None))
"""

from __future__ import annotations

import time

from gridgraph.exec.ipfs.discovery import HEARTBEAT, Directory, Seen, Trust, ask_workers, trusts
from gridgraph.exec.ipfs.secure import peer_of
from gridgraph.exec.ipfs.transport import GridTransport, open_transport
from gridgraph.exec.protocol import DISCOVERY_TOPIC

COLUMNS = ("NAME", "PEER ID", "TRUSTED", "LEASE", "SESSIONS", "MEMORY", "MAX MESSAGE", "LOAD")


def survey(ipfs: str, wait: float = 2 * HEARTBEAT) -> dict[str, Seen]:
    """What each live worker heard through the node at `ipfs` within `wait` s announced."""
    transport = open_transport(GridTransport, ipfs, deliver_own=True)
    try:
        directory = Directory()
        transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
        ask_workers(transport)
        time.sleep(wait)
        return directory.seen()
    finally:
        transport.close()


def render(workers: dict[str, Seen], trust: Trust | None) -> str:
    """The table `gridgraph status` prints, one worker a row, sorted by name."""
    rows = [COLUMNS]
    for name, seen in sorted(workers.items()):
        info = seen.info or {}
        allowed = info.get("max_memory")
        rows.append((
            name,
            peer_of(seen.identity),
            "open grid" if trust is None else "yes" if trusts(trust, name, seen.identity) else "no",
            f"{seen.lease:g} s",
            _number(info.get("sessions")),
            f"{_size(info.get('held'))} / {_size(allowed) if allowed is not None else 'no limit'}",
            _size(info.get("max_message")),
            f"{info['load']:.2f}" if "load" in info else "?",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _number(v: float | None) -> str:
    return "?" if v is None else f"{int(v)}"


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
