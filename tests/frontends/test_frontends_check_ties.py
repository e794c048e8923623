"""The export check's tie arbitration (#39 item 2, ``step_ties``): a bundle whose step
decides one ReLU input the other way from PyTorch, where float32 rounding decides it
either way, passes with a note saying which input; a real divergence is still refused.

The tie is built, not found, so that it holds on every host: a batch row of zeros makes
one ReLU input exactly the bias 2**-26 (1.5e-08) in PyTorch float32 and float64 alike
(the row's products are zero in any order), well within float32's rounding at that call
(PyTorch float32 is about 1e-07 off over the others). The bundle's program is then
edited to subtract 2**-25 from that one element before the ReLU, as a rounding of the
runtime's might: it computes -2**-26 there, exactly, on any ISA, and its ReLU closes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.step_check import CheckFailed, check_bundle
from stepbundle.frontend.step_ties import _kinks, _Tap
from stepbundle.schema import SectionPayload, open_bundle, write_bundle
from stepbundle.schema.manifest import MetricOutput, StateUpdateOutput

TIE = 2.0**-26
ROW, UNIT = 0, 3  # the tie's element of the ReLU's input (batch row, hidden unit)


def _classify(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    return {"loss": loss}


def _tied() -> Recipe:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].bias[UNIT] = TIE
    x = torch.randn(6, 4)
    x[ROW] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Recipe(model, opt, _classify, {"x": x, "y": torch.arange(6) % 3})


def _parts(path: Path) -> tuple[Any, list[SectionPayload]]:
    with open_bundle(path) as b:
        manifest = b.manifest
        payloads = [SectionPayload(s.name, s.kind, bytes(b.section(s.name))) for s in manifest.sections]  # fmt: skip
    return manifest, payloads


def _nudged(manifest: Any, payloads: list[SectionPayload], delta: float) -> list[SectionPayload]:
    """The train program with ``delta`` subtracted from the ReLU's input at (ROW, UNIT),
    for every use of that input (the forward ReLU and its backward alike)."""
    from jaxlib.mlir import ir

    from stepbundle.stablehlo.artifact import parse_artifact
    from stepbundle.stablehlo.graph import shape_of, splat_value

    program = manifest.entries["train"].programs[0]
    k = next(i for i, p in enumerate(payloads) if p.name == program.section)
    module = parse_artifact(payloads[k].data)
    with module._ctx, ir.Location.unknown():
        ops = list(module.main.regions[0].blocks[0].operations)
        relus = [op for op in ops if op.operation.name == "stablehlo.maximum"
                 and any(splat_value(v, {}) == 0.0 for v in op.operands)]  # fmt: skip
        assert len(relus) == 1, [str(op) for op in relus]
        x = next(v for v in relus[0].operands if splat_value(v, {}) != 0.0)
        shape = shape_of(x)
        assert shape == [6, 8], shape
        onehot = np.zeros(shape, np.float32)
        onehot[ROW, UNIT] = delta
        t = ir.RankedTensorType.get(shape, ir.F32Type.get())
        with ir.InsertionPoint(next(op for op in ops if any(v == x for v in op.operands))):
            c = ir.Operation.create("stablehlo.constant", results=[t],
                                    attributes={"value": ir.DenseElementsAttr.get(onehot, type=t)})  # fmt: skip
            sub = ir.Operation.create("stablehlo.subtract", results=[t], operands=[x, c.result])
        x.replace_all_uses_except(sub.result, sub)
        assert module._module.operation.verify()
    out = list(payloads)
    out[k] = SectionPayload(program.section, payloads[k].kind,
                            module.portable_artifact(program.stablehlo_version))  # fmt: skip
    return out


def _dropping(manifest: Any, state: str) -> Any:
    """The manifest with the train program no longer writing ``state`` back."""

    def edit(o: Any) -> Any:
        if isinstance(o, StateUpdateOutput) and o.state == state:
            return MetricOutput(name="dropped_update", spec=o.spec)
        return o

    train = manifest.entries["train"]
    programs = tuple(dataclasses.replace(p, outputs=tuple(edit(o) for o in p.outputs)) for p in train.programs)  # fmt: skip
    assert programs != train.programs
    return dataclasses.replace(manifest, entries={**manifest.entries, "train": dataclasses.replace(train, programs=programs)})  # fmt: skip


@pytest.fixture
def exported(frontend: Any, tmp_path: Path) -> Path:
    report = frontend.export(_tied(), tmp_path / "good.stepbundle", check=False)
    return Path(report.path)


def _write(tmp_path: Path, name: str, manifest: Any, payloads: list[SectionPayload]) -> Any:
    path = tmp_path / name
    write_bundle(path, manifest, payloads)
    with open_bundle(path) as b:
        return path, b.manifest


def test_the_tie_is_one_in_eager_float32_and_float64() -> None:
    """The premise, on this host's PyTorch: the element is 2**-26 in both, exactly, and
    the ReLU's other inputs are off in float32 by more (the tie is within its rounding)."""
    recipe = _tied()
    seen = {}
    for dtype in (torch.float32, torch.float64):
        layer = copy.deepcopy(recipe.model[0]).to(dtype)
        seen[dtype] = layer(recipe.example_batch["x"].to(dtype)).detach().double()
    assert float(seen[torch.float32][ROW, UNIT]) == TIE == float(seen[torch.float64][ROW, UNIT])
    err = float((seen[torch.float32] - seen[torch.float64]).abs().max())
    assert err > 4 * TIE, err
    others = seen[torch.float64].abs().reshape(-1)
    assert int((others < 100 * err).sum()) == 1  # no other element near zero


def test_a_tie_decided_the_other_way_passes_with_a_note(exported: Path, tmp_path: Path) -> None:
    manifest, payloads = _parts(exported)
    nudged = _nudged(manifest, payloads, 2 * TIE)
    path, m = _write(tmp_path, "tie.stepbundle", manifest, nudged)
    # Without the arbitration the check refuses it: the ReLU dropped row 0's gradient.
    with pytest.raises(CheckFailed) as caught:
        check_bundle(_tied(), path, m, random_reference="none", ties=False)
    assert caught.value.name.startswith(("0.bias", "optimizer.state.0.bias"))
    assert "No ReLU tie" not in str(caught.value)
    assert not path.exists()
    path, m = _write(tmp_path, "tie.stepbundle", manifest, nudged)
    report = check_bundle(_tied(), path, m, random_reference="none")
    assert path.exists() and report.ran
    note = report.ties
    assert "decides one ReLU input the other way" in note, note
    assert "aten.relu (in module '1'; ReLU-like call 0 of the step)" in note, note
    assert "element [0, 3]: 1.49e-08 in float64, 1.49e-08 in PyTorch float32" in note, note
    assert "within float32's rounding of zero" in note and "1 float64 step tried" in note
    assert note in report.line() and "against float64 with the tie" in report.closest
    assert report.ties_cpu_seconds > 0
    assert report.compared == len(m.state) + 1  # and the loss


def test_a_faithful_bundle_needs_no_arbitration(exported: Path) -> None:
    with open_bundle(exported) as b:
        manifest = b.manifest
    report = check_bundle(_tied(), exported, manifest, random_reference="none")
    assert report.ran and report.ties == "" and report.ties_cpu_seconds == 0.0


@pytest.mark.parametrize("nudge", [False, True], ids=["faithful", "tie_too"])
def test_a_dropped_update_is_refused_with_a_tie_at_hand(
    exported: Path, tmp_path: Path, nudge: bool
) -> None:
    """A flip explains the tie, never a dropped update: the float64 step with the tie
    decided the bundle's way must match every tensor, the dropped one included."""
    manifest, payloads = _parts(exported)
    if nudge:
        payloads = _nudged(manifest, payloads, 2 * TIE)
    path, m = _write(tmp_path, "bad.stepbundle", _dropping(manifest, "2.weight"), payloads)
    with pytest.raises(CheckFailed) as caught:
        check_bundle(_tied(), path, m, random_reference="none")
    e = caught.value
    assert e.name == "2.weight", str(e)
    assert math.isfinite(e.bundle_value) and e.bundle_value != e.eager_value
    # The arbitration ran and says what it tried.
    assert "No ReLU tie explains it: float64 with the ReLU input nearest its kink" in str(e)
    assert "(1 float64 step) does not match the bundle either" in str(e), str(e)
    assert not path.exists()


# No export below: the dispatch mode itself, on each ReLU-like operation.
# (id, the call, its aten operation, whether its backward is an operation the tap reads
# float64's gradient from: clamp's is a where() over a mask)
_RELU_LIKE = [
    ("relu", nn.functional.relu, "aten.relu", True),
    ("relu_inplace", nn.ReLU(inplace=True), "aten.relu_", True),
    ("relu6", nn.functional.relu6, "aten.hardtanh", True),
    ("relu6_inplace", lambda x: nn.functional.relu6(x, inplace=True), "aten.hardtanh_", True),
    ("threshold", lambda x: nn.functional.threshold(x, 0.0, 0.0), "aten.threshold", True),
    ("threshold_inplace", lambda x: nn.functional.threshold(x, 0.0, 0.0, inplace=True),
     "aten.threshold_", True),
    ("leaky", lambda x: nn.functional.leaky_relu(x, 0.1), "aten.leaky_relu", True),
    ("leaky_inplace", lambda x: nn.functional.leaky_relu(x, 0.1, inplace=True),
     "aten.leaky_relu_", True),
    ("clamp_min0", lambda x: torch.clamp(x, min=0), "aten.clamp", False),
    ("clamp_inplace", lambda x: x.clamp_(min=0), "aten.clamp_", False),
    ("clamp_min", lambda x: x.clamp_min(0), "aten.clamp_min", False),
    ("clamp_min_inplace", lambda x: x.clamp_min_(0), "aten.clamp_min_", False),
]  # fmt: skip
TINY = 1e-9


@pytest.mark.parametrize(("name", "f", "op", "reads"), _RELU_LIKE, ids=[r[0] for r in _RELU_LIKE])
def test_a_flip_moves_the_decision_forward_and_backward_alike(
    name: str, f: Any, op: str, reads: bool
) -> None:
    """The tap records the call as the aten operation it runs, finds the element within
    float32's rounding of zero and float64's gradient at its output; a flip (the input's
    sign at that element, reflected in place below autograd) gives what the same function
    gives on the flipped input above autograd: the same output and the same gradient,
    whether autograd saved the operation's input (threshold, hardtanh, clamp; a clone of
    it for an in-place one) or its result (relu)."""
    w = torch.tensor([0.7, -1.3, TINY, 0.4, -0.2], dtype=torch.float64, requires_grad=True)
    scale = torch.arange(1.0, 6.0, dtype=torch.float64)

    def run(mode: Any, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        w.grad = None
        z = w * 1.0
        if delta is not None:
            z = z + delta
        with mode if mode is not None else contextlib.nullcontext():
            out = f(z)
            (out * scale).sum().backward()  # the step's backward runs under the tap too
        assert w.grad is not None
        return out.detach().clone(), w.grad.clone()

    record = _Tap()  # the float32 step's inputs, here float64's rounded to float32
    plain = run(record, None)
    assert [k[0] for k in record.kept] == [op] and record.kept[0][1] == (5,)
    scan = _Tap(kept=list(record.kept))
    run(scan, None)
    assert [(t.call, t.index, t.float64) for t in scan.found] == [(0, (2,), TINY)]
    # float32's largest error over the call: 0.7, -1.3, 0.4 and -0.2 rounded
    assert scan.found[0].reach == max(abs(float(torch.tensor(v).float()) - v)
                                      for v in (0.7, -1.3, 0.4, -0.2))  # fmt: skip
    # float64's gradient at the output there (what an open ReLU passes on: scale[2])
    assert scan.gradients == ({(0, (2,)): 3.0} if reads else {})
    got = run(_Tap(kept=record.kept, flips=scan.found), None)
    delta = torch.zeros(5, dtype=torch.float64)
    delta[2] = -2 * TINY
    want = run(None, delta)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[1], plain[1])  # the decision moved a gradient


def test_only_relu_like_calls_are_tapped() -> None:
    aten = torch.ops.aten
    assert _kinks(aten.relu.default, [torch.zeros(1)], {}) == (0.0,)
    assert _kinks(aten.hardtanh.default, [torch.zeros(1), 0.0, 6.0], {}) == (0.0, 6.0)
    assert _kinks(aten.clamp.default, [torch.zeros(1), 0], {}) == (0.0,)
    assert _kinks(aten.clamp.Tensor, [torch.zeros(1), torch.zeros(1)], {}) == ()
    assert _kinks(aten.threshold.default, [torch.zeros(1), 0.5, 0.0], {}) == (0.5,)
    assert _kinks(aten.gelu.default, [torch.zeros(1)], {}) == ()
    assert _kinks(aten.add.Tensor, [torch.zeros(1), torch.zeros(1)], {}) == ()
