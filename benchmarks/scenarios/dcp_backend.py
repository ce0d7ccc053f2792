"""DCP with shardfmt's storage backend (``shardfmt.dcp``) against DCP with its own
FileSystemWriter/Reader, 2 ranks (gloo, DTensor Shard(0)), and the floors of the same bytes."""

from benchmarks.harness.model import Phase, Scenario, StateSpec, throughput

SAVES = ("floor.write", "dcp+shardfmt.save", "dcp.save", "shardfmt.save")
LOADS = ("floor.read", "dcp+shardfmt.load", "dcp.load", "shardfmt.load")

SCENARIOS = (
    Scenario(
        name="dcp-backend",
        doc="dcp.save/dcp.load through shardfmt.dcp's Writer/Reader vs DCP's FileSystemWriter/Reader: "
            "save, same-topology load, row -> column load",
        state=StateSpec(builder="transformer", size_mib=1024),
        ranks=2,
        phases=(
            Phase(name="save", kind="save", candidates=SAVES),
            Phase(name="load", kind="load", candidates=LOADS),
            Phase(name="row->col", kind="load", layout="cols", candidates=LOADS),
        ),
        targets=(
            throughput("save", "dcp+shardfmt.save", 1.0, "dcp.save"),
            throughput("load", "dcp+shardfmt.load", 1.0, "dcp.load"),
            throughput("row->col", "dcp+shardfmt.load", 1.0, "dcp.load"),
            throughput("save", "dcp+shardfmt.save", 0.9, "floor.write"),
            throughput("load", "dcp+shardfmt.load", 0.9, "floor.read"),
        ),
    ),
)
