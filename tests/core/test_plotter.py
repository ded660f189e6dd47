"""`plotter`: the helper process draws curves.png to the byte as this process would; without
a helper, or with one that is gone, the curves are drawn here; the helper ends with its block,
killed when the block fails."""

from __future__ import annotations

import pytest

from ddpkit import plots, plotter

# Three epochs of a run's records, with a NaN (JSON carries it, and floats exactly).
HISTORY = [
    {
        "epoch": e,
        "train_loss": 1 / e + 1e-17,
        "test_loss": 1.1 / e,
        "train_accuracy": 0.3 * e,
        "test_accuracy": 0.29 * e,
    }
    for e in (1, 2, 3)
]
HISTORY[1]["test_loss"] = float("nan")


def _drawn_here(tmp_path) -> bytes:
    plots.plot_curves(HISTORY, str(tmp_path / "here.png"), "cnn on digits")
    return (tmp_path / "here.png").read_bytes()


@pytest.mark.cli
def test_the_helper_draws_the_same_png_and_ends_with_its_block(tmp_path):
    with plotter.helper() as proc:
        assert proc is not None and plotter._helper is proc
        wait = plotter.draw_later("plot_curves", [HISTORY], str(tmp_path / "curves.png"), "cnn on digits")
        assert wait() is True  # drawn by the helper
        assert proc.poll() is None  # which still waits for more
        token = plotter.draw_later(
            "plot_token_curves",
            [[{"step": 1, "loss": 2.0}], [{"step": 1, "test_loss": 1.5}]],
            str(tmp_path / "t.png"),
            "",
        )
        assert token() is True
    assert proc.returncode == 0 and plotter._helper is None
    assert (tmp_path / "curves.png").read_bytes() == _drawn_here(tmp_path)
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.cli
def test_without_a_helper_or_with_one_gone_the_curves_are_drawn_here(tmp_path):
    assert plotter.draw_later("plot_curves", [HISTORY], str(tmp_path / "none.png"), "cnn on digits")() is False
    with plotter.helper() as proc:
        proc.kill()
        proc.wait()
        assert plotter.draw_later("plot_curves", [HISTORY], str(tmp_path / "gone.png"), "cnn on digits")() is False
    expected = _drawn_here(tmp_path)
    assert (tmp_path / "none.png").read_bytes() == expected
    assert (tmp_path / "gone.png").read_bytes() == expected


@pytest.mark.cli
def test_a_failing_block_kills_the_helper(tmp_path):
    with pytest.raises(KeyboardInterrupt), plotter.helper() as proc:
        raise KeyboardInterrupt
    assert proc.returncode is not None and proc.returncode < 0  # killed, not left behind
    with pytest.raises(ValueError, match="unknown plot"):
        plotter.draw_later("plot_runs", [], str(tmp_path / "x.png"), "")
