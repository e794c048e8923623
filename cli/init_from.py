"""The initial-state options of ``stepbundle run`` and ``stepbundle eval``.

``--init-from CKPT`` starts from a checkpoint's tensors instead of the bundle's state (a
bundle exported with ``--no-state`` has no weights of its own), ``--no-init-strict``
relaxes the name checks, and ``--resume`` of a bundle without weights reads the
checkpoint's tensors as the initial state too, since the bundle has none to load first.

Imports: the standard library, stepbundle.schema.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from . import args as types

__all__ = ["add_init_options", "report_origins", "state_options"]


def add_init_options(p: Any) -> None:
    p.add_argument(
        "--init-from",
        type=types.checkpoint_path,
        metavar="CKPT",
        help="take the initial state from CKPT instead of the bundle: a .safetensors file "
        "(PyTorch's, Hugging Face's or a stepbundle checkpoint), a "
        "model.safetensors.index.json with its shards, or a save_pretrained folder; "
        "state it lacks keeps the bundle's value (a fresh optimizer's zeros)",
    )
    p.add_argument(
        "--init-strict",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --init-from, refuse a checkpoint holding tensors the bundle does not "
        "name or lacking a parameter (default); --no-init-strict ignores the first and "
        "keeps the bundle's values for the second (dtypes and shapes must still match)",
    )


def _has_no_weights(bundle: str, expect_digest: str | None) -> bool:
    from stepbundle.runtime.io.store import resolve_bundle
    from stepbundle.schema import SectionKind, read_manifest

    # A URL or sha256:<digest> is found (or fetched once) through the store, as load does.
    manifest = read_manifest(resolve_bundle(bundle, expect_digest=expect_digest))
    kinds = {s.name: s.kind for s in manifest.sections}
    return any(kinds[s.section] is SectionKind.EXTERNAL for s in manifest.state)


def state_options(args: argparse.Namespace) -> Any:
    """``load``'s ``StateOptions`` for this command line: the initial state's source, and
    ``--pack-state`` where the command has it."""
    from stepbundle.runtime import StateOptions

    init_from = args.init_from
    if (
        init_from is None
        and args.resume
        and _has_no_weights(
            getattr(args, "bundle_file", None) or args.bundle, getattr(args, "expect_digest", None)
        )
    ):
        init_from = args.resume
    return StateOptions(
        init_from=init_from,
        init_strict=args.init_strict,
        pack_state=getattr(args, "pack_state", True),
    )


def report_origins(trainer: Any, args: argparse.Namespace) -> None:
    """One line on stderr saying where the initial state came from, when a checkpoint gave
    it or the bundle holds state by rule."""
    counts = Counter(trainer.load_info.state_origins.values())
    if not counts.get("file") and not counts.get("rule"):
        return
    parts = [f"{counts['file']} from {args.init_from or args.resume}"] if counts.get("file") else []
    parts += [f"{counts.get('rule', 0)} by rule", f"{counts.get('stored', 0)} stored"]
    ignored = trainer.load_info.ignored_tensors
    tail = (
        f"; ignored {len(ignored)} tensor(s) of the checkpoint that the bundle does not name"
        if ignored
        else ""
    )
    print(f"[run] initial state: {', '.join(parts)}{tail}", file=sys.stderr)
