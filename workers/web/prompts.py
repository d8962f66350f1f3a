"""How a request becomes the engine's token ids, shared by the generation routes and
/tokenize, so both give the same ids: the fields rule of `kvwire.openai`, chat messages
as the template wants them, and the bounds of a token-id prompt.
"""
from __future__ import annotations

from collections.abc import Mapping

from kvwire.openai import unsupported_content, unsupported_fields
from workers.errors import BadRequest
from workers.schema import ChatMessage

from .common import Unsupported

# Request fields of our own wire extension that `kvwire.openai` (OpenAI's fields) does
# not list: `lora` scopes block keys to an adapter (docs/wire.md).
WORKER_EXTENSIONS = frozenset({"lora"})
# Fields the app hands to the engine in `GenRequest`, where the engine refuses what it
# cannot honour (the simulated engine has no log-probabilities to give, nor KV to transfer).
ENGINE_FIELDS = frozenset({"min_tokens", "logprobs", "return_token_ids", "kv_transfer_params"})
ENGINE_FIELDS_CHAT = ENGINE_FIELDS | {"top_logprobs"}


def refuse_unsupported(body: Mapping[str, object], chat: bool) -> None:
    """400 naming the first field (or non-text content part) our engines do not implement."""
    handled = WORKER_EXTENSIONS | (ENGINE_FIELDS_CHAT if chat else ENGINE_FIELDS)
    fields = [f for f in unsupported_fields(body, chat) if f not in handled]
    if fields:
        raise Unsupported(fields[0])
    if chat:
        refuse_non_text(body.get("messages"))


def refuse_non_text(messages: object) -> None:
    """400 naming the first chat content part that is not text (`messages[i].content[j]`)."""
    part = unsupported_content(messages)
    if part is not None:
        raise Unsupported(part, f"a content part that is not text ({part})")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them: text parts joined, `developer` as `system`
    (the gateway's rule)."""
    if not messages:
        raise BadRequest("messages must not be empty", param="messages")
    out = []
    for m in messages:
        c = m.content
        if isinstance(c, list):
            c = "".join(part.text for part in c)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": c or ""})
    return out


def check_ids(ids: list[int], top: int, param: str, *, allow_empty: bool = False) -> None:
    """Token ids the tokenizer knows, each in [0, top] (a prompt must have one at least)."""
    if not ids:
        if allow_empty:
            return
        raise BadRequest(f"the {param} is empty", param=param)
    if min(ids) < 0 or max(ids) > top:
        raise BadRequest(f"{param} token ids must be in [0, {top}]", param=param)
