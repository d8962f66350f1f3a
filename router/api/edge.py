"""The connection's edge: bounded request heads and timeouts that close slow clients.

uvicorn's httptools protocol (router/server.py) accepts a request head of any size and
waits for it forever: one connection sending an endless header makes the parser buffer
it all, and connections that send half a request line and stop are never closed.
llhttp offers no head limit and uvicorn none either (its `h11_max_incomplete_event_size`
is for the h11 server only), so this subclass adds them where the bytes arrive:

- the request line (target) is at most `max_request_line_bytes` (414 past it);
- at most `max_header_count` header fields and `max_header_bytes` of them (431 past it),
  counted from the parser's fields and, for a field still incomplete (the endless one),
  from the raw bytes of a head not yet finished;
- a request's head must be complete within `header_timeout_s` of its first byte (and of
  the connection's opening, for the first request; 408 then close);
- a connection idle between requests closes after `idle_timeout_s` (uvicorn's keep-alive).

Refusals are in OpenAI's error shape and close the connection: the rest of a head that
was not read cannot be skipped safely.
"""
from __future__ import annotations

import asyncio
from asyncio import TimerHandle
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .errors import error_body


@dataclass(frozen=True, slots=True)
class HeadLimits:
    max_request_line_bytes: int = 8192
    max_header_count: int = 100
    max_header_bytes: int = 32768
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; the protocol answers `status`."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def protocol_class(limits: HeadLimits) -> type[HttpToolsProtocol]:
    """uvicorn's `http` protocol class with these limits (uvicorn builds one per connection)."""

    class Bounded(BoundedHttpToolsProtocol):
        pass

    Bounded.limits = limits
    return Bounded


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with head limits and a head timeout (module doc)."""

    limits = HeadLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: TimerHandle | None = None
        self._in_head = False  # a request's first byte was parsed, its head not yet complete
        self._url_bytes = 0
        self._field_count = 0
        self._field_bytes = 0
        self._raw_head_bytes = 0
        self._refusal: _Refused | None = None

    # ------------------------------------------------------------------ the connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        if self._head_timer is None and self._between_requests():
            # from the first byte of a request (blank lines included), or from when a head
            # that began behind another response (pipelined) became this connection's turn
            self._arm_head_timer()
        began_before = self._in_head
        super().data_received(data)
        if self._in_head and self._refusal is None and not self.transport.is_closing():
            # The head is still incomplete after this chunk: if it began before it, all of it is head.
            self._raw_head_bytes += len(data) if began_before else 0
            if self._raw_head_bytes > self.limits.max_header_bytes + self.limits.max_request_line_bytes:
                self._refuse(_Refused(431, "Request header fields too large.", "request_header_fields_too_large"))

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parser error; a callback's refusal is answered instead."""
        if self._refusal is not None:
            self._answer(self._refusal)
        else:
            self._answer(_Refused(400, msg, "invalid_http_request"))

    def timeout_keep_alive_handler(self) -> None:
        self._cancel_head_timer()
        super().timeout_keep_alive_handler()

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._url_bytes = self._field_count = self._field_bytes = self._raw_head_bytes = 0
        if self._head_timer is None and self._between_requests():
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > self.limits.max_request_line_bytes:
            self._stop(_Refused(414, f"Request line longer than {self.limits.max_request_line_bytes} bytes.",
                                "request_uri_too_long"))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field_count += 1
        self._field_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._field_count > self.limits.max_header_count:
            self._stop(_Refused(431, f"More than {self.limits.max_header_count} header fields.",
                                "request_header_fields_too_large"))
        if self._field_bytes > self.limits.max_header_bytes:
            self._stop(_Refused(431, f"Header fields larger than {self.limits.max_header_bytes} bytes.",
                                "request_header_fields_too_large"))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    # ------------------------------------------------------------------ refusing

    def _stop(self, r: _Refused) -> None:
        """In a callback: remember the refusal and abort parsing (uvicorn then calls
        send_400_response, which answers it)."""
        self._refusal = r
        raise r

    def _refuse(self, r: _Refused) -> None:
        self._refusal = r
        self._answer(r)

    def _answer(self, r: _Refused) -> None:
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        body = error_body(r.message, "invalid_request_error", None, r.code)
        head = [STATUS_LINE[r.status]]
        head += [n + b": " + v + b"\r\n" for n, v in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    # ------------------------------------------------------------------ the head timer

    def _between_requests(self) -> bool:
        """No response in progress (a pipelined head waits behind one: uvicorn stops
        reading then, and a 408 must not be written into another response)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        """A head not complete in time: 408 when a request began, else just closed (nothing
        was asked, like uvicorn's keep-alive timeout)."""
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._in_head and self._between_requests():
            self._refuse(_Refused(408, f"Request head not received within {self.limits.header_timeout_s:g} s.",
                                  "request_timeout"))
        elif self._between_requests():
            self._unset_keepalive_if_required()
            self.transport.close()
