"""Memory of the log-probs and entropy of a reply, whole-batch against a slice at a time.

    python -m benchmarks.logits_memory [--rows 2] [--replies 64,128,256] [--out FILE]

Writes ``benchmarks/results/logits_memory.json`` unless ``--out`` is given.

Random fp32 logits ``[rows, reply + 1, 151,936]`` (Qwen2.5's vocabulary) stand for a model's
output; each way computes the log-probs of the reply tokens and the entropy at temperature 0.7,
then the backward pass of ``logp.sum() + 0.001 * entropy.sum()``, once, in a process of its own
(``benchmarks.peak``):

* ``whole batch``: what ``training.step.action_logprobs`` did before, one ``log_softmax`` over
  ``[rows, reply, V]`` in fp32, ``exp`` and the product for the entropy;
* ``slices``: ``training.token_logprobs``, a slice of positions at a time, the gradient written
  straight into one tensor the size of the logits.

The figure is the peak above the RSS with the logits already in memory. One copy of the
logits is ``rows x (reply + 1) x 151,936 x 4`` bytes; the table gives the peak in copies.
"""

from __future__ import annotations

import argparse

VOCAB = 151_936
MODES = ("whole batch", "slices")


def one(spec: dict) -> dict:
    import torch

    from benchmarks.peak import BlockPeak
    from serl_cli.training.token_logprobs import token_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows, reply = spec["rows"], spec["reply"]
    logits = torch.randn(rows, reply + 1, VOCAB, requires_grad=True)
    targets = torch.randint(0, VOCAB, (rows, reply))
    with BlockPeak() as peak:
        if spec["mode"] == "whole batch":
            lp = torch.log_softmax(logits[:, :-1].float() / 0.7, dim=-1)
            logp = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            ent = -(lp.exp() * lp).sum(-1)
        else:
            logp, ent = token_logprobs(logits, targets, 0.7, entropy=True)
        (logp.sum() + 0.001 * ent.sum()).backward()
    return {**spec, "peak_extra_mb": peak.extra_mb, "copy_mb": logits.numel() * 4 / 2**20}


def main(argv=None) -> dict:
    from benchmarks.common import add_one_options, measure_one, report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--replies", default="64,128,256")
    add_one_options(ap)
    args = ap.parse_args(argv)
    if args.one:
        return measure_one(args, one)
    from benchmarks.peak import in_fresh_process

    results = []
    for reply in (int(r) for r in args.replies.split(",")):
        for mode in MODES:
            r = in_fresh_process("benchmarks.logits_memory", {"rows": args.rows, "reply": reply, "mode": mode})
            results.append({"mode": mode, "reply": reply, **r})
            print(f"{mode:12s} reply {reply:4d}: {r.get('peak_extra_mb', float('nan')):.0f} MB", flush=True)
    rows = [
        [
            r["mode"],
            r["reply"],
            f"{r['copy_mb']:.0f}" if "copy_mb" in r else "-",
            f"{r['peak_extra_mb']:.0f}" if "peak_extra_mb" in r else r.get("error", "-"),
            f"{r['peak_extra_mb'] / r['copy_mb']:.2f}" if "copy_mb" in r else "-",
        ]
        for r in results
    ]
    columns = ["log-softmax", "reply tokens", "one copy, MB", "peak above start, MB", "copies"]
    title = f"log-probs + entropy, forward and backward ({args.rows} rows, vocabulary 151,936, fp32)"
    report("logits_memory", title, columns, rows, {"rows": args.rows, "vocab": VOCAB, "results": results}, args.out)
    return {"results": results}


if __name__ == "__main__":
    main()
