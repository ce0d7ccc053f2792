"""The README's scripts, run as a user runs them (torchrun, real processes, gloo), so they never
rot: ``examples/fsdp2_train.py``, ``examples/tp_train.py``, ``examples/dcp_backend.py``; and the
README itself, on a fresh clone: its first command in a fresh virtual environment, its second
command as CI's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.distributed.harness import ROOT, free_port

pytestmark = pytest.mark.slow


def torchrun(script: str, nproc: int, *args: str, cwd: str = ROOT, python: str = sys.executable,
             timeout: float = 300) -> str:
    """Run ``examples/<script>`` under torchrun on ``nproc`` CPU ranks; return its output (stdout,
    then stderr: the warnings)."""
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", os.path.join("examples", script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=cwd)
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def losses(out: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, flags=re.M)}


def test_fsdp2_example_resumes_bit_for_bit_and_on_another_world_size(tmp_path):
    straight = losses(torchrun("fsdp2_train.py", 2, "--root", str(tmp_path / "a"), "--steps", "8"))
    assert sorted(straight) == list(range(1, 9))
    first = torchrun("fsdp2_train.py", 2, "--root", str(tmp_path / "b"), "--steps", "4")
    assert "fresh start on 2 rank(s)" in first
    again = torchrun("fsdp2_train.py", 2, "--root", str(tmp_path / "b"), "--steps", "8")
    assert "resumed from step 4 on 2 rank(s)" in again
    assert losses(again) == {s: straight[s] for s in range(5, 9)}, "the resumed run differs from the straight one"
    wider = torchrun("fsdp2_train.py", 4, "--root", str(tmp_path / "b"), "--steps", "10")
    assert "resumed from step 8 on 4 rank(s)" in wider and sorted(losses(wider)) == [9, 10]
    assert wider.count("RNG states were saved by 2 ranks") == 1  # once for the job, not once per rank


def test_tp_example_loads_on_another_tp_size(tmp_path):
    straight = losses(torchrun("tp_train.py", 2, "--ckpt", str(tmp_path / "a"), "--steps", "8"))
    torchrun("tp_train.py", 2, "--ckpt", str(tmp_path / "b"), "--steps", "4")
    inspect = subprocess.run([sys.executable, "-m", "shardfmt.cli", "inspect", str(tmp_path / "b"), "--tensors",
                              "model.*"], capture_output=True, text=True, cwd=ROOT)
    assert re.search(r"model\.up\.weight\s+128x32\s+F32\s+.*tp:Shard\(0\)", inspect.stdout), inspect.stdout
    assert re.search(r"model\.down\.weight\s+32x128\s+F32\s+.*tp:Shard\(1\)", inspect.stdout), inspect.stdout
    same = torchrun("tp_train.py", 2, "--ckpt", str(tmp_path / "b"), "--steps", "8", "--resume")
    assert "resumed from step 4 on tp=2" in same and losses(same) == {s: straight[s] for s in range(5, 9)}
    one = torchrun("tp_train.py", 1, "--ckpt", str(tmp_path / "b"), "--steps", "10", "--resume")
    assert "resumed from step 8 on tp=1" in one
    for s, v in losses(one).items():  # tp=1 sums in another order: equal to the float rounding
        assert s in (9, 10) and abs(float(v)) < 10


def test_dcp_backend_example(tmp_path):
    out = torchrun("dcp_backend.py", 2, "--ckpt", str(tmp_path / "c"))
    assert "step 1, weights equal: True" in out
    check = subprocess.run([sys.executable, "-m", "shardfmt.cli", "validate", str(tmp_path / "c"), "--deep"],
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 0, check.stdout + check.stderr


def _readme_commands() -> tuple[str, str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = f.read().split("```bash\n", 1)[1].split("```", 1)[0]
    demo, tests = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()[:2]]
    return demo, tests


def test_the_readme_on_a_fresh_clone(tmp_path):
    """The README's first command, as written, in a fresh clone and a fresh virtual environment
    (torch from this machine's site-packages: the command's own ``pip install torch==2.13.0`` then
    finds it installed); its second command is exactly what CI runs."""
    demo, tests = _readme_commands()
    assert demo.startswith("pip install torch==2.13.0 && pip install -e . && shardfmt demo"), demo
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert tests in f.read().splitlines(), "CI must run the README's test command exactly"
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", ROOT, str(clone)], check=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    out = subprocess.run(["bash", "-c", f"{demo} --dir {tmp_path / 'demo'}"], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "bit for bit: YES" in out.stdout
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import shardfmt; print(shardfmt.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(clone)), where.stdout + where.stderr  # the clone's package ran
