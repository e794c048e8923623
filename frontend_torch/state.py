"""The training state of a recipe, by name, and the sandbox the step is traced in.

``state_slots`` lists every tensor a step may read or write under the names PyTorch users
know, in the order the torch_xla front-end uses (``stepbundle.exporter.workspace``), so
both front-ends write the same state table: parameters (``state_dict()`` keys; a tied
parameter under its first name, the others as aliases), buffers, optimizer state
(``optimizer.state.<param name>.<key>``), gradients (``<param name>.grad``).

A weights-free export (``Recipe(include_state=False)``) copies nothing: a slot's value is
the user's own tensor (which nothing writes; on the ``meta`` device when the recipe built
its model there), and the state the front-end makes (a fresh optimizer's, zero gradients)
is one element expanded to its shape (``stepbundle.frontend.fresh_state.described``), so
that a model of billions of parameters costs its shapes only; the tracer feeds fake
tensors in their place (``capture.py``).

``Sandbox`` lets the tracer run the user's own step on the user's own objects, with
tracer tensors in place of every state tensor, and puts the original objects back
afterwards: the user's model and optimizer are never written to.

Imports: torch, stepbundle.schema, stepbundle.exporter's torch_xla-free modules.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stepbundle.frontend.errors import ExportError, MetaTensorError, not_a_parameter
from stepbundle.frontend.fresh_state import (
    adam_first_state,
    described,
    fresh_state,
    sgd_first_state,
)
from stepbundle.frontend.initial_state import non_persistent_buffers
from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.user_objects import UserObjects
from stepbundle.schema.manifest import StateKind

__all__ = ["Sandbox", "Slot", "described", "state_slots"]


@dataclass(frozen=True)
class Slot:
    """One state tensor.

    Attributes:
      name: its primary name; aliases: its other names (tied parameters).
      kind: parameter, buffer, optimizer state or gradient.
      value: its value at export (a CPU tensor; a fresh optimizer's first-step state and
        the zero gradients are made here, never in the user's objects). In a weights-free
        export: the user's tensor itself (perhaps on ``meta``), or a made tensor as one
        element expanded to its shape (``described``).
      trainable: a parameter the optimizer updates.
      param: for optimizer state and gradients, the id of the user's parameter they
        belong to; for parameters, the parameter's own id.
      key: the optimizer-state key (``exp_avg``...), or ``""``.
    """

    name: str
    kind: StateKind
    value: torch.Tensor
    trainable: bool = False
    aliases: tuple[str, ...] = ()
    param: int = 0
    key: str = ""


def _group_names(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, list[str]]:
    """id -> every name of that tensor, in the module's order (first name first)."""
    names: dict[int, list[str]] = {}
    for name, t in named:
        if t is not None:
            names.setdefault(id(t), []).append(name)
    return names


def _fresh_state(
    opt: torch.optim.Optimizer, group: Mapping[str, Any], p: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The state a fresh optimizer creates on its first step, as it would (the front-end
    core's table)."""
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return adam_first_state(group, p, torch.zeros((), dtype=torch.get_default_dtype()))
    if isinstance(opt, torch.optim.SGD):
        return sgd_first_state(opt, group, p)
    fresh = fresh_state(opt, dict(group), p)
    # Optimizers the table does not know: if their first step creates state, the tracer
    # notices and asks the user to step once before exporting.
    return {} if fresh is None else fresh


def _zero(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=p.dtype).expand(p.shape)


def _first_names(names: list[str]) -> str:
    """The first three names, quoted, and "..." when there are more."""
    return ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")


def _meta_refusal(recipe: Recipe) -> MetaTensorError | None:
    on_meta = [n for n, t in recipe.model.state_dict(keep_vars=True).items() if t.is_meta]
    if not on_meta:
        return None
    shown = _first_names(on_meta)
    return MetaTensorError(
        f"{len(on_meta)} of the model's tensors are on the meta device ({shown}): they have "
        "shapes but no values, and a bundle with its weights stores values. Export without "
        "weights (Recipe(include_state=False), stepbundle export --no-state; a run then takes "
        "them from a checkpoint with --init-from), or materialize the model first "
        "(model.to_empty(device='cpu') and initialize, or load a checkpoint)."
    )


def _refuse_meta_code_buffers(model: torch.nn.Module) -> None:
    """Refuse a non-persistent buffer on meta before tracing: the bundle must store it."""
    non_persistent = non_persistent_buffers(model)
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in non_persistent and b is not None and b.is_meta:
            raise MetaTensorError(
                f"The buffer {name!r} is on the meta device and registered with "
                "persistent=False: no checkpoint holds it, so the bundle must store its "
                "values, and a meta tensor has none. Compute it on the CPU after building "
                "the model on meta (for rotary tables: model.<buffer> = <cos/sin made with "
                "device='cpu'>), then export."
            )


def state_slots(recipe: Recipe, *, zero_grads: bool) -> list[Slot]:
    """Every state tensor of the recipe, in the bundle's order.

    With ``zero_grads``, every trainable parameter without a gradient gets a zero one
    (what a first backward accumulates into), so that the traced step is the steady-state
    step; a step that drops its gradients is traced again without.

    Raises:
      MetaTensorError: a weights-holding export of a model, optimizer state or gradient
        on the meta device, or a non-persistent buffer on meta in any export.
    """
    model, opt = recipe.model, recipe.optimizer
    light = not recipe.include_state
    if not light and (refusal := _meta_refusal(recipe)) is not None:
        raise refusal
    # either way: state_dict() leaves non-persistent buffers out, and the bundle stores them
    _refuse_meta_code_buffers(model)

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if light else t.detach().clone()

    out: list[Slot] = []
    trainable = {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad}
    params: dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}
    param_names = _group_names(model.named_parameters(remove_duplicate=False))
    name_of: dict[int, str] = {}
    for pid, names in param_names.items():
        name_of[pid] = names[0]
        value = keep(params[pid])
        out.append(
            Slot(names[0], StateKind.PARAMETER, value, pid in trainable, tuple(names[1:]), pid)
        )
    buffers = {id(b): b for _, b in model.named_buffers(remove_duplicate=False) if b is not None}
    for bid, names in _group_names(model.named_buffers(remove_duplicate=False)).items():
        value = keep(buffers[bid])
        out.append(Slot(names[0], StateKind.BUFFER, value, False, tuple(names[1:])))
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in name_of:
                raise not_a_parameter(opt, p)
            st = opt.state.get(p)
            if not st and p.requires_grad:
                if light:  # shapes from a meta parameter, values from a one-element one
                    st = described(
                        _fresh_state(opt, group, torch.empty_like(p, device="meta")),
                        _fresh_state(opt, group, torch.zeros((1,) * p.dim(), dtype=p.dtype)),
                    )
                else:
                    st = _fresh_state(opt, group, p)
            for key, v in (st or {}).items():
                if isinstance(v, torch.Tensor):
                    out.append(
                        Slot(
                            f"optimizer.state.{name_of[id(p)]}.{key}",
                            StateKind.OPTIMIZER_STATE,
                            keep(v),
                            param=id(p),
                            key=key,
                        )
                    )
    for pid, names in param_names.items():
        p = params[pid]
        g = p.grad
        if g is None and zero_grads and p.requires_grad:
            g = _zero(p) if light else torch.zeros_like(p)
        if g is not None:
            out.append(Slot(f"{names[0]}.grad", StateKind.GRADIENT, keep(g), param=pid))
    if not light:  # optimizer state or gradients left on meta: refused before any tracing
        on_meta = [s.name for s in out if s.value.is_meta]
        if on_meta:
            shown = _first_names(on_meta)
            raise MetaTensorError(
                f"{len(on_meta)} state tensor(s) are on the meta device ({shown}): they have "
                "shapes but no values, and a bundle with its weights stores values. Export "
                "without weights (Recipe(include_state=False), stepbundle export --no-state), "
                "or give them values on the CPU first."
            )
    return out


class Sandbox(UserObjects):
    """The user's model and optimizer, temporarily holding other tensors as their state.

    ``install`` swaps given tensors (the tracer's) in for every state tensor: new
    ``nn.Parameter`` objects in the modules and ``param_groups``, a new ``optimizer.state``,
    new gradients, declared hyperparameters as tensors in ``param_groups``. ``read``
    returns what each state slot holds after the step. ``restore`` (or leaving the
    ``with`` block) puts every original object back.
    """

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(recipe.model, recipe.optimizer)
        self._saved_grad = {id(p): p.grad for p in self.model.parameters()}
        self._new_params: dict[int, torch.nn.Parameter] = {}
        # Each buffer registration (module index, key) -> the buffer's primary name.
        primary = {
            bid: names[0]
            for bid, names in _group_names(self.model.named_buffers(remove_duplicate=False)).items()
        }
        self._buffer_at = {
            (i, k): primary[id(b)]
            for i, saved in enumerate(self._saved_buffers)
            for k, b in saved.items()
            if b is not None
        }

    def install(
        self,
        slots: list[Slot],
        values: Mapping[str, torch.Tensor],
        hyperparameters: Mapping[tuple[int, str, int | None], torch.Tensor],
    ) -> None:
        """Put ``values`` (by slot name) in place of the state, and the hyperparameter
        tensors (by (group index, key, tuple element or None)) into ``param_groups``."""
        new: dict[int, torch.nn.Parameter] = {}
        for s in slots:
            if s.kind is StateKind.PARAMETER:
                old = self._param_object(s.param)
                new[s.param] = torch.nn.Parameter(values[s.name], requires_grad=old.requires_grad)
        self._new_params = new
        for m, saved_p in zip(self._modules, self._saved_params):
            for k, p in saved_p.items():
                if p is not None:
                    m._parameters[k] = new[id(p)]
        for (i, k), name in self._buffer_at.items():
            self._modules[i]._buffers[k] = values[name]
        for group, saved in zip(self.optimizer.param_groups, self._saved_groups):
            group["params"] = [new[id(p)] for p in saved["params"]]
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for old_p, st in self._saved_state.items():
            if id(old_p) in new:
                state[new[id(old_p)]] = {
                    k: copy.deepcopy(v) for k, v in st.items() if not isinstance(v, torch.Tensor)
                }
        for s in slots:
            if s.kind is StateKind.OPTIMIZER_STATE:
                state[new[s.param]][s.key] = values[s.name]
            elif s.kind is StateKind.GRADIENT:
                new[s.param].grad = values[s.name]
        self.optimizer.state = state
        for (i, key, index), t in hyperparameters.items():
            group = self.optimizer.param_groups[i]
            if index is None:
                group[key] = t
            else:  # one element of a tuple setting (Adam's betas.0); the rest stay numbers
                elems = list(group[key])
                elems[index] = t
                group[key] = type(group[key])(elems)

    def _param_object(self, pid: int) -> torch.Tensor:
        for saved in self._saved_params:
            for p in saved.values():
                if p is not None and id(p) == pid:
                    return p
        raise KeyError(pid)  # pragma: no cover - slots come from the same model

    def read(self, slots: list[Slot]) -> dict[str, torch.Tensor | None]:
        """What each slot holds now (None: the step dropped it, as a gradient set to None).

        Raises:
          ExportError: the step replaced a parameter object, or created optimizer state.
        """
        out: dict[str, torch.Tensor | None] = {}
        new = self._new_params
        for m, saved_p in zip(self._modules, self._saved_params):
            for k, p in saved_p.items():
                if p is not None and m._parameters.get(k) is not new[id(p)]:
                    raise ExportError(
                        f"The training step replaced the parameter {k!r} of a "
                        f"{type(m).__name__} with another object. Update parameters in "
                        "place (the optimizer does); a bundle replays in-place updates only."
                    )
        buffers: dict[str, torch.Tensor | None] = {}
        for (i, k), name in self._buffer_at.items():
            buffers.setdefault(name, self._modules[i]._buffers.get(k))
        known = {(s.param, s.key) for s in slots if s.kind is StateKind.OPTIMIZER_STATE}
        for old_pid, p in new.items():
            for key, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and (old_pid, key) not in known:
                    raise ExportError(
                        f"The training step created new optimizer state "
                        f"({type(self.optimizer).__name__} state {key!r}). The first step of "
                        "an optimizer stepbundle does not know lazily creates its state; take "
                        "one optimizer step before exporting so that the state exists, then "
                        "export."
                    )
        for s in slots:
            if s.kind is StateKind.PARAMETER:
                out[s.name] = new[s.param]
            elif s.kind is StateKind.BUFFER:
                out[s.name] = buffers.get(s.name)
            elif s.kind is StateKind.OPTIMIZER_STATE:
                v = self.optimizer.state.get(new[s.param], {}).get(s.key)
                out[s.name] = v if isinstance(v, torch.Tensor) else None
            else:
                out[s.name] = new[s.param].grad
        return out

    def uninstall(self) -> None:
        """Put the user's parameters, buffers, gradients and optimizer state back, but keep
        what the step did to ``param_groups``' settings (the next capture sees it, as the
        next eager step would); ``restore`` puts those back too."""
        for m, ps, bs in zip(self._modules, self._saved_params, self._saved_buffers):
            m._parameters.clear()
            m._parameters.update(ps)
            m._buffers.clear()
            m._buffers.update(bs)
        for group, saved in zip(self.optimizer.param_groups, self._saved_groups):
            group["params"] = saved["params"]
        self.optimizer.state = self._saved_state
        self._new_params = {}

    def restore(self) -> None:
        """Put the user's original parameters, buffers, gradients and optimizer contents
        back."""
        super().restore()
        for p in self.model.parameters():
            if p.grad is not self._saved_grad.get(id(p)):  # pragma: no cover - never set
                p.grad = self._saved_grad.get(id(p))
        self._new_params = {}
