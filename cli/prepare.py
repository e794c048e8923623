"""``stepbundle pull`` and ``stepbundle compile``: get a job's artifacts ready before it runs.

``pull URL`` puts a bundle into the local bundle store (``runtime/io/store.py``), so that
``run sha256:<digest>`` (or ``run URL --expect-digest ...``) starts without a download.
``compile BUNDLE --cache-dir DIR-or-URL`` compiles every program a ``run`` with the same
options would compile and writes them into that compile cache: the hosts of a job that
share the cache then load executables instead of compiling each its own. The options
that change what is compiled (device, devices, packing, ZeRO-1, non-finite stopping)
must be the run's, since they are part of every entry's key.

Imports: the runtime (lazily), the standard library.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import args as types
from .common import die
from .config import RunConfig
from .options import (
    JOB,
    add,
    add_device_options,
    head_barriers,
    parallel_options,
    regather_weights,
)

__all__ = ["add_compile", "add_pull", "cmd_compile", "cmd_pull"]


def add_pull(sub: Any) -> None:
    """``stepbundle pull``."""
    p = sub.add_parser(
        "pull",
        help="fetch a bundle from a URL into the local store (run it as sha256:<digest>)",
        description="Fetch a bundle once into the local content-addressed store "
        "($STEPBUNDLE_CACHE_DIR/bundles, default ~/.cache/stepbundle/bundles), verifying "
        "every section first; prints its digest and path.",
    )
    p.add_argument("source", help="URL (https://, gs://, s3://, file://) or path of the bundle")
    p.add_argument(
        "--expect-digest",
        type=types.digest,
        metavar="sha256:...",
        help="refuse any other bundle, after reading only its header and manifest",
    )
    p.set_defaults(fn=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    from stepbundle.runtime.io.file_kinds import NotARegularFileError
    from stepbundle.runtime.io.store import pull
    from stepbundle.schema.errors import StepbundleError

    from .paths import check_path_kinds

    t0 = time.perf_counter()
    try:
        check_path_kinds(args)  # a FIFO would block the first open for ever
        got = pull(args.source, expect_digest=args.expect_digest)
    except NotARegularFileError as e:  # a path of the wrong kind
        return die(str(e), 2)
    except StepbundleError as e:
        return die(str(e), 1)
    except OSError as e:  # a local source that cannot be read
        return die(f"cannot read {args.source!r}: {e.strerror or e}.", 2)
    print(f"{got.digest}  {got.path}")
    if got.fetched:
        seconds = time.perf_counter() - t0
        print(f"[pull] fetched {got.bytes_read} bytes in {seconds:.2f}s", file=sys.stderr)
    else:
        print("[pull] already in the store; nothing fetched", file=sys.stderr)
    return 0


def add_compile(sub: Any) -> None:
    """``stepbundle compile``."""
    c = sub.add_parser(
        "compile",
        help="compile a bundle's programs into a (shared) compile cache ahead of a run",
        description="Compile every program `stepbundle run` would compile with the same "
        "options, and write each into --cache-dir (a folder or URL shared by the job's "
        "hosts). Runs on the kind of device the job uses.",
    )
    c.add_argument("bundle", help="the bundle: a file, a URL or sha256:<digest>")
    c.add_argument(
        "--entry",
        action="append",
        dest="entries",
        metavar="NAME",
        help="compile only this entry (repeatable; default: every entry, as `run` does)",
    )
    same = "as for run: it is part of every entry's key"
    add(c, "--expect-digest", help=None)
    add(
        c,
        "--devices",
        "--shard-optimizer-state",
        "--layout",
        "--tp-rule",
        "--stop-on-nonfinite",
        help=same,
    )
    add(c, "--pack-state", help=same)
    c.add_argument(
        "--steps-per-call", type=types.at_least(1), default=1, metavar="K", help="as for run"
    )
    add(c, "--matmul-precision", help=same)
    add(c, *JOB, help="as for run, to compile for a multi-process job's devices")
    add_device_options(c)
    c.set_defaults(fn=cmd_compile)


def cmd_compile(args: argparse.Namespace) -> int:
    from .stopping import Signals

    # Ctrl-C ends the compiles at once, never as a KeyboardInterrupt inside jax
    # (stopping.Signals says why).
    with Signals().installed():
        return _cmd_compile(RunConfig.from_args(args))


def _cmd_compile(args: RunConfig) -> int:
    from stepbundle.runtime import (
        CacheOutcome,
        CompileOptions,
        LoadOptions,
        SafetyOptions,
        StateOptions,
        load,
    )
    from stepbundle.schema.errors import StepbundleError, UsageError

    from .run import _join_job

    if args.no_cache:
        return die("compile writes into the compile cache; drop --no-cache.", 2)
    try:
        _join_job(args)
    except ValueError as e:
        return die(str(e), 2)
    except StepbundleError as e:
        return die(str(e), 1)
    t0 = time.perf_counter()
    try:
        options = LoadOptions(
            compile=CompileOptions(
                entries=args.entries,
                cache_dir=args.cache_dir or True,
                steps_per_call=1 if args.steps_per_call is None else args.steps_per_call,
                compile_only=True,
                matmul_precision=args.matmul_precision,
                fused_attention=not args.no_fused_attention,
                bf16_products=not args.no_bf16_products,
                regather_weights=regather_weights(args),
                head_barriers=head_barriers(args),
            ),
            state=StateOptions(pack_state=args.pack_state),
            safety=SafetyOptions(
                expect_digest=args.expect_digest, stop_on_nonfinite=args.stop_on_nonfinite
            ),
            parallel=parallel_options(args),
        )
        trainer = load(args.bundle, args.device, options=options)
    except UsageError as e:  # an option the load refused (--layout, a missing bundle)
        return die(str(e), 2)
    except (StepbundleError, ValueError) as e:
        return die(str(e), 1)
    except OSError as e:  # a local bundle that is missing or cannot be read
        return die(f"cannot read {args.bundle!r}: {e.strerror or e}", 2)
    info = trainer.load_info
    failed = 0
    writer = trainer.placement.writes_files
    for name, event in info.cache.items():
        if event.outcome is CacheOutcome.HIT:
            what = "in the cache already"
        elif event.write_error is not None:
            failed += 1
            what = f"compiled, but NOT written: {event.write_error}"
        else:
            what = "compiled and written" if writer else "compiled"
        if writer:
            print(f"{name:16s} {what}  {event.path}")
    if writer:
        from .load_line import layout_note

        n_dev = len(trainer.devices)
        print(
            f"[compile] {info.compiled} compiled, {info.cache_hits} already cached, in "
            f"{time.perf_counter() - t0:.2f}s"
            + (
                f" for {args.device} x{n_dev} ({layout_note(info, state=False)})"
                if n_dev > 1
                else ""
            ),
            file=sys.stderr,
        )
        for note in info.layout_notes:  # what the layout did not split, and why
            print(f"[compile] layout: {note}", file=sys.stderr)
        for note in info.head_barriers.values():  # the output head weighed (a TPU), or asked
            print(f"[compile] output head: {note}", file=sys.stderr)
        for note in info.regather_choice.values():  # fsdp, fsdp+tp: weights re-gathered?
            print(f"[compile] regather-weights: {note}", file=sys.stderr)
        for label, (n, w) in info.bf16_products.items():  # a TPU, one device
            print(
                f"[compile] {label}: {n} bf16 product{'s' if n != 1 else ''} compiled "
                f"bf16-out ({w} weight gradient{'s' if w != 1 else ''} swapped)",
                file=sys.stderr,
            )
    return 1 if failed else 0
