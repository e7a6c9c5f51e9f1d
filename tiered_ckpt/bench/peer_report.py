"""The markdown that `tiered-ckpt bench --peers` prints: per size, one row per library with seconds and
ratios to this machine's raw limits, tiered_ckpt against the best peer, the first saves of a process, and
which libraries could not be measured and why."""
from __future__ import annotations

import statistics
from typing import Any

from ..sizes import format_size
from .peer_libs import RAW

OURS = "tiered_ckpt"


def medians(size: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per library: the median over its processes of each figure (save 2 for the save figures)."""
    med = statistics.median
    out: dict[str, dict[str, Any]] = {}
    for name, runs in size["runs"].items():
        if name == RAW:
            out[name] = {k: med(r[k] for r in runs) for k in ("memcpy", "raw_write", "raw_read")}
            continue
        row: dict[str, Any] = {"library": runs[0]["library"], "fsyncs_itself": runs[0]["fsyncs_itself"]}
        for k in ("returned", "blocked", "durable"):
            row[k] = med(r["saves"][1][k] for r in runs)
        row["cold_load"] = med(r["cold_load"] for r in runs)
        if "memory_load" in runs[0]:
            row["memory_load"] = med(r["memory_load"] for r in runs)
        row["first_saves"] = [med(r["saves"][i]["blocked"] for r in runs) for i in range(len(runs[0]["saves"]))]
        if "prepare" in runs[0]:
            row["prepare"] = med(r["prepare"] for r in runs)
        out[name] = row
    return out


def _s(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


def _x(x: float | None, limit: float | None) -> str:
    return "" if x is None or not limit else f"{x / limit:.2f}"


def _library_rows(rows: dict[str, dict[str, Any]], raw: dict[str, float]) -> list[str]:
    lines = ["| library | save() returns s | blocked s | × memcpy | durable on disk s | × raw write | cold load s "
             "| × raw read | load from host memory s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    if raw:
        lines.append(f"| raw limits: memcpy / write + fsync / cold read | | {_s(raw['memcpy'])} | 1.00 | "
                     f"{_s(raw['raw_write'])} | 1.00 | {_s(raw['raw_read'])} | 1.00 | |")
    for name, r in rows.items():
        label = r["library"] + ("" if r["fsyncs_itself"] else " †")
        returns = _s(r["returned"]) if r["returned"] < r["blocked"] * 0.99 else "="
        lines.append(f"| {label} | {returns} | {_s(r['blocked'])} | {_x(r['blocked'], raw.get('memcpy'))} | "
                     f"{_s(r['durable'])} | {_x(r['durable'], raw.get('raw_write'))} | {_s(r['cold_load'])} | "
                     f"{_x(r['cold_load'], raw.get('raw_read'))} | {_s(r.get('memory_load'))} |")
    return lines


def _against_best_peer(rows: dict[str, dict[str, Any]]) -> list[str]:
    ours = rows.get(OURS)
    peers = {n: r for n, r in rows.items() if not n.startswith(OURS)}
    if not ours or not peers:
        return []
    lines = ["", f"| {OURS} / best peer | ratio | {OURS} s | best peer s |", "|---|---:|---:|---|"]
    for label, key in (("blocked", "blocked"), ("durable on disk", "durable"), ("cold load", "cold_load")):
        best = min(peers.values(), key=lambda r: r[key])
        lines.append(f"| {label} | {ours[key] / best[key]:.2f} | {_s(ours[key])} | {_s(best[key])} "
                     f"({best['library']}) |")
    return lines


def _first_saves(rows: dict[str, dict[str, Any]]) -> list[str]:
    n = max(len(r["first_saves"]) for r in rows.values())
    lines = ["", f"Blocked seconds of saves 1..{n} of a fresh process (each followed by an in-place change of every "
             "tensor and waited on until durable):", "",
             "| library | " + " | ".join(f"save {i}" for i in range(1, n + 1)) + " |",
             "|---|" + "---:|" * n]
    for r in rows.values():
        lines.append(f"| {r['library']} | " + " | ".join(_s(x) for x in r["first_saves"]) + " |")
    lines += [f"\n{r['library']}: its set-up before save 1 took {_s(r['prepare'])} s (not in the saves)"
              for r in rows.values() if "prepare" in r]
    return lines


def _problems(size: dict[str, Any]) -> list[str]:
    lines = []
    for name, p in size["problems"].items():
        what = p.get("library", name)
        if "unavailable" in p:
            lines.append(f"- {what}: {p['unavailable']}")
        elif p.get("mismatch"):
            lines.append(f"- **{what}: LOAD DID NOT REPRODUCE THE SAVED TENSORS**: {p['error']}")
        else:
            late = p.get("repetition", 1) > 1
            when = f" (repetition {p['repetition']}; the earlier ones are in the table)" if late else ""
            lines.append(f"- {what}: failed{when}: {p['error']}")
    return ["", "Not measured:", *lines] if lines else []


def report_size(size: dict[str, Any], first_saves: int) -> str:
    rows = medians(size)
    raw = rows.pop(RAW, {})
    runs = next(iter(size["runs"].values()), [{}])
    tensors = runs[0].get("tensors", "?")
    lines = [f"### {format_size(size['bytes'])} in {tensors} tensors; median of {size['repeats']} fresh "
             "process(es) per library, interleaved; save 2 of each process", ""]
    lines += _library_rows(rows, raw)
    if any(not r["fsyncs_itself"] for r in rows.values()):
        lines += ["", "† the library does not fsync: *durable on disk* includes the harness's fsync of its files and "
                  "folders after the library reported the save complete."]
    lines += _against_best_peer(rows)
    if first_saves and rows:
        lines += _first_saves(rows)
    lines += _problems(size)
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    head = (f"torch {results['torch']}, python {results['python']}, {results['cpus']} CPUs. *blocked*: until the "
            "caller may change the tensors; *durable on disk*: from the save call until durable (fsync'd); *cold "
            "load*: page cache dropped for the library's files, into the live tensors, verified bit for bit.")
    return "\n\n".join([head] + [report_size(s, results["first_saves"]) for s in results["sizes"]])
