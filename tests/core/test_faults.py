"""The one-shot form of an injected fault (core/faults.py): armed by a file, it raises once at its
point and lets every later pass through; the SIGKILL form is tests/infra/test_artifacts.py's."""
from __future__ import annotations

import pytest

from gristmill.core.faults import FAULT_ENV, FAULT_ONCE_ENV, InjectedFault, fault_point


def test_an_armed_one_shot_fault_raises_once_at_its_point_only(tmp_path, monkeypatch):
    armed = tmp_path / "armed"
    monkeypatch.setenv(FAULT_ENV, "checkpoint:10")
    monkeypatch.setenv(FAULT_ONCE_ENV, str(armed))
    fault_point("checkpoint:10")  # not armed yet
    armed.touch()
    fault_point("checkpoint:20")  # another point
    assert armed.exists()
    with pytest.raises(InjectedFault, match="checkpoint:10"):
        fault_point("checkpoint:10")
    assert not armed.exists()
    fault_point("checkpoint:10")  # fired: the retried run passes
