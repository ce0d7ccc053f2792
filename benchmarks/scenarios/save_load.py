"""One process: shardfmt against torch.save, safetensors and the raw I/O floors."""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio, throughput

SCENARIOS = (Scenario(
    name="save-load",
    doc="1 process: shardfmt save/load vs torch.save, safetensors and the floors; cold and warm loads",
    state=StateSpec(builder="transformer", size_mib=1024, quick_mib=16),
    ranks=1,
    phases=(
        Phase(name="save", kind="save",
              candidates=("floor.write", "raw.write", "shardfmt.save", "shardfmt.save.v1", "torch.save", "safetensors.save")),
        Phase(name="load", kind="load",
              candidates=("floor.read", "raw.read", "shardfmt.load", "shardfmt.load.v1", "torch.load", "safetensors.load")),
        Phase(name="warm", kind="load", cache="warm", candidates=("floor.read", "shardfmt.load")),
    ),
    targets=(
        throughput("save", "shardfmt.save", 0.9, "floor.write"),
        throughput("load", "shardfmt.load", 0.9, "floor.read"),
        throughput("warm", "shardfmt.load", 0.9, "floor.read"),
        ratio("save: shardfmt's peak RSS growth <= 10% of the state",
              Ref(phase="save", candidate="shardfmt.save", metric="rss_frac"), "<=", 0.10),
    ),
),)
