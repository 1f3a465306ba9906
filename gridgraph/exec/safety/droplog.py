"""Warnings about dropped messages that no flood can multiply.

Any peer may send anything, as often as it likes, and peer IDs cost nothing: a log line per
dropped message let 7,270 tiny malformed announcements write 5,083 lines in 10 s to every
log. State, per `DropLog`: for each (peer, warning) lately logged, when its window began,
how many lines it had in it, and how many like it were not logged; a bucket of lines for
all peers together; a count of warnings not logged for want of lines. Policy:
- the first `per_warning` lines of a warning about a peer in `every` s are logged; more
  within the window are counted, and the next one logged says how many were not;
- at most `lines` lines per `every` s in all: past that, warnings are counted, and the next
  line logged says how many others were not;
- at most `kept` (peer, warning) pairs are remembered; past that the oldest go (their
  counts join the others').
Two warnings are alike when their text is, but for its numbers (sizes, counters) and past
its first KEY_CHARS characters.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

EVERY = 10.0  # seconds: one line per peer and kind of warning in this long
LINES = 20  # lines in all per EVERY s
PER_WARNING = 2  # lines per peer and warning per EVERY s
KEPT = 1024  # (peer, warning) pairs remembered
KEY_CHARS = 160
_NUMBER = re.compile(r"\d+")


class DropLog:
    """Logs `warning(peer, msg, *args)` as `logger.warning(msg, *args)` would, at most
    `per_warning` times per `every` s per peer and warning alike, and at most `lines` times
    per `every` s in all.

    Example:
        drops = DropLog(logging.getLogger(__name__))
        drops.warning(peer, "dropped a malformed message from %s: %s", peer, error)
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every: float = EVERY,
        lines: int = LINES,
        per_warning: int = PER_WARNING,
        kept: int = KEPT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every, self.lines, self.kept, self.clock = every, lines, kept, clock
        self.per_warning = per_warning
        # (peer, warning) -> [window began, lines in it, not logged since the last line]
        self._last: OrderedDict[tuple[str, str], list] = OrderedDict()
        self._tokens = float(lines)
        self._updated = clock()
        self._others = 0  # warnings not logged for want of lines, or forgotten with their pair
        self._lock = threading.Lock()

    def warning(self, peer: str, msg: str, *args: object) -> bool:
        """Log the warning, or count it; whether it was logged."""
        if not self.logger.isEnabledFor(logging.WARNING):
            return False
        now = self.clock()
        text = msg % args if args else msg
        key = (peer, _NUMBER.sub("#", text[:KEY_CHARS]))
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last[0] >= self.every:
                last[0], last[1] = now, 0  # a new window
            if last is not None and last[1] >= self.per_warning:
                last[2] += 1
                return False
            self._tokens = min(
                self.lines, self._tokens + (now - self._updated) * self.lines / self.every
            )
            self._updated = now
            if self._tokens < 1:
                self._others += 1
                return False
            self._tokens -= 1
            if last is None:
                last = self._last[key] = [now, 0, 0]
            last[1] += 1
            same, last[2] = last[2], 0
            others, self._others = self._others, 0
            self._last.move_to_end(key)
            while len(self._last) > self.kept:
                self._others += self._last.popitem(last=False)[1][2]
        if same:
            text += f" (and {same} more like it from {peer:.60} not logged)"
        if others:
            text += f" ({others} other warnings of dropped messages not logged)"
        self.logger.warning("%s", text)
        return True
