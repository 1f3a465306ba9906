"""A small client for the Kubo (go-ipfs) RPC API: only the calls gridgraph needs.

Policy:
- Unary calls are plain HTTP POSTs on a keep-alive `http.client` connection, one per calling
  thread, with bodies multipart-encoded by ipfshttpclient (`ipfshttpclient.multipart`).
  Not ipfshttpclient's `Client`: `ipfshttpclient.connect()` refuses daemons newer than 0.8,
  and its pubsub helpers send raw topics and data as a URL argument, which current Kubo
  rejects. Nor its `ClientSync`: it opens a new requests session and connection per call
  (~2 ms a publish here, against ~0.7 ms on a kept connection; bench/bench_ipfs.py).
  A call on a kept connection that the daemon had closed meanwhile is retried once on a new
  one (Kubo's calls used here are idempotent, and receivers drop a repeated message).
- Binary RPC arguments (pubsub topics) are multibase base64url ('u' prefix, no padding), as
  Kubo requires; binary bodies (pubsub data, blocks) go as a multipart file.
- Blocks are capped at `MAX_BLOCK_SIZE` (1 MiB) on our side, so every Kubo release (older
  ones stop at 1 MiB, newer at 2 MiB) accepts them and bitswap moves them.
- Every failure is raised as `KuboError`, naming the call and the node.

Example:
    kubo = Kubo("/ip4/127.0.0.1/tcp/5001")
    cid = kubo.block_put(b"hello")
    assert kubo.block_get(cid) == b"hello"
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ipfshttpclient import multipart
from ipfshttpclient.http_common import multiaddr_to_url_data

MAX_BLOCK_SIZE = 1 << 20
API_BASE = "api/v0"


class KuboError(RuntimeError):
    """A Kubo RPC call failed (daemon down, bad argument, timeout...)."""


def mb_encode(data: bytes) -> str:
    """Multibase base64url, the only encoding Kubo accepts for binary URL arguments."""
    return "u" + base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def mb_decode(text: str) -> bytes:
    """Decode a multibase base64url string as Kubo emits it (`u` prefix, no padding)."""
    if not text.startswith("u"):
        raise ValueError(f"expected multibase base64url ('u' prefix), got {text[:16]!r}")
    body = text[1:]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


def _rpc_endpoint(addr: str) -> tuple[str, int, str]:
    """(host, port, path prefix such as "/api/v0") of the RPC API at multiaddr `addr`."""
    url, _, _, _ = multiaddr_to_url_data(addr, API_BASE)
    parts = urllib.parse.urlsplit(url)
    return parts.hostname, parts.port, parts.path.rstrip("/")


@dataclass(frozen=True)
class PubsubMessage:
    """One message read from a pubsub subscription."""

    sender: str  # libp2p peer id of the publisher (signed, so trustworthy)
    data: bytes
    seqno: bytes


class Subscription:
    """A live `pubsub/sub` stream: iterate it for messages, `close()` it from any thread.

    ipfshttpclient's streaming iterator cannot do this: closing it from another thread while
    its reader is blocked raises "generator already executing", and closing a socket does not
    wake a thread blocked in recv() anyway. So the stream is a plain `http.client` request to
    the URL ipfshttpclient computes, and `close()` shuts the socket down, which does wake it.
    """

    def __init__(self, addr: str, topic: str, connect_timeout: float) -> None:
        host, port, base = _rpc_endpoint(addr)
        query = urllib.parse.urlencode({"arg": mb_encode(topic.encode())})
        self.topic = topic
        self._closed = threading.Event()
        self._conn = http.client.HTTPConnection(host, port, timeout=connect_timeout)
        try:
            self._conn.connect()
            # The stream stays idle between messages: no read timeout.
            self._conn.sock.settimeout(None)
            self._conn.request("POST", f"{base}/pubsub/sub?{query}")
            self._response = self._conn.getresponse()
        except OSError as error:
            self._conn.close()
            raise KuboError(f"pubsub/sub {topic!r} on {addr}: {error}") from error
        if self._response.status != 200:
            body = self._response.read().decode(errors="replace")
            self._conn.close()
            raise KuboError(f"pubsub/sub {topic!r} on {addr}: HTTP {self._response.status} {body}")

    def __iter__(self) -> Iterator[PubsubMessage]:
        """Yield messages until the stream ends or `close()` is called.

        Raises KuboError if the stream breaks while not closed.
        """
        while not self._closed.is_set():
            try:
                line = self._response.readline()
            except Exception as error:
                # close() from another thread tears the response down under us: any error then
                # (http.client is not thread-safe) just means "closed".
                if self._closed.is_set():
                    return
                if isinstance(error, OSError | http.client.HTTPException):
                    raise KuboError(f"pubsub/sub {self.topic!r} stream broke: {error}") from error
                raise
            if not line:
                if self._closed.is_set():
                    return
                raise KuboError(f"pubsub/sub {self.topic!r} stream ended (daemon stopped?)")
            if not line.strip():
                continue
            record = json.loads(line)
            yield PubsubMessage(
                sender=record.get("from", ""),
                data=mb_decode(record["data"]) if record.get("data") else b"",
                seqno=mb_decode(record["seqno"]) if record.get("seqno") else b"",
            )

    def close(self) -> None:
        """End the stream; a thread blocked iterating it returns promptly."""
        self._closed.set()
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already disconnected
        self._conn.close()


class Kubo:
    """RPC client for one Kubo node, addressed by its API multiaddr."""

    def __init__(self, addr: str, timeout: float = 60.0) -> None:
        self.addr = addr
        self.timeout = timeout
        self._host, self._port, self._base = _rpc_endpoint(addr)
        self._local = threading.local()  # this thread's kept connection

    def _call(
        self,
        path: str,
        args: Sequence[str] = (),
        *,
        data: bytes | None = None,
        opts: dict[str, str] | None = None,
        decoder: str = "json",
        timeout: float | None = None,
    ) -> Any:
        """POST one RPC call; its JSON objects (decoder "json") or raw body ("none")."""
        query = urllib.parse.urlencode([("arg", a) for a in args] + list((opts or {}).items()))
        url = f"{self._base}{path}?{query}"
        body, headers = None, {}
        if data is not None:
            chunks, headers = multipart.stream_bytes(data)
            body = b"".join(chunks)
        seconds = timeout if timeout is not None else self.timeout
        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(self._host, self._port)
            try:
                conn.timeout = seconds
                if conn.sock is not None:
                    conn.sock.settimeout(seconds)
                conn.request("POST", url, body=body, headers=headers)
                response = conn.getresponse()
                content = response.read()
                break
            except (OSError, http.client.HTTPException) as error:
                conn.close()
                self._local.conn = None
                stale = isinstance(error, (ConnectionError, http.client.RemoteDisconnected))
                if attempt == 0 and reused and stale:
                    continue  # the daemon closed the kept connection meanwhile
                raise KuboError(f"{path} on {self.addr}: {error}") from error
        if response.status != 200:
            raise KuboError(f"{path} on {self.addr}: HTTP {response.status} {_message(content)}")
        if decoder == "none":
            return content
        try:
            return _json_objects(content.decode())
        except (UnicodeDecodeError, ValueError) as error:
            raise KuboError(f"{path} on {self.addr}: bad JSON reply: {error}") from error

    def id(self) -> str:
        """This node's libp2p peer id, e.g. '12D3KooW...'."""
        return self._call("/id")[0]["ID"]

    def version(self) -> str:
        """The daemon's version string, e.g. '0.43.1'."""
        return self._call("/version")[0]["Version"]

    def swarm_connect(self, multiaddr: str) -> None:
        """Dial a peer, e.g. '/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...'."""
        self._call("/swarm/connect", [multiaddr])

    def swarm_peers(self) -> list[str]:
        """Peer ids this node is connected to."""
        peers = self._call("/swarm/peers")[0].get("Peers") or []
        return [peer["Peer"] for peer in peers]

    def pubsub_pub(self, topic: str, data: bytes) -> None:
        """Publish `data` (any bytes, under ~1 MiB with framing) to `topic`."""
        self._call("/pubsub/pub", [mb_encode(topic.encode())], data=data, decoder="none")

    def pubsub_sub(self, topic: str) -> Subscription:
        """Open a subscription stream; the topic is subscribed once this returns."""
        return Subscription(self.addr, topic, connect_timeout=self.timeout)

    def pubsub_peers(self, topic: str) -> list[str]:
        """Peer ids connected to us that are subscribed to `topic`."""
        return self._call("/pubsub/peers", [mb_encode(topic.encode())])[0].get("Strings") or []

    def block_put(self, data: bytes) -> str:
        """Store one raw block (at most MAX_BLOCK_SIZE bytes) and return its CID."""
        if len(data) > MAX_BLOCK_SIZE:
            raise ValueError(
                f"block of {len(data)} bytes exceeds gridgraph's {MAX_BLOCK_SIZE}-byte limit; "
                "split it first"
            )
        result = self._call("/block/put", data=data, opts={"cid-codec": "raw"})
        return result[0]["Key"]

    def block_get(self, cid: str, timeout: float | None = None) -> bytes:
        """Fetch a block by CID, from this node or (via bitswap) from connected peers.

        With `timeout`, the node itself gives up after that long (not only this client), so a
        block no peer has does not keep bitswap searching."""
        if timeout is None:
            return self._call("/block/get", [cid], decoder="none")
        opts = {"timeout": f"{timeout:g}s"}
        return self._call("/block/get", [cid], decoder="none", opts=opts, timeout=timeout + 5)

    def block_rm(self, cids: Sequence[str]) -> None:
        """Remove these blocks from this node's repo; blocks it does not hold are skipped."""
        if cids:
            self._call("/block/rm", list(cids), opts={"force": "true"})

    def refs_local(self) -> list[str]:
        """The CIDs of every block in this node's repo."""
        return [ref["Ref"] for ref in self._call("/refs/local") if ref.get("Ref")]


def _json_objects(text: str) -> list[Any]:
    """The JSON values in a reply body: one, or a stream of them (`block/rm`, `refs/local`)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return objects
        value, at = decoder.raw_decode(text, at)
        objects.append(value)


def _message(content: bytes) -> str:
    """The error message of a failed call's body (Kubo sends {"Message": ..., ...})."""
    try:
        return str(json.loads(content)["Message"])
    except (ValueError, KeyError, TypeError):
        return content[:200].decode(errors="replace")
