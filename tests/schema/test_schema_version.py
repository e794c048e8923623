"""The reader's acceptance rule, decided on day one (see schema/version.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stepbundle.schema import FORMAT_VERSION, KNOWN_FEATURES, UnsupportedVersionError, version
from stepbundle.schema.version import check_version


def test_current_version_and_features() -> None:
    assert FORMAT_VERSION == (1, 2)
    assert frozenset({"state_initializers", "rng_restored_draws"}) == KNOWN_FEATURES


def test_changelog_comment_sits_right_above_the_constant() -> None:
    lines = Path(version.__file__).read_text(encoding="utf-8").splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("FORMAT_VERSION"))
    # The newest dated entry (continuation lines are indented) names the current version.
    j = i - 1
    while lines[j].startswith("#   "):
        j -= 1
    assert re.fullmatch(r"# \d{4}-\d{2}-\d{2}: 1\.2, .+", lines[j]), lines[j]
    assert "# 2026-11-30: 1.0, first version" in lines[:j]


@pytest.mark.parametrize("found", [(1, 0), (1, 1), (1, 2), (1, 65535)])
def test_same_major_without_features_is_accepted(found: tuple[int, int]) -> None:
    check_version(found, ())


@pytest.mark.parametrize("found", [(0, 0), (0, 9), (2, 0), (65535, 0)])
def test_other_major_is_refused(found: tuple[int, int]) -> None:
    with pytest.raises(UnsupportedVersionError, match="supports format versions 1.0 to 1.2") as e:
        check_version(found, ())
    assert e.value.found == found
    assert ("Upgrade stepbundle" if found[0] > 1 else "Re-export") in str(e.value)


@pytest.mark.parametrize("found", [(1, 0), (1, 3)])
def test_unknown_required_features_are_refused(found: tuple[int, int]) -> None:
    with pytest.raises(UnsupportedVersionError, match="'zeta', 'alpha'|'alpha', 'zeta'") as e:
        check_version(found, ("zeta", "alpha"))
    assert e.value.missing_features == ("alpha", "zeta")


def test_known_required_features_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version, "KNOWN_FEATURES", frozenset({"alpha"}))
    check_version((1, 3), ("alpha",))
    with pytest.raises(UnsupportedVersionError) as e:
        check_version((1, 3), ("alpha", "beta"))
    assert e.value.missing_features == ("beta",)
