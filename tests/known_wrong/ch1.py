"""Known-wrong answers to Chapter 1's exercises; each must lose points.

Each variant replaces the source of one solution cell (named by its grade_id).
"""

VARIANTS = {
    "softmax_without_max_subtraction": {"grade_id": "ch1_softmax", "source": '''
def softmax(x):
    e = torch.exp(x.double())
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)
'''},
    "softmax_nan_on_fully_masked_rows": {"grade_id": "ch1_softmax", "source": '''
def softmax(x):
    w = x.float() if x.dtype == torch.float16 else x
    e = torch.exp(w - w.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)
'''},
    "softmax_calls_the_library": {"grade_id": "ch1_softmax", "source": '''
def softmax(x):
    w = x.float() if x.dtype == torch.float16 else x
    p = torch.softmax(w, dim=-1)
    return torch.nan_to_num(p, nan=0.0).to(x.dtype)
'''},
    "softmax_over_the_wrong_axis": {"grade_id": "ch1_softmax", "source": '''
def softmax(x):
    w = x.float() if x.dtype == torch.float16 else x
    m = w.amax(0, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(w - m)
    s = e.sum(0, keepdim=True)
    return torch.where(s > 0, e / s, torch.zeros_like(e)).to(x.dtype)
'''},
    "attention_without_scale": {"grade_id": "ch1_attention", "source": '''
def naive_attention(q, k, v, scale=None, causal=False):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2))
    if causal:
        s = s.masked_fill(~fb.reference.causal_mask(q.shape[-2], k.shape[-2]), float("-inf"))
    return torch.matmul(softmax(s), v.float()).to(q.dtype), torch.logsumexp(s, -1)
'''},
    "attention_causal_aligned_top_left": {"grade_id": "ch1_attention", "source": '''
def naive_attention(q, k, v, scale=None, causal=False):
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        top_left = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~top_left, float("-inf"))
    return torch.matmul(softmax(s), v.float()).to(q.dtype), torch.logsumexp(s, -1)
'''},
    "attention_lse_in_base_2": {"grade_id": "ch1_attention", "source": '''
def naive_attention(q, k, v, scale=None, causal=False):
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~fb.reference.causal_mask(q.shape[-2], k.shape[-2]), float("-inf"))
    return torch.matmul(softmax(s), v.float()).to(q.dtype), torch.logsumexp(s, -1) / math.log(2)
'''},
    "attention_computed_in_the_input_dtype": {"grade_id": "ch1_attention", "source": '''
def naive_attention(q, k, v, scale=None, causal=False):
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~fb.reference.causal_mask(q.shape[-2], k.shape[-2]), float("-inf"))
    return torch.matmul(softmax(s), v), torch.logsumexp(s.float(), -1)
'''},
    "attention_nan_for_rows_without_keys": {"grade_id": "ch1_attention", "source": '''
def naive_attention(q, k, v, scale=None, causal=False):
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~fb.reference.causal_mask(q.shape[-2], k.shape[-2]), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    p = e / e.sum(-1, keepdim=True)
    return torch.matmul(p, v.float()).to(q.dtype), torch.logsumexp(s, -1)
'''},
    "traffic_forgets_reading_p": {"grade_id": "ch1_traffic", "source": '''
def naive_traffic(B, H, N, d, bytes_per_element):
    return {"flops": 4 * B * H * N * N * d,
            "bytes": B * H * (4 * N * d + 3 * N * N) * bytes_per_element}
'''},
    "traffic_counts_one_matmul": {"grade_id": "ch1_traffic", "source": '''
def naive_traffic(B, H, N, d, bytes_per_element):
    return {"flops": 2 * B * H * N * N * d,
            "bytes": B * H * (4 * N * d + 4 * N * N) * bytes_per_element}
'''},
}
