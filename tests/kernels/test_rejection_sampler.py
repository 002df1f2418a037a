"""The rejection-sampling kernel makes the same choices as its torch reference from the same random numbers:
equal outputs, exactly, for sampled and deterministic drafts, padded rows, vocabularies spanning several
tiles, empty residuals and ids outside the vocabulary."""
import pytest
import torch

from mini_engine.kernels import rejection_sampler
from mini_engine.speculative import rejection_sample_from_randoms as rejection_sampler_reference
from mini_engine.speculative import draw_randoms, num_drafts_of


def step(s, k, vocab, device, seed=0, close=True):
    """Target and draft distributions that often agree (close=True: q is p perturbed) so every outcome
    (accepted runs of each length, rejections, bonus tokens) shows up; drafts drawn from q."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(s, k + 1, vocab, generator=gen) * 2
    target = torch.softmax(logits, -1)
    draft = torch.softmax(logits[:, :k] + (0.5 if close else 3) * torch.randn(s, k, vocab, generator=gen), -1)
    drafts = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).view(s, k) if k else \
        torch.empty(s, 0, dtype=torch.long)
    uniforms, inv_exp = draw_randoms([k] * s, k, vocab, gen)
    return [t.to(device) for t in (target, drafts, draft, uniforms, inv_exp)]


def assert_kernel_matches(target, drafts, draft, uniforms, inv_exp):
    num_drafts = num_drafts_of(drafts)
    expected = rejection_sampler_reference(target, drafts, num_drafts, draft, uniforms, inv_exp)
    got = rejection_sampler(target, drafts, num_drafts, draft, uniforms, inv_exp)
    assert got.dtype == torch.int64 and got.shape == expected.shape
    assert torch.equal(got, expected), f"kernel\n{got}\nreference\n{expected}"
    return got


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("s, k, vocab", [(16, 4, 37), (8, 1, 10), (6, 3, 1500)])  # 1500: two tiles of 1024
def test_kernel_equals_reference(s, k, vocab, with_draft_probs, device):
    target, drafts, draft, uniforms, inv_exp = step(s, k, vocab, device)
    if not with_draft_probs:
        # A deterministic proposer guesses the target's argmax half of the time, something else otherwise.
        draft = None
        drafts[::2] = target[::2, :k].argmax(-1)
    out = assert_kernel_matches(target, drafts, draft, uniforms, inv_exp)
    lengths = (out >= 0).sum(1)
    assert lengths.min() >= 1 and (out[:, 0] < vocab).all()


def test_every_outcome_appears_and_matches(device):
    # Many sequences and a close draft: runs of 0..k accepted drafts all occur, each one checked.
    target, drafts, draft, uniforms, inv_exp = step(256, 3, 20, device, seed=1)
    out = assert_kernel_matches(target, drafts, draft, uniforms, inv_exp)
    assert set((out >= 0).sum(1).tolist()) == {1, 2, 3, 4}


def test_rows_padded_with_minus_one(device):
    target, drafts, draft, uniforms, inv_exp = step(5, 4, 33, device, seed=2)
    drafts[0, 2:] = -1
    drafts[1, :] = -1
    drafts[4, 3:] = -1
    out = assert_kernel_matches(target, drafts, draft, uniforms, inv_exp)
    assert (out[1, 1:] == -1).all(), "a row without drafts emits one token"
    assert_kernel_matches(target, drafts, None, uniforms, inv_exp)


def test_no_drafts_at_all(device):
    target, drafts, _, uniforms, inv_exp = step(4, 0, 12, device, seed=3)
    out = assert_kernel_matches(target, drafts, None, uniforms, inv_exp)
    assert out.shape == (4, 1) and (out >= 0).all()


def test_an_empty_residual_falls_back_to_p(device):
    # Draft token 0 has probability 0 under both p and q, and q = p elsewhere: it is rejected, and
    # max(0, p - q) is all zeros, so the token must come from p (both implementations, the same one).
    target, _, _, uniforms, inv_exp = step(3, 1, 8, device, seed=4)
    target[:, :, 0] = 0
    target = target / target.sum(-1, keepdim=True)
    draft = target[:, :1].clone()
    drafts = torch.zeros(3, 1, dtype=torch.long, device=device)
    out = assert_kernel_matches(target, drafts, draft, uniforms, inv_exp)
    assert (out[:, 0] != 0).all() and (out[:, 1] == -1).all()


def test_ids_outside_the_vocabulary_are_rejected_not_read(device):
    # rejection_sample validates ids on the host; the kernel must stay in bounds on a GPU without that check.
    target, drafts, draft, uniforms, inv_exp = step(4, 2, 16, device, seed=5)
    drafts[0, 0], drafts[1, 1], drafts[2, 0] = 16, 10**6, -7
    out = assert_kernel_matches(target, drafts, None, uniforms, inv_exp)
    assert ((out >= -1) & (out < 16)).all()


def test_greedy_rows_need_no_randomness(device):
    target, drafts, _, uniforms, inv_exp = step(10, 3, 25, device, seed=6)
    target = torch.zeros_like(target).scatter_(-1, target.argmax(-1, keepdim=True), 1.0)
    drafts[:5] = target[:5, :3].argmax(-1)
    first = assert_kernel_matches(target, drafts, None, uniforms, inv_exp)
    again = assert_kernel_matches(target, drafts, None, torch.rand_like(uniforms), 1 / torch.rand_like(inv_exp))
    assert torch.equal(first, again)
    assert (first[:5] == target[:5].argmax(-1)).all(), "argmax agreed on all drafts: all accepted plus the bonus"


def test_bad_inputs(device):
    target, drafts, draft, uniforms, inv_exp = step(2, 2, 8, device)
    num_drafts = num_drafts_of(drafts)
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sampler(target, drafts, num_drafts, draft, uniforms[:, :1], inv_exp)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sampler(target.double(), drafts, num_drafts, draft, uniforms, inv_exp)
    with pytest.raises(ValueError, match="num_drafts"):
        rejection_sampler(target, drafts, num_drafts.long(), draft, uniforms, inv_exp)
