"""Which OpenAI request fields kvroute's own engines implement.

A field that changes the answer must never be dropped silently: the gateway forwards a
request carrying a field outside this list only to workers that implement it (vLLM),
and our worker app answers such a request with a 400 naming the field. Both read this
one list. A field counts as used when it is present with a value other than its
neutral one (`n: 1`, `logprobs: false` and the like ask for nothing).
"""
from __future__ import annotations

from collections.abc import Mapping

# Fields our engines honour (or that only carry the request itself).
IMPLEMENTED_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "stop", "temperature", "top_p", "seed",
    "cache_salt", "ignore_eos", "kv", "min_tokens",
})
IMPLEMENTED_CHAT = IMPLEMENTED_COMMON | {"messages", "max_completion_tokens"}
IMPLEMENTED_COMPLETION = IMPLEMENTED_COMMON | {"prompt"}

# Fields that change nothing a self-hosted engine computes (accounting and storage
# options of OpenAI's hosted service); accepted and ignored.
METADATA_ONLY = frozenset({"user", "metadata", "store", "service_tier"})

# Values that ask for nothing: such a field is as good as absent.
NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
    "logit_bias": ({},),
    "stop_token_ids": ([],),
    "tools": ([],),
    "stream_options": (),
    "suffix": ("",),
    "priority": (0,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "echo_prompt": (False,),
    # sglang-router and vllm-router send these on every chat request, at these values,
    # whatever the client asked: at them nothing changes for a model without a reasoning parser
    "no_stop_trim": (False,),
    "return_hidden_states": (False,),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
    "include_reasoning": (True,),
}
# Neutral values that differ between the endpoints (vLLM's defaults for each).
NEUTRAL_CHAT: dict[str, tuple[object, ...]] = {**NEUTRAL, "add_special_tokens": (False,)}
NEUTRAL_COMPLETION: dict[str, tuple[object, ...]] = {**NEUTRAL, "add_special_tokens": (True,)}


def _neutral(neutral: Mapping[str, tuple[object, ...]], name: str, value: object) -> bool:
    if value is None:
        return True
    choices = neutral.get(name)
    return choices is not None and any(type(value) is type(c) and value == c for c in choices)


def unsupported_fields(body: Mapping[str, object], chat: bool) -> list[str]:
    """The body's fields our engines do not implement, in body order (empty: all fine)."""
    implemented = IMPLEMENTED_CHAT if chat else IMPLEMENTED_COMPLETION
    neutral = NEUTRAL_CHAT if chat else NEUTRAL_COMPLETION
    return [k for k, v in body.items()
            if k not in implemented and k not in METADATA_ONLY and not _neutral(neutral, k, v)]


def unsupported_content(messages: object) -> str | None:
    """The path of the first chat content part that is not text (`messages[i].content[j]`), if any."""
    if not isinstance(messages, list):
        return None
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text"):
                    return f"messages[{i}].content[{j}]"
    return None
