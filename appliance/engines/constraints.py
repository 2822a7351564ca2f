"""Grammar constraints on sampling: what a request may carry and how the torch engine enforces it.

Owns the ``Constraint`` a request's ``SamplingParams`` may hold, its check (the grammar compiles),
and, for the in-process engine, the per-row guide that turns a grammar into the set of tokens
allowed next. The one thing an engine enforces is an llguidance Lark grammar over the sampled
text (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md); where the grammar
comes from (an OpenAI ``response_format``, a forced ``tool_choice``) is the chat side's
(``appliance.chat.constraints``), and ``kind`` only labels it for the record.

Stopping: a grammar describes the text before the stop token. A row may sample one of its stop
ids only where the grammar accepts the text so far, and nothing but a stop id once the grammar
can take no more (``is_stopped``), so a constrained completion that ends with "stop" always
matches its grammar; one cut by ``max_tokens`` ("length") is a prefix of a match.

Invariant: a guide only ever allows tokens its matcher can consume, so a matcher never enters
its error state while it guides a row.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import torch

from contracts.errors import BadRequest

log = logging.getLogger(__name__)

#: The labels a constraint may carry (what the grammar was built from).
KINDS = ("json_object", "json_schema", "tool_call")
#: The request parameter a bad constraint is blamed on (OpenAI's name for structured output).
PARAM = "response_format"
#: Compiled grammars an engine keeps, most recently used last.
MATCHER_CACHE_SIZE = 64


@dataclass(frozen=True, slots=True)
class Constraint:
    """The sampled text must match ``grammar`` (an llguidance Lark grammar)."""

    #: What the grammar was built from, one of ``KINDS``; engines ignore it.
    kind: str
    grammar: str

    @classmethod
    def from_record(cls, value: Any) -> Constraint | None:
        """The constraint ``dataclasses.asdict`` recorded (a mapping, or None)."""
        if value is None or isinstance(value, Constraint):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"a recorded constraint is a mapping, got {type(value).__name__}")
        return cls(kind=str(value["kind"]), grammar=str(value["grammar"]))


@functools.lru_cache(maxsize=256)
def grammar_error(grammar: str) -> str:
    """llguidance's complaint about ``grammar`` ("" when it compiles). Cached: the calls of a
    rollout send the same grammar again and again, and compiling a large JSON schema takes ms."""
    return str(llguidance.LLMatcher.validate_grammar(grammar))


def check_constraint(value: object) -> None:
    """Raise ``BadRequest`` (param "response_format") unless ``value`` is None or a
    ``Constraint`` of a known kind whose grammar compiles."""
    if value is None:
        return
    if not isinstance(value, Constraint):
        raise BadRequest(f"a constraint must be a Constraint, got {type(value).__name__}", param=PARAM)
    if value.kind not in KINDS:
        raise BadRequest(
            f"constraint kind must be one of {', '.join(KINDS)}; got {value.kind!r}", param=PARAM
        )
    if not isinstance(value.grammar, str) or not value.grammar.strip():
        raise BadRequest("the constraint's grammar is empty", param=PARAM)
    error = grammar_error(value.grammar)
    if error:
        raise BadRequest(
            f"the {value.kind} constraint cannot be enforced: {error.strip()[:500]}", param=PARAM
        )


class GrammarCompiler:
    """Matchers for grammars over one model's vocabulary (its ``tokenizer.json``).

    ``vocab_size`` is the width of the model's logits (at least the tokenizer's size); ``eos_id``
    is any special token: guides put the row's own stop ids where llguidance puts it.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int) -> None:
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=None, eos_token=eos_id)
        if self._tokenizer.vocab_size > vocab_size:
            size = self._tokenizer.vocab_size
            raise ValueError(f"the tokenizer has {size} tokens but the model only {vocab_size} logits")
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self._fresh: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int, eos_id: int) -> GrammarCompiler:
        return cls((model_dir / "tokenizer.json").read_text(), vocab_size, eos_id)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher at the start of ``grammar``; ``BadRequest`` if it does not compile for this
        vocabulary (e.g. it names a special token the tokenizer lacks)."""
        fresh = self._fresh.get(grammar)
        if fresh is None:
            fresh = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if fresh.is_error():
                raise BadRequest(
                    f"the constraint cannot be enforced on this model: {fresh.get_error().strip()}",
                    param=PARAM,
                )
            self._fresh[grammar] = fresh
            while len(self._fresh) > MATCHER_CACHE_SIZE:
                self._fresh.popitem(last=False)
        else:
            self._fresh.move_to_end(grammar)
        return fresh.deep_copy()

    def guide(self, constraint: Constraint, stop_ids: Collection[int]) -> Guide:
        """A guide for one row that stops on any of ``stop_ids`` (at least one in the vocabulary)."""
        stops = sorted(t for t in stop_ids if 0 <= t < self.vocab_size)
        if not stops:
            raise BadRequest(
                "a constrained request needs a stop token id in the vocabulary, to end the text the "
                "grammar describes",
                param=PARAM,
            )
        return Guide(self.matcher(constraint.grammar), stops, self.vocab_size, self.eos_id)


#: Bit ``k`` of byte ``j`` of an llguidance bitmask (little-endian u32 words) is token ``8j + k``.
_SHIFTS = torch.arange(8, dtype=torch.uint8)


class Guide:
    """One row's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(
        self, matcher: llguidance.LLMatcher, stop_ids: list[int], vocab_size: int, eos_id: int
    ) -> None:
        self._matcher = matcher
        self._stops = torch.tensor(stop_ids, dtype=torch.long)
        self._stop_set = frozenset(stop_ids)
        self._vocab = vocab_size
        self._eos = eos_id
        #: Why the grammar can no longer be enforced (its matcher failed while sampling, e.g. a
        #: recursion too deep for the parser), or None. The row must then end as an error: any
        #: text sampled after it would not be held to the constraint.
        self.error: str | None = None

    def allowed(self) -> torch.Tensor:
        """A bool (vocab,) tensor on the CPU: the tokens the grammar allows next, with the row's
        stop ids exactly where the grammar accepts the text so far."""
        matcher = self._matcher
        bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> _SHIFTS) & 1).flatten()[: self._vocab].bool()
        # llguidance marks its eos where the grammar accepts; the row's stop ids take its place.
        allowed[self._eos] = False
        accepting = matcher.is_accepting()
        allowed[self._stops] = accepting
        if not bool(allowed.any()):
            # Only a matcher in its error state allows nothing; end the row rather than sample
            # from nothing (which ``allowed`` never lets happen, see the module's invariant).
            self.error = matcher.get_error().strip() or "the grammar allows no next token"
            log.error("a grammar guide allows no token: %s", self.error)
            allowed[self._stops] = True
        return allowed

    def consume(self, token: int) -> None:
        """Advance past a sampled token (a stop id ends the row and is not fed to the grammar)."""
        if token in self._stop_set:
            return
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            self.error = self._matcher.get_error().strip() or f"the grammar refused token {token}"
            log.error("a grammar guide refused token %d it allowed: %s", token, self.error)


def mask_logits(logits: torch.Tensor, guides: list[Guide | None]) -> torch.Tensor:
    """``logits`` (rows, vocab) with the tokens each row's guide forbids at -inf (rows without a
    guide untouched, and nothing done at all when no row has one); a float32 tensor.

    Sampling from the masked logits samples from the policy restricted to the allowed tokens
    and renormalised, and the log-probs computed from them are that distribution's."""
    rows = [i for i, guide in enumerate(guides) if guide is not None]
    if not rows:
        return logits
    allowed = torch.stack([guide.allowed() for guide in guides if guide is not None]).to(logits.device)
    out = logits.clone() if logits.dtype == torch.float32 else logits.float()
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out
