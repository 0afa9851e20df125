"""Fixtures of the SGLang conformance suite: SGLang's own code, from the pinned wheel (sglang_wheel.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sglang_wheel import load_file, wheel_root  # noqa: E402


@pytest.fixture(scope="session")
def sglang_root() -> Path:
    """The unpacked SGLang wheel; skips (fails under CI=true) when it cannot be fetched."""
    return wheel_root()


@pytest.fixture(scope="session")
def tensor_bucket(sglang_root):
    """SGLang's sglang/srt/weight_sync/tensor_bucket.py, imported as is (it needs only torch)."""
    return load_file(sglang_root, "sglang/srt/weight_sync/tensor_bucket.py", "_sglang_tensor_bucket")


@pytest.fixture(scope="session")
def api_types(sglang_root):
    """SGLang's generated HTTP schema sglang/api/v1/api_types.py (needs msgspec, from the cache)."""
    return load_file(sglang_root, "sglang/api/v1/api_types.py", "_sglang_api_types")
