"""scripts/overlap_model.py: the closed form it prints agrees with playing the layer-by-layer
schedule, and its KV size is the one the handoff benchmark moves (docs/performance.md)."""

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("overlap_model", ROOT / "scripts/overlap_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["overlap_model"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def test_the_closed_form_matches_the_schedule_played_layer_by_layer():
    m = _load()
    rng = random.Random(22)
    for _ in range(2000):
        layers = rng.randint(1, 128)
        prefill = rng.uniform(1e-4, 1.0)
        transfer = rng.uniform(1e-4, 2.0)
        closed = m.tail_after_prefill(prefill, transfer, layers)
        played = m.scheduled_tail(prefill, transfer, layers)
        assert abs(closed - played) <= 1e-9 * max(1.0, played), (layers, prefill, transfer)
        # Never worse than sending everything after the prefill, never better than one layer.
        assert transfer / layers - 1e-12 <= closed <= transfer + 1e-12


def test_a_llama_8b_request_of_3000_tokens_is_the_benchmarks_394_mb():
    m = _load()
    assert round(m.Model().kv_bytes(3000) / 1e6) == 393  # 64 planes x 188 blocks x 32 KiB = 394 MB
    # at 16 tokens per block: 188 blocks hold 3,008 tokens, 393.2 vs 394.3 MB.


def test_the_script_prints_a_row_per_link_and_refuses_a_bad_rate():
    ok = subprocess.run([sys.executable, str(ROOT / "scripts/overlap_model.py"), "--gbps", "25,400"],
                        capture_output=True, text=True, check=True)
    assert ok.stdout.count("Gb/s |") == 2, ok.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts/overlap_model.py"), "--gbps", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "positive" in bad.stderr
