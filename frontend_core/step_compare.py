"""The export check's comparison: how far a bundle's step may be from the eager one
(``Bounds``), and each metric's and state tensor's distance against its bound
(``verdicts``). ``step_check.py`` runs the two steps; this module only compares.

Imports: torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FLOAT32",
    "LOW_PRECISION",
    "Bounds",
    "Verdict",
    "describe",
    "suspects",
    "update_verdicts",
    "verdicts",
]


@dataclass(frozen=True)
class Bounds:
    """How far the bundle may be from the eager step, from rounding.

    A state tensor ``a`` (bundle) against ``b`` (eager), which were ``b0`` before the
    step, passes when ``||a - b|| <= update * ||b - b0|| + ulps * eps * ||b|| + atol *
    sqrt(n)`` (2-norms): the step's *update* must agree to ``update`` (relative), and
    the new value to a few roundings of its own size. Comparing the update, not only the
    new value, keeps the check sensitive to an update that is small beside the value it
    changes (a parameter at a small learning rate). A metric passes when ``|a - b| <=
    metric * |b| + atol``. Integer tensors must be equal.

    The defaults hold with a wide margin on the equivalence suite's models (one step
    differs from PyTorch float32 by about 1e-6 of the update; resnet18's BatchNorm
    gradients 1e-5): ``docs/frontends.md`` has the figures. ``LOW_PRECISION`` is for steps
    that compute in bfloat16 or float16 (autocast, or such state or batches).

    A value term of bfloat16's size is about 3% of the tensor's norm, more than one
    ordinary step moves a weight: a dropped update would pass it. Bounds with ``suspect``
    therefore also judge the update itself: a tensor whose update is further than
    ``suspect`` of its size from eager's (``||a - b|| > suspect * ||b - b0||``) is
    *suspect*, and the float64 step decides (``update_verdicts``). Under any bounds, a
    tensor one of whose rows (``_rows``) has an update further than ``ROW_SUSPECT`` of its
    size from eager's is suspect too: a tensor's norm hides one dropped row.
    """

    update: float = 1e-3
    ulps: float = 4.0
    eps: float = float(torch.finfo(torch.float32).eps)
    atol: float = 1e-7
    metric: float = 1e-4
    suspect: float | None = None
    """A tensor whose update differs from eager's by more than this fraction of it is
    judged against the float64 step (``update_verdicts``); None: only the tensors beyond
    their bound and those with a suspect row (``ROW_SUSPECT``) are."""
    label: str = "float32 rounding"
    """What the bound stands for, in a refusal ("4.2x the bound float32 rounding explains")."""


FLOAT32 = Bounds()
LOW_PRECISION = Bounds(update=5e-2, ulps=4.0, eps=float(torch.finfo(torch.bfloat16).eps),
                       atol=1e-5, metric=3e-2, suspect=0.5,
                       label="bfloat16 or float16 rounding")  # fmt: skip

ROW_SUSPECT = 0.5
"""A row (``_rows``) of a state tensor whose update is further than this fraction of its
size from eager's makes the tensor suspect under any bounds (``suspects``)."""
_EPS32 = float(torch.finfo(torch.float32).eps)

ARBITER_TIMES = 4.0
"""A suspect tensor fails where its update is further from float64's than this many times
eager's own distance from float64, plus ``ARBITER_FLOOR``."""
ARBITER_FLOOR = 0.25
"""...plus this fraction of float64's update. A dropped (or doubled) update is float64's
whole update away; a tensor whose update is rounding noise (a convolution's bias before
BatchNorm: its gradient is zero in exact arithmetic, and Adam scales the noise up to a
full step) has eager itself about its whole update away, and passes."""


@dataclass(frozen=True)
class Verdict:
    """One metric's or state tensor's distance against its bound.

    Attributes:
      name: the metric or state tensor.
      ratio: distance / bound; above 1 fails.
      where: the element that differs most ("[2, 0]"; "" for a scalar, and for a state
        tensor within its bound, where it is not looked for).
      bundle, eager: the values there (nan where ``where`` was not looked for).
      detail: the distance and the bound, in words.
      distance, update: a state tensor's normwise distance from eager, and eager's
        update's norm (nan for a metric).
      against: the bound in words ("the distance ... that rounding explains"), where not
        "the bound <``Bounds.label``> explains".
      structural: the two sides do not hold the same kind of tensor (dtype, shape, or a
        tensor on one side only): no rounding explains it, and no float64 step is asked.
      suspect: one row's update is further than ``ROW_SUSPECT`` of its size from
        eager's, or under bounds with ``Bounds.suspect`` the whole update further than
        that fraction (``suspects``).
    """

    name: str
    ratio: float
    where: str
    bundle: float
    eager: float
    detail: str
    distance: float = math.nan
    update: float = math.nan
    against: str = ""
    structural: bool = False
    suspect: bool = False


def _where(i: int, shape: tuple[int, ...]) -> str:
    """Flat index ``i`` of a tensor of ``shape``, as text ("[2, 0]"; "" for a scalar)."""
    idx = []
    for n in reversed(shape):
        idx.append(i % n)
        i //= n
    return str(idx[::-1]) if shape else ""


_CHUNK = 1 << 16
"""Elements per float32 partial norm: torch accumulates a float32 norm in float32, which
over 4e7 elements was 2e-3 off; over chunks of this size it is within about 1e-6, and the
chunks' squares add in float64."""


def _norm(x: torch.Tensor) -> float:
    """The 2-norm of the flat tensor ``x``; inf or nan where it holds such values."""
    if x.dtype == torch.float64:
        return float(torch.linalg.vector_norm(x))
    total = 0.0
    for part in x.split(_CHUNK):  # type: ignore[no-untyped-call]
        n = float(torch.linalg.vector_norm(part))
        if math.isinf(n):  # finite values whose squares overflow float32
            n = float(torch.linalg.vector_norm(part.double()))
        total += n * n
    return math.sqrt(total)


def _non_finite_mismatch(a: torch.Tensor, w: torch.Tensor) -> int | None:
    """The first flat index where the flat tensors ``a`` and ``w`` are not the same kind
    of value (finite, NaN, +inf, -inf), or None: a NaN where eager has an infinity, or
    an infinity of the other sign, is a different step, not a rounding."""
    bad = torch.isnan(a) != torch.isnan(w)
    bad |= torch.isposinf(a) != torch.isposinf(w)
    bad |= torch.isneginf(a) != torch.isneginf(w)
    hits = torch.nonzero(bad)
    return int(hits[0]) if hits.numel() else None


MIN_ROW = 16
"""Rows narrower than this many elements are not judged one by one (``_rows``). Where a
state's gradient is zero in exact arithmetic (a per-head offset that softmax cancels),
Adam turns each element's rounding noise into a full step of either sign, on eager's
side and the bundle's alike; float64 tells them apart only by eager's own distance from
it, which is zero for a row of n elements where eager's n signs all happen to agree with
float64's (about 2**-n), and a row of a few elements would then be refused. A tensor of
such rows is judged as a whole."""


def _rows(shape: tuple[int, ...]) -> int:
    """How many rows the local criterion splits a tensor of ``shape`` into: its first
    dimension (an embedding's rows, a linear or convolution weight's output channels)
    for a tensor of two or more dimensions whose rows hold at least ``MIN_ROW``
    elements; one (the whole) otherwise."""
    if len(shape) < 2 or shape[0] <= 1 or math.prod(shape[1:]) < MIN_ROW:
        return 1
    return shape[0]


def _row_norms(x: torch.Tensor, rows: int) -> torch.Tensor:
    """The 2-norms of the flat tensor ``x`` split into ``rows`` equal rows, in float64
    (float32 rows are summed in float32 when short, in float64 chunks otherwise)."""
    if rows == 1:
        return torch.tensor([_norm(x)], dtype=torch.float64)
    per = x.numel() // rows
    if x.dtype == torch.float64 or per > _CHUNK:
        return torch.tensor([_norm(r) for r in x.view(rows, per)], dtype=torch.float64)
    out: torch.Tensor = torch.linalg.vector_norm(x.view(rows, per), dim=1).double()
    big = torch.isinf(out)  # finite values whose squares overflow float32
    if bool(big.any()):
        out[big] = torch.linalg.vector_norm(x.view(rows, per)[big].double(), dim=1)
    return out


def _whole(rows: torch.Tensor) -> float:
    return math.sqrt(float((rows * rows).sum()))


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _compare_tensor(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    before: torch.Tensor | None,
    b: Bounds,
    dtypes: bool = True,
) -> Verdict:
    shape = tuple(want.shape)
    if tuple(got.shape) != shape:
        return Verdict(name, math.inf, "", math.nan, math.nan,
                       f"shape {tuple(got.shape)} in the bundle, {shape} eager",
                       structural=True)  # fmt: skip
    if dtypes and got.dtype != want.dtype:
        return Verdict(name, math.inf, "", math.nan, math.nan,
                       f"dtype {_dtype(got)} in the bundle, {_dtype(want)} eager",
                       structural=True)  # fmt: skip
    if got.numel() == 0:
        return Verdict(name, 0.0, "", 0.0, 0.0, "")
    if not (got.is_floating_point() or want.is_floating_point()):
        a, w = got.double().reshape(-1), want.double().reshape(-1)
        i = int(torch.argmax((a - w).abs()))
        equal = bool(torch.equal(a, w))
        return Verdict(name, 0.0 if equal else math.inf, _where(i, shape), float(a[i]),
                        float(w[i]), "integers must be equal")  # fmt: skip
    # In the tensors' own precision (float32 for float32 state; float64 where one side
    # is): the difference of two values this close is exact or within one rounding of
    # itself, and the norms add their chunks in float64 (_norm). Converting every tensor
    # to float64 first, and a pass for each question, made the comparison most of GPT-2's
    # check.
    dt = torch.float64 if torch.float64 in (got.dtype, want.dtype) else torch.float32
    a, w = got.reshape(-1).to(dt), want.reshape(-1).to(dt)
    b0 = before.reshape(-1).to(dt) if before is not None and before.shape == shape else None
    rows = _rows(shape)
    # Row by row as well as whole (``_rows``): a tensor's norm hides one row's error
    # (an embedding row or output channel whose update was dropped is a millionth of a
    # large tensor); a row that looks dropped makes the tensor suspect (below).
    w_rows = _row_norms(w, rows)
    norm_w = _whole(w_rows)
    d = a - w
    d_rows = _row_norms(d, rows)
    # Where eager's values and the difference are finite, so are the bundle's.
    all_finite = math.isfinite(norm_w) and (
        math.isfinite(_whole(d_rows)) or bool(torch.isfinite(a).all())
    )
    if not all_finite:
        bad = _non_finite_mismatch(a, w)
        if bad is not None:
            return Verdict(name, math.inf, _where(bad, shape), float(a[bad]), float(w[bad]),
                            "non-finite values differ")  # fmt: skip
        fw = torch.isfinite(w)
        a, w = a[fw], w[fw]
        b0 = b0[fw] if b0 is not None else None
        rows = 1  # the finite elements no longer fill whole rows
        w_rows = _row_norms(w, rows)
        norm_w = _whole(w_rows)
        d = a - w
        d_rows = _row_norms(d, rows)
    per = d.numel() // rows
    # No value before the step (state the step created): the value is the update.
    u_rows = _row_norms(w - b0, rows) if b0 is not None else w_rows
    dist, update = _whole(d_rows), _whole(u_rows)
    bound = b.update * update + b.ulps * b.eps * norm_w + b.atol * math.sqrt(w.numel())
    ratio = dist / bound if bound > 0 else (0.0 if dist == 0 else math.inf)
    detail = f"normwise distance {dist:.3g}, bound {bound:.3g} (update {update:.3g})"
    suspect = b.suspect is not None and dist > b.suspect * update
    if rows > 1:
        # A row whose update is further than half its size from eager's (beyond float32
        # roundings of its value and ``atol``) is suspect, and float64 decides
        # (``update_verdicts``): a dropped row is its whole update away, while rounding
        # noise that Adam turns into a full step flips single elements, a small part of
        # a row's update, and a 1e-3 bound per row would refuse those.
        floor = b.ulps * _EPS32 * w_rows + b.atol * math.sqrt(per)
        suspect = suspect or bool((d_rows > ROW_SUSPECT * u_rows + floor).any())
    if ratio <= 1.0:  # where it differs most is only said of a tensor that fails
        return Verdict(name, ratio, "", math.nan, math.nan, detail, dist, update,
                       suspect=suspect)  # fmt: skip
    i = int(torch.argmax(d.abs()))
    where = _where(i, shape) if all_finite else "a finite element"
    return Verdict(name, ratio, where, float(a[i]), float(w[i]), detail, dist, update,
                   suspect=suspect)  # fmt: skip


def _compare_metric(name: str, got: list[float], want: torch.Tensor, b: Bounds) -> Verdict:
    w = want.detach().cpu().double().reshape(-1)
    a = torch.tensor(got, dtype=torch.float64)
    if a.shape != w.shape:
        return Verdict(name, math.inf, "", math.nan, math.nan, "shapes differ")
    bad = _non_finite_mismatch(a, w)
    i = (
        bad
        if bad is not None
        else int(torch.argmax(torch.where(torch.isfinite(w), (a - w).abs(), 0.0)))
    )
    where, x, y = _where(i, tuple(w.shape)) if w.numel() > 1 else "", float(a[i]), float(w[i])
    if bad is not None:
        return Verdict(name, math.inf, where, x, y, "non-finite values differ")
    fin = torch.isfinite(w)
    d = (a[fin] - w[fin]).abs()
    bound = b.metric * w[fin].abs() + b.atol
    ratio = float((d / bound).max()) if d.numel() else 0.0
    return Verdict(name, ratio, where, x, y, f"bound {b.metric:g} relative")


def describe(v: Verdict) -> str:
    at = v.where if v.where.startswith("[") else f" ({v.where})" if v.where else ""
    return f"{v.name}{at}: bundle {v.bundle!r}, eager {v.eager!r}"


def verdicts(
    metric_names: list[str],
    state_names: list[str],
    bundle: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]],
    eager: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]],
    before: Mapping[str, torch.Tensor],
    bounds: Bounds,
    *,
    dtypes: bool = True,
) -> list[Verdict]:
    """Each metric's and state tensor's ``Verdict``: ``bundle`` against ``eager`` (each
    ``(metrics, state)``), the state having been ``before`` before the step.
    ``dtypes``: a state tensor in another dtype than eager's fails (False where ``eager``
    is the float64 step)."""
    # A few elementwise passes over every state tensor: one thread each (torch's pool
    # churned on a busy machine, and the comparison of resnet18 took 44 s instead of 1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _verdicts_of(metric_names, state_names, bundle, eager, before, bounds, dtypes)
    finally:
        torch.set_num_threads(threads)


def _verdicts_of(
    metric_names: list[str],
    state_names: list[str],
    bundle: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]],
    eager: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]],
    before: Mapping[str, torch.Tensor],
    bounds: Bounds,
    dtypes: bool,
) -> list[Verdict]:
    out = []
    for name in metric_names:
        want = eager[0][name]
        want = want if isinstance(want, torch.Tensor) else torch.tensor(float(want))
        out.append(_compare_metric(name, bundle[0][name]["values"], want, bounds))
    for name in state_names:
        b0 = before.get(name)
        if b0 is None and name.endswith(".grad"):
            b0 = torch.zeros_like(eager[1][name])
        out.append(_compare_tensor(name, bundle[1][name], eager[1][name], b0, bounds, dtypes))
    return out


def suspects(found: list[Verdict], bounds: Bounds) -> set[str]:
    """The state tensors within ``bounds`` that float64 must judge (``update_verdicts``):
    one of whose rows' updates is further than ``ROW_SUSPECT`` of its size from eager's
    (beyond four float32 roundings of the row and ``atol`` per element), or, under bounds
    with ``suspect``, whose whole update is further than that fraction from eager's."""
    return {v.name for v in found if v.ratio <= 1.0 and math.isfinite(v.distance) and v.suspect}


def _before(
    name: str, before: Mapping[str, torch.Tensor], like: torch.Tensor
) -> torch.Tensor | None:
    b0 = before.get(name)
    if b0 is None and name.endswith(".grad"):
        return torch.zeros_like(like)
    return b0 if b0 is not None and b0.shape == like.shape else None


def update_verdicts(
    names: set[str],
    bundle: Mapping[str, torch.Tensor],
    eager: Mapping[str, torch.Tensor],
    float64: Mapping[str, torch.Tensor],
    before: Mapping[str, torch.Tensor],
    bounds: Bounds,
    *,
    own: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Verdict]:
    """Each suspect state tensor's update judged against the float64 step's: it fails
    where ``||a - x|| > ARBITER_TIMES * ||b - x|| + ARBITER_FLOOR * ||x - b0|| + atol *
    sqrt(n)`` (``a`` bundle, ``b`` eager, ``x`` float64, ``b0`` before the step), over
    the whole tensor or over any one of its rows (``_rows``: a dropped update of one
    embedding row or output channel). A tensor with non-finite values, or one the float64
    step did not make, is left out.

    ``own``: the float64 step eager's own distance is measured from (``||b - own||``),
    where ``float64`` is another (the tie arbitration's, with a ReLU decided the other
    way: eager's distance from it would count the decision as rounding)."""
    out: dict[str, Verdict] = {}
    for name in sorted(names):
        if name not in float64 or (own is not None and name not in own):
            continue
        x = float64[name].detach().reshape(-1).double()
        a = bundle[name].reshape(-1).double()
        w = eager[name].reshape(-1).double()
        xo = x if own is None else own[name].detach().reshape(-1).double()
        if a.shape != x.shape or w.shape != x.shape or xo.shape != x.shape:
            continue
        if not bool(torch.isfinite(torch.stack([a, w, x, xo])).all()):
            continue
        shape = tuple(eager[name].shape)
        rows = _rows(shape)
        per = x.numel() // rows
        b0 = _before(name, before, float64[name])
        u_rows = _row_norms(x - b0.reshape(-1).double() if b0 is not None else x, rows)
        b_rows, e_rows = _row_norms(a - x, rows), _row_norms(w - xo, rows)
        upd, dist_b, dist_e = _whole(u_rows), _whole(b_rows), _whole(e_rows)
        limit = ARBITER_TIMES * dist_e + ARBITER_FLOOR * upd + bounds.atol * math.sqrt(x.numel())
        ratio = dist_b / limit if limit > 0 else (0.0 if dist_b == 0 else math.inf)
        detail = (
            f"its update is {dist_b:.3g} from float64's (whose norm is {upd:.3g}), eager's "
            f"{dist_e:.3g}; allowed {limit:.3g}"
        )
        row = -1
        if rows > 1:
            r_limit = ARBITER_TIMES * e_rows + ARBITER_FLOOR * u_rows + bounds.atol * math.sqrt(per)
            r_ratio = b_rows / r_limit
            r = int(torch.argmax(r_ratio))
            if float(r_ratio[r]) > ratio:
                ratio, row = float(r_ratio[r]), r
                detail = (
                    f"row {r}: its update is {float(b_rows[r]):.3g} from float64's (whose norm "
                    f"is {float(u_rows[r]):.3g}), eager's {float(e_rows[r]):.3g}; allowed "
                    f"{float(r_limit[r]):.3g}; the whole tensor: {detail}"
                )
        against = (
            f"the distance from PyTorch float64's update that rounding explains "
            f"({ARBITER_TIMES:g}x eager's own, plus {ARBITER_FLOOR:g} of the update)"
        )
        if row >= 0:
            i = row * per + int(torch.argmax((a - w).view(rows, per)[row].abs()))
        else:
            i = int(torch.argmax((a - w).abs()))
        out[name] = Verdict(name, ratio, _where(i, shape), float(a[i]), float(w[i]), detail,
                            dist_b, upd, against)  # fmt: skip
    return out
