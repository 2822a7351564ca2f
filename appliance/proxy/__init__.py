"""The proxy: the OpenAI- and Anthropic-compatible HTTP face that rollouts' harnesses call.

Owns the aiohttp application (``server``) and everything a request meets on its way to the
engine and back: the HTTP plumbing (``http``: auth, admission, JSON bodies, server-sent
events), one pure adapter per API surface (``openai_chat``, ``openai_completions``,
``openai_responses`` with ``responses_output`` and ``response_store``, ``anthropic_messages``)
speaking the shapes of ``pipeline``, the one ``driver`` of model calls, the call path itself
(``calls``: render, generate, parse, record; ``sampled``: the sampled tokens as columns, the
sampling as recorded; ``deltas``: a stream's text), the serving ``gate`` the scheduler closes while
it trains, refused calls, the admin and control routes, external runners' routes and
``/metrics``. It does not own chat rendering (``appliance.chat``), engines, rollouts or the
event log; it does not decide when to train (``appliance.scheduler`` drives the gate).

May import: ``appliance.chat``, ``appliance.engines`` (the ``Engine`` contract and grammars),
``appliance.rollouts``, ``appliance.operations.health``, ``appliance.config``, ``store`` and
``contracts``. The surfaces never import tokens (``appliance.chat.tokenizer`` and ``render``,
``calls``, the engines but their contract): the driver decodes for them.
"""
