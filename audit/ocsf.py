"""A documented mapping of kvgate audit records to OCSF 1.x *API Activity* (class_uid 6003).

Exports keep the canonical, hashed field names (they are what verification recomputes); this
module turns a record into an OCSF event for a SIEM, with the chain fields kept in ``unmapped``:
occurred_at -> time, event_id -> metadata.uid, seq -> metadata.sequence, recorded_at ->
metadata.logged_time (times in epoch ms); actor.subject / tenant / issuer / client_id / token_id ->
actor.user.uid / actor.user.org.uid / actor.idp.uid / actor.app_uid / actor.user.credential_uid;
actor.source -> src_endpoint.ip, or for a Unix-socket peer (``unix:uid=U:pid=P``)
src_endpoint.name, actor.process.pid and actor.process.user.uid; action -> api.operation
(activity_id from ``ACTIVITY``); outcome -> status_id / status (denied: Failure, status_detail);
target.* -> resources[0] (uid = tenant/namespace, data = the rest); details -> api.request.data;
prev_hash, hash -> unmapped.kvgate_prev_hash, unmapped.kvgate_hash.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from audit.record import parse_time

__all__ = ["ACTIVITY", "CLASS_UID", "to_ocsf"]


def _source(source: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``src_endpoint`` and the actor's extra fields (a Unix-socket peer's process) of
    ``actor.source``."""
    if source and source.startswith("unix:"):
        fields = dict(part.split("=", 1) for part in source[5:].split(":") if "=" in part)
        pid = fields.get("pid", "")
        process = {"process": {"pid": int(pid), "user": {"uid": fields.get("uid")}}} if pid.isdigit() else {}
        return {"name": source}, process
    return {"ip": source}, {}

CLASS_UID = 6003
CATEGORY_UID = 6
# activity_id: 1 Create, 2 Read, 3 Update, 4 Delete, 99 Other
ACTIVITY: dict[str, int] = {
    "tenant.create": 1,
    "key.create": 1,
    "capability.mint": 1,
    "key.lease": 2,
    "key.issue": 2,
    "key.rotate": 3,
    "move": 3,
    "pin": 3,
    "unpin": 3,
    "tenant.disable": 3,
    "key.destroy": 4,
    "clear.requested": 4,
    "clear.completed": 4,
    "capability.revoke": 4,
}


def _ms(text: str) -> int:
    return int(parse_time(text).timestamp() * 1000)


def to_ocsf(doc: Mapping[str, Any], hash_: str) -> dict[str, Any]:
    """OCSF API Activity event from a record document (``AuditRecord.hashed_fields()``)."""
    actor, target = doc["actor"], doc["target"]
    details = doc["details"]
    activity = ACTIVITY.get(doc["action"], 99)
    outcome = doc["outcome"]
    endpoint, process = _source(actor["source"])
    event: dict[str, Any] = {
        "class_uid": CLASS_UID,
        "category_uid": CATEGORY_UID,
        "activity_id": activity,
        "type_uid": CLASS_UID * 100 + activity,
        "severity_id": 1 if outcome == "success" else 3,
        "time": _ms(doc["occurred_at"]),
        "status_id": 1 if outcome == "success" else 2,
        "status": "Success" if outcome == "success" else "Failure",
        "metadata": {
            "uid": doc["event_id"],
            "sequence": doc["seq"],
            "logged_time": _ms(doc["recorded_at"]),
            "product": {"name": "kvgate", "vendor_name": "kvgate"},
            "version": "1.1.0",
        },
        "actor": {
            "user": {"uid": actor["subject"], "org": {"uid": actor["tenant"]}, "credential_uid": actor["token_id"]},
            "idp": {"uid": actor["issuer"]},
            "app_uid": actor["client_id"],
            **process,
        },
        "src_endpoint": endpoint,
        "api": {
            "operation": doc["action"],
            "request": {"data": json.loads(details) if isinstance(details, str) else details},
        },
        "resources": [
            {
                "uid": "/".join(p for p in (target["tenant"], target["namespace"]) if p) or None,
                "type": "kv_cache",
                "data": {k: target[k] for k in ("chunk_count", "chunk_digest", "tier_from", "tier_to")},
            }
        ],
        "unmapped": {"kvgate_prev_hash": doc["prev_hash"], "kvgate_hash": hash_},
    }
    if outcome == "denied":
        event["status_detail"] = "denied"
    return event
