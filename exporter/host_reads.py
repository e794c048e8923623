"""Refuse a host read of a device value inside a traced step, naming the line that did it.

A step that reads an XLA tensor on the host (``.item()``, ``if t:``, ``float(t)``,
``t.tolist()``, a tensor where torch wants an int) splits into several graphs whose
host-side decisions would be frozen into the bundle. torch_xla's counters can only say
*that* it happened (``trace.py`` still checks them); ``guard_host_reads`` intercepts the
reads themselves as they happen (a ``TorchFunctionMode`` for Python's conversions; for
``aten._local_scalar_dense``, which torch's C++ calls when a tensor is passed where it
wants a number, a kernel that stands in for torch_xla's while the step is traced), and
refuses at the first one
with the file and line of the code that asked (the innermost frame outside torch,
torch_xla and the exporter), the frames that called it, and a fix where one is known.

It also refuses a tensor made inside the step that torch_xla's functionalization does not
track (``UntrackedTensorError``): a ``TorchDispatchMode`` the step enters makes torch_xla's
factory functions return such tensors, and torch_xla drops writes through views of them.

Imports: torch; torch_xla through ``xla.py`` only.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _python_dispatch

from stepbundle.frontend.errors import ExportError

from . import xla

__all__ = ["HostReadError", "UntrackedTensorError", "guard_host_reads"]


class UntrackedTensorError(ExportError):
    """The traced step made an XLA tensor outside torch_xla's functionalization (a
    ``TorchDispatchMode`` was active inside the step), whose writes through views
    torch_xla would drop.

    Attributes:
      location: ``file:line`` of the code that made it.
    """

    def __init__(self, message: str, *, location: str) -> None:
        super().__init__(message)
        self.location = location


class HostReadError(ExportError):
    """The traced step read a device value on the host.

    Attributes:
      location: ``file:line`` of the code that read it (a library's file relative to its
        site-packages folder).
      read: what read it (``Tensor.__bool__``, ``Tensor.item``, ...).
    """

    def __init__(self, message: str, *, location: str, read: str) -> None:
        super().__init__(message)
        self.location = location
        self.read = read


_T = torch.Tensor
_READS: dict[Any, str] = {
    _T.__bool__: "Tensor.__bool__ (a Python `if`, `and`, `or` or `not` on a tensor)",
    _T.item: "Tensor.item()",
    _T.tolist: "Tensor.tolist()",
    _T.__float__: "Tensor.__float__ (float(t))",
    _T.__int__: "Tensor.__int__ (int(t))",
    _T.__index__: "Tensor.__index__ (a tensor where Python wants an integer)",
}

# Known host reads in libraries, by the file's tail: the fix to give.
_KNOWN_FIXES: dict[str, str] = {
    "transformers/modeling_attn_mask_utils.py": (
        "This is Hugging Face's sdpa attention checking on the host whether the "
        "attention_mask is all ones (torch.all(mask == 1)). Load the model with "
        'attn_implementation="eager" (from_pretrained(..., attn_implementation="eager"), '
        'or config._attn_implementation = "eager" before building it), or leave out an '
        "all-ones attention_mask."
    ),
}

_GENERIC_FIX = (
    "Keep the value on the device: torch.where instead of `if`, return tensors as metrics "
    "instead of calling .item(), pass Python numbers (not tensors) where torch wants a "
    "number."
)


def _skipped_roots() -> tuple[str, ...]:
    """Folders whose frames are not the user's or a library's: torch, torch_xla, the
    exporter itself and the standard library."""
    roots = [
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.abspath(__file__)),
        xla.package_dir(),
    ]
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        roots.append(stdlib)
    return tuple(os.path.realpath(r) + os.sep for r in roots)


def _shown(filename: str) -> str:
    """A library file relative to its site-packages folder; other files as given."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    return filename


def _frames() -> list[tuple[str, int, str]]:
    """(shown file, line, function) of the caller's frames, innermost first, outside the
    skipped folders, up to the exporter's own frame that called the step."""
    skipped = _skipped_roots()
    exporter = os.path.realpath(os.path.dirname(os.path.abspath(__file__))) + os.sep
    out: list[tuple[str, int, str]] = []
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.realpath(frame.f_code.co_filename)
        if out and name.startswith(exporter):
            break  # the tracer that called the step: what follows is not the step's
        if not name.startswith(skipped) and not frame.f_code.co_filename.startswith("<"):
            out.append((_shown(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back  # type: ignore[assignment]
    return out


def _source_line(filename: str, line: int) -> str:
    import linecache

    return linecache.getline(filename, line).strip()


def _optimizer_fix() -> str | None:
    """The fix when the read happened inside an optimizer's update (torch.optim or
    torch_xla's syncfree optimizers), naming torch's line."""
    frame = sys._getframe(0)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        for marker in ("/torch/optim/", "/torch_xla/amp/syncfree/"):
            if marker in path:
                where = f"{marker.strip('/')}/{path.split(marker, 1)[1]}:{frame.f_lineno}"
                return (
                    f"The read is inside the optimizer's update ({where}): with these "
                    "settings it turns a device value into a Python number. Known causes: "
                    "capturable=False with a declared hyperparameter (build the optimizer "
                    "with capturable=True); a declared hyperparameter the optimizer branches "
                    "on in Python (weight_decay, momentum: declare only lr); torch_xla's "
                    "syncfree optimizers stepped without found_inf (pass "
                    "optimizer.step(found_inf=...) as torch_xla's GradScaler does)."
                )
        frame = frame.f_back  # type: ignore[assignment]
    return None


_SCALAR_READ = "aten._local_scalar_dense (a tensor passed where torch wants a Python number)"


class _ReadsInTorch:
    """Host reads made by torch's C++ (a tensor given as a Scalar argument, such as
    ``addcdiv_(value=t)``), which no Python method sees: every one goes through
    ``aten._local_scalar_dense``, whose XLA kernel this replaces while it is entered
    (the dispatcher restores torch_xla's own at exit).

    Not a ``TorchDispatchMode``: while any Python dispatch mode is active, torch_xla's
    factory functions (``torch.zeros``, ``full``, ``arange``, ``eye``, ``empty``) return
    tensors that functionalization does not wrap, and torch_xla then drops every write
    through a view of them (``t[i] = v``, ``t[a:b].fill_(v)``, ``t.view(...).add_(u)``)
    without a word: a mask or bias built that way inside the step vanished from the
    traced program (issue #39). A kernel at the XLA key changes nothing else.
    """

    def __init__(self, refuse: Callable[[str], HostReadError]) -> None:
        self.refuse = refuse
        self._lib: torch.library.Library | None = None

    def _kernel(self, t: torch.Tensor) -> Any:
        raise self.refuse(_SCALAR_READ)

    def __enter__(self) -> _ReadsInTorch:
        lib = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": that is the point, and it ends
            # at __exit__.
            warnings.simplefilter("ignore", UserWarning)
            lib.impl("_local_scalar_dense", self._kernel, "XLA")  # type: ignore[no-untyped-call]
        self._lib = lib
        return self

    def __exit__(self, *exc: Any) -> None:
        lib, self._lib = self._lib, None
        if lib is not None:
            lib._destroy()  # type: ignore[no-untyped-call]


class guard_host_reads(TorchFunctionMode):  # noqa: N801 - a context manager, used like a function
    """Within it, reading an XLA tensor on the host raises ``HostReadError``.

    Python-level reads are caught as calls (``Tensor.item`` ...), reads inside torch's
    C++ by a stand-in for torch_xla's ``aten._local_scalar_dense`` kernel
    (``_ReadsInTorch``). Reads of CPU tensors (a non-capturable optimizer's host step
    count) are allowed: they are not device values.
    """

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self._dispatch = _ReadsInTorch(self._refusal)
        self._functionalized = False

    def __enter__(self) -> guard_host_reads:
        # Whether torch_xla wraps the tensors it makes for functionalization (it does
        # unless XLA_DISABLE_FUNCTIONALIZATION is set): asked before any mode is active.
        self._functionalized = torch._is_functional_tensor(torch.empty(0, device=xla.device()))
        super().__enter__()  # type: ignore[no-untyped-call]
        try:
            self._dispatch.__enter__()
        except BaseException:
            super().__exit__(None, None, None)  # type: ignore[no-untyped-call]
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._dispatch.__exit__(*exc)
        finally:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        read = _READS.get(func)
        t = args[0] if args else None
        if read is not None and isinstance(t, torch.Tensor) and t.device.type == "xla":
            raise self._refusal(read)
        out = func(*args, **(kwargs or {}))
        if (
            self._functionalized
            and isinstance(out, torch.Tensor)
            and out.device.type == "xla"
            and not torch._is_functional_tensor(out)
            # Only while a dispatch mode is active: functorch's transforms (torch.vmap, as
            # Hugging Face's mask functions use) also return tensors that are not
            # functional wrappers, and torch_xla tracks what they make.
            and _python_dispatch._get_current_dispatch_mode() is not None  # type: ignore[no-untyped-call]
        ):
            raise self._untracked(func)
        return out

    def _untracked(self, func: Callable[..., Any]) -> UntrackedTensorError:
        location, chain, code = _where()
        name = torch.overrides.resolve_name(func) or getattr(func, "__name__", repr(func))
        return UntrackedTensorError(
            f"The {self.what} made an XLA tensor at {location}"
            + (f" (`{code}`)" if code else "")
            + f", through {name}"
            + (f"; called from {chain}" if chain else "")
            + ", that torch_xla's functionalization does not track: a TorchDispatchMode "
            "(FlopCounterMode, a debugging or logging mode, ...) is active inside the step. "
            "torch_xla drops every write through a view of such a tensor (t[i] = v, "
            "t[a:b].fill_(v), t.view(...).add_(u)) without an error, so the traced program "
            "would not do what the step does, and the export is refused. Remove the "
            "dispatch mode from the step and export again.",
            location=location,
        )

    def _refusal(self, read: str) -> HostReadError:
        location, chain, code = _where()
        fix = next(
            (fix for tail, fix in _KNOWN_FIXES.items() if location.startswith(tail)),
            _optimizer_fix() or _GENERIC_FIX,
        )
        return HostReadError(
            f"The {self.what} read a device value on the host at {location}"
            + (f" (`{code}`)" if code else "")
            + f", through {read}"
            + (f"; called from {chain}" if chain else "")
            + ". That splits the step into several graphs whose host-side decisions would "
            f"be frozen into the bundle, so the export is refused. {fix}",
            location=location,
            read=read.split(" ")[0],
        )


def _where() -> tuple[str, str, str]:
    """(``file:line``, the calling frames, the source line) of the step's code that
    called into torch, for a refusal made by ``guard_host_reads``."""
    frames = _frames()
    if not frames:  # pragma: no cover - a call from torch itself, called by nothing else
        return "(inside torch)", "", ""
    f, line, _ = frames[0]
    location = f"{f}:{line}"
    chain = " <- ".join(f"{g}:{n} ({fn})" for g, n, fn in frames[1:5])
    code = ""
    raw = sys._getframe(0)
    while raw is not None:  # the innermost frame's real path, for its source
        if _shown(raw.f_code.co_filename) == f and raw.f_lineno == line:
            code = _source_line(raw.f_code.co_filename, line)
            break
        raw = raw.f_back  # type: ignore[assignment]
    return location, chain, code
