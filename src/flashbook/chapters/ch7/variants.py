"""Known-wrong answers to Chapter 7's exercises: each is a solution cell with one classic bug
edited in, and each must lose points to that bug (its ``expect`` text is in the failure)."""
from flashbook.contract import Variant

VARIANTS = (
    # ----------------------------------------------------------------- ch7_tmem_plan
    # O placed right after S0, on top of S1 (and of P1 and stats1, which alias S1)
    Variant('tmem_o_overlaps_s', 'ch7_tmem_plan', (
        ('plan[f"O{i}"] = (2 * s + i * head_dim, head_dim)',
         'plan[f"O{i}"] = (s + i * head_dim, head_dim)'),
    ), expect='overlap: S1'),
    # P given columns of its own after the O tiles instead of aliasing S: 640 columns at d=128
    Variant('tmem_p_not_aliased', 'ch7_tmem_plan', (
        ('plan[f"P{i}"] = (i * s + 32, p)',
         'plan[f"P{i}"] = (2 * s + 2 * head_dim + i * p, p)'),
    ), expect='overflow: P0'),
    # P packed right after the two statistics columns: off the 32-column granule
    Variant('tmem_p_misaligned', 'ch7_tmem_plan', (
        ('plan[f"P{i}"] = (i * s + 32, p)', 'plan[f"P{i}"] = (i * s + 2, p)'),
    ), expect='misaligned: P0'),
    # the allocation sized to the buffers (384 at d=64), not rounded up to a power of two
    Variant('tmem_alloc_not_power_of_two', 'ch7_tmem_plan', (
        ('    alloc = 32\n', '    alloc = need\n'),
    ), expect='not a power of two'),

    # ----------------------------------------------------------------- ch7_lazy_update
    # the test inverted: the first tile never sets a reference, every exponential is 2^inf
    Variant('lazy_test_inverted', 'ch7_lazy_update', (
        ('rescale = grow > tau', 'rescale = grow < tau'),
    ), expect='overflowed'),
    # "lazy" that rescales on every step: exact, but nothing avoided
    Variant('lazy_rescales_every_tile', 'ch7_lazy_update', (
        ('rescale = grow > tau', 'rescale = grow >= 0.0'),
    ), expect='rescaled on every tile'),
    # skips the multiplication but still moves the max: acc and l mix two references
    Variant('lazy_skip_still_moves_max', 'ch7_lazy_update', (
        ('    p = EXP2(s * qk_scale - m_i[:, None])',
         '    m_i = m_new\n    p = EXP2(s * qk_scale - m_i[:, None])'),
    ), expect='output O'),
    # the threshold in natural-log units while m is in base 2: rescales too often
    Variant('lazy_threshold_natural_log', 'ch7_lazy_update', (
        ('tau = math.log2(max_growth)', 'tau = math.log(max_growth)'),
    ), expect='natural-log units'),

    # ----------------------------------------------------------------- ch7_exp2_poly
    # no range reduction: one cubic asked to follow 2^x from -126 to 0
    Variant('exp2_no_range_reduction', 'ch7_exp2_poly', (
        ('n = torch.round(x)', 'n = torch.zeros_like(x)'),
    ), expect='grows with |x|'),
    # floor(x) puts f in [0, 1), but the coefficients were fitted on [-1/2, 1/2]
    Variant('exp2_floor_with_round_fit', 'ch7_exp2_poly', (
        ('n = torch.round(x)', 'n = torch.floor(x)'),
    ), expect='outside the interval'),
    # a quadratic: 1.7e-3, seventeen times the bound
    Variant('exp2_degree_too_low', 'ch7_exp2_poly', (
        ('coeffs = ch7.fit_exp2(3)', 'coeffs = ch7.fit_exp2(2)'),
    ), expect='raise the degree'),

    # ----------------------------------------------------------------- ch7_exp2_poly_tl
    # the exponent bias off by one: every result half of 2^x
    Variant('exp2_tl_bias_off_by_one', 'ch7_exp2_poly_tl', (
        ('+ 127) << 23)', '+ 126) << 23)'),
    ), expect='factor of two'),
    # no clamp: -inf (a masked score) turns into garbage
    Variant('exp2_tl_no_clamp', 'ch7_exp2_poly_tl', (
        ('    x = tl.maximum(x, -126.0)\n', ''),
    ), expect='clamp x at -126'),
    # floor instead of round with the [-1/2, 1/2] coefficients
    Variant('exp2_tl_floor_with_round_fit', 'ch7_exp2_poly_tl', (
        ('n = tl.floor(x + 0.5)', 'n = tl.floor(x)'),
    ), expect='outside the interval'),
)
