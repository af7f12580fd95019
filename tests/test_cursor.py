import dataclasses

import pytest

from feeder.core.cursor import Cursor
from feeder.sources.kafka_positions import KafkaEpoch, KafkaFollow
from feeder.core.errors import FailedPrecondition

C = Cursor(job="job-1", fingerprint="ab" * 32, seed=3, shuffle=True, drop_last=False, seq_len=128,
           world_size=4, rank=2, epoch=1, base=0, pos=40, step=5)


def test_roundtrip():
    assert Cursor.decode(C.encode(b"k"), b"k") == C


@pytest.mark.parametrize("mutate", [
    lambda b: b[:-1],                                  # truncated
    lambda b: b[:10],
    lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:],    # a flipped bit
    lambda b: b"",
    lambda b: b"garbage that is long enough to look like one",
])
def test_tampered_cursor_is_refused(mutate):
    with pytest.raises(FailedPrecondition):
        Cursor.decode(mutate(C.encode(b"k")), b"k")


def test_cursor_from_another_deployment_is_refused():
    with pytest.raises(FailedPrecondition, match="another cursor secret"):
        Cursor.decode(C.encode(b"secret-a"), b"secret-b")


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
@pytest.mark.parametrize("secret", [b"", b"k", b"x" * 100])   # the dev secret, short, longer than a block
def test_cursor_writer_writes_what_encode_writes(secret, native, monkeypatch):
    import dataclasses

    from feeder.core import cursor
    from feeder.core.cursor import CursorWriter

    if not native:
        monkeypatch.setattr(cursor, "_native_cursors", None)
        monkeypatch.setattr(cursor, "_native_mac", None)
    else:
        assert cursor._native_cursors is not None, "the C extension is built by make env"

    w = CursorWriter(dataclasses.replace(C, src=KafkaEpoch("topic:0-9")), secret)
    for world in (4, 3, 4):   # a segment re-dealt to 3 ranks, and back: one head per world size
        got = w.many(world=world, epoch=7, base=9, stops=[8, 16, 19], first_step=10)
        want = [dataclasses.replace(C, src=KafkaEpoch("topic:0-9"), world_size=world, epoch=7, base=9, pos=pos, step=step)
                .encode(secret) for pos, step in ((8, 11), (16, 12), (19, 13))]
        assert got == want
        assert Cursor.decode(got[-1], secret).pos == 19


def test_native_cursor_macs_equal_hmac_for_heads_of_every_length():
    """The C HMAC-SHA256 against the standard library: heads of 0-300 bytes put the cursor's
    tail at every offset of a SHA-256 block, so both one and two final blocks occur."""
    import hmac
    import random
    import struct

    from feeder._native import cursors

    rnd = random.Random(7)
    for n in range(301):
        key, head = rnd.randbytes(64), rnd.randbytes(n)
        stops = [rnd.getrandbits(63) for _ in range(3)]
        epoch, base, first = rnd.getrandbits(32), rnd.getrandbits(64), rnd.getrandbits(40)
        want = []
        for j, pos in enumerate(stops):
            body = head + struct.pack(">IQQQ", epoch, base, pos, first + j + 1)
            want.append(body + hmac.digest(key, body, "sha256")[:16])
        assert cursors(key, head, epoch, base, stops, first) == want, n
    assert cursors(key, head, 1, 2, [], 0) == []
    with pytest.raises(ValueError, match="64-byte"):
        cursors(b"short", head, 1, 2, [3], 0)
    with pytest.raises(OverflowError, match="32 bits"):
        cursors(key, head, 1 << 32, 2, [3], 0)
    with pytest.raises(OverflowError):
        cursors(key, head, 1, 2, [-1], 0)


def test_native_mac_of_a_whole_cursor_equals_hmac_for_bodies_and_keys_of_every_length():
    """_native.c's mac (a cursor a plan writes whole: Kafka follow streams write one per batch)
    against the standard library, bodies of 0-300 bytes, keys empty (the dev secret), short,
    one block and longer than one (hashed first)."""
    import hmac
    import random

    from feeder.core import cursor

    assert cursor._native_mac is not None, "the C extension is built by make env"
    rnd = random.Random(11)
    for secret in (b"", b"k", rnd.randbytes(64), rnd.randbytes(65), rnd.randbytes(200)):
        for n in range(301):
            body = rnd.randbytes(n)
            assert cursor._mac(secret, body) == hmac.digest(secret or cursor.DEV_SECRET, body, "sha256")[:16], n
    for secret in (bytearray(b"abc"), memoryview(b"abc")):   # any bytes-like secret, as hmac takes
        assert cursor._mac(secret, b"x") == hmac.digest(bytes(secret), b"x", "sha256")[:16]
    with pytest.raises(ValueError, match="64-byte"):
        cursor._native_mac(b"short", b"body")


def _v2(c: Cursor, text: str, secret: bytes) -> bytes:
    """A cursor as version 2 wrote it (checkpoints made before the typed positions hold these)."""
    import struct

    from feeder.core.cursor import _HEAD, _TAIL, MAGIC, _mac

    job, fp, src = c.job.encode(), c.fingerprint.encode(), text.encode()
    flags = (1 if c.shuffle else 0) | (2 if c.drop_last else 0)
    body = b"".join([MAGIC, bytes([2, 1]), struct.pack(">H", len(job)), job, struct.pack(">H", len(fp)), fp,
                     struct.pack(">I", len(src)), src, _HEAD.pack(c.seed, flags, 0, c.seq_len, c.world_size, c.rank),
                     _TAIL.pack(c.epoch, c.base, c.pos, c.step)])
    return body + _mac(secret, body)


def test_version_2_cursors_still_resume_with_their_position_typed():
    """Checkpoints written before version 3 hold text positions: a dataset's (none), a Kafka
    epoch's ranges, a follow stream's JSON. They decode to the typed values a v3 cursor holds."""
    base = Cursor(job="j", fingerprint="f", seed=1, shuffle=True, drop_last=False, seq_len=8, world_size=2, rank=1,
                  epoch=3, base=0, pos=5, step=2)
    follow = KafkaFollow(partitions=2, next=(7, 9), turn=1, k=15, skip=3, i=40)
    for text, want in (("", None), ("t:0=0-9,1=0-4", KafkaEpoch("t:0=0-9,1=0-4")),
                       ('{"P":2,"next":[7,9],"turn":1,"k":15,"skip":3,"i":40}', follow)):
        got = Cursor.decode(_v2(base, text, b"s"), b"s")
        assert got == dataclasses.replace(base, src=want)
        assert Cursor.decode(got.encode(b"s"), b"s") == got   # and written back as version 3
