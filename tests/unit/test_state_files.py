"""The state directory: private files (0600) and what `lab down` leaves of a lab's NICs (nothing)."""

from __future__ import annotations

import stat

import pytest
from hypafilter.ops import deploy


@pytest.fixture
def state_dir(tmp_path):
    saved = deploy.STATE_DIR, deploy.LAB_NAME
    deploy.configure(lab="hfsf", state_dir=tmp_path / "state")
    yield deploy.STATE_DIR
    deploy.configure(lab=saved[1], state_dir=saved[0])


def test_state_and_last_undeployed_are_private(state_dir):
    deploy.write_state({"policy": "secret"})
    deploy._write_private(state_dir / "last-undeployed.json", "{}\n")
    for name in ("state.json", "last-undeployed.json"):
        assert stat.S_IMODE((state_dir / name).stat().st_mode) == 0o600, name
    assert sorted(p.name for p in state_dir.iterdir()) == ["last-undeployed.json", "state.json"]


def test_lab_down_removes_the_labs_nic_files_only(state_dir):
    class FakeLab:
        name = "hfsf"

        def down(self):
            return ["hfsf-nic"]

    nic = state_dir / "nic"
    nic.mkdir(parents=True)
    files = [nic / f"{n}-g{g}{s}" for n in ("hfsf", "other") for g in (1, 2) for s in (".sock", ".pid", ".log")]
    for f in files:
        f.write_text("")
    assert deploy.lab_down(FakeLab()) == ["hfsf-nic"]
    assert sorted(f.name for f in nic.iterdir()) == sorted(f.name for f in files if f.name.startswith("other"))
