"""Which of a reply's tokens are its action: the mask SERL's weights apply to (METHOD.md 5).

The mask is found on characters -- the action the environment executed is a span of the reply's
text (``rollout.prompts.action_span``) -- and carried back to tokens through the decoded length of
each prefix of the reply, so it follows the tokenizer's own detokenization. Those lengths come in
one pass over the reply's bytes under a byte-level BPE (Qwen, Llama 3, GPT-2), and from every
prefix decoded in one call into the Rust tokenizer otherwise (docs/SCALING.md, issue 39 item 4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast, get_args

from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import ActionSpans, Unparsed
from serl_cli.rollout.prompts import action_span, authors_action_spans

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

    from envs.base import ActionFormat

UNPARSED = get_args(Unparsed)  # a reply with no parseable action: no weights (the authors') | all of it
ACTION_SPANS = get_args(ActionSpans)  # last: serl's parse of the executed action | authors: their mask's spans


def _backend_decoder(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer whose ``decode`` is all of ``tokenizer.decode`` (skipping special
    tokens), or None: a slow tokenizer, a class that overrides ``_decode``, or one whose
    ``clean_up_tokenization_spaces`` post-processing would run after the backend's decode."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: the plain path
        return None
    if not isinstance(tokenizer, TokenizersBackend) or type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    if tokenizer.clean_up_tokenization_spaces:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if hasattr(backend, "decode_batch") else None


def prefix_texts(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """``tokenizer.decode(ids[:k + 1], skip_special_tokens=True)`` for every k, exactly.

    A prefix's text is not always a prefix of the whole text (half a UTF-8 character decodes
    to U+FFFD; a skipped special token), so each prefix is decoded on its own -- but in one
    call into the Rust tokenizer (``decode_batch``), which is what ``decode`` runs for each:
    the Python overhead of a ``decode`` per prefix, 25 ms for a 300-token reply, was the cost.
    Tokenizers whose ``decode`` does more than the backend's call take the plain path."""
    backend = _backend_decoder(tokenizer)
    if backend is None:
        # one sequence of ids decodes to one string
        return [cast(str, tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    ids = [int(i) for i in ids]
    return backend.decode_batch([ids[: k + 1] for k in range(len(ids))], skip_special_tokens=True)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: the printable Latin-1 bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order (the table every
    byte-level BPE shares: GPT-2's ``bytes_to_unicode``, tokenizers' ``ByteLevel``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_of_char()


def _byte_level_lengths(
    tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, ids: list[int]
) -> tuple[list[int], str] | None:
    """Every prefix's decoded length under a byte-level BPE in one pass over the reply, with its
    text; None where the tokenizer is not that kind or the pass disagrees with ``decode``.

    tokenizers' ``ByteLevel`` decoder maps each kept token to its bytes (a token with a character
    outside the table, such as an added token's space, to its UTF-8) and decodes them all at once,
    a broken sequence to U+FFFD. So a prefix's text is its bytes decoded: the characters the
    incremental UTF-8 decoder has given so far, plus what the bytes it still holds give alone."""
    import codecs

    from tokenizers import decoders

    if type(backend.decoder) is not decoders.ByteLevel:
        return None
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    raw_of: dict[int, bytes] = {i: b"" for i in special}  # a skipped special token adds no bytes
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parts: list[str] = []
    done, lengths = 0, []
    for i in ids:
        raw = raw_of.get(i)
        if raw is None:
            token = backend.id_to_token(i)
            if token is None:
                return None
            try:
                raw = bytes(_BYTE_OF_CHAR[c] for c in token)
            except KeyError:
                raw = token.encode()
            raw_of[i] = raw
        parts.append(decoder.decode(raw))
        done += len(parts[-1])
        held, _ = decoder.getstate()
        lengths.append(done + (len(held.decode("utf-8", errors="replace")) if held else 0))
    parts.append(decoder.decode(b"", final=True))
    text = "".join(parts)
    # the one decode that checks the pass: its text, hence its last length, must be decode's
    if text != backend.decode(ids, skip_special_tokens=True):
        return None
    return lengths, text


def prefix_lengths(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> tuple[list[int], str]:
    """``len(tokenizer.decode(ids[:k + 1], skip_special_tokens=True))`` for every k, and the whole
    reply's text: in one pass under a byte-level BPE (Qwen, Llama 3, GPT-2), the time linear in the
    reply's length; otherwise from :func:`prefix_texts`, whose cost grows with its square."""
    backend = _backend_decoder(tokenizer)
    if backend is not None and ids:
        found = _byte_level_lengths(tokenizer, backend, [int(i) for i in ids])
        if found is not None:
            return found
    texts = prefix_texts(tokenizer, ids)
    return [len(t) for t in texts], texts[-1] if texts else ""


def action_span_mask(
    tokenizer: PreTrainedTokenizerBase,
    action_ids: list[int],
    unparsed: str = "none",
    action_format: ActionFormat | None = None,
    spans: str = "last",
) -> list[int]:
    """1 for tokens of the parsed action, 0 for reasoning, tags and the end token (METHOD.md 5).

    A reply with no parseable action gets no weights (all 0) with ``unparsed="none"``, as in
    the authors' ``serl_action_mask`` (recipe/serl/serl_ray_trainer.py:104-152, 592-596);
    ``"whole"`` counts all its visible tokens instead, since the environment received all of it.

    Character offsets are the lengths of the growing prefixes' decodes (:func:`prefix_lengths`), so the mask follows the
    tokenizer's own detokenization; a token overlapping the action's span counts (as the
    authors' offset match, serl_ray_trainer.py:98-102). The parsed action is the one the
    environment executed (``rollout.prompts.action_span``: the last ``<action>`` tag or a bare
    action in ``action_format``, the environment's; WebShop's when None). ``spans="authors"`` marks
    what the authors' mask marks instead (``rollout.prompts.authors_action_spans``): every tagged
    span, malformed tags included, else a WebShop verb anywhere in the reply. Their tokens come
    from re-tokenizing the decoded reply and fall back to decoded prefixes (serl_ray_trainer.py:
    117-150); serl uses the prefixes of the generated tokens themselves, the same where the
    re-tokenization gives the generated tokens back.
    """
    if unparsed not in UNPARSED:
        raise SerlError(f"unknown unparsed {unparsed!r}: choose one of {', '.join(UNPARSED)}")
    if spans not in ACTION_SPANS:
        raise SerlError(f"unknown action_spans {spans!r}: choose one of {', '.join(ACTION_SPANS)}")
    ends, text = prefix_lengths(tokenizer, action_ids)
    if spans == "authors":
        found = authors_action_spans(text)
    else:
        span = action_span(text, action_format) if action_format is not None else action_span(text)
        found = [span] if span is not None else []
    if not found:
        if unparsed == "none":
            return [0] * len(action_ids)
        found = [(0, len(text))]  # the end-of-turn token still keeps weight 1
    mask, prev = [], 0
    for e in ends:
        mask.append(1 if e > prev and any(prev < end and e > start for start, end in found) else 0)
        prev = e
    return mask
