"""Offline batch API: `LLM().generate(prompts)` and `LLM().chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from carpool.config import EngineConfig
from carpool.engine import LLMEngine
from carpool.outputs import RequestOutput
from carpool.request import RequestStatus
from carpool.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion. A bad prompt gets an output with `error` set and
        finish_reason 'error'; the others still run."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            rid = f"gen-{id(self)}-{i}"
            order.append(rid)
            try:
                self.engine.add_request(prompt, sp, request_id=rid)  # None: the model's defaults
            except ValueError as e:
                results[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None,
                                             [], "", [], "", [], True, RequestStatus.FINISHED_ERROR.value,
                                             error=str(e))
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm, initial=len(results))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {'role','content'}) or several; answers via the model's
        own chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, use_tqdm)
