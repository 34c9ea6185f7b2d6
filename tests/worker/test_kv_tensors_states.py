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


def test_a_draft_of_another_head_size_does_not_alias_its_targets_blocks():
    """Attention layers with K/V rows of different sizes (a draft of head size 32 beside a
    target of 64): writing one block of the draft leaves every block of the target as it was
    (shared by layer index, the draft's block 2 overwrote the target's blocks 1 and 5)."""
    target = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    draft = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype="float32")
    specs = {"model.layers.0.self_attn.attn": target, "draft.model.layers.0.self_attn.attn": draft}
    caches = allocate_kv_caches(get_kv_cache_config(specs, 0, num_blocks=8), specs)
    kv = caches["model.layers.0.self_attn.attn"]
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view_as(kv))
    before = kv.clone()
    caches["draft.model.layers.0.self_attn.attn"][:, :, 2] = -1.0
    assert torch.equal(kv, before)
