"""The Python layer without a GPU: Config, EventOverlap, the DeepEP-compatible signatures, argument checks and
the training helpers (torch on the CPU, skipped without torch)."""

import inspect
from types import SimpleNamespace

import pytest

import epx
import epx.compat.deep_ep as deep_ep

# ---- Config ----


def test_config_defaults_and_fields():
    config = epx.Config()
    assert config.num_sms == 20
    assert (config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens) == (6, 256)
    assert (config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (6, 256)
    custom = epx.Config(24, 8, 288, 16, 128)
    assert custom.num_sms == 24 and custom.num_max_rdma_chunked_recv_tokens == 128
    assert custom == epx.Config(24, 8, 288, 16, 128) and custom != config
    assert "num_sms=24" in repr(custom)


def test_config_checks():
    # The C++ rules (validate_config), naming the field.
    with pytest.raises(epx.EpxError, match="invalid num_sms = 0: must be >= 1"):
        epx.Config(0)
    with pytest.raises(epx.EpxError, match="invalid num_max_nvl_chunked_recv_tokens = '8': must be an int"):
        epx.Config(20, 6, "8")
    with pytest.raises(epx.EpxError, match="invalid num_max_nvl_chunked_send_tokens = 300: must be <= "
                                           r"num_max_nvl_chunked_recv_tokens \(256\)"):
        epx.Config(20, 300, 256)
    with pytest.raises(epx.EpxError, match="invalid num_max_rdma_chunked_recv_tokens = 0: must be >= 1"):
        epx.Config(20, 6, 256, 6, 0)
    assert epx.Config(20, 256, 256).num_max_nvl_chunked_send_tokens == 256  # a chunk may fill the queue


def test_config_size_hints():
    config = epx.Config()
    assert config.get_nvl_buffer_size_hint(7168 * 2, 8) == epx.normal_nvl_buffer_size_hint(7168 * 2, 8)
    # The hint is the config's: more SMs (channels) or a longer queue need more, the send chunk nothing.
    more_sms, longer = epx.Config(num_sms=24), epx.Config(num_max_nvl_chunked_recv_tokens=512)
    for bigger in (more_sms, longer):
        assert bigger.get_nvl_buffer_size_hint(7168 * 2, 8) == epx.normal_nvl_buffer_size_hint(7168 * 2, 8, bigger)
        assert bigger.get_nvl_buffer_size_hint(7168 * 2, 8) > config.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert epx.Config(20, 1, 256).get_nvl_buffer_size_hint(7168 * 2, 8) == config.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0  # one NVLink domain needs no RDMA buffer
    # Across nodes: the C++ hint (nodes of 8 by default, or ranks_per_node for virtual nodes).
    two_nodes = config.get_rdma_buffer_size_hint(7168 * 2, 16)
    assert two_nodes == config.to_native().get_rdma_buffer_size_hint(7168 * 2, 16, 8) > 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 4, ranks_per_node=2) == two_nodes
    assert epx.Config(num_max_rdma_chunked_recv_tokens=512).get_rdma_buffer_size_hint(7168 * 2, 16) > two_nodes
    with pytest.raises(epx.EpxError, match="invalid num_ranks = 12: must be a multiple of 8 above 8 ranks"):
        config.get_rdma_buffer_size_hint(7168 * 2, 12)
    with pytest.raises(epx.EpxError, match="invalid hidden_bytes = 7: must be a multiple of 16"):
        config.get_nvl_buffer_size_hint(7, 8)


def test_output_window_hint():
    mib = 1 << 20
    # 4,096 tokens x 7,168 from 2 ranks, top-8: recv_x 8,192 x 14,336 bytes = 112 MiB; the top-k ids and weights
    # (0.75 MiB together) share one 2 MiB segment; the window's first segment starts 512-byte aligned.
    assert epx.normal_nvl_output_bytes_hint(4096, 7168, 2, 8) == 114 * mib + 512
    assert epx.normal_nvl_output_bytes_hint(4096, 7168, 2, 8, num_live=2) == 228 * mib + 512
    # FP8: 56 MiB of rows, 1.75 MiB of scales in a 20 MiB segment, the top-k's 2 MiB.
    assert epx.normal_nvl_output_bytes_hint(4096, 7168, 2, 8, fp8=True) == 78 * mib + 512
    # A cached dispatch (no top-k outputs), and no tokens.
    assert epx.normal_nvl_output_bytes_hint(4096, 7168, 2) == 112 * mib + 512
    assert epx.normal_nvl_output_bytes_hint(0, 7168, 2, 8) == 512
    # A slot per peer for every row and its weights, 128-byte aligned, after 128 bytes of flags.
    assert epx.normal_nvl_staging_bytes_hint(4096, 7168, 2, 8) == 128 + 4096 * (7168 * 2 + 32)
    assert epx.normal_nvl_staging_bytes_hint(333, 2048, 4, 4) == 128 + 3 * (-(-333 * 4112 // 128) * 128)
    assert epx.normal_nvl_staging_bytes_hint(4096, 7168, 1, 8) == 0
    with pytest.raises(epx.EpxError, match="invalid num_live = 0: must be >= 1"):
        epx.normal_nvl_output_bytes_hint(4096, 7168, 2, num_live=0)


# ---- DeepEP V1 compatibility: names, signatures, defaults ----


def params(function):
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values() if p.name != "self"]


E = inspect.Parameter.empty


def test_deep_ep_module_names():
    for name in ("Buffer", "Config", "EventOverlap", "EventHandle"):
        assert hasattr(deep_ep, name)
    assert deep_ep.Config is epx.Config and deep_ep.EventOverlap is epx.EventOverlap
    assert deep_ep.EventHandle is epx.EventHandle
    assert params(deep_ep.EventHandle.__init__) == []
    assert params(deep_ep.EventOverlap.__init__) == [("event", None), ("extra_tensors", None)]
    assert params(deep_ep.Config.__init__)[0][0] == "num_sms"
    assert [n for n, _ in params(deep_ep.Config.__init__)] == [
        "num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"]


def test_deep_ep_buffer_signatures():
    B = deep_ep.Buffer
    assert B.num_sms == 20
    assert params(B.__init__) == [
        ("group", E), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
        ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
        ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None), ("use_fabric", False)]
    # DeepEP's branches place use_fabric differently: EPX takes it by keyword only.
    assert inspect.signature(B.__init__).parameters["use_fabric"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params(B.get_local_buffer_tensor) == [("dtype", E), ("size", None), ("offset", 0),
                                                 ("use_rdma_buffer", False)]
    assert params(B.get_dispatch_layout) == [("topk_idx", E), ("num_experts", E), ("previous_event", None),
                                             ("async_finish", False), ("allocate_on_comm_stream", False)]
    assert params(B.dispatch) == [
        ("x", E), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
        ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
        ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None), ("previous_event", None),
        ("async_finish", False), ("allocate_on_comm_stream", False)]
    assert params(B.combine) == [
        ("x", E), ("handle", E), ("topk_weights", None), ("bias", None), ("config", None), ("previous_event", None),
        ("async_finish", False), ("allocate_on_comm_stream", False)]
    assert params(B.low_latency_dispatch) == [
        ("x", E), ("topk_idx", E), ("num_max_dispatch_tokens_per_rank", E), ("num_experts", E),
        ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
        ("round_scale", False), ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)]
    assert params(B.low_latency_combine) == [
        ("x", E), ("topk_idx", E), ("topk_weights", E), ("handle", E), ("use_logfmt", False), ("zero_copy", False),
        ("async_finish", False), ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None)]
    assert params(B.clean_low_latency_buffer) == [("num_max_dispatch_tokens_per_rank", E), ("hidden", E),
                                                  ("num_experts", E)]
    assert params(B.get_next_low_latency_combine_buffer) == [("handle", E)]
    assert params(B.low_latency_update_mask_buffer) == [("rank_to_mask", E), ("mask", False)]
    assert params(B.low_latency_query_mask_buffer) == [("mask_status", E)]
    assert params(B.low_latency_clean_mask_buffer) == []
    assert params(B.get_low_latency_rdma_size_hint) == [("num_max_dispatch_tokens_per_rank", E), ("hidden", E),
                                                        ("num_ranks", E), ("num_experts", E)]
    for name in ("destroy", "get_comm_stream"):
        assert params(getattr(B, name)) == []
    for name in ("set_num_sms", "get_dispatch_config", "get_combine_config", "capture", "is_sm90_compiled",
                 "get_low_latency_rdma_size_hint"):
        assert isinstance(inspect.getattr_static(B, name), staticmethod), name


def test_epx_buffer_mask_signatures():
    B = epx.Buffer
    assert ("enable_shrink", False) in params(B.__init__)
    assert inspect.signature(B.__init__).parameters["enable_shrink"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params(B.low_latency_update_mask_buffer) == [("rank_to_mask", E), ("mask", False)]
    assert params(B.low_latency_query_mask_buffer) == [("mask_status", E)]
    assert params(B.low_latency_clean_mask_buffer) == []
    assert params(B.low_latency_masked_ranks) == []
    assert isinstance(inspect.getattr_static(B, "enable_shrink"), property)


def test_deep_ep_static_helpers():
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 4, 288) == \
        epx.get_low_latency_rdma_size_hint(128, 7168, 4, 288)
    assert deep_ep.Buffer.is_sm90_compiled() == epx.WITH_CUDA
    for num_ranks in (2, 4, 8):
        assert deep_ep.Buffer.get_dispatch_config(num_ranks).num_sms == deep_ep.Buffer.num_sms
        assert deep_ep.Buffer.get_combine_config(num_ranks).num_sms == deep_ep.Buffer.num_sms
    # The recommended configs (DeepEP's chunk sizes, EPX's measured ones at 2 ranks) follow EPX's rules (send chunk
    # <= queue tokens).
    assert deep_ep.Buffer.get_dispatch_config(2) == deep_ep.Config(deep_ep.Buffer.num_sms, 48, 256, 6, 128)
    assert deep_ep.Buffer.get_combine_config(8) == deep_ep.Config(deep_ep.Buffer.num_sms, 4, 256, 6, 128)
    for num_ranks in DEEP_EP_DISPATCH_CONFIGS:
        for config in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)):
            epx._epx.validate_config(config.to_native())
            assert config.num_max_nvl_chunked_send_tokens <= config.num_max_nvl_chunked_recv_tokens


def test_buffers_of_a_build_without_cuda_raise_epx_error(monkeypatch):
    """A build without CUDA (EPX_WITH_CUDA=OFF) has no CUDA runtime part in epx._epx (no Buffer, BufferOptions,
    Event, StreamOrder, ...): the packages import, and making a Buffer or an event raises EpxError saying so,
    before the layer reaches for a missing part. A CUDA build plays one, those parts removed."""
    from types import SimpleNamespace

    import deep_ep as deep_ep_package

    monkeypatch.setattr(epx._epx, "WITH_CUDA", False)
    for name in ("Buffer", "BufferOptions", "Event", "StreamOrder"):
        monkeypatch.delattr(epx._epx, name, raising=False)
    group = SimpleNamespace(rank=lambda: 0, size=lambda: 1)
    makers = (lambda: epx.Buffer(group, 1 << 20), lambda: epx.Buffer(bootstrap=(0, 1, None, None)),
              lambda: deep_ep_package.Buffer(group, 1 << 20, 1 << 20, low_latency_mode=True),
              deep_ep_package.Buffer.capture, epx.EventHandle)
    for make in makers:
        with pytest.raises(epx.EpxError, match=r"built without CUDA \(EPX_WITH_CUDA=OFF\)"):
            make()
    assert deep_ep_package.Buffer.is_sm90_compiled() is False
    old = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(24)
        assert deep_ep.Buffer.num_sms == 24 and deep_ep.Buffer.get_dispatch_config(8).num_sms == 24
        with pytest.raises(epx.EpxError, match="invalid new_num_sms = 25: must be even"):
            deep_ep.Buffer.set_num_sms(25)
    finally:
        deep_ep.Buffer.num_sms = old


# DeepEP v1.2.1's deep_ep/buffer.py: get_dispatch_config / get_combine_config, after Buffer.num_sms; at 2 ranks the
# send chunks EPX's measurements chose (48 for dispatch, 16 for combine; DeepEP's: 24 and 10).
DEEP_EP_DISPATCH_CONFIGS = {
    2: (48, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
    144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
DEEP_EP_COMBINE_CONFIGS = {
    2: (16, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
    144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


def test_cpp_recommended_configs_are_deep_eps():
    """epx::recommended_config (the Buffer's first config, epx-bench's) holds the same table as deep_ep."""
    for op, table in (("dispatch", DEEP_EP_DISPATCH_CONFIGS), ("combine", DEEP_EP_COMBINE_CONFIGS)):
        for num_ranks, fields in table.items():
            config = epx._epx.recommended_config(op, num_ranks, 24)
            assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                    config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (24, *fields)
    default = epx._epx.Config()
    assert epx._epx.recommended_config("dispatch", 3, 8).num_max_nvl_chunked_send_tokens == \
        default.num_max_nvl_chunked_send_tokens
    with pytest.raises(epx.EpxError, match="invalid op = send: must be dispatch or combine"):
        epx._epx.recommended_config("send", 2, 24)


def test_cpp_recommended_configs_by_gpu_kind():
    """On H200 the 2-rank chunks follow the SM budget; H100 and other GPUs keep the table's."""
    def chunk(op, num_ranks, num_sms, kind):
        return epx._epx.recommended_config(op, num_ranks, num_sms, kind).num_max_nvl_chunked_send_tokens

    assert [chunk("combine", 2, num_sms, "H200") for num_sms in (8, 20, 24, 28, 32)] == [32, 32, 16, 8, 8]
    assert [chunk("dispatch", 2, num_sms, "H200") for num_sms in (8, 24, 28, 32, 40)] == [48, 48, 48, 32, 32]
    for kind in ("H100", "other"):
        assert [chunk("combine", 2, num_sms, kind) for num_sms in (8, 16, 24, 32)] == [16] * 4
        assert [chunk("dispatch", 2, num_sms, kind) for num_sms in (8, 16, 24, 32)] == [48] * 4
    assert chunk("combine", 8, 32, "H200") == 4
    with pytest.raises(epx.EpxError, match="invalid gpu_kind = A100: must be H100, H200 or other"):
        epx._epx.recommended_config("combine", 2, 24, "A100")


@pytest.mark.parametrize("num_sms", [20, 24])
def test_deep_ep_config_tables_match_deep_ep(num_sms):
    old = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(num_sms)
        assert sorted(DEEP_EP_DISPATCH_CONFIGS) == sorted(DEEP_EP_COMBINE_CONFIGS)
        for num_ranks, fields in DEEP_EP_DISPATCH_CONFIGS.items():
            assert deep_ep.Buffer.get_dispatch_config(num_ranks) == deep_ep.Config(num_sms, *fields), num_ranks
        for num_ranks, fields in DEEP_EP_COMBINE_CONFIGS.items():
            assert deep_ep.Buffer.get_combine_config(num_ranks) == deep_ep.Config(num_sms, *fields), num_ranks
    finally:
        deep_ep.Buffer.num_sms = old


@pytest.mark.parametrize("num_ranks", [0, 1, 3, 6, 12, 48, 96, 256])
def test_deep_ep_configs_for_unlisted_rank_counts_raise(num_ranks):
    # DeepEP asserts 'Unsupported number of EP ranks'; EPX raises EpxError naming the counts it lists.
    for getter, kind in ((deep_ep.Buffer.get_dispatch_config, "dispatch"),
                         (deep_ep.Buffer.get_combine_config, "combine")):
        with pytest.raises(epx.EpxError, match=rf"invalid num_ranks = {num_ranks}: DeepEP has no recommended {kind} "
                                               r"config for this many ranks \(it lists \[2, 4, 8, 16, 24, 32, 64, "
                                               r"128, 144, 160\]\)"):
            getter(num_ranks)


# ---- EventOverlap ----


def test_event_overlap_without_event_is_a_no_op():
    event = epx.EventOverlap()
    event.current_stream_wait()
    with event as inside:
        assert inside is event
    assert event.event is None and event.extra_tensors is None

    class Empty:  # an empty C++ Event reads as "no event"
        valid = False

    assert epx.EventOverlap(Empty()).event is None


# ---- With torch on the CPU ----


def test_buffer_calls_check_arguments_before_the_runtime():
    torch = pytest.importorskip("torch")
    buffer = object.__new__(epx.Buffer)  # no runtime needed: the checks come first
    buffer.num_ranks, buffer.rank = 2, 0
    # What the torch extension's paths read before they decline a CPU tensor (the Python path then raises).
    buffer.runtime, buffer._device_index, buffer._comm_stream_handle = SimpleNamespace(ranks_per_node=2), 0, 0
    with pytest.raises(epx.EpxError, match=r"invalid x.device = cpu: must be a CUDA device"):
        buffer.dispatch(torch.zeros(4, 128, dtype=torch.bfloat16))
    with pytest.raises(epx.EpxError, match=r"invalid topk_idx.device = cpu"):
        buffer.get_dispatch_layout(torch.zeros(4, 2, dtype=torch.int64), 8)
    with pytest.raises(epx.EpxError, match=r"invalid x = a tuple of 3"):
        buffer.dispatch((1, 2, 3))


def test_reference_torch_bridges():
    torch = pytest.importorskip("torch")
    import numpy as np

    import epx_tools.reference as ref

    values = torch.tensor([[1.0, -2.5], [0.125, 3.0]], dtype=torch.bfloat16)
    bits = ref.bf16_bits(values)
    np.testing.assert_array_equal(ref.bf16_to_float(bits), values.float().numpy())
    assert torch.equal(ref.to_torch_bf16(bits), values)
    fp8 = torch.tensor([0.5, -1.0, 448.0]).to(torch.float8_e4m3fn)
    assert torch.equal(ref.to_torch_fp8(ref.fp8_bytes(fp8)).float(), fp8.float())


def test_permute_unpermute_match_a_dense_computation():
    torch = pytest.importorskip("torch")
    import epx.training as training

    generator = torch.Generator().manual_seed(0)
    num_rows, hidden, num_topk, num_local = 13, 16, 3, 4
    recv_x = torch.randn(num_rows, hidden, generator=generator).to(torch.bfloat16).requires_grad_()
    recv_idx = torch.randint(-1, num_local, (num_rows, num_topk), generator=generator)
    recv_weights = torch.rand(num_rows, num_topk, generator=generator).masked_fill(recv_idx < 0, 0).requires_grad_()
    scale = torch.arange(1, num_local + 1, dtype=torch.float32)

    rows, probs, info = training.permute(recv_x, recv_idx, num_local, recv_weights)
    counts = info.num_tokens_per_expert.tolist()
    assert counts == [int((recv_idx == e).sum()) for e in range(num_local)]
    expert_of_row = torch.repeat_interleave(torch.arange(num_local), torch.tensor(counts))
    # Rows of each expert keep the received order.
    for e in range(num_local):
        assert info.row_idx[expert_of_row == e].tolist() == sorted(info.row_idx[expert_of_row == e].tolist())
    out = training.unpermute(rows.float() * scale[expert_of_row].unsqueeze(1), info, probs)

    dense = torch.zeros(num_rows, hidden)
    for k in range(num_topk):
        selected = recv_idx[:, k] >= 0
        factor = torch.where(selected, recv_weights[:, k] * scale[recv_idx[:, k].clamp(min=0)], 0)
        dense = dense + recv_x.float() * factor.unsqueeze(1)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)

    target = torch.randn(num_rows, hidden, generator=generator)
    (grad_x, grad_w) = torch.autograd.grad((out * target).sum(), (recv_x, recv_weights))
    (ref_x, ref_w) = torch.autograd.grad((dense * target).sum(), (recv_x, recv_weights))
    torch.testing.assert_close(grad_x.float(), ref_x.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-4, atol=1e-4)
