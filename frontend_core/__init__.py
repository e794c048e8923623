"""stepbundle.frontend: the front-end core both exporters share; torch, never torch_xla.

What a user hands an exporter and what comes back are the same whichever front-end
traces the step: the ``Recipe`` (``recipe.py``), the ``ExportError`` (``errors.py``),
the ``ExportReport`` and the one bundle writer (``writer.py``). Beside them, the rules
both front-ends apply the same way: the dtype table (``dtypes.py``), what each state
section holds (``initial_state.py``), where a declared hyperparameter lives
(``hyperparameters.py``), the scheduler notes (``schedulers.py``), the checks of a
step's batch and metrics (``step_io.py``), the binding-table rows both build
(``tables.py``), saving and restoring the user's objects
around a trace (``user_objects.py``), the state a fresh optimizer starts from
(``fresh_state.py``), and loading a runtime checkpoint back into PyTorch
(``checkpoint.py``).

The front-ends: ``stepbundle.exporter`` (torch_xla) and ``stepbundle.export_torch``
(torch alone). Importing this package imports no torch_xla (a test checks it in a fresh
process), so the torch front-end and ``load_into`` work where torch_xla is not installed.

Imports: torch, stepbundle.schema (safetensors in ``checkpoint.py``, jax's version string
in ``writer.py``); never torch_xla, never stepbundle.exporter or stepbundle.runtime.
"""

from __future__ import annotations

from .errors import ExportError
from .recipe import Recipe
from .writer import ExportReport

__all__ = ["ExportError", "ExportReport", "Recipe"]
