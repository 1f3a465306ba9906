"""gridgraph.exec.ipfs.secure without a network: sealing, opening, and every bad input refused."""

from __future__ import annotations

import io
import os
import time

import msgpack
import pytest

from gridgraph.exec.ipfs import secure
from gridgraph.exec.ipfs.progress import PROGRESS_MIN, Progress, wanted

ALICE, BOB, EVE = "12D3KooWalice", "12D3KooWbob", "12D3KooWeve"


@pytest.fixture
def pair() -> tuple[secure.Channel, secure.Channel]:
    return secure.Channel(ALICE), secure.Channel(BOB)


def test_a_sealed_message_opens_for_its_receiver_only(pair):
    alice, bob = pair
    sealed = alice.seal(bob.identity, "topic", b"tensor bytes")
    assert b"tensor bytes" not in sealed
    assert bob.open(ALICE, "topic", sealed) == (alice.identity, b"tensor bytes")
    assert secure.split_identity(alice.identity) == (ALICE, alice.public)
    with pytest.raises(secure.Rejected, match="authentication failed"):
        secure.Channel(BOB).open(ALICE, "topic", sealed)  # another key of the same peer


def test_the_two_directions_and_every_pair_have_their_own_key(pair):
    alice, bob = pair
    a_to_b = alice._key(alice.identity, bob.identity)
    b_to_a = alice._key(bob.identity, alice.identity)
    assert a_to_b is not b_to_a
    sealed = alice.seal(bob.identity, "t", b"x")
    # The same bytes claimed by another peer (who re-publishes them) do not open.
    with pytest.raises(secure.Rejected, match="authentication failed"):
        bob.open(EVE, "t", sealed)


@pytest.mark.parametrize(
    "how, reason",
    [
        ("wrong key", "authentication failed"),
        ("truncated ciphertext", "truncated ciphertext"),
        ("tampered tag", "authentication failed"),
        ("tampered counter", "authentication failed"),
        ("another topic", "authentication failed"),
        ("replayed nonce", "a replay"),
        ("garbage", "not a sealed message"),
        ("bad version", "not a version 2"),
        ("no sender key", "without a sender key"),
    ],
)
def test_bad_input_is_rejected_naming_why(pair, how, reason):
    alice, bob = pair
    topic = "gridgraph.worker.w1"
    receiver = bob.identity
    if how == "wrong key":
        receiver = secure.make_identity(BOB, secure.Channel(BOB).public)
    sealed = alice.seal(receiver, topic, b"payload")
    version, public, counter, ciphertext = msgpack.unpackb(sealed)
    if how == "truncated ciphertext":
        ciphertext = ciphertext[:10]
    elif how == "tampered tag":
        ciphertext = ciphertext[:-1] + bytes([ciphertext[-1] ^ 0x80])
    elif how == "tampered counter":
        counter += 1
    elif how == "bad version":
        version = 1
    elif how == "no sender key":
        public = b"short"
    message = msgpack.packb([version, public, counter, ciphertext])
    if how == "garbage":
        message = os.urandom(40)
    if how == "another topic":
        topic = "gridgraph.worker.w2"
    if how == "replayed nonce":
        bob.open(ALICE, topic, message)
    with pytest.raises(secure.Rejected, match=reason):
        bob.open(ALICE, topic, message)


def test_replays_are_refused_in_any_order_and_old_counters_too():
    window = secure.ReplayWindow(width=8)
    for counter in (5, 3, 9, 4):
        window.check(counter)
    for counter in (5, 3, 9):
        with pytest.raises(secure.Rejected, match="replay"):
            window.check(counter)
    window.check(20)
    with pytest.raises(secure.Rejected, match="older than the replay window"):
        window.check(12)
    window.check(13)


def test_pieces_round_trip_and_refuse_tampering_and_reordering():
    key = secure.new_blob_key()
    payload = os.urandom(10_000)
    pieces = secure.seal_pieces(key, payload, 4096)
    assert [len(p) for p in pieces] == [4096 + 16, 4096 + 16, 1808 + 16]
    assert secure.open_pieces(key, pieces) == payload
    with pytest.raises(secure.Rejected, match="block 0 failed"):
        secure.open_pieces(key, [pieces[1], pieces[0], pieces[2]])
    with pytest.raises(secure.Rejected, match="truncated"):
        secure.open_pieces(key, [pieces[0][:8]])
    with pytest.raises(secure.Rejected, match="failed authentication"):
        secure.open_pieces(secure.new_blob_key(), pieces)


def test_blinded_topics_hide_the_name():
    topic = "gridgraph.client.12D3KooWalice~key.0123456789ab"
    blind = secure.blind_topic(topic)
    assert blind == secure.blind_topic(topic) and blind.startswith("gridgraph.t.")
    assert "alice" not in blind and "0123456789ab" not in blind


def test_only_short_topic_names_are_kept_by_the_hash_cache():
    # A worker names topics after what clients send it: the workers a program sends to, the
    # session id of a request it refuses. Cached whatever their length, runs sending to
    # workers named by 256 KiB strings held up to 1 GiB in this cache (names in runs are
    # bounded now too: worker.py, session.is_name).
    long = "gridgraph.worker." + "w" * (256 << 10)
    before = secure._cached_topic.cache_info().misses
    assert secure.blind_topic(long) == secure.blind_topic(long)
    assert secure._cached_topic.cache_info().misses == before  # (not even looked up)
    short = "gridgraph.worker." + "w" * (secure.CACHED_NAME_MAX - 17)
    secure.blind_topic(short)
    assert secure._cached_topic.cache_info().misses == before + 1


def test_announcements_carry_the_key_in_the_clear(pair):
    alice, _ = pair
    message = alice.announcement(b"heartbeat")
    assert secure.open_announcement(ALICE, message) == (alice.identity, b"heartbeat")
    with pytest.raises(secure.Rejected):
        secure.open_announcement(ALICE, b"\x93\x02\xc4\x01x\xc4\x00")


def test_progress_bar_draws_large_payloads_only():
    out = io.StringIO()
    bar = Progress("get", PROGRESS_MIN * 2, enabled=True, stream=out)
    for _ in range(4):
        bar.add(PROGRESS_MIN // 2)
    bar.close()
    assert "100%" in out.getvalue() and "128/128 MiB" in out.getvalue()
    quiet = io.StringIO()
    small = Progress("get", PROGRESS_MIN - 1, enabled=True, stream=quiet)
    small.add(PROGRESS_MIN - 1)
    small.close()
    assert quiet.getvalue() == ""
    assert wanted(None, io.StringIO()) is False and wanted(True) is True


@pytest.mark.parametrize(
    "garbage",
    [[[]] * 900_000, [[0]] * 300_000, [1, 2, 3, 4, [[]] * 900_000], list(range(900_000))],
    ids=["empty lists", "small lists", "lists in a 5th item", "wide"],
)
def test_what_is_read_before_the_key_opens_a_message_costs_next_to_nothing(pair, garbage):
    # The outer msgpack of a sealed message or an announcement was decoded whole before any
    # check: 0.9 MB of empty lists on a worker's topic held its reader ~0.3 s each.
    alice, bob = pair
    message = msgpack.packb(garbage)
    start = time.perf_counter()
    for _ in range(10):
        with pytest.raises(secure.Rejected):
            bob.open(alice.peer, "topic", message)
        with pytest.raises(secure.Rejected):
            secure.open_announcement(alice.peer, message)
    assert time.perf_counter() - start < 0.05  # (20 refusals; one whole decode took 0.1-0.3 s)
