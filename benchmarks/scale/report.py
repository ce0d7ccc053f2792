"""The markdown tables of a scale run: one row per (layout, N, format), then every phase."""

from __future__ import annotations

MB = 1e6


def _stat(s: dict | None, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    if not s:
        return "–"
    med = fmt.format(s["median"] / scale)
    if s["min"] == s["max"]:
        return med
    return f"{med} [{fmt.format(s['min'] / scale)}–{fmt.format(s['max'] / scale)}]"


def _side(rec: dict, side: str, key: str, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    got = rec.get(side) or {}
    if "skipped" in got:
        proj = got.get("projected_cpu_s" if "cpu" in key else "projected_peak_mib")
        return "skipped" + (f" (proj. {fmt.format(proj / scale)})" if proj else "")
    if "summary" not in got:
        return "–"
    if not got["summary"]:
        return "failed"
    return _stat(got["summary"].get(key), fmt, scale)


def _bytes(n) -> str:
    if n is None:
        return "–"
    return f"{n / MB:.1f} MB" if n >= 0.1 * MB else f"{n / 1e3:.1f} kB"


def _reads(rec: dict) -> str:
    f = ((rec.get("load_side") or {}).get("summary") or {}).get("facts")
    if not f:
        return "–"
    ver = f.get("read_verified_bytes")
    return f"{_bytes(ver) if ver is not None else 'n/a'} / {_bytes(f.get('read_unverified_bytes'))} / " \
           f"{_bytes(f.get('needed_bytes'))}"


def _meta_read(rec: dict) -> str:
    f = ((rec.get("load_side") or {}).get("summary") or {}).get("facts")
    return _bytes(f.get("metadata_read_bytes")) if f else "–"


def _meta_bytes(rec: dict) -> str:
    prep = rec.get("prepare") or {}
    if "skipped" in prep:
        return "skipped"
    facts = (prep.get("runs") or [{}])[0].get("facts") or {}
    return _bytes(facts.get("metadata_bytes"))


HEAD = ("| layout | N | format | metadata | load CPU s | load peak RSS MiB | metadata read | read: verified / "
        "unverified / needed | other rank's save CPU s | its peak MiB | commit CPU s | coordinator's save CPU s "
        "| its peak MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def render(doc: dict) -> str:
    lines = [f"Scale simulation, {doc['started'][:16]} UTC, commit {doc['commit']}, repeat {doc['repeat']}, "
             f"budget {doc['budget_s']:.0f} s (prepare {doc['prepare_budget_s']:.0f} s); CPU seconds and peak RSS "
             "above the import baseline, median [min–max] over fresh processes.", "", HEAD]
    skipped = []
    for rec in doc["results"]:
        if "skipped" in rec:
            skipped.append(f"- {rec['layout']} N={rec['n']} {rec['adapter']}: {rec['skipped']}")
            continue
        lines.append(" | ".join([
            f"| {rec['layout']}", str(rec["n"]), rec["adapter"], _meta_bytes(rec),
            _side(rec, "load_side", "headline_cpu_s"), _side(rec, "load_side", "peak_mib", "{:.0f}"),
            _meta_read(rec), _reads(rec),
            _side(rec, "save_other", "headline_cpu_s"), _side(rec, "save_other", "peak_mib", "{:.0f}"),
            _side(rec, "save_commit", "headline_cpu_s"), _side(rec, "save_commit", "side_cpu_s"),
            _side(rec, "save_commit", "peak_mib", "{:.0f}") + " |"]))
        for side in ("prepare", "load_side", "save_other", "save_commit"):
            got = rec.get(side) or {}
            if "skipped" in got and side != "prepare":
                skipped.append(f"- {rec['layout']} N={rec['n']} {rec['adapter']} {side}: {got['skipped']}")
            elif side == "prepare" and "skipped" in got:
                skipped.append(f"- {rec['layout']} N={rec['n']} {rec['adapter']}: inputs not built: {got['skipped']}")
    if skipped:
        lines += ["", "Skipped:", *skipped]
    lines += ["", "Phases (CPU s, median [min–max]):", "",
              "| layout | N | format | side | phase | CPU s |", "|---|---|---|---|---|---|"]
    for rec in doc["results"]:
        for side in ("load_side", "save_other", "save_commit"):
            summ = (rec.get(side) or {}).get("summary") or {}
            for name, st in (summ.get("phases") or {}).items():
                lines.append(f"| {rec['layout']} | {rec['n']} | {rec['adapter']} | {side} | {name} | {_stat(st)} |")
    return "\n".join(lines) + "\n"
