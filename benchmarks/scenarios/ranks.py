"""2 and 4 ranks (gloo, DTensor Shard(0)): shardfmt against DCP and the floors."""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio, throughput

METHODS = ("floor.write", "shardfmt.save", "shardfmt.save.v1", "dcp.save")
LOADS = ("floor.read", "shardfmt.load", "shardfmt.load.v1", "dcp.load")


def vs_dcp(ranks: int) -> Scenario:
    return Scenario(
        name=f"ranks-{ranks}",
        doc=f"{ranks} ranks: save, same-topology load and row -> column load, shardfmt vs DCP vs the floors",
        state=StateSpec(builder="transformer", size_mib=1536),
        ranks=ranks,
        phases=(
            Phase(name="save", kind="save", candidates=METHODS),
            Phase(name="load", kind="load", candidates=LOADS),
            Phase(name="row->col", kind="load", layout="cols", candidates=LOADS),
        ),
        targets=(
            throughput("save", "shardfmt.save", 0.9, "floor.write"),
            throughput("save", "shardfmt.save", 1.5, "dcp.save"),
            throughput("load", "shardfmt.load", 0.9, "floor.read"),
            ratio("row->col: shardfmt's time <= 0.6x DCP's", Ref(phase="row->col", candidate="shardfmt.load"),
                  "<=", 0.6, Ref(phase="row->col", candidate="dcp.load")),
            *[ratio(f"{p}: shardfmt's peak RSS growth <= 10% of the rank's share",
                    Ref(phase=p, candidate=c, metric="rss_frac"), "<=", 0.10)
              for p, c in (("save", "shardfmt.save"), ("load", "shardfmt.load"), ("row->col", "shardfmt.load"))],
        ),
    )


SCENARIOS = (vs_dcp(2), vs_dcp(4))
