"""Helpers the benchmark scripts share: memory, page cache, raw I/O floors and process launch.

Everything here measures or prepares; nothing imports shardfmt. The scripts import it as
``common`` (``python benchmarks/<script>.py`` puts benchmarks/ on ``sys.path``).

* Memory: ``RSSSampler`` (VmRSS from /proc/self/statm in a thread, peak while armed) and
  ``malloc_trim`` (hand freed heap back to the OS so the next baseline is honest).
* Page cache: ``drop_cache`` (fsync + POSIX_FADV_DONTNEED on every file under a path: the
  next read is cold) and ``cached_fraction`` (mincore: how much of it is still resident).
* I/O floors: ``write_pieces`` / ``read_pieces`` move a tensor's bytes with plain
  os.write / os.preadv in 8 MiB pieces, optionally hashing every 1 MiB chunk with xxh3-128.
* Processes: ``free_port`` and ``launch``, which runs ``script --worker JOB RANK WORLD PORT
  ARGS_JSON`` once per rank and collects every rank's ``rank_<r>.json`` result.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

PIECE = 8 << 20  # bytes per os.write / os.preadv call of the floors
CHUNK = 1 << 20  # bytes per hashed chunk (shardfmt's default chunk size)
MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # measure this checkout, as the workers do (PYTHONPATH=ROOT), whatever is installed
    sys.path.insert(0, ROOT)

# ----------------------------------------------------------------------------- memory

_libc = ctypes.CDLL(None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def malloc_trim() -> None:
    """Return freed heap memory to the OS (glibc); a no-op elsewhere."""
    try:
        _libc.malloc_trim(0)
    except AttributeError:
        pass


class RSSSampler:
    """Background thread: VmRSS from /proc/self/statm every ``interval`` seconds, while armed.

    1) ``before = start()`` arms it; 2) the measured call runs; 3) ``peak = stop()``;
    4) ``close()`` once at the end.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._peak = 0
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._t.start()
        self.samples = 0

    def rss(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._armed.wait(0.05):
                continue
            r = self.rss()
            if r > self._peak:
                self._peak = r
            self.samples += 1
            time.sleep(self.interval)

    def start(self) -> int:
        before = self.rss()
        self._peak = before
        self.samples = 0
        self._armed.set()
        return before

    def stop(self) -> int:
        self._armed.clear()
        return max(self._peak, self.rss())

    def close(self) -> None:
        self._stop.set()
        self._armed.set()
        self._t.join()
        os.close(self._fd)


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (rchar, read_bytes, ...)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


# ----------------------------------------------------------------------------- files and page cache


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in names)
    return sorted(out)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """fsync then POSIX_FADV_DONTNEED every file under ``path`` (drops it from the page cache)."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(path: str) -> float:
    """Fraction of the bytes under ``path`` resident in the page cache (mincore); 0.0 when empty."""
    total = resident = 0
    for f in files_under(path):
        size = os.path.getsize(f)
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                pages = (size + _PAGE - 1) // _PAGE
                vec = ctypes.create_string_buffer(pages)
                if _libc.mincore(addr, size, vec) != 0:
                    return float("nan")
                resident += sum(b & 1 for b in vec.raw) * _PAGE
                total += pages * _PAGE
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts), or '?'."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


# ----------------------------------------------------------------------------- raw I/O floors


def hash_chunks(mv: memoryview, chunk: int = CHUNK) -> None:
    """xxh3-128 of every ``chunk`` bytes of ``mv`` (what a verifying writer or reader must do)."""
    import xxhash

    for pos in range(0, len(mv), chunk):
        xxhash.xxh3_128(mv[pos: pos + chunk]).digest()


def write_pieces(fd: int, mv: memoryview, *, hashed: bool) -> None:
    """os.write all of ``mv`` in PIECE-sized pieces (hashing each piece's chunks first if asked)."""
    for pos in range(0, len(mv), PIECE):
        piece = mv[pos: pos + PIECE]
        if hashed:
            hash_chunks(piece)
        done = 0
        while done < len(piece):
            done += os.write(fd, piece[done:])


def read_pieces(fd: int, dst: memoryview, src_offset: int, *, hashed: bool, path: str = "?") -> None:
    """os.preadv ``len(dst)`` bytes from ``src_offset`` into ``dst`` in PIECE-sized pieces (hashing each)."""
    for pos in range(0, len(dst), PIECE):
        piece = dst[pos: pos + PIECE]
        got = 0
        while got < len(piece):
            n = os.preadv(fd, [piece[got:]], src_offset + pos + got)
            if n == 0:
                raise EOFError(f"{path}: short read at {src_offset + pos + got}")
            got += n
        if hashed:
            hash_chunks(piece)


# ----------------------------------------------------------------------------- processes


def rotate(names, k: int) -> list:
    """``names`` rotated left by ``k``: round k starts with a different method."""
    names = list(names)
    k %= len(names)
    return names[k:] + names[:k]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, job: str, world: int, args: dict, out_dir: str, timeout: float) -> list[dict]:
    """Run ``job`` of ``script`` on ``world`` processes; return every rank's records.

    1) every rank runs ``script --worker job rank world port json(args + out_dir)`` in its
    own session (rank 0's stdout is ours: progress; others' is discarded; stderr goes to
    ``out_dir/rank_<r>.stderr``); 2) each must write ``out_dir/rank_<r>.json`` =
    ``{"ok": bool, "records": [...], "error": str}``; 3) past ``timeout`` seconds the
    survivors are killed. Raises RuntimeError naming every rank that failed.
    """
    port = free_port()
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for r in range(world):
        err = open(os.path.join(out_dir, f"rank_{r}.stderr"), "w")
        procs.append((subprocess.Popen(
            [sys.executable, os.path.abspath(script), "--worker", job, str(r), str(world), str(port),
             json.dumps(dict(args, out_dir=out_dir))],
            cwd=ROOT, env=env, stdout=None if r == 0 else subprocess.DEVNULL, stderr=err,
            start_new_session=True), err))
    deadline = time.monotonic() + timeout
    for p, _ in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p, err in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        err.close()
    records, bad = [], []
    for r, (p, _) in enumerate(procs):
        path = os.path.join(out_dir, f"rank_{r}.json")
        res = None
        if os.path.exists(path):
            with open(path) as f:
                res = json.load(f)
        if res is None or not res.get("ok"):
            with open(os.path.join(out_dir, f"rank_{r}.stderr")) as f:
                tail = f.read()[-3000:]
            bad.append(f"rank {r} rc={p.returncode}: {res.get('error') if res else 'no result'}\n{tail}")
        if res:
            records.extend(res["records"])
    if bad:
        raise RuntimeError(f"job {job} on {world} ranks failed:\n" + "\n".join(bad))
    return records


def code_fingerprint(dirs=("shardfmt", "reshard")) -> str:
    """xxh3-64 of every .py under ``dirs`` of the repo (the code the workers import)."""
    import xxhash

    h = xxhash.xxh3_64()
    for d in dirs:
        for f in sorted(files_under(os.path.join(ROOT, d))):
            if f.endswith(".py"):
                h.update(f.encode())
                with open(f, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


class WorkerCtx:
    """One benchmark rank's context: its RSS sampler, its records, a barrier and rank-0 logging."""

    def __init__(self, rank: int, world: int, args: dict, distributed: bool) -> None:
        self.rank, self.world, self.args, self.distributed = rank, world, args, distributed
        self.sampler = RSSSampler(args.get("sample_interval", 0.002))
        self.records: list[dict] = []
        self.label = args["label"]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{self.label}] {msg}", flush=True)


def run_worker(argv: list[str], jobs: dict, make_ctx, *, setup=None) -> None:
    """A benchmark rank's process: ``argv`` = JOB RANK WORLD PORT ARGS_JSON (see ``launch``).

    Joins the gloo group (world > 1), builds ``make_ctx(rank, world, args, distributed)`` (an
    object with ``label``, ``records`` and ``sampler``), runs ``jobs[JOB](ctx)``, writes
    ``{out_dir}/rank_<r>.json`` (records, or the error and its trace) and exits 0 or 1.
    """
    import datetime as dt
    import traceback

    import torch
    import torch.distributed as dist

    name, rank, world, port, raw = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    args = json.loads(raw)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    distributed = world > 1
    if distributed:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=args.get("pg_timeout", 900)))
    if setup is not None:
        setup(args)
    ctx = make_ctx(rank, world, args, distributed)
    try:
        jobs[name](ctx)
        result = {"ok": True, "records": ctx.records}
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(),
                  "records": ctx.records}
        print(f"[{ctx.label}] rank {rank} FAILED: {result['trace']}", file=sys.stderr, flush=True)
    ctx.sampler.close()
    with open(os.path.join(args["out_dir"], f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)
    if distributed:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)
