"""The continuous-batching scheduler.

There are no prefill or decode phases. Each request has `num_tokens`
(prompt + outputs, plus output slots scheduled but not known yet) and
`num_computed_tokens`; every step gives each request a slice of one token
budget so that its computed tokens catch up with its tokens. A chunk that
reaches the last token samples the next one. Running requests are served
first, then waiting ones are admitted (with their prefix-cache hits).

When the KV pool runs out, the latest (or lowest-priority) running request
is preempted and later recomputed. With async scheduling the engine may
schedule step N+1 before applying step N's output, so blocks given up while
an unprocessed step still references them are freed behind a fence
(`deferred_free.DeferredBlockFrees`), in exactly the order the immediate
path would free them.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.kv_cache.interface import KVCacheConfig
from kvserve.kv_cache.manager import KVCacheBlocks, KVCacheManager
from kvserve.kv_cache.utils import KVCacheBlock
from kvserve.request import Request, RequestStatus
from kvserve.scheduler.admission import max_tokens_in_pool
from kvserve.scheduler.deferred_free import DeferredBlockFrees, drain_ready, free_or_defer
from kvserve.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.scheduler.pause import PAUSE_MODES, PauseState
from kvserve.scheduler.preemption import pick_victim, reset_for_recompute
from kvserve.scheduler.request_queue import create_request_queue
from kvserve.scheduler.speculation import Speculator
from kvserve.scheduler.stats import SchedulerStats, prefix_cache_counts
from kvserve.scheduler.step_plan import StepPlan, block_ids_or_none, build_scheduler_output
from kvserve.scheduler.stop import reached_length_cap
from kvserve.scheduler.update import apply_sampled_tokens

logger = logging.getLogger(__name__)


class Scheduler(DeferredBlockFrees):
    """Decides, step by step, which requests run how many tokens on which KV blocks.

    Owns the request queues (`waiting`, `running`, `requests` by id) and the
    `KVCacheManager`. Keeps true: the tokens of one step never exceed
    `max_num_batched_tokens`, at most `max_num_seqs` requests run, no request
    is scheduled past `max_tokens` / `max_model_len` (in-flight outputs
    counted), and no block is returned to the pool while a step that
    references it is unprocessed (when `defer_block_free` is on; the fence
    state is `DeferredBlockFrees`' fields).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_config: KVCacheConfig,
        cache_config: CacheConfig,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.kv_cache_config = kv_cache_config
        self.cache_config = cache_config
        self.policy = scheduler_config.policy
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold

        block_sizes = [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len=scheduler_config.max_model_len,
            scheduler_block_size=math.lcm(*block_sizes),
            hash_block_size=cache_config.hash_block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
        )
        self.hash_block_size = self.kv_cache_manager.hash_block_size
        # Requests must hash their tokens with this to hit the prefix cache.
        self.block_hasher = (self.kv_cache_manager.request_block_hasher
                             if self.kv_cache_manager.enable_caching else None)
        # A sequence longer than the pool could hold on its own would be preempted
        # forever: longer prompts are ignored, generation stops at that length.
        self.max_tokens_in_pool = max_tokens_in_pool(
            kv_cache_config, scheduler_config.max_model_len, self.max_num_scheduled_tokens)
        self.max_model_len = min(self.max_tokens_in_pool + 1, scheduler_config.max_model_len)
        if self.max_model_len < scheduler_config.max_model_len:
            logger.warning("KV pool of %d blocks holds at most %d tokens per request; "
                           "capping max_model_len %d to that", kv_cache_config.num_blocks,
                           self.max_model_len, scheduler_config.max_model_len)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self._ignored_outputs: list[EngineCoreOutput] = []
        DeferredBlockFrees.__init__(self, scheduler_config.should_defer_block_free)
        self.pause_state = PauseState.UNPAUSED
        self.num_preemptions = 0
        spec_config = scheduler_config.speculative_config
        self.speculator = Speculator(spec_config) if spec_config is not None else None

    def _free_cow_retained_blocks(self, blocks: list[KVCacheBlock], fence_seq: int) -> None:
        """Release the CoW endpoints retained for the copy done in step `fence_seq`:
        now if that step is processed (or deferral is off), else as-is behind the fence.
        Reads only the seed's fields, as the seed's tests call it on a stand-in scheduler."""
        free_or_defer(self.kv_cache_manager.block_pool, self.deferred_frees, blocks,
                      fence_seq, self.processed_step_seq, self.defer_block_free)

    def _drain_deferred_frees(self) -> None:
        """Free, oldest first and as-is, every deferred list whose fence is processed."""
        drain_ready(self.kv_cache_manager.block_pool, self.deferred_frees, self.processed_step_seq)

    # -- requests in ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or finish it as ignored if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.block_hasher is not None and request._block_hasher is None:
            # Built without a hasher (tests, tools): hash it the way this cache expects.
            request._block_hasher = self.block_hasher
            request.update_block_hashes()
        reason = self._reason_to_ignore(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            request.stop_reason = reason
            logger.warning("request %s ignored: %s", request.request_id, reason)
            self._ignored_outputs.append(EngineCoreOutput(
                request.request_id, [], finish_reason=request.get_finished_reason(), stop_reason=reason))
            return
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _reason_to_ignore(self, request: Request) -> str | None:
        # Lengths, ids and parameters are checked before a request gets here
        # (kvserve/engine/validation.py); only the pool's own limit remains.
        num_prompt_tokens = request.num_prompt_tokens
        if num_prompt_tokens > self.max_tokens_in_pool:
            return (f"prompt of {num_prompt_tokens} tokens cannot fit the KV cache "
                    f"({self.kv_cache_config.num_blocks} blocks)")
        return None

    # -- schedule -------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then admissions, then the output."""
        self._drain_deferred_frees()
        if self.speculator is not None:
            self.speculator.begin_step()
        plan = StepPlan(token_budget=self.max_num_scheduled_tokens)
        if self.pause_state != PauseState.PAUSED_ALL:
            self._schedule_running(plan)
            if not plan.preempted_req_ids:
                self._schedule_waiting(plan)
        copies, retained = self.kv_cache_manager.take_kv_cache_block_copies()
        self._free_cow_retained_blocks(retained, fence_seq=self.next_step_seq())
        step_seq = self.mark_scheduled() if plan.num_scheduled_tokens else self.sched_step_seq
        output = build_scheduler_output(plan, step_seq, self.kv_cache_manager.get_block_ids,
                                        self.finished_req_ids, copies)
        self.finished_req_ids = set()
        self._advance_scheduled(plan, step_seq)
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_tokens_to_run(request, plan.token_budget)
            if num_new_tokens == 0:
                req_index += 1
                continue
            drafts = self._propose_drafts(request, num_new_tokens, plan.token_budget)
            lookahead = self._runner_lookahead(request, request.num_computed_tokens + num_new_tokens)
            # The step in flight may accept all its drafts: this one's tokens come after.
            num_unverified = len(request.spec_token_ids)
            new_blocks = self._allocate_ahead(request, num_new_tokens, drafts, lookahead + num_unverified)
            if new_blocks is None:
                drafts, lookahead = [], 0
                new_blocks = self._allocate_or_preempt(request, num_new_tokens, plan, num_unverified)
            if new_blocks is None:
                return
            plan.add_running(request, num_new_tokens + len(drafts), block_ids_or_none(new_blocks), drafts)
            self._note_runner_proposal(request, plan, lookahead)
            if num_unverified:
                plan.after_unverified_drafts_req_ids.add(request.request_id)
            # A priority victim may have sat before this request in `running`.
            req_index = self.running.index(request) + 1 if plan.preempted_req_ids else req_index + 1

    def _num_tokens_to_run(self, request: Request, token_budget: int) -> int:
        num_pending = request.num_output_placeholders
        if num_pending and reached_length_cap(request, self.max_model_len, num_pending):
            return 0  # the in-flight outputs already finish it
        drafts_in_runner = self.speculator is not None and self.speculator.runner_lookahead > 0
        if request.spec_token_ids and not drafts_in_runner:
            return 0  # its step in flight emits an unknown number of tokens
        if num_pending and self._speculates(request) and not drafts_in_runner:
            return 0  # wait for the last token, then propose after it
        num_computed = request.num_computed_tokens
        num_new_tokens = request.num_tokens + num_pending - num_computed
        if num_new_tokens > 1:
            num_new_tokens = self._cap_long_prefill(num_new_tokens)
        return max(min(num_new_tokens, token_budget, self.max_model_len - num_computed), 0)

    def _speculates(self, request: Request) -> bool:
        return self.speculator is not None and self.speculator.wants_drafts(request, len(self.running))

    def _propose_drafts(self, request: Request, num_new_tokens: int, token_budget: int) -> list[int]:
        """Draft tokens to verify after a decoding request's last token: none while
        it prefills, has an output in flight, or when speculation does not pay."""
        # With a draft model the runner fills the drafts in, so a request may draft
        # while its previous step is in flight (positions counted pessimistically).
        if self.speculator is None:
            return []
        num_pending = request.num_output_placeholders
        if (num_new_tokens != 1 or (num_pending and not self.speculator.runner_lookahead)
                or request.num_computed_tokens != request.num_tokens + num_pending - 1
                or not self._speculates(request)):
            return []
        # Room: the drafts plus the token sampled after them stay within the caps, even
        # if the step in flight accepts all of its drafts.
        num_unknown = num_pending + len(request.spec_token_ids)
        room = min(token_budget - 1, self.max_model_len - request.num_tokens - num_unknown - 1)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - num_unknown - 1)
        return self.speculator.propose(request, room, len(self.running))

    def _runner_lookahead(self, request: Request, chunk_end: int) -> int:
        """Slots the draft model needs after a chunk ending at token `chunk_end`: its
        proposal, when the chunk samples and the request speculates; else 0."""
        if self.speculator is None or chunk_end < request.num_tokens or not self._speculates(request):
            return 0
        return self.speculator.runner_lookahead

    def _note_runner_proposal(self, request: Request, plan: StepPlan, runner_lookahead: int) -> None:
        """Record whether the runner proposes drafts after this step of `request`."""
        if self.speculator is None or not self.speculator.runner_lookahead:
            return
        if runner_lookahead:
            plan.draft_proposal_req_ids.add(request.request_id)
        self.speculator.note_runner_proposal(request.request_id, bool(runner_lookahead))

    def _allocate_ahead(self, request: Request, num_new_tokens: int, drafts: list[int],
                        runner_lookahead: int) -> KVCacheBlocks | None:
        """Slots for the new tokens plus, as lookahead (never hashed into the prefix
        cache), the drafts to verify and the draft model's proposal; None when
        there is nothing to look ahead for or the pool is short (no preemption)."""
        if not drafts and not runner_lookahead:
            return None
        return self.kv_cache_manager.allocate_slots(request, num_new_tokens,
                                                    num_lookahead_tokens=len(drafts) + runner_lookahead)

    def _cap_long_prefill(self, num_new_tokens: int) -> int:
        threshold = self.long_prefill_token_threshold
        if (threshold > 0 and self.enable_chunked_prefill
                and len(self.running) + len(self.waiting) > 1):
            return min(num_new_tokens, threshold)
        return num_new_tokens

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, plan: StepPlan,
                             num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Allocate slots for `request`, preempting victims until they fit.

        Returns None when the request cannot run in this step: it was the
        victim itself, or the victim's blocks are fenced by an unprocessed
        step (freeing them cannot make room now, so the cascade stops and the
        victim stays RUNNING).
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens,
                                                              num_lookahead_tokens=num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = pick_victim(self.running, self.policy)
            if self.is_fenced(victim.last_sched_seq):
                return None
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.running.remove(victim)
        plan.remove(victim)
        self._free_request_blocks(victim)
        reset_for_recompute(victim)
        self.num_preemptions += 1
        plan.preempted_req_ids.add(victim.request_id)
        self.waiting.prepend(victim)
        logger.debug("preempted %s", victim.request_id)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        skipped = []
        while (self.waiting and plan.token_budget > 0
               and len(self.running) < self.max_num_running_reqs):
            request = self.waiting.peek()
            if not self._may_admit(request):
                skipped.append(self.waiting.pop())
                continue
            if not self._admit(request, plan):
                break
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _may_admit(self, request: Request) -> bool:
        if request.num_in_flight_tokens > 0:
            return False  # preempted with an output still in flight: wait for it
        return self.pause_state == PauseState.UNPAUSED or request.status == RequestStatus.PREEMPTED

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        """Try to start (or resume) the waiting head; False when it does not fit."""
        hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = self._cap_long_prefill(request.num_tokens - num_hit_tokens)
        if not self.enable_chunked_prefill and num_new_tokens > plan.token_budget:
            return False
        num_new_tokens = min(num_new_tokens, plan.token_budget)
        lookahead = self._runner_lookahead(request, num_hit_tokens + num_new_tokens)
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens=num_hit_tokens,
            new_computed_blocks=hit_blocks, num_lookahead_tokens=lookahead)
        if new_blocks is None and lookahead:
            lookahead = 0  # the proposal must not keep a prompt that fits out of the pool
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_new_computed_tokens=num_hit_tokens,
                new_computed_blocks=hit_blocks)
        if new_blocks is None and num_hit_tokens and self._pool_is_idle():
            # A partial-block hit costs a copy block on top of the source it
            # keeps; in a tiny pool that can be the difference. Cold, it fits.
            num_hit_tokens, lookahead = 0, 0
            num_new_tokens = min(self._cap_long_prefill(request.num_tokens), plan.token_budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        if new_blocks is None:
            return False
        self.waiting.pop()
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        self.running.append(request)
        plan.add_admitted(request, num_new_tokens, resumed)
        self._note_runner_proposal(request, plan, lookahead)
        return True

    def _pool_is_idle(self) -> bool:
        """No request holds blocks and none wait on a fence: the pool is as free as it gets."""
        return not self.running and not self.deferred_frees

    def _advance_scheduled(self, plan: StepPlan, step_seq: int) -> None:
        for request in plan.scheduled_requests():
            num_tokens = plan.num_scheduled_tokens[request.request_id]
            request.spec_token_ids = plan.spec_token_ids.get(request.request_id, [])
            # Drafts count as computed once accepted (update_from_output).
            request.num_computed_tokens += num_tokens - len(request.spec_token_ids)
            request.num_in_flight_tokens += num_tokens
            request.last_sched_seq = step_seq
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1

    # -- outputs in -----------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput,
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens (steps strictly in order); returns the
        per-request outputs, finished requests included."""
        if scheduler_output.num_scheduled_tokens:
            self.mark_processed(scheduler_output.step_seq)
        self._drain_deferred_frees()
        outputs, stopped = apply_sampled_tokens(self, scheduler_output, model_runner_output)
        if stopped:
            self.running = [request for request in self.running if request.request_id not in stopped]
            for request in stopped.values():
                self._free_finished(request)
        if self._ignored_outputs:
            outputs.extend(self._ignored_outputs)
            self._ignored_outputs = []
        return outputs

    def cache_processed_blocks(self, request: Request) -> None:
        """Register the newly full blocks whose tokens are known and processed."""
        num_processed = min(request.num_computed_tokens - request.num_in_flight_tokens,
                            request.num_tokens)
        if num_processed > 0:
            self.kv_cache_manager.cache_blocks(request, num_processed)

    # -- finishing ------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus) -> list[Request]:
        """Finish live requests from outside (abort, stop string); None means all.
        Returns the requests actually finished (unknown or finished ids are skipped)."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_finished(request)
            finished.append(request)
        return finished

    def _free_finished(self, request: Request) -> None:
        self._free_request_blocks(request)
        if self.speculator is not None:
            self.speculator.forget(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _free_request_blocks(self, request: Request) -> None:
        """Free now, or park the blocks (eviction order) behind the newest step."""
        if self.is_fenced(request.last_sched_seq):
            blocks = self.kv_cache_manager.pop_blocks_for_free(request)
            self.free_or_defer_blocks(self.kv_cache_manager.block_pool, blocks, self.sched_step_seq)
        else:
            self.kv_cache_manager.free(request)

    # -- pause, queries, stats ------------------------------------------------

    def pause(self, mode: str = "abort") -> list[Request]:
        """Pause with `mode`: "abort" (finish everything as aborted, admit
        nothing new), "wait" (let running and preempted requests finish, admit
        nothing new) or "keep" (freeze everything). Returns the aborted requests."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        aborted = self.finish_requests(None, RequestStatus.FINISHED_ABORTED) if mode == "abort" else []
        self.pause_state = PAUSE_MODES[mode]
        return aborted

    def resume(self) -> None:
        self.pause_state = PauseState.UNPAUSED

    def get_num_unfinished_requests(self) -> int:
        if self.pause_state == PauseState.PAUSED_ALL:
            return 0
        num_ignored = len(self._ignored_outputs)
        if self.pause_state == PauseState.PAUSED_NEW:
            num_preempted = sum(1 for r in self.waiting if r.status == RequestStatus.PREEMPTED)
            return len(self.running) + num_preempted + num_ignored
        return len(self.running) + len(self.waiting) + num_ignored

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        queries, hits = prefix_cache_counts(self.kv_cache_manager.make_prefix_cache_stats())
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=self.num_preemptions,
            num_deferred_blocks=self.num_deferred_blocks,
            sched_step_seq=self.sched_step_seq,
            processed_step_seq=self.processed_step_seq,
            spec_decoding_stats=self.speculator.take_stats() if self.speculator is not None else None,
        )
