"""Smoke tests of the exporter's one door to torch_xla (stepbundle/exporter/xla.py).

Each wrapped call runs against the real torch_xla and the test checks the shape of what
comes back, so a torch_xla upgrade that changes its private API fails here, by name,
rather than as a wrong bundle somewhere else. The negative tests patch torch_xla's
bindings to return another shape and expect a loud ExportError.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import torch_xla
from export_helpers import linear_sgd_recipe, mse_step

from stepbundle.exporter import ExportError, export, xla
from stepbundle.stablehlo import artifact as mlir

EXPORTER = Path(xla.__file__).resolve().parent


def _data(*shape: int, value: float = 1.0) -> torch.Tensor:
    """A tensor holding device data (synced), not a pending computation."""
    t = torch.full(shape, value).to(xla.device())
    xla.sync()
    return t


# The version check.


def test_installed_torch_xla_is_the_tested_release() -> None:
    xla.check_version()
    major, minor = xla.TESTED_TORCH_XLA
    assert xla.torch_xla_version().startswith(f"{major}.{minor}.")


@pytest.mark.parametrize("version", ["2.9.0", "2.9.1", "2.9.0+cpu", "2.9.0rc1", "2.9"])
def test_patch_releases_of_the_tested_one_are_accepted(version: str) -> None:
    xla.check_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.8.1", "3.9.0", "2.90.0", "nightly"])
def test_other_releases_are_refused_naming_the_version_range_and_fix(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(xla.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ExportError) as e:
        xla.check_version(version)
    msg = str(e.value)
    assert f"torch_xla {version} is installed" in msg
    assert "tested with torch_xla 2.9.x" in msg
    assert "pip install 'torch_xla~=2.9.0'" in msg
    assert xla.ALLOW_UNTESTED_ENV in msg


def test_the_version_check_has_a_named_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(xla.ALLOW_UNTESTED_ENV, "1")
    xla.check_version("2.10.0")


def test_export_checks_the_version_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(xla.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(torch_xla, "__version__", "2.10.0")
    with pytest.raises(ExportError, match="torch_xla 2.10.0 is installed"):
        export(linear_sgd_recipe(mse_step), tmp_path / "b.stepbundle")
    assert not (tmp_path / "b.stepbundle").exists()


# Public torch_xla API.


def test_device_and_sync() -> None:
    d = xla.device()
    assert isinstance(d, torch.device) and d.type == "xla"
    t = _data(3) * 2
    assert xla.tensor_values([t])[0].pending
    xla.sync()
    assert not xla.tensor_values([t])[0].pending


def test_rng_state_round_trips() -> None:
    saved = xla.get_rng_state()
    try:
        xla.set_rng_state(12345)
        got = xla.get_rng_state()
        assert isinstance(got, int) and got == 12345
    finally:
        xla.set_rng_state(saved)


def test_is_spmd_is_false_here() -> None:
    assert xla.is_spmd() is False


def test_syncfree_family() -> None:
    import torch_xla.amp.syncfree as syncfree

    p = [torch.nn.Parameter(torch.zeros(2))]
    assert xla.syncfree_family(syncfree.SGD(p, lr=0.1)) == "syncfree_sgd"
    assert xla.syncfree_family(syncfree.AdamW(p, lr=0.1)) == "syncfree_adam"
    assert xla.syncfree_family(syncfree.Adam(p, lr=0.1)) == "syncfree_adam"
    assert xla.syncfree_family(torch.optim.SGD(p, lr=0.1)) is None


def test_lower_gives_text_and_a_portable_artifact() -> None:
    a = _data(3)
    out = (a * 2).sum()
    text, data = xla.lower([out])
    assert isinstance(text, str) and text.startswith("module @main_module")
    assert isinstance(data, bytes)
    # torch_xla's bytes are a portable artifact: the exporter needs no plain-MLIR fallback.
    ctx = mlir.make_context()
    with ctx:
        module = mlir.stablehlo.deserialize_portable_artifact(ctx, data)
    assert "func.func" in str(module) or "func @main" in str(module)
    assert mlir.parse_artifact(data).signature().results == (("f32", ()),)
    # The module name's process-wide counter is gone: two lowerings compare equal.
    assert xla.lower([(a * 2).sum()])[0] == text
    xla.sync()


def test_plain_mlir_from_torch_xla_would_be_an_export_error() -> None:
    """The exporter reads torch_xla's graph strictly as a portable artifact: no fallback."""
    from stepbundle.exporter.bind import BoundProgram
    from stepbundle.exporter.serialize import _parse

    bound = BoundProgram((), (), {}, b"module {}", "module {}")
    with pytest.raises(ExportError, match="training step's graph, as torch_xla .* is not a"):
        _parse(bound, "training step", "pytorch")


# Private API (_XLAC).


def test_package_dir_holds_torch_xla() -> None:
    assert Path(xla.package_dir(), "__init__.py").is_file()
    assert Path(xla.package_dir()) == Path(torch_xla.__file__).parent


def test_counting_checkpoints_counts_torch_xla_checkpoint_calls() -> None:
    import torch_xla.utils.checkpoint as xcp

    seg = torch.nn.Linear(3, 3).to(xla.device())
    x = torch.ones(2, 3, device=xla.device(), requires_grad=True)
    before = xcp.CheckpointFunction.__dict__["forward"]
    from stepbundle.exporter.segments import counting_checkpoints

    with counting_checkpoints() as calls:
        xcp.checkpoint(seg, x, use_reentrant=True).sum().backward()
        xcp.checkpoint(seg, x, use_reentrant=True)
    assert calls == [2]
    assert xcp.CheckpointFunction.__dict__["forward"] is before  # put back
    xla.sync()


def test_skip_step_drops_the_graph_and_leaves_placeholders() -> None:
    """_clear_pending_irs, create_placeholder_tensor and _get_tensors_handle as skip_step
    uses them: a state tensor with a pending value gets a placeholder (a handle, the
    same shape and dtype, a new id); nothing else with a pending value is dropped."""
    w = _data(3, 2)
    w.add_(1.0)  # pending
    old_id = xla.tensor_id(w)
    assert xla.skip_step([w]) == []
    assert (tuple(w.shape), w.dtype) == ((3, 2), torch.float32)
    assert xla.tensor_id(w) != old_id
    torch_xla._XLAC._get_tensors_handle([w])  # a placeholder has a handle

    user = _data(2)
    w2 = _data(3, 2)
    w2.add_(1.0)
    user.mul_(3.0)  # pending, outside the state: nothing may be dropped
    pending = xla.skip_step([w2])
    assert [t is user for t in pending] == [True]
    xla.sync()
    assert user.cpu().tolist() == [3.0, 3.0]
    assert w2.cpu().tolist() == [[2.0, 2.0]] * 3


def test_skip_step_passes_over_tensors_that_are_not_torch_xla_s() -> None:
    """A dynamo FakeTensor on the xla device (the benchmark's dynamo runs leave some
    alive) is not a torch_xla tensor: _xla_get_tensor_id raises for it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(3, device="xla")
    w = _data(2)
    w.add_(1.0)
    assert xla.skip_step([w]) == []
    assert fake.device.type == "xla"


def test_tensor_id() -> None:
    a, b = _data(3), _data(3)
    ia, ib = xla.tensor_id(a), xla.tensor_id(b)
    assert isinstance(ia, int) and isinstance(ib, int) and ia != ib
    assert xla.tensor_id(a) == ia


def test_graph_inputs_name_the_tensors_read() -> None:
    a, b = _data(3), _data(2, 3)
    out = (a * b).sum()
    ids, values = xla.graph_inputs([out])
    assert isinstance(ids, list) and isinstance(values, list) and len(ids) == len(values)
    assert all(isinstance(i, int) for i in ids)
    assert all(isinstance(v, torch.Tensor) for v in values)
    by_id = dict(zip(ids, values))
    assert xla.tensor_id(a) in by_id and xla.tensor_id(b) in by_id
    assert tuple(by_id[xla.tensor_id(b)].shape) == (2, 3)
    xla.sync()


def test_the_rng_seed_input_has_the_seed_id() -> None:
    seed_id = xla.seed_input_id()
    assert isinstance(seed_id, int)
    r = torch.rand(4, device=xla.device()).sum()
    ids, values = xla.graph_inputs([r])
    assert seed_id in ids
    assert values[ids.index(seed_id)].numel() == 1
    xla.sync()


def test_tensor_values_see_in_place_updates_and_ignore_reads() -> None:
    a, b = _data(3), _data(3, value=2.0)
    before = xla.tensor_values([a, b])
    assert all(isinstance(v, xla.TensorValue) for v in before)
    assert not before[0].pending and before[0] != before[1]
    _ = (a * b).sum()  # reading gives them device-data nodes: no change
    assert xla.tensor_values([a, b]) == before
    a.add_(1)  # an in-place update keeps the tensor id
    ida = xla.tensor_id(a)
    now = xla.tensor_values([a, b])
    assert now[0].pending and now[0] != before[0] and now[1] == before[1]
    assert xla.tensor_id(a) == ida
    b.copy_(_data(3, value=5.0))  # another buffer
    assert xla.tensor_values([b])[0] != before[1]
    xla.sync()


def test_tensor_values_see_batchnorm_running_statistics() -> None:
    bn = torch.nn.BatchNorm1d(3).to(xla.device())
    x = _data(4, 3)
    xla.sync()
    before = xla.tensor_values([bn.running_mean, bn.running_var])
    bn(x)
    after = xla.tensor_values([bn.running_mean, bn.running_var])
    assert all(a != b for a, b in zip(after, before))
    xla.sync()


# Metric counters.


def test_counters_and_round_trips() -> None:
    a = _data(3)
    c0 = xla.counters()
    assert c0 and all(isinstance(k, str) and isinstance(v, int) for k, v in c0.items())
    _ = (a * 2).sum()
    assert xla.round_trips(c0, xla.counters()) == xla.RoundTrips((), False)
    c1 = xla.counters()
    _ = float((a * 3).sum())  # a host read in the middle of a step
    assert xla.round_trips(c1, xla.counters()).host_reads
    xla.sync()


def test_round_trips_name_cpu_fallback_ops() -> None:
    trips = xla.round_trips(
        {"aten::nonzero": 1, "ExecuteComputation": 4},
        {"aten::nonzero": 2, "aten::unique2": 1, "ExecuteComputation": 4, "Other": 9},
    )
    assert trips == xla.RoundTrips(("nonzero", "unique2"), False)


def _where_it_is_computed(a: torch.Tensor) -> torch.Tensor:
    return (a * 3.0).sin()  # the traced line


def test_ir_debug_records_source_locations_in_the_ir_text() -> None:
    a = _data(3)
    assert not xla.ir_debugging()
    plain = xla.ir_text([_where_it_is_computed(a)])
    assert "aten::sin" in plain and "location=" not in plain
    with xla.ir_debug():
        assert xla.ir_debugging()
        located = xla.ir_text([_where_it_is_computed(a)])
    assert not xla.ir_debugging()  # put back as it was
    line = _where_it_is_computed.__code__.co_firstlineno + 1
    assert "aten::sin(%" in located
    assert f"location=_where_it_is_computed@test_xla_api.py:{line}" in located
    xla.sync()


# Loud failures when torch_xla's private API changes shape.


@pytest.mark.parametrize(
    ("function", "fake"),
    [
        ("_check_tensor_need_materialization", lambda ts: [False]),
        ("_get_tensors_handle", lambda ts: ["0x1"] * len(ts)),
    ],
)
def test_a_changed_api_is_an_export_error(
    function: str, fake: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_xla._XLAC, function, fake)
    with pytest.raises(ExportError, match=f"{function} returned .* changed its API"):
        xla.tensor_values([_data(3), _data(3)])


def test_a_changed_node_id_is_an_export_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_xla._XLAC, "_unique_id_for_ir_and_data", lambda t: None)
    a = _data(3)
    a.add_(1)
    with pytest.raises(ExportError, match="_unique_id_for_ir_and_data returned None"):
        xla.tensor_values([a])
    xla.sync()


def test_export_fails_loudly_when_the_update_check_breaks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        torch_xla._XLAC, "_check_tensor_need_materialization", lambda ts: "no such thing"
    )
    with pytest.raises(ExportError, match="_check_tensor_need_materialization"):
        export(linear_sgd_recipe(mse_step), tmp_path / "b.stepbundle")
    assert not (tmp_path / "b.stepbundle").exists()


# The door is the only one.


def _torch_xla_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "torch_xla"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch_xla":
            found.append(node.module or "")
        elif isinstance(node, ast.Attribute) and node.attr == "_XLAC":
            found.append("_XLAC")
        elif isinstance(node, ast.Constant) and re.fullmatch(r"torch_xla(\.\w+)*", str(node.value)):
            found.append(str(node.value))  # importlib.import_module("torch_xla...")
    return found


def test_only_xla_py_touches_torch_xla() -> None:
    uses = {p.name: _torch_xla_uses(p) for p in sorted(EXPORTER.glob("*.py")) if p.name != "xla.py"}
    assert {k: v for k, v in uses.items() if v} == {}
    assert _torch_xla_uses(EXPORTER / "xla.py")  # the check itself can see them
