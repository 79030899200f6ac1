"""The canonical record: validation at emit, the chain hash, and the exact export/spool codecs."""

from __future__ import annotations

import csv
import hashlib
import io
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from audit.errors import InvalidAuditEvent
from audit.formats import CSV_COLUMNS, csv_header, decode_csv, decode_jsonl, encode_csv, encode_jsonl
from audit.ocsf import to_ocsf
from audit.record import GENESIS_HASH, AuditRecord, PendingEvent, chain_hash, parse_time, uuid7
from audit.types import Actions, Actor, AuditEvent, Target

T0 = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def make(**kw) -> PendingEvent:
    event = AuditEvent(
        action=kw.pop("action", Actions.PIN),
        outcome=kw.pop("outcome", "success"),
        actor=kw.pop("actor", Actor(subject="alice", issuer="https://idp", tenant="t1", source="10.0.0.1")),
        target=kw.pop("target", Target(tenant="t1", namespace="ns", chunk_count=3, chunk_digest="ab" * 32)),
        details=kw.pop("details", {"n": 1}),
    )
    return PendingEvent.from_event(event, kw.pop("now", T0))


def test_golden_hash_pins_the_canonical_encoding() -> None:
    e = PendingEvent(
        event_id="01941234-5678-7abc-8def-0123456789ab",
        occurred_at=T0,
        action="key.rotate",
        outcome="success",
        actor=Actor(subject="alice", tenant="t1"),
        target=Target(tenant="t1", chunk_count=0),
        details='{"version":2}',
    )
    rec = AuditRecord.chain(e, seq=1, recorded_at=T0 + timedelta(seconds=1), prev_hash=GENESIS_HASH)
    assert rec.hashed_fields()["occurred_at"] == "2025-01-02T03:04:05.678901Z"
    # The exact bytes hashed, written out. Changing them breaks every stored chain: add a
    # RECORD_VERSION instead.
    expected = (
        '{"action":"key.rotate","actor":{"client_id":null,"issuer":null,"source":null,"subject":"alice",'
        '"tenant":"t1","token_id":null},"details":"{\\"version\\":2}",'
        '"event_id":"01941234-5678-7abc-8def-0123456789ab","occurred_at":"2025-01-02T03:04:05.678901Z",'
        '"outcome":"success","prev_hash":"' + "0" * 64 + '","recorded_at":"2025-01-02T03:04:06.678901Z",'
        '"seq":1,"target":{"chunk_count":0,"chunk_digest":null,"namespace":null,"tenant":"t1",'
        '"tier_from":null,"tier_to":null},"v":1}'
    )
    assert rec.hash == hashlib.sha256(expected.encode()).hexdigest()
    assert rec.hash == "d2da2d7babedd55524387fcee0616d77865cc95b6a28af46c8af5c83ad5f0040"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"action": "Bad Action"}, "dotted lowercase"),
        ({"action": ""}, "dotted lowercase"),
        ({"action": "pin\n"}, "dotted lowercase"),
        ({"outcome": "maybe"}, "outcome"),
        ({"actor": "alice"}, "Actor"),
        ({"target": {"tenant": "t"}}, "Target"),
        ({"actor": Actor(subject="a\x00b")}, "NUL"),
        ({"actor": Actor(subject="x" * 2000)}, "longer"),
        ({"actor": Actor(tenant=5)}, "string"),  # type: ignore[arg-type]
        ({"target": Target(chunk_count=-1)}, "chunk_count"),
        ({"target": Target(chunk_count=True)}, "chunk_count"),  # type: ignore[arg-type]
        ({"target": Target(chunk_digest="xyz")}, "chunk_digest"),
        ({"target": Target(chunk_digest="ab" * 32 + "\n")}, "chunk_digest"),
        ({"details": {"f": float("nan")}}, "JSON"),
        ({"details": {"o": object()}}, "JSON"),
        ({"details": ["not", "a", "mapping"]}, "mapping"),
        ({"details": {"big": "x" * 70000}}, "limit"),
        ({"now": datetime(2025, 1, 1)}, "naive"),
    ],
)
def test_emit_validation_rejects_bad_events(kwargs, message) -> None:
    with pytest.raises(InvalidAuditEvent, match=message):
        make(**kwargs)


def test_details_convert_common_types_once() -> None:
    import enum

    class Tier(enum.Enum):
        REDIS = "redis"

    e = make(details={"at": T0, "id": uuid.UUID(int=1), "tier": Tier.REDIS, "ops": {"put", "get"}})
    assert e.details == (
        '{"at":"2025-01-02T03:04:05.678901Z","id":"00000000-0000-0000-0000-000000000001",'
        '"ops":["get","put"],"tier":"redis"}'
    )
    with pytest.raises(InvalidAuditEvent):
        make(details={"at": datetime(2025, 1, 1)})  # naive: ambiguous
    with pytest.raises(InvalidAuditEvent):
        make(details={"raw": b"bytes"})


def test_not_an_event_is_rejected() -> None:
    with pytest.raises(InvalidAuditEvent):
        PendingEvent.from_event({"action": "pin"}, T0)  # type: ignore[arg-type]


def test_empty_strings_are_absent_and_times_are_utc() -> None:
    local = timezone(timedelta(hours=2))
    e = make(actor=Actor(subject="", tenant="t"), now=T0.astimezone(local))
    assert e.actor.subject is None and e.actor.tenant == "t"
    assert e.occurred_at.tzinfo == UTC and e.occurred_at == T0


def test_uuid7_carries_the_time_and_is_unique() -> None:
    ids = [uuid7(T0) for _ in range(1000)]
    assert len(set(ids)) == 1000
    u = uuid.UUID(ids[0])
    assert u.version == 7 and u.variant == uuid.RFC_4122
    assert (u.int >> 80) == int(T0.timestamp() * 1000)
    assert uuid7(T0 + timedelta(milliseconds=1)) > max(ids)


def test_every_field_is_covered_by_the_hash() -> None:
    rec = AuditRecord.chain(make(), seq=7, recorded_at=T0, prev_hash="1" * 64)
    doc = rec.hashed_fields()
    for key in doc:
        changed = dict(doc)
        if isinstance(doc[key], dict):
            sub = dict(doc[key])
            first = next(iter(sub))
            sub[first] = "other"
            changed[key] = sub
        else:
            changed[key] = 8 if key in ("seq", "v") else "other"
        assert chain_hash(changed) != rec.hash, key


text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
events = st.builds(
    AuditEvent,
    action=st.sampled_from([Actions.PIN, Actions.CLEAR_COMPLETED, "authz.denied"]),
    outcome=st.sampled_from(["success", "failure", "denied"]),
    actor=st.builds(
        Actor, subject=text | st.none(), issuer=text, tenant=text, client_id=text, token_id=text, source=text
    ),
    target=st.builds(
        Target,
        tenant=text,
        namespace=text,
        chunk_count=st.none() | st.integers(0, 2**62),
        chunk_digest=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
        tier_from=text,
        tier_to=text,
    ),
    details=st.dictionaries(text, json_values, max_size=5),
)


@settings(max_examples=150, deadline=None)
@given(event=events, seq=st.integers(1, 2**62))
def test_codecs_round_trip_exactly(event: AuditEvent, seq: int) -> None:
    pending = PendingEvent.from_event(event, T0)
    assert PendingEvent.from_json(pending.to_json()) == pending
    rec = AuditRecord.chain(pending, seq=seq, recorded_at=T0, prev_hash="2" * 64)

    doc, claimed = decode_jsonl(encode_jsonl(rec).decode())
    assert claimed == rec.hash and chain_hash(doc) == rec.hash

    data = (csv_header() + encode_csv(rec)).decode()
    rows = list(csv.reader(io.StringIO(data, newline="")))
    assert rows[0] == list(CSV_COLUMNS)
    doc, claimed = decode_csv(rows[1])
    assert claimed == rec.hash and chain_hash(doc) == rec.hash

    ocsf = to_ocsf(rec.hashed_fields(), rec.hash)
    assert ocsf["metadata"]["sequence"] == seq and ocsf["unmapped"]["kvgate_hash"] == rec.hash


def test_decoders_refuse_malformed_rows() -> None:
    rec = AuditRecord.chain(make(), seq=1, recorded_at=T0, prev_hash=GENESIS_HASH)
    line = encode_jsonl(rec).decode()
    for bad in ("[]", "{", line.replace('"seq":1', '"seq":true'), line.replace('"v":1', '"v":1,"extra":1')):
        with pytest.raises(ValueError):
            decode_jsonl(bad)
    row = next(csv.reader(io.StringIO(encode_csv(rec).decode())))
    for bad in (row[:-1], ["1", "01"] + row[2:], ["1", "1_0"] + row[2:]):
        with pytest.raises(ValueError):
            decode_csv(bad)


def test_parse_time_is_strict() -> None:
    assert parse_time("2025-01-02T03:04:05.678901Z") == T0
    with pytest.raises(ValueError):
        parse_time("2025-01-02 03:04:05")


def test_ocsf_maps_a_socket_peer_to_its_process_and_an_address_to_an_ip() -> None:
    peer = Actor(subject="alice", tenant="t1", source="unix:uid=1000:pid=4242")
    rec = AuditRecord.chain(make(actor=peer), seq=1, recorded_at=T0, prev_hash=GENESIS_HASH)
    ocsf = to_ocsf(rec.hashed_fields(), rec.hash)
    assert ocsf["src_endpoint"] == {"name": "unix:uid=1000:pid=4242"}
    assert ocsf["actor"]["process"] == {"pid": 4242, "user": {"uid": "1000"}}
    assert ocsf["actor"]["user"]["uid"] == "alice"
    # the control: a TCP peer's address stays an IP, with no process
    rec = AuditRecord.chain(make(), seq=1, recorded_at=T0, prev_hash=GENESIS_HASH)
    ocsf = to_ocsf(rec.hashed_fields(), rec.hash)
    assert ocsf["src_endpoint"] == {"ip": "10.0.0.1"} and "process" not in ocsf["actor"]
