"""The export check's eager side: the step a bundle must reproduce, run in PyTorch on copies
of the recipe's model and optimizer (``Reference``; ``CPU_EAGER``), its state read back by
the bundle's names (``state_by_name``), and the float64 arbiter's step (the whole step,
or only the parameters whose tensors failed where that gives the same values).
``step_check.check_bundle`` runs these beside the runtime's process and decides with
``step_compare``.

Imports: torch, the front-end core.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ExportError
from .recipe import Recipe
from .step_compare import Bounds

__all__ = [
    "CPU_EAGER",
    "CannotReproduce",
    "CheckCouldNotRun",
    "Reference",
    "StepRunner",
    "state_by_name",
]

StepRunner = Callable[
    [Recipe, torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor], int | None],
    tuple[Mapping[str, Any], dict[str, torch.Tensor]],
]
"""``(recipe, model, optimizer, batch, seed) -> (metrics, state by name)``: one eager step of
``recipe.step`` on the given copies, the state read back as CPU tensors."""


@dataclass(frozen=True)
class Reference:
    """An eager step a bundle must reproduce.

    Attributes:
      name: what it is, for the export line ("PyTorch eager on the CPU").
      run: runs it (``StepRunner``).
    """

    name: str
    run: StepRunner
    float64: bool = False
    """The same step in float64 is the arbiter of a tensor beyond ``Bounds``, and of a
    suspect update under low-precision bounds (PyTorch on the CPU; not torch_xla eager's
    random numbers, which float64 does not draw)."""
    float64_run: StepRunner | None = None
    """The step the arbiter runs in float64, where not ``run`` (torch_xla eager with
    numerics='torch_xla': PyTorch on the CPU, where both BatchNorms are the same math)."""
    bounds: Bounds | None = None
    """Bounds of its own; None: ``FLOAT32``, or ``LOW_PRECISION`` for a step that computes
    in bfloat16 or float16."""


class CheckCouldNotRun(ExportError):
    """The check itself could not run (the runtime's process failed, or the eager step
    raised); the message says what happened and how to export without the check."""


class CannotReproduce(Exception):  # noqa: N818 - a verdict on the reference, not an error
    """Raised by a ``Reference``'s step that finds it cannot compute what the bundle
    computes (its random draws do not line up with the program's): the check is skipped,
    its message the reason, and no steps whose random numbers differ are compared."""


_NO_CHECK = "export with check=False (stepbundle export --no-check) to skip the check"
"""For a check that could not run (not for a divergence: ``_UNCHECKED_ADVICE``)."""


def state_by_name(
    model: torch.nn.Module, opt: torch.optim.Optimizer, *, copy: bool = True
) -> dict[str, torch.Tensor]:
    """Every state tensor under the bundle's names, on the CPU: ``state_dict()`` keys
    (every name of a tied tensor), ``optimizer.state.<param>.<key>``, ``<param>.grad``.
    ``copy=False`` returns the CPU tensors themselves (read them before they change)."""

    def cpu(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu()
        return t.clone() if copy else t

    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        out[name] = cpu(p)
        if p.grad is not None:
            out[f"{name}.grad"] = cpu(p.grad)
    for name, b in model.named_buffers(remove_duplicate=False):
        if b is not None:
            out[name] = cpu(b)
    for group in opt.param_groups:
        for p in group["params"]:
            pname = first.get(id(p))
            for key, v in opt.state.get(p, {}).items():
                if pname is not None and isinstance(v, torch.Tensor):
                    out[f"optimizer.state.{pname}.{key}"] = cpu(v)
    return out


class _Lazy(Mapping[str, torch.Tensor]):
    """A safetensors file's tensors, each read when asked for (a model's state is not held
    in memory twice over)."""

    def __init__(self, handle: Any) -> None:
        self._f = handle
        self._keys = list(handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._keys:
            raise KeyError(name)
        tensor: torch.Tensor = self._f.get_tensor(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _cpu_step(
    recipe: Recipe,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    seed: int | None,
) -> tuple[Mapping[str, Any], dict[str, torch.Tensor]]:
    for group in opt.param_groups:
        if group.get("capturable", False):
            group["capturable"] = False  # same update; torch refuses capturable on the CPU
    metrics = recipe.step(model, opt, {k: v.cpu() for k, v in batch.items()})
    return metrics, state_by_name(model, opt, copy=False)  # the copies are the check's own


CPU_EAGER = Reference("PyTorch eager on the CPU", _cpu_step, float64=True)


@contextlib.contextmanager
def _autocast_seen(model: torch.nn.Module) -> Iterator[list[bool]]:
    """Records whether any of the model's modules ran under autocast (any device type):
    the step may enter it around the model, or the model inside its own forward (then
    only the modules it calls see it)."""
    seen = [False]

    def hook(*_: Any) -> None:
        if seen[0]:  # one module under autocast answers it: the rest need not ask
            return
        for device_type in ("cpu", "cuda", "xla"):
            with contextlib.suppress(Exception):
                if torch.is_autocast_enabled(device_type):
                    seen[0] = True

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _copies(recipe: Recipe) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A deep copy of the model and optimizer (together, so the optimizer points at the
    copied parameters)."""
    try:
        model, opt = copy.deepcopy((recipe.model, recipe.optimizer))
    except Exception as e:
        raise CheckCouldNotRun(
            f"The export check could not copy the model and optimizer to step them "
            f"eagerly ({type(e).__name__}: {e}); {_NO_CHECK}."
        ) from e
    return model, opt


@contextlib.contextmanager
def _threads_beside_the_runtime() -> Iterator[None]:
    """torch's intra-op threads limited to half the machine's cores (at least one) for
    an eager step: the float32 one runs beside the runtime's process, which takes the
    other half; the float64 one, after it, keeps the count.

    With more threads than free cores, torch's workers spin for cores they do not get
    (benchmarks/results/export_check_choices.md measures it on GPT-2 small). A
    check runs beside other work (an export, a test suite's other lane), so the cheaper
    count is the default. The count moves the eager values by rounding at most (the order
    in which a reduction adds its partial sums), which the bounds are made for."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, (os.cpu_count() or 2) // 2)))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _eager(
    ref: Reference,
    recipe: Recipe,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    seed: int | None,
) -> tuple[Mapping[str, Any], dict[str, torch.Tensor], bool]:
    try:
        with (
            torch.random.fork_rng(devices=[]),
            _autocast_seen(model) as autocast,
            _threads_beside_the_runtime(),
        ):
            metrics, state = ref.run(recipe, model, opt, batch, seed)
    except (ExportError, CannotReproduce):
        raise
    except Exception as e:
        raise CheckCouldNotRun(
            f"The export check's eager step ({ref.name}) raised {type(e).__name__}: {e}. "
            f"{_NO_CHECK[0].upper()}{_NO_CHECK[1:]}."
        ) from e
    return metrics, state, autocast[0]


def _to_float64(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The copies in float64 in place (the optimizer keeps pointing at the parameters:
    ``Module.double`` converts their data), and the batch's floating inputs."""
    model.double()
    for p in model.parameters():
        if p.grad is not None and p.grad.is_floating_point():
            p.grad = p.grad.double()
    for st in opt.state.values():
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                st[k] = v.double()
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def _owners(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Each state name of a parameter, of its gradient and of its optimizer state (as
    ``state_by_name`` names them) -> that parameter."""
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        out[name] = out[f"{name}.grad"] = p
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) in first:
                for key in opt.state.get(p, {}):
                    out[f"optimizer.state.{first[id(p)]}.{key}"] = p
    return out


def _pruned_step(
    ref: Reference,
    recipe: Recipe,
    kept: set[str],
    batch: dict[str, torch.Tensor],
    seed: int | None,
    float64: bool,
) -> tuple[Mapping[str, Any], dict[str, torch.Tensor]]:
    """The eager step on copies whose parameters outside ``kept`` (first names) take no
    gradient: autograd computes no weight gradient the kept ones do not need, and the
    optimizer steps the kept ones alone."""
    model, opt = _copies(recipe)
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    for p in model.parameters():
        p.requires_grad_(first[id(p)] in kept)
    if float64:
        batch = _to_float64(model, opt, batch)
    metrics, state, _ = _eager(ref, recipe, model, opt, batch, seed)
    return metrics, state


def _float64_for(
    recipe: Recipe,
    failing: set[str],
    metric_names: list[str],
    eager_state: Mapping[str, torch.Tensor],
    ref: Reference,
    batch: dict[str, torch.Tensor],
    seed: int | None,
) -> tuple[Mapping[str, Any], dict[str, torch.Tensor]] | None:
    """The float64 step for the failing tensors alone, where they are parameters (or their
    gradients or optimizer state): only those parameters take gradients and are stepped.
    None where that cannot stand for the whole step: a failing metric or buffer, a step
    that raises with parameters frozen, or one whose failing tensors then differ at all
    in float32 (a gradient clipped by the norm of every gradient; the float32 step is run
    pruned once to see it: bit for bit the same values, or the whole float64 step).

    GPT-2 small: two ``c_attn.bias`` tensors need the arbiter; the pruned step leaves
    out every other weight gradient, the layers below them, and the optimizer's update of
    the other parameters and its float64 state."""
    if failing & set(metric_names):
        return None
    owners = _owners(recipe.model, recipe.optimizer)
    first: dict[int, str] = {}
    for name, p in recipe.model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    kept = set()
    for name in failing:
        owner = owners.get(name)
        if owner is None and name.startswith("optimizer.state."):  # state the step created
            owner = owners.get(name[len("optimizer.state.") :].rpartition(".")[0])
        if owner is None:
            return None
        kept.add(first[id(owner)])
    try:
        _, s32 = _pruned_step(ref, recipe, kept, batch, seed, float64=False)
        if not all(n in s32 and torch.equal(s32[n], eager_state[n]) for n in failing):
            return None
        del s32
        return _pruned_step(ref, recipe, kept, batch, seed, float64=True)
    except CheckCouldNotRun:  # e.g. a step that reads every parameter's gradient
        return None
