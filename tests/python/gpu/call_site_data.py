"""Inputs, expert stand-ins and reference answers for the framework call-sequence tests
(test_inference_call_sites.py): every process builds every rank's seeded inputs and asks the CPU reference
(epx_tools.reference) what each rank must receive and get back.

Values are chosen so that any correct implementation is bit-exact: normal-mode tokens are small integers (exact
in BF16 and FP8 e4m3) with power-of-two FP8 scales, so dequantised rows and their sums are exact in any order;
low-latency mode is compared with the reference's own cast and reduction order, as tests/python/gpu/
test_low_latency.py does. The "experts" are elementwise functions of the received rows (double them, or
dequantise FP8 rows), computed the same way with torch on the GPU and on the reference's rows on the CPU."""

import numpy as np

HIDDEN = 2048  # a hidden size vLLM's low-latency path lists; 16 scale groups, 4 UE8M0 words
NUM_TOPK = 6
EXPERTS_PER_RANK = 8

# How FP8 callers hand over scales (normal mode): float32 [T, H/128] row-major (vLLM's block quant),
# column-major with the token dimension padded to 4 (DeepGEMM's TMA-aligned layout, SGLang's
# column_major_scales / scale_tma_aligned), per token [T, 1] (vLLM's per-token quant), or UE8M0 exponents packed
# 4 per int32 [T, ceil(H/512)], column-major and TMA-aligned (SGLang with scale_ue8m0).
SCALE_KINDS = ("row-major", "column-major", "per-token", "ue8m0")


def routing(num_ranks, num_experts, num_tokens, seed, idle_rank=False):
    """Every rank's top-k ids [T_r, K] (int64): one hot expert, some dropped slots (-1); with idle_rank no
    token picks an expert of the last rank, whose normal-mode receive is then empty."""
    import epx_tools.reference as ref

    ids = []
    for r, count in enumerate(num_tokens):
        spec = ref.native.RoutingSpec(num_tokens=count, num_topk=NUM_TOPK, num_experts=num_experts,
                                      num_ranks=num_ranks, hot_experts=[EXPERTS_PER_RANK + 1], hot_probability=0.3,
                                      drop_probability=0.1, excluded_ranks=[num_ranks - 1] if idle_rank else [])
        ids.append(np.asarray(ref.native.make_topk_idx(spec, seed * 1000 + r), dtype=np.int64).reshape(count,
                                                                                                          NUM_TOPK))
    return ids


def topk_weights(num_tokens, seed):
    import epx_tools.reference as ref

    return [ref.native.random_topk_weights(seed * 1000 + r, count, NUM_TOPK).reshape(count, NUM_TOPK)
            for r, count in enumerate(num_tokens)]


# ---- FP8 scales as callers lay them out ----


def scales_tensor(torch, exponents, kind, device):
    """The scales tensor a caller passes for per-128-channel power-of-two scales 2^exponents ([T, G] int):
    its logical values (what indexing reads) and strides follow `kind` (SCALE_KINDS)."""
    num_tokens, num_groups = exponents.shape
    if kind == "per-token":
        return torch.from_numpy(np.exp2(exponents[:, :1]).astype(np.float32)).to(device)
    if kind == "row-major":
        return torch.from_numpy(np.exp2(exponents).astype(np.float32)).to(device)
    aligned = -(-num_tokens // 4) * 4  # DeepGEMM pads the token dimension of column-major scales to 4
    if kind == "column-major":
        storage = torch.zeros(num_groups, aligned, dtype=torch.float32, device=device)
        storage[:, :num_tokens] = torch.from_numpy(np.exp2(exponents).astype(np.float32).T.copy()).to(device)
        return storage[:, :num_tokens].t()
    assert kind == "ue8m0"
    words = pack_ue8m0(exponents)  # [T, W] int32
    storage = torch.zeros(words.shape[1], aligned, dtype=torch.int32, device=device)
    storage[:, :num_tokens] = torch.from_numpy(words.T.copy()).to(device)
    return storage[:, :num_tokens].t()


def pack_ue8m0(exponents):
    """UE8M0 bytes (exponent + 127) of [T, G] scales, 4 per int32, group 4w + i in byte i: [T, ceil(G/4)]."""
    num_tokens, num_groups = exponents.shape
    num_words = -(-num_groups // 4)
    padded = np.full((num_tokens, num_words * 4), 127, dtype=np.uint8)
    padded[:, :num_groups] = (exponents + 127).astype(np.uint8)
    return padded.view(np.int32).reshape(num_tokens, num_words)


def logical_scales(exponents, kind):
    """What indexing the scales tensor of `kind` reads, as numpy [T, S]."""
    if kind == "per-token":
        return np.exp2(exponents[:, :1]).astype(np.float32)
    if kind == "ue8m0":
        return pack_ue8m0(exponents)
    return np.exp2(exponents).astype(np.float32)


# ---- Experts: elementwise stand-ins, identical on the GPU and on the CPU ----


def expand_scales(torch, scales, hidden):
    """Per-channel float32 scales from float32 [..., G] / [..., 1] or UE8M0-packed int32 [..., W] scales."""
    if scales.dtype == torch.int32:
        words = scales.contiguous()
        if words.numel() == 0:  # no rows: nothing to view as bytes
            return torch.zeros(*words.shape[:-1], hidden, device=words.device)
        exponents = words.view(torch.uint8)[..., : hidden // 128].float()
        scales = torch.exp2(exponents - 127)
    if scales.size(-1) == 1:
        return scales
    return scales.repeat_interleave(128, dim=-1)[..., :hidden]


def expert(torch, x, scales=None):
    """BF16 rows doubled, or FP8 rows dequantised (data times their scales), as BF16."""
    if scales is None:
        return (x.float() * 2).to(torch.bfloat16)
    return (x.float() * expand_scales(torch, scales, x.size(-1))).to(torch.bfloat16)


def expert_on_host(x_bits_or_bytes, scales=None):
    """expert() on the reference's numpy rows (BF16 bits, or FP8 bytes with scales): BF16 bits."""
    import torch

    import epx_tools.reference as ref

    if scales is None:
        out = expert(torch, ref.to_torch_bf16(x_bits_or_bytes))
    else:
        out = expert(torch, ref.to_torch_fp8(x_bits_or_bytes), torch.from_numpy(np.ascontiguousarray(scales)))
    return ref.bf16_bits(out)


# ---- Normal mode ----


class NormalWorld:
    """One normal-mode round of every rank: tokens as small integers (BF16, or FP8 with power-of-two scales of
    one SCALE_KINDS layout), routing, weights, and what the reference says each rank receives and gets back
    from a combine of expert() outputs."""

    def __init__(self, num_ranks, num_tokens, seed, *, fp8_kind=None, idle_rank=False, expert_alignment=1,
                 num_worst_tokens=0):
        import torch

        import epx_tools.reference as ref

        self.num_ranks, self.num_tokens, self.fp8_kind = num_ranks, num_tokens, fp8_kind
        self.num_experts = EXPERTS_PER_RANK * num_ranks
        self.ids = routing(num_ranks, self.num_experts, num_tokens, seed, idle_rank)
        self.weights = topk_weights(num_tokens, seed + 1)
        rng = np.random.default_rng(seed)
        values = [rng.integers(-8, 9, size=(count, HIDDEN)).astype(np.float32) for count in num_tokens]
        self.x_bits = [ref.float_to_bf16(v) for v in values]
        self.exponents = [rng.integers(-2, 3, size=(count, HIDDEN // 128)) for count in num_tokens]
        if fp8_kind == "per-token":  # one scale per token: every group gets the first group's
            self.exponents = [np.repeat(e[:, :1], HIDDEN // 128, axis=1) for e in self.exponents]
        self.x_fp8 = [ref.fp8_bytes(torch.from_numpy(v).to(torch.float8_e4m3fn)) for v in values]
        # The reference routes BF16 rows of the same values: its rows name their source token, which gives the
        # FP8 bytes and scales each received row must carry.
        inputs = [ref.NormalRankInput(x=self.x_bits[r], topk_idx=self.ids[r], topk_weights=self.weights[r])
                  for r in range(num_ranks)]
        self.outputs, self.handle = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=self.num_experts,
                                                        hidden=HIDDEN, expert_alignment=expert_alignment,
                                                        num_worst_tokens=num_worst_tokens)
        self.expert_out = [self.expected_expert_out(d) for d in range(num_ranks)]
        self.combined = [c for c, _ in ref.normal_combine(self.handle, self.expert_out)]

    def gather(self, per_rank, d):
        """Rows of per_rank arrays ([T_r, ...] per source rank) in rank d's receive order (padding rows 0)."""
        out = self.outputs[d]
        src_rank, src_idx = np.asarray(out.recv_src_rank), np.asarray(out.recv_src_token_idx)
        stacked = np.concatenate(per_rank)
        offsets = np.concatenate([[0], np.cumsum(self.num_tokens)])[:-1]
        valid = src_rank >= 0
        rows = np.zeros((len(src_rank),) + stacked.shape[1:], dtype=stacked.dtype)
        rows[valid] = stacked[offsets[src_rank[valid]] + src_idx[valid]]
        return rows

    def expected_recv(self, d):
        """(data, scales) rank d must receive: BF16 bits and None, or FP8 bytes and logical scales [N, S]."""
        if self.fp8_kind is None:
            return self.gather(self.x_bits, d), None
        scales = [logical_scales(e, self.fp8_kind) for e in self.exponents]
        return self.gather(self.x_fp8, d), self.gather(scales, d)

    def expected_expert_out(self, d):
        data, scales = self.expected_recv(d)
        return expert_on_host(data, scales)

    def inputs(self, rank, device):
        """(x or (fp8, scales), topk_idx, topk_weights) of this rank on the device, as the caller passes them."""
        import torch

        import epx_tools.reference as ref

        if self.fp8_kind is None:
            x = ref.to_torch_bf16(self.x_bits[rank], device)
        else:
            x = (ref.to_torch_fp8(self.x_fp8[rank], device),
                 scales_tensor(torch, self.exponents[rank], self.fp8_kind, device))
        return (x, torch.from_numpy(self.ids[rank]).to(device), torch.from_numpy(self.weights[rank]).to(device))

    def check_dispatch(self, rank, recv_x, recv_ids, recv_weights, counts):
        """recv_x (BF16 or the FP8 tuple), local top-k ids and weights, per-expert counts against the reference
        (rows past the received count, in worst-case mode, are not compared)."""
        import epx_tools.reference as ref

        expected = self.outputs[rank]
        rows = expected.num_recv_tokens
        data, scales = self.expected_recv(rank)
        if self.fp8_kind is None:
            np.testing.assert_array_equal(ref.bf16_bits(recv_x)[:rows], data[:rows])
        else:
            got_data, got_scales = recv_x
            np.testing.assert_array_equal(ref.fp8_bytes(got_data)[:rows], data[:rows])
            assert tuple(got_scales.shape) == (expected.num_rows, scales.shape[1])
            np.testing.assert_array_equal(got_scales.cpu().numpy()[:rows], scales[:rows])
        np.testing.assert_array_equal(recv_ids.cpu().numpy()[:rows], expected.recv_topk_idx[:rows])
        np.testing.assert_array_equal(recv_weights.cpu().numpy()[:rows], expected.recv_topk_weights[:rows])
        assert list(counts) == list(expected.num_recv_tokens_per_expert_list)


# ---- Low-latency mode ----


class LowLatencyWorld:
    """One low-latency round of every rank (T_r <= M tokens each): the reference's receive and the weighted
    combine of expert() outputs (rows past each expert's count are zeros)."""

    def __init__(self, num_ranks, num_tokens, max_tokens, seed, *, use_fp8=False, round_scale=False,
                 use_ue8m0=False):
        import epx_tools.reference as ref

        native = ref.native
        self.num_ranks, self.num_tokens, self.max_tokens = num_ranks, num_tokens, max_tokens
        self.num_experts = EXPERTS_PER_RANK * num_ranks
        self.use_fp8, self.use_ue8m0 = use_fp8, use_ue8m0
        self.params = ref.low_latency_params(num_ranks=num_ranks, num_experts=self.num_experts, hidden=HIDDEN,
                                             num_topk=NUM_TOPK, num_max_dispatch_tokens_per_rank=max_tokens)
        self.ids = routing(num_ranks, self.num_experts, num_tokens, seed)
        self.weights = topk_weights(num_tokens, seed + 1)
        self.x = [native.random_bf16_tokens(seed * 7919 + r, count, HIDDEN, r, native.TokenValues.UNIFORM)
                  .reshape(count, HIDDEN) for r, count in enumerate(num_tokens)]
        self.received = ref.low_latency_dispatch(self.x, self.ids, self.params, use_fp8=use_fp8,
                                                 round_scale=round_scale, use_ue8m0=use_ue8m0)
        self.expert_out = [self.expected_expert_out(d) for d in range(num_ranks)]
        self.combined = ref.low_latency_combine(self.expert_out, self.ids, self.weights, self.params)

    def expected_expert_out(self, d):
        got = self.received[d]
        if not self.use_fp8:
            out = expert_on_host(got.recv_x)
        else:
            scales = got.recv_x_scales.view(np.int32) if self.use_ue8m0 else got.recv_x_scales
            out = expert_on_host(got.recv_x, scales)
        return mask_rows(out, got.recv_count)

    def inputs(self, rank, device):
        import torch

        import epx_tools.reference as ref

        return (ref.to_torch_bf16(self.x[rank], device), torch.from_numpy(self.ids[rank]).to(device),
                torch.from_numpy(self.weights[rank]).to(device))

    def check_dispatch(self, rank, recv_x, recv_count):
        import epx_tools.reference as ref

        expected = self.received[rank]
        counts = recv_count.cpu().numpy()
        np.testing.assert_array_equal(counts, expected.recv_count)
        data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        assert (scales is not None) == self.use_fp8
        bits = ref.fp8_bytes(data) if self.use_fp8 else ref.bf16_bits(data)
        scales_host = None if scales is None else scales.cpu().numpy()
        for le, count in enumerate(counts):
            np.testing.assert_array_equal(bits[le, :count], expected.recv_x[le, :count])
            if scales is not None:
                got = scales_host[le, :count].view(np.uint32) if self.use_ue8m0 else scales_host[le, :count]
                np.testing.assert_array_equal(got, expected.recv_x_scales[le, :count])


def mask_rows(rows, counts):
    """Zeros past each local expert's count ([L, R*M, H] BF16 bits)."""
    rows = np.array(rows, copy=True)
    for le, count in enumerate(np.asarray(counts)):
        rows[le, int(count):] = 0
    return rows


def device_expert(torch, recv_x, recv_count):
    """expert() of a low-latency receive on the device, rows past each expert's count zeroed (as the host
    side computes them)."""
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    out = expert(torch, data, scales)
    rows = torch.arange(out.size(1), device=out.device)[None, :, None]
    return torch.where(rows < recv_count.to(torch.int64)[:, None, None], out, torch.zeros((), dtype=out.dtype,
                                                                                           device=out.device))
