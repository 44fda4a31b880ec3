"""The batched sampler against plain per-row reference implementations."""
import pytest
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


# ---------------------------------------------------------------- the one-kernel path
# (Triton's CPU interpreter without a GPU; tests/kernels/test_triton_sampling.py checks the
# kernel against its reference in depth.)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def filtered_meta(temperature, top_k, top_p, min_p, seeds=None):
    """Metadata as the runner builds it for the kernel: all three filters, on the device."""
    dev = lambda t: t.to(DEVICE)
    md = meta(len(temperature), top_k=dev(top_k), top_p=dev(top_p), min_p=dev(min_p))
    md.temperature, md.all_greedy = dev(temperature), bool((temperature == 0).all())
    md.seeds = None if seeds is None else dev(seeds)
    return md


def test_kernel_keeps_what_the_torch_path_keeps():
    """On logits without ties, the kernel's kept set (its threshold, and min-p) is the torch
    path's (apply_top_k_top_p_min_p) on every row where no float rounding can move a boundary
    (the float64 reference gives one set for top_p and min_p moved by 1e-5)."""
    from pagoda.kernels import reference
    from pagoda.kernels.triton_sampling import sample_triton
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(8, 2000, generator=g) * 3
    assert all(len(row.unique()) == 2000 for row in logits)
    temp = torch.tensor([1.0, 0.7, 1.3, 0.9, 1.0, 0.5, 1.1, 0.8])
    top_k = torch.tensor([0, 40, 0, 1, 200, 0, 15, 2000])
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.95, 1.0, 0.7, 0.99])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.01, 0.2, 0.05, 0.0])
    thresholds = torch.empty(8, device=DEVICE)
    md = filtered_meta(temp, top_k, top_p, min_p)
    sample_triton(logits.to(DEVICE), md.temperature, torch.arange(8, device=DEVICE), md.top_k, md.top_p, md.min_p,
                  thresholds)
    probs = (logits.double() / temp[:, None].double()).softmax(-1)
    kernel_kept = ((reference.float_key(logits) >= reference.float_key(thresholds.cpu())[:, None])
                   & (probs >= probs.amax(-1, keepdim=True) * min_p[:, None]))
    torch_md = meta(8, top_k=top_k, top_p=top_p, min_p=min_p)
    torch_kept = apply_top_k_top_p_min_p(logits / temp[:, None], torch_md) > float("-inf")
    slack = 1e-5
    sure = (reference.sampling_mask(logits, temp, top_k, top_p * (1 - slack), min_p * (1 + slack))
            == reference.sampling_mask(logits, temp, top_k, (top_p * (1 + slack)).clamp(max=1), min_p * (1 - slack)))
    sure = sure.all(-1)
    assert sure.sum() >= 7
    assert torch.equal(kernel_kept[sure], torch_kept[sure])
    assert kernel_kept.sum(-1)[3] == 1 and kernel_kept.sum(-1)[1] == 40


def test_sample_with_seeds_takes_the_kernel(monkeypatch):
    """sample() hands a batch with top-k / top-p / min-p to the kernel when the runner gave it
    seeds: the kernel's tokens, drawn from the torch path's kept sets, argmax for greedy rows."""
    from pagoda.kernels import triton_sampling
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 2000, generator=g) * 3).to(DEVICE)
    md = filtered_meta(torch.tensor([0.8, 0.0, 1.0, 0.6, 1.2]), torch.tensor([0, 5, 30, 0, 0]),
                       torch.tensor([0.9, 0.9, 0.8, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0]),
                       seeds=torch.tensor([11, 12, 13, 14, 15]))
    calls = []
    real = triton_sampling.sample_triton
    monkeypatch.setattr(triton_sampling, "sample_triton", lambda *a: calls.append(a) or real(*a))
    tokens = sample(logits, md).token_ids
    assert len(calls) == 1 and calls[0][4] is md.top_p and calls[0][3] is md.top_k and calls[0][5] is md.min_p
    assert torch.equal(tokens, real(logits, md.temperature, md.seeds, md.top_k, md.top_p, md.min_p))
    torch_kept = apply_top_k_top_p_min_p(logits / md.temperature.clamp(min=1e-6)[:, None], md) > float("-inf")
    assert torch_kept.gather(1, tokens[:, None]).all()
    assert tokens[1] == logits[1].argmax()


def test_engine_sends_filtered_batches_to_the_kernel(tmp_path, monkeypatch):
    """With the one-kernel sampler on (as on CUDA; here in the interpreter, on a tiny dummy
    model), batches with top-k / top-p / min-p take it with their filters; a seeded request
    gives the same tokens alone and in a batch; a request asking logprobs keeps its batch on
    the torch path."""
    import json

    from pagoda import LLM, SamplingParams
    from pagoda.kernels import triton_sampling
    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
               eos_token_id=2, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    runner = llm.llm_engine.executor.runner
    runner.one_kernel_sampler = True
    steps = runner.num_sampling_steps
    calls = []
    real = triton_sampling.sample_triton
    monkeypatch.setattr(triton_sampling, "sample_triton", lambda *a: calls.append(a) or real(*a))

    def run(prompts, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=7, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    alone = run([prompt], [seeded])[0]
    mixed = run([{"prompt_token_ids": [9, 10]}, prompt, {"prompt_token_ids": [11]}],
                [SamplingParams(temperature=1.0, min_p=0.1, max_tokens=3, ignore_eos=True), seeded,
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert mixed[1] == alone and len(calls) == runner.num_sampling_steps - steps >= 8
    assert all(c[3] is not None and c[4] is not None and c[5] is not None for c in calls)
    before = len(calls)
    run([prompt], [SamplingParams(top_p=0.9, logprobs=2, max_tokens=2)])
    assert len(calls) == before
    # allowed_token_ids and bad words (as token ids: no tokenizer here) keep theirs on it too
    assert set(run([prompt], [SamplingParams(temperature=1.0, allowed_token_ids=[40, 41], max_tokens=3)])[0]) <= {40, 41}
    assert len(calls) == before
    with pytest.raises(ValueError, match="bad_words need the tokenizer"):
        run([prompt], [SamplingParams(bad_words=["x"])])
