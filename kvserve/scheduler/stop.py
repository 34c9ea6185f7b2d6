"""Stop conditions checked after each sampled token is appended."""
from __future__ import annotations

from kvserve.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish `request` if its newest output token ends it; returns whether it did.

    Order: EOS (unless `ignore_eos`), then a stop token id (recorded as
    `stop_reason`), then the length caps (`max_tokens`, `max_model_len`).
    Before `min_tokens` outputs exist, EOS and stop tokens do not stop the
    request; the length caps always do.
    """
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if reached_length_cap(request, max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def reached_length_cap(request: Request, max_model_len: int, num_pending_tokens: int = 0) -> bool:
    """Whether the request has (or, counting `num_pending_tokens` outputs not
    yet known, will have) as many tokens as `max_tokens` / `max_model_len` allow."""
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and request.num_output_tokens + num_pending_tokens >= max_tokens:
        return True
    return request.num_tokens + num_pending_tokens >= max_model_len
