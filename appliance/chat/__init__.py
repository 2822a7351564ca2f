"""Chat: conversations as the model sees them, independent of any API surface or engine.

Owns the internal conversation model every surface converts to (``messages``: ``Message``,
``ToolCall``), the model families' chat formats and templates (``formats``, ``template``),
the tokenizer as the proxy uses it, rendering a conversation to token ids with the exact ids
of earlier sampled turns spliced in (``render``, ``turns``, a rollout's ``transcript``),
parsing sampled text back into an assistant message (``tools``) and the grammars of
structured outputs (``constraints``, ``schemas``). It knows no HTTP, no event log and no
training: the proxy calls it, the engines' model loading reads its formats.

May import: ``appliance.engines.constraints`` (the grammar type the engines enforce) and
``contracts``; nothing else of the project.
"""
