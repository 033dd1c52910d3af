"""The reading budget of one default RL step (RESULTS.md §12b, issue 48): tools/step_lines.py traces train.rl_step
and counts what a reader must follow outside the model and the verifier; a change that threads more of itself
through the default path fails here, not in a later reading."""
import pytest

from tools import step_lines


@pytest.mark.slow
@pytest.mark.parametrize("argv", [[], ["--config", "configs/grpo.toml"]], ids=["default", "grpo"])
def test_one_rl_step_stays_within_the_reading_budget(argv, monkeypatch):
    monkeypatch.chdir(step_lines.ROOT)
    files, lines, funcs, span = step_lines.main(argv)
    assert files <= 7 and lines <= 300 and funcs <= 40 and span <= 600, (files, lines, funcs, span)
