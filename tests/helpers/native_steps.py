"""Counting the steps the native decoder ran (did not decline), for its tests."""
from __future__ import annotations

from kvserve.model import native_decoder


def count_native_steps(monkeypatch) -> list[int]:
    """Wrap `NativeDecoder.forward` for the test; the returned one-element list holds the count."""
    count = [0]
    forward = native_decoder.NativeDecoder.forward

    def counting(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        count[0] += out is not None
        return out
    monkeypatch.setattr(native_decoder.NativeDecoder, "forward", counting)
    return count


def record_step_sizes(monkeypatch) -> list[int]:
    """Wrap `NativeDecoder.forward` for the test; the returned list gets the token count of
    every step it ran (did not decline)."""
    sizes: list[int] = []
    forward = native_decoder.NativeDecoder.forward

    def recording(self, hidden, *args, **kwargs):
        out = forward(self, hidden, *args, **kwargs)
        if out is not None:
            sizes.append(hidden.shape[0])
        return out
    monkeypatch.setattr(native_decoder.NativeDecoder, "forward", recording)
    return sizes


def per_op_model(config, edit=None, kernels=None):
    """`config`'s model (`edit(model)` applied) decided to run the per-op path only."""
    from kvserve.model.loader import load_model
    model = load_model(config, kernel_config=kernels)
    if edit:
        edit(model)
    model._native = None
    return model


def native_model(config, threads: int | None = None, edit=None, kernels=None):
    """`config`'s model (`edit(model)` applied) with its native decoder, described after the edit
    (required: the test fails where the decoder declines the model), on `threads` threads."""
    from kvserve.model.loader import load_model
    model = load_model(config, kernel_config=kernels)
    if edit:
        edit(model)
    model._native = native_decoder.NativeDecoder.for_model(model)
    assert model._native is not None
    if threads:
        model._native.num_threads = threads
    return model


def run_chunks_of_two(model, sequences: dict[str, list[int]], prompt_lens: dict[str, int]) -> dict:
    """`run_teacher_forced` on blocks of 4, prompts in chunks of 2 (a few requests' steps stay
    within the native decoder's small steps, prompt chunks over cached context included)."""
    from paged_kv_helper import PagedRunner, run_teacher_forced
    return run_teacher_forced(PagedRunner(model, block_size=4), sequences, prompt_lens, chunk=2)


def steps_in_chunks_of_two(sequences: dict[str, list[int]], prompt_lens: dict[str, int]) -> int:
    """How many steps `run_chunks_of_two` takes."""
    return max(-(-p // 2) + len(s) - p for s, p in zip(sequences.values(), prompt_lens.values()))


def largest_relative_diff(ours: dict, ref: dict) -> float:
    """The largest |ours - ref| over requests and rows, relative to each row's scale (at least 1)."""
    return max(((ours[r] - ref[r]).abs().amax(-1) / ref[r].abs().amax(-1).clamp(min=1.0)).max().item() for r in ref)
