"""Worker discovery on the grid's discovery topic: who is alive, and which peer owns a name.

Workers announce `{"kind": "announce", "name", "instance", "lease", "seq"}` and what
`ANNOUNCED` lists (numbers: their message limit, load ...) on DISCOVERY_TOPIC every
HEARTBEAT s (and at once when a client publishes `{"kind": "discover"}`), and send
`{"kind": "leave", ...}` when they stop cleanly. A `Directory` keeps per name a `Seen`: the
announcing identity ("<peer ID>~<public key>", whole: messages for `w` are sealed for the key
`w` announced), its process instance, when last heard and its lease; and the names pinned.
Policy:
- alive: heard within `dead_after` s and not gone (`leave`): a client waiting on a dead worker
  raises `WorkerLost`, so a killed worker is noticed in DEAD_AFTER + ~1 s. A worker
  unheard that long is still alive while its node holds the subscription to its topic
  (`subscribed`, asked at most every PROBE_EVERY s): a worker process keeps it while it
  lives, whatever delays its heartbeats (a machine under load, a pause), and its node drops
  it when the process dies;
- a name is the first announcing peer ID's (a worker restarted on its node keeps it); other
  claims are ignored (logged) while it is alive, and taken once it is silent DEAD_AFTER s, so
  two directories can disagree on who `w` is. The latest rival claim of each name is kept:
  a client that would pin a name two live peers claim raises GridError naming both (`wait`),
  rather than pick one. With `trust` (`load_trust`) only those peers, for those names, are
  heard: no other peer joins this client's grid as a worker;
- bounded, since any peer may announce anything: SEEN_KEPT names, past half of them
  NAMES_PER_PEER per node (`_room_for`); instances of MAX_INSTANCE characters; claims
  ignored are logged a bounded number of times (safety/droplog.py);
- a client pins the identity and instance it connected to: a restart under the name, or a
  later owner of it, is a lost worker to that client, and nothing is sealed for it; a
  message its transport opened from a pinned endpoint counts as a heartbeat (`heard`).
Only a client's directory says who a worker is, and only to that client (its runs name each
worker's identity, worker.py); a worker's own serves its rival check and `alive`.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gridgraph.errors import GridError
from gridgraph.exec import wire
from gridgraph.exec.ipfs.kubo import KuboError
from gridgraph.exec.ipfs.secure import peer_of
from gridgraph.exec.ipfs.transport import GridTransport
from gridgraph.exec.protocol import DISCOVERY_TOPIC, worker_topic
from gridgraph.exec.safety.droplog import DropLog
from gridgraph.exec.transport import Transport

log = logging.getLogger("gridgraph.ipfs")

HEARTBEAT = 1.0  # seconds between a worker's announcements
DEAD_AFTER = 5.0  # a worker unheard for this long is lost (WorkerLost within 10 s)
PROBE_EVERY = 1.0  # seconds between two looks at a silent worker's subscription
PROBE_TIMEOUT = 5.0  # seconds a node has to say whether a worker's node is subscribed
DEFAULT_LEASE = 300.0  # a silent client's tensors are freed after this long
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_INSTANCE = 64  # characters of a worker process's instance id (workers send 12)
# Any peer may announce as many names as it likes, in the clear, and every directory reads
# them: past SEEN_KEPT // 2 names, a node may add names while it holds fewer than
# NAMES_PER_PEER (live or silent), and past SEEN_KEPT the names silent for `dead_after` go
# (pinned ones stay). A directory full of live names takes no new one: on an open grid,
# anyone can fill it (with some 33 made-up nodes); `trust` keeps others' names out.
SEEN_KEPT = 4096
NAMES_PER_PEER = 64
TYPO_AFTER = 2.0  # seconds of listening before a name that looks mistyped fails `wait`


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"bad worker name {name!r:.60}: use 1-64 letters, digits, '_', '.', '-'")
    return name


Trust = dict[str, str] | set[str]  # worker name -> peer ID, or the trusted peer IDs


def load_trust(trust: str | Path | dict | list | set | tuple) -> Trust:
    """The trusted workers, from a mapping (name -> peer ID), peer IDs, or a file.

    A file is JSON (a {name: peer ID} object or a [peer ID, ...] list) or text with one
    `peer_id` or `name peer_id` a line (`#` starts a comment); `gridgraph id` prints a node's
    peer ID.
    """
    if isinstance(trust, (str, Path)):
        text = Path(trust).read_text()
        try:
            trust = json.loads(text)
        except ValueError:
            pairs = [line.split("#")[0].split() for line in text.splitlines()]
            pairs = [p for p in pairs if p]
            if any(len(p) > 2 for p in pairs):
                raise ValueError(f"{trust}: each line is `peer_id` or `name peer_id`") from None
            if all(len(p) == 2 for p in pairs):
                trust = {name: peer for name, peer in pairs}
            else:
                trust = [p[-1] for p in pairs]
    if isinstance(trust, dict):
        for name, peer in trust.items():
            check_name(name)
            if not isinstance(peer, str) or not peer:
                raise ValueError(f"trusted worker {name!r} needs a peer ID, got {peer!r}")
        return dict(trust)
    if isinstance(trust, (list, set, tuple)) and all(isinstance(p, str) and p for p in trust):
        return set(trust)
    raise ValueError(f"trust must map worker names to peer IDs or list peer IDs, got {trust!r}")


def trusted_peers(trust: Trust) -> set[str]:
    """The peer IDs a trust list names."""
    return set(trust.values()) if isinstance(trust, dict) else set(trust)


def trusts(trust: Trust | None, name: str, identity: str) -> bool:
    """Whether `trust` lets the endpoint `identity` serve as worker `name`."""
    if trust is None:
        return True
    peer = peer_of(identity)
    return trust.get(name) == peer if isinstance(trust, dict) else peer in trust


# What a worker announces besides its name (numbers only, each bounded: `announced`):
# the largest request it reads, what it grants each client, and what it serves now.
ANNOUNCED = {
    "max_message": "the largest request payload it reads (bytes); larger ones are dropped",
    "max_memory": "bytes each client may hold there (absent: no limit)",
    "sessions": "client sessions it holds",
    "held": "bytes its sessions hold",
    "load": "seconds spent serving requests per second, over its last heartbeat",
}


def announced(msg: dict) -> dict[str, float]:
    """The `ANNOUNCED` fields of an announcement that are plain finite non-negative numbers
    (anything else is left out: any peer may announce anything)."""
    out = {}
    for key in ANNOUNCED:
        v = msg.get(key)
        if type(v) in (int, float) and 0 <= v < 2**63:
            out[key] = v
    return out


@dataclass
class Seen:
    """What the directory knows about one worker name."""

    identity: str  # peer id that announced it
    instance: str  # the announcing process (changes on restart)
    last_seen: float
    lease: float
    gone: bool = False
    info: dict[str, float] | None = None  # what it announced of ANNOUNCED
    # Since last heard: whether its node held its topic when last asked, and when (`alive`)
    subscribed: bool = True
    probed_at: float = -math.inf


def subscription_probe(transport: Transport) -> Callable[[str, str], bool | None] | None:
    """`subscribed(name, peer)`: whether node `peer` holds the subscription to worker
    `name`'s topic, as the Kubo node of `transport` sees it (itself, or a peer connected to
    it), or None when that node does not answer in PROBE_TIMEOUT s. None for a transport
    without Kubo."""
    kubo, here = getattr(transport, "kubo", None), getattr(transport, "peer", None)
    wire_topic = getattr(transport, "wire_topic", None)
    if kubo is None or here is None or wire_topic is None:
        return None

    def subscribed(name: str, peer: str) -> bool | None:
        topic = wire_topic(worker_topic(name))
        try:
            if peer == here:
                return topic in kubo.pubsub_ls(timeout=PROBE_TIMEOUT)
            return peer in kubo.pubsub_peers(topic, timeout=PROBE_TIMEOUT)
        except (KuboError, OSError):
            return None

    return subscribed


class Directory:
    """Workers heard on the discovery topic: name -> peer id, instance, last seen.

    Example:
        directory = Directory()
        transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
        names = directory.wait(min_workers=3, timeout=60)
        directory.alive("w1"), directory.identity("w1")
    """

    def __init__(
        self,
        dead_after: float = DEAD_AFTER,
        on_discover: Callable[[], None] = lambda: None,
        trust: Trust | None = None,
        subscribed: Callable[[str, str], bool | None] | None = None,
    ) -> None:
        self.dead_after = dead_after
        # (name, peer ID) -> whether that node still holds the subscription to the name's
        # topic (None: could not tell)
        self.subscribed = subscribed
        self.trust = trust  # None: an open grid, any peer may announce a worker
        self.on_discover = on_discover  # a worker announces itself now
        self._seen: dict[str, Seen] = {}
        self._names_of: dict[str, int] = {}  # node -> how many names in _seen it announced
        self._pruned_at = -math.inf  # when silent names were last dropped (_room_for)
        self._pinned: dict[str, Seen] = {}  # name -> what this client connected to
        self._rivals: dict[str, tuple[str, float]] = {}  # name -> latest other claimant, when
        self._drops = DropLog(log)
        self._cv = threading.Condition()

    def on_message(self, sender: str, payload: bytes) -> None:
        """The discovery topic's handler: record announcements and departures; pass on a
        client's request to announce now."""
        try:
            msg = wire.decode(payload)
            if msg["kind"] == "discover":  # a client looking for workers: answer at once
                self.on_discover()
                return
            name, instance = check_name(msg.get("name")), msg.get("instance")
            if not isinstance(instance, str) or not 0 < len(instance) <= MAX_INSTANCE:
                raise ValueError(f"no instance of 1 to {MAX_INSTANCE} characters")
        except ValueError as e:  # WireError is a ValueError
            self._drops.warning(
                peer_of(sender), "ignored a discovery message from %s: %s", peer_of(sender), e
            )
            return
        now = time.monotonic()
        with self._cv:
            if not trusts(self.trust, name, sender):
                self._drops.warning(peer_of(sender), "peer %s announces worker %r but is not "
                                    "trusted; ignored", peer_of(sender), name)  # fmt: skip
                return
            known = self._seen.get(name)
            owner = known is not None and peer_of(known.identity) == peer_of(sender)
            if known is not None and not owner and self._fresh(known, now):
                if msg["kind"] == "announce":
                    self._rivals[name] = (sender, now)  # (one per name in _seen)
                self._drops.warning(
                    peer_of(sender),
                    "peer %s claims worker name %r, which belongs to live peer %s; ignored",
                    peer_of(sender),
                    name,
                    peer_of(known.identity),
                )
                return
            if known is None and msg["kind"] == "announce" and not self._room_for(sender, now):
                self._drops.warning(peer_of(sender), "peer %s announces more worker names than "
                                    "a directory keeps for one node; %r ignored",
                                    peer_of(sender), name)  # fmt: skip
                return
            if msg["kind"] == "announce":
                lease = msg.get("lease")
                lease = float(lease) if isinstance(lease, int | float) else DEFAULT_LEASE
                if not owner:
                    self._count(known.identity if known is not None else None, sender)
                self._seen[name] = Seen(sender, instance, now, lease, info=announced(msg))
            elif msg["kind"] == "leave" and owner and known.instance == instance:
                known.gone = True
            self._cv.notify_all()

    def _fresh(self, seen: Seen, now: float) -> bool:
        return not seen.gone and now - seen.last_seen <= self.dead_after

    def heard(self, identity: str) -> None:
        """A message from endpoint `identity` was opened (sealed by its key, signed by its
        node): the pinned names it owns are alive, as if it had announced them now. So a
        client's workers stay alive to it while they answer, whatever delays the discovery
        topic."""
        with self._cv:
            for name, pinned in self._pinned.items():
                seen = self._seen.get(name)
                if pinned.identity == identity and seen is not None and seen.identity == identity:
                    seen.last_seen = max(seen.last_seen, time.monotonic())

    def _claimants(self, name: str, now: float) -> tuple[str, str] | None:
        """(under _cv) The two peers claiming `name`, if it is not pinned yet and a live rival
        of its owner claims it too."""
        rival = self._rivals.get(name)
        if name in self._pinned or rival is None or now - rival[1] > self.dead_after:
            return None
        owner, other = peer_of(self._seen[name].identity), peer_of(rival[0])
        return (owner, other) if owner != other else None

    def _contested(self, names: list[str], now: float) -> None:
        """(under _cv) Raise GridError if a name not pinned yet has a live rival claimant."""
        for name in names:
            claim = self._claimants(name, now)
            if claim is not None:
                raise GridError(
                    f"worker name {name!r} is claimed by two peers, {claim[0]} and {claim[1]}: "
                    f"on an open grid any peer may announce any name, and this client will not "
                    f"pick one. Connect with trust={{{name!r}: PEER_ID}} naming the right one "
                    f"(`gridgraph id --ipfs ADDR` on its node prints its peer ID)"
                )

    def _room_for(self, sender: str, now: float) -> bool:
        """(under _cv) Whether a name new here, announced by `sender`, may be kept (see
        SEEN_KEPT): past half of it, not if its node holds NAMES_PER_PEER names already
        (silent ones too, until they go); past all of it, once the silent names are gone,
        looked for once a second at most (a full directory costs a flood nothing more)."""
        if len(self._seen) < SEEN_KEPT // 2:
            return True
        if self._names_of.get(peer_of(sender), 0) >= NAMES_PER_PEER:
            return False
        if len(self._seen) >= SEEN_KEPT and now - self._pruned_at >= 1.0:
            self._pruned_at = now
            self._seen = {
                n: s for n, s in self._seen.items() if self._fresh(s, now) or n in self._pinned
            }
            self._rivals = {n: r for n, r in self._rivals.items() if n in self._seen}
            self._names_of = {}
            for seen in self._seen.values():
                self._count(None, seen.identity)
        return len(self._seen) < SEEN_KEPT

    def _count(self, old: str | None, new: str) -> None:
        """(under _cv) A name in _seen passes from identity `old` (None: it is new) to `new`."""
        if old is not None:
            self._names_of[peer_of(old)] -= 1
            if not self._names_of[peer_of(old)]:
                del self._names_of[peer_of(old)]
        self._names_of[peer_of(new)] = self._names_of.get(peer_of(new), 0) + 1

    def live(self) -> list[str]:
        """Names of the workers heard lately, sorted."""
        now = time.monotonic()
        with self._cv:
            return sorted(n for n, s in self._seen.items() if self._fresh(s, now))

    def alive(self, name: str) -> bool:
        """Heard lately, or its node still subscribed to its topic; and (once pinned) still
        the same process of the same endpoint."""
        now = time.monotonic()
        with self._cv:
            seen = self._seen.get(name)
            if seen is None or seen.gone:
                return False
            pinned = self._pinned.get(name, seen)
            if (pinned.identity, pinned.instance) != (seen.identity, seen.instance):
                return False
            if self._fresh(seen, now):
                return True
            if self.subscribed is None:
                return False
            if now - seen.probed_at < PROBE_EVERY:
                return seen.subscribed
            seen.probed_at = now  # (meanwhile others take the last answer)
        answer = self.subscribed(name, peer_of(seen.identity))
        with self._cv:
            if answer is not None:
                seen.subscribed = answer
            seen.probed_at = time.monotonic()
            return seen.subscribed

    def identity(self, name: str, wait: float = 0.0) -> str | None:
        """The identity of worker `name`: the pinned one once pinned, else the one that owns
        the name now, waiting up to `wait` s to hear of it; None if unknown."""
        deadline = time.monotonic() + wait
        with self._cv:
            if name in self._pinned:
                return self._pinned[name].identity
            while name not in self._seen and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            seen = self._seen.get(name)
            return seen.identity if seen is not None else None

    def heard_since(self, name: str, since: float) -> Seen | None:
        with self._cv:
            seen = self._seen.get(name)
            return seen if seen is not None and seen.last_seen >= since else None

    def lease(self, names: list[str]) -> float:
        """The shortest lease these workers announce."""
        with self._cv:
            return min(
                (self._seen[n].lease for n in names if n in self._seen), default=DEFAULT_LEASE
            )

    def seen(self) -> dict[str, Seen]:
        """A copy of what is known of each live worker, by name (`gridgraph status`)."""
        now = time.monotonic()
        with self._cv:
            return {n: copy.copy(s) for n, s in self._seen.items() if self._fresh(s, now)}

    def info(self, name: str) -> dict[str, float]:
        """What worker `name` (the pinned one, once pinned) last announced of ANNOUNCED."""
        with self._cv:
            seen = self._seen.get(name)
            pinned = self._pinned.get(name)
            if seen is None or pinned is not None and pinned.identity != seen.identity:
                return {}
            return dict(seen.info or {})

    def max_message(self, name: str) -> int | None:
        """The largest request worker `name` reads, as it announced it (None: unknown)."""
        limit = self.info(name).get("max_message")
        return None if limit is None else int(limit)

    def pin(self, names: list[str]) -> None:
        """Remember which endpoint and process answer to each name: messages for that name
        stay sealed for that endpoint, and another one counts as a lost worker."""
        with self._cv:
            for n in names:
                self._pinned[n] = self._seen[n]

    def joiners(self, new_names: bool) -> list[tuple[str, bool]]:
        """Workers alive now that this client has not pinned as they are: (name, fresh), where
        `fresh` is a pinned name now announced by another process of the same node (a
        restart: another peer that took the name once it fell silent stays out, as an
        impostor would); with `new_names`, names never pinned too (fresh False). Only what
        `trust` lets in was heard at all."""
        now = time.monotonic()
        with self._cv:
            found = []
            for name, seen in self._seen.items():
                if not self._fresh(seen, now) or self._claimants(name, now) is not None:
                    continue
                pinned = self._pinned.get(name)
                if pinned is None and new_names:
                    found.append((name, False))
                elif (
                    pinned is not None
                    and peer_of(pinned.identity) == peer_of(seen.identity)
                    and (pinned.identity, pinned.instance) != (seen.identity, seen.instance)
                ):
                    found.append((name, True))
            return found

    def wait(
        self,
        min_workers: int = 1,
        timeout: float = 60.0,
        names: list[str] | None = None,
        settle: float = 0.0,
        where: str = "the grid",
        pin: bool = False,
    ) -> list[str]:
        """Wait until `names` (or at least `min_workers` workers) are alive; return the names.

        Keeps listening until `settle` s have passed, so every live worker (and every rival
        claimant of a name) has announced itself at least once. With `pin`, pins the names
        returned in the same hold of the lock: a full directory dropping silent names in
        between could otherwise drop one of them first; a name not pinned yet that two live
        peers claim raises GridError naming both if `names` asks for it, and is left out of
        the `min_workers` chosen otherwise. Raises GridError at `timeout`.
        """
        start = time.monotonic()
        with self._cv:
            while True:
                live = self.live()
                now = time.monotonic()
                found = None
                settled = now - start >= settle or now - start > timeout
                if names is not None:
                    if all(n in live for n in names) and settled:
                        found = list(names)
                    elif now - start >= TYPO_AFTER:  # heard from every live worker by now
                        typos = {n: t for n in names if n not in live and (t := typo_of(n, live))}
                        if typos:
                            raise GridError(
                                f"no worker {', '.join(map(repr, typos))} on {where}; did you "
                                f"mean {', '.join(map(repr, typos.values()))}? (live: "
                                f"{', '.join(live)})"
                            )
                elif settled:  # (names two peers claim are left out, not picked)
                    uncontested = [n for n in live if self._claimants(n, now) is None]
                    if len(uncontested) >= min_workers:
                        found = uncontested if pin else live
                if found is not None:
                    if pin:
                        self._contested(found, now)
                        self.pin(found)
                    return found
                if now - start > timeout:
                    wanted = f"workers {', '.join(names)}" if names else f"{min_workers} workers"
                    close = {n: difflib.get_close_matches(n, live, 1, 0.5) for n in names or ()}
                    hint = "".join(
                        f" Did you mean {m[0]!r} for {n!r}?" for n, m in close.items()
                        if m and n not in live
                    )  # fmt: skip
                    contested = [n for n in live if self._claimants(n, now) is not None]
                    if contested and names is None:
                        hint += (
                            f" Left out, each claimed by two peers: {', '.join(contested)} "
                            f"(name the one you mean with trust=)."
                        )
                    raise GridError(
                        f"waited {timeout:g} s for {wanted} on {where}; found {len(live)} "
                        f"({', '.join(live) or 'none'}).{hint} Start workers with `gridgraph "
                        f"worker --ipfs ADDR --name NAME`, on nodes connected to this one (check "
                        f"`ipfs swarm peers`)"
                    )
                self._cv.wait(0.1)


def typo_of(name: str, live: list[str]) -> str | None:
    """The live name `name` looks like a typo of, if any: the same but for case or `-_.`,
    or one letter (not a digit) off, other than the last: left out, added, changed, or two
    swapped; so that `W1`, `wrker1` and `wokrer1` point at `w1` and `worker1`, while
    `worker2`, `w10` or `node-b`, which may still be starting, point at nothing."""

    def plain(n: str) -> str:
        return n.lower().replace("-", "").replace("_", "").replace(".", "")

    for other in live:
        if plain(other) == plain(name) or _one_edit_before_the_end(name, other):
            return other
    return None


def _one_edit_before_the_end(a: str, b: str) -> bool:
    """Whether `a` and `b` differ by one edit of a letter (insertion, deletion, substitution
    or a swap of neighbours) that leaves their last characters alike."""
    if a == b or abs(len(a) - len(b)) > 1 or a[-1:] != b[-1:]:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        swap = len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
        edited = a[diff[0]] + b[diff[0]] if diff else ""
        if len(diff) == 1 or (swap and a[diff[1]] == b[diff[0]]):
            return not any(c.isdigit() for c in edited)
        return False
    short, long = sorted((a, b), key=len)
    return any(
        long[:i] + long[i + 1 :] == short and not long[i].isdigit() for i in range(len(long))
    )


def ask_workers(transport: Transport) -> None:
    """Ask every worker to announce itself now rather than at its next heartbeat."""
    try:
        transport.publish(DISCOVERY_TOPIC, wire.encode({"kind": "discover"}), counted=False)
    except KuboError as e:  # the heartbeats will do
        log.debug("discover: %s", e)


def discover(
    ipfs: str,
    min_workers: int = 1,
    timeout: float = 60.0,
    names: list[str] | None = None,
    procs: list[subprocess.Popen] = (),
) -> list[str]:
    """The live workers heard through `ipfs` (as `connect` would find them), without a client.

    Fails early, naming it, if one of `procs` (workers we started) exits meanwhile.
    """
    transport = GridTransport(ipfs, deliver_own=True)
    try:
        directory = Directory()
        transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
        ask_workers(transport)
        deadline = time.monotonic() + timeout
        while True:
            for proc in procs:
                if proc.poll() is not None:
                    raise GridError(
                        f"worker process {' '.join(proc.args[-6:])} exited with {proc.returncode}"
                    )
            try:
                left = min(1.0, deadline - time.monotonic())
                return directory.wait(min_workers, left, names, settle=HEARTBEAT, where=ipfs)
            except GridError:
                if time.monotonic() >= deadline:
                    raise
    finally:
        transport.close()
