"""Activation checkpointing as the user wrote it: the recomputation kept a recomputation.

``torch.utils.checkpoint`` (either kind: ``use_reentrant=False``, or the reentrant one
Hugging Face's ``gradient_checkpointing_enable()`` uses by default) runs a segment's
forward again in the backward pass instead of keeping its activations, and the capture
records both runs. In one program the second run is the first one's operations on the
same values, so XLA's common-subexpression elimination merges them, and the program
keeps every activation again: a model checkpointed to fit a chip's memory would not.

So while the step is captured (``recompute_behind_barriers``), each recomputation reads
its inputs through ``stepbundle::optimization_barrier`` (``stablehlo.optimization_barrier``
in the program: values XLA may not look through), as ``jax.checkpoint`` does: the
recomputed operations read other values than the forward's, and stay. The barrier is the
identity on values and on gradients, so the step computes what eager PyTorch computes.

Imports: torch, stepbundle.frontend.errors, this package's registry (which operators draw).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from stepbundle.frontend.errors import ExportError
from stepbundle.frontend.segments import refuse_gradless_reentrant_segment

from .registry import draws_nothing

__all__ = ["optimization_barrier", "recompute_behind_barriers"]


@torch.library.custom_op("stepbundle::optimization_barrier", mutates_args=())
def optimization_barrier(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors ``xs`` (new ones: a custom operator may not return its inputs),
    lowered to ``stablehlo.optimization_barrier``."""
    return [x.clone() for x in xs]


@optimization_barrier.register_fake
def _(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


def _setup(ctx: Any, inputs: tuple[list[torch.Tensor]], output: list[torch.Tensor]) -> None:
    # An output requires grad where its input did, no more: the recomputation must save
    # the tensors the forward saved (torch.utils.checkpoint checks that it does).
    (xs,) = inputs
    ctx.mark_non_differentiable(*(o for x, o in zip(xs, output) if not x.requires_grad))


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return list(grads)


optimization_barrier.register_autograd(_backward, setup_context=_setup)


class _NoDraws(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Refuses a random draw in a recomputation that restores the RNG state: eager
    PyTorch's recomputation draws the forward's numbers again (its dropout masks), but
    this front-end's program gives each random operator its own draw (``lowering.py``),
    so the backward pass would use masks the forward never applied."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and not draws_nothing(func, args, kwargs):
            raise ExportError(
                f"The training step draws random numbers ({func}, dropout as a rule) inside a "
                "segment of torch.utils.checkpoint. Eager PyTorch draws them again when it "
                "recomputes the segment (preserve_rng_state=True), and this front-end's "
                "program cannot yet draw the same numbers twice, so its backward pass would "
                "use other dropout masks than its forward. Set the dropout inside checkpointed "
                "segments to 0, or checkpoint with preserve_rng_state=False (eager PyTorch "
                "then draws new numbers too; a Hugging Face model: model."
                "gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'preserve_rng_state': False})), or export with the torch_xla front-end "
                "and torch_xla.utils.checkpoint, whose recomputation replays them."
            )
        return func(*args, **kwargs)


def _restores_rng(recompute: Any) -> bool:
    """Whether a ``use_reentrant=False`` recomputation restores the forward's RNG state
    (``preserve_rng_state``, a variable its closure holds; True where it cannot be read)."""
    code = getattr(recompute, "__code__", None)
    cells = getattr(recompute, "__closure__", None)
    if code is None or not cells or "preserve_rng_state" not in code.co_freevars:
        return True
    return bool(cells[code.co_freevars.index("preserve_rng_state")].cell_contents)


def _behind_barrier(
    fn: Callable[..., Any],
    after: Callable[[], list[torch.Tensor]] = list,
    restores_rng: bool = True,
) -> Callable[..., Any]:
    """``fn`` with its tensor arguments passed through one ``optimization_barrier``,
    together with ``after()`` (gradients the backward pass has computed when the segment
    is recomputed: the recomputation then waits for them, rather than running where the
    forward ran and keeping its activations from there on, as it would with its inputs
    alone behind the barrier)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Tensors anywhere in the arguments (a tuple of rotary tables, the keyword
        # arguments some torch versions hand the recomputation as a dict).
        leaves, spec = pytree.tree_flatten((args, kwargs))
        at = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
        if not at:
            return fn(*args, **kwargs)
        held = optimization_barrier([leaves[i] for i in at] + after())[: len(at)]
        for i, t in zip(at, held):
            # The gradient of what the segment computes flows back into the input as it
            # would without the barrier (the reentrant kind reads it off the input).
            leaves[i] = t
        new, kwargs = pytree.tree_unflatten(leaves, spec)
        with _NoDraws() if restores_rng else contextlib.nullcontext():  # type: ignore[no-untyped-call]
            return fn(*new, **kwargs)

    return run


class _Results(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Keeps the floating-point tensors operators make while it is on, in order (whether
    one requires grad is known only once autograd has seen it, after the operator)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.made: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.made.append(t)
        return out


@contextlib.contextmanager
def recompute_behind_barriers() -> Iterator[list[int]]:
    """While it lasts, every ``torch.utils.checkpoint`` segment recomputes behind a
    barrier; yields a one-element list counting the segments checkpointed."""
    frame_cls = torch_checkpoint._CheckpointFrame
    hook_cls = torch_checkpoint._checkpoint_hook
    reentrant = torch_checkpoint.CheckpointFunction
    frame_init = frame_cls.__init__
    forward = reentrant.__dict__["forward"]
    backward = reentrant.__dict__["backward"]
    count = [0]

    # use_reentrant=False: the segment's forward runs inside ``_checkpoint_hook(frame)``;
    # the last tensor it makes (its result, as a rule) gets a gradient hook, and the
    # recomputation, which the backward starts when it first reads a saved activation of
    # the segment, waits behind the barrier for that gradient where it has arrived.
    class watched(hook_cls):  # type: ignore[misc,valid-type]
        def __init__(self, frame: Any) -> None:
            super().__init__(frame)
            self._frame = frame
            self._mode = _Results()

        def __enter__(self) -> Any:
            out = super().__enter__()
            self._mode.__enter__()  # type: ignore[no-untyped-call]
            return out

        def __exit__(self, *exc: Any) -> Any:
            self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
            # The last result that autograd differentiates (a detached metric the segment
            # also returns, say, gets no gradient to wait for).
            last = next((t for t in reversed(self._mode.made) if t.requires_grad), None)
            self._mode.made.clear()
            if last is not None:
                arrived = self._frame._stepbundle_arrived
                hook = lambda g: arrived.append(g) if g is not None else None  # noqa: E731
                last.register_hook(hook)  # type: ignore[no-untyped-call]
            return super().__exit__(*exc)

    def init(self: Any, recompute_fn: Any, *rest: Any, **kw: Any) -> None:
        count[0] += 1
        arrived: list[torch.Tensor] = []
        self._stepbundle_arrived = arrived
        run = _behind_barrier(recompute_fn, lambda: list(arrived), _restores_rng(recompute_fn))
        frame_init(self, run, *rest, **kw)

    def reentrant_forward(ctx: Any, run_function: Any, preserve: Any, *args: Any) -> Any:
        count[0] += 1
        return forward.__func__(ctx, run_function, preserve, *args)

    # apply, not forward, sees the caller's grad mode (autograd runs forward without grad).
    own_apply = reentrant.__dict__.get("apply")
    saved_apply = reentrant.apply

    def apply(cls: Any, run_function: Any, preserve: Any, *args: Any) -> Any:
        refuse_gradless_reentrant_segment(
            run_function, args, "torch.utils.checkpoint(..., use_reentrant=True)",
            "checkpoint with use_reentrant=False",
        )  # fmt: skip
        return saved_apply(run_function, preserve, *args)

    def reentrant_backward(ctx: Any, *grads: Any) -> Any:
        run = ctx.run_function  # what backward runs again
        arrived = [g for g in grads if isinstance(g, torch.Tensor)]
        ctx.run_function = _behind_barrier(run, lambda: arrived, bool(ctx.preserve_rng_state))
        try:
            return backward.__func__(ctx, *grads)
        finally:
            ctx.run_function = run

    frame_cls.__init__ = init  # type: ignore[method-assign]
    torch_checkpoint._checkpoint_hook = watched  # type: ignore[misc]
    reentrant.forward = staticmethod(reentrant_forward)  # type: ignore[method-assign]
    reentrant.backward = staticmethod(reentrant_backward)  # type: ignore[method-assign]
    reentrant.apply = classmethod(apply)
    try:
        yield count
    finally:
        if own_apply is not None:
            reentrant.apply = own_apply
        else:  # inherited from torch.autograd.Function
            del reentrant.apply
        frame_cls.__init__ = frame_init  # type: ignore[method-assign]
        torch_checkpoint._checkpoint_hook = hook_cls  # type: ignore[misc]
        reentrant.forward = forward  # type: ignore[method-assign]
        reentrant.backward = backward  # type: ignore[method-assign]
