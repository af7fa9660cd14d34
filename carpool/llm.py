"""Offline batch API: `LLM().generate(prompts)` and `LLM().chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from carpool.args import engine_config
from carpool.engine import LLMEngine
from carpool.inputs import PromptType, TokensPrompt, is_single_prompt, parse_prompt
from carpool.outputs import RequestOutput
from carpool.sampling_params import SamplingParams
from carpool.tools.template import apply_chat_template

Message = dict[str, str]


class LLM:
    """vLLM's offline API over one LLMEngine. Keyword arguments are vLLM's engine arguments
    (carpool/args.py: honoured, mapped, or ignored with a warning)."""

    def __init__(self, model: str | None = None, **kwargs):
        self.llm_engine = LLMEngine(engine_config(model, **kwargs))
        self.tokenizer = self.llm_engine.tokenizer

    @property
    def engine(self) -> LLMEngine:
        return self.llm_engine

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams runs with: the model's generation_config.json
        defaults, as vLLM applies them (a fresh object each call, safe to modify)."""
        return self.llm_engine.default_sampling_params()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; returns whether it did (False while a request holds blocks).
        `generate` and `chat` run their requests to completion, so between calls none does and
        `reset_running_requests` has nothing to act on."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion: one RequestOutput per prompt, with `n` choices in its
        `outputs`. A prompt is text, token ids, or a TextPrompt / TokensPrompt dict (a dict with
        a key carpool does not know raises ValueError before anything runs). A prompt the engine
        refuses gets an output with `error` set and finish_reason 'error'; the others still run."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        texts = [parse_prompt(prompt)[0] for prompt in prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        choices: dict[str, tuple[str, int]] = {}  # engine request id -> (prompt's id, choice index)
        order = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            sp = sp or engine.default_sampling_params()  # generation_config.json's, as vLLM
            rid = f"gen-{id(self)}-{i}"
            order.append(rid)
            try:
                for j, choice_params in enumerate(one_per_choice(sp)):
                    engine.add_request(prompt, choice_params, request_id=f"{rid}-{j}")
                    choices[f"{rid}-{j}"] = (rid, j)
            except ValueError as e:
                for cid, (parent, _) in list(choices.items()):
                    if parent == rid:
                        engine.abort_request(cid)
                        del choices[cid]
                results[rid] = RequestOutput.failed(rid, texts[i], str(e), sp.n)
        pending = {rid: [None] * (sp.n if sp else 1) for rid, sp in zip(order, params) if rid not in results}
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm, initial=len(results))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                rid, j = choices[out.request_id]
                pending[rid][j] = out
                if all(pending[rid]):
                    results[rid] = merge_choices(rid, pending.pop(rid))
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def apply_chat_template(self, messages: list[Message], chat_template: str | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            tools: list[dict] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of one conversation. `tools` (OpenAI's function definitions) reach the template;
        a template that ignores tools gets them written into the system message (carpool/tools).
        `chat_template_kwargs` become template variables (e.g. `enable_thinking`)."""
        return apply_chat_template(self.tokenizer, messages, tools=tools, chat_template=chat_template,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {'role','content'}) or several; answers via the model's
        own chat template (or `chat_template`, a Jinja string), given `chat_template_kwargs` as
        template variables. Each output's `prompt` is the rendered conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = apply_chat_template(self.tokenizer, conversation, tools=tools, chat_template=chat_template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       chat_template_kwargs=chat_template_kwargs, tokenize=False)
            # The template writes the special tokens itself; encoding adds none (as transformers does).
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append(TokensPrompt(prompt_token_ids=ids, prompt=text))
        return self.generate(prompts, sampling_params, use_tqdm)


def one_per_choice(sp: SamplingParams) -> list[SamplingParams]:
    """n choices -> n engine requests; choice j of a seeded request draws with seed + j. The
    prompt is scored (prompt_logprobs) once, by the first."""
    if sp.n == 1:
        return [sp]
    return [replace(sp, n=1, seed=None if sp.seed is None else (sp.seed + j + 2**63) % 2**64 - 2**63,
                    prompt_logprobs=sp.prompt_logprobs if j == 0 else None)
            for j in range(sp.n)]


def merge_choices(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    first = outs[0]
    if len(outs) == 1:
        return first
    merged = [replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
    errors = [o.error for o in outs if o.error]
    return replace(first, request_id=request_id, outputs=merged, error=errors[0] if errors else None)
