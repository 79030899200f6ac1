"""bench-e2e's published-prefix workload (scripts/bench_e2e/published.py) without an engine: its
command line, its plan of steps, and its figures and table from rows made up here (the engine
run itself is ``make bench-e2e E2E_ARGS="--quick --published-only"``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scripts.bench_e2e import published
from scripts.bench_e2e.run import Config, parse


def _row(kind: str, tenant: str, q: int, prompt: int, cached: int, ttft: float, wall: float, tokens: list[int]) -> dict[str, Any]:
    return {"tag": {"kind": kind, "tenant": tenant, "q": q}, "prompt_tokens": prompt, "cached": cached,
            "ttft_s": ttft, "batch_wall_s": wall, "tokens": tokens}


def _raw() -> dict[str, Any]:
    cfg = published.PubConfig(tenants=2, prefix_tokens=600, questions=2, question_tokens=40)
    p = 640

    def run(key: str, first: int, later: int, cross: int, ttft: float, wall: float, out: int) -> dict[str, Any]:
        rows = [_row("prefix", "", 0, 600, 0, 9.0, 9.0, [0])]
        for q in range(2):
            rows += [_row("pub", t, q, p, first if q == 0 else later, ttft, wall, [out, q]) for t in ("tenant00", "tenant01")]
        rows += [_row(kind, t, 0, 1112, cached, ttft, wall, [out]) for t in ("tenant00", "tenant01")
                 for kind, cached in (("private", 512), ("cross", cross), ("own", 1088))]
        return {"label": published.LABELS[key], "rows": rows, "publication": {}}

    runs = {"isolation": run("isolation", 0, 608, 512, 2.0, 4.0, 5),  # its own copy of the system prompt only
            "published": run("published", 512, 608, 512, 0.5, 1.0, 5),  # the published 512 (two chunks of 256)
            "example": run("example", 0, 0, 1088, 2.0, 4.0, 6)}  # a neighbour's whole prompt, outputs differ
    return {"config": published.asdict(cfg), "engine": {}, "runs": runs, "failed": {"x": "boom | here"}, "not_run": {}}


def test_published_workload_figures_and_cross_tenant_hits() -> None:
    res = published.analyze(_raw(), chunk_tokens=256)
    by = {r["system"]: r for r in res["rows"]}
    assert res["shared_tokens"] == 512
    assert by["isolation"]["prefill_tokens"] == 4 * 640 - 2 * 608
    assert by["published"]["prefill_tokens"] == 4 * 640 - 2 * 512 - 2 * 608
    assert by["isolation"]["req_per_s"] == pytest.approx(4 / 8.0) and by["published"]["req_per_s"] == pytest.approx(4 / 2.0)
    assert by["published"]["first_request_cached"] == {"min": 512, "max": 512}
    # the published prefix on a neighbour's prompt is no cross-tenant hit; anything beyond it is
    assert by["published"]["cross_tenant"] == {"requests": 2, "hits": 0, "private_tokens": 0, "cached_median": 512,
                                               "own_cached_median": 1088}
    assert by["isolation"]["cross_tenant"]["hits"] == 0 and by["isolation"]["cross_tenant"]["own_cached_median"] == 1088
    assert by["example"]["cross_tenant"] == {"requests": 2, "hits": 2, "private_tokens": 2 * 1088, "cached_median": 1088,
                                             "own_cached_median": 1088}
    assert by["published"]["identical_to_isolation"] == "4/4" and by["example"]["identical_to_isolation"] == "0/4"
    assert res["targets"]["prefill_isolation_over_published"] == pytest.approx(round(1344 / 320, 2))
    assert res["targets"]["req_per_s_published_over_example"] == pytest.approx(4.0)
    md = published.markdown(res)
    assert "| kvgate, published prefix | 500 | 500 | 320 |" in md
    assert "| ExampleConnector (shares everything) |" in md and "2/2 / 2,176 (1,088)" in md
    assert "failed: boom \\| here" in md  # a failed row keeps a row, its reason escaped


def test_published_docs_section_is_replaced_not_repeated(tmp_path: Path) -> None:
    doc = tmp_path / "e2e.md"
    doc.write_text("# End-to-end\n\nthe TTFT tables\n")
    published.write_docs(None, doc)
    first = doc.read_text()
    assert first.startswith("# End-to-end\n\nthe TTFT tables\n") and "No figures here" in first
    res = published.analyze(_raw(), chunk_tokens=256)
    published.write_docs(res, doc, json_path=tmp_path / "e2e-published.json")
    text = doc.read_text()
    assert text.count(published.BEGIN) == 1 and "No figures here" not in text and "| kvgate, published prefix |" in text
    assert (tmp_path / "e2e-published.json").exists()


def test_published_command_line_and_steps() -> None:
    cfg, a = parse(["--quick", "--published-only", "--pub-tenants", "3"])
    assert cfg.systems == [] and a.json.name == "e2e-published.json"
    assert a.pub.tenants == 3 and a.pub.prefix_tokens == published.QUICK["prefix_tokens"]
    cfg, a = parse(["--quick"])
    assert a.pub is None and cfg.systems and a.json.name == "e2e.json"
    with pytest.raises(SystemExit):
        parse(["--published", "--pub-systems", "isolation,nobody"])
    pub = published.PubConfig(tenants=3, prefix_tokens=512, questions=2, question_tokens=32)
    salt = {t: f"salt-{t}" for t in pub.names}
    plan = published.steps(pub, Config(), "published", salt)
    gens = [s for s in plan if s["op"] == "gen"]
    prefix = gens[1]["reqs"][0]
    assert prefix["cap"] == published.WARM and prefix["parts"] == [[512, published.PREFIX_SEED]]
    rounds = [g for g in gens if g["reqs"][0]["tag"]["kind"] == "pub"]
    assert len(rounds) == 2 and all(len(g["reqs"]) == 3 for g in rounds)
    assert all(r["parts"][0] == [512, published.PREFIX_SEED] and r["cap"] == r["tag"]["tenant"] for g in rounds for r in g["reqs"])
    private, cross, own = (next(g["reqs"] for g in gens if g["reqs"][0]["tag"]["kind"] == k) for k in ("private", "cross", "own"))
    assert [r["tag"]["owner"] for r in cross] == ["tenant01", "tenant02", "tenant00"]
    assert cross[0]["parts"] == private[1]["parts"] and own[0]["parts"] == private[0]["parts"]  # tenant00: tenant01's, its own
    assert private[0]["parts"][0] == [512, published.PREFIX_SEED] and private[0]["parts"][1][0] == pub.private_tokens
    assert private[0]["parts"] != private[1]["parts"]
    assert plan[plan.index(gens[-3]) + 1] == {"op": "settle"}  # the private prompts are stored before the neighbours ask
    example = published.steps(pub, Config(), "example", salt)
    assert all(r["cap"] is None for s in example if s["op"] == "gen" for r in s["reqs"])
