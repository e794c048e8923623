"""The export check's tie arbitration: a bundle refused because one ReLU decided the other
way from PyTorch, where float32 rounding decides it either way.

A ReLU's output is discontinuous in its gradient at zero: where an input is, in float64,
closer to zero than float32's own error at that call, a float32 step may land on either
side, and that element's whole gradient goes with the decision. On an AVX-512 host the
runtime's step of torchvision resnet18 landed below zero at one input of layer3.0's last
ReLU that is 1.5e-06 in float64 and 6.0e-06 in PyTorch float32, and the check refused a
bundle that float64 decided the same way matches to 7e-06
(benchmarks/results/relu_ties.md). PyTorch float32 itself meets such ties.

``arbitrate`` runs only where the check would refuse (a tensor beyond its bound that the
float64 arbiter does not excuse), under float32 bounds, against a reference with a float64
step. It runs the eager float32 step again recording the input of every ReLU-like call
(``_Tap``: a dispatch mode, so ``nn.ReLU``, ``F.relu``, ``inplace=True``, ``relu6``,
``clamp(min=0)`` and ``threshold`` are all seen as the aten operation they run), then the
float64 step, matching the calls in order: the candidate ties are the elements whose
float64 value is within ``TIE_REACH`` times float32's largest error at that call of the
operation's kink (zero for a ReLU), closest first, those whose float64 gradient at the
output is zero left out (deciding them otherwise moves no gradient). Then float64 again
with the candidates reflected across the kink (an element's sign flipped: a change of
twice a value within rounding of zero, which moves the ReLU's decision forward and
backward alike), one at a time and then in pairs, within ``TIE_RERUNS`` float64 steps.
A flip is accepted only where every metric and every state tensor of the bundle is then
as close to that float64 step as the check asks of it against float64 (within its bound,
or twice PyTorch float32's own distance from float64; a row that looks dropped judged as
``update_verdicts`` does): a dropped update, or a wrong tensor anywhere else, is not
explained by a flip.

Imports: torch, the front-end core.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .step_compare import Bounds, Verdict, update_verdicts
from .step_compare import verdicts as judge
from .step_eager import CannotReproduce, CheckCouldNotRun, Reference, _copies, _eager, _to_float64

__all__ = ["TIE_CANDIDATES", "TIE_REACH", "TIE_RERUNS", "Tie", "TieVerdict", "arbitrate"]

TIE_REACH = 4.0
"""A ReLU-like call's input element is a candidate tie where its float64 value is within
this many times PyTorch float32's largest error over that call's inputs of the kink.
relu_ties.md: the runtime's ReLU inputs on resnet18 were within 2.2x PyTorch float32's
distance from float64 (normwise, per call; median 1.6x), and the tie it decided the other
way was 0.12 of PyTorch float32's largest error at that call from zero (1.5e-06 against
1.28e-05). Twice the measured ratio, rounded up: the candidates are ranked by that
distance, so a wide reach costs reruns only where nothing nearer explains the refusal."""
TIE_CANDIDATES = 6
"""At most this many candidate ties, the nearest their kink (as a fraction of the reach)
first."""
TIE_PAIRED = 4
"""Pairs are formed from the first this many candidates."""
TIE_RERUNS = 10
"""At most this many flipped float64 steps: each candidate alone, then pairs."""
_PER_CALL = 4 * TIE_CANDIDATES
"""Candidates kept per call and kink before those float64's gradient leaves out."""

aten = torch.ops.aten

_ONE_KINK = {aten.relu, aten.relu_, aten.leaky_relu, aten.leaky_relu_}
_THRESHOLD = {aten.threshold, aten.threshold_, aten.clamp_min, aten.clamp_min_,
              aten.clamp_max, aten.clamp_max_}  # fmt: skip
_TWO_KINKS = {aten.hardtanh, aten.hardtanh_, aten.clamp, aten.clamp_}
_RESULT_SAVED = {aten.relu, aten.relu_, aten.leaky_relu_}
"""Operations whose backward reads their result (the input of an in-place one): the
tensor their backward operation is handed (``_BACKWARD``); the others' is their input,
or for an in-place one the clone autograd made of it (``_Tap``)."""
_BACKWARD = {aten.threshold_backward, aten.hardtanh_backward, aten.leaky_relu_backward}
"""Backward operations of the ReLU-like ones: (gradient at the output, the saved tensor,
...). ``clamp``'s backward is a ``where`` over a mask: no gradient is read for it."""


def _kinks(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[float, ...]:
    """Where a ReLU-like operation's derivative jumps (its inputs' kinks), or () for any
    other operation (and for bounds given as tensors)."""
    packet = getattr(func, "overloadpacket", None)
    if packet is None or getattr(func, "_overloadname", "") == "out":
        return ()
    if packet in _ONE_KINK:
        return (0.0,)

    def scalar(i: int, name: str, default: float | None) -> float | None:
        v = args[i] if len(args) > i else kwargs.get(name, default)
        if v is None or isinstance(v, torch.Tensor):
            return None
        return float(v)

    if packet in _THRESHOLD:
        k = scalar(1, "threshold" if "threshold" in str(packet) else "min", None)
        if packet in (aten.clamp_max, aten.clamp_max_):
            k = scalar(1, "max", None)
        return () if k is None else (k,)
    if packet in _TWO_KINKS:
        if packet in (aten.hardtanh, aten.hardtanh_):
            lo, hi = scalar(1, "min_val", -1.0), scalar(2, "max_val", 1.0)
        elif any(isinstance(a, torch.Tensor) for a in [*args[1:], *kwargs.values()]):
            return ()
        else:
            lo, hi = scalar(1, "min", None), scalar(2, "max", None)
        return tuple(k for k in (lo, hi) if k is not None)
    return ()


@dataclass(frozen=True)
class Tie:
    """A ReLU-like call's input element within float32's rounding of its kink.

    Attributes:
      call: the step's ReLU-like calls counted in order from 0.
      op: the aten operation ("aten.relu_").
      module: the module whose forward made the call ("layer3.0.relu"; "" outside any),
        and which of its calls it was (from 1).
      index: the element (its indices in the call's input).
      kink: where the derivative jumps (0 for a ReLU).
      float64, float32: the input there in the float64 step and in PyTorch float32's.
      reach: PyTorch float32's largest error over that call's inputs.
      gradient: float64's gradient at the call's output there (what the decision passes
        on or drops); nan where the step's backward did not say.
      flat_index: the element's index in the flattened input.
    """

    call: int
    op: str
    module: str
    module_call: int
    index: tuple[int, ...]
    kink: float
    float64: float
    float32: float
    reach: float
    gradient: float = math.nan
    flat_index: int = 0

    @property
    def rank(self) -> float:
        return abs(self.float64 - self.kink) / self.reach

    def words(self) -> str:
        """This tie, for the export line."""
        which = f"ReLU-like call {self.call} of the step"
        if self.module:
            nth = f", its call {self.module_call}" if self.module_call > 1 else ""
            which = f"in module {self.module!r}{nth}; {which}"
        at = "zero" if self.kink == 0 else f"its kink at {self.kink:g}"
        grad = (
            f"; float64's gradient at its output there, {self.gradient:.5g}, goes with the decision"
            if math.isfinite(self.gradient)
            else ""
        )
        return (
            f"{self.op} ({which}), element {list(self.index)}: {self.float64:.4g} in float64, "
            f"{self.float32:.4g} in PyTorch float32, within float32's rounding of {at} (PyTorch "
            f"float32 is up to {self.reach:.3g} off over that call's inputs){grad}"
        )


@dataclass(frozen=True)
class TieVerdict:
    """What the tie arbitration found.

    Attributes:
      flipped: the ties float64 decided the other way to match the bundle (empty: none
        did).
      verdicts: every metric and state tensor against that float64 step, each ratio over
        what it is allowed (empty where none matched).
      candidates: how many candidate ties there were.
      reruns: the flipped float64 steps run.
      reason: why nothing matched, in words.
      seconds, cpu_seconds: its wall and processor time (this process).
    """

    flipped: tuple[Tie, ...] = ()
    verdicts: list[Verdict] = field(default_factory=list)
    candidates: int = 0
    reruns: int = 0
    reason: str = ""
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def words(self) -> str:
        """The export line's note on an accepted tie."""
        n = len(self.flipped)
        head = (
            "the bundle's step decides one ReLU input the other way from PyTorch float32 and "
            "float64, at a tie"
            if n == 1
            else f"the bundle's step decides {n} ReLU inputs the other way from PyTorch float32 "
            "and float64, at ties"
        )
        return (
            f"{head}: " + "; and ".join(t.words() for t in self.flipped) + ". Float32 rounding "
            f"decides {'it' if n == 1 else 'them'} either way: float64 decided the bundle's way "
            f"matches every metric and state tensor ({self.reruns} float64 "
            f"step{'s' if self.reruns != 1 else ''} tried), so the bundle is as accurate as "
            f"PyTorch float32 here, and there is nothing to fix"
        )


class _Mismatch(CannotReproduce):
    """The float64 step's ReLU-like calls are not the float32 step's (another operation
    or shape at the same place): they cannot be matched in order."""


class _Tap(TorchDispatchMode):
    """Sees every ReLU-like call of an eager step, in order, as the aten operation it runs.

    ``record``: keeps a float32 copy of each call's input (and, with ``_with_modules``, the
    module that made it). ``scan`` (given what ``record`` kept): compares each call's
    float64 input with the float32 one, keeps the candidate ties, and reads float64's
    gradient at their outputs from the backward operations. ``flip`` (given ties):
    reflects those elements across their kink, in place before the call, so that the
    operation and the tensor autograd saved for its backward (its input, its result, or
    for an in-place operation that needs its input the clone autograd made of it just
    before: seen here as ``aten.clone``) hold the same flipped value. Flipping in place
    also hands the input's other readers the flipped value, a change within float32's
    rounding; an input that is a leaf (a parameter, the batch) is never a candidate.
    """

    def __init__(
        self,
        kept: list[tuple[str, tuple[int, ...], torch.Tensor]] | None = None,
        flips: Sequence[Tie] = (),
        modules: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls = 0
        self.recording = kept is None and not flips
        self.kept: list[tuple[str, tuple[int, ...], torch.Tensor]] = (
            kept if kept is not None else []
        )
        self.flips = {t.call: [u for u in flips if u.call == t.call] for t in flips}
        self.modules = modules
        self.stack: list[str] = []
        self.per_module: dict[str, int] = {}
        self.where: list[tuple[str, int]] = []
        self.found: list[Tie] = []
        self.saved: dict[tuple[int, tuple[int, ...]], int] = {}
        self.gradients: dict[tuple[int, tuple[int, ...]], float] = {}
        self.clone: tuple[int, tuple[int, ...], torch.Tensor] | None = None

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        if packet in _BACKWARD and len(args) > 1 and self.saved:
            k = self.saved.get((args[1].data_ptr(), tuple(args[1].shape)))
            if k is not None:  # float64's gradient at the call's output, at its ties
                g = args[0].detach().reshape(-1)
                for t in self.found:
                    if t.call == k:
                        self.gradients[(k, t.index)] = float(g[t.flat_index])
            return func(*args, **kwargs)
        if func is aten.clone.default and args and isinstance(args[0], torch.Tensor):
            out = func(*args, **kwargs)
            self.clone = (args[0].data_ptr(), tuple(args[0].shape), out)
            return out
        kinks = _kinks(func, args, kwargs)
        x = args[0] if args else None
        if not kinks or not isinstance(x, torch.Tensor) or not x.is_floating_point():
            self.clone = None
            return func(*args, **kwargs)
        # An in-place operation whose backward reads its input: autograd saved a clone of
        # the input just before it (threshold_, hardtanh_, clamp_, clamp_min_).
        saved_clone = None
        in_place = str(packet).endswith("_")
        if in_place and self.clone is not None and self.clone[:2] == (x.data_ptr(), tuple(x.shape)):
            saved_clone = self.clone[2]
        self.clone = None
        k = self.calls
        self.calls += 1
        op = str(packet)
        if self.recording:
            self.kept.append((op, tuple(x.shape), x.detach().float().clone()))
            module = self.stack[-1] if self.stack else ""
            self.per_module[module] = self.per_module.get(module, 0) + 1
            self.where.append((module, self.per_module[module]))
            return func(*args, **kwargs)
        if k >= len(self.kept) or self.kept[k][:2] != (op, tuple(x.shape)):
            raise _Mismatch(f"ReLU-like call {k} is {op} of shape {tuple(x.shape)}")
        if self.flips:
            for t in self.flips.get(k, ()):
                with torch.no_grad():
                    x[t.index] = 2 * t.kink - x[t.index]
                    if saved_clone is not None:
                        saved_clone[t.index] = x[t.index]
            return func(*args, **kwargs)
        self._scan(k, op, x, kinks)
        out = func(*args, **kwargs)
        if x.requires_grad:  # its backward hands back the tensor autograd saved
            saved = (
                saved_clone if saved_clone is not None else out if packet in _RESULT_SAVED else x
            )
            if isinstance(saved, torch.Tensor):
                self.saved[(saved.data_ptr(), tuple(saved.shape))] = k
        return out

    def _scan(self, k: int, op: str, x: torch.Tensor, kinks: tuple[float, ...]) -> None:
        """The candidate ties of call ``k`` (``x``: its float64 input)."""
        x32 = self.kept[k][2]
        self.kept[k] = (self.kept[k][0], self.kept[k][1], torch.empty(0))  # let it go
        # An input autograd keeps as a leaf (a parameter, the batch) or a view of one is
        # not flipped in place: that would change the state itself.
        base = x._base if x._is_view() else None
        if x.is_leaf or (base is not None and base.is_leaf):
            return
        x64 = x.detach().reshape(-1).double()
        err = (x64 - x32.reshape(-1).double()).abs()
        err = err[torch.isfinite(err)]
        reach = float(err.max()) * TIE_REACH if err.numel() else 0.0
        if reach <= 0.0:  # float32 computed this call exactly: rounding decides nothing
            return
        for kink in kinks:
            d = (x64 - kink).abs()
            near = torch.nonzero((d < reach) & (d > 0)).reshape(-1)
            if near.numel() > _PER_CALL:
                near = near[torch.topk(d[near], _PER_CALL, largest=False).indices]
            for i in near.tolist():
                index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), x.shape))
                self.found.append(Tie(k, op, "", 0, index, kink, float(x64[i]),
                                      float(x32.reshape(-1)[i]), reach / TIE_REACH,
                                      flat_index=i))  # fmt: skip


def _module_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules() if name}


def _with_modules(tap: _Tap, model: torch.nn.Module) -> Any:
    """Global forward hooks that keep ``tap.stack`` the modules running, innermost last."""
    from torch.nn.modules import module as nn_module

    names = _module_names(model)

    def pre(m: torch.nn.Module, _a: Any) -> None:
        tap.stack.append(names.get(id(m), ""))

    def post(m: torch.nn.Module, _a: Any, _o: Any) -> None:
        if tap.stack:
            tap.stack.pop()

    return (
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(post),
    )


def _step(
    ref: Reference,
    recipe: Any,
    batch: dict[str, torch.Tensor],
    seed: int | None,
    tap: _Tap,
    *,
    float64: bool,
) -> tuple[Mapping[str, Any], dict[str, torch.Tensor]]:
    """One eager step of ``ref`` on fresh copies under ``tap`` (in float64: copies and
    batch converted); a recording tap also learns the modules that make the calls."""
    model, opt = _copies(recipe)
    if float64:
        batch = _to_float64(model, opt, batch)
    hooks = _with_modules(tap, model) if tap.recording else ()
    try:
        with tap:
            metrics, state, _ = _eager(ref, recipe, model, opt, batch, seed)
    finally:
        for h in hooks:
            h.remove()
    return metrics, state


def _values(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Eager metrics in the form the runtime writes them (``{"values": [...]}``)."""
    return {k: {"values": torch.as_tensor(v).double().reshape(-1).tolist()}
            for k, v in metrics.items()}  # fmt: skip


def arbitrate(
    recipe: Any,
    ref: Reference,
    arbiter: Reference,
    batch: dict[str, torch.Tensor],
    seed: int | None,
    bundle: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]],
    metric_names: list[str],
    state_names: list[str],
    failing: set[str],
    before: Mapping[str, torch.Tensor],
    bounds: Bounds,
) -> TieVerdict:
    """Look for ReLU ties float64 can decide the bundle's way (module docstring).

    Args:
      recipe: the recipe (copied, never stepped).
      ref, arbiter: the float32 eager step and the float64 one.
      batch, seed: the example batch and the bundle's seed.
      bundle: the bundle's metrics (as the runtime writes them) and state after the step.
      metric_names, state_names: what the check compares.
      failing: the tensors the check would refuse: judged first.
      before: the state before the step.
      bounds: the check's bounds (float32's).
    """
    t0, cpu0 = time.perf_counter(), time.process_time()

    def done(**kw: Any) -> TieVerdict:
        return TieVerdict(seconds=time.perf_counter() - t0,
                          cpu_seconds=time.process_time() - cpu0, **kw)  # fmt: skip

    # The float32 step again, every ReLU-like call's input kept.
    tap = _Tap()
    try:
        m32, s32 = _step(ref, recipe, batch, seed, tap, float64=False)
        if not tap.kept:
            return done(reason="the step has no ReLU-like operation")
        # The float64 step, each call compared with the float32 one as it runs.
        scan = _Tap(kept=tap.kept)
        m64, s64 = _step(arbiter, recipe, batch, seed, scan, float64=True)
    except _Mismatch as e:
        return done(reason=f"the float64 step's ReLU-like calls are not the float32 step's ({e})")
    except (CannotReproduce, CheckCouldNotRun) as e:
        return done(reason=f"the steps could not be run again to look for ties ({e})")
    if scan.calls != len(scan.kept):
        return done(reason="the float64 step made another number of ReLU-like calls")
    found = []
    for t in scan.found:
        grad = scan.gradients.get((t.call, t.index), math.nan)
        if grad == 0.0:  # deciding it otherwise moves no gradient
            continue
        module, nth = tap.where[t.call]
        found.append(dataclasses.replace(t, module=module, module_call=nth, gradient=grad))
    found.sort(key=lambda t: t.rank)
    found = found[:TIE_CANDIDATES]
    if not found:
        return done(reason="no ReLU input is within float32's rounding of its kink")
    names = [*metric_names, *state_names]
    own: dict[str, float] = {}  # PyTorch float32's own distance from float64, as asked

    def own_of(asked: list[str]) -> dict[str, float]:
        new = [n for n in asked if n not in own]
        if new:
            fm = [n for n in new if n in metric_names]
            fs = [n for n in new if n not in metric_names]
            own.update({v.name: v.ratio for v in judge(fm, fs, (_values(m32), s32), (m64, s64),
                                                       before, bounds, dtypes=False)})  # fmt: skip
        return own

    trials: list[tuple[Tie, ...]] = [(t,) for t in found]
    trials += list(itertools.combinations(found[:TIE_PAIRED], 2))
    reruns = 0
    first = [n for n in names if n in failing]
    rest = [n for n in names if n not in failing]
    for flips in trials[:TIE_RERUNS]:
        reruns += 1
        try:
            mx, sx = _step(arbiter, recipe, batch, seed, _Tap(kept=scan.kept, flips=flips),
                           float64=True)  # fmt: skip
        except (_Mismatch, CannotReproduce, CheckCouldNotRun):
            continue  # a flip that changed which calls the step makes, or their shapes
        verdicts: list[Verdict] = []
        for group in (first, rest):
            got = _judged(group, metric_names, bundle, (mx, sx), s32, s64, own_of, before, bounds)
            verdicts += got
            if any(v.ratio > 1.0 for v in got):
                break
        else:
            return done(flipped=flips, verdicts=verdicts, candidates=len(found), reruns=reruns)
    return done(
        candidates=len(found),
        reruns=reruns,
        reason=(
            f"float64 with {'the ReLU input' if len(found) == 1 else f'each of the {len(found)} ReLU inputs'}"
            f" nearest {'its' if len(found) == 1 else 'their'} kink within float32's rounding "
            f"decided the other way{', alone and in pairs' if len(found) > 1 else ''} "
            f"({reruns} float64 step{'s' if reruns != 1 else ''}) does not match the bundle either"
        ),
    )


def _judged(
    names: list[str],
    metric_names: list[str],
    bundle: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]],
    flipped: tuple[Mapping[str, Any], Mapping[str, torch.Tensor]],
    eager: Mapping[str, torch.Tensor],
    float64: Mapping[str, torch.Tensor],
    own: Callable[[list[str]], Mapping[str, float]],
    before: Mapping[str, torch.Tensor],
    bounds: Bounds,
) -> list[Verdict]:
    """``names`` of the bundle against the flipped float64 step, each ratio over what it is
    allowed: its bound, or twice PyTorch float32's own distance from (unflipped) float64
    where that is larger; a tensor with a row that looks dropped (``Verdict.suspect``)
    judged by ``update_verdicts``, eager's own distance measured from ``float64``."""
    fm = [n for n in names if n in metric_names]
    fs = [n for n in names if n not in metric_names]
    out = []
    suspect = set()
    found = judge(fm, fs, bundle, flipped, before, bounds, dtypes=False)
    # PyTorch float32's own distance, asked only where the bound alone does not suffice
    ratios = own([v.name for v in found if v.ratio > 1.0 or v.suspect])
    for v in found:
        allowed = max(1.0, 2.0 * ratios.get(v.name, 0.0))
        if v.ratio <= allowed and v.suspect:
            suspect.add(v.name)
        out.append(Verdict(v.name, v.ratio / allowed, v.where, v.bundle, v.eager, v.detail,
                           v.distance, v.update, v.against))  # fmt: skip
    if suspect:
        rows = update_verdicts(suspect, bundle[1], eager, flipped[1], before, bounds,
                               own=float64)  # fmt: skip
        out = [rows.get(v.name, v) if v.name in suspect else v for v in out]
    return out
