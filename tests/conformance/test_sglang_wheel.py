"""The wheel helper's contract: under CI a wheel that cannot be fetched fails the suite, elsewhere it
skips with the reason; a fetched cache is reused without pip."""

from __future__ import annotations

import pytest

import sglang_wheel


@pytest.fixture
def unfetchable(monkeypatch):
    def fail(dest=None):
        raise RuntimeError("pip download sglang==0.5.23 failed: no network")

    monkeypatch.setattr(sglang_wheel, "fetch", fail)
    monkeypatch.setattr(sglang_wheel, "_ROOT", [])


def test_ci_fails_when_the_wheel_cannot_be_fetched(unfetchable, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true.*no network|no network.*CI=true"):
        sglang_wheel.wheel_root()


def test_elsewhere_it_skips_with_the_reason(unfetchable, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="could not be fetched.*no network"):
        sglang_wheel.wheel_root()


def test_complete_cache_is_reused_without_pip(tmp_path, monkeypatch):
    (tmp_path / "COMPLETE").write_text(sglang_wheel.SGLANG_VERSION)
    monkeypatch.setattr(sglang_wheel.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    assert sglang_wheel.fetch(tmp_path) == tmp_path
