"""A bundle whose programs hold attention composites runs where nothing knows them.

``tests/runtime/data/sdpa_composite.stepbundle`` was written by the torch front-end
(``make_sdpa_composite.py`` beside it) from a model that calls
``F.scaled_dot_product_attention``: its train program holds ``stepbundle.attention``
and ``stepbundle.attention_grad`` composites (``stablehlo/attention_composite.py``).
On a CPU the runtime swaps nothing, so XLA runs their decompositions; this test runs on
jax 0.7.1 and on the newest jax (scripts/test.sh) against PyTorch float64's numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.schema import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention_composite import GRAD_NAME, NAME, find_composites

DATA = Path(__file__).resolve().parent / "data"
BUNDLE = DATA / "sdpa_composite.stepbundle"


def test_the_program_holds_the_composites_and_their_attributes() -> None:
    with open_bundle(BUNDLE) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
    found = find_composites(module)
    with module._ctx:
        names = sorted(str(op.attributes["name"]).strip('"') for op, _ in found)
    assert names == [NAME, GRAD_NAME]
    atts = [att for _, att in found]
    assert all(a is not None for a in atts)
    fwd = next(a for a in atts if a is not None and not a.grad)
    assert (fwd.causal, fwd.mask, fwd.groups, fwd.q_len, fwd.kv_len) == (True, "causal", 1, 8, 8)
    assert (fwd.heads, fwd.head_dim, fwd.dtype, fwd.dropout_p) == (2, 16, "f32", 0.0)
    assert abs(fwd.scale - 16**-0.5) < 1e-12


def test_the_runtime_runs_the_decomposition_as_pytorch_float64_does() -> None:
    expected = np.load(DATA / "sdpa_composite.expected.npz")
    trainer = load(
        BUNDLE, device="cpu", options=LoadOptions(compile=CompileOptions(cache_dir=False))
    )
    assert trainer.load_info.fused_attention == {}
    losses = []
    for i in range(len(expected["losses"])):
        batch = {"idx": expected["idx"][i], "y": expected["y"][i]}
        losses.append(float(trainer.step(batch)["loss"]))
    # float32 against float64, three SGD steps: within float32's rounding (the losses
    # of the steps after the first depend on the attention's gradients too)
    np.testing.assert_allclose(losses, expected["losses"], rtol=2e-6)
    state = trainer.state_dict()
    for name, want in expected.items():
        if name.startswith("param."):
            got = np.asarray(state[name.removeprefix("param.")], np.float64)
            assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), name


def test_a_kernel_of_other_types_keeps_its_site_only() -> None:
    # A kernel function whose types are not its composite's keeps that composite, with
    # the reason, and the program's other composites are still replaced (it used to
    # raise, and the load then kept every attention of the program).
    import jax
    import jax.numpy as jnp

    from stepbundle.runtime.compile import fused_attention as fa
    from stepbundle.stablehlo.attention_composite import rewrite_composites

    with open_bundle(BUNDLE) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
    right = fa.composite_kernels_for("cpu", interpret=True)

    def kernels(att: Any) -> str:
        if not att.grad:
            return right(att)
        aval: Any = jax.ShapeDtypeStruct  # the backward lowered for bf16 operands
        q, k, v, out, lse = fa.composite_avals(att)
        q, k, v, out = (aval(x.shape, jnp.bfloat16) for x in (q, k, v, out))
        return fa._lower(fa.composite_kernel(att, True), "cpu", out, q, k, v, out, lse)

    replaced, kept = rewrite_composites(module, kernels, lambda att: None)
    assert [a.grad for a in replaced] == [False]
    (why,) = kept
    assert why.startswith("attention backward") and "the composite" in why and "bf16" in why
    assert [att.grad for _, att in find_composites(module) if att is not None] == [True]
