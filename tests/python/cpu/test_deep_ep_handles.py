"""deep_ep's handles and inputs as DeepEP callers use them, on the CPU with one rank (fake_runtime.py): the
handle tuples' elements (read as DeepEP's tests read them) and their way back into cached dispatch and combine,
FP8 scales as callers produce them, int32 top-k ids and tokens of other dtypes. Skipped without torch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
import epx.compat.deep_ep as deep_ep  # noqa: E402
import epx_tools.reference as ref  # noqa: E402
from fake_runtime import install  # noqa: E402

HIDDEN = 256
NUM_EXPERTS = 4
NUM_TOPK = 2


@pytest.fixture
def wrapper(monkeypatch):
    buffer, _ = install(monkeypatch)
    wrapper = object.__new__(deep_ep.Buffer)
    wrapper.rank, wrapper.group_size, wrapper.group = 0, 1, None
    wrapper.explicitly_destroy = True
    wrapper.runtime = buffer
    return wrapper


def tokens(seed=0):
    x = ref.native.random_bf16_tokens(seed, 6, HIDDEN, 0).reshape(6, HIDDEN)
    ids = np.array([[0, 1], [2, -1], [-1, -1], [3, 0], [1, 2], [-1, 3]], dtype=np.int64)
    weights = ref.native.random_topk_weights(seed, 6, NUM_TOPK).reshape(6, NUM_TOPK)
    return ref.to_torch_bf16(x), torch.from_numpy(ids), torch.from_numpy(weights)


KEPT = [0, 1, 3, 4, 5]  # tokens with at least one expert (all on rank 0)


def dispatch(wrapper, x, ids, weights):
    return wrapper.dispatch(x, topk_idx=ids, topk_weights=weights, num_tokens_per_expert=torch.zeros(NUM_EXPERTS,
                                                                                                     dtype=torch.int32))


# ---- Normal-mode handle ----


def test_normal_handle_is_deep_eps_tuple(wrapper):
    x, ids, weights = tokens()
    recv_x, _, recv_w, _, handle, _ = dispatch(wrapper, x, ids, weights)
    assert type(handle) is tuple and len(handle) == 6
    rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head = handle
    num_channels = deep_ep.Buffer.num_sms // 2
    assert rank_prefix.dtype == torch.int32 and rank_prefix.shape == (1, 1)
    # As DeepEP's tests read it: rows from ranks 0..i in column `rank`.
    assert rank_prefix[0][wrapper.rank].item() == recv_x.size(0) == len(KEPT)
    assert channel_prefix.dtype == torch.int32 and channel_prefix.shape == (1, num_channels)
    assert bool((channel_prefix == -1).all())  # documented placeholder
    assert recv_channel_prefix.dtype == torch.int32 and recv_channel_prefix.shape == (1, num_channels)
    assert recv_channel_prefix[0, 0].item() == 0 and bool((recv_channel_prefix.diff(dim=1) >= 0).all())
    assert recv_src_idx.dtype == torch.int32 and recv_src_idx.tolist() == KEPT
    assert in_rank.dtype == torch.bool and in_rank[:, 0].tolist() == [t in KEPT for t in range(6)]
    assert send_head.dtype == torch.int32 and send_head.shape == (6, 1)
    assert send_head[2, 0].item() == -1 and bool((send_head[KEPT, 0] >= 0).all())


def test_handle_tuples_pass_back_even_rebuilt(wrapper):
    x, ids, weights = tokens()
    recv_x, _, recv_w, _, handle, _ = dispatch(wrapper, x, ids, weights)
    combined, combined_w, _ = wrapper.combine(recv_x, handle, topk_weights=recv_w)
    rebuilt = tuple(list(handle))  # e.g. a framework that stores the elements and packs them again
    again, again_w, _ = wrapper.combine(recv_x, rebuilt, topk_weights=recv_w)
    assert torch.equal(again, combined) and torch.equal(again_w, combined_w)
    cached = wrapper.dispatch(x, rebuilt)
    assert torch.equal(cached[0], recv_x) and cached[4] is None
    with pytest.raises(epx.EpxError, match="must be the handle tuple dispatch returned"):
        wrapper.combine(recv_x, (torch.zeros(1, 1, dtype=torch.int32),) + handle[1:])


# ---- Normal-mode handle across nodes ----
#
# 4 ranks as 2 nodes of 2, 2 channels, 5 tokens of this rank (rank 0): channel 0 holds tokens 0-2, channel 1
# tokens 3-4 (ceil(5 / 2) per channel). The counts as the count exchange leaves them: rows received per (source
# rank, channel) and records forwarded per (source node, channel).
IN_RANK = [[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
RECV_CHANNEL_OFFSET = [0, 3, 4, 4, 4, 6, 7, 8, 9]  # [R * C + 1]: source 1 sent nothing; 9 rows
NODE_CHANNEL_OFFSET = [0, 2, 3, 3, 5]  # [N * C + 1]: 5 records forwarded
SEND_HEAD = [[0, -1], [-1, 0], [1, 1], [-1, 0], [-1, -1]]  # [T, N]


def internode_handle(binding):
    """An epx DispatchHandle across nodes whose arrays are CPU tensors (read through the fake device_view)."""
    from epx.results import DispatchHandle
    from fake_runtime import Struct

    arrays = {"recv_channel_offset": torch.tensor(RECV_CHANNEL_OFFSET, dtype=torch.int32),
              "node_channel_offset": torch.tensor(NODE_CHANNEL_OFFSET, dtype=torch.int32),
              "is_token_in_rank": torch.tensor(IN_RANK, dtype=torch.uint8),
              "send_head": torch.tensor(SEND_HEAD, dtype=torch.int32),
              "forward_mask": torch.tensor([1, 3, 2, 2, 1], dtype=torch.uint8),
              "recv_src_idx": torch.arange(9, dtype=torch.int32)}
    native = Struct(arrays=arrays, num_channels=2, num_nodes=2, num_forward_records=5, num_recv_per_rank=[4, 0, 3, 2],
                    **{name: binding.pointer(tensor) for name, tensor in arrays.items()})
    return DispatchHandle(native=native, buffer_id=0, num_tokens=5, num_recv_rows=9, hidden=HIDDEN,
                          num_experts=8, num_topk=0, num_worst_tokens=0, num_ranks=4,
                          _owner=Struct(device=torch.device("cpu")))


def test_internode_handle_is_deep_eps_tuple(monkeypatch):
    from epx.compat.deep_ep_handles import NormalHandleBuilder, normal_handle

    _, binding = install(monkeypatch)
    handle = internode_handle(binding)
    builder = NormalHandleBuilder()
    builder(handle)  # after the count exchange
    got = builder.tuple_for(handle)
    assert type(got) is tuple and len(got) == 10
    (in_rank, rdma_prefix, gbl_prefix, recv_rdma_prefix, recv_rdma_rank_prefix_sum, recv_gbl_prefix,
     recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head) = got
    int32 = torch.int32
    assert in_rank.dtype == torch.bool and in_rank.int().tolist() == IN_RANK
    # Send side: tokens of channels 0..c per node (once per node) and per rank.
    assert rdma_prefix.dtype == int32 and rdma_prefix.tolist() == [[2, 2], [2, 3]]
    assert gbl_prefix.dtype == int32 and gbl_prefix.tolist() == [[2, 2], [1, 1], [2, 2], [1, 2]]
    # Receive side, as the rail peer: records per source node, channels 0..c, and per node 0..n.
    assert recv_rdma_prefix.dtype == int32 and recv_rdma_prefix.tolist() == [[2, 3], [0, 2]]
    assert recv_rdma_rank_prefix_sum.dtype == int32 and recv_rdma_rank_prefix_sum.tolist() == [3, 5]
    # Receive side, rows: first row of each (source rank, channel); rows from ranks 0..r.
    assert recv_gbl_prefix.dtype == int32 and recv_gbl_prefix.tolist() == [[0, 3], [4, 4], [4, 6], [7, 8]]
    assert recv_gbl_rank_prefix_sum.dtype == int32 and recv_gbl_rank_prefix_sum.tolist() == [4, 4, 7, 9]
    # Source metadata: 8 bytes per row, the source's node then a -1 placeholder.
    assert recv_src_meta.dtype == torch.uint8 and recv_src_meta.shape == (9, 8)
    meta = recv_src_meta.view(int32).view(9, 2)
    assert meta[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1] and bool((meta[:, 1] == -1).all())
    assert send_rdma_head.dtype == int32 and send_rdma_head.tolist() == SEND_HEAD
    assert send_nvl_head.dtype == int32 and send_nvl_head.shape == (5, 8) and bool((send_nvl_head == -1).all())
    # As DeepEP's tests read it: the rows of source i end at recv_gbl_rank_prefix_sum[i].
    begin, sources = 0, []
    for i in range(4):
        end = recv_gbl_rank_prefix_sum[i].item()
        sources += [i] * (end - begin)
        begin = end
    assert sources == [0, 0, 0, 0, 2, 2, 2, 3, 3]
    # It passes back (cached dispatch and combine find EPX's handle), also rebuilt from its tensors.
    assert normal_handle(got) is handle and normal_handle(tuple(list(got))) is handle
    assert handle.forward_mask.tolist() == [1, 3, 2, 2, 1]
    assert handle.node_channel_offset.tolist() == NODE_CHANNEL_OFFSET


def test_internode_matrices_without_tokens(monkeypatch):
    from epx.compat.deep_ep_handles import internode_matrices

    _, binding = install(monkeypatch)
    handle = internode_handle(binding)
    handle.native.arrays["is_token_in_rank"] = empty = torch.zeros(0, 4, dtype=torch.uint8)
    handle.native.is_token_in_rank = binding.pointer(empty)
    handle.num_tokens = 0
    rdma_prefix, gbl_prefix, *_ = internode_matrices(handle, 2)
    assert rdma_prefix.tolist() == [[0, 0], [0, 0]] and gbl_prefix.shape == (4, 2) and not gbl_prefix.any()


def test_low_latency_handle_is_deep_eps_tuple(wrapper):
    x, ids, weights = tokens()
    max_tokens = 8
    recv_x, _, handle, _, _ = wrapper.low_latency_dispatch(x, ids, max_tokens, NUM_EXPERTS, use_fp8=False)
    assert type(handle) is tuple and len(handle) == 5
    src_info, layout_range, num_max_tokens, hidden, num_experts = handle
    assert (num_max_tokens, hidden, num_experts) == (max_tokens, HIDDEN, NUM_EXPERTS)
    assert src_info.dtype == torch.int32 and src_info.shape == (NUM_EXPERTS, max_tokens)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (NUM_EXPERTS, 1)
    combined, _, _ = wrapper.low_latency_combine(recv_x, ids, weights, handle)
    again, _, _ = wrapper.low_latency_combine(recv_x, ids, weights, tuple(list(handle)))
    assert torch.equal(again, combined)
    # zero_copy with the caller's own x: only its shape counts, as in DeepEP.
    with pytest.raises(epx.EpxError, match=r"x.shape"):
        wrapper.low_latency_combine(recv_x[:, :4], ids, weights, handle, zero_copy=True)


# ---- Inputs as callers produce them ----


def fp8_tokens(x):
    return x.float().to(torch.float8_e4m3fn)


@pytest.mark.parametrize("layout", ["column-major", "per-token", "ue8m0-packed"])
def test_fp8_scales_as_callers_produce_them(wrapper, layout):
    x, ids, weights = tokens()
    rows = torch.arange(6, dtype=torch.float32)[:, None]
    if layout == "column-major":  # DeepGEMM-style: [T, H/128] with the token index fastest
        scales = (rows + torch.arange(HIDDEN // 128)).t().contiguous().t()
        assert not scales.is_contiguous()
    elif layout == "per-token":
        scales = rows + 0.5
    else:  # UE8M0 exponents packed four to an int32, [T, ceil(H / 512)]
        scales = (torch.arange(6, dtype=torch.int32) + 0x7F7F7F70)[:, None]
        assert scales.shape == (6, (HIDDEN + 511) // 512)
    (recv_x, recv_scales), *_ = dispatch(wrapper, (fp8_tokens(x), scales), ids, weights)
    assert recv_x.dtype == torch.float8_e4m3fn and recv_scales.dtype == scales.dtype
    assert recv_scales.shape == (len(KEPT), scales.size(1)) and recv_scales.is_contiguous()
    assert torch.equal(recv_scales, scales[KEPT])


def test_int32_topk_idx(wrapper):
    x, ids, weights = tokens()
    expected = dispatch(wrapper, x, ids, weights)
    got = dispatch(wrapper, x, ids.int(), weights)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    layout = wrapper.get_dispatch_layout(ids.int(), NUM_EXPERTS)
    assert torch.equal(layout[3], wrapper.get_dispatch_layout(ids, NUM_EXPERTS)[3])


def test_tokens_of_another_dtype_move_as_bytes(wrapper):
    x, ids, weights = tokens()
    wide = x.float()  # 1 KiB rows: moved as raw bytes, viewed back
    recv_x, *_ = dispatch(wrapper, wide, ids, weights)
    assert recv_x.dtype == torch.float32 and torch.equal(recv_x, wide[KEPT])
    with pytest.raises(epx.EpxError, match=r"rows must be a multiple of 16 bytes"):
        dispatch(wrapper, torch.zeros(6, 12, dtype=torch.float16), ids, weights)


def test_intranode_tuple_views_the_matrices_the_count_exchange_wrote():
    """Rank 1 of 2, 3 channels: the tuple's first three elements are views of the handle's deep_ep_matrices block
    (written by the notify kernel; its arithmetic is tests/cpu/test_deep_ep_matrices.cpp's), shaped [R, R], [R, C],
    [R, C]; the first carries EPX's handle."""
    from types import SimpleNamespace

    from epx.compat.deep_ep_handles import normal_handle, normal_handle_tuple
    from epx.results import DispatchHandle

    block = torch.tensor([-1, 5, -1, 11] + [-1] * 6 + [0, 2, 2, 0, 1, 4], dtype=torch.int32)
    native = SimpleNamespace(deep_ep_matrices=1, num_nodes=1, num_channels=3)
    handle = DispatchHandle(native=native, buffer_id=0, num_tokens=4, num_recv_rows=11, hidden=HIDDEN, num_experts=8,
                            num_topk=0, num_worst_tokens=0, num_ranks=2)
    handle._view = lambda address, dtype, shape: block.view(shape)
    for name, value in (("recv_src_idx", "src"), ("is_token_in_rank", "in_rank"), ("send_head", "head")):
        handle.__dict__[name] = value
    got = normal_handle_tuple(handle)
    rank_prefix, channel_prefix, recv_channel_prefix = got[:3]
    assert rank_prefix.tolist() == [[-1, 5], [-1, 11]]
    assert channel_prefix.tolist() == [[-1, -1, -1], [-1, -1, -1]]
    assert recv_channel_prefix.tolist() == [[0, 2, 2], [0, 1, 4]]
    assert all(m.is_contiguous() for m in got[:3])
    assert got[3:] == ("src", "in_rank", "head") and normal_handle(got) is handle
