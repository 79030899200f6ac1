"""The scale run (scripts/scale): its tables from a result made up here, the docs section they go
into, and ``--quick`` end to end against a real server, Postgres and redis-server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts.scale.render import BEGIN, END, markdown, write_docs
from tests.support.paths import REPO
from tests.support.services import PG_ADMIN_URL, missing, need


def _result() -> dict[str, Any]:
    cfg = {"envelope_bytes": 256, "lookup_chunks": 128, "lookup_reps": 500, "served_reps": 300, "clear_reps": 3,
           "worker_seconds": 15.0, "load_chunks": 16, "load_bytes": 16384, "audit_seconds": 30.0}
    meta = {"date": "2026-12-05", "commit": "abc1234", "command": "python -m scripts.scale", "machine": "2 CPUs", "config": cfg}
    lookup = [
        {"chunks": 1000, "wall_ms": {"p50": 0.7, "p99": 1.1}, "cpu_ms": {"p50": 0.5, "p99": 0.9}, "rss_bytes": 300 << 20,
         "rss_base_bytes": 299 << 20, "bytes_per_chunk": 900.0},
        {"chunks": 1000000, "wall_ms": {"p50": 1.4, "p99": 3.0}, "cpu_ms": {"p50": 1.0, "p99": 2.0}, "rss_bytes": 1500 << 20,
         "rss_base_bytes": 299 << 20, "bytes_per_chunk": 1259.5},
    ]
    served = [
        {"chunks": 1000, "wall_ms": {"p50": 1.0, "p99": 2.0}, "server_cpu_ms": 0.8, "rss_bytes": 128 << 20,
         "rss_base_bytes": 127 << 20, "bytes_per_chunk": 2000.0},
        {"chunks": 1000000, "wall_ms": {"p50": 1.2, "p99": 2.5}, "server_cpu_ms": 1.2, "rss_bytes": 1400 << 20,
         "rss_base_bytes": 127 << 20, "bytes_per_chunk": 1300.0},
    ]
    clear_memory = [{"chunks": 0, "reps": 3, "namespace_ms": 20.0, "tenant_ms": 25.0},
                    {"chunks": 100000, "reps": 3, "namespace_ms": 920.0, "tenant_ms": 700.0}]
    clear_redis = [{"chunks": 0, "reps": 3, "namespace_ms": 15.0, "tenant_ms": 20.0},
                   {"chunks": 100000, "reps": 3, "namespace_ms": 815.0, "tenant_ms": 700.0, "raw_unlink_ms": 163.0}]
    workers = [
        {"workers": 1, "requests": 4000, "requests_per_s": 280.0, "per_worker": 280.0, "lookup_ms": {"p50": 2.0, "p99": 6.8},
         "load_ms": {"p50": 4.1, "p99": 12.6}, "server_cpu_ms_per_request": 2.5, "wall_s": 15.1, "errors": {}},
        {"workers": 4, "requests": 6000, "requests_per_s": 420.0, "per_worker": 105.0, "lookup_ms": {"p50": 11.0, "p99": 27.0},
         "load_ms": {"p50": 8.6, "p99": 22.6}, "server_cpu_ms_per_request": 2.2, "wall_s": 15.2,
         "errors": {"load_short": 2}},
    ]
    audit = {"emitted": {"rows": 300000, "seconds": 30.0, "rows_per_s": 10000.0},
             "recorded_1": {"rows": 1400, "seconds": 10.0, "rows_per_s": 140.0},
             "recorded_16": {"rows": 14000, "seconds": 10.0, "rows_per_s": 1400.0},
             "raw_batch": {"rows": 600000, "seconds": 30.0, "rows_per_s": 20000.0},
             "raw_row_1": {"rows": 7000, "seconds": 10.0, "rows_per_s": 700.0},
             "raw_row_16": {"rows": 11200, "seconds": 10.0, "rows_per_s": 1120.0}, "batch_size": 500}
    return {"meta": meta, "embedded": {"lookup": lookup, "clear_memory": clear_memory, "clear_redis": clear_redis},
            "served": {"lookup": served, "workers": workers}, "audit": audit}


def _row(md: str, start: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(start))
    return [c.strip() for c in line.strip("|").split("|")]


def test_tables_give_each_figure_beside_its_ratio_of_the_same_run() -> None:
    md = markdown(_result())
    # lookups: CPU time beside the smallest size's (1.0 / 0.5, 1.2 / 0.8), resident MiB, bytes per chunk
    assert _row(md, "| embedded | 10^6 |") == ["embedded", "10^6", "1.400", "3.000", "1.000", "2.00", "1,500", "1,260"]
    assert _row(md, "| served | 10^3 |")[4:6] == ["0.800", "1.00"]
    assert _row(md, "| served | 10^6 |")[4:6] == ["1.200", "1.50"]
    # clears: per chunk above the empty namespace's clear ((920 - 20) ms / 10^5 = 9 us), beside raw UNLINK (815 / 163)
    assert _row(md, "| memory | 10^5 |") == ["memory", "10^5", "920.00", "700.00", "20.00", "9.00", "-", "-"]
    assert _row(md, "| redis | 10^5 |")[4:] == ["15.00", "8.00", "163.00", "5.00"]
    assert "| memory | 0 |" not in md  # the empty clear is a column, not a row
    # workers: per worker beside one worker alone (105 / 280), all of them beside it (420 / 280); errors shown
    assert _row(md, "| 4 |") == ["4", "420", "105", "0.38", "1.50", "11.00 / 27.00", "8.60 / 22.60", "2.200", "load_short 2"]
    assert _row(md, "| 1 |")[-1] == "0"
    # audit: each path beside the raw INSERT of its shape
    assert _row(md, "| `emit`, sustained |")[-1] == "0.50"
    assert _row(md, "| `record`, 1 caller |")[-1] == "0.20"
    assert _row(md, "| `record`, 16 callers |")[-2:] == ["1,120", "1.25"]
    assert "abc1234" in md and "256 bytes" in md


def test_parts_not_run_leave_their_tables_empty() -> None:
    data = _result()
    del data["served"], data["audit"], data["embedded"]["clear_redis"]
    md = markdown(data)
    assert "| embedded | 10^3 |" in md and "| served |" not in md and "| redis |" not in md
    assert "| `emit`" not in md


def test_docs_get_the_tables_between_the_markers_only_and_the_json_beside(tmp_path: Path) -> None:
    runs = tmp_path / "runs.md"
    runs.write_text(f"# Runs\n\n## Scale\n\n{BEGIN}\nold\n{END}\n\n## Next\nkept\n")
    src = tmp_path / "out.json"
    src.write_text(json.dumps(_result()))
    write_docs(_result(), runs, tmp_path / "runs-data", source=src)
    text = runs.read_text()
    assert text.startswith("# Runs\n\n## Scale\n\n" + BEGIN + "\nRun 2026-12-05")
    assert text.endswith(f"{END}\n\n## Next\nkept\n") and "old" not in text
    assert json.loads((tmp_path / "runs-data" / "scale.json").read_text()) == _result()
    before = runs.read_text()
    write_docs(_result(), runs, tmp_path / "runs-data", source=src)  # again: the same text, not a second copy
    assert runs.read_text() == before
    runs.write_text("no markers\n")
    with pytest.raises(SystemExit):
        write_docs(_result(), runs, tmp_path / "runs-data")
    assert runs.read_text() == "no markers\n"


@pytest.mark.slow
def test_quick_run_measures_every_part_through_live_services(tmp_path: Path) -> None:
    need("PostgreSQL", PG_ADMIN_URL, 5432)
    if shutil.which("redis-server") is None:
        missing("redis-server is not installed")
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, "-m", "scripts.scale", "--out", str(out), "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    emb = data["embedded"]
    assert [r["chunks"] for r in emb["lookup"]] == [10**3, 10**4]
    assert all(0 < r["wall_ms"]["p50"] <= r["wall_ms"]["p99"] for r in emb["lookup"])
    # resident memory grows with the chunks held, by more than their envelopes
    assert emb["lookup"][1]["rss_bytes"] > emb["lookup"][0]["rss_bytes"]
    assert emb["lookup"][1]["bytes_per_chunk"] > 256
    assert [r["chunks"] for r in emb["clear_memory"]] == [0, 10**3, 10**4]
    assert [r["chunks"] for r in emb["clear_redis"]] == [0, 10**3]
    assert emb["clear_redis"][1]["raw_unlink_ms"] > 0
    served = data["served"]
    assert [r["chunks"] for r in served["lookup"]] == [10**3, 10**4]
    assert [r["workers"] for r in served["workers"]] == [1, 4]
    for level in served["workers"]:
        assert level["requests"] > 0 and level["errors"] == {}, level
    audit = data["audit"]
    assert audit["emitted"]["rows"] > 0 and audit["recorded_16"]["rows"] > 0 and audit["raw_batch"]["rows"] > 0
    # the Markdown on stdout is the renderer's, from the same JSON
    assert done.stdout == markdown(data)
