"""A one-line progress bar on stderr for large payloads (no dependency).

Policy: a bar is shown for payloads of at least `PROGRESS_MIN` bytes when the user asked for
it (`connect(progress=True)`) or, by default, when stderr is an interactive terminal. It is
redrawn at most every 1 % and erased when done. Updates may come from several threads.

Example:
    bar = Progress("send", total=200 << 20, enabled=True)
    bar.add(512 << 10)   # as each block is stored
    bar.close()
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

PROGRESS_MIN = 64 << 20  # bytes
WIDTH = 30


def wanted(progress: bool | None, stream: TextIO | None = None) -> bool:
    """Whether to show bars: as asked, or (None) when stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """Bytes done of `total`, drawn as `label [#####.....] 42% 84/200 MiB`."""

    def __init__(self, label: str, total: int, enabled: bool, stream: TextIO | None = None):
        self.label, self.total = label, max(total, 1)
        self.enabled = enabled and total >= PROGRESS_MIN
        self.stream = stream or sys.stderr
        self.done = 0
        self._shown = -1
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done = min(self.done + nbytes, self.total)
            percent = 100 * self.done // self.total
            if percent == self._shown:
                return
            self._shown = percent
            filled = WIDTH * self.done // self.total
            bar = "#" * filled + "." * (WIDTH - filled)
            self.stream.write(
                f"\r{self.label} [{bar}] {percent:3d}% {self.done >> 20}/{self.total >> 20} MiB"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._shown >= 0:
            with self._lock:
                self.stream.write("\r" + " " * (len(self.label) + WIDTH + 32) + "\r")
                self.stream.flush()
