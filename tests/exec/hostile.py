"""A hostile peer and its hand-made messages, for the adversarial suite and the fuzzer.

`Peer` is a client that owns an endpoint of its own on any transport (a LocalBus endpoint,
or a Kubo node) and sends whatever it likes: any request, any request id, any session, or
raw bytes. `frame` lays a header and a data region out exactly as `wire.encode` does but
packs the header as given, so a test can put in it what the encoder never would (two tensors
over the same bytes, a wrong byte count, an unknown extension); `tensor_ref` is the header's
pointer to a tensor in the data region. `call` and `run` build program steps and requests.
"""

from __future__ import annotations

import queue
import time
import uuid
from typing import Any

import msgpack

from gridgraph.exec import wire
from gridgraph.exec.protocol import client_topic, worker_topic
from gridgraph.exec.transport import Transport

ALIGN = 64


def tensor_ref(dtype: str, shape: list[int], offset: int, nbytes: int) -> msgpack.ExtType:
    """A tensor in a header: `[dtype, shape, offset, nbytes]` into the data region."""
    return msgpack.ExtType(3, msgpack.packb([dtype, shape, offset, nbytes]))


def frame(header: Any, data: bytes = b"", *, default=None) -> bytearray:
    """A message with this header (packed as is) and this data region."""
    packed = msgpack.packb(header, use_bin_type=True, default=default)
    pad = bytes(-(4 + len(packed)) % ALIGN)
    return bytearray(len(packed).to_bytes(4, "little") + packed + pad + data)


def call(op: str, args: list, outs: list[int], kwargs: dict | None = None,
         writes: list | None = None, report: bool = False) -> list:  # fmt: skip
    """A call step: `[call, op, args, kwargs, outs, writes, report]`."""
    return ["call", op, args, kwargs or {}, outs, writes or [], report]


def run(steps: list, slots: list[int], *, plan: int = 1, run_id: int = 1,
        params: list | None = None, program: bool = True,
        peers: dict | None = None) -> dict:  # fmt: skip
    """A run request of one stage of `steps` over value ids `slots`; `peers`: the identity
    of each worker its `send` and `recv` steps name."""
    msg = {"kind": "run", "run": run_id, "plan": plan, "slots": slots, "params": params or []}
    if program:
        msg["program"] = [steps]
    if peers is not None:
        msg["peers"] = peers
    return msg


class Peer:
    """A hand-made client with an endpoint of its own: any request, id, session or bytes."""

    def __init__(self, transport: Transport, session: str = "s", resend: float = 0.0) -> None:
        self.transport = transport
        self.session = session
        # ipfs: PubSub drops messages now and then; resend the same request id this often
        self.resend = resend
        self.replies: queue.Queue[dict] = queue.Queue()
        self.contacted: set[str] = set()  # workers it may hold a session on
        self.closed = False
        self._heard: set[str] = set()  # reply topics subscribed
        self.topic = self.reply_topic(session)

    def reply_topic(self, session: Any) -> str:
        """The reply topic of `session` (workers reply only there), subscribed."""
        topic = client_topic(self.transport.identity, session)
        if topic not in self._heard:
            self._heard.add(topic)
            self.transport.subscribe(topic, self._on_reply)
        return topic

    def _on_reply(self, sender: str, payload: bytes) -> None:
        try:
            self.replies.put(wire.decode(payload))
        except wire.WireError:
            pass

    def message(self, msg: dict, rid: str | None = None) -> bytearray:
        """`msg` as this peer sends it: with an id and its session (whose reply topic it
        subscribes)."""
        session = msg.get("session", self.session)
        self.reply_topic(session)
        return wire.encode({"id": rid or uuid.uuid4().hex, "session": session, **msg})

    def identities(self, *workers: str) -> dict[str, str | None]:
        """Each worker's identity as this peer's transport knows it: what a client names in
        a run's `peers`."""
        return {w: self.transport.recipient(worker_topic(w)) for w in workers}

    def send(self, worker: str, msg: dict, rid: str | None = None) -> str:
        rid = rid or uuid.uuid4().hex
        self.publish(worker, self.message(msg, rid))
        return rid

    def publish(self, worker: str, payload: bytes) -> None:
        self.contacted.add(worker)
        self.transport.publish(worker_topic(worker), payload)

    def reply(self, rid: str, timeout: float = 20.0, worker: str | None = None,
              payload: bytes | None = None) -> dict:  # fmt: skip
        """The reply to `rid`; replies to other requests are dropped. With `worker` and
        `payload`, the request is resent every `self.resend` seconds until it comes."""
        deadline = time.monotonic() + timeout
        next_send = time.monotonic() + (self.resend or timeout)
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no reply to request {rid} within {timeout} s")
            if payload is not None and self.resend and now >= next_send:
                self.publish(worker, payload)
                next_send = now + self.resend
            try:
                msg = self.replies.get(timeout=max(0.01, min(deadline, next_send) - now))
            except queue.Empty:
                continue
            if msg.get("re") == rid:
                return msg

    def request(self, worker: str, msg: dict, rid: str | None = None,
                timeout: float = 20.0) -> dict:  # fmt: skip
        """Send `msg` and wait for its reply (resending the same id on a lossy transport)."""
        rid = rid or uuid.uuid4().hex
        payload = self.message(msg, rid)
        self.publish(worker, payload)
        return self.reply(rid, timeout, worker, payload)

    def no_reply_within(self, seconds: float) -> bool:
        """Whether no reply at all comes within `seconds`."""
        try:
            self.replies.get(timeout=seconds)
        except queue.Empty:
            return True
        return False

    def drain(self) -> None:
        while not self.replies.empty():
            self.replies.get_nowait()

    def close(self) -> None:
        """Say bye to every worker it wrote to (workers cap sessions per peer), then stop."""
        if self.closed:
            return
        self.closed = True
        for worker in sorted(self.contacted):
            try:
                self.request(worker, {"kind": "bye"}, timeout=5)
            except TimeoutError:
                pass
        self.transport.close()
