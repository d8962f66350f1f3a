"""The prefill leg of a prefill/decode pair (router/planner/pd.py decides; the gateway runs it).

The exchange is the one vLLM's disaggregated-serving proxies make with its KV connectors,
for both worker kinds (our engine accepts `kv_transfer_params` the same way):

1. to the prefill worker P: the request as the decode worker will get it (a vLLM worker:
   the client's body; ours: the relay's token ids) with `max_tokens` 1 (and
   `max_completion_tokens` 1 when the client set it), `stream` false, no
   `stream_options`, no `min_tokens` / `min_completion_tokens` (a one-token answer cannot
   honour them), and `kv_transfer_params` asking for a remote decode (`REMOTE_DECODE`).
   P computes the prompt, answers one token in one JSON body and keeps the prompt's
   blocks for the decode side, naming them in its answer's `kv_transfer_params`;
2. to the decode worker D (`Attempt.kv_transfer`, passthrough.py / relay.py): the
   client's request as it came (streamed or not as the client asked) plus P's
   `kv_transfer_params`, the very bytes P wrote (`msgspec.Raw`: never decoded and
   re-encoded). D pulls the blocks, and its answer is the client's: the first token the
   client sees is D's. P's one token is discarded, as vLLM's proxies do: D's stream is
   the whole answer (one id, one usage, one set of logprobs), and D samples its first
   token from the same prompt KV.

P answering without `kv_transfer_params` (a worker without a KV connector) is what
vLLM's proxies accept too: D is then sent the plain request and prefills it itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from ..fleet.pool import WorkerPool
from ..fleet.worker import Worker
from ..planner.types import Estimate
from .client import UpstreamClient
from .passthrough import client_body, read_whole
from .proxy import UpstreamError
from .relay import worker_body

if TYPE_CHECKING:
    from ..intake.prepare import Prepared

# What asks a vLLM prefill server (NIXL connector) to compute the prompt for a remote decode.
REMOTE_DECODE = msgspec.Raw(b'{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,'
                            b'"remote_block_ids":null,"remote_host":null,"remote_port":null}')
_enc = msgspec.json.Encoder()


class _Answer(msgspec.Struct):
    """The parts of P's JSON answer the gateway reads; `kv_transfer_params` kept as bytes."""

    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")  # absent: as null
    usage: dict[str, Any] | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


@dataclass(slots=True)
class Prefilled:
    """A prefill leg that succeeded: where, what to send on, and the prompt tokens whose KV
    P offers (its prompt's full blocks)."""

    worker: Worker
    params: msgspec.Raw | None
    moved_tokens: int
    seconds: float  # from dispatch to P's answer: its TTFT (one token)
    kv: dict[str, Any] | None = None  # our worker's `usage.kv` timings (calibration)


def prefill_body(prep: Prepared, w: Worker) -> bytes:
    """Request 1 of the exchange (module doc), for worker `w`."""
    body = client_body(prep, w) if w.kind == "vllm" else worker_body(prep, w)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(k, None)
    body["kv_transfer_params"] = REMOTE_DECODE
    return _enc.encode(body)


def moved_tokens(answer_usage: dict[str, Any] | None, prompt_tokens: int, block_size: int) -> int:
    """The tokens of the prompt's full blocks (P's count when it reports one)."""
    n = answer_usage.get("prompt_tokens") if answer_usage is not None else None
    if not isinstance(n, int) or n < 0:
        n = prompt_tokens
    return n // block_size * block_size if block_size > 0 else n


async def prefill(client: UpstreamClient, pool: WorkerPool, prep: Prepared, w: Worker, est: Estimate | None,
                  predicted_s: float | None) -> Prefilled:
    """Run the prefill leg on `w`. Raises UpstreamError: retryable when P failed (no answer,
    5xx, 429, an answer that is not JSON), not retryable for P's own 4xx (the request
    itself is wrong; its `api_error` is what the client gets)."""
    prompt = len(prep.ids)
    rec = pool.dispatched(w, est.recompute_tokens if est is not None and est.eligible else prompt, prompt + 1, est)
    path = "/v1/chat/completions" if prep.chat and w.kind == "vllm" else "/v1/completions"
    headers = {"content-type": "application/json", "accept": "application/json", "x-request-id": prep.request_id}
    t0 = time.monotonic()
    try:
        head_s = client.timeouts.whole_answer_s(predicted_s, 1)
        resp = await client.send(w, path, prefill_body(prep, w), headers, head_s, rec.ticket, relay_4xx=False)
        rec.ticket.abort = resp.close
        pool.accepted(rec)
        try:
            raw = await read_whole(resp, w, client.timeouts.idle_timeout_s)
        finally:
            resp.release()
        try:
            ans = _decode_answer(raw)
        except msgspec.DecodeError:
            raise UpstreamError(f"prefill worker {w.id} answered 200 with a body that is not a JSON object", True,
                                phase="first") from None
        pool.first_token(rec)
        params: msgspec.Raw | None = ans.kv_transfer_params
        if bytes(ans.kv_transfer_params).strip() in (b"null", b"{}"):
            params = None  # no KV connector: D prefills itself
        moved = 0 if params is None else moved_tokens(ans.usage, prompt, w.block_size)
        kv = ans.usage.get("kv") if ans.usage is not None else None
        return Prefilled(w, params, moved, time.monotonic() - t0, kv if isinstance(kv, dict) else None)
    finally:
        rec.ticket.abort = None
        pool.finished(rec)
