"""shardfmt.get_state_dict / set_state_dict: the plain API resumes a fresh optimizer exactly.

A fresh optimizer has no per-parameter state to load into; the helpers make it (marked
``IfSaved``), ``load`` keeps what the checkpoint holds and drops the rest, so the next step is
bit for bit the step the saving run took. The old flow (a fresh ``opt.state_dict()``) is
refused with a typed error instead of a silent "missing optim".
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import bytes_equal

import shardfmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + i))


def _step(model, opt, i: int, *, use_unused: bool = False) -> None:
    opt.zero_grad()
    model(_batch(i), use_unused=use_unused).pow(2).mean().backward()
    opt.step()


class _Net(torch.nn.Module):
    """A body and head that train, a frozen layer (requires_grad=False) and a layer only some
    steps use (no gradient, hence no optimizer state, until then)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(6, 5)
        self.frozen = torch.nn.Linear(6, 5)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(5, 2)

    def forward(self, x, use_unused: bool = False):
        h = torch.relu(self.body(x) + self.frozen(x))
        return self.head(self.unused(h) if use_unused else h)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not bytes_equal(a[k], b[k])]
    assert not bad, f"differ after the resumed step: {bad}"


_CHILD = """
import sys, torch, shardfmt
src, out = sys.argv[1], sys.argv[2]
torch.manual_seed(7)                                    # not the saving run's weights
model = torch.nn.Linear(6, 3)
opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
state = {**shardfmt.get_state_dict(model, opt), "step": None}
report = shardfmt.load(state, src)
shardfmt.set_state_dict(model, opt, state)
assert state["step"] == 3 and not report.missing and not report.unexpected, report
opt.zero_grad()
model(torch.randn(4, 6, generator=torch.Generator().manual_seed(3))).pow(2).mean().backward()
opt.step()
shardfmt.save({"params": dict(model.state_dict()),
               "optim": {k: dict(v) for k, v in shardfmt.get_state_dict(model, opt)["optim"]["state"].items()}}, out)
"""


def test_a_new_process_resumes_a_checkpoint_of_another_bit_for_bit(tmp_path):
    """The README's flow: one process trains and saves; a NEW process with a fresh model and
    AdamW loads it; its next step equals the uninterrupted run's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        opt.step()
    src = str(tmp_path / "step_3")
    shardfmt.save({**shardfmt.get_state_dict(model, opt), "step": 3}, src, step=3)
    opt.zero_grad()
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(3))).pow(2).mean().backward()
    opt.step()
    out = str(tmp_path / "child")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", _CHILD, src, out], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = {"params": {k: torch.empty_like(v) for k, v in model.state_dict().items()},
           "optim": {k: {n: torch.empty_like(t) for n, t in s.items()}
                     for k, s in shardfmt.get_state_dict(model, opt)["optim"]["state"].items()}}
    shardfmt.load(got, out)
    _assert_same(got["params"], _params(model))
    want = {f"{k}.{n}": t for k, s in shardfmt.get_state_dict(model, opt)["optim"]["state"].items()
            for n, t in s.items()}
    _assert_same({f"{k}.{n}": t for k, s in got["optim"].items() for n, t in s.items()}, want)


@pytest.mark.parametrize("api", ["helpers", "checkpointer"])
def test_frozen_and_never_used_parameters_resume_without_state(tmp_path, api):
    """Parameters with no optimizer state at save (frozen; never given a gradient) are not
    demanded at load and get no state back: when the unused layer first trains after the
    resume, its step is the uninterrupted run's (a made-up state would count one step more).
    The Checkpointer builds its optimizer state with the same helpers."""
    model = _Net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for i in range(2):
        _step(model, opt, i)
    trained = {"body.weight", "body.bias", "head.weight", "head.bias"}
    assert {n for n, p in model.named_parameters() if p in opt.state} == trained
    fresh = _Net(1)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.01, weight_decay=0.1)
    if api == "checkpointer":
        shardfmt.Checkpointer(str(tmp_path)).save(2, {"model": model, "optim": opt})
        assert shardfmt.Checkpointer(str(tmp_path)).restore({"model": fresh, "optim": fopt}) == 2
        path = str(tmp_path / "step_000000002")
    else:
        path = str(tmp_path / "c")
        shardfmt.save(shardfmt.get_state_dict(model, opt), path)
        state = shardfmt.get_state_dict(fresh, fopt)
        report = shardfmt.load(state, path)  # strict: nothing demanded that was never saved
        assert report.missing == () and report.unexpected == ()
        assert sorted(state["optim"]["state"]) == sorted(trained)
        shardfmt.set_state_dict(fresh, fopt, state)
    saved = shardfmt.read_manifest(path).tensors
    assert not [k for k in saved if k.startswith(("optim.state.frozen", "optim.state.unused"))]
    assert {n for n, p in fresh.named_parameters() if p in fopt.state} == trained
    for m, o in ((model, opt), (fresh, fopt)):
        _step(m, o, 2)
        _step(m, o, 3, use_unused=True)
    _assert_same(_params(fresh), _params(model))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_never_stepped_optimizer_saves_no_state_and_resumes_fresh(tmp_path, kind):
    """Saved before its first step, an optimizer writes no per-parameter state (it has none),
    stays fresh itself, and loads back as exactly a fresh optimizer: SGD with dampening would
    otherwise get a zero momentum buffer, Adam a step count of 1."""
    def make(seed):
        model = _Net(seed)
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5) if kind == "sgd"
               else torch.optim.Adam(model.parameters(), lr=0.01))
        return model, opt

    model, opt = make(0)
    path = str(tmp_path / "c")
    shardfmt.save(shardfmt.get_state_dict(model, opt), path)
    assert not opt.state and all(p.grad is None for p in model.parameters())
    m = shardfmt.read_manifest(path)
    assert not [k for k in [*m.tensors, *m.values] if k.startswith("optim.state")], sorted(m.tensors)

    fresh, fopt = make(1)
    state = shardfmt.get_state_dict(fresh, fopt)
    assert shardfmt.load(state, path).missing == ()
    assert state["optim"]["state"] == {}
    shardfmt.set_state_dict(fresh, fopt, state)
    assert not fopt.state
    for i in range(3):
        _step(model, opt, i)
        _step(fresh, fopt, i)
    _assert_same(_params(fresh), _params(model))


def test_a_fresh_optimizer_whose_parameters_hold_gradients_still_gets_state_to_load_into(tmp_path):
    """torch makes no optimizer state while a parameter holds a gradient; get_state_dict makes it
    anyway and leaves the gradients as they were."""
    model = _Net(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, opt, 0)
    path = str(tmp_path / "c")
    shardfmt.save(shardfmt.get_state_dict(model, opt), path)
    fresh = _Net(1)
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh(_batch(5)).sum().backward()
    grads = {n: p.grad.clone() for n, p in fresh.named_parameters() if p.grad is not None}
    state = shardfmt.get_state_dict(fresh, fopt)
    shardfmt.load(state, path)
    shardfmt.set_state_dict(fresh, fopt, state)
    assert torch.equal(fopt.state[fresh.body.weight]["exp_avg"], opt.state[model.body.weight]["exp_avg"])
    _assert_same({n: p.grad for n, p in fresh.named_parameters() if p.grad is not None}, grads)


def _stepped(tmp_path, **adam):
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), **adam)
    model(_batch(0)).sum().backward()
    opt.step()
    path = str(tmp_path / "plain")
    shardfmt.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    return path


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("lr", [0.01, "tensor"])
def test_a_fresh_optimizers_state_dict_is_refused_naming_what_the_checkpoint_holds(tmp_path, strict, lr):
    """The old README flow: a new process's fresh ``opt.state_dict()`` holds no tensor, so
    ``optim`` (or ``optim.state``, when a tensor lr makes ``optim`` a tree) is one value while
    the checkpoint holds the state under it: a StateDictError naming the leaf and the fix, never
    MissingKeyError and never a silent load of no optimizer state (strict=False)."""
    adam = {"lr": torch.tensor(0.01), "foreach": False} if lr == "tensor" else {"lr": lr}
    path = _stepped(tmp_path, **adam)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), **adam)
    leaf = "optim.state" if lr == "tensor" else "optim"
    n = 6 if lr == "tensor" else 7  # 2 parameters x (exp_avg, exp_avg_sq, step), + param_groups
    with pytest.raises(shardfmt.errors.StateDictError,
                       match=rf": {leaf}: the checkpoint holds {n} entries under this name "
                             rf"\({leaf}\.[^)]*\);.*shardfmt\.get_state_dict\(model, optimizer\)"):
        shardfmt.load({"model": model.state_dict(), "optim": opt.state_dict()}, path, strict=strict)
    assert not opt.state


def test_a_value_saved_whole_is_not_missing_under_its_parts(tmp_path):
    """The other way round: a never-stepped optimizer saved as ``opt.state_dict()`` is one value
    ``optim``; loading its parts (``optim.param_groups``) names it rather than calling them missing."""
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters())
    path = str(tmp_path / "c")
    shardfmt.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    for strict in (True, False):
        with pytest.raises(shardfmt.errors.StateDictError, match=r"optim\.param_groups: the checkpoint holds optim as one value"):
            shardfmt.load(shardfmt.get_state_dict(model, opt), path, strict=strict)


def test_optimizer_state_saved_by_parameter_index_is_refused_not_dropped(tmp_path):
    """A stepped optimizer saved as ``opt.state_dict()`` keys its state by parameter index; the
    helpers' names find none of it: set_state_dict refuses rather than resume without state."""
    path = _stepped(tmp_path, lr=0.01)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = shardfmt.get_state_dict(model, opt)
    report = shardfmt.load(state, path)
    assert "optim.state.0.exp_avg" in report.unexpected
    with pytest.raises(shardfmt.errors.StateDictError, match="names its parameters by index"):
        shardfmt.set_state_dict(model, opt, state)
    assert not opt.state


def test_load_settles_if_saved_subtrees(tmp_path):
    """``IfSaved`` rules on a plain dict: held leaves are filled and unwrapped, the others removed
    (dicts left empty go, a list stays only whole), never missing; save writes none of it."""
    path = str(tmp_path / "c")
    shardfmt.save({"s": {"a": {"x": torch.ones(2), "n": 3}, "b": {"x": torch.ones(1)},
                         "c": [torch.ones(1)]}, "made": shardfmt.IfSaved({"y": torch.zeros(1)})}, path)
    m = shardfmt.read_manifest(path)
    assert sorted([*m.tensors, *m.values]) == ["s.a.n", "s.a.x", "s.b.x", "s.c.0"]
    want = {"s": {"a": shardfmt.IfSaved({"x": torch.zeros(2), "n": 0, "gone": torch.zeros(1)}),
                  "d": shardfmt.IfSaved({"x": torch.zeros(1)}),
                  "c": shardfmt.IfSaved([torch.zeros(1), torch.zeros(1)]),
                  "b": {"x": torch.zeros(1)}}}
    report = shardfmt.load(want, path)
    assert report.missing == () and report.unexpected == ("s.c.0",)
    assert want["s"].keys() == {"a", "b"}
    assert want["s"]["a"].keys() == {"x", "n"} and want["s"]["a"]["n"] == 3
    assert torch.equal(want["s"]["a"]["x"], torch.ones(2)) and torch.equal(want["s"]["b"]["x"], torch.ones(1))
