"""The end-to-end benchmark's analysis and tables (scripts/bench_e2e), on rows made up here: the
engines themselves run only under ``make bench-e2e``."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench_e2e.analyze import analyze, quantile
from scripts.bench_e2e.report import BEGIN, END, _readme, markdown


def _row(kind: str, length: int, i: int, ttft_s: float, tokens: list[int], cached: int = 0, **tag: object) -> dict:
    return {"name": kind, "tag": {"kind": kind, "length": length, "i": i, **tag}, "tokens": tokens,
            "prompt_tokens": length, "cached": cached, "kv": None, "batch_wall_s": ttft_s + 0.1, "ttft_s": ttft_s,
            "first_token_ts": 10.0, "last_token_ts": 10.7, "generated": 8}


def _raw() -> dict:
    cfg = {"lengths": [1024], "chunk_tokens": 256, "reps": 3, "out_tokens": 8, "tenants": 1, "context": 1024,
           "questions": 1, "question_tokens": 64}
    none = [_row("base", 1024, i, 2.0 + i, [i, 1]) for i in range(3)]
    emb = [_row("miss", 1024, i, 2.2, [i, 1]) for i in range(3)] + [
        _row("hit", 1024, 0, 0.5, [0, 1], 768), _row("hit", 1024, 1, 0.4, [1, 1], 768),
        _row("hit", 1024, 2, 0.6, [9, 9], 768),  # a wrong answer: counted, not hidden
        _row("b_on_a", 1024, 0, 2.3, [0, 1]),
    ]
    trace = [{"event": "load", "loaded_tokens": 768, "ms": 10.0}, {"event": "store", "tokens": 768, "ms": 20.0}]
    model = {"kv_bytes_per_token": 49152, "params": 1, "hidden": 64, "heads": 2, "layers": 2, "kv_heads": 2}
    return {"meta": {"config": cfg, "engine": {"dtype": "float32", "block_size": 32}, "model": model},
            "runs": {"none": {"label": "no connector", "rows": none, "trace": []},
                     "kvgate-embedded": {"label": "kvgate embedded", "rows": emb, "trace": trace}}}


def test_quantile_interpolates_like_numpy():
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert quantile([7.0], 0.9) == 7.0


def test_analysis_speedup_identity_load_rate_and_isolation():
    res = analyze(_raw())
    hit = next(r for r in res["ttft"] if r["kind"] == "hit")
    assert hit["ttft_ms"]["median"] == 500.0 and hit["speedup_vs_none"] == 6.0  # 3000 ms / 500 ms
    assert hit["identical_to_none"] == "2/3"
    assert hit["load_gbps"] == pytest.approx(768 * 49152 / 0.010 / 1e9, abs=0.01)  # 3.77 GB/s
    iso = res["isolation"][0]
    assert iso["b_on_a_cached"] == 0 and iso["a_on_a_cached"] == 768 and iso["b_speedup_vs_own_miss"] < 1
    assert "| kvgate embedded hit | 1K | 500 |" in markdown(res)


def test_readme_table_goes_between_the_markers_only(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{BEGIN}\nold table\n{END}\nafter\n")
    _readme("new table\n", readme)
    assert readme.read_text() == f"before\n{BEGIN}\nnew table\n{END}\nafter\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit):
        _readme("x\n", readme)
