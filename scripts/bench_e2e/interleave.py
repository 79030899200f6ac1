"""Every system's engine up at once, their requests taken in turns (``--interleave``).

Systems run one after another drift apart with the machine: on a shared VM two engines of the
same code can prefill a fifth apart minutes later, more than any connector's cost. Here every
system's engine starts at once (engine.py in lockstep) and the runner hands out turns, one at a
time: a turn is one request (a miss, a hit, a capless pair's side) and the steps after it (the
settle after a miss, the flush after a hit), so a store ends within its own turn. Turns go block
by block (the warm-ups, each length and repetition, the multi-tenant rounds), and within a block
the engines take one turn each in an order that rotates, so every system's miss and hit of a
prompt run within a minute or two of the others'. Between turns the runner waits ``gap_s``, for
the engine that just ran to go idle (vLLM's processes poll for about a second after a message),
and it records the CPU time the engines not in their turn used meanwhile (``others_cpu_s``), the
check that a turn had the machine to itself.

The engines share the host's memory: each keeps its KV cache space (``Config.kv_cache_gb``) for
the whole run."""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.bench_e2e.engine import turns as plan_turns
from scripts.bench_e2e.systems import System, group_pids, start_process, stop_process

__all__ = ["Engine", "block_of", "order", "run"]

TICK = os.sysconf("SC_CLK_TCK")


def block_of(turn: list[dict[str, Any]]) -> str:
    """The block a turn belongs to: its request's length and repetition, or its kind."""
    gens = [s for s in turn if s["op"] == "gen"]
    tag = (gens[0]["reqs"][0].get("tag") or {}) if gens else {}
    if "length" in tag and "i" in tag:
        return f"{tag['length']}/{tag['i']}"
    return str(tag.get("kind", "other"))


def order(blocks: dict[str, list[int]], names: list[str]) -> list[tuple[str, int]]:
    """The turns' order: ``blocks`` maps each engine (of ``names``) to its turns' block indices
    (non-decreasing). Block by block; within one, rounds of one turn per engine that has one
    left, the first engine of a round rotating with the block and the round. Gives (engine,
    turn index) pairs."""
    out: list[tuple[str, int]] = []
    at = dict.fromkeys(names, 0)
    every = sorted({b for idx in blocks.values() for b in idx})
    for n_block, b in enumerate(every):
        r = 0
        while True:
            ready = [n for n in names if at[n] < len(blocks[n]) and blocks[n][at[n]] == b]
            if not ready:
                break
            k = (n_block + r) % len(names)
            for name in names[k:] + names[:k]:
                if name in ready:
                    out.append((name, at[name]))
                    at[name] += 1
            r += 1
    return out


@dataclass
class Engine:
    key: str
    system: System
    work: Path
    turns: list[list[dict[str, Any]]]
    proc: Any = None
    cmd: int = -1  # the runner's end of the engine's command pipe
    reply: int = -1  # and of its reply pipe
    failed: str = ""
    pending: bytearray = field(default_factory=bytearray)

    def pgids(self) -> list[int]:
        """This system's process groups: its engine's and its servers' (``kvgate serve``)."""
        return [p.pid for p in ([self.proc] if self.proc is not None else []) + list(self.system.procs)]


def _cpu_s(pgids: list[int]) -> float:
    """CPU seconds (user + system) of every live process in these process groups."""
    total = 0
    for pid in group_pids(set(pgids)):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (after the name)
    return total / TICK


def _line(engine: Engine, timeout_s: float) -> str:
    """The engine's next reply line; "" where it exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in engine.pending:
        if engine.proc.poll() is not None or time.monotonic() > deadline:
            return ""
        ready, _, _ = select.select([engine.reply], [], [], 1.0)
        if ready:
            chunk = os.read(engine.reply, 4096)
            if not chunk:
                return ""
            engine.pending += chunk
    line, _, rest = bytes(engine.pending).partition(b"\n")
    engine.pending = bytearray(rest)
    return line.decode()


def _start(engine: Engine, plan: dict[str, Any], env: dict[str, str], python: str) -> None:
    engine.work.mkdir(parents=True, exist_ok=True)
    (engine.work / "plan.json").write_text(json.dumps(plan))
    r_cmd, w_cmd = os.pipe()
    r_rep, w_rep = os.pipe()
    env = {**env, "KVGATE_E2E_LOCKSTEP": f"{r_cmd},{w_rep}"}
    cmd = [python, "-m", "scripts.bench_e2e.engine", str(engine.work / "plan.json"), str(engine.work / "results.jsonl")]
    try:
        engine.proc = start_process(cmd, env, engine.work / "engine.log", pass_fds=(r_cmd, w_rep))
    finally:
        os.close(r_cmd)
        os.close(w_rep)
    engine.cmd, engine.reply = w_cmd, r_rep


def _fail(engine: Engine, why: str) -> None:
    log = engine.work / "engine.log"
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    engine.failed = f"{why}; log {log}:\n{tail}"
    if engine.proc is not None:
        stop_process(engine.proc)  # its memory and any CPU it still uses go back to the others
    print(f"[bench-e2e] {engine.key}: FAILED: {why}", flush=True)


def run(
    opened: list[tuple[str, System, dict[str, Any], dict[str, str]]], work: Path, timeout_s: float, gap_s: float,
) -> tuple[dict[str, dict[str, Any]], dict[str, str], dict[str, Any]]:
    """Run each ``(key, system, plan, env)`` (its engine's plan and environment, the system open)
    in lockstep. Gives each system's rows, trace, wall time and load averages (as
    ``run.run_system`` does), the failures, and the interleaving's own record (the turns' order,
    the idle engines' CPU during each)."""
    engines = {key: Engine(key, system, work / key, plan_turns(plan["steps"])) for key, system, plan, _ in opened}
    names = list(engines)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    try:
        for key, system, plan, env in opened:
            _start(engines[key], plan, env, system.python)
        for e in engines.values():
            if _line(e, timeout_s) != "ready":
                _fail(e, "the engine did not come up")
        blocks: dict[str, list[int]] = {}
        index: dict[str, int] = {}
        for name, e in engines.items():
            blocks[name] = [index.setdefault(block_of(t), len(index)) for t in e.turns]
        record: list[dict[str, Any]] = []
        for name, k in order(blocks, names):
            e = engines[name]
            if e.failed:
                continue
            time.sleep(gap_s)
            others = [p for o in engines.values() if o is not e and not o.failed for p in o.pgids()]
            before, t = _cpu_s(others), time.monotonic()
            os.write(e.cmd, b"go\n")
            if _line(e, timeout_s) != "done":
                _fail(e, f"turn {k} ({block_of(e.turns[k])}) did not end")
                continue
            gens = [s["name"] for s in e.turns[k] if s["op"] == "gen"]
            record.append({"system": name, "turn": gens[0] if gens else "", "block": block_of(e.turns[k]),
                           "s": round(time.monotonic() - t, 3), "others_cpu_s": round(_cpu_s(others) - before, 3)})
    finally:
        for e in engines.values():
            if e.cmd >= 0:
                os.close(e.cmd)  # each engine's last read ends: it exits
        for e in engines.values():
            if e.proc is not None:
                try:
                    e.proc.wait(120)
                except subprocess.TimeoutExpired:  # stopped below either way
                    pass
                stop_process(e.proc)
            if e.reply >= 0:
                os.close(e.reply)
    wall = round(time.monotonic() - t0, 1)
    out: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for name, e in engines.items():
        if e.failed:
            failed[name] = e.failed[-2000:]
            continue
        rows_path = e.work / "results.jsonl"
        rows = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
        tr = e.system.trace
        trace = [json.loads(x) for x in tr.read_text().splitlines()] if tr and tr.exists() else []
        out[name] = {"rows": rows, "trace": [x for x in trace if x["event"] in ("load", "store")], "wall_s": wall,
                     "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()]}
    idle = [r["others_cpu_s"] for r in record]
    meta = {"gap_s": gap_s, "turns": len(record), "wall_s": wall,
            "others_cpu_s": {"median": round(statistics.median(idle), 3) if idle else None,
                             "max": max(idle) if idle else None,
                             "per_s_median": round(statistics.median([r["others_cpu_s"] / r["s"] for r in record if r["s"] > 0]), 4)
                             if record else None},
            "record": record}
    return out, failed, meta
