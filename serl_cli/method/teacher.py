"""The hindsight teacher: the same network, shown a hindsight block, scoring the student's tokens.

The teacher's prompt follows the authors' reprompt layout (github.com/OliverLeeXZ/SERL at
5a2a85b): the user message becomes ``REPROMPT_TEMPLATE`` filled with the student's user
message and the block -- the prompt, a blank line, the block's sections, a blank line and
their closing instruction (recipe/serl/config/serl_trainer.yaml:65,
recipe/serl/privileged_context.py:1569-1572, 449-452). Stored turns hold token ids only, so
serl never re-renders a stored prompt: it splices token ids into it, which keeps every other
token exactly as the student saw it. Where they go is learnt from the tokenizer's own chat
template (any model family: ChatML, Llama 3, Gemma, Mistral's ``[INST]``), on a probe
conversation of one user message rendered with ``apply_chat_template(add_generation_prompt=True)``
and the prompt's ``chat_template_kwargs``:

* the *tail* is what the template writes after the user message's text (the end of the
  user turn and the assistant header): the longest common suffix of two probes whose texts
  differ in their last character;
* the probe rendered again with the block text at the end of its user message must be the
  probe's own ids around an inserted part -- student = P + tail, teacher = P + X + tail --
  and X (the block as the template renders it: Gemma and Llama 3 trim the message, so no
  final newline) is spliced into the stored prompt just before its tail.

Fallback, where that check fails (the tokenizer merges tokens across the boundary, the
template rewrites the message) or the stored prompt does not end with the tail (it was
rendered with other ``chat_template_kwargs``): the block's own tokens
(:func:`block_ids`) go before the last end-of-turn token of the prompt (the template's, e.g.
Gemma's ``<end_of_turn>``; else eos: ``rollout.prompts.end_of_turn_id``), serl's original
layout (:func:`teacher_prompt_ids`); with no such token in the prompt, before the tail; with
neither, :func:`teacher_prompt` refuses. For serl's own models and Qwen-style
ChatML templates both paths give the same ids. The system message stays, as the authors'
chat template keeps its own (their student prompt is one user message:
agent_system/multi_turn_rollout/rollout_loop.py:201-211). A turn with no block keeps the
student's prompt and is not scored (PC:449-451). The teacher then scores the student's own
reply tokens, in batches, without gradient: ``log pi_T(a_t | prompt_t + hindsight)``
(recipe/serl/serl_ray_trainer.py:568).

Differences on purpose: the authors strip the prompt text (PC:244-251) -- serl's own user
messages carry no leading or trailing whitespace to strip, while the authors' templates
(``prompt.style: authors``) begin and end with a newline, which the spliced teacher prompt keeps
(one newline more before the student's text and before the block than theirs); and their ``max_reprompt_len``
truncates the whole templated prompt from the right (serl_ray_trainer.py:36-39, 562), which
can cut off the closing instruction and the assistant header -- serl caps the block alone
(``AnnotateConfig.max_hindsight_tokens``), so the instruction always survives. And splicing
token ids means the token where the user's text meets the block is never merged, as a
re-rendered prompt could merge it (``]`` + ``\\n\\n`` under a Qwen or Llama 3 tokenizer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch

from serl_cli.artifacts import io
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import Tokens
from serl_cli.rollout.prompts import end_of_turn_id, render_prompt_ids, tokenizer_fact

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from serl_cli.training.learner import Learner

# The authors' default template (serl_trainer.yaml:65; the code default at PC:1569-1572).
REPROMPT_TEMPLATE = "{prompt}\n\n{privileged_context}\n\nCorrectly solve the current task.\n"
TOKEN_SCOPES = get_args(Tokens)  # serl: the parsed action's tokens | rlsd: every reply token
TEACHER_STATE = "teacher_state.pt"  # in an online run's checkpoint: the snapshot, so a resumed run matches


def teacher_prompt_ids(prompt_ids: list[int], block_ids: list[int], end_of_turn_id: int) -> list[int]:
    """The student prompt with ``block_ids`` inserted before the user message's end-of-turn token
    (the fallback layout of :func:`teacher_prompt`)."""
    try:
        # the last end-of-turn token before the assistant header closes the user message
        cut = len(prompt_ids) - 1 - prompt_ids[::-1].index(end_of_turn_id)
    except ValueError:
        raise SerlError(
            "cannot place the hindsight block: the stored prompt has no end-of-turn token "
            "(the tokenizer's eos token must close each chat message)"
        ) from None
    return prompt_ids[:cut] + block_ids + prompt_ids[cut:]


# The probe conversation's user text: two variants that differ in their last character only.
PROBE_TEXTS = ("Probe message A", "Probe message B")


def _render_probe(tokenizer: PreTrainedTokenizerBase, text: str, chat_template_kwargs: dict | None) -> list[int] | None:
    if text not in PROBE_TEXTS:
        return _render_probe_now(tokenizer, text, chat_template_kwargs)
    # the two fixed probes depend only on the tokenizer and the kwargs, and every scored turn needs them
    key = ("probe", text, repr(sorted((chat_template_kwargs or {}).items())))
    return tokenizer_fact(tokenizer, key, lambda: _render_probe_now(tokenizer, text, chat_template_kwargs))


def _render_probe_now(
    tokenizer: PreTrainedTokenizerBase, text: str, chat_template_kwargs: dict | None
) -> list[int] | None:
    """A one-user-message prompt, as the student's prompts are rendered; None where the
    tokenizer has no chat template or the template refuses it."""
    from jinja2 import TemplateError

    try:
        return render_prompt_ids(tokenizer, [{"role": "user", "content": text}], chat_template_kwargs)
    except (ValueError, TemplateError):
        return None


def _common_suffix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def chat_tail(tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict | None = None) -> list[int] | None:
    """The token ids the chat template writes after the user message's text (the end of the
    user turn, the assistant header): the longest common suffix of two probe prompts."""
    a, b = (_render_probe(tokenizer, text, chat_template_kwargs) for text in PROBE_TEXTS)
    if a is None or b is None:
        return None
    return a[len(a) - _common_suffix(a, b) :]


def spliced_part(student: list[int], teacher: list[int], tail: list[int]) -> list[int] | None:
    """X where student = P + tail and teacher = P + X + tail (X not empty); None where the
    teacher is not the student with a part inserted just before ``tail``."""
    cut = len(student) - len(tail)
    end = len(teacher) - len(tail)
    if student[cut:] != tail or teacher[end:] != tail or end <= cut or teacher[:cut] != student[:cut]:
        return None
    return teacher[cut:end]


def inserted_ids(
    tokenizer: PreTrainedTokenizerBase, block: str, tail: list[int], chat_template_kwargs: dict | None = None
) -> list[int] | None:
    """The block's ids as the chat template renders them at the end of a user message
    (:func:`spliced_part` of a probe with and without it); None where the check fails."""
    text = PROBE_TEXTS[0]
    student = _render_probe(tokenizer, text, chat_template_kwargs)
    teacher = _render_probe(tokenizer, text + teacher_suffix(block), chat_template_kwargs)
    if student is None or teacher is None:
        return None
    return spliced_part(student, teacher, tail)


def _ends_with(ids: list[int], tail: list[int]) -> bool:
    return len(ids) >= len(tail) and ids[len(ids) - len(tail) :] == tail


def teacher_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], block: str, chat_template_kwargs: dict | None = None
) -> list[int]:
    """The teacher's prompt: the stored student ``prompt_ids`` with the hindsight ``block``
    (the sections' text) at the end of the user message (module docstring: the layout and
    its fallback). ``chat_template_kwargs``: those the student's prompts were rendered with."""
    tail = chat_tail(tokenizer, chat_template_kwargs)
    if tail is not None and _ends_with(prompt_ids, tail):
        cut = len(prompt_ids) - len(tail)
        inserted = inserted_ids(tokenizer, block, tail, chat_template_kwargs)
        if inserted is not None:
            return prompt_ids[:cut] + inserted + prompt_ids[cut:]
    ids = block_ids(tokenizer, block)
    end = end_of_turn_id(tokenizer)  # Gemma closes a message with <end_of_turn>, not its eos token
    if end is not None and end in prompt_ids:
        return teacher_prompt_ids(prompt_ids, ids, end)
    if tail is not None and _ends_with(prompt_ids, tail):
        cut = len(prompt_ids) - len(tail)
        return prompt_ids[:cut] + ids + prompt_ids[cut:]
    raise SerlError(
        "cannot place the hindsight block: the stored prompt has no end-of-turn token and does "
        "not end as the tokenizer's chat template ends a user message (rendered with other "
        "prompt.chat_template_kwargs, or by another tokenizer?)"
    )


def teacher_suffix(block: str) -> str:
    """What the template puts after the student's prompt, for ``block`` (the sections)."""
    return REPROMPT_TEMPLATE.split("{prompt}", 1)[1].format(privileged_context=block)


def teacher_prompts_for(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[list[int]],
    blocks: list[str],
    chat_template_kwargs: dict | None = None,
) -> list[list[int]]:
    """:func:`teacher_prompt` of each stored prompt with its block, the same ids, with every distinct
    block's probe rendered in one batched chat-template call (a call per turn cost ~0.3 ms of
    Python, a third of the annotate stage's time outside the teacher on Sokoban: issue 39). A prompt
    off the spliced path takes :func:`teacher_prompt`'s fallback on its own."""
    tail = chat_tail(tokenizer, chat_template_kwargs)
    student = _render_probe(tokenizer, PROBE_TEXTS[0], chat_template_kwargs)
    spliced = [tail is not None and student is not None and _ends_with(p, tail) for p in prompt_ids]
    unique = list(dict.fromkeys(b for b, ok in zip(blocks, spliced, strict=True) if ok))
    rendered = _render_probes(tokenizer, [PROBE_TEXTS[0] + teacher_suffix(b) for b in unique], chat_template_kwargs)
    inserted = {
        b: spliced_part(student, r, tail) if r is not None and student is not None and tail is not None else None
        for b, r in zip(unique, rendered, strict=True)
    }
    out = []
    for p, b, ok in zip(prompt_ids, blocks, spliced, strict=True):
        part = inserted[b] if ok else None
        if part is None:
            out.append(teacher_prompt(tokenizer, p, b, chat_template_kwargs))
        else:
            cut = len(p) - len(tail or [])
            out.append(p[:cut] + part + p[cut:])
    return out


def _render_probes(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], chat_template_kwargs: dict | None
) -> list[list[int] | None]:
    """:func:`_render_probe_now` of each text, in one batched ``apply_chat_template`` call (the same
    template render and tokenization per conversation); one at a time where the batch is refused."""
    from jinja2 import TemplateError

    if not texts:
        return []
    try:
        # a list of id lists, or a BatchEncoding holding them, as the transformers version has it
        ids: Any = tokenizer.apply_chat_template(
            [[{"role": "user", "content": t}] for t in texts],
            add_generation_prompt=True,
            tokenize=True,
            **(chat_template_kwargs or {}),
        )
    except (ValueError, TemplateError):
        return [_render_probe_now(tokenizer, t, chat_template_kwargs) for t in texts]
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return [list(row) for row in ids]


def block_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The tokens spliced into the student's user message for the block ``text``."""
    return tokenizer.encode(teacher_suffix(text), add_special_tokens=False)


class TeacherSnapshot:
    """The hindsight teacher between syncs: the policy as it was at the last :meth:`sync`.

    The teacher is the live network with the snapshot's weights copied in while it scores
    (:meth:`scoring`), then the live weights copied back: no second model is built. The
    snapshot holds the tensors an update changes (every weight; under LoRA the adapter's
    only), as each process keeps them:

    * under ZeRO-3, each process's own partitions (``ds_tensor``), on their device: the
      teacher is sharded like the policy, and scores with ZeRO's per-layer gathers;
    * otherwise (the torch backend, ZeRO-1/2) each process keeps a whole copy in CPU memory
      between scorings; it is copied onto the device only while it scores (on a CPU that
      is where it stays).

    Every process keeps its snapshot: each scores its own share of the turns
    (:func:`serl_cli.training.scoring.score`). :meth:`save` / :meth:`load` put it in a checkpoint
    (``teacher_state.pt``; under ZeRO-3 one file per process, ``teacher_state.rank{r}.pt``).
    """

    def __init__(self, learner: Learner) -> None:
        self.learner, self.backend = learner, learner.backend
        self.params = learner.trained_parameters()
        self.saved: dict[str, torch.Tensor] = {}
        self.sync()

    def _keep(self, values: torch.Tensor) -> torch.Tensor:
        return values.clone() if self.backend.sharded else values.to("cpu", copy=True)

    @torch.no_grad()
    def sync(self) -> None:
        """The teacher becomes the policy as it is now (every process, no communication)."""
        self.saved = {name: self._keep(self.backend.local_values(p)) for name, p in self.params}

    @contextmanager
    def scoring(self) -> Iterator[Any]:  # the policy network: a Hugging Face model, or its peft wrapper
        """The network to score with: the live one holding the teacher's weights until the
        block ends (every process enters: under ZeRO-3 every gathered copy is dropped first
        and last, so its forwards gather the teacher's partitions, then the policy's)."""
        self.backend.release_gathered()
        live = {}
        with torch.no_grad():
            for name, p in self.params:
                values = self.backend.local_values(p)
                live[name] = self._keep(values)
                values.copy_(self.saved[name])
        try:
            yield self.learner.model
        finally:
            self.backend.release_gathered()
            with torch.no_grad():
                for name, p in self.params:
                    self.backend.local_values(p).copy_(live[name])

    def state_dict(self) -> dict:
        return dict(self.saved)

    def load_state_dict(self, state: dict) -> None:
        # an older serl saved a LoRA teacher in peft's names (no ".default."): read those too
        found = {name: state.get(name, state.get(name.replace(".default.", "."))) for name, _ in self.params}
        missing = [name for name, value in found.items() if value is None]
        if missing:
            raise SerlError(f"the saved teacher has no {missing[0]}: it was saved by another serl or another model")
        self.saved = {
            name: self._keep(value.to(self.saved[name].dtype)) for name, value in found.items() if value is not None
        }

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The teacher becomes the whole policy ``weights`` names (a published version, in the
        policy's names): each process keeps its own share, as :meth:`sync` would have kept it."""
        missing = [name for name, _ in self.params if name not in weights]
        if missing:
            raise SerlError(f"the policy version has no {missing[0]}: it was written for another model")
        self.saved = {
            name: self._keep(self.backend.local_part(p, weights[name]).to(self.saved[name])) for name, p in self.params
        }

    def state_file(self, directory: Path) -> Path:
        name = f"teacher_state.rank{self.backend.rank}.pt" if self.backend.sharded else TEACHER_STATE
        return Path(directory) / name

    def save(self, directory: Path) -> None:
        """The snapshot into a checkpoint directory (every process calls it)."""
        if self.backend.sharded or self.backend.is_main:
            io.torch_save(self.state_dict(), self.state_file(directory))

    def load(self, directory: Path) -> bool:
        """The snapshot a checkpoint holds, if it holds one (every process calls it)."""
        path = self.state_file(directory)
        if not path.is_file():
            return False
        self.load_state_dict(io.torch_load(path, "the teacher snapshot"))
        return True
