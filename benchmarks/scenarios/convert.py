"""Offline tools: reshard convert and export-hf against copying the same files, and the DCP route."""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio, throughput

MIB = 1 << 20
TOOLS = ("convert@1024", "convert@256", "export-hf@256")

SCENARIOS = (Scenario(
    name="convert",
    doc="a Llama-shaped pp=2 x tp=2 checkpoint: convert to tp=4 and export-hf (budgets in MiB) vs copying its "
        "files (plain, overlapped, hashed) and DCP's dcp_to_torch_save route; one fresh process each",
    state=StateSpec(builder="llama", size_mib=2048, quick_mib=64),
    ranks=1,
    phases=(
        Phase(name="source", kind="save", timed=False, candidates=("shardfmt.save(pp=2,tp=2)", "dcp.save")),
        Phase(name="convert", kind="convert", fresh_process=True,
              candidates=("copy", "copy||", "copy+hash", *TOOLS, "dcp->hf")),
    ),
    targets=(
        *[throughput("convert", t, 0.7, floor) for t in TOOLS[:2] for floor in ("copy", "copy||")],
        *[ratio(f"convert: {t}'s peak RSS growth <= its budget + 32 MiB",
                Ref(phase="convert", candidate=t, metric="rss_growth"), "<=", 1.0,
                (int(t.split("@")[1]) + 32) * MIB) for t in TOOLS],
        ratio("convert: export-hf@256 faster than the DCP route", Ref(phase="convert", candidate="export-hf@256"),
              "<=", 1.0, Ref(phase="convert", candidate="dcp->hf")),
        ratio("convert: export-hf@256's RSS growth < half the DCP route's",
              Ref(phase="convert", candidate="export-hf@256", metric="rss_growth"), "<=", 0.5,
              Ref(phase="convert", candidate="dcp->hf", metric="rss_growth")),
    ),
),)
