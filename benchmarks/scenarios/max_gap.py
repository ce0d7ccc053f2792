"""The local read path's ``max_gap`` (16 KiB): loads with it against 0 and 1 MiB, and the floor.

A verified read merges two wanted spans of a file when the gap between them is at most
``max_gap`` (whole hash chunks are read either way): a large gap reads bytes nobody needs, a
small one issues more requests. Same-topology loads (one span a shard) show the requests'
cost alone; row -> column and 2 -> 4 loads cut shards into many spans.
"""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio

LOADS = ("floor.read", "shardfmt.load", "shardfmt.load@gap=0", "shardfmt.load@gap=1MiB")

SCENARIOS = (Scenario(
    name="max-gap",
    doc="2 ranks: same-topology, row -> column and 2 -> 4 loads at max_gap 16 KiB (the local default), 0 and 1 MiB",
    state=StateSpec(builder="transformer", size_mib=1536),
    ranks=2,
    phases=(
        Phase(name="source", kind="save", timed=False, candidates=("floor.write", "shardfmt.save")),
        Phase(name="load", kind="load", candidates=LOADS),
        Phase(name="row->col", kind="load", layout="cols", candidates=LOADS),
        Phase(name="2->4", kind="load", world=4, candidates=LOADS),
    ),
    targets=tuple(
        ratio(f"{p}: max_gap 16 KiB's time <= 1 MiB's", Ref(phase=p, candidate="shardfmt.load"), "<=", 1.0,
              Ref(phase=p, candidate="shardfmt.load@gap=1MiB")) for p in ("load", "row->col", "2->4")),
),)
