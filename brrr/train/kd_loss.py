"""Token-level distillation losses between a student's and a teacher's next-token distributions, both softened by
a temperature T: p = softmax(teacher / T), q = softmax(student / T), each summed over the vocabulary per token.

  forward KL(p || q) = sum_v p_v (log p_v - log q_v)   mode-covering: the student spreads mass wherever the teacher
                                                       has any (Hinton et al.'s distillation; GKD's beta = 0)
  reverse KL(q || p) = sum_v q_v (log q_v - log p_v)   mode-seeking: the student puts its mass where the teacher's
                                                       is highest (MiniLLM's objective, here token-level on the
                                                       data's prefixes rather than on the student's own samples)

Both are multiplied by T^2 so their gradients keep their scale as T changes (Hinton et al.). With top_k, only the
teacher's k most likely tokens of each position count (what a cache of teacher logits stores): p renormalised over
them, and q too for the reverse direction, each taken at those tokens from the student's full softmax."""
from __future__ import annotations

import torch
import torch.nn.functional as F

KINDS = ("forward", "reverse")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "forward",
            temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """[tokens] per-token T^2 * KL in fp32; logits [tokens, vocab] (the teacher's without gradients)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = teacher_logits.float() / temperature
    if top_k:
        t, idx = t.topk(min(top_k, t.shape[-1]), dim=-1)
        log_q = log_q.gather(-1, idx)
        if kind == "reverse":
            log_q = log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)
    log_p = F.log_softmax(t, dim=-1)
    if kind == "forward":
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:
        kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    return kl * temperature ** 2
