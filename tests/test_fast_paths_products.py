"""The fast linear products (one row without oneDNN, weights laid out once for oneDNN, the few-row and widened bf16
kernels, int4 with 16-bit fixed-point activations, int8) and their tile copies compute the same thing as the general
products they short-cut, and a decode loop makes each weight's copy once."""

from __future__ import annotations

import pytest
import torch

from tiny_models import build
from waferline import kernels


def test_one_row_16bit_linear_skips_onednn_and_restores_the_flag():
    from waferline.model.layers import linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(1, 64, generator=g).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert torch._C._get_mkldnn_enabled()
    out = linear(x, w, b)
    assert torch._C._get_mkldnn_enabled()  # switched back on
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError):
        linear(torch.randn(1, 63).bfloat16(), w)  # a shape error inside still restores the flag
    assert torch._C._get_mkldnn_enabled()
    many = linear(torch.cat([x, x]), w, b)  # two rows: the usual path, same numbers as one row
    torch.testing.assert_close(many[0].float(), out[0].float(), rtol=1e-2, atol=1e-2)


def test_packed_linear_is_the_same_product_and_follows_weight_changes():
    """16-bit products of more rows than the few-row kernel takes run oneDNN on a weight laid out once: bitwise what
    F.linear gives, re-laid out when the weight changes in place. A CPU without oneDNN's bf16 kernels (AVX2 only)
    keeps no copy and runs the few-row kernel (5-8 rows) or the widened fp32 product (more)."""
    from waferline.model.layers import FEW_ROWS, Linear, packed_linear, prepack_supported

    g = torch.Generator().manual_seed(0)
    lin = Linear(64, 48, bias=True, dtype=torch.bfloat16)
    lin.weight.copy_(torch.randn(48, 64, generator=g))
    lin.bias.copy_(torch.randn(48, generator=g))
    native = prepack_supported(torch.bfloat16)

    def check(x):
        y = lin(x)
        if native:  # oneDNN's kernel on the laid-out copy: bitwise F.linear
            assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
        else:  # the few-row kernel (5-8 rows) or the fp32 product (more): the exact products' fp32 sums, rounded
            ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
            torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
        return y

    for shape in ((FEW_ROWS + 2, 64), (2, 5, 64)):
        check(torch.randn(shape, generator=g).to(torch.bfloat16))
    assert (0 in lin._packs) == native  # the many-row calls made the copy, where the CPU has the kernels
    x = torch.randn(FEW_ROWS + 1, 64, generator=g).to(torch.bfloat16)
    before = lin(x)
    lin.weight.mul_(1.5)  # an in-place change: the copy must follow
    after = check(x)
    assert not torch.equal(before, after)
    packs: dict = {}
    w32 = torch.randn(48, 64, generator=g)
    torch.testing.assert_close(packed_linear(x.float(), w32, None, packs, 0), x.float() @ w32.T)
    assert not packs  # fp32 weights are not re-laid out


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
def test_widened_bf16_product_is_one_operator_with_the_fp32_result():
    """waferline::linear_wide (what linear() runs for many-row 16-bit products where oneDNN has no bf16 GEMM):
    bitwise the fp32 product of the widened operands rounded once, with and without a bias, for 2-D and 3-D x; the
    twin's op counter records it as one bf16 product with its 16-bit weight's bytes."""
    from waferline.sim.calibrate.opcount import OpCounter

    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 72, generator=g).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    for shape in ((20, 72), (2, 9, 72)):
        x = torch.randn(shape, generator=g).to(torch.bfloat16)
        for bias in (None, b):
            ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).bfloat16()
            assert torch.equal(torch.ops.waferline.linear_wide(x, w, bias), ref)
    x = torch.ones(20, 72, dtype=torch.bfloat16)
    with OpCounter() as c:
        torch.ops.waferline.linear_wide(x, w, None)
    work = {k: v for d in c.work.values() for k, v in d.items()}
    assert c.total == 1 and work == {f"call|bf16|20|{40 * 72 * 2}": 1.0}


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
def _fixed_point(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [R, K] as the integer-activation kernels hold it: per row and group of ``group`` inputs, the nearest multiple
    of max|x| / 32767 (the last group may be shorter)."""
    xf = x.float()
    out = torch.empty_like(xf)
    for k0 in range(0, xf.shape[1], group):
        blk = xf[:, k0:k0 + group]
        mx = blk.abs().amax(1, keepdim=True)
        inv = torch.where(mx > 0, torch.tensor(32767.0) / mx, torch.zeros_like(mx))
        out[:, k0:k0 + group] = torch.round(blk * inv).clamp(-32767, 32767) * (mx / 32767.0)
    return out


_INT_KERNELS = kernels.available() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.skipif(not _INT_KERNELS, reason="the integer-activation kernels are AVX2 code")
@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("G,K,Z", [(64, 256, 2), (128, 384, 1), (256, 512, 2)])
def test_int4_linear_int16_activations(G, K, Z, tiles):
    """16-bit x through an int4 weight with G % 64 == 0 runs the integer kernel: x as 16-bit fixed point per row and
    group, exact integer sums. Against the fp32 product of the dequantized weight with x so held (``_fixed_point``):
    float rounding only, and bf16's at the output, at every row count (1-4 rows per pass; 5-16 in passes of 4, which
    must not change a row's result). Against the product with x itself: within the fixed point's bound, the sum over
    groups of max|x_g| / 65534 * sum |w| over the group. Rows that are all zero, and groups with one large x, too.
    ``tiles``: through the weight's tile copy (CPUs with AVX512-VNNI: one is made; elsewhere the row kernel runs),
    else the row kernel (up to 8 rows per pass through the tiles, up to 4 through the rows). Through a tile copy any
    number of rows takes the kernel (a prefill's: 17, 40, and 140 in passes of 128), each row's result still its own."""
    op = torch.ops.waferline
    prev = op.use_int_tiles(tiles)
    try:
        made = op.int4_tile_copies()[1]
        _int16_activations(G, K, Z, many=tiles and _VNNI)
        assert (op.int4_tile_copies()[1] > made) == (tiles and _VNNI)
    finally:
        op.use_int_tiles(prev)


_VNNI = _INT_KERNELS and {"avx512_vnni", "avx512bw", "avx512vl"} <= set(kernels._cpu_flags().split())


def _lane_input(j: int) -> int:
    """cpu_ops.cpp's i16_lane_input: which input (0..63) of a 64-input block lane j of the kernels' order holds."""
    def lo_k(b: int) -> int:
        u, p = (b // 8) % 2, b % 8 + 8 * (b // 16)
        return 8 * (2 * u + p % 2) + p // 2
    v, i = j // 16, j % 16
    return (32 if v >= 2 else 0) + lo_k((i if i < 8 else i + 8) + (8 if v % 2 else 0))


@pytest.mark.skipif(not _INT_KERNELS, reason="the integer-activation kernels are AVX2 code")
@pytest.mark.parametrize("G,K", [(64, 192), (128, 768), (256, 512)])
def test_i16_rows_quantizer(G, K):
    """waferline::i16_rows, how the integer-activation kernels hold a product's input rows: per row and group of G,
    xi = round(x * 32767 / max|x|) (to nearest even) clamped to +-32767, in the kernels' lane order per 64 inputs,
    sx = max|x| / 32767 and xs = sx * sum xi, all in fp32 as the C++ computes them. The vector quantizer (AVX-512) and
    the scalar loop (use_portable) must both be exactly that: zero rows and groups, an outlier, values that round to
    .5, tiny ones, rows of one sign. Bad shapes are refused."""
    op = torch.ops.waferline
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, K, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    x[1] = 0
    x[2, :G] = 0  # one zero group
    x[3, 5] = 1e4  # an outlier: the rest of its group rounds coarsely
    x[4] = x[4].abs()
    x[5, :G] = torch.arange(G) * 0.5  # exact halves: round to even
    x[6, 7] = 1e-30
    ng = K // G
    blk = x.view(9, ng, G)
    mx = blk.abs().amax(-1)
    inv = torch.where(mx > 0, torch.tensor(32767.0) / mx, torch.zeros_like(mx))
    xi = torch.round(blk * inv[..., None]).clamp(-32767, 32767).to(torch.int16).view(9, K)
    order = torch.tensor([k0 + _lane_input(j) for k0 in range(0, K, 64) for j in range(64)])
    want_sx = torch.where(mx > 0, mx / 32767.0, torch.zeros_like(mx))
    want_xs = want_sx * xi.view(9, ng, G).sum(-1).float()
    prev = op.use_portable(False)
    try:
        for portable in (False, True):
            op.use_portable(portable)
            xq, sx, xs = op.i16_rows(x, G)
            assert torch.equal(xq, xi[:, order]), f"portable={portable}"
            assert torch.equal(sx, want_sx) and torch.equal(xs, want_xs), f"portable={portable}"
    finally:
        op.use_portable(prev)
    for bad in ((x, 96), (x, 0), (x, 8192), (x[:, :G + 32], G), (x.double(), G)):
        with pytest.raises(RuntimeError):
            op.i16_rows(*bad)


def _int16_activations(G, K, Z, many=False):
    from waferline.model.quant import pack_kernel

    g = torch.Generator().manual_seed(5)
    N = 48
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = (torch.rand(N, K // G, generator=g) * 0.05 + 0.01).to(torch.bfloat16)
    zeros = (torch.randn(N, K // G, generator=g) * 0.02).to(torch.bfloat16)
    sz = (torch.stack([scales, zeros], -1) if Z == 2 else scales.unsqueeze(-1)).contiguous()
    w = (codes.float().view(N, K // G, G) - 8) * scales.float().unsqueeze(-1)
    if Z == 2:
        w = w + zeros.float().unsqueeze(-1)
    w = w.view(N, K)
    packed = pack_kernel(codes)
    for dtype in (torch.bfloat16, torch.float16):
        R = 140 if many else 16
        x = torch.randn(R, K, generator=g).to(dtype)
        x[3] = 0
        x[5, 7] = 300.0  # one outlier: its group's other inputs lose precision, within the bound
        one = torch.ops.waferline.int4_linear(x[:1], packed, sz, G)
        for rows in (*range(1, 9), 12, 16, *((17, 40, 140) if many else ())):
            out = torch.ops.waferline.int4_linear(x[:rows], packed, sz, G).float()
            held = _fixed_point(x[:rows], G).double() @ w.double().T
            tol = (x[:rows].float().abs() @ w.abs().T).double() * 2.0 ** -20 + held.abs() * 2.0 ** -8
            assert bool(((out.double() - held).abs() <= tol).all()), f"{dtype} {rows} rows"
            assert torch.equal(out[:1], one.float())  # a row's result does not depend on the rows beside it
            last = torch.ops.waferline.int4_linear(x[rows - 1:rows], packed, sz, G)
            assert torch.equal(out[rows - 1:], last.float()), f"{dtype} row {rows - 1} of {rows}"
        exact = x.double() @ w.double().T
        xmax = x.float().abs().view(R, K // G, G).amax(-1)  # [R, groups]
        wsum = w.abs().view(N, K // G, G).sum(-1)  # [N, groups]
        bound = (xmax @ wsum.T).double() / 65534 + exact.abs() * 2.0 ** -7
        assert bool(((out.double() - exact).abs() <= bound).all())
        assert bool((out[3] == 0).all())


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
@pytest.mark.parametrize("kernel", ["tiles", "rows", "portable"])
def test_integer_activation_products_keep_nan(kernel):
    """A NaN or an infinity in a row of x makes that row's outputs non-finite through the int4 and int8 products with
    16-bit fixed-point activations, as through the float product (NaN there: sx NaN for its group; the largest |x|
    skipped the NaN and the clamp turned it into -32767, a finite row), whichever kernel takes it (tile copies,
    row kernels, the portable quantizer and loops); the other rows are what they are without it, bitwise. i16_rows
    holds such a group as sx = NaN, xi = 0, from the vector and the scalar quantizer alike."""
    from waferline.model.quant import Int4Weight, rtn_quantize

    op = torch.ops.waferline
    g = torch.Generator().manual_seed(13)
    prev = op.use_int_tiles(kernel == "tiles"), op.use_portable(kernel == "portable")
    try:
        for G, K in ((64, 128), (128, 384), (32, 96)):
            t = rtn_quantize(torch.randn(33, K, generator=g), G, symmetric=False)
            w = Int4Weight(t, compute_dtype=torch.bfloat16)
            for rows in (1, 2, 5, 9, 20):
                x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
                clean = op.int4_linear(x, w.packed, w.scales_zeros, G)
                for bad in (float("nan"), float("inf")):
                    xb = x.clone()
                    xb[0, K - 3] = bad
                    y = op.int4_linear(xb, w.packed, w.scales_zeros, G)
                    assert not y[0].isfinite().any(), (G, K, rows, bad)
                    assert torch.equal(y[1:], clean[1:])
        q = torch.randint(-127, 128, (40, 200), generator=g, dtype=torch.int8)
        scale = torch.rand(40, generator=g).to(torch.bfloat16)
        x = torch.randn(3, 200, generator=g)
        clean = op.int8_linear(x, q, scale)
        for bad in (float("nan"), float("inf")):
            xb = x.clone()
            xb[1, 150] = bad
            y = op.int8_linear(xb, q, scale)
            assert y[1].isnan().all() if bad != bad else not y[1].isfinite().any()
            assert torch.equal(y[::2], clean[::2])
        if _INT_KERNELS:
            x = torch.randn(2, 256, generator=g)
            x[0, 70] = float("nan")
            x[1, 200] = float("-inf")
            xq, sx, xs = op.i16_rows(x, 64)
            for row, group in ((0, 1), (1, 3)):
                assert sx[row, group].isnan() and xs[row, group].isnan()
                assert not xq[row, 64 * group:64 * group + 64].any()
            assert sx[0, 0].isfinite() and sx[1, :3].isfinite().all() and xq[0, :64].any()
    finally:
        op.use_int_tiles(prev[0])
        op.use_portable(prev[1])


@pytest.mark.skipif(not _INT_KERNELS, reason="the integer-activation kernels are AVX2 code")
@pytest.mark.parametrize("kernel", ["tiles", "rows", "portable"])
def test_integer_activations_of_tiny_groups(kernel):
    """A group of x whose largest |x| is below 32767 times the smallest normal float (~3.9e-34) is held with sx =
    2^-126 (xi = round(x 2^126), its own sign): 32767 / max|x| passed the largest float there, and the infinity made
    every xi -32767 (the vector and the scalar quantizer alike), outputs of the wrong sign and size. Through the int4
    products (tile copies, row kernels; the portable loop's fp32 product) and the int8 head, within the fixed point's
    bound, as normal-sized groups are."""
    from waferline.model.quant import pack_kernel

    op = torch.ops.waferline
    g = torch.Generator().manual_seed(17)
    K, N, G = 256, 40, 64
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = (torch.rand(N, K // G, generator=g) * 0.05 + 0.01).to(torch.bfloat16)
    w = ((codes.float().view(N, K // G, G) - 8) * scales.float().unsqueeze(-1)).view(N, K)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s8 = (torch.rand(N, generator=g) * 0.01 + 0.001).to(torch.bfloat16)
    w8 = q.float() * s8.float()[:, None]
    x = torch.randn(5, K, generator=g) * 1e-35
    x[1, :G] *= 1e-4  # a group near the smallest bf16 numbers
    x[2, G:] = torch.randn(K - G, generator=g)  # one tiny group beside normal ones
    x[3] = x[3].abs()
    x = x.to(torch.bfloat16)
    prev = op.use_int_tiles(kernel == "tiles"), op.use_portable(kernel == "portable")
    try:
        tiny = x.float().abs().view(5, K // G, G).amax(-1) < 32767 * 2.0 ** -126
        for out, wt in ((op.int4_linear(x, pack_kernel(codes), scales.unsqueeze(-1).contiguous(), G), w),
                        (op.int8_linear(x.float(), q, s8), w8)):
            exact = x.double() @ wt.double().T
            step = torch.where(tiny, 2.0 ** -126, x.float().abs().view(5, K // G, G).amax(-1) / 32767).double()
            bound = step @ wt.abs().view(N, K // G, G).sum(-1).double().T / 2 + exact.abs() * 2.0 ** -7
            assert bool(((out.double() - exact).abs() <= bound).all()), kernel
        xq, sx, _ = op.i16_rows(x.float(), G)
        assert bool(tiny.any()) and bool((sx[tiny] == 2.0 ** -126).all())
        order = torch.tensor([k0 + _lane_input(j) for k0 in range(0, K, 64) for j in range(64)])
        want = torch.round(x.float()[:, order] * 2.0 ** 126).to(torch.int16)
        pick = tiny.repeat_interleave(G, 1)
        assert torch.equal(xq[pick], want[pick])
    finally:
        op.use_int_tiles(prev[0])
        op.use_portable(prev[1])


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("K", [512, 200, 40, 99])
def test_int8_linear(K, tiles):
    """waferline::int8_linear (the int8 LM head): fp32 ``x @ (q * scale)^T`` for 1-9, 16 and 17 rows, K with and
    without a partial last group and a tail past the last 16, odd K. The integer kernel (AVX2) holds x as 16-bit fixed
    point per 64 inputs: against that to float rounding, and against x itself within the fixed point's bound; the
    portable loop and the kernel switched off: the exact product to fp32 rounding. ``tiles``: through the head's tile
    copy (AVX512-VNNI CPUs, even K: one is made; else the row kernel), where each row's result is the row's alone,
    bitwise; else the row kernel. 80 outputs: the last tile's half is padding. Bad shapes are refused."""
    g = torch.Generator().manual_seed(6)
    N = 80
    wf = torch.randn(N, K, generator=g)
    scale = (wf.abs().amax(1) / 127).to(torch.bfloat16)
    q = torch.round(wf / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    w = q.float() * scale.float()[:, None]
    op = torch.ops.waferline
    prev_tiles = op.use_int_tiles(tiles)
    made = op.int8_tile_copies()[1]
    try:
        _int8_rows(g, K, N, q, scale, w, tiles)
    finally:
        op.use_int_tiles(prev_tiles)
    assert (op.int8_tile_copies()[1] == made + 1) == (tiles and _VNNI and K % 2 == 0)


def _int8_rows(g, K, N, q, scale, w, tiles):
    for rows in (*range(1, 10), 16, 17):
        x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
        out = torch.ops.waferline.int8_linear(x, q, scale)
        assert out.dtype == torch.float32 and out.shape == (rows, N)
        if tiles and _VNNI:
            assert torch.equal(out[-1:], torch.ops.waferline.int8_linear(x[-1:], q, scale))
        small = (x.float().abs() @ w.abs().T).double() * 2.0 ** -20
        if _INT_KERNELS:
            held = _fixed_point(x, 64).double() @ w.double().T
            assert bool(((out.double() - held).abs() <= small + held.abs() * 2.0 ** -20).all()), f"{rows} rows"
        exact = x.double() @ w.double().T
        xmax = torch.stack([x.float()[:, k:k + 64].abs().amax(1) for k in range(0, K, 64)], 1)
        wsum = torch.stack([w[:, k:k + 64].abs().sum(1) for k in range(0, K, 64)], 1)
        assert bool(((out.double() - exact).abs() <= (xmax @ wsum.T).double() / 65534 + small).all())
        for switch, setting in ((torch.ops.waferline.use_portable, True),
                                (torch.ops.waferline.use_int_activations, False)):
            prev = switch(setting)
            try:
                ref = torch.ops.waferline.int8_linear(x, q, scale)
            finally:
                switch(prev)
            assert bool(((ref.double() - exact).abs() <= small + exact.abs() * 2.0 ** -22).all())
    x3 = torch.randn(2, 3, K, generator=g)  # leading dims kept
    assert torch.ops.waferline.int8_linear(x3, q, scale).shape == (2, 3, N)
    with pytest.raises(RuntimeError, match="int8_linear"):
        torch.ops.waferline.int8_linear(x3, q[:, :-1], scale)
    with pytest.raises(RuntimeError, match="int8_linear"):
        torch.ops.waferline.int8_linear(x3, q.float(), scale)


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
@pytest.mark.parametrize("K", [64, 96, 200])
@pytest.mark.parametrize("kernel", ["tiles", "rows", "portable"])
def test_few_row_bf16_linear(K, kernel):
    """bf16 products of 1..FEW_ROWS rows run waferline::linear_rows (no oneDNN copy made): the fp32 product of the same
    bf16 numbers, rounded once to bf16 (a different summation order may flip a rounding), bias added after; K not a
    multiple of the kernel's 128-wide steps exercises its tail; ``tiles``: through the weight's tile copy (AVX512-BF16
    CPUs; elsewhere the next kernel), ``rows``: the row kernel, ``portable``: the loop CPUs without AVX512-BF16 or
    AVX2 run. Linear routes ``few_rows()`` rows there (FEW_ROWS: 8); the operator itself is checked at every row count
    it takes (1-8), and each row of x gets bitwise what it gets alone (the same summation order at every row count:
    a speculative verify's tokens compute what one-token steps compute)."""
    from waferline.model.layers import FEW_ROWS, Linear, few_rows

    prev = torch.ops.waferline.use_portable(kernel == "portable")
    prev_tiles = torch.ops.waferline.use_bf16_tiles(kernel == "tiles")
    try:
        _few_row_products(K, few_rows(torch.bfloat16), Linear)
        g = torch.Generator().manual_seed(2)
        w = torch.randn(48, K, generator=g).to(torch.bfloat16)
        for rows in range(1, FEW_ROWS + 1):
            x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
            ref = x.float() @ w.float().T
            out = torch.ops.waferline.linear_rows(x, w)
            alone = torch.cat([torch.ops.waferline.linear_rows(x[i: i + 1], w) for i in range(rows)])
            assert torch.equal(out, alone), f"{rows} rows"
            out = out.float()
            assert bool(((out - ref).abs() <= ref.abs().clamp_min(1e-2) * 2.0 ** -7 * 1.01).all()), f"{rows} rows"
    finally:
        torch.ops.waferline.use_portable(prev)
        torch.ops.waferline.use_bf16_tiles(prev_tiles)


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
def test_bf16_tile_copies_follow_their_weights():
    """The few-row bf16 kernel's tile copy of a weight (made at its first product) is redone when the weight is
    written in place (its version counter moves, in or out of inference mode) and goes when the weight is freed; a
    weight the copy cannot follow (an inference tensor: no version counter) or lay out (odd K) runs the row kernel.
    An output count not a multiple of the 16-output tile (the padding's outputs are not stored). Rows through the
    tiles equal the row kernel's to a bf16 rounding and each row's result does not depend on the rows beside it."""
    import gc

    op = torch.ops.waferline
    g = torch.Generator().manual_seed(4)
    prev = op.use_bf16_tiles(True)
    try:
        gc.collect()  # (earlier tests' weights freed now, not in the middle of the counts below)
        warm = torch.randn(16, 32, generator=g).to(torch.bfloat16)
        op.linear_rows(warm[:1], warm)  # (its packing drops the copies of weights freed before this test)
        before = op.bf16_tile_copies()[0]
        w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
        x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
        out = op.linear_rows(x, w)
        if op.bf16_tile_copies()[0] == before:
            pytest.skip("no AVX512-BF16 here: the row kernel runs (test_few_row_bf16_linear covers it)")
        assert op.bf16_tile_copies()[0] == before + 1 and out.shape == (5, 40)
        assert torch.equal(torch.cat([op.linear_rows(x[i:i + 1], w) for i in range(5)]), out)
        op.use_bf16_tiles(False)
        rows = op.linear_rows(x, w)
        op.use_bf16_tiles(True)
        ref = x.double() @ w.double().T
        for y in (out, rows):
            assert bool(((y.double() - ref).abs() <= ref.abs().clamp_min(1e-2) * 2.0 ** -7 * 1.01).all())
        with torch.no_grad():
            w.mul_(-2.0)  # in place: the version moves, the copy is redone
        assert torch.equal(op.linear_rows(x, w), op.linear_rows(x, w.clone()))
        with torch.inference_mode():
            w[3].fill_(0.5)
            assert torch.equal(op.linear_rows(x, w), op.linear_rows(x, w.clone()))
        n = op.bf16_tile_copies()[0]
        del w
        gc.collect()
        other = torch.randn(48, 64, generator=g).to(torch.bfloat16)
        op.linear_rows(x, other)
        assert op.bf16_tile_copies()[0] == n  # w's copy went, other's came
        with torch.inference_mode():
            frozen = torch.randn(32, 64, generator=g).to(torch.bfloat16)
        odd = torch.randn(32, 63, generator=g).to(torch.bfloat16)
        for wt, xt in ((frozen, x), (odd, torch.randn(2, 63, generator=g).to(torch.bfloat16))):
            y = op.linear_rows(xt, wt)
            assert op.bf16_tile_copies()[0] == n
            ref = xt.double() @ wt.double().T
            assert bool(((y.double() - ref).abs() <= ref.abs().clamp_min(1e-2) * 2.0 ** -7 * 1.01).all())
    finally:
        op.use_bf16_tiles(prev)


@pytest.mark.skipif(not _VNNI, reason="the int4 tile copies are AVX512-VNNI code")
def test_int4_tile_copies_follow_their_weights():
    """The integer int4 kernel's tile copy of a weight (its codes and scales, made at its first product of 16-bit
    rows) is made once, redone when the codes or the scales are written in place, and goes when the weight is
    freed; none is made for an inference tensor, groups of 32 (not the integer kernel's) or fp32 x; a product of more
    than 16 rows (a prefill's) makes one too.
    40 outputs (not a multiple of the 16-output tile: the padding's are not stored). Rows through the copy equal the
    row kernel's to float rounding, each row's result not depending on the rows beside it."""
    import gc

    from waferline.model.quant import Int4Weight, rtn_quantize

    op = torch.ops.waferline
    g = torch.Generator().manual_seed(6)

    def weight(N, K, G):
        t = rtn_quantize(torch.randn(N, K, generator=g), G, symmetric=False)
        q = Int4Weight(t, compute_dtype=torch.bfloat16)
        return q.packed, q.scales_zeros, t.dequantize()

    def close(y, x, w):  # within bf16 rounding of the dequantized product (plus the 16-bit fixed point of x)
        ref = x.double() @ w.double().T
        return bool(((y.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-3 * ref.abs().max()).all())

    prev = op.use_int_tiles(True)
    try:
        gc.collect()  # (earlier tests' weights freed now, not in the middle of the counts below)
        wp, wsz, _ = weight(16, 64, 64)
        op.int4_linear(torch.ones(1, 64, dtype=torch.bfloat16), wp, wsz, 64)  # (drops the copies of freed weights)
        base, made = op.int4_tile_copies()
        p, sz, w = weight(40, 256, 64)
        x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
        out = op.int4_linear(x, p, sz, 64)
        assert op.int4_tile_copies() == (base + 1, made + 1) and out.shape == (5, 40)
        assert torch.equal(torch.cat([op.int4_linear(x[i:i + 1], p, sz, 64) for i in range(5)]), out)
        assert op.int4_tile_copies() == (base + 1, made + 1)  # (the same copy)
        op.use_int_tiles(False)
        rows = op.int4_linear(x, p, sz, 64)
        op.use_int_tiles(True)
        assert close(out, x, w) and close(rows, x, w) and not torch.equal(out, torch.zeros_like(out))
        p.bitwise_xor_(0x35)  # codes in place: the copy is redone
        assert torch.equal(op.int4_linear(x, p, sz, 64), op.int4_linear(x, p.clone(), sz.clone(), 64))
        sz.mul_(-2.0)  # scales in place
        assert torch.equal(op.int4_linear(x, p, sz, 64), op.int4_linear(x, p.clone(), sz.clone(), 64))
        del p, sz
        gc.collect()
        p, sz, w = weight(48, 256, 128)
        assert close(op.int4_linear(x, p, sz, 128), x, w)
        live, made = op.int4_tile_copies()
        assert live == base + 1  # the old weight's copy (and its clones') went, this one's came
        with torch.inference_mode():
            frozen = weight(32, 256, 64)
        for (wq, wsz, wd), G, xt in ((frozen, 64, x), (weight(32, 256, 32), 32, x), ((p, sz, w), 128, x.float())):
            y = op.int4_linear(xt, wq, wsz, G)
            assert op.int4_tile_copies()[1] == made and close(y.float(), xt.float(), wd), G
        p, sz, w = weight(32, 256, 64)
        many = torch.randn(17, 256, generator=g).to(torch.bfloat16)
        y = op.int4_linear(many, p, sz, 64)
        assert op.int4_tile_copies()[1] == made + 1 and close(y, many, w)
        assert torch.equal(y[16:], op.int4_linear(many[16:], p, sz, 64))  # (the same copy, the same numbers)
    finally:
        op.use_int_tiles(prev)


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("G,K,Z,sdtype", [(32, 224, 1, torch.bfloat16), (32, 224, 2, torch.float16),
                                          (64, 256, 2, torch.float32), (128, 384, 1, torch.bfloat16),
                                          (128, 4096, 2, torch.bfloat16), (96, 480, 2, torch.bfloat16),
                                          (160, 480, 1, torch.float32)])
def test_int4_linear_is_the_dequantized_product(portable, G, K, Z, sdtype):
    """waferline::int4_linear (waferline's CPU int4 layout) computes x @ W^T with W = (code - 8) * scale + zero in
    fp32: against the fp32 product with the dequantized weight, rounded once to bf16, at every row count the few-row
    kernel takes (1-8, one register blocking each), in blocks of 8 (12, 16) and through the dequantise-and-GEMM path
    (20, 40; it takes the weight in slices of 256 KiB in fp32: with K = 4096, three slices of 16, 16 and 8
    outputs); K with a 32-input tail; groups of 32 (two per 64-input block), of 64 / 128 (several blocks per group)
    and of an odd number of 32s (96, 160: a group starting mid-block, which the operator accepts),
    symmetric and with zeros, 16- and 32-bit scales, and
    ``portable``: the loop CPUs without AVX2 run. Its layout is ``quant.pack_kernel``'s (a wrong byte order fails);
    ``unpack_kernel`` inverts it; bad shapes are refused. The 16-bit-integer activation kernel is off here (it has
    its own test below): this is the exact fp32 kernel."""
    from waferline.model.quant import pack_kernel, pack_nibbles, unpack_kernel

    g = torch.Generator().manual_seed(3)
    N = 40  # K = 224: three 64-input blocks and a 32-input tail
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_kernel(pack_kernel(codes)), codes)
    scales = (torch.rand(N, K // G, generator=g) * 0.05 + 0.01).to(sdtype)
    zeros = (torch.randn(N, K // G, generator=g) * 0.02).to(sdtype)
    sz = torch.stack([scales, zeros], -1) if Z == 2 else scales.unsqueeze(-1)
    w = (codes.float().view(N, K // G, G) - 8) * scales.float().unsqueeze(-1)
    if Z == 2:
        w = w + zeros.float().unsqueeze(-1)
    w = w.view(N, K)
    packed = pack_kernel(codes)
    prev = torch.ops.waferline.use_portable(portable)
    prev_int = torch.ops.waferline.use_int_activations(False)
    try:
        for rows in (*range(1, 9), 12, 16, 20, 40):
            x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
            ref = x.float() @ w.T
            out = torch.ops.waferline.int4_linear(x, packed, sz.contiguous(), G)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, N)
            tol = (x.float().abs() @ w.abs().T) * 2.0 ** -20 + ref.abs() * 2.0 ** -8
            assert bool(((out.float() - ref).abs() <= tol).all()), f"{rows} rows"
        x3 = torch.randn(2, 3, K, generator=g)  # fp32 activations, leading dims kept
        out = torch.ops.waferline.int4_linear(x3, packed, sz.contiguous(), G)
        assert out.dtype == torch.float32 and out.shape == (2, 3, N)
        torch.testing.assert_close(out, x3 @ w.T, rtol=1e-5, atol=1e-4)
    finally:
        torch.ops.waferline.use_portable(prev)
        torch.ops.waferline.use_int_activations(prev_int)
    wrong = pack_nibbles(codes)  # the canonical on-disk order is not the kernel's
    assert not torch.allclose(torch.ops.waferline.int4_linear(x3, wrong, sz.contiguous(), G), x3 @ w.T, atol=1e-2)
    with pytest.raises(RuntimeError, match="int4_linear"):
        torch.ops.waferline.int4_linear(x3, packed[:, :-1].contiguous(), sz.contiguous(), G)
    with pytest.raises(RuntimeError, match="int4_linear"):
        torch.ops.waferline.int4_linear(x3, packed, sz.contiguous(), 48)



@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
@pytest.mark.parametrize("int_act", [False, True])
@pytest.mark.parametrize("G,K,Z", [(32, 224, 1), (32, 256, 2), (96, 480, 2), (64, 256, 1), (128, 384, 2)])
def test_int4_linear_rows_do_not_depend_on_the_rows_beside_them(int_act, G, K, Z):
    """Each row of waferline::int4_linear's result is bitwise that row's product alone, at every row count up to 16
    (the few-row kernels: a decode step's batch), fp32 and bf16 activations, the fp32 kernel (groups of 32 and 96,
    or every group with the integer activations off) and the integer one: a sequence's numbers do not depend on
    how many others share its decode steps. (The fp32 kernel's chains per row, and a 1-2 row kernel of its own,
    once depended on the row count: group-32 int4 models moved by up to ~1e-3 in log-probability beside others.)"""
    from waferline.model.quant import pack_kernel

    g = torch.Generator().manual_seed(5)
    N = 37  # (an odd count: the one-row kernel takes weight rows two at a time)
    packed = pack_kernel(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8))
    sz = (torch.rand(N, K // G, Z, generator=g) * 0.05 + 0.01).to(torch.bfloat16)
    prev = torch.ops.waferline.use_int_activations(int_act)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(16, K, generator=g).to(dtype)
            alone = [torch.ops.waferline.int4_linear(x[i:i + 1], packed, sz, G)[0] for i in range(16)]
            for rows in range(2, 17):
                out = torch.ops.waferline.int4_linear(x[:rows], packed, sz, G)
                for i in range(rows):
                    assert torch.equal(out[i], alone[i]), (dtype, rows, i)
    finally:
        torch.ops.waferline.use_int_activations(prev)

def _few_row_products(K, FEW_ROWS, Linear):
    g = torch.Generator().manual_seed(1)
    lin = Linear(K, 80, bias=True, dtype=torch.bfloat16)
    lin.weight.copy_(torch.randn(80, K, generator=g))
    lin.bias.copy_(torch.randn(80, generator=g))
    for rows in range(1, FEW_ROWS + 1):
        x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
        ref = (x.float() @ lin.weight.float().T).to(torch.bfloat16)
        out = lin(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 80)
        diff = (out.float() - (ref.float() + lin.bias.float())).abs()
        tol = (ref.float().abs() + lin.bias.float().abs()).clamp_min(1e-2) * 2.0 ** -7 * 2.01
        assert bool((diff <= tol).all()), f"{rows} rows: max diff {diff.max().item()}"
    assert not lin.__dict__.get("_packs")  # no oneDNN copy for few rows


@pytest.mark.skipif(not _VNNI, reason="the int4 tile copies are AVX512-VNNI code")
def test_a_decode_loop_packs_each_int4_weight_once(tmp_path):
    """An int4 engine's decode steps (1 and 3 rows; the layers as one op, on thread teams) make the tile copies of
    their int4 weights and int8 head once: a second generate makes none. Without the copies (the row kernels) the
    same tokens."""
    from waferline import LLM, SamplingParams

    op = torch.ops.waferline
    prev = op.use_int_tiles(True)
    try:
        build("deepseek_v3", tmp_path, q_lora_rank=64)
        llm = LLM(str(tmp_path), dtype="bfloat16", weight_bits=4, group_size=64, head_bits=8)
        prompts = [[3, 5, 7, 9, 11, 13], [4, 6, 8], [10, 12, 14, 16]]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        made0 = op.int4_tile_copies()[1], op.int8_tile_copies()[1]
        llm.generate(prompts[:1], params)
        llm.generate(prompts, params)
        copies = op.int4_tile_copies(), op.int8_tile_copies()
        assert copies[0][1] > made0[0] and copies[1][1] == made0[1] + 1
        first = llm.generate(prompts, params)
        assert (op.int4_tile_copies(), op.int8_tile_copies()) == copies
        op.use_int_tiles(False)  # (random weights: near-ties could differ; not here)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in first]
    finally:
        op.use_int_tiles(prev)


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "llama"])
def test_a_decode_loop_packs_each_bf16_weight_once(tmp_path, model_type):
    """The engine's bf16 decode steps (1 and 3 rows) make the tile copies of their weights once: a second generate
    makes none (a weight re-made per step -- a slice copied, a cast -- would be packed at every call)."""
    from waferline import LLM, SamplingParams

    op = torch.ops.waferline
    prev = op.use_bf16_tiles(True)
    try:
        build(model_type, tmp_path)
        llm = LLM(str(tmp_path), dtype="bfloat16")
        prompts = [[3, 5, 7, 9, 11, 13], [4, 6, 8], [10, 12, 14, 16]]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        llm.generate(prompts[:1], params)
        llm.generate(prompts, params)
        live, made = op.bf16_tile_copies()
        if made == 0:
            pytest.skip("no AVX512-BF16 here: no tile copies")
        first = llm.generate(prompts, params)
        assert op.bf16_tile_copies() == (live, made)
        op.use_bf16_tiles(False)  # the row kernel: the same tokens (random weights: near-ties may differ; not here)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in first]
    finally:
        op.use_bf16_tiles(prev)
