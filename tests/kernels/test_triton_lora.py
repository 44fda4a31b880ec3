"""LoRA's masked second matmul (pagoda.kernels.triton_lora) against its torch version
(reference.lora_expand), and an adapted layer's whole term against the plain product of each
token's own adapter. Without a CUDA device the kernel runs in Triton's CPU interpreter (fp32,
fp16); with one compiled, bf16 too. Fresh random inputs; tokens of no adapter, of every slot,
ragged token counts, slots of one to three slices. Bounds as in test_triton_ops.py."""
import pytest
import torch

from pagoda.kernels import reference, triton_lora
from tests.kernels.test_triton_ops import DEVICE, DTYPES, ON_GPU, TOLERANCE, matrix, seed_for

CASES = matrix([1, 5, 40] + ([300] if ON_GPU else []),          # tokens
               [(1, 8), (2, 48), (4, 32)],                      # slots, width (slices x rank)
               [96, 200],                                        # output features
               DTYPES, cpu=lambda t, sw, n, dtype: t < 40 or dtype == torch.float32)


def inputs(tokens, slots, width, n, dtype, g):
    k = slots * width
    xa = torch.randn(tokens, k, generator=g).to(DEVICE, dtype)
    b = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    token_slots = torch.randint(-1, slots, (tokens,), generator=g, dtype=torch.int32).to(DEVICE)
    out = torch.randn(tokens, n, generator=g).to(DEVICE, dtype)
    return xa, b, token_slots, out


@pytest.mark.parametrize("tokens,slots_width,n,dtype", CASES)
def test_lora_expand_matches_reference(tokens, slots_width, n, dtype, request):
    slots, width = slots_width
    xa, b, token_slots, out = inputs(tokens, slots, width, n, dtype, seed_for(request))
    want = reference.lora_expand(xa, b, token_slots, width, out.clone())
    got = triton_lora.lora_expand(xa, b, token_slots, width, out)
    assert got is out
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < TOLERANCE[dtype], err
    # a token of no slot gets nothing added
    none = token_slots == -1
    if none.any():
        torch.testing.assert_close(want[none], reference.lora_expand(xa, b, token_slots, width, want.clone())[none])


def test_adapted_layer_is_each_tokens_own_adapter(request):
    """The layer's masked two-matmul form (lora/layers.py) equals x @ A_s.T @ B_s.T for each
    token's own slot s, slices included (B block diagonal), on this device's path."""
    from pagoda.lora.layers import LoRALinear
    from pagoda.model.layers.linear import QKVParallelLinear
    g = seed_for(request)
    slots, rank, in_f, outs = 3, 4, 24, [16, 8, 8]          # q/k/v: 2 heads of 8, one KV head
    layer = QKVParallelLinear(in_f, 8, 2, 1)
    token_slots = torch.tensor([2, -1, 0, 1, 2, 0, -1], dtype=torch.int32, device=DEVICE)
    lora = LoRALinear(layer, ("q", "k", "v"), slots, rank, token_slots, torch.float32, row_parallel=False)
    adapters = []
    for s in range(slots):
        r = rank if s else 2                                  # a slot of a smaller rank
        slices = [(torch.randn(r, in_f, generator=g), torch.randn(o, r, generator=g)) for o in outs]
        slices[1] = None if s == 1 else slices[1]             # an adapter without k
        lora.set_slot(layer, s, slices)
        adapters.append(slices)
    x = torch.randn(len(token_slots), in_f, generator=g).to(DEVICE)
    base = torch.randn(len(token_slots), sum(outs), generator=g).to(DEVICE)
    got = lora.apply(x, base.clone())
    want = base.clone().cpu()
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        terms = [torch.zeros(o) if ab is None else x[t].cpu() @ ab[0].T @ ab[1].T for ab, o in zip(adapters[s], outs)]
        want[t] += torch.cat(terms)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
