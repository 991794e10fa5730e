"""Every request option of LMDeploy's chat and completions protocols, sent to a Hybrid node and through DistServe.

The one list of options the parity suite (``tests/e2e/test_parity.py``) and the parity table (docs/parity.md)
(``scripts/parity_table.py``) use. :data:`NOT_OPTIONS` names the protocol fields that are not options (the
prompt itself, the route's dimensions); a test checks that the two lists together cover every field of
LMDeploy's request models, so an option a new release adds shows up as missing here.

An answer is compared on what a client reads: status, and per choice its text (content, reasoning, tool calls),
finish_reason and logprobs, and the usage. Ids, timestamps and tool-call ids are random by design.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from lmdeploy_pdfix_sim import model
from lmdeploy_pdfix_sim.cluster import MODEL_NAME

PROMPT = 'parity: tell me about the weather in paris.'
MAX_TOKENS = 8
_FIRST = model.expected_text_for(PROMPT, MAX_TOKENS)  # what the emulated model answers, token by token
# api_server arguments of every node of a parity cluster: logprobs, tool calls and reasoning are served
NODE_ARGS = ('--logprobs-mode', 'raw_logprobs', '--tool-call-parser', 'qwen3', '--reasoning-parser', 'default')

_TOOLS = [{'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'weather of a city',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}]
_SCHEMA = {'name': 'reading', 'schema': {'type': 'object', 'properties': {'a': {'type': 'integer'}},
                                         'required': ['a']}}
_SAMPLED = {'temperature': 0.9, 'seed': 1234}
# without thinking (the reasoning parser starts every answer in reasoning), so a required tool call is made
_TOOLING = {'enable_thinking': False, 'max_tokens': 40}

# option -> (routes it applies to, the request fields that set it; None removes a field of the base request)
OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    'plain': (('chat', 'completions'), {}),
    'max_tokens': (('chat', 'completions'), {'max_tokens': 1}),
    'max_completion_tokens': (('chat', 'completions'), {'max_tokens': None, 'max_completion_tokens': 1}),
    'temperature': (('chat', 'completions'), _SAMPLED),
    'seed': (('chat', 'completions'), {**_SAMPLED, 'seed': 99}),
    'top_p': (('chat', 'completions'), {**_SAMPLED, 'top_p': 0.5}),
    'top_k': (('chat', 'completions'), {**_SAMPLED, 'top_k': 3}),
    'min_p': (('chat', 'completions'), {**_SAMPLED, 'min_p': 0.2}),
    'stop': (('chat', 'completions'), {'stop': [_FIRST[3]]}),
    'stop (first token)': (('chat', 'completions'), {'stop': [_FIRST[0]]}),
    'include_stop_str_in_output': (('chat',), {'stop': [_FIRST[3]], 'include_stop_str_in_output': True}),
    'ignore_eos': (('chat', 'completions'), {'ignore_eos': True}),
    'logit_bias': (('chat',), {'logit_bias': {str(ord('z')): 50}}),
    # the first token is a stop word, banned until 3 tokens are out: the Decode must count the first one
    'min_new_tokens': (('chat',), {'stop': [_FIRST[0]], 'min_new_tokens': 3}),
    'repetition_penalty': (('chat', 'completions'), {'repetition_penalty': 1.5}),
    'presence_penalty': (('chat', 'completions'), {'presence_penalty': 1.5}),
    'frequency_penalty': (('chat', 'completions'), {'frequency_penalty': 1.5}),
    'repetition_ngram_size': (('chat', 'completions'), {'repetition_ngram_size': 2,
                                                        'repetition_ngram_threshold': 1}),
    'logprobs': (('chat', 'completions'), {}),  # per route below: chat takes a bool, completions a count
    'top_logprobs': (('chat',), {'logprobs': True, 'top_logprobs': 3}),
    'return_logprob': (('chat',), {'return_logprob': True}),
    'return_token_ids': (('chat',), {'return_token_ids': True}),
    'return_routed_experts': (('chat',), {'return_routed_experts': True}),
    'stream_options': (('chat', 'completions'), {'stream_options': {'include_usage': True}}),
    'skip_special_tokens': (('chat', 'completions'), {'skip_special_tokens': False}),
    'spaces_between_special_tokens': (('chat', 'completions'), {'spaces_between_special_tokens': False}),
    'echo': (('completions',), {'echo': True}),
    'suffix': (('completions',), {'suffix': ' the end'}),
    'user': (('chat', 'completions'), {'user': 'someone'}),
    'session_id': (('chat', 'completions'), {'session_id': 4242}),
    'n': (('chat', 'completions'), {'n': 2}),
    'n (4, sampled)': (('chat',), {**_SAMPLED, 'n': 4}),
    'response_format json_object': (('chat',), {'response_format': {'type': 'json_object'}, 'max_tokens': 12}),
    'response_format json_schema': (('chat',), {'response_format': {'type': 'json_schema', 'json_schema': _SCHEMA},
                                                'max_tokens': 12}),
    'response_format regex_schema': (('chat',), {'response_format': {'type': 'regex_schema',
                                                                     'regex_schema': '(sunny|rainy) [0-9]+'}}),
    'tools': (('chat',), {**_TOOLING, 'tools': _TOOLS}),
    'tool_choice required': (('chat',), {**_TOOLING, 'tools': _TOOLS, 'tool_choice': 'required'}),
    'tool_choice named': (('chat',), {**_TOOLING, 'tools': _TOOLS,
                                      'tool_choice': {'type': 'function', 'function': {'name': 'get_weather'}}}),
    'tool_choice none': (('chat',), {**_TOOLING, 'tools': _TOOLS, 'tool_choice': 'none'}),
    'parallel_tool_calls': (('chat',), {**_TOOLING, 'tools': _TOOLS, 'parallel_tool_calls': False}),
    'enable_thinking': (('chat',), {'enable_thinking': False}),
    'reasoning_effort': (('chat',), {'reasoning_effort': 'low'}),
    'chat_template_kwargs': (('chat',), {'chat_template_kwargs': {'enable_thinking': True}}),
    'input_ids': (('chat',), {'messages': None, 'input_ids': model.prompt_ids(PROMPT)}),
    'image_data': (('chat',), {'image_data': 'data:image/png;base64,AAAA'}),
    'media_io_kwargs': (('chat',), {'media_io_kwargs': {'video': {'num_frames': 2}}}),
    'mm_processor_kwargs': (('chat',), {'mm_processor_kwargs': {'max_pixels': 1024}}),
    'do_preprocess': (('chat',), {'do_preprocess': False}),  # LMDeploy 0.17 only
}
_LOGPROBS = {'chat': {'logprobs': True}, 'completions': {'logprobs': 2}}

# Fields of LMDeploy's request models that are not options of the answer: the prompt, its model, the route's
# dimensions (streamed or not) and the base budget every case starts from.
NOT_OPTIONS = frozenset({'model', 'messages', 'prompt', 'stream', 'max_tokens'})


@dataclass(frozen=True)
class Case:
    option: str
    route: str  # 'chat' or 'completions'
    stream: bool

    @property
    def id(self) -> str:
        return f'{self.route}-{"stream" if self.stream else "whole"}-{self.option}'

    @property
    def path(self) -> str:
        return '/v1/chat/completions' if self.route == 'chat' else '/v1/completions'

    def body(self) -> dict[str, Any]:
        base: dict[str, Any] = {'model': MODEL_NAME, 'max_tokens': MAX_TOKENS, 'temperature': 0, 'stream': self.stream}
        if self.route == 'chat':
            base['messages'] = [{'role': 'user', 'content': PROMPT}]
        else:
            base['prompt'] = PROMPT
        fields = _LOGPROBS[self.route] if self.option == 'logprobs' else OPTIONS[self.option][1]
        base.update(fields)
        return {key: value for key, value in base.items() if value is not None}


def cases(fields: dict[str, frozenset[str]]) -> list[Case]:
    """Every option of :data:`OPTIONS` that the running LMDeploy's protocol has, per route, streamed and not.

    ``fields``: the field names of each route's request model (``chat``, ``completions``).
    """
    return [Case(option, route, stream)
            for option, (routes, _) in OPTIONS.items() for route in routes
            if set(Case(option, route, False).body()) <= fields[route]
            for stream in (False, True)]


def options_of(route: str) -> set[str]:
    """The request fields some case of ``route`` sets."""
    covered = set(_LOGPROBS[route])
    for routes, body in OPTIONS.values():
        if route in routes:
            covered |= set(body)
    return covered


def protocol_fields() -> dict[str, frozenset[str]]:
    """The request fields of the LMDeploy installed here, per route."""
    from lmdeploy.serve.openai import protocol

    return {'chat': frozenset(protocol.ChatCompletionRequest.model_fields),
            'completions': frozenset(protocol.CompletionRequest.model_fields)}


def send(url: str, case: Case, timeout_s: float = 60.0) -> tuple[int, bytes | None]:
    """The status and body of ``case`` sent to ``url``; the body is None when the answer broke off."""
    return post(url + case.path, case.body(), timeout_s)


def post(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, bytes | None]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method='POST',
                                     headers={'Content-Type': 'application/json'})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            status = response.status
            return status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except http.client.IncompleteRead:  # LMDeploy's own streams can end in an exception (its server's log)
        return status, None


def answer(status: int, raw: bytes | None, stream: bool) -> dict[str, Any]:
    """What a client reads of an answer, comparable across nodes."""
    if raw is None:
        return {'status': status, 'broken_off': True}
    if status != 200:
        return {'status': status}
    events = _events(raw) if stream else [json.loads(raw)]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for event in events:
        if 'error' in event:
            return {'status': status, 'stream_error': True}
        usage = event.get('usage') or usage
        for choice in event.get('choices') or []:
            _merge(choices.setdefault(choice['index'], {}), choice)
    return {'status': status, 'choices': [choices[index] for index in sorted(choices)], 'usage': _usage(usage)}


def _events(raw: bytes) -> list[dict[str, Any]]:
    lines = raw.decode().split('\n')
    return [json.loads(line[len('data: '):]) for line in lines if line.startswith('data: {')]


def _merge(into: dict[str, Any], choice: dict[str, Any]) -> None:
    """Fold one choice (a whole one, or a stream's delta) into what the client has read of it."""
    message = choice.get('message') or choice.get('delta') or {}
    for key in ('text', 'content', 'reasoning_content'):
        piece = choice.get(key) if key == 'text' else message.get(key)
        if piece:
            into[key] = into.get(key, '') + piece
    for call in message.get('tool_calls') or []:
        _merge_tool_call(into.setdefault('tool_calls', []), call)
    for key in ('output_token_logprobs', 'output_ids'):  # per token: a stream's chunks split them by timing
        into.setdefault(key, []).extend(choice.get(key) or ())
    logprobs = choice.get('logprobs') or {}
    for key, value in logprobs.items():  # chat: its content per token; completions: tokens, token_logprobs, …
        if isinstance(value, list):
            into.setdefault(f'logprobs.{key}', []).extend(value)
    if choice.get('finish_reason'):
        into['finish_reason'] = choice['finish_reason']


def _merge_tool_call(calls: list[dict[str, Any]], call: dict[str, Any]) -> None:
    index = call.get('index', len(calls))
    while len(calls) <= index:
        calls.append({'name': '', 'arguments': ''})
    function = call.get('function') or {}
    calls[index]['name'] += function.get('name') or ''
    calls[index]['arguments'] += function.get('arguments') or ''


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {key: usage.get(key) for key in ('prompt_tokens', 'completion_tokens', 'total_tokens')}


def differences(hybrid: dict[str, Any], distserve: dict[str, Any]) -> list[str]:
    """What differs between two answers, by part; empty when they are the same."""
    if hybrid.keys() != distserve.keys() or hybrid['status'] != distserve['status'] or 'choices' not in hybrid:
        return [] if hybrid == distserve else [f'{_short(hybrid)} vs {_short(distserve)}']
    found = []
    if len(hybrid['choices']) != len(distserve['choices']):
        found.append(f'{len(hybrid["choices"])} vs {len(distserve["choices"])} choices')
    for index, (mine, theirs) in enumerate(zip(hybrid['choices'], distserve['choices'], strict=False)):
        for part in sorted(set(mine) | set(theirs)):
            if mine.get(part) != theirs.get(part):
                found.append(f'choice {index} {part}: {_short(mine.get(part))} vs {_short(theirs.get(part))}')
    if hybrid['usage'] != distserve['usage']:
        found.append(f'usage {hybrid["usage"]} vs {distserve["usage"]}')
    return found


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + '...'
