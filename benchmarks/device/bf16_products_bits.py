"""Whether a bf16 x bf16 product computes the same bits written float32-out and rounded
(``convert(dot_general(a, b) -> f32) -> bf16``, the torch front-end's form) as written
bf16-out (``dot_general(a, b) -> bf16``, torch_xla's form, and what the runtime's
``bf16-products`` rewrite compiles on a TPU: ``stablehlo/bf16_products.py``).

    python benchmarks/device/bf16_products_bits.py OUT.json     # on the TPU host

For five products of a transformer's shapes (the 55M GPT's qkv projection, its weight
gradient summing 8,192 tokens, the MLP's down projection and its weight gradient, a
16,384-wide head), random normal operands rounded to bf16: the fraction of elements on
which the two forms agree, each form's agreement with the exact product (numpy float64)
rounded once to bf16 (to nearest, ties to even: ``ml_dtypes``), and each form's largest
error against the exact product in bf16 units in the last place of the exact value, and
mean absolute error. Writes them to OUT.json (``rows``, with the device and jax).

Imports: jax, numpy, ml_dtypes.
"""

import json
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

SHAPES = [(8192, 768, 2304), (768, 8192, 2304), (8192, 3072, 768), (2304, 8192, 768),
          (1024, 768, 16384)]  # fmt: skip


def main() -> int:
    dn = (((1,), (0,)), ((), ()))
    f32out = jax.jit(
        lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.float32).astype(
            jnp.bfloat16
        )
    )
    bf16out = jax.jit(
        lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.bfloat16)
    )
    rows = []
    for i, (m, k, n) in enumerate(SHAPES):
        ka, kb = jax.random.split(jax.random.PRNGKey(i))
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        b = jax.random.normal(kb, (k, n), jnp.float32).astype(jnp.bfloat16)
        x = np.asarray(f32out(a, b)).astype(np.float64)
        y = np.asarray(bf16out(a, b)).astype(np.float64)
        exact = np.asarray(a).astype(np.float64) @ np.asarray(b).astype(np.float64)
        ref = exact.astype(ml_dtypes.bfloat16).astype(np.float64)  # rounded once
        ulp = np.abs(ref) * 2.0**-7 + 1e-30
        row = {
            "shape": [m, k, n],
            "f32out_vs_bf16out_equal": float(np.mean(x == y)),
            "f32out_equal_ref": float(np.mean(x == ref)),
            "bf16out_equal_ref": float(np.mean(y == ref)),
            "f32out_max_err_vs_exact_ulp": float(np.max(np.abs(x - exact) / ulp)),
            "bf16out_max_err_vs_exact_ulp": float(np.max(np.abs(y - exact) / ulp)),
            "f32out_mean_abs_err": float(np.mean(np.abs(x - exact))),
            "bf16out_mean_abs_err": float(np.mean(np.abs(y - exact))),
        }
        print(json.dumps(row))
        rows.append(row)
    out = {
        "script": "benchmarks/device/bf16_products_bits.py",
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "rows": rows,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
