"""The off-policy correction of an update: which correction applies to rollouts some updates old, and
each turn's per-token weights pi_prox / pi_behav with the mismatch statistics (the weights' math is
:func:`serl_cli.algos.core.offpolicy_weights`). ``train.offpolicy`` (``training.train_config``) holds the
settings; they are read here by name, so this layer imports nothing above it. torch loads with the
weights' function: the settings' checks (:func:`resolve_correction`) run without it."""

from __future__ import annotations

from serl_cli.errors import SerlError


def resolve_correction(cfg, staleness: int = 0) -> tuple[str, str]:
    """``(correction, level)`` an update applies (``cfg``: ``train.offpolicy``), for rollouts
    ``staleness`` policy versions old (the online loop's ``max_staleness``; 0: synchronous).
    ``auto``: none on-policy, TIS once stale (an asynchronous loop's default), at ``cfg.level``
    (token by default); the other words stand."""
    if cfg.correction != "auto":
        return cfg.correction, cfg.level
    return ("tis" if staleness > 0 else "none"), cfg.level


def offpolicy_correction(samples: list, op, staleness: int = 0) -> tuple[list[list[float]] | None, dict]:
    """The off-policy correction of an update's turns (``op``: ``train.offpolicy``) for rollouts
    ``staleness`` updates old: each turn's per-token weights pi_prox / pi_behav (None: no
    correction) and the mismatch statistics, over every turn the trainer recomputed pi_old of
    (no statistics where it recomputed none: a run without the recompute logs what it always did)."""
    import torch

    from serl_cli.algos import core
    from serl_cli.algos.batch import right_aligned

    correction, level = resolve_correction(op, staleness)
    recomputed = [s.engine_logprobs is not None and len(s.engine_logprobs) == len(s.action_ids) for s in samples]
    if not any(recomputed):  # stale rollouts with no gradient anywhere need no pi_prox (Learner.update)
        if correction != "none" and samples and staleness == 0:
            raise SerlError(
                f"train.offpolicy.correction {correction} needs the trainer's recomputed pi_old, and these turns "
                "have none: set train.recompute_logp_old to true"
            )
        return None, {}
    if correction != "none" and staleness == 0 and not all(recomputed):
        raise SerlError(f"train.offpolicy.correction {correction}: some turns' pi_old was not recomputed")
    rows = [i for i, ok in enumerate(recomputed) if ok]
    k = max(len(samples[i].action_ids) for i in rows)
    prox = right_aligned([samples[i].behaviour_logprobs for i in rows], k)
    behav = right_aligned([samples[i].engine_logprobs for i in rows], k)
    mask = right_aligned([[1.0] * len(samples[i].action_ids) for i in rows], k)
    episodes = torch.tensor([samples[i].episode for i in rows])
    bounds = {"tis_cap": op.tis_cap, "mis_low": op.mis_low, "mis_high": op.mis_high}
    weights, stats = core.offpolicy_weights(prox, behav, mask, correction, level, episode_ids=episodes, **bounds)
    mismatch = {key: stats[key] for key in ("logp_mismatch_k1", "logp_mismatch_k3")}
    if correction == "none":
        return None, mismatch
    # stale rollouts recompute pi_prox only where a gradient is (Learner.update): elsewhere weight 1
    per_turn = [[1.0] * len(s.action_ids) for s in samples]
    for r, i in enumerate(rows):
        per_turn[i] = weights[r, k - len(samples[i].action_ids) :].tolist()
    return per_turn, stats
