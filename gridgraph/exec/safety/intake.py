"""What a worker's network thread checks of a message before it acts on it, and while it
decodes it: its size, then its peer's rate of header bytes, then the header's shape.

State: header bytes decoded per peer (a token bucket). Policy: a message over
`max_message_bytes` is dropped unread; a header is decoded only within its peer's
HEADER_BYTES_PER_SECOND (bursts of HEADER_BURST; none on a grid whose request rate is
unlimited, a local grid of your own), since a header costs time to decode (up to ~70 ms for
a hostile 1 MB one) before any check of what it says; a header refused for its containers
(wire.CostlyHeader: no honest peer makes one) costs its peer COSTLY_HEADER_CHARGE times its
size. Every drop is a bounded warning (droplog.py).
"""

from __future__ import annotations

import math

from gridgraph.exec import wire
from gridgraph.exec.safety.droplog import DropLog
from gridgraph.exec.safety.limits import Limits, RateLimiter, format_size

# A client's programs are sent once and then named by their plan: 1 MiB/s of headers is
# far more than an honest peer needs.
HEADER_BYTES_PER_SECOND = 1 << 20
HEADER_BURST = 2 * wire.MAX_HEADER_BYTES
COSTLY_HEADER_CHARGE = 16  # (its peer's next header is then decoded some 16 s later, not 1)


class Intake:
    """Opens the messages that reach worker `name`: `open` gives the decoded message, or
    None once it has logged why it dropped it."""

    def __init__(self, name: str, limits: Limits, drops: DropLog) -> None:
        self.name = name
        self.max_bytes = limits.max_message_bytes
        unlimited = math.isinf(limits.requests_per_second)
        self._headers = RateLimiter(
            math.inf if unlimited else HEADER_BYTES_PER_SECOND, HEADER_BURST
        )
        self.drops = drops

    def open(self, owner: str, sender: str, payload: bytes) -> dict | None:
        """`payload` decoded, if it passes the checks above for peer `owner`."""
        if len(payload) > self.max_bytes:
            self.drops.warning(owner, "%s: dropped a %d-byte message from %s, over the limit "
                               "of %d", self.name, len(payload), sender,
                               self.max_bytes)  # fmt: skip
            return None
        if not self._headers.allow(owner, wire.header_size(payload)):
            self.drops.warning(owner, "%s: dropped a message from %s: its peer sent more than "
                               "%s of headers a second", self.name, sender,
                               format_size(HEADER_BYTES_PER_SECOND))  # fmt: skip
            return None
        try:
            return wire.decode(payload)
        except wire.WireError as e:
            if isinstance(e, wire.CostlyHeader):
                self._headers.charge(owner, COSTLY_HEADER_CHARGE * wire.header_size(payload))
            self.drops.warning(owner, "%s: dropped a malformed message from %s: %s",
                               self.name, sender, e)  # fmt: skip
            return None
