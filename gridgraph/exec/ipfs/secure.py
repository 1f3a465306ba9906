"""End-to-end encryption and authentication of gridgraph messages: all the crypto in one place.

Threat model: any peer of the swarm may subscribe to any topic, fetch any block whose CID it
learns, publish anything on any topic and replay what it saw. Kubo signs each PubSub message
with the publishing node's libp2p key, so its `from` peer ID is authentic, but all can read
it (libp2p encrypts hops, not ends). Here only a message's two endpoints can read or forge it.

State, per endpoint (a `Channel`: a client session, or a worker process): a static X25519 key
pair made for it and never stored; its `identity`, "<peer ID>~<public key>" (the peer ID
vouched for by Kubo's signature, the key by the AEAD: only its owner seals under it); one
message counter, the nonce; per sender (SENDERS_KEPT latest) a derived key and a ReplayWindow.

Policy:
- AES-256-GCM under a key per direction and pair of endpoints, bound to both peer IDs
  (`Channel._key`), with both public keys, the counter and the topic as associated data: a
  message opens only for its receiver, on its topic, as sent by its sender's node;
- in the clear: [VERSION, sender public key, counter, ciphertext] and nothing else; topic names
  travel hashed (`blind_topic`); workers announce their key in their signed heartbeat;
- a large payload's blocks are sealed under a fresh key of its own (`seal_pieces`), which
  travels inside the sealed message that names them;
- a counter seen before, or REPLAY_WINDOW below the sender's highest, is a replay;
- what is read before the key opens it is an array of a few scalars, decoded at a cost its
  size bounds (wire.unpackb);
- every failure to open (wrong key, truncated or tampered ciphertext, a replayed counter,
  garbage) raises `Rejected`, naming what was wrong; callers log it and drop the message.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import threading
from collections import OrderedDict

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gridgraph.exec import wire

VERSION = 2
KEY_BYTES = 32
TAG_BYTES = 16
REPLAY_WINDOW = 1 << 16  # counters this far below a sender's highest are refused as replays
SENDERS_KEPT = 4096  # replay windows (and derived keys) kept, least recently used dropped
IDENTITY_SEPARATOR = "~"
CACHED_NAME_MAX = 512  # characters of a topic name whose hash is kept (an IPFS client's: ~180)


class Rejected(ValueError):
    """A message that does not open: not sealed for us, altered, replayed, or not a message."""


def encode_key(public: bytes) -> str:
    return base64.urlsafe_b64encode(public).rstrip(b"=").decode("ascii")


def decode_key(text: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as e:
        raise Rejected(f"bad public key {text[:16]!r}") from e
    if len(raw) != KEY_BYTES:
        raise Rejected(f"a public key has {KEY_BYTES} bytes, got {len(raw)}")
    return raw


@functools.lru_cache(maxsize=SENDERS_KEPT)  # every message opened names its sender
def make_identity(peer: str, public: bytes) -> str:
    return f"{peer}{IDENTITY_SEPARATOR}{encode_key(public)}"


@functools.lru_cache(maxsize=SENDERS_KEPT)  # every seal and open splits one
def split_identity(identity: str) -> tuple[str, bytes]:
    """(peer ID, X25519 public key) of an identity made by `make_identity`."""
    peer, sep, key = identity.partition(IDENTITY_SEPARATOR)
    if not sep or not peer:
        raise Rejected(f"not an endpoint identity: {identity[:60]!r}")
    return peer, decode_key(key)


def peer_of(identity: str) -> str:
    """The libp2p peer ID part of an identity (the whole string if it has no key part)."""
    return identity.partition(IDENTITY_SEPARATOR)[0]


def blind_topic(topic: str) -> str:
    """The PubSub topic that carries `topic`: a hash, so the name (a client's identity and
    session, say) is not in the clear. Both ends compute it from the name they know.

    Every publish names one, so names of up to CACHED_NAME_MAX characters are hashed once
    and kept. Longer ones are hashed each time: only a hostile client makes a worker use
    one (a session id past its limit, whose refusal goes to its topic), and none is kept."""
    return _hash_topic(topic) if len(topic) > CACHED_NAME_MAX else _cached_topic(topic)


def _hash_topic(topic: str) -> str:
    digest = hashlib.sha256(b"gridgraph topic\x00" + topic.encode()).digest()
    return "gridgraph.t." + base64.b32encode(digest[:20]).decode("ascii").lower()


_cached_topic = functools.lru_cache(maxsize=4096)(_hash_topic)


class ReplayWindow:
    """The counters one sender used lately: each is accepted once, and none far below the
    highest (whose messages could no longer be told apart from replays)."""

    def __init__(self, width: int = REPLAY_WINDOW) -> None:
        self.width = width
        self.highest = 0
        self.seen: set[int] = set()

    def check(self, counter: int) -> None:
        """Raise Rejected if `counter` was seen or is too old; otherwise note it."""
        if counter <= self.highest - self.width:
            raise Rejected(f"counter {counter} is older than the replay window")
        if counter in self.seen:
            raise Rejected(f"counter {counter} was already used: a replay")
        self.seen.add(counter)
        if counter > self.highest:
            self.highest = counter
            if len(self.seen) > 2 * self.width:
                floor = self.highest - self.width
                self.seen = {c for c in self.seen if c > floor}


class Channel:
    """One endpoint's keys: seals messages for other endpoints and opens those sealed for it.

    Example:
        alice, bob = Channel("12D3KooWA..."), Channel("12D3KooWB...")
        sealed = alice.seal(bob.identity, "topic", b"hi")
        sender, body = bob.open("12D3KooWA...", "topic", sealed)   # (alice.identity, b"hi")
    """

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.identity = make_identity(peer, self.public)
        self._counter = itertools.count(1)  # next() is atomic under the GIL
        self._lock = threading.Lock()
        self._keys: OrderedDict[tuple[str, str], AESGCM] = OrderedDict()
        self._windows: OrderedDict[str, ReplayWindow] = OrderedDict()

    def _key(self, sender: str, receiver: str) -> AESGCM:
        """The AEAD for messages from `sender` to `receiver` (one of them is this endpoint):
        HKDF-SHA256 over the two static keys' X25519 shared secret, both public keys, both
        peer IDs and the direction. So the two directions never share a key, and a key is
        bound to the two peer identities Kubo signs for: a message sealed for `P~K` and
        re-published by another peer fails to open. A client session's key pair is its own,
        a worker's its process's: every session has its own pairwise keys."""
        with self._lock:
            aead = self._keys.get((sender, receiver))
            if aead is not None:
                self._keys.move_to_end((sender, receiver))
                return aead
        sender_peer, sender_key = split_identity(sender)
        receiver_peer, receiver_key = split_identity(receiver)
        other = receiver_key if sender == self.identity else sender_key
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(other))
        except ValueError as e:  # e.g. a low-order point, whose shared secret is all zeros
            raise Rejected(f"unusable public key: {e}") from e
        info = b"\x00".join(
            [b"gridgraph v2 direction key", sender_key, receiver_key,
             sender_peer.encode(), receiver_peer.encode()]
        )  # fmt: skip
        hkdf = HKDF(hashes.SHA256(), KEY_BYTES, salt=b"gridgraph", info=info)
        aead = AESGCM(hkdf.derive(shared))
        with self._lock:
            self._keys[(sender, receiver)] = aead
            while len(self._keys) > SENDERS_KEPT:
                self._keys.popitem(last=False)
        return aead

    def seal(self, receiver: str, topic: str, body: bytes) -> bytes:
        """`body` encrypted and authenticated for endpoint `receiver` on PubSub `topic`:
        msgpack [VERSION, our public key, counter, AES-256-GCM ciphertext], the counter as
        nonce, and the version, both public keys, the counter and the topic as associated
        data, so it cannot be moved to another topic or receiver (bench/bench_crypto.py
        measures its speed)."""
        _, receiver_key = split_identity(receiver)
        counter = next(self._counter)
        aad = _associated(self.public, receiver_key, counter, topic)
        ciphertext = self._key(self.identity, receiver).encrypt(_nonce(counter), body, aad)
        return msgpack.packb([VERSION, self.public, counter, ciphertext])

    def open(self, peer: str, topic: str, message: bytes) -> tuple[str, bytes]:
        """(sender identity, body) of a message that `peer` published on `topic`.

        Raises Rejected if it was not sealed for this endpoint by a key of `peer`, was
        altered or truncated, or is a replay."""
        try:  # (an array of 4 scalars: nothing else is built, whatever the message holds)
            version, public, counter, ciphertext = wire.unpackb(
                message, max_containers=1, max_array_len=4, max_map_len=0
            )
        except (wire.WireError, TypeError, ValueError) as e:  # or not 4 items
            raise Rejected(f"not a sealed message: {e}") from e
        if version != VERSION or type(counter) is not int or not 0 < counter < 2**64:
            raise Rejected(f"not a version {VERSION} sealed message")
        if not isinstance(public, bytes) or len(public) != KEY_BYTES:
            raise Rejected("sealed message without a sender key")
        if not isinstance(ciphertext, bytes) or len(ciphertext) < TAG_BYTES:
            raise Rejected("truncated ciphertext")
        sender = make_identity(peer, public)
        aad = _associated(public, self.public, counter, topic)
        try:
            body = self._key(sender, self.identity).decrypt(_nonce(counter), ciphertext, aad)
        except InvalidTag:
            raise Rejected(
                "authentication failed (sealed for another key, by another peer, or altered)"
            ) from None
        with self._lock:
            window = self._windows.get(sender)
            if window is None:
                window = self._windows[sender] = ReplayWindow()
                while len(self._windows) > SENDERS_KEPT:
                    self._windows.popitem(last=False)
            self._windows.move_to_end(sender)
            window.check(counter)
        return sender, body

    def announcement(self, body: bytes) -> bytes:
        """`body` in the clear, with this endpoint's public key (for the discovery topic,
        where Kubo's signature binds the key to the publishing peer)."""
        return msgpack.packb([VERSION, self.public, body])


def open_announcement(peer: str, message: bytes) -> tuple[str, bytes]:
    """(sender identity, body) of a message made by `Channel.announcement`."""
    try:
        version, public, body = wire.unpackb(
            message, max_containers=1, max_array_len=3, max_map_len=0
        )
    except (wire.WireError, TypeError, ValueError) as e:
        raise Rejected(f"not an announcement: {e}") from e
    if version != VERSION or not isinstance(body, bytes):
        raise Rejected(f"not a version {VERSION} announcement")
    if not isinstance(public, bytes) or len(public) != KEY_BYTES:
        raise Rejected("announcement without a public key")
    return make_identity(peer, public), body


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "big")


def _associated(sender_key: bytes, receiver_key: bytes, counter: int, topic: str) -> bytes:
    return b"\x00".join([b"gridgraph v2", sender_key, receiver_key, b"%d" % counter,
                         topic.encode()])  # fmt: skip


# --- payload blocks --------------------------------------------------------------------------


def new_blob_key() -> bytes:
    """A fresh key for one large payload's blocks (never used for anything else)."""
    return AESGCM.generate_key(bit_length=256)


def seal_pieces(key: bytes, payload: bytes | bytearray, size: int) -> list[bytes]:
    """`payload` cut into pieces of `size` bytes, each encrypted under the payload's own key
    with its index as nonce (so a piece cannot be moved to another place)."""
    aead, view = AESGCM(key), memoryview(payload)
    starts = range(0, len(view), size)
    return [aead.encrypt(_nonce(i), view[s : s + size], None) for i, s in enumerate(starts)]


def open_pieces(key: bytes, pieces: list[bytes]) -> bytearray:
    """The payload `seal_pieces` cut; raises Rejected if a piece was altered, truncated or
    misplaced. Decrypts in place into one buffer (a bytearray: wire.decode takes it as is)."""
    if any(len(piece) < TAG_BYTES for piece in pieces):
        raise Rejected("a block is truncated")
    aead = AESGCM(key)
    out = bytearray(sum(len(piece) - TAG_BYTES for piece in pieces))
    view, start = memoryview(out), 0
    for i, piece in enumerate(pieces):
        end = start + len(piece) - TAG_BYTES
        try:
            aead.decrypt_into(_nonce(i), piece, None, view[start:end])
        except InvalidTag:
            raise Rejected(f"block {i} failed authentication") from None
        start = end
    return out
