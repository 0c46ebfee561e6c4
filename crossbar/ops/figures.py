"""What an answer says it did: tokens, speed and cache (docs/design.md §What the answers say).

llama-server ends every answer with its figures; this module reads them from the tail
of a relayed body, once, when the answer ended. It is pure: no I/O, no state, and it
never raises for anything a host sends.

The figures, and what each means (the same as llama-server's own ``--metrics``
counters, so crossbar's totals equal their increase):

- ``prompt``: prompt tokens **processed**, i.e. read and evaluated by the host,
  *excluding* those taken from its KV cache: ``timings.prompt_n``; from ``usage``
  ``prompt_tokens - prompt_tokens_details.cached_tokens`` (OpenAI),
  ``input_tokens - input_tokens_details.cached_tokens`` (Responses), ``input_tokens``
  (Anthropic, which already excludes cache reads); native answers without ``timings``
  ``tokens_evaluated``. llama-server adds this to ``llamacpp:prompt_tokens_total``.
- ``cached``: prompt tokens taken from the cache: ``timings.cache_n``,
  ``cached_tokens``, ``cache_read_input_tokens`` (``llamacpp:prompt_tokens_cached_total``).
  A native answer's ``tokens_cached`` is the whole context kept (prompt and generated),
  not a prompt figure, so it is not used.
- ``generated``: tokens generated: ``timings.predicted_n``, ``completion_tokens``,
  ``output_tokens``, ``tokens_predicted`` (``llamacpp:tokens_predicted_total``).
- ``prompt_speed``, ``generation_speed``: ``timings.prompt_per_second`` and
  ``predicted_per_second`` (tokens/s), None where the answer has no ``timings``.

``timings`` wins over ``usage`` where both are present. Where to look (always in the
last :data:`TAIL_BYTES`, found by searching for the keys, so a long answer costs no
more than a short one and only the figures' own bytes are decoded):

- ``text/event-stream``: the last ``data:`` event carrying ``timings``, ``usage`` or
  ``tokens_predicted`` (OpenAI chat/completions chunks, llama.cpp's native stream, the
  Responses API's ``response.completed`` with its ``response.usage``); for the
  Anthropic API, ``message_delta``'s usage plus ``message_start``'s input tokens
  (from the tail, or from the first chunk of the body, kept by reference).
- JSON: the last ``"timings":``, else ``"usage":``, else native key of the answer --
  the top-level object's (llama-server writes its figures after the content), or the
  last element's of an array (the native endpoints given several prompts). Not in the
  tail (a native answer with ``n_probs`` puts its figures first and the token
  probabilities after them): the same in the body's first chunk.

Anything else -- no figures, a figure that is not a non-negative integer below
:data:`MAX_TOKENS` (or a finite speed below :data:`MAX_SPEED`), a cut event, deep
nesting -- gives None: such an answer counts no tokens.
"""

from __future__ import annotations

import json
import re
from json.scanner import make_scanner
from typing import Any, NamedTuple, Sequence

__all__ = ["Figures", "MAX_SPEED", "MAX_TOKENS", "TAIL_BYTES", "read_figures"]

TAIL_BYTES = 16 * 1024
"""How much of an answer's end is looked at."""

MAX_TOKENS = 1 << 31
"""A token count at or above this is not believed (the answer counts nothing)."""

MAX_SPEED = 1e9
"""Tokens/s at or above this is not believed."""

_DECODER = json.JSONDecoder()
_SCAN = make_scanner(_DECODER)  # type: ignore[arg-type]  # a JSONDecoder is the context make_scanner reads
"""The C scanner behind ``raw_decode`` (one Python frame less per value): ``(value,
end)`` of the JSON value at an index; StopIteration where none starts there."""
_NEW = tuple.__new__


class Figures(NamedTuple):
    """What one complete answer did (see the module docstring for each figure); an
    immutable tuple (cheaper to make than a frozen dataclass: one per request).

    :ivar prompt: prompt tokens processed (read, cache excluded).
    :ivar cached: prompt tokens taken from the host's cache.
    :ivar generated: tokens generated.
    :ivar prompt_speed: prompt tokens/s, or None.
    :ivar generation_speed: generated tokens/s, or None.
    """

    prompt: int
    cached: int
    generated: int
    prompt_speed: float | None = None
    generation_speed: float | None = None


class _Bad(Exception):
    """A figure of the wrong shape: the answer counts nothing."""


def _figures(prompt: Any, cached: Any, generated: Any, prompt_speed: float | None = None,
             generation_speed: float | None = None) -> Figures:
    """:class:`Figures` of three counts, each checked to be an int in [0, :data:`MAX_TOKENS`)
    (speeds already checked). One call for the three: this runs once per request."""
    if (type(prompt) is not int or type(cached) is not int or type(generated) is not int
            or not (0 <= prompt < MAX_TOKENS and 0 <= cached < MAX_TOKENS and 0 <= generated < MAX_TOKENS)):
        raise _Bad
    return _NEW(Figures, (prompt, cached, generated, prompt_speed, generation_speed))


def _speed(value: Any) -> float | None:
    """A speed: None, or an int or float in [0, :data:`MAX_SPEED`) (which excludes inf
    and nan), as a float."""
    if value is None:
        return None
    if not ((type(value) is float or type(value) is int) and 0 <= value < MAX_SPEED):
        raise _Bad
    return float(value)


def _from_timings(t: Any) -> Figures:
    """llama-server's ``timings`` in any layout (its own is read by :data:`_LLAMA_TIMINGS`):
    ``prompt_n`` and ``predicted_n`` required, ``cache_n`` absent or null is 0."""
    if type(t) is not dict:
        raise _Bad
    cached = t.get("cache_n")
    return _figures(t.get("prompt_n"), 0 if cached is None else cached, t.get("predicted_n"),
                    _speed(t.get("prompt_per_second")), _speed(t.get("predicted_per_second")))


def _from_usage(u: Any, start: Any = None) -> Figures:
    """OpenAI (``prompt_tokens``), Responses (``input_tokens`` + ``input_tokens_details``)
    or Anthropic (``input_tokens`` + ``cache_read_input_tokens``) usage; ``start`` is an
    Anthropic ``message_start`` usage supplying what a ``message_delta`` lacks."""
    if type(u) is not dict:
        raise _Bad
    if "prompt_tokens" in u or "completion_tokens" in u:
        total, details, generated = u.get("prompt_tokens"), u.get("prompt_tokens_details"), u.get("completion_tokens")
    elif "input_tokens_details" in u:  # the Responses API: input_tokens includes the cache
        total, details, generated = u.get("input_tokens"), u.get("input_tokens_details"), u.get("output_tokens")
    elif "output_tokens" not in u and "input_tokens" not in u:
        raise _Bad
    else:  # Anthropic: input_tokens excludes cache reads
        first = start if type(start) is dict else {}
        prompt = u["input_tokens"] if "input_tokens" in u else first.get("input_tokens", 0)
        cached = u["cache_read_input_tokens"] if "cache_read_input_tokens" in u else first.get(
            "cache_read_input_tokens", 0)
        generated = u.get("output_tokens")
        return _figures(prompt, cached, 0 if generated is None else generated)
    # OpenAI and Responses: the prompt total includes the cached tokens
    cached = details.get("cached_tokens") if type(details) is dict else None
    if total is None:
        total = 0
    if cached is None:
        cached = 0
    if type(total) is not int or type(cached) is not int or not 0 <= cached <= total < MAX_TOKENS:
        raise _Bad
    return _figures(total - cached, cached, 0 if generated is None else generated)


def _is_sse(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.split(b";", 1)[0].strip().lower() == b"text/event-stream"


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


_TIMINGS, _USAGE, _PREDICTED, _EVALUATED = b'"timings":', b'"usage":', b'"tokens_predicted":', b'"tokens_evaluated":'

# The exact bytes llama-server writes (and OpenAI's order of ``usage``), matched where the
# key's value starts without decoding anything: a count is 0 or up to nine digits (below
# 1e9, so below MAX_TOKENS), a speed the same with an optional fraction (below
# MAX_SPEED, never negative, inf or nan), a figure crossbar does not read any JSON number.
# What matches is valid by construction and reads exactly as the general path below would
# read it; anything else (another order, blanks, another figure's shape) takes that path.
_COUNT = rb"(0|[1-9][0-9]{0,8})"
_SPEED = rb"((?:0|[1-9][0-9]{0,8})(?:\.[0-9]+)?)"
_NUMBER = rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
_LLAMA_TIMINGS = re.compile(
    rb'\{"cache_n":' + _COUNT + rb',"prompt_n":' + _COUNT + rb',"prompt_ms":' + _NUMBER
    + rb',"prompt_per_token_ms":' + _NUMBER + rb',"prompt_per_second":' + _SPEED + rb',"predicted_n":' + _COUNT
    + rb',"predicted_ms":' + _NUMBER + rb',"predicted_per_token_ms":' + _NUMBER + rb',"predicted_per_second":'
    + _SPEED + rb"\}")
"""llama-server's ``timings`` (cache_n, prompt_n, prompt/s, predicted_n, predicted/s)."""
_DETAILS = rb'(?:,"prompt_tokens_details":\{"cached_tokens":' + _COUNT + rb"\})?\}"
_LLAMA_USAGE = re.compile(
    rb'\{"completion_tokens":' + _COUNT + rb',"prompt_tokens":' + _COUNT + rb',"total_tokens":' + _NUMBER + _DETAILS)
"""llama-server's OpenAI ``usage`` (completion, prompt, cached or None)."""
_OPENAI_USAGE = re.compile(
    rb'\{"prompt_tokens":' + _COUNT + rb',"completion_tokens":' + _COUNT + rb',"total_tokens":' + _NUMBER + _DETAILS)
"""OpenAI's own order of ``usage`` (prompt, completion, cached or None)."""
_SSE_WINDOW = 2048
"""A stream's figures are in one of its last events: the tail's last this many bytes are
searched first, the whole tail only when they hold none of the keys."""


def _value_at(data: bytes, at: int) -> Any:
    """The JSON value starting at ``data[at:]`` (after blanks); only the bytes from
    there on are decoded.

    :raises ValueError: the value is cut or not JSON."""
    try:
        return _SCAN(data[at:].decode("utf-8", "replace").lstrip(), 0)[0]
    except StopIteration:
        raise ValueError("no JSON value") from None


def _value(data: bytes, key: bytes) -> Any:
    """The JSON value after the last ``key`` (e.g. ``b'"usage":'``) in ``data``, or
    None. In JSON a quote inside a string is always escaped, so the pattern only
    matches a real key.

    :raises ValueError: the value is cut or not JSON."""
    at = data.rfind(key)
    return None if at < 0 else _value_at(data, at + len(key))


def _message_start_usage(texts: Sequence[bytes]) -> Any:
    """The usage of an Anthropic ``message_start`` event found in ``texts``, or None."""
    for text in texts:
        at = text.find(b'"message_start"')
        if at < 0:
            continue
        line_start = text.rfind(b"\n", 0, at) + 1
        line_end = text.find(b"\n", at)
        line = text[line_start:line_end if line_end >= 0 else len(text)]
        if not line.startswith(b"data:"):
            continue
        try:
            event = json.loads(line[5:])
        except (ValueError, RecursionError):
            continue
        message = event.get("message") if isinstance(event, dict) else None
        return message.get("usage") if isinstance(message, dict) else None
    return None


def read_figures(chunks: Sequence[bytes], content_type: bytes | None, path: bytes,
                 whole: bool, head: bytes | None = None) -> Figures | None:
    """The figures of a complete answer, or None (counts nothing).

    :param chunks: references to the body's last chunks, oldest first, covering at
        least its last :data:`TAIL_BYTES` (or all of it); only that much is read.
    :param content_type: the answer's ``Content-Type`` header value, or None.
    :param path: the upstream request path (the rest after the route). Answers are
        read by their shape, whatever the endpoint (an array answer is only ever the
        native endpoints'), so it is not consulted today.
    :param whole: ``chunks`` hold the whole body (nothing was dropped from its start).
    :param head: the body's first chunk when it is no longer among ``chunks`` (an
        Anthropic stream's ``message_start``, a native JSON answer's figures), else
        None; only its first :data:`TAIL_BYTES` are read.
    :returns: the :class:`Figures`, or None when the answer carries none or any figure
        has an unexpected shape. Never raises.

    What is read is one answer object (JSON) or one event (a stream's last ``data:``
    event carrying figures, found by searching the tail for the keys, no split into
    events): its last ``timings``, else its last ``usage``, else the native
    ``tokens_predicted``/``tokens_evaluated``. For a whole answer the last occurrence is
    the top-level one (llama-server writes its figures after the content; in an array,
    the last element's). llama-server's own bytes of ``timings`` and ``usage`` are read
    in line by a pattern (bench/figures_ab.py times it); any other layout is decoded
    and checked by :func:`_from_timings` and :func:`_from_usage`.
    """
    del path  # every endpoint is read by the shape of its answer
    if not chunks or content_type is None:
        return None
    if content_type.startswith(b"application/json"):  # the usual cases, without parsing
        sse = False
    elif content_type.startswith(b"text/event-stream"):
        sse = True
    else:
        sse = _is_sse(content_type)
        if not sse and not _is_json(content_type):
            return None
    try:
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if len(data) > TAIL_BYTES:
            if whole:  # the body's start is still here: it is the head
                head = data[:TAIL_BYTES]
            data = data[-TAIL_BYTES:]
        start = None
        if sse:  # the last data: event carrying figures, read like an answer object
            window = len(data) - _SSE_WINDOW if len(data) > _SSE_WINDOW else 0
            at = max(data.rfind(_TIMINGS, window), data.rfind(_USAGE, window), data.rfind(_PREDICTED, window))
            if at < 0 < window:  # none in the window: any occurrence is before it
                at = max(data.rfind(_TIMINGS), data.rfind(_USAGE), data.rfind(_PREDICTED))
            if at < 0:
                return None
            line_start = data.rfind(b"\n", 0, at) + 1
            line_end = data.find(b"\n", at)
            line = data[line_start:line_end if line_end >= 0 else len(data)]
            if not line.startswith(b"data:"):
                return None  # an event cut by the tail's start, or not an event
            if b'"message_delta"' in line:  # Anthropic: the prompt figures are in message_start
                start = _message_start_usage([data] if head is None else [data, head[:TAIL_BYTES]])
            data, head = line[5:], None
        found: Figures | None = None
        try:
            t = None
            at = data.rfind(_TIMINGS)
            if at >= 0:
                m = _LLAMA_TIMINGS.match(data, at + 10)
                if m is not None:  # llama-server's own bytes: valid as matched
                    cached, prompt, prompt_speed, generated, generation_speed = m.groups()
                    return _NEW(Figures, (int(prompt), int(cached), int(generated), float(prompt_speed),
                                          float(generation_speed)))
                t = _value_at(data, at + 10)
            if t is not None:
                found = _from_timings(t)
            else:  # no timings (or null): usage, else the native figures
                u = None
                at = data.rfind(_USAGE)
                if at >= 0:
                    m = _LLAMA_USAGE.match(data, at + 8)
                    if m is not None:
                        generated, total, cached = m.groups()
                    else:
                        m = _OPENAI_USAGE.match(data, at + 8)
                        if m is not None:
                            total, generated, cached = m.groups()
                    if m is not None:  # as matched: counts below MAX_TOKENS
                        total, cached = int(total), 0 if cached is None else int(cached)
                        if cached > total:
                            return None
                        return _NEW(Figures, (total - cached, cached, int(generated), None, None))
                    u = _value_at(data, at + 8)
                if u is not None:
                    found = _from_usage(u, start)
                else:
                    predicted = _value(data, _PREDICTED)
                    if predicted is not None:
                        found = _figures(_value(data, _EVALUATED) or 0, 0, predicted)
        except (ValueError, RecursionError):
            found = None  # a value cut or not JSON: as if absent
        if found is None and head is not None:
            # llama.cpp's native answers put their figures first and the token
            # probabilities (n_probs) after them: look at the body's first chunk
            return read_figures((head[:TAIL_BYTES],), b"application/json", b"", False)
        return found
    except (_Bad, ValueError, RecursionError, TypeError, AttributeError, KeyError):
        return None
