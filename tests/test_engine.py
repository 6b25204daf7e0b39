"""The generation engine and the rollout stage it drives (serl_cli.rollout.engines, serl_cli.stages.rollout).

The acceptance test: the behaviour log-probs stored with a rollout are what a plain
forward pass of the same model gives for the stored tokens, ``log_softmax(logits / T)``
(T = 1 for greedy), to 1e-4 in fp32 on CPU. Rollouts come from the real path
(``run_rollout`` on WebShop's synthetic catalog, 2 tasks x 3 rollouts, a tiny model
directory; episodes capped at 4 turns to keep the module fast). Sampled runs use the
``stopping_model_dir`` fixture so that one batch holds replies that stopped on the
end-of-turn token and replies cut at ``max_new_tokens``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import rollout_config, synthetic_env
from transformers import AutoModelForCausalLM, AutoTokenizer

from serl_cli.artifacts.schema import ROLLOUTS_FILE, read_rollouts
from serl_cli.models.loading import load_model
from serl_cli.models.tiny import EOS_TOKEN, PAD_TOKEN
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.engines.hf import HFEngine
from serl_cli.rollout.prompts import format_action
from serl_cli.stages.rollout import run_rollout

torch.set_num_threads(1)

TOL = 1e-4
MAX_NEW = 16


def _run(model_dir, out: Path, temperature: float, seed: int = 0, **kw) -> Path:
    run_rollout(rollout_config(model_dir, out, temperature=temperature, seed=seed, max_new_tokens=MAX_NEW, **kw))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, stopping_model_dir) -> dict:
    """Rollout directories by name; built once for the module (each ~2 s)."""
    root = tmp_path_factory.mktemp("rollouts")
    return {
        "T1.0": _run(stopping_model_dir, root / "t10", 1.0),
        "T0.7": _run(stopping_model_dir, root / "t07", 0.7),
        "greedy": _run(tiny_model_dir, root / "greedy", 0.0),  # the plain model: the stopping one stops at once
    }


RUN_MODEL = {"T1.0": ("stopping", 1.0), "T0.7": ("stopping", 0.7), "greedy": ("plain", 1.0)}


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir, stopping_model_dir) -> dict:
    """Plain ``AutoModelForCausalLM`` loads (not serl's loader): the scorer a trainer would use."""
    out = {}
    for name, path in (("plain", tiny_model_dir), ("stopping", stopping_model_dir)):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        out[name] = (model, AutoTokenizer.from_pretrained(str(path)))
    return out


def _turns(run_dir: Path) -> list:
    return [t for ep in read_rollouts(run_dir) for t in ep.turns]


@torch.no_grad()
def _action_logits(model, prompt_ids: list[int], action_ids: list[int]) -> torch.Tensor:
    """Logits that predict each action token: one plain forward pass, batch of 1, no padding."""
    logits = model(input_ids=torch.tensor([prompt_ids + action_ids])).logits[0].float()
    p = len(prompt_ids)
    return logits[p - 1 : p - 1 + len(action_ids)]


def _logprobs(logits: torch.Tensor, action_ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at the action tokens."""
    return (
        torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(action_ids).unsqueeze(-1)).squeeze(-1)
    )


@pytest.fixture(scope="module")
def scored(runs, hf_models) -> dict:
    """Per run: (turn, action logits) for every stored turn, from a fresh forward pass."""
    return {
        run: [
            (t, _action_logits(hf_models[RUN_MODEL[run][0]][0], t.prompt_ids, t.action_ids)) for t in _turns(runs[run])
        ]
        for run in runs
    }


@torch.no_grad()
def _score_right_padded(model, pad_id: int, turns: list[dict], temperature: float) -> list[torch.Tensor]:
    """The same, for all turns in one right-padded batch with an attention mask."""
    seqs = [t.prompt_ids + t.action_ids for t in turns]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for i, t in enumerate(turns):
        p, a = len(t.prompt_ids), t.action_ids
        out.append(_logprobs(logits[i, p - 1 : p - 1 + len(a)].float(), a, temperature))
    return out


# ---------------------------------------------------------------- acceptance: re-scoring


@pytest.mark.parametrize("run", ["T1.0", "T0.7", "greedy"])
def test_rescoring_reproduces_behaviour_logprobs(scored, run):
    temperature = RUN_MODEL[run][1]
    assert len(scored[run]) >= 6
    worst = 0.0
    for t, logits in scored[run]:
        stored = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
        assert len(stored) == len(t.action_ids) > 0
        assert (stored <= 0).all()
        rescored = _logprobs(logits, t.action_ids, temperature)
        worst = max(worst, (rescored - stored).abs().max().item())
    assert worst < TOL, f"{run}: re-scored log-probs differ from the stored ones by up to {worst:.2e}"


def test_rescoring_right_padded_batch(runs, hf_models):
    """A trainer scores many turns at once: right padding with an attention mask gives the same."""
    run = "T1.0"
    model_name, temperature = RUN_MODEL[run]
    model, tok = hf_models[model_name]
    turns = _turns(runs[run])
    assert len({len(t.prompt_ids) + len(t.action_ids) for t in turns}) > 1  # padding really happens
    for t, rescored in zip(turns, _score_right_padded(model, tok.pad_token_id, turns, temperature), strict=True):
        stored = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
        assert (rescored - stored).abs().max().item() < TOL


def test_logprobs_are_of_tempered_logits(scored):
    """The T = 0.7 run's log-probs are of logits / 0.7: scoring it at T = 1 does not match."""
    gap = max(
        (_logprobs(logits, t.action_ids, 1.0) - torch.tensor(t.behaviour_logprobs)).abs().max().item()
        for t, logits in scored["T0.7"]
    )
    assert gap > 1e-2


def test_greedy_takes_the_argmax(scored):
    for t, logits in scored["greedy"]:
        assert logits.argmax(-1).tolist() == t.action_ids


# ---------------------------------------------------------------- what a turn holds


@pytest.mark.parametrize("run", ["T1.0", "T0.7", "greedy"])
def test_action_ids_end_on_eos_and_hold_no_padding(runs, hf_models, run):
    _, tok = hf_models[RUN_MODEL[run][0]]
    eos, pad = tok.convert_tokens_to_ids(EOS_TOKEN), tok.convert_tokens_to_ids(PAD_TOKEN)
    assert tok.eos_token_id == eos and tok.pad_token_id == pad and eos != pad
    stopped = cut = 0
    for t in _turns(runs[run]):
        ids = t.action_ids
        assert len(t.behaviour_logprobs) == len(ids) > 0
        # a reply ends at the end-of-turn token or the end-of-text token (also the pad id); nothing
        # generated after it is kept, and no padding is
        assert pad not in ids[:-1] and eos not in ids[:-1]
        if ids[-1] in (eos, pad):
            stopped += 1
        else:
            assert len(ids) == MAX_NEW  # it did not stop: cut at the token budget, never shorter
            cut += 1
        assert t.action_text == tok.decode(ids, skip_special_tokens=True)
        assert tok.decode(t.prompt_ids).endswith("<|im_start|>assistant\n")
    if run != "greedy":  # the sampled runs hold both kinds in the same batches
        assert stopped and cut, (stopped, cut)


def test_engine_batch_with_early_stop(runs, hf_models):
    """Rows that stop early are not padded in the result; their neighbours keep going."""
    model, tok = hf_models["stopping"]
    engine = HFEngine(model, tok)
    prompts = _prompts_of_many_lengths(runs["greedy"], tok)
    gens = engine.generate(prompts + prompts, SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW), seed=0)
    assert len(gens) == 2 * len(prompts)
    lengths = [len(g.token_ids) for g in gens]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths
    for g in gens:
        assert len(g.logprobs) == len(g.token_ids)
        assert tok.pad_token_id not in g.token_ids
        assert g.token_ids[-1] == tok.eos_token_id or len(g.token_ids) == MAX_NEW


# ---------------------------------------------------------------- batching and seeds


def _prompts_of_many_lengths(run_dir: Path, tok) -> list[list[int]]:
    """Stored prompts of distinct lengths (first pages, later pages with history) and a short one."""
    by_length = {len(t.prompt_ids): t.prompt_ids for t in _turns(run_dir)}
    lengths = sorted(by_length)
    prompts = [by_length[n] for n in (lengths[0], lengths[len(lengths) // 2], lengths[-1])]
    prompts.append(tok("<|im_start|>user\nbuy a mug<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


@pytest.mark.parametrize("model_name", ["plain", "stopping"])
def test_batched_greedy_equals_one_by_one(runs, hf_models, model_name):
    model, tok = hf_models[model_name]
    engine = HFEngine(model, tok)
    prompts = _prompts_of_many_lengths(runs["greedy"], tok)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)
    batched = engine.generate(prompts, greedy, seed=0)
    for prompt, b in zip(prompts, batched, strict=True):
        (single,) = engine.generate([prompt], greedy, seed=123)  # greedy: the seed plays no part
        assert b.token_ids == single.token_ids
        assert max(abs(x - y) for x, y in zip(b.logprobs, single.logprobs, strict=True)) < TOL


def test_same_seed_same_generations_other_seed_differs(runs, hf_models):
    model, tok = hf_models["plain"]
    engine = HFEngine(model, tok)
    prompts = _prompts_of_many_lengths(runs["greedy"], tok)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW)
    first = engine.generate(prompts, sampling, seed=7)
    torch.manual_seed(999)  # global RNG state before the call does not matter: the engine seeds it
    again = engine.generate(prompts, sampling, seed=7)
    other = engine.generate(prompts, sampling, seed=8)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.logprobs for g in first] == [g.logprobs for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


@pytest.mark.parametrize("coupled", [False, True])
def test_a_checkpoints_generation_config_does_not_change_sampling(runs, stopping_model_dir, tmp_path, coupled):
    """transformers fills every generation setting a call leaves unset from the checkpoint's
    generation_config.json (Qwen2.5-Instruct's: repetition_penalty 1.05, top_k 20, top_p 0.8);
    the engine draws from softmax(logits / T) alone, the distribution whose log-probs it stores."""
    import json
    import shutil

    loaded = tmp_path / "with-generation-config"
    shutil.copytree(stopping_model_dir, loaded)
    path = loaded / "generation_config.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    settings.update(
        repetition_penalty=1.5, top_k=2, top_p=0.5, temperature=0.3, min_new_tokens=4, no_repeat_ngram_size=2
    )
    path.write_text(json.dumps(settings))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, coupled=coupled)
    gens = {}
    for name, directory in (("plain", stopping_model_dir), ("loaded", loaded)):
        model, tok = load_model(str(directory))
        prompts = _prompts_of_many_lengths(runs["greedy"], tok)
        rows = list(range(2 * len(prompts))) if coupled else None
        gens[name] = HFEngine(model.eval(), tok).generate(prompts + prompts, sampling, seed=5, row_seeds=rows)
    assert model.generation_config.repetition_penalty == 1.5 and model.generation_config.top_k == 2  # it was read
    assert [g.token_ids for g in gens["loaded"]] == [g.token_ids for g in gens["plain"]]
    assert [g.logprobs for g in gens["loaded"]] == [g.logprobs for g in gens["plain"]]


# ---------------------------------------------------------------- coupled sampling


def test_gumbel_rows_draw_from_the_tempered_softmax():
    """GumbelRows' argmax is a draw from softmax(logits / T): over 4000 row streams the
    frequencies are within 4 standard errors of the probabilities."""
    from serl_cli.rollout.engines.hf import GumbelRows

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature, n = 0.7, 4000
    picks = torch.tensor(
        [int(GumbelRows([s], SamplingConfig(temperature, 1.0, 1))(None, logits).argmax()) for s in range(n)]
    )
    p = torch.softmax(logits[0] / temperature, dim=-1)
    freq = torch.bincount(picks, minlength=4).double() / n
    assert torch.all((freq - p).abs() <= 4 * torch.sqrt(p * (1 - p) / n))
    # top-p 0.8 keeps the two likeliest tokens (0.76 + 0.18 of the mass) and draws only from them
    top = {int(GumbelRows([s], SamplingConfig(temperature, 0.8, 1))(None, logits).argmax()) for s in range(200)}
    assert top == {0, 1}


def test_gumbel_rows_draw_each_rows_stream_on_the_scores_device():
    """A row's noise is its seed's stream from a generator on the device of the scores: on a CPU,
    the CPU generator's, step after step -- the draws coupled runs always made."""
    from serl_cli.rollout.engines.hf import GumbelRows

    scores = torch.zeros(2, 5)
    rows = GumbelRows([11, 12], SamplingConfig(1.0, 1.0, 3))
    for _ in range(3):  # each call draws the next piece of each row's stream
        noised = rows(None, scores)
        assert all(g.device == scores.device for g in rows.generators)
    expected = []
    for seed in (11, 12):
        g = torch.Generator().manual_seed(seed)
        u = [torch.rand(5, generator=g, dtype=torch.float64) for _ in range(3)][-1]
        expected.append(-torch.log(-torch.log(u)))
    assert torch.equal(noised, torch.stack(expected).float())


def test_coupled_rows_draw_the_same_alone_or_in_a_batch(runs, hf_models):
    """Under coupled sampling a row's reply depends on its own seed, not on the rows batched
    with it or on the call's seed; another row seed draws otherwise."""
    model, tok = hf_models["plain"]
    engine = HFEngine(model, tok)
    prompts = _prompts_of_many_lengths(runs["greedy"], tok)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, coupled=True)
    rows = list(range(100, 100 + len(prompts)))
    batched = engine.generate(prompts, sampling, seed=7, row_seeds=rows)
    for k in (0, len(prompts) - 1):
        (alone,) = engine.generate([prompts[k]], sampling, seed=99, row_seeds=[rows[k]])
        assert alone.token_ids == batched[k].token_ids
        assert max(abs(x - y) for x, y in zip(alone.logprobs, batched[k].logprobs, strict=True)) < TOL
    shifted = engine.generate(prompts, sampling, seed=7, row_seeds=[r + 1 for r in rows])
    assert [g.token_ids for g in shifted] != [g.token_ids for g in batched]


def test_coupled_rollouts_do_not_depend_on_the_batching(stopping_model_dir, tmp_path):
    """Coupled sampling draws each episode's turns from its own stream: the same rollouts whether
    the episodes run 6 at a time or 1 at a time (one stream per batch would not give that)."""

    def actions(batch_size: int, coupled: bool) -> list:
        cfg = rollout_config(
            stopping_model_dir, tmp_path / f"b{batch_size}{coupled}", temperature=1.0, batch_size=batch_size
        )
        cfg.sampling.coupled = coupled
        run_rollout(cfg)
        return [[t.action_ids for t in ep.turns] for ep in read_rollouts(cfg.out)]

    assert actions(6, True) == actions(1, True)
    assert actions(6, False) != actions(1, False)


def test_row_seed_names_the_episode_turn():
    from serl_cli.rollout.engines import row_seed

    assert row_seed(3, (0, 1), 2) == row_seed(3, (0, 1), 2)
    assert (
        len(
            {
                row_seed(3, (0, 1), 2),
                row_seed(4, (0, 1), 2),
                row_seed(3, (1, 1), 2),
                row_seed(3, (0, 0), 2),
                row_seed(3, (0, 1), 3),
            }
        )
        == 5
    )


# ---------------------------------------------------------------- the rollout stage


def test_same_seed_byte_identical_rollouts(runs, stopping_model_dir, tmp_path):
    """The pipeline's acceptance test: the same command twice gives the same rollouts.jsonl."""
    again = _run(stopping_model_dir, tmp_path / "again", 1.0)
    assert (again / ROLLOUTS_FILE).read_bytes() == (runs["T1.0"] / ROLLOUTS_FILE).read_bytes()
    other = _run(stopping_model_dir, tmp_path / "other", 1.0, seed=1)
    assert (other / ROLLOUTS_FILE).read_bytes() != (runs["T1.0"] / ROLLOUTS_FILE).read_bytes()


def test_rollout_groups(runs):
    episodes = read_rollouts(runs["T1.0"])
    assert len(episodes) == 6
    assert [(e.group_id, e.rollout_index) for e in episodes] == [(g, r) for g in range(2) for r in range(3)]
    for g in range(2):
        assert len({e.task_id for e in episodes if e.group_id == g}) == 1
    assert episodes[0].task_id != episodes[3].task_id
    # group members share their first prompt but (sampling at T = 1) not their first reply
    firsts = [e.turns[0] for e in episodes[:3]]
    assert len({tuple(t.prompt_ids) for t in firsts}) == 1
    assert len({tuple(t.action_ids) for t in firsts}) > 1


def test_expert_rollouts_are_sft_data(runs, tiny_model_dir, tmp_path):
    out = tmp_path / "expert"
    summary = run_rollout(rollout_config(tiny_model_dir, out, policy="expert", env=synthetic_env(max_turns=None)))
    assert summary["success_rate"] == 1.0
    _, tok = load_model(str(tiny_model_dir))
    episodes = read_rollouts(out)
    assert len(episodes) == 6
    for ep in episodes:
        assert ep.success and ep.reward == 1.0
        for t in ep.turns:
            assert t.behaviour_logprobs == []
            assert t.action_ids[-1] == tok.eos_token_id
            assert tok.decode(t.action_ids) == format_action(t.action) + EOS_TOKEN
            assert t.action_text == format_action(t.action) and t.action == t.expert_action
            assert not t.feedback["error"]
            prompt = tok.decode(t.prompt_ids)
            assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert t.observation in prompt
    # the expert sees exactly the prompt a model sees: same tasks (same seed), same first page
    model_first = {e.task_id: e.turns[0].prompt_ids for e in read_rollouts(runs["greedy"])}
    for ep in episodes:
        assert ep.turns[0].prompt_ids == model_first[ep.task_id]
