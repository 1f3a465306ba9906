"""When to ask again for an answer a lossy transport may have dropped: waits learned per step.

State (`AnswerTimes`, KEYS_KEPT keys): per key (for a client, a plan or a kind of request to a
worker; for a worker, a recv step of a program), the smoothed time the answer took and its
mean deviation, as TCP estimates a round trip (RFC 6298: gains 1/8 and 1/4).

Policy:
- the first ask comes after twice the smoothed time plus four deviations, at least FLOOR s,
  and never later than the caller's default (the client's `retry_after`, a worker's
  RESEND_AFTER); a key with no history waits the default. Only the first ask comes early;
  later ones follow the default's schedule (the default, then twice as long each time), so a
  slow moment costs one message more at most: one of the 4 resends a transfer's sender
  allows, or of the 4 answers again a worker allows a request (and a request of its peer's
  rate);
- a client asks early only for requests of at most EARLY_MAX bytes: a larger one costs its
  worker a fetch and a decode each time;
- every answer is a sample, resent or not: one late by a resend's wait widens the next waits
  a little until they settle, so no loss goes unmeasured, and a step that really got slower
  is learned, not resent every time.
Kubo drops 0.5-3% of PubSub messages (a node validating two from one origin at once keeps the
later), and asking again costs little: a repeated request id never runs twice, and a repeated
transfer request is answered from the sender's kept copy, within the asker's request rate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

FLOOR = 0.02  # seconds: no wait is shorter (a resend costs the worker a decode, Kubo a publish)
EARLY_MAX = 64 * 1024  # bytes: a larger request is sent again on the default schedule only
KEYS_KEPT = 1024  # keys remembered, least recently used dropped


def may_ask_early(payload: bytes) -> bool:
    """Whether a request this large may be sent again after a learned wait."""
    return len(payload) <= EARLY_MAX


class AnswerTimes:
    """Learned answer times by key: `wait(key, default)` before asking again, `observe(key,
    seconds)` once the answer came."""

    def __init__(self) -> None:
        self._times: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

    def wait(self, key: Hashable, default: float) -> float:
        """Seconds to wait for the answer before the first ask again."""
        learned = self._times.get(key)
        if learned is None:
            return default
        smoothed, deviation = learned
        return min(default, max(FLOOR, 2 * smoothed + 4 * deviation))

    def observe(self, key: Hashable, seconds: float) -> None:
        """The answer for `key` took `seconds`."""
        learned = self._times.pop(key, None)
        if learned is None:
            learned = (seconds, seconds / 2)
        else:
            smoothed, deviation = learned
            learned = (
                smoothed + (seconds - smoothed) / 8,
                deviation + (abs(seconds - smoothed) - deviation) / 4,
            )
        self._times[key] = learned
        if len(self._times) > KEYS_KEPT:
            self._times.popitem(last=False)
