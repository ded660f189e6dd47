"""`plotter`: the helper process draws curves.png to the byte as this process would; without
a helper, or with one that is gone, the curves are drawn here; the helper ends with its block,
killed when the block fails."""

from __future__ import annotations

import os
import pickle

import pytest

from ddpkit.observe import plots, plotter

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


def _drawn_here(tmp_path, history=HISTORY, title="cnn on digits") -> bytes:
    plots.plot_curves(history, str(tmp_path / "here.png"), title)
    return (tmp_path / "here.png").read_bytes()


@pytest.mark.cli
def test_the_helper_draws_the_same_png_and_ends_with_its_block(tmp_path):
    with plotter.helper() as proc:
        assert proc is not None and plotter._helper is proc
        drawing = plotter.draw_later("plot_curves", [HISTORY], str(tmp_path / "curves.png"), "cnn on digits")
        assert not drawing.waited_elsewhere  # this process started the helper: it reads the answer
        assert drawing.wait() is True  # drawn by the helper
        assert proc.poll() is None  # which still waits for more
        token = plotter.draw_later(
            "plot_token_curves",
            [[{"step": 1, "loss": 2.0}], [{"step": 1, "test_loss": 1.5}]],
            str(tmp_path / "t.png"),
            "",
        )
        assert token.wait() is True
        # the helper draws curves again in the figure it keeps: other records, no title; and
        # records with nothing to show in a panel (none: --max-steps inside the first epoch;
        # every loss NaN), which a kept figure would show in its last drawing's limits
        nothing = [{**h, "train_loss": float("nan"), "test_loss": float("nan")} for h in HISTORY]
        others = {"again": (HISTORY[::2] * 2, ""), "none": ([], "t"), "nan": (nothing, "t")}
        for name, (records, title) in others.items():
            assert plotter.draw_later("plot_curves", [records], str(tmp_path / f"{name}.png"), title).wait() is True
    assert proc.returncode == 0 and plotter._helper is None
    assert (tmp_path / "curves.png").read_bytes() == _drawn_here(tmp_path)
    for name, (records, title) in others.items():
        assert (tmp_path / f"{name}.png").read_bytes() == _drawn_here(tmp_path, records, title), name
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.cli
def test_a_forked_worker_leaves_the_wait_to_the_process_that_started_the_helper(tmp_path):
    # As a forked rank 0 does: it asks the inherited helper, hands the Drawing back with its
    # results, and the command reads the helper's answer.
    with plotter.helper():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                drawing = plotter.draw_later("plot_curves", [HISTORY], str(tmp_path / "curves.png"), "cnn on digits")
                os.write(write, pickle.dumps(drawing))
                code = 0 if drawing.waited_elsewhere and drawing.request else 3
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            drawing = pickle.loads(f.read())
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert not drawing.waited_elsewhere  # here, in the helper's owner
        assert drawing.wait() is True  # the helper drew it
    assert (tmp_path / "curves.png").read_bytes() == _drawn_here(tmp_path)


@pytest.mark.cli
def test_without_a_helper_or_with_one_gone_the_curves_are_drawn_here(tmp_path):
    assert plotter.draw_later("plot_curves", [HISTORY], str(tmp_path / "none.png"), "cnn on digits").wait() is False
    with plotter.helper() as proc:
        proc.kill()
        proc.wait()
        assert plotter.draw_later("plot_curves", [HISTORY], str(tmp_path / "gone.png"), "cnn on digits").wait() is False
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


@pytest.mark.unit
@pytest.mark.alone  # timed to the second
def test_an_answer_read_off_the_pipe_with_another_is_not_waited_for_again(monkeypatch):
    # After a restart both attempts' rank 0 asked for the curves: the helper's two answers came
    # in one read, the buffered readline returned the first, and select() waited for the second,
    # already read, until the one-minute deadline
    import os
    import time
    import types

    from ddpkit.observe import plotter

    monkeypatch.setattr(plotter, "ANSWER_TIMEOUT_S", 5.0)
    monkeypatch.setattr(plotter, "_unread", bytearray())
    read, write = os.pipe()
    os.write(write, b'{"id": "1-0", "ok": true}\n{"id": "2-0", "ok": true}\n')
    helper = types.SimpleNamespace(stdout=os.fdopen(read, "rb"))
    started = time.monotonic()
    assert plotter._answered(helper, "2-0") is True
    assert time.monotonic() - started < 1.0
    os.write(write, b'{"id": "3-0", "ok": false}\n')
    assert plotter._answered(helper, "3-0") is False  # the helper could not draw it
    os.close(write)
    assert plotter._answered(helper, "4-0") is False  # gone: no answer will come
    helper.stdout.close()
