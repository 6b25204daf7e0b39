"""Math shared by every algorithm (METHOD.md sections 6-7).

Shapes: B samples (one sample = one turn), T token positions. `mask` marks the tokens
that carry loss (generated tokens; prompt and padding are 0). Everything is pure.
"""

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, std_norm: bool = True) -> Tensor:
    """GRPO advantage (R - mean_g) / (std_g + eps) within each group id.

    std is the unbiased (Bessel) std, torch's default, as in verl and TRL. A group of
    size 1 or with all-equal rewards gives exactly 0: it has nothing to compare against
    (verl instead returns the raw reward for a singleton; we do not). std_norm=False
    gives the mean-only variant (Dr. GRPO; GiGPO's "mean_norm").
    """
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards.detach().to(torch.float64)  # float64: stats exact enough to test by hand
    count = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    var = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inv, centred**2)
    std = (var / (count - 1).clamp_min(1)).sqrt()
    gmax = torch.full((n_groups,), -torch.inf, dtype=r.dtype).scatter_reduce(0, inv, r, "amax")
    gmin = torch.full((n_groups,), torch.inf, dtype=r.dtype).scatter_reduce(0, inv, r, "amin")
    # Test equality directly, not std == 0: a float mean can leave a tiny residue.
    degenerate = (count < 2) | (gmax == gmin)
    adv = centred / (std[inv] + eps) if std_norm else centred
    adv = torch.where(degenerate[inv], torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def _zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    # Zero masked-out entries BEFORE exp(): an inf there would turn its (zero) gradient
    # into 0 * inf = nan in backward, which where() after the fact cannot stop.
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    # where(), not x * mask: a masked-out inf or nan must not leak in as nan.
    return _zero_outside(x, mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked entries; 0 when the mask is empty (no tokens, no loss)."""
    return masked_sum(x, mask) / mask.sum().clamp_min(1)


def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref) from tokens sampled from pi (Schulman 2020).

    With d = logp_ref - logp: exp(d) - d - 1 >= 0, unbiased, lower variance than -d.
    Used as a loss (as in DeepSeekMath/verl "low_var_kl"), its expected gradient on
    on-policy samples is that of KL(ref || pi); both vanish at pi = ref.
    """
    d = logp_ref - logp
    return torch.exp(d) - d - 1


def offpolicy_weights(
    logp_prox: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    correction: str,
    level: str = "token",
    *,
    episode_ids: Tensor | None = None,
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> tuple[Tensor, dict]:
    """Importance weights pi_prox / pi_behav for the policy-gradient term, and their statistics.

    pi_prox is the trainer's own log-prob of each reply token (the recomputed pi_old the PPO
    ratio is taken against), pi_behav the rollout engine's (vLLM's, or a bf16 decode's): the
    weight corrects for the tokens having been sampled from pi_behav (decoupled PPO). Shapes
    [B, T], one row per turn; ``episode_ids`` [B] says which rows are one episode (``level``
    episode). The log-ratio of a unit is its tokens' summed log-ratio (the product of their
    ratios, SkyRL's sequence level), ``token``: each token alone, ``turn``: a row, ``episode``:
    every row of the episode; each token of a unit gets the unit's weight.

    correction: ``tis`` w = min(ratio, tis_cap) (truncated IS: verl's token TIS, slime's
    --use-tis); ``mis`` w = ratio inside [mis_low, mis_high], else 0 (masked IS, "icepop"):
    a masked token stays in the loss's token count, it only carries no gradient; ``none``
    w = 1. Weights are constants (no gradient), 1 off the mask.

    Stats over the masked tokens: the mismatch as k1 and k3 estimates of KL(pi_behav ||
    pi_prox) (the samples are pi_behav's), the mean weight, and the fraction of tokens the
    TIS cap clipped or MIS masked.
    """
    if correction not in ("none", "tis", "mis"):
        raise ValueError(f"unknown off-policy correction {correction!r}")
    m = mask.bool()
    # float64: a turn's or an episode's sum of hundreds of log-ratios keeps its digits
    log_ratio = _zero_outside(logp_prox.detach().double() - logp_behav.detach().double(), m)
    if level == "token":
        unit = log_ratio
    elif level == "turn":
        unit = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level == "episode":
        if episode_ids is None:
            raise ValueError("episode-level correction needs episode_ids")
        _, inv = torch.unique(episode_ids, return_inverse=True)
        per_episode = torch.zeros(int(inv.max()) + 1 if inv.numel() else 0, dtype=log_ratio.dtype)
        per_episode.index_add_(0, inv, log_ratio.sum(-1))
        unit = per_episode[inv].unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown off-policy correction level {level!r}")
    ratio = torch.exp(unit)
    clipped = torch.zeros_like(ratio, dtype=torch.bool)
    masked = torch.zeros_like(ratio, dtype=torch.bool)
    if correction == "tis":
        clipped = ratio > tis_cap
        w = torch.clamp(ratio, max=tis_cap)
    elif correction == "mis":
        masked = (ratio < mis_low) | (ratio > mis_high)
        w = torch.where(masked, torch.zeros_like(ratio), ratio)
    else:
        w = torch.ones_like(ratio)
    w = torch.where(m, w, torch.ones_like(w)).to(logp_prox.dtype)
    f = mask.to(torch.float64)
    stats = {
        "logp_mismatch_k1": masked_mean(-log_ratio, f).item(),
        # kl_k3(logp, logp_ref) estimates KL(pi || ref) from pi's samples: pi = behav, ref = prox
        "logp_mismatch_k3": masked_mean(kl_k3(torch.zeros_like(log_ratio), log_ratio), f).item(),
        "is_weight_mean": masked_mean(w.double(), f).item(),
        "is_clipped_frac": masked_mean(clipped.double(), f).item(),
        "is_masked_frac": masked_mean(masked.double(), f).item(),
    }
    return w.detach(), stats


def ppo_clip_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    weights: Tensor | None,
    mask: Tensor,
    clip_eps: float = 0.2,
    num_tokens: float | None = None,
    dual_clip: float = 0.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Token-level PPO clip on the reweighted advantage w * A (METHOD.md section 6).

    loss = sum_k -min(r_k w_k A, clip(r_k, 1-eps, 1+eps) w_k A) / N_tokens over masked k.
    advantages: [B] (one per sample, broadcast over tokens) or [B, T]. weights: [B, T]
    SERL weights (constants, no gradient), None for all ones (GRPO). num_tokens: the
    token count of the whole batch when this call sees one micro-batch (gradient
    accumulation must divide by the batch total, not the micro-batch's).

    dual_clip c > 1 (Ye et al. 2019, arXiv 1912.09729; verl's ``clip_ratio_c``, 3.0 in the
    authors' runs): where w A < 0 the per-token loss is also capped at -c w A, so a ratio
    far above 1 on a penalized token cannot blow the loss up. 0 (default) = off.

    is_weights: [B, T] off-policy correction weights (:func:`offpolicy_weights`, constants)
    multiplying each token's clipped term, after the dual clip; None: no correction, and no
    multiplication at all, so the loss is bit for bit what it was without the option.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    wa = advantages if weights is None else weights.detach() * advantages
    wa = wa.detach().expand_as(logp)
    log_ratio = _zero_outside(logp - logp_old.detach(), mask)
    ratio = torch.exp(log_ratio)
    surr = ratio * wa
    surr_clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * wa
    n = mask.sum().clamp_min(1) if num_tokens is None else num_tokens
    per_token = -torch.min(surr, surr_clipped)
    if dual_clip:
        # cap -c*wA binds only on penalized tokens (wA < 0); elsewhere the plain clip stands
        capped = torch.minimum(per_token, -dual_clip * wa)
        lower = ((wa < 0) & (capped < per_token)).to(logp.dtype)
        per_token = torch.where(wa < 0, capped, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = masked_sum(per_token, mask) / n
    with torch.no_grad():
        # The clipped branch binds where it is strictly smaller: A>0 and r>1+eps, or
        # A<0 and r<1-eps. There its gradient is zero.
        clipped = (surr_clipped < surr).to(logp.dtype)
        stats = {
            "clip_frac": masked_mean(clipped, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "approx_kl": masked_mean(-log_ratio, mask).item(),  # k1: unbiased but signed, PPO's usual figure
            # k3 of KL(pi_old || pi_theta) from pi_old's tokens: (r - 1) - log r >= 0, what a "KL" panel shows
            "kl_k3": masked_mean(torch.expm1(log_ratio) - log_ratio, mask).item(),
        }
        if dual_clip:
            stats["dual_clip_frac"] = masked_mean(lower, mask).item()
    return loss, stats


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    weights: Tensor | None = None,
    clip_eps: float = 0.2,
    logp_ref: Tensor | None = None,
    kl_coef: float = 0.0,
    logp_teacher: Tensor | None = None,
    distill_coef: float = 0.0,
    distill_mask: Tensor | None = None,
    num_tokens: float | None = None,
    distill_num_tokens: float | None = None,
    dual_clip: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """The one loss every algorithm trains on:

        PPO-clip(w * A)  +  kl_coef * mean_k3(pi || ref)  +  distill_coef * mean_k3(pi || T)
                         -  entropy_coef * mean_k H(pi(. | prefix_k))

    grpo/gigpo: weights None. rlsd/serl: SERL weights. sdpo: advantages all 0 and a
    distill term; its per-token value is sdpo.distill_kl (= kl_k3 with the teacher),
    averaged over distill_mask (action tokens of selected turns of failed rollouts).
    A term whose coefficient is 0 is skipped, so it needs no inputs. num_tokens (see
    ppo_clip_loss) normalizes the PPO and KL terms; the distill term is a mean over
    the distill_mask tokens of this call, or, given distill_num_tokens (the optimizer
    step's count of distillation tokens, as num_tokens is its count of reply tokens), a
    sum divided by it, so micro-batches add up.
    dual_clip: see ppo_clip_loss. entropy: [B, T] the policy's entropy at each reply
    position (differentiable), needed only when entropy_coef > 0; its term has the PPO
    term's normalizer (the authors' token-mean, verl dp_actor.py:564-568).
    is_weights: the off-policy correction (see ppo_clip_loss); it weights the PPO term only.
    """
    pg, stats = ppo_clip_loss(logp, logp_old, advantages, weights, mask, clip_eps, num_tokens, dual_clip, is_weights)
    loss = pg
    stats["pg_loss"] = pg.item()
    if entropy_coef:
        assert entropy is not None, "entropy_coef > 0 needs the policy's entropy"
        n = mask.sum().clamp_min(1) if num_tokens is None else num_tokens
        ent = masked_sum(entropy, mask) / n
        loss = loss - entropy_coef * ent
        stats["entropy"] = ent.item()
    if kl_coef:
        assert logp_ref is not None, "kl_coef > 0 needs the reference log-probs"
        # Same normalizer as the PPO term, so micro-batches add up to the batch mean.
        n = mask.sum().clamp_min(1) if num_tokens is None else num_tokens
        k3 = kl_k3(_zero_outside(logp, mask), _zero_outside(logp_ref.detach(), mask))
        kl = masked_sum(k3, mask) / n
        loss = loss + kl_coef * kl
        stats["kl_ref"] = kl.item()
    if distill_coef:
        assert logp_teacher is not None, "distill_coef > 0 needs the teacher log-probs"
        dmask = mask if distill_mask is None else distill_mask.bool() & mask.bool()
        k3 = kl_k3(_zero_outside(logp, dmask), _zero_outside(logp_teacher.detach(), dmask))
        distill = (
            masked_mean(k3, dmask) if distill_num_tokens is None else masked_sum(k3, dmask) / max(distill_num_tokens, 1)
        )
        loss = loss + distill_coef * distill
        stats["distill_kl"] = distill.item()
    stats["loss"] = loss.item()
    return loss, stats
