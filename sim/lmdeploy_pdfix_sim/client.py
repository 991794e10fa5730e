"""Bounded OpenAI-style requests against any proxy, checked against the emulated model's exact answer.

Standard library only, so soak runs and tests need nothing beyond the package.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from lmdeploy_pdfix.domain.protocol import bearer
from lmdeploy_pdfix_sim import model
from lmdeploy_pdfix_sim.cluster import MODEL_NAME

KINDS = ('completions', 'chat', 'stream', 'stream_completions')  # 'stream': streamed chat
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Result:
    kind: str
    status: int  # HTTP status; 0 when no answer came back in time
    text: str
    expected: str
    latency_s: float
    error: str = ''

    @property
    def ok(self) -> bool:
        """HTTP 200 and exactly the text the emulated model must produce (a 200 with wrong text fails)."""
        return self.status == 200 and self.text == self.expected and not self.error


def _payload(kind: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    body: dict = {'model': MODEL_NAME, 'max_tokens': max_tokens}
    if kind in ('completions', 'stream_completions'):
        return '/v1/completions', {**body, 'prompt': prompt, 'stream': kind == 'stream_completions'}
    messages = [{'role': 'user', 'content': prompt}]
    return '/v1/chat/completions', {**body, 'messages': messages, 'stream': kind == 'stream'}


def _text_of(kind: str, raw: bytes) -> tuple[str, str]:
    """(text, error) from a response body; streams are SSE lines of chat deltas or completion texts."""
    if kind not in ('stream', 'stream_completions'):
        data = json.loads(raw)
        if not isinstance(data, dict) or 'choices' not in data:
            return '', f'no choices in {raw[:200]!r}'
        choice = data['choices'][0]
        return (choice['text'] if kind == 'completions' else choice['message']['content'] or ''), ''
    parts = []
    for line in raw.decode(errors='replace').splitlines():
        if not line.startswith('data:') or line.strip() == 'data: [DONE]':
            continue
        chunk = json.loads(line[len('data:'):])
        if 'choices' not in chunk:
            return ''.join(parts), f'stream error chunk {chunk}'
        for choice in chunk['choices']:
            parts.append(choice.get('text') or (choice.get('delta') or {}).get('content') or '')
    return ''.join(parts), ''


def request(proxy_url: str, kind: str, prompt: str, max_tokens: int = 8, timeout_s: float = 30.0,
            extra: dict | None = None, api_key: str | None = None) -> Result:
    """One request of ``kind`` (completions, chat or stream), never raising and never outliving ``timeout_s``.

    ``extra`` adds or overrides request fields (e.g. a sampling parameter a node rejects); ``api_key`` is sent
    as a Bearer token.
    """
    path, body = _payload(kind, prompt, max_tokens)
    body.update(extra or {})
    expected = model.expected_text_for(prompt, max_tokens)
    req = urllib.request.Request(f'{proxy_url}{path}', data=json.dumps(body).encode(), method='POST',
                                 headers={'Content-Type': 'application/json', **bearer(api_key)})
    began = time.monotonic()
    try:
        with _OPENER.open(req, timeout=timeout_s) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        return Result(kind, exc.code, '', expected, time.monotonic() - began, exc.read()[:300].decode(errors='replace'))
    except (OSError, ValueError, http.client.HTTPException) as exc:  # timeouts, refusals, cut-off answers
        return Result(kind, 0, '', expected, time.monotonic() - began, repr(exc))
    try:
        text, error = _text_of(kind, raw)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        text, error = '', f'unparsable answer {raw[:200]!r}: {exc!r}'
    return Result(kind, status, text, expected, time.monotonic() - began, error)


def prompt_for(index: int, length: int = 0) -> str:
    """Distinct prompts, so a mixed-up owner (another request's KV) shows up as a wrong text."""
    base = f'request {index}: tell me about owner {index * 7919 % 10007}.'
    if length <= len(base):
        return base
    filler = ' lorem ipsum dolor sit amet'
    return (base + filler * (length // len(filler) + 1))[:length]


def stream_then_disconnect(proxy_url: str, prompt: str, max_tokens: int, timeout_s: float = 30.0,
                           chat: bool = True, events: int = 1) -> tuple[int, str]:
    """Start a streaming chat (or completion), read up to its ``events``-th ``data:`` event, then drop the connection.

    Returns (HTTP status, the last event line read, or the error body); (0, error) when nothing came back in time.
    """
    conn = _open(proxy_url, 'stream' if chat else 'stream_completions', prompt, max_tokens, timeout_s)
    try:
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.read()[:300].decode(errors='replace')
        seen, line = 0, b''
        while seen < events:
            line = response.readline()
            if not line:
                break
            seen += line.startswith(b'data:')
        return response.status, line.decode(errors='replace').strip()
    except OSError as exc:
        return 0, repr(exc)
    finally:
        _leave(conn)


def send_then_leave(proxy_url: str, kind: str, prompt: str, max_tokens: int) -> int:
    """Send a request and close the connection at once, before any answer: 0, as no status is ever read."""
    with contextlib.suppress(OSError):
        _leave(_open(proxy_url, kind, prompt, max_tokens, timeout_s=5.0))
    return 0


def _open(proxy_url: str, kind: str, prompt: str, max_tokens: int, timeout_s: float) -> http.client.HTTPConnection:
    """A connection with the request of ``kind`` sent on it, its answer not read yet."""
    parts = urllib.parse.urlsplit(proxy_url)
    path, body = _payload(kind, prompt, max_tokens)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    conn.request('POST', path, json.dumps(body), {'Content-Type': 'application/json'})
    return conn


def _leave(conn: http.client.HTTPConnection) -> None:
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)  # a real disconnect, not a lingering half-read response
    conn.close()


def preserved_prefill_body(index: int, stream: bool = False) -> dict:
    """A Prefill request that keeps its cache for a Decode node, as the proxy sends it."""
    return {'model': MODEL_NAME, 'prompt': prompt_for(index), 'max_tokens': 1, 'with_cache': True,
            'preserve_cache': True, 'stream': stream}


def drop_preserved_stream(prefill_url: str, index: int, wait: Callable[[], object]) -> None:
    """Start a streamed preserved Prefill request, ``wait()``, then close the connection: a caller that left."""
    parts = urllib.parse.urlsplit(prefill_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request('POST', '/v1/completions', json.dumps(preserved_prefill_body(index, stream=True)),
                     {'Content-Type': 'application/json'})
        wait()
    finally:
        conn.close()
