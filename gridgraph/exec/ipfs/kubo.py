"""A small client for the Kubo (go-ipfs) RPC API: only the calls gridgraph needs.

State: one kept HTTP/1.1 connection per calling thread (`_Connection`); each `Subscription`
holds a streaming connection of its own.

Policy:
- A unary call is a plain HTTP/1.1 POST on the thread's kept connection (`_Connection` says
  why not ipfshttpclient's). One on a kept connection the daemon had closed is retried once
  on a new one (the calls used here are idempotent, and receivers drop a repeated message).
- Binary RPC arguments (pubsub topics) are multibase base64url ('u' prefix, no padding), as
  Kubo requires; binary bodies (pubsub data, blocks) go as a multipart file.
- Blocks are capped at MAX_BLOCK_SIZE (1 MiB) here, so every Kubo release (older ones stop at
  1 MiB, newer at 2 MiB) accepts them and bitswap moves them.
- A publish refused with "validation ignored" (two publishes through one node at once, from
  any threads or processes) never went out, and is sent again (`pubsub_pub`).
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
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ipfshttpclient.http_common import multiaddr_to_url_data

from gridgraph.exec.transport import NotSent

MAX_BLOCK_SIZE = 1 << 20
PUBLISH_TRIES = 16  # a publish Kubo refused as "validation ignored" is sent again (pubsub_pub)
API_BASE = "api/v0"
MAX_RECORD_OVERHEAD = 4096  # bytes of a pubsub/sub line besides its data (sender, seqno, topics)


class KuboError(RuntimeError):
    """A Kubo RPC call failed (daemon down, bad argument, timeout...)."""


class PublishRefused(KuboError, NotSent):
    """A publish Kubo refused as "validation ignored" every time it was tried: as lost."""


def mb_encode(data: bytes) -> str:
    """Multibase base64url, the only encoding Kubo accepts for binary URL arguments."""
    return "u" + base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def mb_decode(text: str) -> bytes:
    """Decode a multibase base64url string as Kubo emits it (`u` prefix, no padding)."""
    if not text.startswith("u"):
        raise ValueError(f"expected multibase base64url ('u' prefix), got {text[:16]!r}")
    body = text[1:]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


def api_multiaddr(addr: str) -> str:
    """The RPC API's multiaddr, from a multiaddr or an `http://host:port` URL (what Kubo's
    own docs and `ipfs config Addresses.API` readers often have at hand).

    >>> api_multiaddr("http://127.0.0.1:5001")
    '/ip4/127.0.0.1/tcp/5001'
    """
    if not isinstance(addr, str):
        raise ValueError(f"a Kubo RPC address is a string, got {type(addr).__name__}")
    if addr.startswith("/"):
        return addr
    url = urllib.parse.urlsplit(addr if "://" in addr else f"http://{addr}")
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "http" or not url.hostname or port is None or url.path not in ("", "/"):
        raise ValueError(
            f"{addr!r} is not a Kubo RPC address: give its multiaddr, as "
            "`/ip4/127.0.0.1/tcp/5001`, or an http://HOST:PORT URL"
        )
    host = url.hostname
    kind = "ip6" if ":" in host else "ip4" if host.replace(".", "").isdigit() else "dns"
    return f"/{kind}/{host}/tcp/{port}"


def _rpc_endpoint(addr: str) -> tuple[str, int, str]:
    """(host, port, path prefix such as "/api/v0") of the RPC API at multiaddr `addr`."""
    try:
        url, _, _, _ = multiaddr_to_url_data(addr, API_BASE)
    except Exception as error:  # ipfshttpclient's AddressError, a bare multiaddr.Error
        raise ValueError(
            f"{addr!r} is not a Kubo RPC address ({error}): give its multiaddr, as "
            "`/ip4/127.0.0.1/tcp/5001`, or an http://HOST:PORT URL"
        ) from None
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

    def __init__(
        self, addr: str, topic: str, connect_timeout: float, max_data: int | None = None
    ) -> None:
        host, port, base = _rpc_endpoint(addr)
        query = urllib.parse.urlencode({"arg": mb_encode(topic.encode())})
        self.topic = topic
        # A line longer than a message of `max_data` bytes can make is skipped unread: on
        # the discovery topic, open to every peer, a flood of 0.9 MB messages is not parsed.
        self.max_line = None if max_data is None else 4 * max_data // 3 + MAX_RECORD_OVERHEAD
        self.skipped = 0  # lines skipped for their size
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
            if self.max_line is not None and len(line) > self.max_line:
                self.skipped += 1
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
        self.addr = addr = api_multiaddr(addr)
        self.timeout = timeout
        self._host, self._port, self._base = _rpc_endpoint(addr)
        host = f"[{self._host}]" if ":" in self._host else self._host  # an IPv6 address
        self._authority = f"{host}:{self._port}"
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
        head = f"POST {self._base}{path}?{query} HTTP/1.1\r\nHost: {self._authority}\r\n"
        body = b""
        if data is not None:
            boundary = os.urandom(16).hex()
            head += f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            body = b"".join([
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                'filename="data"\r\nContent-Type: application/octet-stream\r\n\r\n'.encode(),
                data,
                f"\r\n--{boundary}--\r\n".encode(),
            ])  # fmt: skip
        head_bytes = f"{head}Content-Length: {len(body)}\r\n\r\n".encode()
        seconds = timeout if timeout is not None else self.timeout
        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            try:
                if conn is None:
                    conn = self._local.conn = _Connection(self._host, self._port, seconds)
                status, content, keep = conn.exchange(head_bytes, body, seconds)
                break
            except (OSError, _BadReply) as error:
                if conn is not None:
                    conn.close()
                self._local.conn = None
                if attempt == 0 and reused and isinstance(error, ConnectionError):
                    continue  # the daemon closed the kept connection meanwhile
                raise KuboError(f"{path} on {self.addr}: {error}") from error
        if not keep:
            conn.close()
            self._local.conn = None
        if status != 200:
            raise KuboError(f"{path} on {self.addr}: HTTP {status} {_message(content)}")
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
        """Publish `data` (any bytes, under ~1 MiB with framing) to `topic`.

        One refused with "validation ignored" (Kubo was still validating another publish
        through this node, from any thread or process) never went out: it is sent again,
        PUBLISH_TRIES times at most, after a wait that doubles up to 64 ms, drawn at random
        around that so that publishers refused together do not try again together."""
        for attempt in range(PUBLISH_TRIES):
            try:
                self._call("/pubsub/pub", [mb_encode(topic.encode())], data=data, decoder="none")
                return
            except KuboError as e:
                if "validation ignored" not in str(e):
                    raise
                if attempt == PUBLISH_TRIES - 1:  # (the caller's resend sends it again)
                    raise PublishRefused(str(e)) from e
                time.sleep(0.001 * 2 ** min(attempt, 6) * random.uniform(0.5, 1.5))

    def pubsub_sub(self, topic: str, max_data: int | None = None) -> Subscription:
        """Open a subscription stream; the topic is subscribed once this returns. Messages
        whose data is over `max_data` bytes (when given) are skipped unparsed."""
        return Subscription(self.addr, topic, connect_timeout=self.timeout, max_data=max_data)

    def pubsub_peers(self, topic: str, timeout: float | None = None) -> list[str]:
        """Peer ids connected to us that are subscribed to `topic`."""
        reply = self._call("/pubsub/peers", [mb_encode(topic.encode())], timeout=timeout)
        return reply[0].get("Strings") or []

    def pubsub_ls(self, timeout: float | None = None) -> list[str]:
        """The topics this node is subscribed to (for any of its clients)."""
        encoded = self._call("/pubsub/ls", timeout=timeout)[0].get("Strings") or []
        return [mb_decode(t).decode(errors="replace") for t in encoded]

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


class _BadReply(ValueError):
    """The daemon's reply is not the HTTP/1.1 this client reads."""


LINE_MAX = 1 << 16  # a status, header or chunk-size line longer than this is not Kubo's


class _Connection:
    """One kept HTTP/1.1 connection to the RPC API: a thread's own. A request goes out in one
    send, and its reply is read from a buffer. Not ipfshttpclient's `Client`: it refuses
    daemons newer than 0.8, and its pubsub helpers send raw topics and data as a URL argument,
    which current Kubo rejects. Nor its `ClientSync`, which opens a new requests session and
    connection per call, nor `http.client`, which parses every reply's headers through the
    email package: both cost more per publish."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = self.sock.makefile("rb")

    def exchange(self, head: bytes, body: bytes, timeout: float) -> tuple[int, bytes, bool]:
        """Send one request (its head, then its body); (status, reply body, whether the connection
        stays open). Raises ConnectionError if the daemon had closed it, OSError on a
        time-out or a broken socket, _BadReply on a reply that is not HTTP/1.1."""
        self.sock.settimeout(timeout)
        if len(body) < 1 << 16:
            self.sock.sendall(head + body)
        else:  # a block: not copied once more
            self.sock.sendall(head)
            self.sock.sendall(body)
        status_line = self._reader.readline(LINE_MAX)
        if not status_line:
            raise ConnectionResetError("the daemon closed the connection")
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise _BadReply(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        headers = self._headers()
        keep = version == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            content = self._chunked()
        elif b"content-length" in headers:
            length = headers[b"content-length"]
            if not length.isdigit():
                raise _BadReply(f"bad Content-Length {length[:40]!r}")
            content = self._exactly(int(length))
        else:  # the body ends where the connection does
            content, keep = self._reader.read(), False
        return int(code), content, keep

    def _line(self) -> bytes:
        line = self._reader.readline(LINE_MAX)
        if not line.endswith(b"\n"):
            raise _BadReply("the reply ended, or a line of it is too long")
        return line

    def _headers(self) -> dict[bytes, bytes]:
        headers = {}
        while (line := self._line()) not in (b"\r\n", b"\n"):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return headers

    def _exactly(self, n: int) -> bytes:
        data = self._reader.read(n)
        if len(data) != n:
            raise _BadReply(f"the reply ended after {len(data)} of {n} bytes")
        return data

    def _chunked(self) -> bytes:
        chunks = []
        while True:
            size = self._line().split(b";", 1)[0].strip()
            try:
                n = int(size, 16)
            except ValueError:
                raise _BadReply(f"bad chunk size {size[:40]!r}") from None
            if n == 0:
                self._headers()  # trailers, if any, and the blank line that ends the reply
                return b"".join(chunks)
            chunks.append(self._exactly(n))
            if self._line() not in (b"\r\n", b"\n"):
                raise _BadReply("a chunk does not end where its size says")

    def close(self) -> None:
        self._reader.close()
        self.sock.close()


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
