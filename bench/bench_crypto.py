"""AEAD throughput on tensor payloads, as gridgraph's transport encrypts them, and the cost of
sealing one small message, side by side with the alternative cipher.

Run: python bench/bench_crypto.py [--mb 64]

Prints GiB/s for encrypting and decrypting a payload of fresh random bytes piece by piece
(512 KiB pieces, as the IPFS transport cuts blocks) with AES-256-GCM (what gridgraph uses,
through gridgraph.exec.ipfs.secure) and ChaCha20-Poly1305 (the other choice), medians of 5 runs;
next to a plain copy of the same pieces (what memory alone allows on this machine now);
then microseconds to seal and open a 200-byte message between two endpoints. Target: at
least 1 GiB/s for the cipher in use.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from gridgraph.exec.ipfs import secure
from gridgraph.exec.ipfs.transport import BLOCK_SIZE

TARGET = 1.0  # GiB/s


def gib_per_s(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 2**30


def pieces_of(payload: bytes) -> list[memoryview]:
    view = memoryview(payload)
    return [view[i : i + BLOCK_SIZE] for i in range(0, len(view), BLOCK_SIZE)]


def gridgraph_aead(payload: bytes, rounds: int) -> tuple[list[float], list[float]]:
    seal, open_ = [], []
    for _ in range(rounds):
        key = secure.new_blob_key()
        start = time.perf_counter()
        sealed = secure.seal_pieces(key, payload, BLOCK_SIZE)
        seal.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = secure.open_pieces(key, sealed)
        open_.append(time.perf_counter() - start)
        assert out == payload
    return seal, open_


def copies(payload: bytes, rounds: int) -> tuple[list[float], list[float]]:
    """A plain copy of the payload, piece by piece, then joined: what memory alone allows."""
    seal, open_ = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        pieces = [bytes(p) for p in pieces_of(payload)]
        seal.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = bytearray(b"".join(pieces))
        open_.append(time.perf_counter() - start)
        assert out == payload
    return seal, open_


def chacha(payload: bytes, rounds: int) -> tuple[list[float], list[float]]:
    seal, open_ = [], []
    for _ in range(rounds):
        aead = ChaCha20Poly1305(ChaCha20Poly1305.generate_key())
        start = time.perf_counter()
        sealed = [aead.encrypt(i.to_bytes(12, "big"), p, None)
                  for i, p in enumerate(pieces_of(payload))]  # fmt: skip
        seal.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = b"".join(aead.decrypt(i.to_bytes(12, "big"), s, None) for i, s in enumerate(sealed))
        open_.append(time.perf_counter() - start)
        assert out == payload
    return seal, open_


def small_messages(n: int) -> tuple[float, float]:
    alice, bob = secure.Channel("12D3KooWalice"), secure.Channel("12D3KooWbob")
    body = os.urandom(200)
    alice.seal(bob.identity, "t", body)  # derive the keys once, as a session does
    start = time.perf_counter()
    sealed = [alice.seal(bob.identity, "t", body) for _ in range(n)]
    seal_us = 1e6 * (time.perf_counter() - start) / n
    start = time.perf_counter()
    for message in sealed:
        bob.open(alice.peer, "t", message)
    return seal_us, 1e6 * (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64, help="payload size (MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    payload = os.urandom(int(args.mb * 2**20))
    print(f"{args.mb:g} MiB payload in {BLOCK_SIZE >> 10} KiB pieces, median of {args.rounds}")
    print("                          encrypt       decrypt")
    speeds = {}
    for name, run in (
        ("AES-256-GCM (gridgraph)", gridgraph_aead),
        ("ChaCha20-Poly1305", chacha),
        ("plain copy (no crypto)", copies),
    ):
        seal, open_ = run(payload, args.rounds)
        speeds[name] = gib_per_s(len(payload), seal), gib_per_s(len(payload), open_)
        print(f"  {name:24s}{speeds[name][0]:6.2f} GiB/s  {speeds[name][1]:6.2f} GiB/s")
    ours = min(speeds["AES-256-GCM (gridgraph)"])
    copy = min(speeds["plain copy (no crypto)"])
    seal_us, open_us = small_messages(2000)
    print(f"\nsmall message (200 bytes): seal {seal_us:.1f} us, open {open_us:.1f} us")
    verdict = "meets" if ours >= TARGET else "MISSES"
    print(f"\ngridgraph's AEAD: {ours:.2f} GiB/s ({ours / copy:.2f}x a plain copy), {verdict} "
          f"the {TARGET:g} GiB/s target")  # fmt: skip
    if verdict == "MISSES" and copy < 2 * TARGET:
        print(f"(a plain copy runs at only {copy:.2f} GiB/s: the CPU is busy; run it again idle)")


if __name__ == "__main__":
    main()
