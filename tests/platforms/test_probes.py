"""Accelerate's is_*_available probes, answered without importing the package."""

from __future__ import annotations

import sys

from notebook_accel.platforms import probes


def test_a_package_installed_after_a_probe_said_no_is_found_by_the_next_probe(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not probes.package_available("freshly_installed_tracker")
    (tmp_path / "freshly_installed_tracker").mkdir()  # what `pip install` in a cell does
    (tmp_path / "freshly_installed_tracker" / "__init__.py").write_text("")
    assert probes.package_available("freshly_installed_tracker")
    assert "freshly_installed_tracker" not in sys.modules  # found, not imported
