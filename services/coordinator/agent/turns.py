"""Token-exact turns: a trajectory's tokens grow only by appending, and replies are rendered by the chat template.

A multi-turn trajectory is the prompt's ids, then the model's sampled ids, then a tool or environment reply's
ids, then the model again, and so on. Each turn's input is exactly the previous input plus what was appended:
history is never re-tokenized, because re-rendering it through the template changes earlier tokens
(whitespace, thinking blocks, special tokens) and PPO's ratio would compare a sequence that was never sampled.

The ids of a reply come from the template itself, generically, for any template: render the conversation
ending with the model's turn (as the model wrote it), render it again with the replies after it and the
generation prompt, and tokenize only the text that the second adds. When the first is not a prefix of the
second (the template rewrites earlier turns once more follow, as templates that strip earlier thinking do),
there is no exact way to extend, and ``render_reply`` says so with ``CannotExtend``: the agent loop then closes
the trajectory's sample as it stands and goes on in a new one (``next_sample``) whose prompt is the whole
conversation rendered fresh, and counts it, instead of guessing.

The PyPI ``renderers`` package (Prime Intellect's, used by prime-rl) was read (0.1.12) and not used: its
exact bridging is hand-written per model family (Qwen3, Llama 3, ...), and for any other Jinja template,
which is what the tiny test model and users' fine-tunes have, its ``DefaultRenderer.bridge_to_next_turn``
returns None (re-render the history), the very case this module exists for. It also pulls openai,
openai-harmony, tiktoken and a pre-release config library into the coordinator, which imports no model
stack. The prefix check below is one rule that holds for every template and detects where it fails.

Replies are cut to ``max_reply_tokens`` each, keeping the side verl's ``tool_response_truncate_side`` names
(it names the side KEPT: ``left`` keeps the start, ``right`` the end, ``middle`` both ends), with verl's
``(truncated)`` marker, counted in tokens here (verl counts characters) and inside the bound. The whole
response (every token after the prompt) fits ``max_response_length``: a reply that would overflow it is cut
further, and where even the template's own tokens do not fit, the result is ``OverBudget``. Over a trajectory's
samples the same bound holds: a new sample's response may take what the closed one left, less what the
conversation grew by in its fresh rendering (``next_sample``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, NamedTuple, Sequence

TRUNCATE_SIDES = ("left", "right", "middle")
MARKERS = {"left": ("", "...(truncated)"), "right": ("(truncated)...", ""), "middle": ("", "...(truncated)...")}

Message = Mapping[str, Any]  # an OpenAI-style chat message: role, content (and what the template reads)


class Turn(NamedTuple):
    """One turn's place in the response: ids ``[start, end)`` after the prompt."""

    role: Literal["model", "reply"]  # reply: a tool's or environment's message, rendered here
    start: int
    end: int
    weight_version: int | None  # model turns: the weight version that sampled them; replies: None


class SampledTokens(NamedTuple):
    """What the model sampled in one turn: each token with its rollout logprob."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_version: int


class ReplyTokens(NamedTuple):
    """The ids that append replies to a trajectory: the close of the model's turn (where it did not sample
    it), the replies, and the template's prompt for the model's next turn. None of it was sampled."""

    ids: tuple[int, ...]
    truncated: bool  # a reply was cut (to max_reply_tokens or to fit the response budget)
    messages: tuple[Message, ...]  # the conversation as the template now sees it: pass it to the next turn

    @property
    def loss_mask(self) -> tuple[int, ...]:
        return (0,) * len(self.ids)


class CannotExtend(NamedTuple):
    """The template rewrites what came before when replies follow: the trajectory cannot be extended exactly."""

    reason: str
    messages: tuple[Message, ...] = ()  # the conversation with the replies (cut as configured), which a new
    # sample's prompt renders fresh (``next_sample``)


class OverBudget(NamedTuple):
    """The replies do not fit what is left of ``max_response_length``, even cut to nothing."""

    needed: int  # ids the template needs around the replies alone
    room: int


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """A multi-turn trajectory's tokens. ``response_ids``, ``loss_mask`` and ``logprobs`` are aligned, one entry
    per token after the prompt; only the model's tokens have loss mask 1 and a logprob (0.0 elsewhere)."""

    prompt_ids: tuple[int, ...]
    max_response_length: int  # every token after the prompt, model's and replies': data.max_response_length for a
    # trajectory's first sample, what the samples before it left for a later one (``next_sample``)
    response_ids: tuple[int, ...] = ()
    loss_mask: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    turns: tuple[Turn, ...] = ()

    @property
    def ids(self) -> tuple[int, ...]:
        """The whole sequence: the next turn's input."""
        return self.prompt_ids + self.response_ids

    @property
    def room(self) -> int:
        """How many more tokens the response may take."""
        return self.max_response_length - len(self.response_ids)

    @property
    def weight_versions(self) -> tuple[int, ...]:
        """The weight version of each model turn, in order."""
        return tuple(turn.weight_version for turn in self.turns if turn.weight_version is not None)


def extend(trajectory: Trajectory, tokens: SampledTokens | ReplyTokens) -> Trajectory:
    """``trajectory`` with a model turn or replies appended; refuses what does not fit ``trajectory.room``
    (the agent loop caps a turn's max_tokens at the room, and ``render_reply`` fits replies to it)."""
    if len(tokens.ids) > trajectory.room:
        raise ValueError(f"{len(tokens.ids)} ids do not fit the {trajectory.room} left of the response")
    start = len(trajectory.response_ids)
    if isinstance(tokens, SampledTokens):
        if len(tokens.logprobs) != len(tokens.ids):
            raise ValueError(f"{len(tokens.ids)} sampled ids with {len(tokens.logprobs)} logprobs")
        mask, logprobs = (1,) * len(tokens.ids), tokens.logprobs
        turn = Turn(role="model", start=start, end=start + len(tokens.ids), weight_version=tokens.weight_version)
    else:
        mask, logprobs = tokens.loss_mask, (0.0,) * len(tokens.ids)
        turn = Turn(role="reply", start=start, end=start + len(tokens.ids), weight_version=None)
    return replace(trajectory, response_ids=trajectory.response_ids + tokens.ids,
                   loss_mask=trajectory.loss_mask + mask, logprobs=trajectory.logprobs + logprobs,
                   turns=(*trajectory.turns, turn))


def render_prompt(tokenizer: Any, messages: Sequence[Message], template_kwargs: Mapping[str, Any]) -> tuple[int, ...]:
    """The first turn's input: the conversation rendered with the generation prompt, tokenized once."""
    return text_ids(tokenizer, _render(tokenizer, messages, generation_prompt=True, template_kwargs=template_kwargs))


def render_reply(tokenizer: Any, *, messages: Sequence[Message], sampled_ids: Sequence[int],
                 replies: Sequence[Message], room: int, max_reply_tokens: int, truncate_side: str,
                 template_kwargs: Mapping[str, Any]) -> ReplyTokens | CannotExtend | OverBudget:
    """The ids to append after the model's latest turn so that ``replies`` follow it and the model speaks next.

    ``messages``: the conversation before that turn (the previous ``ReplyTokens.messages``, or the prompt's);
    ``sampled_ids``: what the model sampled in it, a stop token included or not; ``room``: the trajectory's
    room once the sampled ids are in; ``template_kwargs``: what the prompt was rendered with (tools, ...).
    """
    if truncate_side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side {truncate_side!r} is not one of {', '.join(TRUNCATE_SIDES)}")
    sampled = ids_text(tokenizer, sampled_ids, skip_special_tokens=False)
    conversation = [*messages, {"role": "assistant", "content": without_stop(tokenizer, sampled)}]
    cut = [truncate_text(tokenizer, str(reply.get("content", "")), max_reply_tokens, side=truncate_side)
           for reply in replies]
    rendered = _bridge(tokenizer, conversation, sampled, replies=_with_contents(replies, cut),
                       template_kwargs=template_kwargs)
    if isinstance(rendered, CannotExtend):
        return rendered._replace(messages=(*conversation, *_with_contents(replies, cut)))
    if len(rendered) <= room:
        truncated = any(text is not None for text in cut)
        return _reply(rendered, conversation, _with_contents(replies, cut), truncated=truncated)
    fitted = _fit_to_room(tokenizer, conversation, sampled, replies=replies, rendered=rendered, cut=cut, room=room,
                          truncate_side=truncate_side, template_kwargs=template_kwargs)
    if isinstance(fitted, CannotExtend):
        return fitted._replace(messages=(*conversation, *_with_contents(replies, cut)))
    if isinstance(fitted, OverBudget):
        return fitted
    ids, contents = fitted
    return _reply(ids, conversation, _with_contents(replies, contents), truncated=True)


def next_sample(tokenizer: Any, closed: Trajectory, messages: Sequence[Message],
                *, template_kwargs: Mapping[str, Any]) -> Trajectory | OverBudget:
    """The sample a trajectory goes on in where ``closed`` could not be extended: its prompt is the whole
    conversation ``messages`` (``CannotExtend.messages``: the replies included) rendered fresh with the generation
    prompt, as the template renders it now. Its response may take ``closed``'s room less what the conversation
    grew by beyond ``closed``'s ids (nothing where the template's rewriting shortened it), so that the
    trajectory's response tokens over all its samples fit the first one's ``max_response_length``, and every
    sample's whole sequence fits the first one's prompt plus that. ``OverBudget`` where nothing is left."""
    prompt_ids = render_prompt(tokenizer, messages, template_kwargs)
    growth = max(0, len(prompt_ids) - len(closed.ids))
    if growth >= closed.room:
        return OverBudget(needed=growth, room=closed.room)
    return Trajectory(prompt_ids=prompt_ids, max_response_length=closed.room - growth)


def truncate_text(tokenizer: Any, text: str, max_tokens: int, *, side: str) -> str | None:
    """``text`` cut to at most ``max_tokens`` tokens with verl's marker, keeping the ``side`` named (left: the
    start, right: the end, middle: both ends); None when it already fits. The marker counts toward the bound
    (at least the marker is kept, so a bound below the marker's length is exceeded by the marker alone)."""
    ids = text_ids(tokenizer, text)
    if len(ids) <= max_tokens:
        return None
    before, after = MARKERS[side]
    keep = max(0, max_tokens - len(text_ids(tokenizer, before + after)))
    head = {"left": keep, "right": 0, "middle": keep - keep // 2}[side]
    tail = keep - head
    kept_head = ids_text(tokenizer, ids[:head], skip_special_tokens=False) if head else ""
    kept_tail = ids_text(tokenizer, ids[len(ids) - tail:], skip_special_tokens=False) if tail else ""
    return before + kept_head + after + kept_tail if side == "middle" else before + kept_head + kept_tail + after


def _fit_to_room(tokenizer: Any, conversation: list[Message], sampled: str, *, replies: Sequence[Message],
                 rendered: tuple[int, ...], cut: list[str | None], room: int, truncate_side: str,
                 template_kwargs: Mapping[str, Any]) -> tuple[tuple[int, ...], list[str]] | OverBudget | CannotExtend:
    """The replies cut further, evenly, so that their ids fit ``room``: the template's own ids (all but the
    contents') are measured from the first rendering, the rest is shared among the replies."""
    contents = [text if text is not None else str(reply.get("content", "")) for text, reply in zip(cut, replies)]
    own = len(rendered) - sum(len(text_ids(tokenizer, text)) for text in contents)
    share = (room - own) // max(1, len(replies))
    if share <= 0:
        return OverBudget(needed=own, room=room)
    refit = [truncate_text(tokenizer, text, share, side=truncate_side) for text in contents]
    contents = [text if fit is None else fit for text, fit in zip(contents, refit)]
    ids = _bridge(tokenizer, conversation, sampled, replies=_with_contents(replies, contents),
                  template_kwargs=template_kwargs)
    if isinstance(ids, CannotExtend):
        return ids
    if len(ids) > room:  # the markers are longer than the share, or the cut text tokenizes longer in place
        return OverBudget(needed=len(ids), room=room)
    return ids, contents


def _bridge(tokenizer: Any, conversation: list[Message], sampled: str, *, replies: list[Message],
            template_kwargs: Mapping[str, Any]) -> tuple[int, ...] | CannotExtend:
    """The ids after ``sampled`` that the template puts between the model's last turn and its next one.

    ``conversation`` ends with the model's turn; its rendering must hold the turn's text as the model wrote
    it, and be a prefix of the rendering with the replies after it. The part of the turn's closing that the
    model sampled itself (its stop token) is not appended again.
    """
    before = _render(tokenizer, conversation[:-1], generation_prompt=True, template_kwargs=template_kwargs)
    closed = _render(tokenizer, conversation, generation_prompt=False, template_kwargs=template_kwargs)
    content = conversation[-1]["content"]
    if not closed.startswith(before + content):
        return CannotExtend("the template does not render the model's turn as sampled after the prompt it was "
                            "sampled from")
    extended = _render(tokenizer, [*conversation, *replies], generation_prompt=True, template_kwargs=template_kwargs)
    if not extended.startswith(closed):
        return CannotExtend("the template rewrites earlier turns when replies follow (for example, it strips "
                            "earlier thinking)")
    closing = closed[len(before) + len(content):]
    stop = sampled[len(content):]
    if stop and closing.startswith(stop):
        closing = closing[len(stop):]
    return text_ids(tokenizer, closing + extended[len(closed):])


def _reply(ids: tuple[int, ...], conversation: list[Message], replies: list[Message],
           *, truncated: bool) -> ReplyTokens:
    return ReplyTokens(ids=ids, truncated=truncated, messages=(*conversation, *replies))


def without_stop(tokenizer: Any, sampled: str) -> str:
    """The model's text without the special token it stopped on (its eos, or ChatML's ``<|im_end|>``), if any."""
    for token in tokenizer.all_special_tokens:
        if token and sampled.endswith(token):
            return sampled[:-len(token)]
    return sampled


def _with_contents(replies: Sequence[Message], contents: Sequence[str | None]) -> list[Message]:
    """Each reply with its content replaced where a new one is given (None: kept)."""
    return [dict(reply) if content is None else {**reply, "content": content}
            for reply, content in zip(replies, contents)]


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool,
            *, template_kwargs: Mapping[str, Any]) -> str:
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                         add_generation_prompt=generation_prompt, **template_kwargs)


def text_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """``text``'s ids, no special tokens added: ``tokenizer.encode(text, add_special_tokens=False)``. A transformers
    fast tokenizer whose class encodes as transformers' own does is asked through its Rust tokenizer directly (for a
    short text, a third of the time: the wrapper costs about 0.1 ms a call), where that tokenizer is set as
    ``encode`` would set it (no truncation, no padding, special tokens split as the tokenizer says)."""
    if _as_transformers(tokenizer.__class__, "encode"):
        rust = tokenizer.backend_tokenizer
        if rust.truncation is None and rust.padding is None \
                and rust.encode_special_tokens == tokenizer.split_special_tokens:
            return tuple(rust.encode(text, add_special_tokens=False).ids)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def ids_text(tokenizer: Any, ids: Sequence[int], *, skip_special_tokens: bool) -> str:
    """``ids`` decoded: ``tokenizer.decode(list(ids), skip_special_tokens=...)``. A transformers fast tokenizer whose
    class decodes as transformers' own does, and that cleans up no spaces after (``clean_up_tokenization_spaces``),
    is asked through its Rust tokenizer directly (the wrapper adds nothing else but its cost)."""
    if _as_transformers(tokenizer.__class__, "decode") and not tokenizer.clean_up_tokenization_spaces:
        return tokenizer.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


@functools.cache
def _as_transformers(kind: type, way: Literal["encode", "decode"]) -> bool:
    """Whether ``kind`` is a transformers fast tokenizer that encodes (or decodes) as transformers' own does, all
    the way to its Rust tokenizer (no subclass changes the text, the ids or the settings on the way)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another major version of transformers: its own encode and decode are used
        return False
    methods = {"encode": ((PreTrainedTokenizerBase, "encode"),
                          (PreTrainedTokenizerBase, "_get_padding_truncation_strategies"),
                          (TokenizersBackend, "_encode_plus"), (TokenizersBackend, "set_truncation_and_padding")),
               "decode": ((PreTrainedTokenizerBase, "decode"), (TokenizersBackend, "_decode"))}[way]
    return issubclass(kind, TokenizersBackend) and all(getattr(kind, name) is getattr(owner, name)
                                                       for owner, name in methods)
