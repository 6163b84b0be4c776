"""Test setup: python/ and the build's python/ on sys.path (the kvferry package is not installed
for tests; the build holds kvferry._native), and no network for vLLM and Hugging Face."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# kvferry._native from the C++ build (scripts/test.sh builds it in build/ with KVFERRY_PYTHON=ON).
_build = Path(os.environ.get("KVFERRY_BUILD_DIR", Path(__file__).resolve().parents[2] / "build"))
sys.path.insert(1, str(_build / "python"))
# For processes the tests start (python/tests/p_rank_process.py): the same two directories.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).resolve().parents[1]), str(_build / "python")]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

# Set before vLLM or huggingface_hub is imported: they read these once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny model directory vLLM's config loader reads (one for every test that needs one)."""
    from vllm_harness import write_model_dir  # imports vLLM: only for the tests that use it

    return write_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item (``item.report_call``), so a fixture's
    teardown can tell whether its test failed (test_vllm_serve.py prints the engines' logs)."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report
