"""The training loss (nosa.train.loss): next-token cross-entropy with answer tokens weighed, and
the per-row weights the eviction heads' fit takes from it, against plain torch cross-entropy."""

import pytest
import torch

from nosa.train.loss import row_weights, weighted_loss


def test_weighted_loss_is_the_plain_mean_at_weight_one_and_weighs_answers():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 10)
    labels = torch.randint(0, 10, (2, 6))
    labels[0, 2] = -100
    answers = torch.zeros(2, 6, dtype=torch.bool)
    answers[1, 4] = True
    plain = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(weighted_loss(logits, labels, answers, 1.0), plain)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                                           reduction="none").reshape(2, 5)
    w = (labels[:, 1:] != -100).float()
    w[1, 3] = 5.0  # answers[1, 4] is predicted at position 3
    torch.testing.assert_close(weighted_loss(logits, labels, answers, 5.0), (ce * w).sum() / w.sum())


def test_row_weights_are_the_loss_weights():
    """row t's weight is what weighted_loss gives the prediction of token t + 1."""
    torch.manual_seed(1)
    logits = torch.randn(1, 12, 10)
    labels = torch.randint(0, 10, (1, 12))
    labels[0, [0, 3, 7]] = -100
    answers = torch.zeros(1, 12, dtype=torch.bool)
    answers[0, [5, 9]] = True
    w = row_weights(labels[0], answers[0], 6.0)
    assert w.shape == (12,) and w[-1] == 0 and w[2] == 0 and w[4] == 6 and w[8] == 6 and w[1] == 1
    ce = torch.nn.functional.cross_entropy(logits[0], torch.cat([labels[0, 1:], labels[0, :1]]), reduction="none",
                                           ignore_index=-100)
    torch.testing.assert_close(weighted_loss(logits, labels, answers, 6.0), (ce * w).sum() / w.sum())


def test_kl_to_teacher_is_the_mean_kl_per_position_and_trains_only_the_student():
    from nosa.train.loss import kl_to_teacher

    torch.manual_seed(0)
    student = torch.randn(2, 5, 11, requires_grad=True)
    teacher = torch.randn(2, 5, 11)
    p = teacher.softmax(-1)
    expected = (p * (p.log() - student.log_softmax(-1))).sum(-1).mean()
    got = kl_to_teacher(student, teacher, chunk=3)  # chunks that straddle the rows
    assert torch.allclose(got, expected, atol=1e-6)
    assert torch.allclose(kl_to_teacher(student, teacher, chunk=100), expected, atol=1e-6)
    assert float(kl_to_teacher(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)
    got.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="kl_to_teacher: logits"):
        kl_to_teacher(student, teacher[:, :4])
