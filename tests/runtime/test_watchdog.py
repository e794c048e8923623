"""--step-timeout: a step loop that stops making progress is ended with a clear message."""

from __future__ import annotations

import threading
import time

from test_cli_inputs import cli, one_line_error, run_args

from stepbundle.cli.watchdog import Watchdog


def test_the_watchdog_fires_when_steps_stop_and_not_before() -> None:
    fired: list[str] = []
    done = threading.Event()

    def on_timeout(message: str) -> None:
        fired.append(message)
        done.set()

    with Watchdog(0.4, on_timeout) as dog:
        for _ in range(8):  # steps that keep coming: no alarm
            time.sleep(0.1)
            dog.feed()
        assert not fired
        assert done.wait(5)  # then a step that never finishes
    assert len(fired) == 1
    assert "no step finished for" in fired[0] and "after 8 steps" in fired[0]
    assert "--step-timeout 0.4" in fired[0]


def test_a_run_with_a_step_timeout_that_is_never_reached_ends_normally() -> None:
    result = cli(*run_args("--steps", "50", "--step-timeout", "60", "--json"))
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 50
    bad = cli(*run_args("--steps", "5", "--step-timeout", "0"))
    assert bad.returncode == 2
    assert "--step-timeout: must be a positive number of seconds" in one_line_error(bad)
