"""The command-line tools refuse what would destroy a user's data or run away, and fail the way
their exit-code convention says (0 ok, 1 unusable checkpoint, 2 bad argument or unreachable
path, 130 Ctrl-C, 141 stdout closed): one line on stderr, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import as_next_format_version, flip_byte
from deadline import deadline

import shardfmt
from reshard.cli import main as reshard_main
from shardfmt.cli import main as shardfmt_main
from shardfmt.layout.topology import Mesh, TopologyError
from shardfmt.validation import validate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture
def tiny(tmp_path) -> str:
    """A committed checkpoint, step 1 of a checkpoint root: <tmp>/root/step_000000001."""
    path = str(tmp_path / "root" / "step_000000001")
    shardfmt.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, path, step=1)
    return path


def _rc(main, argv: list[str]):
    """Exit status of ``main(argv)``, argparse's refusals included."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _tree(path: str) -> list[tuple[str, int]]:
    return sorted((os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
                  for d, _, files in os.walk(path) for f in files)


# ----------------------------------------------------------------------------- the source survives


@pytest.mark.parametrize("command", [["convert", "--mesh", "tp=2"], ["export-hf"]])
@pytest.mark.parametrize("where", ["the source", "its root", "inside it", "a symlink to its root"])
def test_overwrite_onto_the_source_its_root_or_inside_it_is_refused(tiny, tmp_path, capsys, command, where):
    root = os.path.dirname(tiny)
    os.symlink(root, tmp_path / "alias")
    dst = {"the source": tiny, "its root": root, "inside it": os.path.join(tiny, "out"),
           "a symlink to its root": str(tmp_path / "alias")}[where]
    before = _tree(root)
    rc = reshard_main([command[0], tiny, dst, *command[1:], "--overwrite", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: destination overlaps the source: " in err and "source" in err and err.count("\n") == 1
    assert _tree(root) == before and validate(tiny).ok
    assert sorted(os.listdir(tmp_path)) == ["alias", "root"]  # no staging dir left either


def test_import_hf_onto_the_directory_holding_its_source_is_refused(tiny, tmp_path, capsys):
    hf = tmp_path / "models" / "hf"
    assert reshard_main(["export-hf", tiny, str(hf), "--no-progress"]) == 0
    before = _tree(str(hf))
    for dst in (hf.parent, hf, hf / "ck"):
        capsys.readouterr()
        assert reshard_main(["import-hf", str(hf), str(dst), "--overwrite", "--no-progress"]) == 2
        assert "error: destination overlaps the source: " in capsys.readouterr().err
    assert _tree(str(hf)) == before


# ----------------------------------------------------------------------------- meshes and rules


def test_a_mesh_beyond_the_formats_world_size_is_refused_at_once(tiny, tmp_path, capsys):
    dst = str(tmp_path / "dst")
    with deadline(20, "convert --mesh tp=99999999"):
        rc = reshard_main(["convert", tiny, dst, "--mesh", "tp=99999999", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "16777216" in err and err.count("\n") == 1
    assert not os.path.exists(dst)
    for bad, why in [("tp=4096,dp=4097", "world size 16781312"), ({"tp": True}, "bool"), ({"tp": 2.5}, "2.5"),
                     ("tp=0", ">= 1"), ("tp=" + "9" * 5000, "exceeds")]:
        with pytest.raises(TopologyError, match=why):
            Mesh.parse(bad)
    assert Mesh.parse("tp=4096,dp=4096").world_size == 1 << 24


@pytest.mark.parametrize("args", [["--mesh", "tp"], ["--mesh", "tp=2", "--max-read", "0"],
                                  ["--mesh", "tp=2", "--max-read", "-1"], ["--mesh", "tp=2", "--max-gap", "-5"]])
def test_plan_refuses_bad_arguments_with_exit_2(tiny, capsys, args):
    assert _rc(reshard_main, ["plan", tiny, "--rank", "0", *args]) == 2
    err = capsys.readouterr().err
    assert ("mesh" in err or "--max-" in err) and "Traceback" not in err and "TopologyError" not in err


def test_a_loose_mesh_is_echoed_normalised(tiny, tmp_path, capsys):
    assert reshard_main(["plan", tiny, "--mesh", " tp= 2, ", "--rank", "1"]) == 0
    assert capsys.readouterr().out.startswith("rank 1 of mesh tp=2 ")
    assert reshard_main(["convert", tiny, str(tmp_path / "c"), "--mesh", "tp= 2,", "--no-progress"]) == 0
    assert "ranks (tp=2)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bad arguments: exit 2


def test_export_hf_with_a_missing_config_is_a_bad_argument(tiny, tmp_path, capsys):
    dst = str(tmp_path / "hf")
    assert reshard_main(["export-hf", tiny, dst, "--config", str(tmp_path / "missing.json"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and "error: bad config: " in err and err.count("\n") == 1
    assert not os.path.exists(dst)


def test_gc_on_a_missing_root_fails_like_ls(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert shardfmt_main(["ls", missing]) == 2
    ls_err = capsys.readouterr().err
    assert shardfmt_main(["gc", missing]) == 2
    out, err = capsys.readouterr()
    assert err == ls_err and "not a directory" in err and "nothing to collect" not in out


def test_demo_refuses_a_used_or_non_directory_dir(tmp_path, capsys, monkeypatch):
    import shardfmt.demo.run

    def launch(*a, **k):
        raise AssertionError("the demo started training")

    monkeypatch.setattr(shardfmt.demo.run, "_launch", launch)
    (tmp_path / "file").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "A.rank0.jsonl").write_text("{}\n")
    for name, why in [("file", "not a directory"), ("used", "not empty")]:
        assert shardfmt_main(["demo", "--dir", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1
    assert (tmp_path / "file").read_text() == "x" and os.listdir(tmp_path / "used") == ["A.rank0.jsonl"]


# ----------------------------------------------------------------------------- validate, ls


@pytest.mark.parametrize("name", ["COMMITTED", "manifest.json"])
def test_validate_a_checkpoint_whose_file_is_a_directory_is_invalid_not_unreachable(tiny, capsys, name):
    os.remove(os.path.join(tiny, name))
    os.mkdir(os.path.join(tiny, name))
    assert shardfmt_main(["validate", tiny, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and any(p["file"] == name and "directory" in p["message"] for p in report["problems"])


def test_ls_and_validate_json_hold_names_that_are_not_utf8(tiny, capsys):
    root = os.path.dirname(tiny)
    odd = os.path.join(os.fsencode(root), b"step_\xff")
    os.rename(tiny, odd)
    assert shardfmt_main(["ls", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"]) for r in rows] == [("step_\\xff", "committed")]
    assert shardfmt_main(["validate", os.fsdecode(odd), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["path"].endswith("step_\\xff")


def test_ls_shows_a_quarantined_checkpoint_as_quarantined(tmp_path, capsys):
    root = str(tmp_path / "run")
    ck = shardfmt.Checkpointer(root)
    for s in (1, 2):
        ck.save(s, {"model": torch.nn.Linear(4, 4)})
    data = os.path.join(root, "step_000000002", "data")
    f = os.path.join(data, os.listdir(data)[0])
    flip_byte(f, os.path.getsize(f) - 1)  # a bad byte: found by restore, not by a listing
    with pytest.warns(UserWarning, match="unusable"):
        assert shardfmt.Checkpointer(root).restore({"model": torch.nn.Linear(4, 4)}) == 1
    assert shardfmt_main(["ls", "--json", root]) == 0
    rows = {r["name"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    (aside,) = set(rows) - {"step_000000001"}
    assert aside.startswith("step_000000002.corrupt-")
    assert rows == {"step_000000001": "committed", aside: "quarantined"}
    assert [i.step for i in ck.list()] == [1] and ck.latest().endswith("step_000000001")


# ----------------------------------------------------------------------------- what a path is


def _not_a_checkpoint(kind: str, tiny: str, tmp_path) -> str:
    """A directory holding no COMMITTED, of the given kind."""
    if kind == "a checkpoint root":
        return os.path.dirname(tiny)
    if kind == "an interrupted save":
        os.remove(os.path.join(tiny, "COMMITTED"))
        return tiny
    path = tmp_path / kind.replace(" ", "_")
    path.mkdir()
    if kind == "a Hugging Face folder":
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2, 3)}, str(path / "model.safetensors"))
        (path / "config.json").write_text("{}")
    return str(path)


WHAT_IT_IS = {  # kind -> (exit status, what every entry point says)
    "a checkpoint root": (2, "{path}: is a checkpoint root holding step_000000001: pass one of them, "
                             "e.g. {path}/step_000000001"),
    "a Hugging Face folder": (2, "{path}: is a Hugging Face model folder, not a shardfmt checkpoint; "
                                 "`reshard import-hf` converts it"),
    "an empty directory": (2, "{path}: not a shardfmt checkpoint: no COMMITTED or manifest.json"),
    "an interrupted save": (1, "{path}: not committed (no COMMITTED marker: an interrupted or in-progress save)"),
}


@pytest.mark.parametrize("kind", list(WHAT_IT_IS))
def test_a_directory_without_committed_is_named_for_what_it_is_by_every_entry_point(tiny, tmp_path, capsys, kind):
    path = _not_a_checkpoint(kind, tiny, tmp_path)
    code, msg = WHAT_IT_IS[kind]
    msg = msg.format(path=path)
    error = shardfmt.errors.CheckpointNotFoundError if code == 2 else shardfmt.errors.CommitError
    with pytest.raises(error, match=re.escape(msg)):
        shardfmt.load({"w": torch.zeros(2, 3)}, path)
    if code == 2:
        with pytest.raises(error, match=re.escape(msg)):
            validate(path)
    else:
        assert [(p.code, p.message) for p in validate(path).problems][0] == ("not_committed", msg)
    dst = str(tmp_path / "out")
    for main, argv in [(shardfmt_main, ["inspect", path]), (shardfmt_main, ["validate", path]),
                       (reshard_main, ["plan", path, "--mesh", "tp=2", "--rank", "0"]),
                       (reshard_main, ["convert", path, dst, "--mesh", "tp=2", "--no-progress"]),
                       (reshard_main, ["export-hf", path, dst, "--no-progress"])]:
        rc = _rc(main, argv)
        out, err = capsys.readouterr()
        said = out if argv[0] == "validate" and code == 1 else err  # an invalid checkpoint's report
        assert (rc, msg in said) == (code, True), (argv, rc, out, err)
        assert said is out or err.count("\n") == 1
        assert not os.path.exists(dst)


@pytest.mark.parametrize("where", ["manifest", "COMMITTED"])
def test_a_checkpoint_of_a_newer_format_version_is_unreadable_here_never_invalid(tiny, tmp_path, capsys, where):
    """Spec 9: a version error naming both versions, from every entry point, before any check
    that would call the checkpoint invalid; validate exits 2 (not judged), never 1."""
    as_next_format_version(tiny, where)
    want = "written in format version 3, this reader supports up to 2; upgrade shardfmt to read it"
    with pytest.raises(shardfmt.errors.FormatVersionError, match=want):
        shardfmt.load({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, tiny)
    report = validate(tiny)
    assert [p.code for p in report.problems] == ["format_version"] and want in report.problems[0].message
    assert shardfmt_main(["validate", tiny]) == 2
    assert f"{tiny}: cannot be validated by this release: " in capsys.readouterr().out
    assert shardfmt_main(["validate", "--json", tiny]) == 2
    assert [p["code"] for p in json.loads(capsys.readouterr().out)["problems"]] == ["format_version"]
    dst = str(tmp_path / "out")
    for main, argv in [(shardfmt_main, ["inspect", tiny]),
                       (reshard_main, ["plan", tiny, "--mesh", "tp=2", "--rank", "0"]),
                       (reshard_main, ["convert", tiny, dst, "--mesh", "tp=2", "--no-progress"])]:
        assert _rc(main, argv) == 2
        err = capsys.readouterr().err
        assert "error: unsupported format version: " in err and want in err and err.count("\n") == 1, (argv, err)
    assert shardfmt_main(["ls", os.path.dirname(tiny)]) == 0
    assert "unsupported  (format version 3; this reader supports up to 2)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- pipes and Ctrl-C


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["reshard.cli", "plan", "{ck}", "--mesh", "tp=2", "--rank", "0"],
                                  ["shardfmt.cli", "inspect", "{ck}"]])
def test_a_closed_stdout_ends_quietly(tiny, argv):
    """``reshard plan ... | head``: the reader goes away; no traceback, exit 141 (as SIGPIPE)."""
    cmd = [sys.executable, "-m", *(a.format(ck=tiny) for a in argv)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()  # nobody reads: every write to stdout fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == ""


def test_ctrl_c_in_reshard_exits_130_without_a_traceback(tiny, tmp_path, monkeypatch, capsys):
    """Ctrl-C after every byte is written, before the commit: one line, exit 130, nothing at DST
    and nothing staged left behind."""
    import reshard.convert

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(reshard.convert, "_add_records", interrupted)
    out = tmp_path / "out"
    out.mkdir()
    dst = str(out / "c")
    try:
        rc = reshard_main(["convert", tiny, dst, "--mesh", "tp=2", "--no-progress"])
    except KeyboardInterrupt:
        rc = "KeyboardInterrupt escaped (a traceback)"
    assert rc == 130
    assert capsys.readouterr().err == f"reshard: interrupted; {dst} left as it was\n"
    assert os.listdir(out) == []


def test_ctrl_c_in_shardfmt_exits_130_with_one_line(tiny, monkeypatch, capsys):
    import shardfmt.cli.checkpoints

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(shardfmt.cli.checkpoints, "validate", interrupted)
    assert shardfmt_main(["validate", tiny]) == 130
    assert capsys.readouterr().err == "shardfmt: interrupted\n"
