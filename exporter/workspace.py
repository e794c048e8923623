"""Device copies of the user's model and optimizer, and the names of every state tensor.

The exporter never traces on the user's own objects: it deep-copies the model and the
optimizer together (so the optimizer keeps pointing at the copied parameters), moves the
copies to the XLA device, re-points the optimizer at the moved parameters by name, and
materializes the optimizer state a fresh optimizer would create on its first step. The
user's objects are therefore exactly as they were after an export.

Every device tensor the workspace makes also has its value on the host without a copy
(``Workspace.host_value``, what the writer reads): the user's own CPU tensor it was copied
from, or, for the state it makes (a fresh optimizer's, zero gradients), one element
expanded to the tensor's shape (``fresh_state.described``). Copying those back from the
device cost 12 bytes per parameter with AdamW (issue #40).

Imports: torch; torch_xla through ``xla.py`` only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from stepbundle.frontend.errors import not_a_parameter
from stepbundle.frontend.fresh_state import (
    NEEDS_CAPTURABLE,
    adam_first_state,
    described,
    sgd_first_state,
    take_capturable,
)
from stepbundle.frontend.hyperparameters import declare_hyperparameters
from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.user_objects import UserObjects
from stepbundle.schema.manifest import StateKind

from . import xla
from .optimizers import check_optimizer, fresh_state

__all__ = ["StateTensor", "Workspace", "move_to_device", "named_state", "xla_device"]


def xla_device() -> torch.device:
    """The default XLA device (created on first use, before any autograd runs)."""
    return xla.device()


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of the workspace, under its primary name."""

    name: str
    kind: StateKind
    tensor: torch.Tensor
    trainable: bool
    aliases: tuple[str, ...] = ()


def _set_parameter(model: torch.nn.Module, dotted: str, value: torch.nn.Parameter) -> None:
    owner_name, _, leaf = dotted.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._parameters[leaf] = value


def _set_buffer(model: torch.nn.Module, dotted: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = dotted.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._buffers[leaf] = value


def _group_names(named: Iterator[tuple[str, torch.Tensor]]) -> dict[int, list[str]]:
    """Names of each distinct tensor object, first name first (tied weights share one)."""
    out: dict[int, list[str]] = {}
    for name, t in named:
        if t is None:
            continue
        out.setdefault(id(t), []).append(name)
    return out


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One copy of ``t`` on ``device``, made with ``to(device, copy=True)``: with
    ``to(device).clone()`` torch_xla's lazy clone kept the first device copy alive beside
    the clone, 4 bytes per float32 element more at the export's peak. A 0-d tensor keeps
    the clone: copied directly, its value reached the first traced step as a constant and
    an input only in the second (seen with a stepped ASGD's ``eta`` and NAdam's state), so
    the two traces differed."""
    t = t.detach()
    if t.dim() == 0:
        return t.to(device).clone()
    return t.to(device, copy=True)


def _move_value(
    value: Any, device: torch.device, *, keep_on_host: bool, host: _HostValues | None = None
) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    # State the optimizer deliberately keeps on the host (a non-capturable Adam's step
    # count) stays there; the tracer then sees it as a changing host value.
    if keep_on_host:
        return value.detach().cpu().clone()
    moved = _to_device(value, device)
    if host is not None:
        host.record(moved, value)
    return moved


class _HostValues:
    """Each device tensor the workspace made -> its value on the host, not copied back."""

    def __init__(self) -> None:
        self._of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(self, made: torch.Tensor, value: torch.Tensor) -> None:
        """``made`` holds ``value`` (used only where it is a CPU tensor: the user's own,
        which nothing writes, or a described fill)."""
        if value.device.type == "cpu" and made.device.type != "cpu":
            self._of[id(made)] = (made, value.detach())

    def get(self, made: torch.Tensor) -> torch.Tensor | None:
        found = self._of.get(id(made))
        return found[1] if found is not None and found[0] is made else None


def move_to_device(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> None:
    """Move ``model`` and the optimizer built on it to ``device``, in place.

    ``module.to(xla)`` creates new Parameter objects, one module at a time: that unties
    tied weights and leaves an optimizer built on the CPU pointing at the old
    parameters. This re-ties them and re-points the optimizer's ``param_groups`` and
    state at the moved parameters, matching them by name. Gradients move too.
    """
    param_groups = _group_names(model.named_parameters(remove_duplicate=False))
    buffer_groups = _group_names(model.named_buffers(remove_duplicate=False))
    name_of_param = {pid: names[0] for pid, names in param_groups.items()}
    grads = {name_of_param[id(p)]: p.grad for p in model.parameters() if p.grad is not None}
    old_groups = [list(g["params"]) for g in optimizer.param_groups] if optimizer else []
    old_state = optimizer.state if optimizer else {}
    model.to(device)
    for names in param_groups.values():
        p = model.get_parameter(names[0])
        for alias in names[1:]:
            _set_parameter(model, alias, p)
    for names in buffer_groups.values():
        b = model.get_buffer(names[0])
        for alias in names[1:]:
            _set_buffer(model, alias, b)
    new_by_name = dict(model.named_parameters(remove_duplicate=False))
    for name, g in grads.items():
        new_by_name[name].grad = _to_device(g, device)
    if optimizer is None:
        return
    for group, old_params in zip(optimizer.param_groups, old_groups):
        moved = []
        for old_p in old_params:
            pname = name_of_param.get(id(old_p))
            if pname is None:
                raise not_a_parameter(optimizer, old_p)
            moved.append(new_by_name[pname])
        group["params"] = moved
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for old_p, st in old_state.items():
        pname = name_of_param.get(id(old_p))
        if pname is None:
            continue
        newp = new_by_name[pname]
        host_step = _keeps_host_step(optimizer, group_of.get(id(newp), {}))
        new_state[newp] = {
            k: _move_value(v, device, keep_on_host=host_step and k == "step") for k, v in st.items()
        }
    optimizer.state = new_state


def named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[StateTensor]:
    """Every state tensor under its primary name, in a stable order.

    Order: parameters, buffers (model order), optimizer state (param_groups order,
    then the optimizer's key order), gradients (model order). Names: ``state_dict()``
    keys, ``optimizer.state.<param name>.<key>``, ``<param name>.grad``.
    """
    out: list[StateTensor] = []
    param_groups = _group_names(model.named_parameters(remove_duplicate=False))
    trainable = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    params: dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}
    name_of: dict[int, str] = {}
    for pid, names in param_groups.items():
        name_of[pid] = names[0]
        out.append(
            StateTensor(
                names[0], StateKind.PARAMETER, params[pid], pid in trainable, tuple(names[1:])
            )
        )
    buffers = {id(b): b for _, b in model.named_buffers(remove_duplicate=False) if b is not None}
    for bid, names in _group_names(model.named_buffers(remove_duplicate=False)).items():
        out.append(StateTensor(names[0], StateKind.BUFFER, buffers[bid], False, tuple(names[1:])))
    for group in optimizer.param_groups:
        for p in group["params"]:
            pname = name_of[id(p)]
            for key, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out.append(
                        StateTensor(
                            f"optimizer.state.{pname}.{key}", StateKind.OPTIMIZER_STATE, v, False
                        )
                    )
    for pid, names in param_groups.items():
        g = params[pid].grad
        if g is not None:
            out.append(StateTensor(f"{names[0]}.grad", StateKind.GRADIENT, g, False))
    return out


class Workspace(UserObjects):
    """The user's model and optimizer, temporarily holding device copies of their state.

    The exporter traces the user's own objects, so that everything their step refers
    to (a scheduler built on the optimizer, a closure over the model) sees what the
    traced step does. What is swapped in is a device copy of every parameter, buffer,
    gradient and optimizer-state tensor, and new ``param_groups`` contents; ``restore``
    puts the original objects back. The user's tensors are never written to, so
    after an export the model and optimizer are exactly as they were.

    Attributes:
      model, optimizer: the user's objects (holding device copies until ``restore``).
      device: the XLA device.
      hyperparameters: declared hyperparameter name -> its device tensor.
    """

    def __init__(
        self,
        recipe: Recipe,
        device: torch.device,
        *,
        zero_grads: bool = True,
        no_gradient: frozenset[str] = frozenset(),
    ) -> None:
        self.device = device
        self._host = _HostValues()
        super().__init__(recipe.model, recipe.optimizer)
        self._hyper_keys = tuple(recipe.hyperparameters)
        self._restored = False
        try:
            self._swap_in(zero_grads, no_gradient)
        except BaseException:
            self.restore()
            raise

    def _swap_in(self, zero_grads: bool, no_gradient: frozenset[str]) -> None:
        device, model, optimizer = self.device, self.model, self.optimizer
        # Before the state moves: a capturable optimizer keeps its step on the device.
        # On torch_xla, Adam's and AdamW's non-capturable step count is a host number
        # baked into the trace as well.
        self.capturable_note = take_capturable(optimizer, (*NEEDS_CAPTURABLE, "Adam", "AdamW"))
        check_optimizer(optimizer)
        host = self._host
        params: dict[int, torch.nn.Parameter] = {}
        for m, saved in zip(self._modules, self._saved_params):
            for k, p in saved.items():
                if p is None:
                    continue
                new = params.get(id(p))
                if new is None:
                    new = torch.nn.Parameter(_to_device(p, device), requires_grad=p.requires_grad)
                    host.record(new, p)
                    if p.grad is not None:
                        new.grad = _to_device(p.grad, device)
                        host.record(new.grad, p.grad)
                    params[id(p)] = new
                m._parameters[k] = new
        buffers: dict[int, torch.Tensor] = {}
        for m, saved_b in zip(self._modules, self._saved_buffers):
            for k, b in saved_b.items():
                if b is None:
                    continue
                if id(b) not in buffers:
                    buffers[id(b)] = _to_device(b, device)
                    host.record(buffers[id(b)], b)
                m._buffers[k] = buffers[id(b)]
        for group in optimizer.param_groups:
            moved = []
            for p in group["params"]:
                if id(p) not in params:
                    raise not_a_parameter(optimizer, p)
                moved.append(params[id(p)])
            group["params"] = moved
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for old_p, st in self._saved_state.items():
            newp = params.get(id(old_p))
            if newp is None:
                continue
            host_step = _keeps_host_step(optimizer, group_of.get(id(newp), {}))
            state[newp] = {
                k: _move_value(v, device, keep_on_host=host_step and k == "step", host=host)
                for k, v in st.items()
            }
        optimizer.state = state
        self._materialize_optimizer_state()
        # Gradients: the value a parameter's .grad holds between steps is state when
        # the user keeps it. Start every trainable parameter with its grad (zeros
        # when it has none): zeros are what a first backward accumulates into, so the
        # traced step is the steady-state step from the very first call. Not those
        # the step's backward never reaches (``no_gradient``, found by a first trace):
        # in eager their grad stays None and the optimizer skips them, where a zero
        # grad would still get weight decay and momentum.
        for name, p in model.named_parameters():
            if zero_grads and p.requires_grad and p.grad is None and name not in no_gradient:
                p.grad = torch.zeros_like(p)
                host.record(p.grad, torch.zeros((), dtype=p.dtype).expand(p.shape))
        family = _optimizer_family(optimizer)
        self._declared = declare_hyperparameters(optimizer, self._hyper_keys, device, family)
        self.hyperparameters: dict[str, torch.Tensor] = self._declared.tensors

    def restore(self) -> None:
        """Put the user's original parameters, buffers and optimizer contents back (once)."""
        if self._restored:
            return
        self._restored = True
        super().restore()

    def _materialize_optimizer_state(self) -> None:
        """Create the state a fresh optimizer builds on its first step, as the step would,
        and its value on the host as described fills (made again by the same rule for a
        one-element parameter on the CPU)."""
        opt = self.optimizer
        kind = _optimizer_family(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                if not p.requires_grad or opt.state.get(p):
                    continue
                made = _first_state(opt, kind, group, p, self.device)
                # An optimizer stepbundle does not know: if its first step creates state,
                # the tracer notices and asks the user to step once before exporting.
                if not made:
                    continue
                opt.state[p] = made
                one = torch.zeros((1,) * p.dim(), dtype=p.dtype)
                values = described(made, _first_state(opt, kind, group, one, one.device))
                for key, t in made.items():
                    self._host.record(t, values[key])

    def host_value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The value device tensor ``t`` (one of the workspace's state tensors) held when
        the workspace made it, as a CPU tensor that is no copy of it (the user's own, or
        one element expanded: ``_HostValues``); None for a tensor the workspace did not make."""
        return self._host.get(t)

    def replaced_hyperparameters(self) -> list[str]:
        """Declared hyperparameters whose tensor is no longer in ``param_groups`` (code in
        the step, such as a scheduler, put another value there)."""
        return self._declared.replaced(self.optimizer)

    def state_tensors(self) -> list[StateTensor]:
        """Every state tensor of the workspace (see ``named_state``)."""
        return named_state(self.model, self.optimizer)

    def host_state(self) -> list[str]:
        """Names of optimizer state tensors that live on the host, not the device."""
        return [s.name for s in self.state_tensors() if s.tensor.device.type != self.device.type]

    def optimizer_hints(self) -> list[str]:
        """Known causes of step-dependent host values in this optimizer's settings."""
        hints = []
        opt = self.optimizer
        fam = _optimizer_family(opt)
        if fam == "adam" and not all(
            g.get("capturable", False) or g.get("fused", False) for g in opt.param_groups
        ):
            hints.append(
                f"{type(opt).__name__} was built with capturable=False, so its step count "
                "lives on the host and its bias correction is baked into the graph as a "
                "number that changes every step. Build it with capturable=True (foreach "
                "either way)."
            )
        return hints


def _first_state(
    opt: torch.optim.Optimizer,
    kind: str,
    group: dict[str, Any],
    p: torch.Tensor,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The state ``opt``'s first step creates for ``p``, on ``device`` where torch keeps it
    there (empty: no state, or an optimizer with no rule)."""
    if kind == "adam":
        on_device = group.get("capturable", False) or group.get("fused", False)
        step = (
            torch.zeros((), dtype=torch.get_default_dtype(), device=device)
            if on_device
            else torch.tensor(0.0, dtype=torch.get_default_dtype())
        )
        return adam_first_state(group, p, step)
    if kind == "syncfree_adam":
        return {
            "step": torch.zeros((), dtype=torch.float32, device=device),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            "max_exp_avg_sq": (
                torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]
                else torch.empty(0, dtype=torch.float32, device=device)
            ),
        }
    if kind in ("sgd", "syncfree_sgd"):
        s: dict[str, torch.Tensor] = {}
        if kind == "syncfree_sgd":
            s["step"] = torch.zeros((), dtype=torch.float32, device=device)
        s.update(sgd_first_state(opt, group, p))
        return s
    # Every other torch.optim optimizer, by its own creation rule.
    return fresh_state(opt, group, p) or {}


def _optimizer_family(opt: torch.optim.Optimizer) -> str:
    syncfree = xla.syncfree_family(opt)
    if syncfree is not None:
        return syncfree
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(opt, torch.optim.SGD):
        return "sgd"
    return "other"


def _keeps_host_step(opt: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether torch keeps this group's Adam step count on the host (not capturable)."""
    return _optimizer_family(opt) == "adam" and not (
        group.get("capturable", False) or group.get("fused", False)
    )
