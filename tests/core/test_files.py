"""Files are written whole or not at all, and a place that cannot be written is one line naming
the flag before any work starts."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from ddpkit.errors import UsageError
from ddpkit.files import atomic_write, check_writable, write_json, write_text, write_yaml

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
