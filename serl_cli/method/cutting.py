"""Cutting a text to a budget, cleanly: at most so many characters or tokens, ending on a whole
word and a `` ...`` marker. The annotation cuts each turn's hindsight block as a whole with it
(``method.annotation``), as the authors cap the whole teacher prompt (``max_reprompt_len``,
recipe/serl/serl_ray_trainer.py:562); the anchor block's one-line glimpses are cut by characters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TAIL_CHARS = 16  # a cut drops a partial word up to max(20 % of the text, this many characters)


def _trim(head: str, full: str) -> str:
    """``head`` (a prefix of ``full``) ended cleanly: no partial word, then " ..."."""
    head = head.rstrip("\ufffd")  # a split UTF-8 character decodes to U+FFFD: drop it
    if not full[len(head) : len(head) + 1].isspace():  # the cut fell inside a word
        space = max(head.rfind(" "), head.rfind("\n"))
        if space >= 0 and len(head) - space <= max(0.2 * len(head), TAIL_CHARS):
            head = head[:space]  # drop the partial word; a long unbroken run (a URL, an id) stays cut
    return head.rstrip() + " ..."


def char_cutter(max_chars: int) -> Callable[[str], str]:
    """Cut to at most ``max_chars`` characters, cleanly (for tests and tokenizer-less use)."""

    def cut(text: str) -> str:
        if len(text) <= max_chars:
            return text
        return _trim(text[: max_chars - 4], text) if max_chars >= 4 else ""  # room for " ..." or nothing

    return cut


def make_cutter(tokenizer: PreTrainedTokenizerBase, max_tokens: int) -> Callable[[str], str]:
    """Cut to at most ``max_tokens`` tokens of ``tokenizer``, cleanly; short texts unchanged."""

    def cut(text: str) -> str:
        return _cut_encoded(tokenizer, max_tokens, text, tokenizer.encode(text, add_special_tokens=False))

    return cut


def cut_all(tokenizer: PreTrainedTokenizerBase, max_tokens: int, texts: list[str]) -> list[str]:
    """:func:`make_cutter`'s cut of each of ``texts``, each distinct text cut once: a batch's blocks
    repeat (a group's rollouts meet the same states; 173 distinct of 585 in a Sokoban iteration), and
    encoding one took ~0.1 ms, most of the annotate stage's time outside the teacher."""
    cut = make_cutter(tokenizer, max_tokens)
    done = {text: cut(text) for text in dict.fromkeys(texts)}
    return [done[text] for text in texts]


def _cut_encoded(tokenizer: PreTrainedTokenizerBase, max_tokens: int, text: str, ids: list[int]) -> str:
    """``text`` (whose tokens are ``ids``) cut to at most ``max_tokens`` tokens, cleanly."""
    if len(ids) <= max_tokens:
        return text
    n = max_tokens - len(tokenizer.encode(" ...", add_special_tokens=False))
    while n > 0:  # re-encoding a cut text may merge differently: shrink until it fits
        out = _trim(cast(str, tokenizer.decode(ids[:n])), text)  # one sequence of ids decodes to one string
        if len(tokenizer.encode(out, add_special_tokens=False)) <= max_tokens:
            return out
        n -= 1
    return ""  # the budget cannot hold even the marker
