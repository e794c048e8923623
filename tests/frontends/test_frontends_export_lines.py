"""The export's lines count in words that agree with the count (a new user's export said
"1 read-only entries"): both front-ends, a recipe with one read-only entry."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from modes_net import ModesNet, modes_batch, mse_eval, mse_step, prepared

from stepbundle.frontend import Recipe
from stepbundle.frontend.progress import counted


def test_one_read_only_entry_is_one_entry(frontend, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = prepared(ModesNet(), frozen=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, **frontend.adam)
    recipe = Recipe(model, opt, mse_step, modes_batch(), eval_step=mse_eval)
    lines: list[str] = []
    frontend.export(recipe, tmp_path / "m.stepbundle", check=False, progress=lines.append)
    said = "\n".join(lines)
    assert ", 1 read-only entry" in said and "entries" not in said, said
    # Every count in the lines that name one agrees with it: "1 state tensor", "2 state tensors".
    for n, noun in re.findall(r"\b(\d+) (state tensors?|read-only entr(?:y|ies))\b", said):
        assert (int(n) == 1) == (noun in ("state tensor", "read-only entry")), (n, noun)


def test_counted() -> None:
    assert counted(1, "read-only entry", "read-only entries") == "1 read-only entry"
    assert counted(2, "read-only entry", "read-only entries") == "2 read-only entries"
    assert counted(0, "state tensor") == "0 state tensors"
    assert counted(1, "gradient") == "1 gradient"
