"""``stepbundle eval``: each metric of a read-only entry, averaged over a whole dataset.

Imports: the runtime (lazily).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .common import die as _die
from .config import RunConfig

__all__ = ["cmd_eval"]


def cmd_eval(args: argparse.Namespace) -> int:
    from .stopping import Signals

    # Ctrl-C ends the load and the evaluation at once, never as a KeyboardInterrupt
    # inside jax (stopping.Signals says why).
    with Signals().installed():
        return _cmd_eval(RunConfig.from_args(args))


def _cmd_eval(args: RunConfig) -> int:
    from stepbundle.runtime import CompileOptions, LoadOptions, SafetyOptions, load
    from stepbundle.runtime.io.file_kinds import NotARegularFileError
    from stepbundle.runtime.train.metrics import json_safe
    from stepbundle.schema.errors import StepbundleError, UsageError

    from .data import DATA_ERRORS, eval_batches, is_dataset, read_npz
    from .init_from import state_options
    from .load_line import report_load
    from .options import head_barriers, parallel_options, regather_weights
    from .paths import check_path_kinds, refuse_missing_resume, resume_from_folder
    from .run import refuse_too_many_cpu_devices

    try:
        refuse_too_many_cpu_devices(args)
    except StepbundleError as e:  # before jax makes any device: a usage error, as in run
        return _die(str(e), 2)
    try:  # --resume DIR: its latest checkpoint; a path with nothing there is refused
        args = resume_from_folder(args)
        refuse_missing_resume(args)
    except UsageError as e:  # about --resume, not --data
        return _die(str(e), 2)
    try:
        check_path_kinds(args)  # a FIFO or device would block the first open for ever
        if is_dataset(args.data):
            from stepbundle.runtime.data.dataset import open_dataset

            open_dataset(args.data)
        else:
            read_npz(args.data)
    except NotARegularFileError as e:  # the message names the option
        return _die(str(e), 2)
    except (*DATA_ERRORS, StepbundleError) as e:
        return _die(f"cannot read --data {args.data!r}: {e}", 2)
    try:
        _cpu_devices(args)
        compiling = CompileOptions(
            entries=(args.entry,),
            cache_dir=False if args.no_cache else (args.cache_dir or True),
            matmul_precision=args.matmul_precision,
            fused_attention=not args.no_fused_attention,
            bf16_products=not args.no_bf16_products,
            regather_weights=regather_weights(args),
            head_barriers=head_barriers(args),
        )
        options = LoadOptions(
            compile=compiling,
            state=state_options(args),
            safety=SafetyOptions(expect_digest=args.expect_digest),
            parallel=parallel_options(args),
        )
        started = time.perf_counter()
        trainer = load(args.bundle, args.device, options=options)
        if args.resume:  # as run does: the load line's time includes it, and follows it
            trainer.load_checkpoint(args.resume, allow_other_bundle=args.allow_other_bundle)
            print(f"[eval] resumed from {args.resume} (step {trainer.step_count})", file=sys.stderr)
        report_load(args, trainer, time.perf_counter() - started, tag="eval")
        batches, mask = eval_batches(args.data, trainer, args.entry, args.eval_batch_size)
        result = trainer.evaluate_dataset(batches, args.entry, mask_key=mask)
    except OSError as e:  # a missing bundle (BundleNotFoundError) too, in these words
        return _die(f"cannot open {e.filename!r}: {e.strerror}.", 2)
    except UsageError as e:  # an option the load refused (--layout)
        return _die(str(e), 2)
    except (StepbundleError, ValueError) as e:
        return _die(str(e), 1)
    if args.json:
        print(
            json.dumps(
                {"step": trainer.step_count, "rows": result.rows, **json_safe(result.metrics)}
            )
        )
    else:
        shown = "  ".join(f"{k} {v:.6g}" for k, v in result.metrics.items())
        print(f"{shown}  ({result.rows} rows, {result.batches} batches)")
        print(f"[eval] state at step {trainer.step_count}", file=sys.stderr)
    return 0


def _cpu_devices(args: RunConfig) -> None:
    """``--devices N`` on the CPU: N virtual devices, as ``run`` makes them (before jax
    starts; a count XLA_FLAGS already sets wins)."""
    import os

    from stepbundle.runtime.placement import distributed

    platform = args.device.partition(":")[0].lower()
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if platform == "cpu" and isinstance(args.devices, int) and args.devices > 1 and not forced:
        distributed.set_cpu_devices(args.devices)
