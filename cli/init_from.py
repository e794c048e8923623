"""The initial state of ``stepbundle run`` and ``stepbundle eval`` (its options are declared
in ``options.py``).

``--init-from CKPT`` starts from a checkpoint's tensors instead of the bundle's state (a
bundle exported with ``--no-state`` has no weights of its own), ``--no-init-strict``
relaxes the name checks, and ``--resume`` of a bundle without weights reads the
checkpoint's tensors as the initial state too, since the bundle has none to load first.

Imports: the standard library, stepbundle.schema.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stepbundle.runtime import StateOptions, Trainer

    from .config import RunConfig

__all__ = ["report_origins", "state_options"]


def _has_no_weights(bundle: str, expect_digest: str | None) -> bool:
    from stepbundle.runtime.io.store import resolve_bundle
    from stepbundle.schema import SectionKind, read_manifest

    # A URL or sha256:<digest> is found (or fetched once) through the store, as load does.
    manifest = read_manifest(resolve_bundle(bundle, expect_digest=expect_digest))
    kinds = {s.name: s.kind for s in manifest.sections}
    return any(kinds[s.section] is SectionKind.EXTERNAL for s in manifest.state)


def state_options(config: RunConfig) -> StateOptions:
    """``load``'s ``StateOptions`` for this command line: the initial state's source, and
    ``--pack-state`` where the command has it."""
    from stepbundle.runtime import StateOptions

    init_from = config.init_from
    if (
        init_from is None
        and config.resume
        and _has_no_weights(config.bundle_file or config.bundle, config.expect_digest)
    ):
        init_from = config.resume
    return StateOptions(
        init_from=init_from,
        init_strict=config.init_strict,
        pack_state=config.pack_state,
    )


def report_origins(trainer: Trainer, config: RunConfig, tag: str = "run") -> None:
    """One line on stderr saying where the initial state came from, when a checkpoint gave
    it or the bundle holds state by rule (``tag``: the command)."""
    counts = Counter(trainer.load_info.state_origins.values())
    if not counts.get("file") and not counts.get("rule"):
        return
    parts = (
        [f"{counts['file']} from {config.init_from or config.resume}"] if counts.get("file") else []
    )
    parts += [f"{counts.get('rule', 0)} by rule", f"{counts.get('stored', 0)} stored"]
    ignored = trainer.load_info.ignored_tensors
    tail = (
        f"; ignored {len(ignored)} tensor(s) of the checkpoint that the bundle does not name"
        if ignored
        else ""
    )
    print(f"[{tag}] initial state: {', '.join(parts)}{tail}", file=sys.stderr)
