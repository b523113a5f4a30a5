"""kafka2pg.withheld_imports: a module withheld from one thread's imports for a block only, without
changing the import machinery under another thread's feet."""

import importlib
import sys
import threading

import pytest

from kafka2pg.withheld_imports import withheld


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A module nobody has imported yet: its name."""
    (tmp_path / "k2p_withheld_probe.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "k2p_withheld_probe"
    sys.modules.pop("k2p_withheld_probe", None)


def test_a_withheld_module_is_missing_in_the_block_for_this_thread_only(probe):
    seen = {}

    def other_thread():
        seen["value"] = importlib.import_module(probe).VALUE
        sys.modules.pop(probe)

    with withheld(probe):
        with pytest.raises(ModuleNotFoundError, match="withheld"):
            importlib.import_module(probe)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(probe + ".sub")
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == {"value": 7}
    assert importlib.import_module(probe).VALUE == 7


def test_the_finder_list_another_thread_may_be_walking_is_never_changed_in_place(probe):
    """Python's import walks `sys.meta_path` as a list; a finder removed from it meanwhile made
    another thread skip one, and an installed module not found."""
    with withheld(probe):
        pass  # installs the one finder
    walked = sys.meta_path
    finders = list(walked)
    with withheld(probe):
        assert walked == finders
    assert walked == finders and sys.meta_path == finders
