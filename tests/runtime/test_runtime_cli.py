"""The CLI as the README shows it: run, inspect, verify; and the compile cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import GOLDEN_DIR, cli_here, golden_batches, golden_bundle

from stepbundle.runtime import CompileOptions, LoadOptions, ParallelOptions, load
from stepbundle.runtime.state.checkpoint import read_safetensors
from stepbundle.schema import open_bundle


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepbundle", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_run_json_lines_match_the_api(tmp_path: Path) -> None:
    data = GOLDEN_DIR / "dropout_sgd.inputs.npz"
    out = cli(
        "run",
        str(golden_bundle("dropout_sgd")),
        "--steps",
        "4",
        "--data",
        str(data),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert set(lines[0]) == {"step", "loss", "accuracy"}
    t = load(golden_bundle("dropout_sgd"))
    want = [float(m["loss"]) for m in t.run(golden_batches("dropout_sgd"), 4)]
    assert [r["loss"] for r in lines] == pytest.approx(want, rel=1e-6)


def test_run_checkpoints_resume_and_save_state(tmp_path: Path) -> None:
    # In this process (cli_here, the same main): test_run_json_lines_match_the_api runs
    # the command in a child, as a user does; here that would add a jax import per run.
    bundle = str(golden_bundle("batchnorm_lr"))
    data = str(GOLDEN_DIR / "batchnorm_lr.inputs.npz")
    sched = "warmup_cosine:peak=0.02,warmup=2,total=6,min=0.0001"
    whole = cli_here(
        "run",
        bundle,
        "--steps",
        "6",
        "--data",
        data,
        "--json",
        "--lr-schedule",
        sched,
    )
    assert whole.returncode == 0, whole.stderr
    ck = tmp_path / "ck"
    part = cli_here(
        "run",
        bundle,
        "--steps",
        "4",
        "--data",
        data,
        "--json",
        "--lr-schedule",
        sched,
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        str(ck),
    )
    assert part.returncode == 0, part.stderr
    assert sorted(p.name for p in ck.iterdir()) == [
        "step-00000002.safetensors",
        "step-00000004.safetensors",
    ]
    rest = cli_here(
        "run",
        bundle,
        "--steps",
        "2",
        "--data",
        data,
        "--json",
        "--lr-schedule",
        sched,
        "--resume",
        str(ck / "step-00000004.safetensors"),
        "--save-state",
        str(tmp_path / "final.safetensors"),
    )
    assert rest.returncode == 0, rest.stderr
    resumed = [json.loads(x) for x in part.stdout.splitlines()] + [
        json.loads(x) for x in rest.stdout.splitlines()
    ]
    straight = [json.loads(x) for x in whole.stdout.splitlines()]
    assert [r["step"] for r in resumed] == list(range(6))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    final, _ = read_safetensors(tmp_path / "final.safetensors")
    assert "0.weight" in final and "optimizer.state.0.weight.exp_avg" in final


def test_run_refuses_bad_input_clearly(tmp_path: Path) -> None:  # in this process, as above
    bundle = str(golden_bundle("linear_adamw"))
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((2, 8, 5), np.float64), y=np.zeros((2, 8, 3), np.float32))
    out = cli_here("run", bundle, "--steps", "1", "--data", str(bad))
    assert out.returncode == 1
    assert "Dtype mismatch for batch input 'x'" in out.stderr
    out = cli_here("run", bundle, "--steps", "1", "--data", str(tmp_path / "nope.npz"))
    assert out.returncode == 2 and "cannot read --data" in out.stderr
    out = cli_here(
        "run",
        bundle,
        "--steps",
        "1",
        "--data",
        str(GOLDEN_DIR / "linear_adamw.inputs.npz"),
        "--device",
        "quantum",
    )
    assert out.returncode == 1 and "Unknown device 'quantum'" in out.stderr


def test_inspect_and_verify(tmp_path: Path) -> None:
    bundle = golden_bundle("linear_adamw")
    text = cli("inspect", str(bundle), "--full")
    assert text.returncode == 0, text.stderr
    for needle in (
        "entry 'train'",
        "entry 'eval'",
        "donates input",
        "optimizer.state.weight.exp_avg",
        "sha256:",
    ):
        assert needle in text.stdout
    js = json.loads(cli("inspect", str(bundle), "--json").stdout)
    with open_bundle(bundle) as b:
        assert js["digest"] == b.digest
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", js["digest"])
    assert set(js["entries"]) == {"train", "eval"}
    ok = cli("verify", str(bundle))
    assert ok.returncode == 0 and ok.stdout.startswith("OK")
    broken = tmp_path / "broken.stepbundle"
    shutil.copy(bundle, broken)
    raw = bytearray(broken.read_bytes())
    raw[-10] ^= 0xFF  # inside the last section
    broken.write_bytes(bytes(raw))
    bad = cli("verify", str(broken))
    assert bad.returncode == 1 and "FAILED" in bad.stdout


def test_compile_cache_skips_compilation_and_keys_on_jaxlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepbundle.runtime import _compat

    cache = tmp_path / "cache"
    cold = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    # train and eval, each with a full and a short-batch bucket: four programs.
    assert cold.load_info.compiled == 4 and cold.load_info.cache_hits == 0
    warm = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    assert warm.load_info.compiled == 0 and warm.load_info.cache_hits == 4
    b = golden_batches("linear_adamw")[0]
    assert float(cold.step(b)["loss"]) == float(warm.step(b)["loss"])
    # A different jaxlib never hits an entry written by this one.
    monkeypatch.setattr(_compat, "JAXLIB_VERSION", "0.0.0-other")
    other = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    assert other.load_info.cache_hits == 0
    # A damaged cache entry is a miss, not a failure.
    for f in cache.iterdir():
        f.write_bytes(b"garbage")
    monkeypatch.undo()
    again = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    assert again.load_info.cache_hits == 0
    assert float(again.step(b)["loss"]) == float(
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(),
        ).step(b)["loss"]
    )


def test_runtime_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from stepbundle.runtime import LoadOptions, load\n"
        f"t = load({str(golden_bundle('dropout_sgd'))!r}, "
        "options=LoadOptions.from_keywords(cache_dir=False))\n"
        "import numpy as np\n"
        f"z = np.load({str(GOLDEN_DIR / 'dropout_sgd.inputs.npz')!r})\n"
        "t.step({k: z[k][0] for k in z.files})\n"
        "import stepbundle.cli\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'torch_xla'))]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr


def test_unsupported_device_requests_are_clear_errors() -> None:
    from stepbundle.runtime import PlatformError

    with pytest.raises(PlatformError, match="needs 64 cpu devices, but the job has 4"):
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(parallel=ParallelOptions(devices=64)),
        )
    with pytest.raises(PlatformError, match=r"Device cpu:7 does not exist"):
        load(
            golden_bundle("linear_adamw"),
            device="cpu:7",
            options=LoadOptions(),
        )


def test_a_missing_accelerator_says_install_or_no_device(tmp_path: Path) -> None:
    """Without jax's tpu backend the error says what to install; with it installed and
    no chip (a new user's machine with libtpu for offline compiles was told to install
    jax[tpu]) it says there is no device and how to plan without one. The backend's
    presence is its module on the path (here an empty package named as libtpu's)."""
    code = (
        "from stepbundle.runtime import PlatformError, load\n"
        f"try:\n    load({str(golden_bundle('linear_adamw'))!r}, device='tpu')\n"
        "except PlatformError as e:\n    print(e)\n"
    )
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "pip install 'jax[tpu]'" in bare.stdout, bare.stdout + bare.stderr
    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    plugin = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert "backend is installed, but it found no tpu device" in plugin.stdout, plugin.stderr
    assert "compile_offline" in plugin.stdout and "jax[tpu]" not in plugin.stdout
