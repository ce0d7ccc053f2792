"""Resharded loads of a 2-rank save: 2 -> 1 process (full tensors) and dim-0 2 -> 4 ranks."""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio, throughput

LOADS = ("floor.read", "shardfmt.load", "dcp.load")

SCENARIOS = (Scenario(
    name="reshard",
    doc="a 2-rank save (untimed) loaded on 1 process and on 4 ranks: shardfmt vs DCP vs the floors",
    state=StateSpec(builder="transformer", size_mib=1536),
    ranks=2,
    phases=(
        Phase(name="source", kind="save", timed=False, candidates=("floor.write", "shardfmt.save", "dcp.save")),
        Phase(name="2->1", kind="load", world=1, layout="full", candidates=LOADS),
        Phase(name="2->4", kind="load", world=4, candidates=LOADS),
    ),
    targets=(
        throughput("2->1", "shardfmt.load", 0.9, "floor.read"),
        throughput("2->4", "shardfmt.load", 0.9, "floor.read"),
        *[ratio(f"{p}: shardfmt's time <= 0.6x DCP's", Ref(phase=p, candidate="shardfmt.load"), "<=", 0.6,
                Ref(phase=p, candidate="dcp.load")) for p in ("2->1", "2->4")],
        ratio("2->4: shardfmt reads <= 1.1x the bytes its targets need, rounded out to whole hash chunks",
              Ref(phase="2->4", candidate="shardfmt.load", metric="bytes_read"), "<=", 1.1,
              Ref(phase="2->4", candidate="shardfmt.load", metric="needed_chunks")),
    ),
),)
