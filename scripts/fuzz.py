"""The long fuzzer: damaged golden bundles, many cases, every outcome checked.

    .venv-lean/bin/python scripts/fuzz.py                 # 20,000 cases on every core
    .venv-lean/bin/python scripts/fuzz.py --cases 2000 --jobs 1 --seed 7
    .venv-lean/bin/python scripts/fuzz.py --target cache --cases 1000
    .venv-lean/bin/python scripts/fuzz.py --target checkpoint --cases 1000

It runs the mutation families of tests/hostile_fuzz.py (the bounded test in
tests/runtime/test_hostile_fuzz.py runs a few hundred of the same cases) through
hypothesis, with many examples and no shrinking: each damaged file is opened, every
section read and verified, then loaded with the runtime and stepped once. An outcome
other than a clean load or a BundleError, a case past the time limit, or a reader that
allocated more than the limit is a failure: it is printed with its traceback and the
damaged file is kept under --keep (default build/fuzz-failures) to reproduce it.

``--target cache`` damages the compile-cache entries of a golden bundle (bit flips,
in the header or anywhere, truncation, appended bytes, overwritten runs, an empty file,
another program's entry renamed into place), loads the bundle with that cache, and runs
a training step and an evaluation: a damaged or foreign entry must be a miss (the
program compiled again) and every number must equal an uncached load's. A forged entry
(the right magic and key, another program's payload with that payload's correct digest)
is its own family: the key and digest catch damage and mix-ups, not forgery, so it is a
hit and runs the foreign executable; its outcome is printed, never counted as a
failure (the cache folder must be as trusted as the bundles; see
``stepbundle.runtime.compile.compile_cache.read_cache_entry``).

``--target checkpoint`` damages checkpoints written from the golden bundles (bit flips
in the header length, the tensor records, the stepbundle metadata or the tensor bytes,
truncation, appended bytes, edited JSON) and restores each into a trainer: it must be
refused with a ``CheckpointError`` that leaves the trainer as it was, or, if accepted
(a flip in JSON whitespace, keys reordered), restore exactly the saved state, step,
seed, hyperparameters and schedules.

Both run their cases in child processes of ``--batch`` cases each, so a case that
kills its process (a signal, an abort in native code) is a crash, reported with the
case that was running, and the other batches go on.

Prints the number of cases run, the outcomes by mutation family, and the failures;
exits 1 if there was any.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepbundle.runtime import CompileOptions, LoadOptions

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.cases`` bundle cases in this process; return counts and failures."""
    from hostile_fuzz import (
        READER_ALLOCATION_LIMIT,
        HypothesisDraw,
        exercise,
        load_golden,
        mutate,
        time_limit,
    )
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st
    from runtime_helpers import GOLDEN_NAMES, golden_batches

    goldens = [load_golden(n) for n in GOLDEN_NAMES]
    batches = {n: golden_batches(n)[0] for n in GOLDEN_NAMES}
    work = Path(tempfile.mkdtemp(prefix="stepbundle-fuzz-"))
    keep = Path(args.keep)
    counts: collections.Counter[str] = collections.Counter()
    failures: list[dict[str, str]] = []
    cases = [0]

    @seed(args.seed)
    @settings(
        max_examples=args.cases,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def run(data: Any) -> None:
        case = mutate(HypothesisDraw(data), goldens)
        cases[0] += 1
        path = work / "case.stepbundle"
        path.write_bytes(case.data)
        try:
            with time_limit(args.case_seconds):
                outcome = exercise(
                    path,
                    load=not args.no_load,
                    cache_dir=work / "xla-cache",
                    batch=batches[case.golden],
                    stop_on_nonfinite=case.stop_on_nonfinite,
                )
            if outcome.reader_peak >= READER_ALLOCATION_LIMIT:
                raise AssertionError(f"the reader allocated {outcome.reader_peak} bytes")
            counts[f"{case.mutation}: {outcome.stage} {outcome.error or ''}".strip()] += 1
        except BaseException as e:  # a failure, whatever it is (also KeyboardInterrupt)
            keep.mkdir(parents=True, exist_ok=True)
            kept = keep / f"seed{args.seed}-case{cases[0]}.stepbundle"
            kept.write_bytes(case.data)
            failures.append(
                {
                    "case": case.description,
                    "file": str(kept),
                    "error": "".join(traceback.format_exception(e)),
                }
            )
            counts[f"{case.mutation}: FAILED {type(e).__name__}"] += 1
            if isinstance(e, KeyboardInterrupt):
                raise
        if args.progress and cases[0] % 1000 == 0:
            print(f"[fuzz seed {args.seed}] {cases[0]} cases", file=sys.stderr, flush=True)

    run()
    return {"cases": cases[0], "counts": dict(counts), "failures": failures}


CACHE_GOLDEN = "linear_adamw"  # four programs (train and eval, two each)
CACHE_FAMILIES = (
    "bit flip",
    "bit flip in header",
    "truncated",
    "bytes appended",
    "run overwritten",
    "empty",
    "renamed foreign entry",
    "forged header",
)
CHECKPOINT_FAMILIES = (
    "bit flip in header length",
    "bit flip in tensor records",
    "bit flip in metadata",
    "bit flip in tensor bytes",
    "truncated",
    "bytes appended",
    "edited JSON",
)


def _case_rng(seed: int, case: int) -> random.Random:
    """Case ``case`` of seed ``seed`` draws the same damage in any batch and any job."""
    return random.Random(f"stepbundle-fuzz:{seed}:{case}")


def _flip(data: bytes, lo: int, hi: int, rng: random.Random) -> tuple[bytes, str]:
    i = rng.randrange(lo, hi)
    bit = rng.randrange(8)
    return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :], f"bit {bit} of byte {i}"


def _damage(family: str, data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """The families every target shares: flips anywhere, truncation, appends, runs."""
    if family == "bit flip":
        return _flip(data, 0, len(data), rng)
    if family == "truncated":
        n = rng.randrange(len(data))
        return data[:n], f"cut to {n} of {len(data)} bytes"
    if family == "bytes appended":
        extra = rng.randbytes(rng.randrange(1, 256))
        return data + extra, f"{len(extra)} bytes appended"
    if family == "run overwritten":
        i, n = rng.randrange(len(data)), rng.randrange(1, 256)
        return data[:i] + rng.randbytes(n) + data[i + n :], f"{n} random bytes at {i}"
    if family == "empty":
        return b"", "empty file"
    raise AssertionError(family)


def _reason(e: BaseException) -> str:
    """An exception as a count key: its type and the gist of its message, with paths,
    names, numbers and the details of JSON and UTF-8 errors left out."""
    text = str(e).splitlines()[0] if str(e) else ""
    text = re.sub(r"(JSONDecodeError|UnicodeDecodeError): .*", r"\1", text)
    text = re.sub(r"(/[^\s:'\"()]+)+", "<path>", text)
    text = re.sub(r"'[^']*'", "<name>", text)
    text = re.sub(r"\b(sha256:)?[0-9a-f]{16,}\b", "N", text)
    text = re.sub(r"\d+", "N", text)
    return f"{type(e).__name__}: {text[:100]}"


def _run_cases(
    args: argparse.Namespace,
    families: tuple[str, ...],
    case: Callable[[int, str, random.Random], tuple[str, str | None]],
) -> dict[str, Any]:
    """Run cases ``args.first`` .. ``args.first + args.cases - 1``: each draws a family
    and calls ``case(index, family, rng)``, which returns the outcome to count and, for
    a wrong result, what was wrong. Before each case its name goes to the progress file,
    so that a parent whose child died can say which case killed it."""
    counts: collections.Counter[str] = collections.Counter()
    failures: list[dict[str, str]] = []
    progress = Path(args.worker + ".case")
    for i in range(args.first, args.first + args.cases):
        rng = _case_rng(args.seed, i)
        family = families[rng.randrange(len(families))]
        name = f"{args.target} seed {args.seed} case {i} ({family})"
        progress.write_text(name)
        if i == args.abort_at:  # the test that a crash is seen and reported
            os.abort()
        try:
            outcome, wrong = case(i, family, rng)
        except BaseException as e:  # a failure, whatever it is (also KeyboardInterrupt)
            failures.append(
                {"case": name, "kind": "error", "error": "".join(traceback.format_exception(e))}
            )
            counts[f"{family}: FAILED {type(e).__name__}"] += 1
            if isinstance(e, KeyboardInterrupt):
                raise
            continue
        if wrong is not None:
            failures.append({"case": name, "kind": "wrong", "error": wrong})
            outcome = "WRONG RESULT"
        counts[f"{family}: {outcome}"] += 1
    return {"cases": args.cases, "counts": dict(counts), "failures": failures}


def _quiet() -> None:
    import warnings

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # PJRT's refusals, on stderr
    warnings.simplefilter("ignore")  # CacheWarning on every miss: the counts say it


def _cache_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Cache cases: damage one entry of CACHE_GOLDEN's cache, load, step, evaluate."""
    _quiet()
    import numpy as np
    from runtime_helpers import GOLDEN_NAMES, golden_batches, golden_bundle

    from stepbundle.runtime import load
    from stepbundle.runtime.compile import compile_cache as prog
    from stepbundle.runtime.compile.compile_cache import CacheOutcome

    work = Path(tempfile.mkdtemp(prefix="stepbundle-fuzz-cache-"))
    bundle = golden_bundle(CACHE_GOLDEN)
    # Each program (shape bucket: 8 rows and 5) runs: a damaged entry that is not run
    # could hide a wrong hit.
    batches = golden_batches(CACHE_GOLDEN)[:2]
    batches.append({k: v[:5] for k, v in batches[0].items()})

    def results(t: Any) -> dict[str, np.ndarray[Any, Any]]:
        """Everything a load computes: each batch's evaluation and step, the state."""
        out: dict[str, np.ndarray[Any, Any]] = {}
        for i, batch in enumerate(batches):
            out.update({f"eval{i}/{k}": np.asarray(v) for k, v in t.evaluate(batch).items()})
            out.update({f"step{i}/{k}": np.asarray(v) for k, v in t.step(batch).items()})
        out.update({f"state/{k}": v for k, v in t.state_dict().items()})
        return out

    want = results(load(bundle, options=LoadOptions(compile=CompileOptions(cache_dir=False))))
    cache = work / "cache"
    slots = {
        k: e.path
        for k, e in load(
            bundle, options=LoadOptions(compile=CompileOptions(cache_dir=cache))
        ).load_info.cache.items()
    }
    pristine = {k: p.read_bytes() for k, p in slots.items()}  # type: ignore[union-attr]
    # Every other program's entry: this bundle's other slots and the other goldens'.
    foreign = [(f"{CACHE_GOLDEN} {k}", pristine[k]) for k in sorted(pristine)]
    for other in GOLDEN_NAMES:
        if other != CACHE_GOLDEN:
            t = load(
                golden_bundle(other),
                options=LoadOptions(compile=CompileOptions(cache_dir=work / other)),
            )
            foreign += [(f"{other} {k}", e.path.read_bytes()) for k, e in t.load_info.cache.items()]  # type: ignore[union-attr]

    def case(i: int, family: str, rng: random.Random) -> tuple[str, str | None]:
        slot = sorted(slots)[rng.randrange(len(slots))]
        path, data = slots[slot], pristine[slot]
        if family == "bit flip in header":
            damaged, how = _flip(data, 0, prog._ENTRY_HEADER, rng)
        elif family in ("renamed foreign entry", "forged header"):
            others = [(src, e) for src, e in foreign if src != f"{CACHE_GOLDEN} {slot}"]
            src, entry = others[rng.randrange(len(others))]
            if family == "renamed foreign entry":
                damaged, how = entry, f"{src}'s entry"
            else:  # this slot's magic and key, the foreign payload and its digest
                payload = entry[prog._ENTRY_HEADER :]
                damaged = data[: prog._ENTRY_HEADER - 32] + hashlib.sha256(payload).digest()
                damaged += payload
                how = f"{src}'s payload under {slot}'s key"
        else:
            damaged, how = _damage(family, data, rng)
        assert path is not None
        path.write_bytes(damaged)
        try:
            t = load(bundle, options=LoadOptions(compile=CompileOptions(cache_dir=cache)))
            event = t.load_info.cache[slot]
            outcome = f"{event.outcome.value} ({event.reason})"
            if family == "forged header":
                # Not a failure: the key check is not a signature (see the docstring).
                try:
                    got = results(t)
                except Exception as e:  # noqa: BLE001 - what the foreign executable did
                    return f"{outcome}, refused when run: {_reason(e)}", None
                same = got.keys() == want.keys() and all(
                    np.array_equal(got[k], want[k]) for k in want
                )
                return f"{outcome}, ran: {'same' if same else 'other'} results", None
            if damaged != data and event.outcome is not CacheOutcome.MISS:
                return outcome, f"{slot} with {how} was a {event.outcome.value}, not a miss"
            got = results(t)
            bad = sorted(k for k in want if not np.array_equal(got.get(k), want[k]))
            if bad or got.keys() != want.keys():
                return outcome, f"{slot} with {how}: {bad or 'other outputs'} differ"
            return outcome, None
        finally:
            path.write_bytes(data)

    return _run_cases(args, CACHE_FAMILIES, case)


def _checkpoint_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Checkpoint cases: damage a checkpoint of a golden bundle, restore it, compare."""
    _quiet()
    import numpy as np
    from runtime_helpers import GOLDEN_NAMES, GOLDEN_SCHEDULES, golden_batches, golden_bundle

    from stepbundle.runtime import CheckpointError, load

    work = Path(tempfile.mkdtemp(prefix="stepbundle-fuzz-checkpoint-"))
    cache = work / "xla-cache"

    def snapshot(t: Any) -> tuple[Any, ...]:
        state = {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in t.state_dict().items()}
        hyper = {k: np.float64(v).tobytes() for k, v in t.hyperparameters.items()}
        return (state, t.step_count, t.seed, hyper, t.schedules)

    goldens: dict[str, tuple[bytes, tuple[Any, ...], Any]] = {}
    for name in GOLDEN_NAMES:
        t = load(golden_bundle(name), options=LoadOptions(compile=CompileOptions(cache_dir=cache)))
        if name in GOLDEN_SCHEDULES:
            t.set_schedule("lr", GOLDEN_SCHEDULES[name])
        for b in golden_batches(name)[:2]:
            t.step(b)
        t.save_checkpoint(work / f"{name}.safetensors")
        fresh = load(
            golden_bundle(name), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
        )
        goldens[name] = ((work / f"{name}.safetensors").read_bytes(), snapshot(t), fresh)
    as_it_was = {name: snapshot(g[2]) for name, g in goldens.items()}
    target = work / "case.safetensors"

    def case(i: int, family: str, rng: random.Random) -> tuple[str, str | None]:
        name = sorted(goldens)[rng.randrange(len(goldens))]
        data, saved, trainer = goldens[name]
        (n,) = struct.unpack_from("<Q", data, 0)
        header = data[8 : 8 + n]
        # The metadata entry ({"stepbundle": "<JSON>"}) ends at the first '}"}'; the
        # tensor records are the rest of the header.
        meta_at = header.find(b'"__metadata__"')
        meta_end = header.find(b'}"}', meta_at) + 2
        assert meta_at >= 0 and meta_end > meta_at, "the writer's header layout changed"
        records = [(lo, hi) for lo, hi in ((8, 8 + meta_at), (8 + meta_end + 1, 8 + n)) if hi > lo]
        if family == "bit flip in header length":
            damaged, how = _flip(data, 0, 8, rng)
        elif family == "bit flip in tensor records":
            lo, hi = records[rng.randrange(len(records))]
            damaged, how = _flip(data, lo, hi, rng)
        elif family == "bit flip in metadata":
            damaged, how = _flip(data, 8 + meta_at, 8 + meta_end + 1, rng)
        elif family == "bit flip in tensor bytes":
            damaged, how = _flip(data, 8 + n, len(data), rng)
        elif family == "edited JSON":
            damaged, how = _edit_checkpoint_json(data, n, rng)
        else:
            damaged, how = _damage(family, data, rng)
        target.write_bytes(damaged)
        edit = f"[{how.removeprefix('edited JSON: ')}] " if family == "edited JSON" else ""
        before = as_it_was[name]
        try:
            trainer.load_checkpoint(target)
        except CheckpointError as e:
            if snapshot(trainer) != before:
                return "refused", f"{name} with {how}: refused, but the trainer changed"
            return f"{edit}refused: {_reason(e)}", None
        as_it_was[name] = after = snapshot(trainer)
        if after != saved:
            return f"{edit}accepted", f"{name} with {how}: accepted with another state than saved"
        same = " (an unchanged file)" * (damaged == data)
        return f"{edit}accepted: the saved state exactly{same}", None

    return _run_cases(args, CHECKPOINT_FAMILIES, case)


def _edit_checkpoint_json(data: bytes, n: int, rng: random.Random) -> tuple[bytes, str]:
    """One edit of the JSON header (or of the stepbundle metadata inside it), written
    back with a header length that fits: the file stays well-formed safetensors."""
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["stepbundle"])
    tensors = sorted(k for k in header if k != "__metadata__")
    t = tensors[rng.randrange(len(tensors))]
    hyper = meta["hyperparameters"]
    h = sorted(hyper)[0] if hyper else "lr"
    edits: dict[str, Callable[[], None]] = {
        "step + 1": lambda: meta.update(step=meta["step"] + 1),
        "seed changed": lambda: meta.update(seed=(meta["seed"] or 0) + 1),
        "a hyperparameter doubled (or added)": lambda: hyper.update({h: hyper.get(h, 0.5) * 2}),
        "a hyperparameter NaN": lambda: hyper.update({h: float("nan")}),
        "format 3": lambda: meta.update(format=3),
        "format 1, no digest (a valid format 1 file)": lambda: [
            meta.update(format=1),
            meta.pop("sha256", None),
            meta.pop("schedules", None),
            meta.pop("data", None),
        ],
        "format a string": lambda: meta.update(format="2"),
        "bundle digest changed": lambda: meta.update(bundle_digest="sha256:" + "0" * 64),
        "digest removed": lambda: meta.pop("sha256", None),
        "digest of zeros": lambda: meta.update(sha256="0" * 64),
        "unknown metadata field": lambda: meta.update(extra=1),
        "metadata field removed": lambda: meta.pop(sorted(meta)[rng.randrange(len(meta))]),
        "metadata not JSON": lambda: None,
        "a tensor's dtype changed": lambda: header[t].update(
            dtype={"F32": "I32", "I32": "F32"}.get(header[t]["dtype"], "F32")
        ),
        "a tensor's shape changed": lambda: header[t].update(shape=header[t]["shape"] + [1]),
        "a tensor's shape transposed": lambda: header[t].update(shape=header[t]["shape"][::-1]),
        "a tensor's offsets shifted": lambda: header[t].update(
            data_offsets=[x + 4 for x in header[t]["data_offsets"]]
        ),
        "a tensor removed": lambda: header.pop(t),
        "a tensor renamed": lambda: header.update({t + ".x": header.pop(t)}),
        "keys reordered, no whitespace": lambda: None,
    }
    what = sorted(edits)[rng.randrange(len(edits))]
    edits[what]()
    if what == "keys reordered, no whitespace":
        order = list(header)
        rng.shuffle(order)
        header = {k: header[k] for k in order}
    raw_meta = json.dumps(meta) if what != "metadata not JSON" else json.dumps(meta)[:-1]
    header.setdefault("__metadata__", {})["stepbundle"] = raw_meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    return struct.pack("<Q", len(text)) + text + data[8 + n :], f"edited JSON: {what}"


def _run_batches(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """Cache and checkpoint targets: children of ``--batch`` cases, ``--jobs`` at once."""
    starts = list(range(0, args.cases, args.batch))
    reports: list[dict[str, Any]] = []
    crashed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(starts)
        running: list[tuple[subprocess.Popen[bytes], Path, int, int]] = []
        while pending or running:
            while pending and len(running) < args.jobs:
                first = pending.pop(0)
                n = min(args.batch, args.cases - first)
                report = Path(tmp) / f"report{first}.json"
                cmd = [sys.executable, __file__, "--worker", str(report), "--target", args.target]
                cmd += ["--cases", str(n), "--first", str(first), "--seed", str(args.seed)]
                cmd += ["--abort-at", str(args.abort_at)]
                running.append((subprocess.Popen(cmd), report, first, n))
            proc, report, first, n = running.pop(0)
            if proc.wait() != 0 or not report.exists():
                # A child that died (a signal, an abort in native code) is a crash.
                progress = Path(str(report) + ".case")
                last = progress.read_text() if progress.exists() else "before its first case"
                crashed.append(
                    f"the batch of cases {first}..{first + n - 1} exited with "
                    f"{proc.returncode} during {last}"
                )
            else:
                reports.append(json.loads(report.read_text()))
            if args.progress:
                done = sum(r["cases"] for r in reports)
                print(f"[fuzz {args.target}] {done} cases", file=sys.stderr, flush=True)
    return reports, crashed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--target",
        choices=("bundle", "cache", "checkpoint"),
        default="bundle",
        help="what to damage: bundle files (default), compile-cache entries, checkpoints",
    )
    p.add_argument("--cases", type=int, default=20_000, help="cases in all (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed of the first job")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    p.add_argument("--batch", type=int, default=50, help="cases per child (cache, checkpoint)")
    p.add_argument("--no-load", action="store_true", help="only the reader, not the runtime")
    p.add_argument("--case-seconds", type=float, default=60.0, help="time limit per case")
    p.add_argument("--keep", default=str(ROOT / "build" / "fuzz-failures"))
    p.add_argument("--progress", action="store_true", help="print a line every 1000 cases")
    p.add_argument("--worker", metavar="REPORT.json", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--abort-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cases < 1 or args.batch < 1 or args.jobs < 1:
        p.error("--cases, --batch and --jobs must be at least 1.")

    if args.worker:
        work = {"bundle": _worker, "cache": _cache_worker, "checkpoint": _checkpoint_worker}
        Path(args.worker).write_text(json.dumps(work[args.target](args)))
        return 0

    t0 = time.perf_counter()
    jobs = max(1, min(args.jobs, args.cases))
    if args.target != "bundle":
        reports, crashed = _run_batches(args)
    else:
        reports, crashed = _run_bundle_jobs(args, jobs)
    seconds = time.perf_counter() - t0

    total = sum(r["cases"] for r in reports)
    counts: collections.Counter[str] = collections.Counter()
    failures: list[dict[str, str]] = []
    for r in reports:
        counts.update(r["counts"])
        failures.extend(r["failures"])
    print(
        f"stepbundle fuzz --target {args.target}: {total} cases in {seconds:.0f} s "
        f"({jobs} jobs, seed {args.seed})"
    )
    for key, n in sorted(counts.items()):
        print(f"  {n:7d}  {key}")
    for f in failures:
        kept = f"\n  kept as {f['file']}" if "file" in f else ""
        print(f"\nFAILED {f['case']}{kept}\n{f['error']}")
    for c in crashed:
        print(f"\nFAILED (crash) {c}")
    wrong = sum(f.get("kind") == "wrong" for f in failures)
    print(
        f"{total} cases, {len(failures) + len(crashed)} failures "
        f"({wrong} wrong results, {len(crashed)} crashes)"
    )
    return 1 if failures or crashed else 0


def _run_bundle_jobs(args: argparse.Namespace, jobs: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The bundle target: one hypothesis worker per job."""
    reports: list[dict[str, Any]] = []
    crashed = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for j in range(jobs):
            n = args.cases // jobs + (1 if j < args.cases % jobs else 0)
            report = Path(tmp) / f"report{j}.json"
            cmd = [sys.executable, __file__, "--worker", str(report), "--cases", str(n)]
            cmd += ["--seed", str(args.seed + j), "--keep", args.keep]
            cmd += ["--case-seconds", str(args.case_seconds)]
            cmd += ["--no-load"] * args.no_load + ["--progress"] * args.progress
            procs.append((subprocess.Popen(cmd), report, args.seed + j))
        for proc, report, job_seed in procs:
            if proc.wait() != 0 or not report.exists():
                # A worker that died (a signal, an abort in native code) is a failure too.
                crashed.append(f"worker with seed {job_seed} exited with {proc.returncode}")
            else:
                reports.append(json.loads(report.read_text()))
    return reports, crashed


if __name__ == "__main__":
    sys.exit(main())
