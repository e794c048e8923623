"""The runtime's CPU programs are as accurate as PyTorch's, on every jax it supports.

Two things can make a CPU program less accurate than PyTorch's CPU kernels, and the
runtime removes both (``runtime/compile/cpu_numerics.py``, docs/numerics.md): the order
XLA:CPU sums long reductions in (a BatchNorm's statistics over N*H*W values), now fixed
in the program as blocks (``stablehlo/blocked_sums.py``), and jax 0.10.2's hand-over of
reductions, convolutions and matmuls to YNNPACK, whose fusions are off per compile
unless the user's XLA_FLAGS choose.

The oracle is PyTorch: tests/golden/float64/ holds two BatchNorm CNNs' bundles and
PyTorch's training of them in float64 and float32, computed when each bundle was
exported (tests/golden/make_float64.py: losses over 8 steps, four distinct 32x32 batches;
tests/golden/make_float64_stem.py: every state tensor after 4 steps over four distinct
batches of 32 64x64 images, computed from a hash, tests/golden/hashed_batches.py).
Nothing here computes an expectation with the runtime or jax.

The first CNN does not tell the compilations apart (measured on an AVX2 EPYC, jax 0.10.2:
within 4e-7 of float64 with YNNPACK on or off); the stem does: without the blocks its
BatchNorm tensors end 4-6x further from float64 than PyTorch float32's, on jax 0.7.1 and
0.10.2 alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepbundle.runtime import CompileOptions, LoadOptions, _compat, load
from stepbundle.runtime.compile import compile_cache
from stepbundle.runtime.compile.cpu_numerics import BLOCKED_SUMS_ENV, cpu_numerics
from stepbundle.runtime.train.batches import iter_batches

FLOAT64 = Path(__file__).resolve().parent.parent / "golden" / "float64"
OPTION = "xla_cpu_experimental_ynn_fusion_type"


def _golden() -> tuple[Path, list[dict[str, np.ndarray]], np.ndarray, np.ndarray]:
    with np.load(FLOAT64 / "bn_cnn.inputs.npz", allow_pickle=False) as z:
        batches = iter_batches({k: z[k] for k in z.files})
    with np.load(FLOAT64 / "bn_cnn.float64.npz", allow_pickle=False) as z:
        f64, f32 = z["loss_float64"], z["loss_float32"]
    return FLOAT64 / "bn_cnn.stepbundle", batches, f64, f32


@pytest.fixture(scope="module")
def bn_cnn() -> Any:
    """The first CNN's bundle, loaded once with the default CPU numerics."""
    path, _, _, _ = _golden()
    return load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False, entries="train")))


def test_a_batchnorm_cnn_trains_as_near_float64_as_pytorch_float32(bn_cnn: Any) -> None:
    _, batches, f64, f32 = _golden()
    losses = np.array([float(m["loss"]) for m in bn_cnn.run(batches, len(f64))])
    assert len(set(losses.tolist())) == len(losses)  # it trained: every step differs
    err = np.abs(losses - f64) / np.abs(f64)
    f32_err = np.abs(f32 - f64) / np.abs(f64)
    # The bound comes from PyTorch: four times the worst distance of PyTorch's own
    # float32 training from its float64 training (3.98e-7 at step 7 when exported),
    # and never under 16 float32 ulps (2^-20): a different but equally good summation
    # order of a step's reductions moves the loss by a few ulps.
    bound = max(4 * float(f32_err.max()), 2.0**-20)
    print("loss vs PyTorch float64:", err, "PyTorch float32:", f32_err, "bound", bound)
    assert float(err.max()) <= bound, (err, bound)


def test_load_says_what_it_compiled_the_cpu_programs_with(bn_cnn: Any) -> None:
    assert bn_cnn.load_info.cpu_numerics == cpu_numerics().words
    sums, ynn = bn_cnn.load_info.cpu_numerics.split("; ")
    assert sums == "long sums in blocks"
    if _compat._version_tuple(_compat.JAXLIB_VERSION) >= (0, 8):
        assert ynn.startswith("YNNPACK fusion off")
    else:
        assert ynn.startswith("nothing to set")


@pytest.mark.parametrize(
    ("value", "blocked"), [(None, True), ("1", True), ("0", False), (" 0 ", False)]
)
def test_blocked_sums_are_switched_off_by_name(value: str | None, blocked: bool) -> None:
    env = {} if value is None else {BLOCKED_SUMS_ENV: value}
    numerics = cpu_numerics(env)
    assert numerics.blocked_sums is blocked
    assert numerics.overrides == _compat.cpu_numerics_overrides("")[0]
    assert (BLOCKED_SUMS_ENV in numerics.words) is not blocked


@pytest.mark.parametrize(
    ("version", "flags", "expected"),
    [
        ("0.7.1", "", ()),  # its XLA refuses the option: nothing is set
        ("0.8.0", "", ((OPTION, ""),)),
        ("0.10.2", "", ((OPTION, ""),)),
        ("0.10.2", "--xla_force_host_platform_device_count=2", ((OPTION, ""),)),
        # The user's XLA_FLAGS win, whatever they set it to.
        ("0.10.2", f"--{OPTION}=", ()),
        ("0.10.2", f"--xla_force_host_platform_device_count=2 --{OPTION}=dot", ()),
    ],
)
def test_the_option_is_set_by_jaxlib_version_unless_xla_flags_mention_it(
    monkeypatch: pytest.MonkeyPatch, version: str, flags: str, expected: tuple[object, ...]
) -> None:
    monkeypatch.setattr(_compat, "JAXLIB_VERSION", version)
    overrides, why = _compat.cpu_numerics_overrides(flags)
    assert overrides == expected
    assert ("XLA_FLAGS" in why) == (OPTION in flags)


def test_the_overrides_are_in_the_compile_cache_key() -> None:
    client = _compat.get_client("cpu")
    devices = client.local_devices()[:1]
    plain = _compat.compile_options(1, [devices[0].id])
    off = _compat.compile_options(1, [devices[0].id], ((OPTION, ""),))
    assert _compat.option_overrides(off) == ((OPTION, ""),)
    key = compile_cache.cache_key
    assert key(client, devices, b"x", plain) != key(client, devices, b"x", off)
    assert key(client, devices, b"x", off) == key(client, devices, b"x", off)


def test_a_jaxlib_whose_xla_lacks_the_option_compiles_without_it() -> None:
    """On jax 0.7.1 (the oldest supported) XLA refuses the option ("No such compile
    option"); compile_bytecode then drops it. On newer jaxlibs it is accepted as is."""
    from runtime_helpers import golden_train_module

    module = golden_train_module("linear_adamw")
    client = _compat.get_client("cpu")
    device = client.local_devices()[0]
    options = _compat.compile_options(1, [device.id], ((OPTION, ""),))
    exe = _compat.compile_bytecode(client, module.bytecode(), [device], options)
    assert exe is not None
    kept = _compat.option_overrides(options)
    if _compat._version_tuple(_compat.JAXLIB_VERSION) < (0, 8):
        assert kept == ()
    else:
        assert kept == ((OPTION, ""),)
    # Any other unknown option is still an error.
    bad = _compat.compile_options(1, [device.id], (("xla_no_such_option_here", "1"),))
    with pytest.raises(_compat.JaxRuntimeError, match="No such compile option"):
        _compat.compile_bytecode(client, module.bytecode(), [device], bad)


def _stem_distances(state: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, float]]:
    """Per floating state tensor, how far ``state`` and PyTorch float32 are from PyTorch
    float64 after 4 steps, relative to how far float64 moved it from its initial value
    (an optimizer's momentum, made by the first step: relative to its size)."""
    with np.load(FLOAT64 / "bn_stem.float64.npz", allow_pickle=False) as z:
        ref = {k: z[k] for k in z.files}
    got, torch32 = {}, {}
    for key in ref:
        if not key.startswith("float64:"):
            continue
        name = key.removeprefix("float64:")
        f64 = ref[key]
        init = ref.get(f"init:{name}")
        moved = float(np.linalg.norm(f64 - init if init is not None else f64))
        if moved == 0.0:
            continue
        got[name] = float(np.linalg.norm(state[name].astype(np.float64) - f64)) / moved
        torch32[name] = float(np.linalg.norm(ref[f"float32:{name}"] - f64)) / moved
    return got, torch32


def test_a_batchnorm_stem_over_large_maps_trains_as_near_float64_as_pytorch_float32() -> None:
    """Conv -> ReLU -> BatchNorm over 32 64x64 images: BatchNorm's sums run over 131,072
    values of a non-zero mean. Measured on an AVX2 EPYC, with the sums as the program
    writes them (``STEPBUNDLE_CPU_BLOCKED_SUMS=0``), XLA's own kernels put BatchNorm
    tensors 4-6x further from float64 than PyTorch float32 after 4 steps (jax 0.7.1 and
    0.10.2 alike); with them in blocks (``stablehlo/blocked_sums.py``), within 1.0-1.4x,
    with YNNPACK's fusions off or on."""
    import sys

    sys.path.insert(0, str(FLOAT64.parent))
    from hashed_batches import hashed_batches

    batches = hashed_batches(4, 32, (3, 64, 64), 10)
    t = load(
        FLOAT64 / "bn_stem.stepbundle",
        options=LoadOptions(compile=CompileOptions(cache_dir=False, entries="train")),
    )
    t.run(batches, 4)
    got, torch32 = _stem_distances(t.state_dict())
    # The bound is PyTorch's own, per tensor: twice its float32 training's distance, and
    # never under 2^-20 (a few float32 ulps: the head's tensors move by 1e-7 of their size).
    over = {
        name: (got[name], torch32[name])
        for name in got
        if got[name] > max(2 * torch32[name], 2.0**-20)
    }
    print({n: round(got[n] / torch32[n], 2) for n in got})
    assert not over, over
