"""The KV cache is pure Python: it imports (and works) with torch unavailable."""
import subprocess
import sys

_CODE = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import kvserve.kv_cache.manager
from kvserve.kv_cache import block_pool, coordinator, interface, layout, single_type_manager, utils
from kvserve.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
config = KVCacheConfig(3, [], [KVCacheGroupSpec(["l"], FullAttentionSpec(4, 1, 1, "bfloat16"))])
manager = kvserve.kv_cache.manager.KVCacheManager(config, max_model_len=8)
request = manager.new_request("r", [1, 2, 3, 4, 5])
assert manager.allocate_slots(request, 5).get_block_ids() == ([1, 2],)
print("ok", "torch" in sys.modules and sys.modules["torch"] is None)
"""


def test_kv_cache_imports_and_runs_without_torch():
    result = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "True"]
