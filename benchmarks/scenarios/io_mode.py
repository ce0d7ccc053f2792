"""Direct against buffered I/O (issue 22): saves and loads of one state, each way and by default."""

from benchmarks.harness.model import Phase, Scenario, StateSpec, throughput

SAVES = ("floor.write", "shardfmt.save", "shardfmt.save@direct", "shardfmt.save@buffered")
LOADS = ("floor.read", "floor.read@hinted", "floor.read@direct", "shardfmt.load", "shardfmt.load@direct", "shardfmt.load@buffered")
LOAD_PHASES = (("load", None, "rows"), ("2->1", 1, "full"), ("2->4", 4, "rows"))

SCENARIOS = (Scenario(
    name="io-mode",
    doc="2 ranks: save, and same-topology, 2 -> 1 and dim-0 2 -> 4 loads, each with shardfmt's default "
        "I/O, forced around the page cache (direct) and forced through it (buffered), vs the floors",
    state=StateSpec(builder="transformer", size_mib=1024),
    ranks=2,
    phases=(
        Phase(name="save", kind="save", candidates=SAVES),
        *[Phase(name=name, kind="load", world=world, layout=layout, candidates=LOADS)
          for name, world, layout in LOAD_PHASES],
    ),
    targets=(
        throughput("save", "shardfmt.save", 0.9, "floor.write"),
        *[throughput(name, "shardfmt.load", 0.9, "floor.read") for name, _, _ in LOAD_PHASES],
    ),
),)

TUNING = ("floor.read", "shardfmt.load@direct", "shardfmt.load@direct/w2", "shardfmt.load@direct/w8",
          "shardfmt.load@buffered", "shardfmt.load@buffered/w1", "shardfmt.load@buffered/w2")

SCENARIOS += (Scenario(
    name="io-tuning",
    doc="2 ranks: same-topology and dim-0 2 -> 4 loads, direct and buffered reads with 1 to 8 reading threads a rank",
    state=StateSpec(builder="transformer", size_mib=1024),
    ranks=2,
    phases=(
        Phase(name="source", kind="save", timed=False, candidates=("floor.write", "shardfmt.save")),
        Phase(name="load", kind="load", candidates=TUNING),
        Phase(name="2->4", kind="load", world=4, candidates=TUNING),
    ),
    targets=(),
),)
