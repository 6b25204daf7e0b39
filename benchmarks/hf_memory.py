"""Memory of the hf engine's generation against the number of new tokens, Qwen's 152k vocabulary.

    python -m benchmarks.hf_memory [--rows 4] [--tokens 64,128,256] [--out FILE]

Writes ``benchmarks/results/hf_memory.json`` unless ``--out`` is given.

A random-init Qwen2 model with Qwen2.5's vocabulary (151,936) and a small body (hidden 64,
2 layers), so that the logits dominate, generates ``--rows`` replies of exactly N new tokens
(no stop token: sampling at T = 1 from a random model over 152k ids hardly ever draws one;
the JSON records how many were drawn) two ways, each once, in a process of its own
(``benchmarks.peak``):

* ``logits kept``: what the engine did before, ``generate(output_logits=True)``, every step's
  fp32 logits kept, stacked, divided by T and log-softmaxed at the end;
* ``serl engine``: the engine now (``serl_cli.rollout.engines.hf``), which keeps the chosen
  token's log-prob at each step (``ChosenLogprobs``) and one ``[rows, V]`` row of scores.

The figure is the generation's peak above the RSS before it (a 2-token generation runs first,
untimed, for the lazy set-up). One step's logits are ``rows x 151,936 x 4`` bytes (2.3 MiB at 4
rows): kept, they grow by that per step, several times over.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

VOCAB = 151_936
MODES = ("logits kept", "serl engine")


def build_model(out: Path) -> Path:
    """The random model with serl's tokenizer (the Sokoban default model's), saved."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from serl_cli.models.tiny import EOS_TOKEN, PAD_TOKEN
    from serl_cli.rollout.default_model import default_model_dir
    from serl_cli.rollout.worlds import EnvConfig, build_world

    source = default_model_dir(build_world(EnvConfig(name="sokoban", split="train")), "sokoban")
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def generate_keeping_logits(engine, prompts: list[list[int]], sampling, seed: int) -> list[list[float]]:
    """The engine's generation as it was: every step's logits returned by ``generate``, then scored."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), engine.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    torch.manual_seed(seed)
    out = engine.model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=sampling.max_new_tokens,
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=None,
        eos_token_id=sorted(engine.stop_ids),
        pad_token_id=engine.pad_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1).float()
    return torch.log_softmax(logits / sampling.temperature, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1).tolist()


def one(spec: dict) -> dict:
    """The body of a fresh process: one generation of ``spec['tokens']`` new tokens, its peak."""
    import torch

    from benchmarks.peak import BlockPeak
    from serl_cli.models.loading import load_model
    from serl_cli.rollout.engines import SamplingConfig
    from serl_cli.rollout.engines.hf import HFEngine

    torch.set_num_threads(1)
    model, tokenizer = load_model(spec["model"])
    engine = HFEngine(model.eval(), tokenizer)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(32)] for _ in range(spec["rows"])]

    def run(tokens: int):
        sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=tokens)
        if spec["mode"] == "logits kept":
            with torch.no_grad():
                return generate_keeping_logits(engine, prompts, sampling, seed=1)
        return [g.logprobs for g in engine.generate(prompts, sampling, seed=1)]

    run(2)  # lazy set-up outside the measurement
    with BlockPeak() as peak:
        logprobs = run(spec["tokens"])
    return {**spec, "peak_extra_mb": peak.extra_mb, "rss_before_mb": peak.start_mb, "drawn": sum(map(len, logprobs))}


def main(argv=None) -> dict:
    from benchmarks.common import add_one_options, measure_one, report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", default="64,128,256")
    add_one_options(ap)
    args = ap.parse_args(argv)
    if args.one:
        return measure_one(args, one)
    from benchmarks.peak import in_fresh_process

    results = []
    with tempfile.TemporaryDirectory(prefix="serl-hf-memory-") as tmp:
        model = str(build_model(Path(tmp) / "model"))
        for tokens in (int(t) for t in args.tokens.split(",")):
            for mode in MODES:
                r = in_fresh_process(
                    "benchmarks.hf_memory", {"model": model, "rows": args.rows, "tokens": tokens, "mode": mode}
                )
                r.pop("model", None)
                results.append({"mode": mode, "tokens": tokens, **r})
                print(f"{mode:12s} {tokens:4d} new tokens: {r.get('peak_extra_mb', float('nan')):.1f} MB", flush=True)
    step_mb = args.rows * VOCAB * 4 / 2**20
    rows = [
        [
            r["mode"],
            r["tokens"],
            r["rows"] if "rows" in r else args.rows,
            r.get("drawn", "-"),
            f"{r['peak_extra_mb']:.1f}" if "peak_extra_mb" in r else r.get("error", "-"),
            f"{r['peak_extra_mb'] / (r['tokens'] * step_mb):.2f}" if "peak_extra_mb" in r else "-",
        ]
        for r in results
    ]
    data = {"rows": args.rows, "vocab": VOCAB, "one_step_logits_mb": step_mb, "results": results}
    columns = ["engine", "new tokens", "rows", "tokens drawn", "peak above start, MB", "x (tokens x one step's logits)"]
    report(
        "hf_memory",
        "hf engine: generation memory against new tokens (vocabulary 151,936)",
        columns,
        rows,
        data,
        args.out,
    )
    return data


if __name__ == "__main__":
    main()
