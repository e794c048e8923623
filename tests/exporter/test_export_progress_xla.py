"""The torch_xla front-end's progress line (issue #40): which stage the export is in, and
while a step is traced, how far (operators traced so far, from torch_xla's op counters;
the second trace out of the first's count). ``tests/frontend_torch/test_export_progress.py``
checks how the CLI draws it on a terminal.
"""

from __future__ import annotations

from pathlib import Path

from export_helpers import linear_sgd_recipe, mse_step

from stepbundle.exporter import export
from stepbundle.frontend.progress import CHECK_STAGE


def test_the_export_says_which_stage_it_is_in_and_how_far(tmp_path: Path) -> None:
    ticks: list[tuple[str, int, int | None]] = []
    closed: list[int] = []

    class Line:  # a ticker the export closes when a stage's line ends, as the CLI's
        def __call__(self, stage: str, done: int, total: int | None) -> None:
            ticks.append((stage, done, total))

        def close(self) -> None:
            closed.append(len(ticks))

    # the export check is a stage too (it starts the runtime in a child: seconds with
    # nothing else on the line before)
    report = export(
        linear_sgd_recipe(mse_step), tmp_path / "x.stepbundle", check=True, ticker=Line()
    )
    assert report.check is not None and report.check.ran
    assert list(dict.fromkeys(stage for stage, _, _ in ticks)) == [
        "copying the model and optimizer to the XLA device",
        "tracing the training step (1 of 2)",
        "tracing the training step (2 of 2)",
        "comparing the traces of the training step",
        "lowering the train program 0",
        CHECK_STAGE,
    ]
    assert closed[-1] == len(ticks)  # the check's line is ended after it
    first = [(d, t) for s, d, t in ticks if s == "tracing the training step (1 of 2)"]
    second = [(d, t) for s, d, t in ticks if s == "tracing the training step (2 of 2)"]
    traced = first[-1][0]
    # forward, backward and SGD's update of a Linear: a score of operators
    assert traced >= 10 and all(t is None for _, t in first), first
    assert second[0] == (0, traced) and all(t == traced for _, t in second), second
    assert 0.5 * traced <= second[-1][0] <= traced, second  # the first also sets the seed
