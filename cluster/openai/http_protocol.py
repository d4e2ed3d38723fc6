"""uvicorn's httptools protocol with the bounds uvicorn lacks on a request's head: its size,
its number of headers and the time it may take (the limits: cluster/openai/http_limits.py)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from cluster.openai.api_models import error_body

if TYPE_CHECKING:  # http_limits builds this protocol (uvicorn_options)
    from cluster.openai.http_limits import HttpLimits


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a request's head bounded in bytes, headers and time.

    Bytes arriving while a head is incomplete are handed to the parser only up to the byte
    limit, so an oversized head is refused before it is buffered. The head timer runs from
    the connection's start, and from the first byte after a response (uvicorn's keep-alive
    timer stops there), until the headers are complete; it never closes a connection whose
    response is under way. Past the headers, bodies and responses go through uvicorn's own
    code (a flag test per chunk received; nothing per chunk sent)."""

    def __init__(self, *args, limits: HttpLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._in_head = True  # the bytes arriving now belong to a request's head
        self._head_bytes = 0
        self._head_count = 0
        self._heads_done = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._in_head:
            super().data_received(data)
        else:
            room = self.limits.max_header_bytes - self._head_bytes
            heads_before = self._heads_done
            self._head_bytes += min(len(data), room)
            super().data_received(data if len(data) <= room else data[:room])
            if len(data) > room and not self.transport.is_closing():
                if self._heads_done == heads_before:  # this head is still incomplete at the limit
                    self._refuse(431, f"request headers are larger than the limit of "
                                      f"{self.limits.max_header_bytes} bytes", "headers_too_large")
                    return
                self.data_received(data[room:])  # the head ended inside: the rest is a body or the next request
                return
        if self._head_timer is None and not self.transport.is_closing() and not self._serving():
            self._arm_head_timer()  # bytes after a response: a new head, or the unread rest of a body

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._head_count += 1
        if self._head_count > self.limits.max_headers:
            self._refuse(431, f"a request may have at most {self.limits.max_headers} headers", "too_many_headers")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._heads_done += 1
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._in_head, self._head_bytes, self._head_count = True, 0, 0

    def _serving(self) -> bool:
        """Whether a request is in hand whose response is not complete yet."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.request_header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._serving():  # a response's end arms uvicorn's keep-alive timer
            return
        if self._in_head and self._head_bytes:
            self._refuse(408, f"request headers not complete within the {self.limits.request_header_timeout:g} s "
                              "limit", "request_timeout")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` with an OpenAI error body and close the connection; the parser's
        later callbacks for this connection do nothing."""
        self._refused = True
        self._cancel_head_timer()
        body = json.dumps(error_body(message, "invalid_request_error", "headers", code)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        self.logger.warning("%s - %d: %s; connection closed", peer, status, message)
        self.transport.write(b"".join(head))
        self.transport.close()
