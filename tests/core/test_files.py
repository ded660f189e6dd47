"""Files are written whole or not at all and never through a symbolic link, as strict JSON; the
temp files of interrupted writes are pruned; a directory's lock names its holder; and a place
that cannot be written is one line naming the flag before any work starts."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from ddpkit.core.files import atomic_write, check_writable, write_json, write_text, write_yaml
from ddpkit.errors import UsageError

pytestmark = pytest.mark.unit


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "results.json"
    write_json(path, {"a": 1})
    with pytest.raises(RuntimeError, match="disk on fire"), atomic_write(path) as f:
        f.write('{"a": 2, "half')
        raise RuntimeError("disk on fire")
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["results.json"]


def test_writes_create_the_folder_and_keep_the_usual_file_mode(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    path = tmp_path / "new" / "notes.txt"
    write_text(path, "hello\n")
    assert path.read_text() == "hello\n"
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's owner-only 0o600
    write_yaml(tmp_path / "c.yaml", {"b": 2, "a": 1})
    assert list(yaml.safe_load((tmp_path / "c.yaml").read_text())) == ["b", "a"]  # order kept
    write_json(tmp_path / "p.json", {"path": tmp_path})  # what JSON does not know, as its str()
    assert json.loads((tmp_path / "p.json").read_text()) == {"path": str(tmp_path)}


def test_check_writable_makes_the_folder_or_names_the_flag(tmp_path):
    check_writable("--out x", tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and not os.listdir(tmp_path / "a" / "b")
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"^--json r.json: .*file exists and is not a directory$"):
        check_writable("--json r.json", tmp_path / "file")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(UsageError, match=r"^--out y: cannot write there"):
            check_writable("--out y", locked)


def _plant_links(tmp_path, name):
    """In a folder of its own: NAME -> a file outside it, and dangling/NAME -> a missing file."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours\n")
    run, dangling = tmp_path / "run", tmp_path / "dangling"
    run.mkdir(), dangling.mkdir()
    os.symlink(outside, run / name)
    os.symlink(tmp_path / "nowhere" / "missing", dangling / name)
    return outside, [run / name, dangling / name]


def _write_figure(path):
    from ddpkit.observe.plots import pyplot, save_figure

    fig, ax = pyplot().subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, str(path))


def _write_log(path):
    from ddpkit.core.files import replace_with_log

    with replace_with_log(path, "head\n") as f:
        f.write("more\n")


def _write_checkpoint(path):
    import torch

    from ddpkit.checkpoint import save_file

    save_file(path, {"w": torch.ones(2)})


@pytest.mark.parametrize(
    "name, write",
    [
        ("results.json", lambda p: write_json(p, {"a": 1})),
        ("config.yaml", lambda p: write_yaml(p, {"a": 1})),
        ("metrics.jsonl", _write_log),
        ("curves.png", _write_figure),
        ("step-00000010.pt", _write_checkpoint),
    ],
)
def test_every_write_replaces_a_planted_link_and_never_writes_through_it(tmp_path, name, write):
    outside, links = _plant_links(tmp_path, name)
    for link in links:
        write(link)
        assert not os.path.islink(link) and os.path.getsize(link) > 0  # a real file of its own now
    assert outside.read_text() == "not yours\n"  # the link's target is untouched
    assert not (tmp_path / "nowhere").exists()  # and the dangling link's target never made
    assert [n for d in ("run", "dangling") for n in os.listdir(tmp_path / d) if n.startswith(".tmp-")] == []


def test_a_log_replaces_the_old_file_and_keeps_appending_to_its_own(tmp_path):
    from ddpkit.core.files import replace_with_log

    path = tmp_path / "metrics.jsonl"
    path.write_text("old run\n")
    with replace_with_log(path, "kept\n") as f:
        assert path.read_text() == "kept\n"  # in place at once, with what was kept
        os.replace(tmp_path / "metrics.jsonl", tmp_path / "moved.jsonl")
        f.write("line\n")
    assert (tmp_path / "moved.jsonl").read_text() == "kept\nline\n"  # lines follow the file, not the name


def test_json_writes_null_for_nan_and_infinity(tmp_path):
    from ddpkit.core.files import json_line

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))

    write_json(tmp_path / "r.json", {"loss": float("nan"), "rates": [1.0, float("inf"), -float("inf")], "ok": 2.5})
    assert strict((tmp_path / "r.json").read_text()) == {"loss": None, "rates": [1.0, None, None], "ok": 2.5}
    assert strict(json_line({"x": (float("nan"),)})) == {"x": [None]}


def test_temp_files_of_interrupted_writes_are_pruned_and_nothing_else(tmp_path):
    from ddpkit.core.files import prune_temp_files

    for name in (".tmp-abc.pt", ".tmp-x.json", "step-00000010.pt", ".write-test-1", "notes.tmp-1"):
        (tmp_path / name).write_text("x")
    assert sorted(prune_temp_files(tmp_path)) == [".tmp-abc.pt", ".tmp-x.json"]
    assert sorted(os.listdir(tmp_path)) == [".write-test-1", "notes.tmp-1", "step-00000010.pt"]
    assert prune_temp_files(tmp_path / "missing") == []


def test_a_held_lock_names_its_holder_and_is_released_at_exit(tmp_path):
    from ddpkit.core.files import _held, _release, check_unlocked, hold_lock

    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"pid": 999999, "host": "gone", "started": "then"}))  # a killed holder's file
    previous = hold_lock(lock, "--out x")
    try:
        assert previous == {"pid": 999999, "host": "gone", "started": "then"}  # taken over, and said so
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert hold_lock(lock, "--out x") is None  # held already: fine
        check_unlocked(lock, "--out x")  # by this very process: fine
    finally:
        _release(str(lock), _held[str(lock)], os.getpid())  # what exit does (and then nothing more)
    assert not lock.exists()
    link = tmp_path / "linked.lock"
    os.symlink(tmp_path / "elsewhere", link)
    with pytest.raises(UsageError, match=r"^--out y: its lock file .* is a symbolic link"):
        hold_lock(link, "--out y")
    assert not (tmp_path / "elsewhere").exists()
