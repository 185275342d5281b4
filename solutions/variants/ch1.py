"""Known-wrong answers to Chapter 1's exercises: each is the solution cell with one classic bug
edited in, and each must lose points to that bug."""
from flashbook.contract import Variant

_EXP = "    e = torch.exp(work - m)                                      # every exponent <= 0\n"
_SUM = "    total = e.sum(dim=-1, keepdim=True)\n"
_NORMALISE = "    p = torch.where(total > 0, e / total, torch.zeros_like(e))\n"

VARIANTS = (
    # ---------------------------------------------------------------- ch1_softmax
    Variant("softmax_without_max_subtraction", "ch1_softmax", (
        ("e = torch.exp(work - m)", "e = torch.exp(work)"),
    ), expect="large logits"),         # exp(1e4) = inf, inf / inf = NaN
    Variant("softmax_nan_on_fully_masked_rows", "ch1_softmax", (
        ("    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # all -inf row: avoid "
         "-inf - -inf\n", ""),
        (_NORMALISE, "    p = e / total\n"),
    ), expect="a row of only -inf"),   # visible case: -inf - (-inf) = NaN
    Variant("softmax_calls_the_library", "ch1_softmax", (
        (_EXP + _SUM + _NORMALISE, "    p = torch.nan_to_num(torch.softmax(work, dim=-1), nan=0.0)\n"),
    ), expect="written by hand"),    # visible: the library is off in every run
    Variant("softmax_over_the_wrong_axis", "ch1_softmax", (
        ("m = work.amax(dim=-1, keepdim=True)", "m = work.amax(dim=0, keepdim=True)"),
        ("total = e.sum(dim=-1, keepdim=True)", "total = e.sum(dim=0, keepdim=True)"),
    ), expect="random rows"),
    # -------------------------------------------------------------- ch1_attention
    Variant("attention_without_scale", "ch1_attention", (
        ("s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale",
         "s = torch.matmul(q.float(), k.float().transpose(-1, -2))"),
    ), expect="1/sqrt(d)"),
    Variant("attention_causal_aligned_top_left", "ch1_attention", (
        ("visible = fb.reference.causal_mask(q.shape[-2], k.shape[-2], device=q.device)",
         "visible = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()"),
    ), expect="aligned bottom-right"),   # differs only where N_q != N_k
    Variant("attention_lse_in_base_2", "ch1_attention", (
        ("    return o, lse\n", "    return o, lse / math.log(2)\n"),
    ), expect="natural log"),
    Variant("attention_computed_in_the_input_dtype", "ch1_attention", (
        ("s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale",
         "s = torch.matmul(q, k.transpose(-1, -2)) * scale"),
        ("o = torch.matmul(p, v.float()).to(q.dtype)", "o = torch.matmul(p, v)"),
    ), expect="float16"),              # hidden float16 cases: S rounded to fp16 before exp
    Variant("attention_nan_for_rows_without_keys", "ch1_attention", (
        ("    p = softmax(s)\n",
         "    p = torch.exp(s - s.amax(dim=-1, keepdim=True))\n    p = p / p.sum(dim=-1, keepdim=True)\n"),
    ), expect="NaN"),                  # visible causal case with N_q > N_k: rows that see no key
    # ---------------------------------------------------------------- ch1_traffic
    Variant("traffic_forgets_reading_p", "ch1_traffic", (
        ("elements = B * H * (4 * N * d + 4 * N * N)", "elements = B * H * (4 * N * d + 3 * N * N)"),
    ), expect="bytes ="),
    Variant("traffic_counts_one_matmul", "ch1_traffic", (
        ("flops = 4 * B * H * N * N * d", "flops = 2 * B * H * N * N * d"),
    ), expect="flops ="),
)
