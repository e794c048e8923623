"""The checkpoint metadata codec both readers use (the runtime and load_into)."""

from __future__ import annotations

import json

import pytest

from stepbundle.schema.checkpoint_meta import (
    META_KEY,
    CheckpointMeta,
    HyperparameterPlace,
    parse_checkpoint_metadata,
)
from stepbundle.schema.errors import CheckpointError


@pytest.mark.parametrize(
    ("name", "place"),
    [
        ("lr", HyperparameterPlace(None, "lr", None)),
        ("betas.0", HyperparameterPlace(None, "betas", 0)),
        ("param_groups.1.lr", HyperparameterPlace(1, "lr", None)),
        ("param_groups.12.betas.0", HyperparameterPlace(12, "betas", 0)),
        ("param_groups.x.lr", HyperparameterPlace(None, "param_groups.x.lr", None)),
        ("a.b", HyperparameterPlace(None, "a.b", None)),
        ("betas.01", HyperparameterPlace(None, "betas.01", None)),
    ],
)
def test_a_hyperparameter_name_says_its_place(name: str, place: HyperparameterPlace) -> None:
    assert HyperparameterPlace.parse(name) == place
    assert place.whole_key == (name.split(".", 2)[2] if place.group is not None else name)


def test_the_metadata_entry_is_parsed_and_checked() -> None:
    meta = CheckpointMeta(1, 3, None, {"lr": 0.5, "betas.0": 0.85}, "sha256:" + "0" * 64)
    got = parse_checkpoint_metadata("c.safetensors", {META_KEY: meta.to_json()})
    assert got == meta
    with pytest.raises(CheckpointError, match="has no stepbundle metadata"):
        parse_checkpoint_metadata("c.safetensors", {})
    with pytest.raises(CheckpointError, match="has format 9"):
        parse_checkpoint_metadata("c.safetensors", {META_KEY: json.dumps({"format": 9})})
    bad = json.dumps({**json.loads(meta.to_json()), "hyperparameters": {"lr": "x"}})
    with pytest.raises(CheckpointError, match="not a map of finite numbers"):
        parse_checkpoint_metadata("c.safetensors", {META_KEY: bad})
