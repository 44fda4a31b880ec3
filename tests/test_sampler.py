"""The batched sampler against plain per-row reference implementations."""
import torch

from pagoda.runner.sampler import SamplingMetadata, apply_penalties, apply_top_k_top_p_min_p, draw, sample


def meta(b, temperature=1.0, **kw):
    return SamplingMetadata(temperature=torch.full((b,), temperature), all_greedy=temperature == 0,
                            top_k=kw.pop("top_k", None), top_p=kw.pop("top_p", None),
                            min_p=kw.pop("min_p", None), generators=kw.pop("generators", {}), **kw)


def kept(logits):
    return [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]


def test_top_k_top_p_min_p_match_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    top_k = torch.tensor([0, 1, 5, 0, 3, 50])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3, 1.0, 0.95])
    out = apply_top_k_top_p_min_p(logits, meta(6, top_k=top_k, top_p=top_p))
    for i, row in enumerate(logits):
        order = row.argsort(descending=True).tolist()
        k = top_k[i].item() or 50
        cand = order[:k]
        probs = row[cand].softmax(-1)
        keep, mass = [], 0.0
        for t, pr in zip(cand, probs.tolist()):
            if mass >= top_p[i].item():
                break
            keep.append(t)
            mass += pr
        assert kept(out)[i] == set(keep), i
    min_p = torch.tensor([0.0, 0.1, 0.5, 0.9, 0.01, 1.0])
    out = apply_top_k_top_p_min_p(logits, meta(6, min_p=min_p))
    for i, row in enumerate(logits):
        p = row.softmax(-1)
        assert kept(out)[i] == set(torch.nonzero(p >= p.max() * min_p[i]).flatten().tolist())


def test_penalties_match_reference():
    g = torch.Generator().manual_seed(1)
    b, v = 3, 20
    logits = torch.randn(b, v, generator=g)
    counts = torch.randint(0, 3, (b, v), generator=g).float()
    prompt_mask = torch.rand(b, v, generator=g) > 0.7
    md = meta(b, presence_penalty=torch.tensor([0.5, 0.0, -1.0]), frequency_penalty=torch.tensor([0.2, 1.0, 0.0]),
              repetition_penalty=torch.tensor([1.3, 1.0, 0.8]), output_counts=counts, prompt_mask=prompt_mask)
    out = apply_penalties(logits, md)
    for i in range(b):
        for t in range(v):
            x = logits[i, t].item()
            rp = md.repetition_penalty[i].item()
            if prompt_mask[i, t] or counts[i, t] > 0:
                x = x / rp if x > 0 else x * rp
            x -= md.frequency_penalty[i].item() * counts[i, t].item()
            x -= md.presence_penalty[i].item() * float(counts[i, t] > 0)
            assert abs(out[i, t].item() - x) < 1e-5


def test_draw_follows_the_distribution_and_never_picks_masked_tokens():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.2])
    n = 20000
    torch.manual_seed(0)
    tokens = draw(probs.expand(n, -1).contiguous(), {})
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert freq[1] == 0 and freq[3] == 0
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(2)
    probs = torch.rand(8, 100, generator=g).softmax(-1)
    alone = draw(probs[3:4], {0: torch.Generator().manual_seed(42)})
    torch.manual_seed(123)
    batched = draw(probs, {3: torch.Generator().manual_seed(42), 5: torch.Generator().manual_seed(7)})
    assert batched[3] == alone[0]


def test_greedy_rows_and_logprob_ranks():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=g)
    md = meta(4)
    md.temperature = torch.tensor([0.0, 1.0, 0.0, 0.7])
    md.all_greedy = False
    md.max_num_logprobs = 3
    out = sample(logits, md)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    lp = logits.log_softmax(-1)
    for i in range(4):
        t = out.token_ids[i]
        assert torch.isclose(out.logprobs[i], lp[i, t])
        assert out.ranks[i] == (lp[i] > lp[i, t]).sum() + 1
        assert out.topk_ids[i].tolist() == lp[i].topk(3).indices.tolist()


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(2, 5)
    logits[:, 2] = 10.0
    md = meta(2, temperature=0.0, banned=(torch.tensor([0, 1]), torch.tensor([2, 2])))
    assert 2 not in sample(logits, md).token_ids.tolist()


def test_no_greedy_row_skips_the_argmax_and_draws_the_same():
    """any_greedy=False only skips the argmax: the same seeded draws as with it."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=g)
    outs = []
    for any_greedy in (True, False):
        md = meta(3, temperature=0.8, generators={i: torch.Generator().manual_seed(i) for i in range(3)})
        md.any_greedy = any_greedy
        outs.append(sample(logits, md).token_ids.tolist())
    assert outs[0] == outs[1]
