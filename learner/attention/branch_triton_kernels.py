"""The Triton kernels behind :mod:`codraft.learner.attention.branch_triton` (imported only when they
run, so that importing the learner never needs triton). See that module for the arithmetic."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pick(j: tl.constexpr, p0, p1, p2, p3, p4, p5, p6):
    if j == 0:
        p = p0
    elif j == 1:
        p = p1
    elif j == 2:
        p = p2
    elif j == 3:
        p = p3
    elif j == 4:
        p = p4
    elif j == 5:
        p = p5
    else:
        p = p6
    return p


@triton.jit
def merge_kernel(
    Q, OA, LA, OUT, L,
    K0, K1, K2, K3, K4, K5, K6,
    V0, V1, V2, V3, V4, V5, V6,
    T, scale,
    sq_t, sq_h, soa_t, soa_h, sla_t, sla_h, so_t, so_h, sl_t, sl_h, sk_t, sk_h,
    G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
    BT: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    h = kvh * G + g
    tm, gm, dm = t < T, g < G, d < D
    m2 = tm[:, None] & gm[None, :]
    m3 = m2[:, :, None] & dm[None, None, :]
    t3, h3, d3 = t[:, None, None], h[None, :, None], d[None, None, :]
    q = tl.load(Q + t3 * sq_t + h3 * sq_h + d3, mask=m3, other=0.0).to(tl.float32)
    acc = tl.load(OA + t3 * soa_t + h3 * soa_h + d3, mask=m3, other=0.0).to(tl.float32)
    m = tl.load(LA + t[:, None] * sla_t + h[None, :] * sla_h, mask=m2, other=0.0).to(tl.float32)
    z = tl.full([BT, BG], 1.0, tl.float32)
    kd = t[:, None] * sk_t + kvh * sk_h + d[None, :]
    km = tm[:, None] & dm[None, :]
    for j in tl.static_range(NB):
        kp = _pick(j, K0, K1, K2, K3, K4, K5, K6)
        vp = _pick(j, V0, V1, V2, V3, V4, V5, V6)
        k = tl.load(kp + kd, mask=km, other=0.0).to(tl.float32)
        v = tl.load(vp + kd, mask=km, other=0.0).to(tl.float32)
        s = tl.sum(q * k[:, None, :], axis=2) * scale
        m_new = tl.maximum(m, s)
        alpha = tl.exp(m - m_new)  # 0 when the trunk is empty (m = -inf)
        p = tl.exp(s - m_new)
        z = z * alpha + p
        acc = acc * alpha[:, :, None] + p[:, :, None] * v[:, None, :]
        m = m_new
    out = acc / z[:, :, None]
    tl.store(OUT + t3 * so_t + h3 * so_h + d3, out.to(OUT.dtype.element_ty), mask=m3)
    tl.store(L + t[:, None] * sl_t + h[None, :] * sl_h, m + tl.log(z), mask=m2)


@triton.jit
def grad_kernel(
    DQ, DO, Q, OUT, L,
    K0, K1, K2, K3, K4, K5, K6,
    V0, V1, V2, V3, V4, V5, V6,
    DK0, DK1, DK2, DK3, DK4, DK5, DK6,
    DV0, DV1, DV2, DV3, DV4, DV5, DV6,
    T, scale,
    sdq_t, sdq_h, sdo_t, sdo_h, sq_t, sq_h, so_t, so_h, sl_t, sl_h, sk_t, sk_h,
    G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
    BT: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    h = kvh * G + g
    tm, gm, dm = t < T, g < G, d < D
    m2 = tm[:, None] & gm[None, :]
    m3 = m2[:, :, None] & dm[None, None, :]
    t3, h3, d3 = t[:, None, None], h[None, :, None], d[None, None, :]
    do = tl.load(DO + t3 * sdo_t + h3 * sdo_h + d3, mask=m3, other=0.0).to(tl.float32)
    o = tl.load(OUT + t3 * so_t + h3 * so_h + d3, mask=m3, other=0.0).to(tl.float32)
    delta = tl.sum(do * o, axis=2)
    lse = tl.load(L + t[:, None] * sl_t + h[None, :] * sl_h, mask=m2, other=0.0).to(tl.float32)
    q = tl.load(Q + t3 * sq_t + h3 * sq_h + d3, mask=m3, other=0.0).to(tl.float32)
    dq_ptr = DQ + t3 * sdq_t + h3 * sdq_h + d3
    dq = tl.load(dq_ptr, mask=m3, other=0.0).to(tl.float32)
    kd = t[:, None] * sk_t + kvh * sk_h + d[None, :]
    km = tm[:, None] & dm[None, :]
    for j in tl.static_range(NB):
        kp = _pick(j, K0, K1, K2, K3, K4, K5, K6)
        vp = _pick(j, V0, V1, V2, V3, V4, V5, V6)
        dkp = _pick(j, DK0, DK1, DK2, DK3, DK4, DK5, DK6)
        dvp = _pick(j, DV0, DV1, DV2, DV3, DV4, DV5, DV6)
        k = tl.load(kp + kd, mask=km, other=0.0).to(tl.float32)
        v = tl.load(vp + kd, mask=km, other=0.0).to(tl.float32)
        p = tl.exp(tl.sum(q * k[:, None, :], axis=2) * scale - lse)
        p = tl.where(m2, p, 0.0)
        ds = p * (tl.sum(do * v[:, None, :], axis=2) - delta) * scale
        dq += ds[:, :, None] * k[:, None, :]
        dk = tl.sum(ds[:, :, None] * q, axis=1)
        dv = tl.sum(p[:, :, None] * do, axis=1)
        tl.store(dkp + kd, dk.to(dkp.dtype.element_ty), mask=km)
        tl.store(dvp + kd, dv.to(dvp.dtype.element_ty), mask=km)
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=m3)
