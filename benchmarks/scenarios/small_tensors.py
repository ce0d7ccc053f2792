"""Many tiny tensors (Adam steps, norms): the per-tensor overhead of a save and a load."""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio

SCENARIOS = (Scenario(
    name="small-tensors",
    doc="2 ranks, 50,000 tensors (0-d replicated steps, (64,) Shard(0) norms): shardfmt vs DCP",
    state=StateSpec(builder="small", size_mib=50, quick_mib=2),  # thousands of tensors,
    ranks=2,
    phases=(
        Phase(name="save", kind="save", candidates=("shardfmt.save", "shardfmt.save.v1", "dcp.save")),
        Phase(name="load", kind="load", candidates=("shardfmt.load", "shardfmt.load.v1", "dcp.load")),
    ),
    targets=tuple(ratio(f"{p}: shardfmt faster than DCP", Ref(phase=p, candidate=f"shardfmt.{p}"), "<=", 1.0,
                        Ref(phase=p, candidate=f"dcp.{p}")) for p in ("save", "load")),
),)
