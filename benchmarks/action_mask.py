"""The action span mask's cost per reply: every prefix decoded against one pass over the bytes.

    python -m benchmarks.action_mask [--model DIR] [--lengths 50 150 300 600 1200] [--repeats 30] [--out FILE]

SERL's annotate stage marks which reply tokens belong to the parsed action (METHOD.md 5), from
the decoded length of each prefix of the reply. Decoding every prefix (``prefix_texts``: one
``decode_batch`` call over all of them) costs time that grows with the reply's length squared;
under a byte-level BPE, ``prefix_lengths`` finds the same lengths in one pass over the reply's
bytes. Both give the same mask (``tests/test_action_span_mask.py``); this times them on an
ALFWorld-like reply (reasoning, then ``<action>...</action>``) cut to each length, with the
tokenizer of ``--model`` (default: the embedded WebShop model, a byte-level BPE built and
cached on first use). The median of ``--repeats`` calls is kept. Writes
``benchmarks/results/action_mask.json`` unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import report
from serl_cli.method.action_mask import action_span_mask, prefix_lengths, prefix_texts

REPLY = (
    "<think>The mug is not on the countertop, and the drawers I opened held only spoons. "
    "Cabinets 1 to 4 are still closed, so the next thing to try is cabinet 1, then go on in order "
    "until the mug turns up; after that I take it to the coffee machine. </think>"
)


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def reply_ids(tokenizer, length: int) -> list[int]:
    body = tokenizer.encode(REPLY, add_special_tokens=False)
    action = tokenizer.encode("<action>open cabinet 1</action>", add_special_tokens=False)
    reasoning = (body * (length // len(body) + 1))[: max(length - len(action), 0)]
    return reasoning + action


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory whose tokenizer to use")
    ap.add_argument("--lengths", type=int, nargs="+", default=[50, 150, 300, 600, 1200])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    model = args.model
    if model is None:
        from serl_cli.rollout.default_model import default_model_dir
        from serl_cli.rollout.worlds import EnvConfig, build_world

        model = str(default_model_dir(build_world(EnvConfig(name="webshop", split="train")), "webshop"))
    tokenizer = AutoTokenizer.from_pretrained(model)

    rows, results = [], []
    for length in args.lengths:
        ids = reply_ids(tokenizer, length)
        assert prefix_lengths(tokenizer, ids) == ([len(t) for t in prefix_texts(tokenizer, ids)], tokenizer.decode(ids))
        every_prefix = median_ms(lambda ids=ids: prefix_texts(tokenizer, ids), args.repeats)
        one_pass = median_ms(lambda ids=ids: prefix_lengths(tokenizer, ids), args.repeats)
        mask = median_ms(lambda ids=ids: action_span_mask(tokenizer, ids), args.repeats)
        results.append({"tokens": len(ids), "every_prefix_ms": every_prefix, "one_pass_ms": one_pass, "mask_ms": mask})
        rows.append([len(ids), every_prefix, one_pass, every_prefix / one_pass, mask])
    report(
        "action_mask",
        "the action span mask per reply (median ms)",
        ["reply tokens", "every prefix decoded", "one pass", "speed-up", "whole mask"],
        rows,
        {"model": model, "repeats": args.repeats, "results": results},
        args.out,
    )


if __name__ == "__main__":
    main()
