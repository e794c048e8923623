"""The checkpoint metadata codec: the ``stepbundle`` entry of a checkpoint's metadata.

A checkpoint is a safetensors file whose ``__metadata__`` maps ``stepbundle`` to a JSON
object, ``CheckpointMeta``: the format number, the step count, the RNG seed, every
hyperparameter's value by bundle name, the digest of the bundle the state belongs to, and
(format 2 on) the file's own digest, the schedules and the input pipeline's position.
Both readers parse it here, with the same checks: the runtime (``runtime/state/checkpoint.py``,
which also writes it) and ``load_into``, which puts a checkpoint back into a PyTorch
model and optimizer (``stepbundle.frontend.checkpoint``).

A hyperparameter's bundle name says where it lives in ``param_groups``
(``HyperparameterPlace``): ``lr`` (every group's ``lr``), ``betas.0`` (element 0 of every
group's ``betas``), ``param_groups.1.lr`` (group 1 only), ``param_groups.1.betas.0``.

Imports: standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError

__all__ = [
    "CHECKPOINT_FORMAT",
    "META_KEY",
    "SUPPORTED_FORMATS",
    "CheckpointMeta",
    "HyperparameterPlace",
    "parse_checkpoint_metadata",
]

# Changelog of the checkpoint format (the ``format`` field of the stepbundle metadata).
# The reader accepts exactly the formats in SUPPORTED_FORMATS and refuses any other with
# a CheckpointError naming both; a new format keeps the old numbers there for as long as files
# written with them must load.
# 2026-11-30: 1, first version: safetensors, the state under PyTorch's names, metadata
#   "stepbundle" = JSON {format, step, seed, hyperparameters, bundle_digest}.
# 2026-12-01: 1, unchanged on disk; readers now refuse unknown formats and, unless told
#   otherwise, checkpoints written by another bundle.
# 2026-12-01: 2, adds "sha256": the SHA-256 of the metadata (its canonical JSON without
#   this field) and of every tensor's name, dtype, shape and bytes (``checkpoint_digest``),
#   checked on read, so a flipped byte anywhere is refused; and, both
#   optional, "schedules" (hyperparameter name -> schedule spec, or null for a Python
#   function) and "data" (the input pipeline's position, a JSON object), so a resume
#   continues both. Format 1 files (none of these) still load.
# 2026-12-07: 2, unchanged on disk; the codec moved from runtime/state/checkpoint.py to
#   schema/checkpoint_meta.py so that load_into (PyTorch) reads with the same checks.
CHECKPOINT_FORMAT = 2
SUPPORTED_FORMATS = frozenset({1, 2})

META_KEY = "stepbundle"
"""The safetensors metadata key holding the JSON ``CheckpointMeta``."""

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _finite_number(v: object) -> bool:
    if type(v) is int:
        return -(2**53) <= v <= 2**53  # exact as a float (10**400 would overflow)
    return type(v) is float and math.isfinite(v)


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint holds besides the state: the ``stepbundle`` metadata entry.

    Attributes:
      format: the checkpoint format number (``CHECKPOINT_FORMAT`` when written here).
      step: the number of training steps taken when it was saved.
      seed: the RNG seed the next training step receives; None when the bundle's
        programs use no random numbers.
      hyperparameters: every hyperparameter's value by name (``HyperparameterPlace``).
      bundle_digest: the digest ("sha256:...") of the bundle the state belongs to.
      sha256: hex SHA-256 over this metadata and every tensor (``checkpoint_digest`` of
        ``runtime/state/checkpoint.py``); format 2 on, None in format 1 files.
      schedules: each scheduled hyperparameter's schedule spec, or None where the
        schedule was a Python function (which a resume must set again).
      data: the input pipeline's position for the next step (a loader's ``state()``),
        or None.
    """

    format: int
    step: int
    seed: int | None
    hyperparameters: Mapping[str, float]
    bundle_digest: str
    sha256: str | None = None
    schedules: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    data: Mapping[str, Any] | None = None

    # ``load_into`` returned the metadata as a dict before 0.2: reading it as a mapping
    # (``meta["step"]``, ``"lr" in meta``, ``meta.get``, ``dict(meta)``) still works, with
    # a DeprecationWarning, until 0.3. Use the attributes.
    def _deprecated(self, how: str) -> None:
        import warnings

        warnings.warn(
            f"reading CheckpointMeta as a mapping ({how}) is deprecated and goes in 0.3: "
            "use its attributes, e.g. meta.step",
            DeprecationWarning,
            stacklevel=3,
        )

    def keys(self) -> list[str]:
        self._deprecated("keys()")
        return [f.name for f in dataclasses.fields(self)]

    def __iter__(self) -> Any:
        self._deprecated("iteration")
        return iter([f.name for f in dataclasses.fields(self)])

    def __contains__(self, key: object) -> bool:
        self._deprecated("in")
        return key in _FIELDS

    def __getitem__(self, key: str) -> Any:
        self._deprecated(f"meta[{key!r}]")
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        self._deprecated("get()")
        return getattr(self, key) if key in _FIELDS else default

    def to_json(self) -> str:
        bad = {k: v for k, v in self.hyperparameters.items() if not math.isfinite(v)}
        if bad:
            raise CheckpointError(
                f"Cannot write a checkpoint whose hyperparameters are not finite: {bad}. Set "
                "them to finite values first (a reader refuses such a checkpoint)."
            )
        return json.dumps(
            {
                "format": self.format,
                "step": self.step,
                "seed": self.seed,
                "hyperparameters": dict(self.hyperparameters),
                "bundle_digest": self.bundle_digest,
                **({} if self.sha256 is None else {"sha256": self.sha256}),
                **({"schedules": dict(self.schedules)} if self.schedules else {}),
                **({} if self.data is None else {"data": dict(self.data)}),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], raw: str) -> CheckpointMeta:
        """Parse and check the metadata of the checkpoint at ``path``.

        Raises:
          CheckpointError: also when the format is not one this reader supports.
          CheckpointError: the metadata is malformed.
        """

        def bad(why: str) -> CheckpointError:
            return CheckpointError(f"{os.fspath(path)} has corrupt stepbundle metadata: {why}.")

        try:
            info = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise bad(f"{type(e).__name__}: {e}") from None
        if not isinstance(info, dict):
            raise bad("it is not a JSON object")
        # The format first: a newer format may name its fields differently, and must be
        # reported as a newer format, not as damage.
        if "format" not in info:
            raise bad("missing format")
        fmt = info["format"]
        if type(fmt) is not int or fmt not in SUPPORTED_FORMATS:
            raise CheckpointError(
                f"The checkpoint {os.fspath(path)} has format {fmt!r}, but this version of "
                "stepbundle reads checkpoint formats "
                f"{', '.join(map(str, sorted(SUPPORTED_FORMATS)))} only. Load it with "
                "the stepbundle version that wrote it, or save it again from there."
            )
        missing = [k for k in ("step", "seed", "hyperparameters", "bundle_digest") if k not in info]
        if missing:
            raise bad(f"missing {', '.join(missing)}")
        step, seed, hyper = info["step"], info["seed"], info["hyperparameters"]
        digest = info["bundle_digest"]
        if type(step) is not int or step < 0:
            raise bad(f"the step {step!r} is not a non-negative integer")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 2**64):
            raise bad(f"the seed {seed!r} is not an integer in [0, 2**64)")
        if not isinstance(hyper, dict) or not all(map(_finite_number, hyper.values())):
            raise bad(f"the hyperparameters {hyper!r:.200} are not a map of finite numbers")
        if not isinstance(digest, str):
            raise bad(f"the bundle digest {digest!r:.100} is not a string")
        digest_hex = info.get("sha256")
        if fmt < 2 and digest_hex is not None:
            # Format 1 never wrote a digest: a file that has one was written as format 2
            # and edited to skip the check.
            raise bad("it says format 1 but carries a digest, which only format 2 writes")
        if fmt >= 2 and not (isinstance(digest_hex, str) and _SHA256_HEX.fullmatch(digest_hex)):
            raise bad(f"the digest {digest_hex!r:.100} is not 64 hex digits")
        schedules = info.get("schedules", {}) if fmt >= 2 else {}
        if not isinstance(schedules, dict) or not all(
            isinstance(v, str) or v is None for v in schedules.values()
        ):
            raise bad(f"the schedules {schedules!r:.200} are not a map of specs (or null)")
        data = info.get("data") if fmt >= 2 else None
        if data is not None and not isinstance(data, dict):
            raise bad(f"the data position {data!r:.200} is not a JSON object")
        return cls(
            format=fmt,
            step=step,
            seed=seed,
            hyperparameters={str(k): float(v) for k, v in hyper.items()},
            bundle_digest=digest,
            sha256=digest_hex if fmt >= 2 else None,
            schedules={str(k): v for k, v in schedules.items()},
            data=data,
        )


_FIELDS = frozenset(f.name for f in dataclasses.fields(CheckpointMeta))


def parse_checkpoint_metadata(
    path: str | os.PathLike[str], metadata: Mapping[str, str]
) -> CheckpointMeta:
    """The checked ``CheckpointMeta`` of a safetensors file's ``__metadata__``.

    Raises:
      CheckpointError: also when the format is not one this reader supports.
      CheckpointError: no stepbundle entry (plain safetensors), or a malformed one.
    """
    raw = metadata.get(META_KEY)
    if raw is None:
        raise CheckpointError(
            f"{os.fspath(path)} has no stepbundle metadata; it was not written by "
            "save_checkpoint. Use trainer.load_state_dict for plain state."
        )
    return CheckpointMeta.from_json(path, raw)


_GROUP = re.compile(r"param_groups\.(0|[1-9][0-9]*)\.(.+)")
_ELEMENT = re.compile(r"(.+)\.(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class HyperparameterPlace:
    """Where a hyperparameter's bundle name says it lives in an optimizer's
    ``param_groups``.

    Attributes:
      group: the param group's index, or None for every group (a bundle exported from
        an optimizer with one group names its hyperparameters by key alone).
      key: the ``param_groups`` key (``"lr"``, ``"betas"``).
      index: the element of the tuple ``key`` holds (0 for ``"betas.0"``), or None when
        the name is the key itself.
    """

    group: int | None
    key: str
    index: int | None

    @classmethod
    def parse(cls, name: str) -> HyperparameterPlace:
        """The place a bundle name says: ``lr``, ``betas.0``, ``param_groups.1.betas.0``.

        A trailing ``.<digits>`` is an element of a tuple setting (the exporter names a
        tuple's element so, ``stepbundle.frontend.hyperparameters``); a reader that finds
        ``key`` itself (dots and all) in a group takes ``name`` as the whole key there.
        """
        group: int | None = None
        rest = name
        m = _GROUP.fullmatch(name)
        if m:
            group, rest = int(m.group(1)), m.group(2)
        e = _ELEMENT.fullmatch(rest)
        if e:
            return cls(group, e.group(1), int(e.group(2)))
        return cls(group, rest, None)

    @property
    def whole_key(self) -> str:
        """The key as one string, element included (``"betas.0"``)."""
        return self.key if self.index is None else f"{self.key}.{self.index}"
