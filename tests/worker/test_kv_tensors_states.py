"""State layers' tensors (`allocate_kv_caches` over `get_kv_cache_config`'s layout) never
overlap an attention layer's bytes: writing every state slot leaves every KV block as it was."""
import torch

from kvserve.kv_cache.interface import FullAttentionSpec, StateSpec
from kvserve.kv_cache.utils import get_kv_cache_config
from kvserve.worker.kv_tensors import allocate_kv_caches


def test_state_slots_do_not_alias_attention_blocks():
    attention = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype="float32")
    state = StateSpec(block_size=4, shapes=((3, 96), (4, 16, 8)), dtype="float32")
    specs = {"l0.state": state, "l1.state": state, "l2.attn": attention, "l3.state": state}
    caches = allocate_kv_caches(get_kv_cache_config(specs, 64 * 1024), specs)
    kv = caches["l2.attn"]
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view_as(kv))
    before = kv.clone()
    for name in ("l0.state", "l1.state", "l3.state"):
        for tensor in caches[name]:
            tensor.fill_(-1.0)
    assert torch.equal(kv, before)
