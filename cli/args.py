"""Argument types of the ``stepbundle`` command: each refuses a bad value while parsing,
before anything is loaded or compiled, with a message that names the option.

Imports: the standard library only.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal

__all__ = [
    "DeprecatedAlias",
    "at_least",
    "checkpoint_path",
    "digest",
    "devices",
    "hyperparameter",
    "positive_seconds",
]

_HEX64 = re.compile(r"[0-9a-f]{64}")


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer type that refuses values below ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def devices(text: str) -> int | str:
    """``--devices``: a count of at least 1, or ``all``."""
    if text == "all":
        return "all"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 device, got {n}")
    return n


def tp_rule(text: str) -> tuple[str, int] | str:
    """``--tp-rule``: ``PATTERN:DIM`` (a name pattern, and the dimension it splits over
    the model axis), or ``defaults`` (``layout_spec.DEFAULT_TP_RULES``, at that place)."""
    if text.strip() == "defaults":
        return "defaults"
    pattern, sep, dim = text.rpartition(":")
    try:
        d = int(dim)
    except ValueError:
        d = None
    if not sep or not pattern or d is None:
        raise argparse.ArgumentTypeError(
            f"expected PATTERN:DIM (a parameter name pattern and the dimension to split, "
            f"e.g. mlp.c_fc.weight:0) or 'defaults', got {text!r}"
        )
    return pattern, d


def steps_per_call(text: str) -> int | Literal["auto"]:
    """``--steps-per-call``: a positive integer, or ``auto`` (runtime/auto_steps.py)."""
    if text.strip().lower() == "auto":
        return "auto"
    return at_least(1)(text)


def hyperparameter(text: str) -> tuple[str, float]:
    """``--set NAME=VALUE``: a name and a finite number."""
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{name}={value!r}: {value!r} is not a number (write e.g. {name}=0.001)"
        ) from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{name}={value}: a hyperparameter must be finite")
    return name, number


def digest(text: str) -> str:
    """``--expect-digest``: ``sha256:<64 hex>`` or the bare 64 hex digits."""
    hexpart = text.lower().removeprefix("sha256:")
    if not _HEX64.fullmatch(hexpart):
        raise argparse.ArgumentTypeError(
            f"expected sha256:<64 hex digits> (as `stepbundle inspect` prints), got {text!r}"
        )
    return f"sha256:{hexpart}"


def positive_seconds(text: str) -> float:
    """A duration in seconds, finite and above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def checkpoint_path(text: str) -> str:
    """``--init-from``: a URL, or a file or folder that exists (what it holds is checked at
    load)."""
    if "://" in text and not text.startswith("file://"):
        return text  # read through fsspec at load; a missing object is refused there
    local = text.removeprefix("file://")
    if not os.path.exists(local):
        raise argparse.ArgumentTypeError(
            f"{text!r} does not exist; give a .safetensors file, a "
            "model.safetensors.index.json or the folder save_pretrained wrote"
        )
    return text


class DeprecatedAlias(argparse.Action):
    """An option's old name: stores into the new one's ``dest`` and prints a one-line
    note naming the new spelling (``stepbundle eval --batch-size``, until 0.3)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        new = "--" + self.dest.replace("_", "-")
        command = parser.prog.removeprefix("stepbundle ").strip()
        print(
            f"stepbundle: note: `stepbundle {command} {option_string}` is deprecated; it is "
            f"now {new}, as in `stepbundle run` (the old name goes in 0.3).",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)
