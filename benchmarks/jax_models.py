"""Hand-written jax train steps of the benchmark's models: what a JAX user would write.

Each builder takes the PyTorch model's initial weights (numpy, PyTorch's names) and
returns ``(step, carry)``: ``step(carry, batch) -> (carry, loss)`` is one ``jax.jit``
with ``donate_argnums=0`` (parameters, optax AdamW state and, for the GPT, the dropout
key are all donated), the same math as the PyTorch step.

Imports: jax, optax, numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Step = Callable[[Any, Mapping[str, Any]], tuple[Any, Any]]


def _linear(p: Mapping[str, Any], x: Any) -> Any:
    y = x @ p["weight"].T
    return y + p["bias"] if "bias" in p else y


def _layer_norm(p: Mapping[str, Any], x: Any, eps: float = 1e-5) -> Any:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["weight"] + p["bias"]


GELU_TANH = False
"""Set to True together with benchmarks.models.GELU = "tanh"."""


def _gelu(x: Any) -> Any:
    return jax.nn.gelu(x, approximate=GELU_TANH)


def _tx(lr: float, weight_decay: float) -> optax.GradientTransformation:
    # PyTorch's AdamW defaults: betas (0.9, 0.999), eps 1e-8 outside the square root.
    return optax.adamw(learning_rate=lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)


def _nest(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """``{"0.weight": a}`` -> ``{"0": {"weight": a}}`` (one level per dot)."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        node = out
        *path, leaf = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    return out


def _make(loss_fn: Callable[..., Any], params: Any, tx: optax.GradientTransformation) -> Any:
    def step(carry: Any, batch: Mapping[str, Any]) -> tuple[Any, Any]:
        params, opt_state, key = carry
        key, sub = jax.random.split(key)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, sub)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    carry = (params, tx.init(params), jax.random.key(0))
    return jax.jit(step, donate_argnums=0), carry


def mlp_step(
    state: Mapping[str, np.ndarray], depth: int, lr: float, weight_decay: float
) -> tuple[Step, Any]:
    """The benchmark MLP of ``models.mlp``: ``depth`` x (Linear(16, 16), LayerNorm(16),
    GELU); modules 3i, 3i+1, 3i+2."""
    params = _nest(state)

    def loss_fn(p: Any, batch: Mapping[str, Any], key: Any) -> Any:
        x = batch["x"]
        for i in range(depth):
            x = _gelu(_layer_norm(p[str(3 * i + 1)], _linear(p[str(3 * i)], x)))
        return jnp.mean((x - batch["y"]) ** 2)

    return _make(loss_fn, params, _tx(lr, weight_decay))


def gpt_step(
    state: Mapping[str, np.ndarray],
    *,
    layers: int,
    heads: int,
    dropout: float,
    lr: float,
    weight_decay: float,
) -> tuple[Step, Any]:
    """benchmarks/models.py's SmallGPT (the head is tied to ``wte``, so it is not a leaf)."""
    params = _nest({k: v for k, v in state.items() if not k.startswith("head.")})

    def drop(x: Any, key: Any) -> Any:
        if dropout == 0.0:
            return x
        keep = jax.random.bernoulli(key, 1.0 - dropout, x.shape)
        return jnp.where(keep, x / (1.0 - dropout), 0.0)

    def loss_fn(p: Any, batch: Mapping[str, Any], key: Any) -> Any:
        idx = batch["idx"]
        b, t = idx.shape
        keys = jax.random.split(key, 1 + 2 * layers)
        x = drop(p["wte"]["weight"][idx] + p["wpe"]["weight"][:t], keys[0])
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        for i in range(layers):
            blk = p["blocks"][str(i)]
            c = x.shape[-1]
            qkv = _linear(blk["qkv"], _layer_norm(blk["ln1"], x))
            q, k, v = (
                a.reshape(b, t, heads, c // heads).transpose(0, 2, 1, 3)
                for a in jnp.split(qkv, 3, axis=-1)
            )
            att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(c // heads))
            att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
            y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
            x = x + drop(_linear(blk["proj"], y), keys[1 + 2 * i])
            h = _gelu(_linear(blk["fc"], _layer_norm(blk["ln2"], x)))
            x = x + drop(_linear(blk["out"], h), keys[2 + 2 * i])
        logits = _layer_norm(p["ln_f"], x) @ p["wte"]["weight"].T
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, batch["target"][..., None], axis=-1)
        return -jnp.mean(picked)

    return _make(loss_fn, params, _tx(lr, weight_decay))
