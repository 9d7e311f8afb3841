"""The training loss: next-token cross-entropy over the labelled tokens, the answer tokens of
synthetic examples weighing ``data.answer_weight`` against the other labelled tokens; and, with
``data.kl_weight``, the KL divergence from a frozen teacher's next-token distributions
(``kl_to_teacher``: self-distillation from the model the run started from).

One weight formula (``loss_weights``) serves both users: the fine-tune's ``weighted_loss`` and the
eviction heads' fit (nosa.train.distill, through ``row_weights``), which weighs each row's
attention as the loss weighs that row's prediction. Rows come from nosa.train.data: labels -100
(``IGNORE``) where no loss is taken, ``answers`` True on answer tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nosa.train.data import IGNORE


def loss_weights(labels: torch.Tensor, answers: torch.Tensor, answer_weight: float) -> torch.Tensor:
    """The loss weight of predicting token i + 1 from position i: labels, answers [..., L] ->
    [..., L - 1] float; 0 where the token carries no label, ``answer_weight`` for an answer token,
    1 otherwise (1 everywhere labelled gives the plain mean)."""
    target, answer = torch.as_tensor(labels)[..., 1:], torch.as_tensor(answers)[..., 1:].float()
    return (target != IGNORE).float() * (1 + (answer_weight - 1) * answer)


def row_weights(labels: torch.Tensor, answers: torch.Tensor, answer_weight: float) -> torch.Tensor:
    """``loss_weights`` indexed by the predicting row: labels, answers [L] -> [L] float, row t
    weighing the prediction of token t + 1; the last row is 0 (it predicts nothing)."""
    weight = loss_weights(labels, answers, answer_weight)
    return torch.cat([weight, weight.new_zeros(1)])


def weighted_loss(
    logits: torch.Tensor, labels: torch.Tensor, answers: torch.Tensor, answer_weight: float = 1.0
) -> torch.Tensor:
    """The weighted mean of the next-token cross-entropy (``loss_weights``; at ``answer_weight``
    1 the plain mean, what transformers' ``labels=`` loss computes), a scalar.
    logits [b, L, V]; labels [b, L] (-100: no loss); answers [b, L] bool."""
    ce = F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="none"
    )
    weight = loss_weights(labels, answers, answer_weight)
    return (ce * weight.flatten()).sum() / weight.sum().clamp(min=1)


def kl_to_teacher(logits: torch.Tensor, teacher_logits: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """KL(teacher || model) of the next-token distributions, summed over the vocabulary and averaged
    over every position, a scalar. logits, teacher_logits [b, L, V]; computed ``chunk`` positions at
    a time in float32 (a [L, V] float32 softmax of a 49K vocabulary is 400 MB at 2K tokens)."""
    if logits.shape != teacher_logits.shape:
        raise ValueError(f"kl_to_teacher: logits {tuple(logits.shape)} vs teacher {tuple(teacher_logits.shape)}")
    flat, teacher = logits.flatten(0, 1), teacher_logits.detach().flatten(0, 1)
    total = logits.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk):
        student = F.log_softmax(flat[start : start + chunk].float(), dim=-1)
        target = F.log_softmax(teacher[start : start + chunk].float(), dim=-1)
        total = total + F.kl_div(student, target, log_target=True, reduction="sum")
    return total / flat.shape[0]
