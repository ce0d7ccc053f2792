"""One rank of a benchmark job: ``python -m benchmarks.harness.worker JOB.json RANK``.

1) join the gloo group over 127.0.0.1 (world > 1) and build the 1-D mesh; 2) run the job's
phases, each as its planned steps ``(round, candidate)`` (rotation and rounds come from
``plan.schedule``); 3) write ``rank_<r>.json`` (records, or the error) and exit 0 or 1.

A measured call: gc + malloc_trim, device sync, ``--settle`` seconds idle, barrier (rank 0 resets the S3 server's
counters between two barriers), the call, device sync (``local``: this rank's time), a
barrier (``seconds``: barrier to barrier). Loads start from NaN targets and a cold page
cache (every rank fsyncs and drops every file of the checkpoint first) or a warm one, and
are checked against the formula after. A DCP candidate that raises is recorded and skipped
from then on (DCP variants fail on some torch builds); any other failure ends the job.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import sys
import time
import traceback

import torch

from .. import candidates, probes, states
from .calls import Call, Env
from .registry import scenario_by_name

MIB = 1 << 20


class Runner:
    """A rank's job: the state, the targets of the current phase, the records."""

    def __init__(self, env: Env, job: dict) -> None:
        self.env, self.job = env, job
        self.scenario = scenario_by_name(job["scenario"])
        st = self.scenario.state
        self.specs = states.build_specs(st.builder, job["size_mib"], replicated=st.replicated)
        self.sampler = probes.RSSSampler()
        self.records: list[dict] = []
        self.failed: dict[str, str] = {}
        self._state: states.Built | None = None
        self._check_targets: states.Built | None = None

    # ------------------------------------------------------------------ helpers
    def say(self, msg: str) -> None:
        if self.env.rank == 0:
            print(msg, flush=True)

    def barrier(self) -> None:
        if self.env.distributed:
            import torch.distributed as dist

            dist.barrier()

    def built(self, layout: str, *, values: bool) -> states.Built:
        e = self.env
        return states.build(self.specs, layout, e.world, e.rank, device=e.device, mesh=e.mesh, values=values)

    def state(self) -> states.Built:
        if self._state is None:
            t0 = time.perf_counter()
            self._state = self.built("rows", values=True)
            e = self.env
            e.sync()
            self.say(f"state: {len(self.specs)} tensors, {states.spec_bytes(self.specs) / 1e9:.3f} GB, "
                     f"{self._state.nbytes / 1e9:.3f} GB on rank 0 ({e.device}), built in "
                     f"{time.perf_counter() - t0:.1f}s")
        return self._state

    def path_of(self, name: str) -> str:
        c = candidates.get(name)
        return f"{self.job['s3_base']}/{name}" if c.storage == "s3" else os.path.join(self.job["base"], name)

    def fresh(self, path: str, *, make: bool) -> None:
        if self.env.rank == 0:
            if path.startswith("s3://"):
                from . import s3

                s3.remove(path, self.env.s3_endpoint)
            else:
                probes.remove(path)
                if make:
                    os.makedirs(path)
        self.barrier()

    # ------------------------------------------------------------------ measuring
    def measure(self, phase: str, rnd: int, cand: candidates.Candidate, call: Call, *, nbytes: int) -> dict | None:
        """Run ``cand`` once between barriers; record its times, memory and I/O; None if it failed."""
        e, s3 = self.env, cand.storage == "s3" and self.env.rank == 0
        gc.collect()
        probes.malloc_trim()
        e.sync()
        time.sleep(self.job["settle"])
        self.barrier()
        if s3:
            from . import s3 as s3srv

            s3srv.reset_stats(e.s3_endpoint)
        self.barrier()
        gc.disable()
        io0, cpu0 = probes.proc_io(), os.times()
        before = self.sampler.start()
        t0 = time.perf_counter()
        error, out = None, {}
        try:
            out = cand.run(call) or {}
            e.sync()
        except Exception as exc:
            if not cand.name.startswith("dcp"):
                raise
            error = f"{type(exc).__name__}: {exc}"
            print(f"rank {e.rank}: {phase} {cand.name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        finally:
            local = time.perf_counter() - t0
            peak = self.sampler.stop()
            io1, cpu1 = probes.proc_io(), os.times()
            gc.enable()
        self.barrier()
        wall = time.perf_counter() - t0
        rec = {"kind": "op", "phase": phase, "candidate": cand.name, "round": rnd, "rank": e.rank,
               "seconds": wall, "local": local, "bytes": nbytes, "rss_growth": peak - before,
               "rss_frac": (peak - before) / max(nbytes, 1),
               "cpu": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
               **{k: io1[k] - io0[k] for k in ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes")},
               **{k: v for k, v in out.items() if not k.startswith("_")}}
        if s3:
            from . import s3 as s3srv

            st = s3srv.stats(e.s3_endpoint)
            rec.update(server_requests=st["requests"], server_bytes=st["bytes_in"] + st["bytes_out"])
        if error:
            self.failed[cand.name] = error
            self.records.append({"kind": "error", "phase": phase, "candidate": cand.name, "round": rnd,
                                 "rank": e.rank, "error": error})
            self.say(f"[{phase}] round {rnd} {cand.name} FAILED (recorded, skipped from now on): {error[:300]}")
            return None
        self.records.append(rec)
        extra = "".join(f"  {k} {rec[k]:.3f}s" for k in ("blocked", "staged") if k in rec)
        self.say(f"[{phase}] round {rnd:>2} {cand.name:<26} {wall:8.3f}s{extra}  rank0 RSS +"
                 f"{rec['rss_growth'] / MIB:.0f} MiB" + ("  (warm-up)" if rnd <= 0 else ""))
        return rec

    # ------------------------------------------------------------------ phases
    def run(self) -> None:
        kinds = [self.scenario.phase(p["name"]).kind for p in self.job["phases"]]
        last_save = max((i for i, k in enumerate(kinds) if k == "save"), default=-1)
        for i, ph in enumerate(self.job["phases"]):
            phase = self.scenario.phase(ph["name"])
            getattr(self, f"run_{phase.kind}")(phase, ph)
            if i == last_save:  # free the saved state before the loads
                self._state = self._check_targets = None
                gc.collect()
                probes.malloc_trim()
        if "shardfmt.Stager" in self.env.cache:
            self.env.cache.pop("shardfmt.Stager").release()
        if "dcp.DefaultStager" in self.env.cache:
            self.env.cache.pop("dcp.DefaultStager").close()

    def run_save(self, phase, ph: dict) -> None:
        seen: set[str] = set()
        for rnd, name in ph["steps"]:
            if name in self.failed:
                continue
            cand = candidates.get(name)
            path = self.path_of(name)
            self.fresh(path, make=cand.makes_dir)
            b = self.state()
            rec = self.measure(phase.name, rnd, cand, Call(env=self.env, phase=phase.name, layout="rows", built=b,
                                                           path=path), nbytes=b.nbytes)
            if rec is not None and cand.check_with and name not in seen:
                self.check_saved(phase.name, cand, path)
            seen.add(name)
            self.leave_cold(path)

    def leave_cold(self, path: str) -> None:
        """Drop what a call left in the page cache, untimed, so the next call, whichever
        candidate it is, starts from the same memory state. The floors keep what they read and
        wrote; shardfmt drops it. On this project's VM, a page cache holding another
        gigabyte made the next buffered load twice as slow (benchmarks/README.md, session 24)."""
        if not path.startswith("s3://") and os.path.exists(path):
            probes.drop_cache(path)

    def check_saved(self, phase: str, cand: candidates.Candidate, path: str) -> None:
        """Load a save's output untimed into NaN targets and check them (once per candidate)."""
        if self._check_targets is None:
            self._check_targets = self.built("rows", values=False)
        t = self._check_targets
        states.fill_nan(t)
        self.barrier()
        candidates.get(cand.check_with).run(Call(env=self.env, phase=phase, layout="rows", built=t, path=path,
                                                  src=path, src_world=self.env.world))
        self.env.sync()
        states.check(t, f"{phase}: the output of {cand.name}")

    def run_load(self, phase, ph: dict) -> None:
        targets = self.built(phase.layout, values=False)
        for rnd, name in ph["steps"]:
            if name in self.failed:
                continue
            cand = candidates.get(name)
            src = self.path_of(cand.reads)
            states.fill_nan(targets)
            if not src.startswith("s3://"):
                if phase.cache == "cold":
                    probes.drop_cache(src)
                elif self.env.rank == 0:
                    probes.warm_cache(src)
            call = Call(env=self.env, phase=phase.name, layout=phase.layout, built=targets, path=src, src=src,
                        src_world=ph["src_world"][name])
            rec = self.measure(phase.name, rnd, cand, call, nbytes=targets.nbytes)
            if rec is None:
                continue
            if self._checkable(cand, phase.name):
                states.check(targets, f"{phase.name} {name} round {rnd}")
            if cand.after is not None:
                rec.update(cand.after(call))
            if phase.cache == "cold":
                self.leave_cold(src)

    def _checkable(self, cand: candidates.Candidate, phase: str) -> bool:
        """Whether the targets hold the saved values (a floor's idealised reshard plan does not)."""
        if cand.exact_check:
            return True
        _, exact = self.env.cache[("floor.plan", phase, self.path_of(cand.reads))]
        return exact

    def run_convert(self, phase, ph: dict) -> None:
        for rnd, name in ph["steps"]:
            cand = candidates.get(name)
            src, out = self.path_of(cand.reads), os.path.join(self.job["base"], f"out-{name}")
            probes.remove(out)
            probes.drop_cache(src)
            nbytes = sum(os.path.getsize(f) for f in probes.files_under(src))
            self.measure(phase.name, rnd, cand, Call(env=self.env, phase=phase.name, layout="full", built=None,
                                                     path=out, src=src), nbytes=nbytes)
            probes.remove(out)


def env_record(env: Env) -> dict:
    name = torch.cuda.get_device_name(env.device) if env.cuda else probes.cpu_name()
    return {"kind": "env", "rank": env.rank, "device": str(env.device), "device_name": name,
            "torch": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads()}


def make_env(job: dict, rank: int) -> Env:
    world = job["world"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if job["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=job["pg_timeout"]))
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return Env(rank=rank, world=world, device=device, fsync=job["fsync"], mesh=mesh,
               s3_endpoint=job.get("s3_endpoint"))


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        job = json.load(f)
    rank = int(argv[1])
    runner = None
    try:
        env = make_env(job, rank)
        runner = Runner(env, job)
        runner.records.append(env_record(env))
        runner.run()
        result = {"ok": True, "records": runner.records}
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which fails the run
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "records": runner.records if runner else []}
        print(f"rank {rank} FAILED: {traceback.format_exc()}", file=sys.stderr, flush=True)
    with open(os.path.join(job["out_dir"], f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
