"""The fuzzer: generated messages to a live worker that also serves a well-behaved client.

Hypothesis drives the generator (one random stream per batch of messages), which makes three
kinds of message: valid requests (a run naming the identity of each worker it sends to or
receives from) with fields mutated (any field replaced by an arbitrary value, dropped, or
joined by junk), valid messages with their bytes mutated (flipped, cut,
extended), random bytes, and headers shaped to cost decoding time (wide, deep, many empty
containers, also inside extensions). They are sent to a live worker: at least
10,000 on the local bus, 1,000 over Kubo. Every so often the victim checks its tensor and
computes (exact, against plain torch) and a fresh peer pings the worker: a crash or a hang
fails the test. The counts are printed (`pytest -s`).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gridgraph.exec import wire
from gridgraph.schedule.program import Param, Slot
from tests.exec.hostile import call, run
from tests.exec.worker.arena import Arena, local_arena

LOCAL_MESSAGES = 10_000
IPFS_MESSAGES = 1_000
CHECK_EVERY = 500  # messages between the victim's checks (IPFS: a tenth of it)

# Ops the fuzzer names: listed ones (so programs run), refused ones, and garbage.
OPS = ["aten::add.Tensor", "aten::add_.Tensor", "aten::mul.Tensor", "aten::neg", "aten::sum",
       "aten::expand", "aten::view", "aten::clone", "aten::cat", "aten::index_select",
       "aten::randn_like", "aten::new_empty", "aten::as_strided", "aten::select.int",
       "aten::_reshape_alias", "aten::set_.source_Tensor", "aten::resize_", "aten::manual_seed",
       "aten::nonzero", "aten::equal", "aten::", "os.system", ""]  # fmt: skip
KINDS = ["put", "run", "free", "stats", "seed", "bye", "ping", "transfer", "resend", "abort"]
SESSIONS = ["f0", "f1", "f2"]  # a few, so the fuzzer also hits live sessions


# Generating each message with Hypothesis's strategies costs ~30 ms; a Hypothesis-drawn
# random stream per batch of BATCH messages costs ~50 us a message, so 10,000 fit in CI.
BATCH = 25


def small_int(rng: random.Random) -> int:
    return rng.randint(-3, 40)


def an_int(rng: random.Random) -> int:
    if rng.random() < 0.8:
        return small_int(rng)
    return rng.choice([-(2**63), -1, 2**31, 2**32 + 1, 2**63 - 1, 2**64 - 1])


def a_text(rng: random.Random) -> str:
    return "".join(rng.choice("ab\x00\u00e9\U0001f600/. w") for _ in range(rng.randint(0, 8)))


def a_tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(list(wire.DTYPES.values()))
    shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
    return torch.randint(0, 2 if dtype == torch.bool else 100, shape).to(dtype)


SPECIALS = [
    None,
    True,
    False,
    0.5,
    math.nan,
    math.inf,
    -0.0,
    b"\x00\xff",
    torch.float32,
    torch.int64,
    torch.bool,
    torch.device("cpu"),
    torch.contiguous_format,
    1 + 2j,
]


def a_value(rng: random.Random, depth: int = 0) -> Any:
    """Any value the wire can carry, nested a little."""
    pick = rng.random()
    if pick < 0.25:
        return an_int(rng)
    if pick < 0.35:
        return a_text(rng)
    if pick < 0.5:
        return rng.choice(SPECIALS)
    if pick < 0.6:
        return Slot(rng.randint(0, 12))
    if pick < 0.65:
        return Param(rng.randint(0, 4))
    if pick < 0.75:
        return a_tensor(rng)
    if depth >= 3:
        return None
    if pick < 0.9:
        return [a_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {a_text(rng): a_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def an_arg(rng: random.Random) -> Any:
    pick = rng.random()
    if pick < 0.5:
        return Slot(rng.randint(0, 5))
    if pick < 0.7:
        return small_int(rng)
    if pick < 0.8:
        return rng.uniform(-4, 4)
    if pick < 0.9:
        return [small_int(rng) for _ in range(rng.randint(0, 3))]
    return a_tensor(rng)


def a_step(rng: random.Random) -> list:
    kind = rng.choice(["call", "call", "call", "send", "recv", "free", "return"])
    slot = rng.randint(0, 5)
    if kind == "call":
        outs = [rng.randint(0, 5) for _ in range(rng.randint(1, 2))]
        writes = rng.choice([[], [[0, outs[-1]]], [[1, outs[-1]]]])
        op_args = [an_arg(rng) for _ in range(rng.randint(0, 4))]
        return call(rng.choice(OPS), op_args, outs, {}, writes, rng.random() < 0.3)
    if kind in ("send", "recv"):
        slots = [slot] + [rng.randint(0, 5) for _ in range(rng.randint(0, 2))]
        return [kind, slots, rng.choice(["w0", "w1", "nobody"])]
    return [kind, slot]


def a_request(rng: random.Random) -> dict:
    """A well-formed message of any kind, before mutation."""
    kind = rng.choice(KINDS)
    body: dict[str, Any] = {}
    if kind == "put":
        body = {"values": [[rng.randint(0, 8), a_tensor(rng)] for _ in range(rng.randint(0, 3))]}
    elif kind == "run":
        program = [a_step(rng) for _ in range(rng.randint(1, 5))]
        params = [[rng.randint(0, 4), a_value(rng)] for _ in range(rng.randint(0, 2))]
        # The identity of each worker it names: the name itself, as on the local bus.
        peers = {step[2]: step[2] for step in program if step[0] in ("send", "recv")}
        body = run(program, [rng.randint(0, 8) for _ in range(6)], plan=rng.randint(0, 6),
                   run_id=rng.randint(0, 6), params=params, program=rng.random() < 0.7,
                   peers=peers)  # fmt: skip
    elif kind == "seed":
        body = {"seed": an_int(rng)}
    elif kind == "stats":
        body = {"reset": rng.random() < 0.5}
    elif kind == "free":
        body = {"free": [rng.randint(0, 8) for _ in range(rng.randint(0, 3))]}
    elif kind in ("transfer", "resend"):
        n = rng.randint(1, 3)
        body = {"client": a_text(rng), "run": small_int(rng), "value": small_int(rng),
                "values": [small_int(rng) for _ in range(n)],
                "src": rng.choice(["w0", "w1", "x"]), "dst": "w1",
                "tensors": [a_tensor(rng) for _ in range(n)]}  # fmt: skip
    elif kind == "abort":
        body = {"run": small_int(rng)}
    return {"kind": kind, "id": a_text(rng), "free": [], "session": rng.choice(SESSIONS),
            **body}  # fmt: skip


def mutated(rng: random.Random) -> dict:
    """A request with fields replaced by arbitrary values, dropped, or added."""
    msg = a_request(rng)
    for _ in range(rng.randint(0, 3)):
        action = rng.choice(["replace", "drop", "add", "program"])
        key = rng.choice(sorted(msg))
        if action == "replace":
            msg[key] = a_value(rng)
        elif action == "drop" and key != "kind":
            del msg[key]
        elif action == "add":
            msg[a_text(rng)] = a_value(rng)
        elif action == "program" and "program" in msg:
            msg["program"] = a_value(rng)
    return msg


def bytes_mutated(rng: random.Random) -> bytes | None:
    """A valid message's bytes, flipped, cut or extended (None if it cannot be encoded)."""
    try:
        payload = bytearray(wire.encode(mutated(rng)))
    except (wire.WireError, OverflowError, TypeError, ValueError):
        return None
    for _ in range(rng.randint(1, 4)):
        action = rng.choice(["flip", "cut", "extend"])
        if action == "flip" and payload:
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        elif action == "cut":
            payload = payload[: rng.randint(0, len(payload))]
        else:
            payload += rng.randbytes(rng.randint(1, 64))
    return bytes(payload)


COSTLY = ["wide", "deep", "empty lists", "empty maps", "nested empty lists",
          "lists in a tensor", "lists in a slot"]  # fmt: skip


def a_costly_header(rng: random.Random) -> bytes:
    """A request whose header costs time to decode, one of COSTLY: a field that is wide (many
    small ints), deep (nested up to past msgpack's stack of 1024), or many empty containers,
    also inside an extension (decoded on its own). The worker must refuse it, or serve it,
    at a cost its size bounds."""
    shape, n = rng.choice(COSTLY), rng.randint(1, 64 << 10)
    if shape == "deep":
        value = b"\x91" * rng.randint(1, 1100) + b"\x90"
    else:
        value = msgpack.packb({
            "wide": lambda: [rng.randint(0, 200)] * n,
            "empty lists": lambda: [[]] * n,
            "empty maps": lambda: [{}] * n,
            "nested empty lists": lambda: [[[[]] * 4] * 4] * (n // 16 + 1),
            "lists in a tensor": lambda: msgpack.ExtType(3, msgpack.packb([[]] * n)),
            "lists in a slot": lambda: msgpack.ExtType(1, msgpack.packb([[]] * n)),
        }[shape]())  # fmt: skip
    fields = {"kind": rng.choice(KINDS), "id": a_text(rng), "session": rng.choice(SESSIONS)}
    field = rng.choice(["program", "values", "free", "params", "pad"])
    header = bytes([0x80 | (len(fields) + 1)])  # a fixmap
    for key, v in fields.items():
        header += msgpack.packb(key) + msgpack.packb(v)
    header += msgpack.packb(field) + value
    return bytes(len(header).to_bytes(4, "little") + header + bytes(-(4 + len(header)) % 64))


def a_message(rng: random.Random) -> tuple[str, bytes | dict | None]:
    """(what it is, the message): a dict to encode, or raw bytes."""
    pick = rng.random()
    if pick < 0.6:
        return "mutated", mutated(rng)
    if pick < 0.9:
        return "bytes-mutated", bytes_mutated(rng)
    if pick < 0.97:
        return "random", rng.randbytes(rng.randint(0, 300))
    return "costly", a_costly_header(rng)


class Fuzzer:
    """Sends generated messages to `arena.target`; counts them; checks the victim."""

    def __init__(self, arena: Arena, check_every: int) -> None:
        self.arena = arena
        self.check_every = check_every
        self.sent: Counter[str] = Counter()
        self.unencodable = 0
        self.checks = 0
        self.failure: BaseException | None = None  # raised after Hypothesis is done

    def send(self, kind: str, message: bytes | dict | None) -> None:
        peer = self.arena.attacker
        if message is None:
            self.unencodable += 1
            return
        if isinstance(message, dict):
            # Its replies go to the sender's own topic for the session named: heard, unless
            # the session is one of no use to a well-behaved peer.
            session = message.get("session")
            if isinstance(session, str) and session in SESSIONS:
                peer.reply_topic(session)
            try:
                payload = wire.encode(message)
            except (wire.WireError, OverflowError, TypeError, ValueError):
                self.unencodable += 1
                return
        else:
            payload = message
        peer.publish(self.arena.target, payload)
        self.sent[kind] += 1
        if sum(self.sent.values()) % self.check_every == 0:
            try:
                self.check()
            except BaseException as e:  # a crash or hang: stop fuzzing, report it
                self.failure = e

    def check(self) -> None:
        """No crash, no hang: a fresh peer is answered, and the victim stays exact."""
        prober = self.arena.new_peer(f"prober{self.checks}")
        assert prober.request(self.arena.target, {"kind": "ping"}, timeout=60)["ok"]
        prober.close()
        self.arena.check()
        self.checks += 1

    def report(self, transport: str) -> str:
        replies = Counter()
        while not self.arena.attacker.replies.empty():
            msg = self.arena.attacker.replies.get_nowait()
            replies["ok" if msg.get("ok") else "error"] += 1
        total = sum(self.sent.values())
        return (
            f"fuzz ({transport}): {total} messages sent ("
            + ", ".join(f"{k} {n}" for k, n in sorted(self.sent.items()))
            + f"), {self.unencodable} unencodable skipped; replies: {replies['ok']} ok, "
            f"{replies['error']} errors; {self.checks} victim checks, all exact; "
            "0 crashes, 0 hangs"
        )


def fuzz(arena: Arena, n: int, check_every: int, transport: str) -> Fuzzer:
    fuzzer = Fuzzer(arena, check_every)

    # Generate only: the checks are not a property of one batch, so nothing to shrink.
    @settings(max_examples=-(-n // BATCH), deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.randoms(use_true_random=False))
    def send_batch(rng: random.Random) -> None:
        for _ in range(BATCH):
            if fuzzer.failure is None:
                fuzzer.send(*a_message(rng))

    send_batch()
    if fuzzer.failure is not None:
        raise fuzzer.failure
    fuzzer.check()
    for session in SESSIONS:  # free them (not waited for: a fuzzed run may still be going)
        arena.attacker.send(arena.target, {"kind": "bye", "session": session})
    print(fuzzer.report(transport))
    return fuzzer


def test_fuzz_a_worker_on_the_local_bus():
    for arena in local_arena(requests_per_second=math.inf, request_burst=1 << 62):
        fuzzer = fuzz(arena, LOCAL_MESSAGES, CHECK_EVERY, "local bus")
        assert sum(fuzzer.sent.values()) >= LOCAL_MESSAGES


@pytest.mark.ipfs
@pytest.mark.parametrize("arena", ["ipfs"], indirect=True)
def test_fuzz_a_worker_over_kubo(arena):
    fuzzer = fuzz(arena, IPFS_MESSAGES, CHECK_EVERY // 10, "Kubo")
    assert sum(fuzzer.sent.values()) >= IPFS_MESSAGES
