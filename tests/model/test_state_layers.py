"""The state-layer contract: `StateMetadata`'s read/write slots, the decoder's
`StateSpec` hook, and the test-only toy layer's chunked form against its
token-by-token reference across steps that hand the state over through slots."""
import pytest
import torch

from helpers.toy_recurrent import HYBRID_LAYERS, build_toy_model, reference_logits, toy_model_config
from kvserve.kv_cache.interface import FullAttentionSpec, SlidingWindowSpec, StateSpec
from kvserve.model.attention import StateMetadata
from kvserve.model.decoder import DecoderModel
from kvserve.model.errors import ModelConfigError
from kvserve.model.toy_recurrent import ToyRecurrentMixer

SPEC = StateSpec(block_size=4, shapes=((1, 32), (32,)), dtype="float32")


def test_state_spec_page_size_is_one_slot_of_every_state_tensor():
    assert SPEC.slot_sizes == (32, 32)
    assert SPEC.page_size_bytes == (32 + 32) * 4
    with pytest.raises(ValueError):
        StateSpec(block_size=4, shapes=(), dtype="float32")


def test_read_and_write_slots():
    table = torch.tensor([[5, 6, 7], [0, 3, 9], [0, 0, 8], [0, 0, 4]])
    # 0: a fresh 10-token prompt crossing two boundaries; 1: decode from a boundary
    # (snapshot in block 1, running state moves to block 2); 2: decode inside block 2
    # (in place); 3: a 10-token prompt without snapshots (caching off: nulls).
    md = StateMetadata.build(SPEC, query_lens=[10, 1, 1, 10], num_computed_tokens=[0, 8, 9, 0], block_table=table)
    assert md.read_slot.tolist() == [-1, 3, 8, -1]
    assert md.writes_of(0) == [(4, 5), (8, 6), (10, 7)]
    assert md.writes_of(1) == [(1, 9)]
    assert md.writes_of(2) == [(1, 8)]
    assert md.writes_of(3) == [(10, 4)]
    assert md.query_start_loc.tolist() == [0, 10, 11, 12, 22]
    assert md.seq_lens.tolist() == [10, 9, 10, 10]


def test_a_step_ending_on_a_boundary_writes_that_block_once():
    md = StateMetadata.build(SPEC, query_lens=[8], num_computed_tokens=[0], block_table=torch.tensor([[5, 6]]))
    assert md.writes_of(0) == [(4, 5), (8, 6)]


def test_reading_a_released_slot_is_an_error():
    with pytest.raises(ValueError, match="holds no block"):
        StateMetadata.build(SPEC, query_lens=[1], num_computed_tokens=[8], block_table=torch.tensor([[5, 0, 6]]))


def test_decoder_reports_a_state_spec_per_recurrent_layer():
    model = DecoderModel(toy_model_config(HYBRID_LAYERS))
    specs = model.kv_cache_specs(block_size=4)
    kinds = [type(spec) for spec in specs.values()]
    assert kinds == [StateSpec, FullAttentionSpec, StateSpec, SlidingWindowSpec]
    state_spec = specs["model.layers.0.toy_mixer.state"]
    assert state_spec.shapes == ((1, 32), (32,)) and state_spec.block_size == 4
    assert model.has_state_layers


def test_an_unknown_layer_type_is_refused():
    config = toy_model_config(["full", "full"])
    config.layer_types = ["full", "mystery"]
    with pytest.raises(ModelConfigError, match="mystery"):
        DecoderModel(config)


@torch.inference_mode()
def test_toy_layer_chunks_through_slots_match_its_reference():
    """A 23-token sequence in three steps (5, 7 and 11 tokens), each reading the state
    the previous one wrote, against the token-by-token recurrence.

    Bound: the chunked form sums at most CHUNK_LEN = 16 terms a^(t-k) v_k per step
    with a^(t-k) from exp((t-k) log a), each off by a few float32 ulps (2**-24 ~ 6e-8
    relative), against the reference's sequential sum of the same terms; the error is
    O(16 * 4 ulps) ~ 4e-6 of the state's magnitude, then one matmul of width 32 at
    most doubles it. 1e-4 of the output's scale leaves a wide margin and is far below
    a wrong slot (which changes outputs by their own size)."""
    model = build_toy_model(toy_model_config(["toy_recurrent"]))
    mixer: ToyRecurrentMixer = model.layers[0].toy_mixer
    hidden = torch.randn(23, 32, generator=torch.Generator().manual_seed(3))
    expected = mixer.reference(hidden)
    state = (torch.zeros(8, 1, 32), torch.zeros(8, 32))
    outputs, start, slot = [], 0, -1
    for length, new_slot in ((5, 2), (7, 5), (11, 2)):
        table = torch.zeros(1, 8, dtype=torch.int64)
        table[0, (start + length - 1) // 4] = new_slot
        if start:
            table[0, (start - 1) // 4] = slot
        md = StateMetadata.build(SPEC, [length], [start], table)
        outputs.append(mixer(hidden[start:start + length], md, state))
        start, slot = start + length, new_slot
    got = torch.cat(outputs)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-4 * scale


@torch.inference_mode()
def test_toy_reference_forward_is_causal():
    """The whole-sequence reference the engine tests use: logits of a prefix do not
    depend on later tokens (its attention masks and recurrences look only back)."""
    model = build_toy_model(toy_model_config())
    tokens = list(range(3, 40))
    full = reference_logits(model, tokens)
    prefix = reference_logits(model, tokens[:20])
    assert torch.allclose(full[:20], prefix, rtol=0, atol=1e-5 * float(full.abs().max()))
