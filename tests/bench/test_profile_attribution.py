"""The profile attributes time by the package's own location, whatever the checkout's folder is named."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kvserve

# Profiles calls into two areas of the package and prints the categories that got time.
_SCRIPT = """
import cProfile, pstats, json
import kvserve
from kvserve.bench.profile import categorize
from kvserve.kv_cache.utils import hash_block_tokens, sha256_hash
from kvserve.engine.output_processor import child_request_id

def work():
    for i in range(200):
        hash_block_tokens(sha256_hash, None, list(range(i, i + 16)))
        child_request_id(i, "parent")

profiler = cProfile.Profile()
profiler.runcall(work)
shares = categorize(pstats.Stats(profiler))
print(json.dumps({"file": kvserve.__file__, "categories": sorted(k for k, v in shares.items() if v > 0)}))
"""


def test_attribution_from_a_checkout_named_kvserve(tmp_path):
    checkout = tmp_path / "kvserve"  # the folder name `git clone .../kvserve` gives
    package_dir = Path(kvserve.__file__).resolve().parent
    shutil.copytree(package_dir, checkout / "kvserve", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(checkout))
    assert "scheduler + KV cache" in result["categories"]
    assert "engine: output processing" in result["categories"]
