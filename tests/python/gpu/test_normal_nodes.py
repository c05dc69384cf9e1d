"""Normal mode across nodes through epx.compat.deep_ep, on virtual nodes (EPX_RANKS_PER_NODE below the group
size; ranks may share one GPU): the layout's per-node counts, BF16 and FP8 dispatch, combine with weights and
biases in the across-nodes reduction order, the cached handle. Bit-exact against the CPU reference."""

import os

import numpy as np
import pytest

from dist_util import run
from test_normal import HIDDEN, check_dispatch, make_inputs, random_rows, to_device


def check_internode_handle(handle, expected, in_rank, num_ranks, ranks_per_node, num_channels):
    """DeepEP's internode handle tuple, read as DeepEP's tests and its internode_dispatch / internode_combine read
    it (epx.compat.deep_ep_handles documents each element)."""
    import torch

    num_nodes = num_ranks // ranks_per_node
    num_tokens = in_rank.size(0)
    assert type(handle) is tuple and len(handle) == 10
    (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
     recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
     send_rdma_head, send_nvl_head) = handle
    assert torch.equal(is_token_in_rank, in_rank)
    # As DeepEP's test_internode.py reads it (handle[-4]): rows of source i end at recv_gbl_rank_prefix_sum[i].
    recv_gbl_rank_prefix_sum = handle[-4]
    per_source = list(expected.num_recv_tokens_per_rank)
    assert recv_gbl_rank_prefix_sum.dtype == torch.int32 and recv_gbl_rank_prefix_sum.shape == (num_ranks,)
    assert recv_gbl_rank_prefix_sum.tolist() == np.cumsum(per_source).tolist()
    for name, tensor, shape in (("rdma_channel_prefix_matrix", rdma_channel_prefix_matrix, (num_nodes, num_channels)),
                                ("gbl_channel_prefix_matrix", gbl_channel_prefix_matrix, (num_ranks, num_channels)),
                                ("recv_rdma_channel_prefix_matrix", recv_rdma_channel_prefix_matrix,
                                 (num_nodes, num_channels)),
                                ("recv_rdma_rank_prefix_sum", recv_rdma_rank_prefix_sum, (num_nodes,)),
                                ("recv_gbl_channel_prefix_matrix", recv_gbl_channel_prefix_matrix,
                                 (num_ranks, num_channels)),
                                ("send_rdma_head", send_rdma_head, (num_tokens, num_nodes)),
                                ("send_nvl_head", send_nvl_head, (send_nvl_head.size(0), 8))):
        assert tensor.dtype == torch.int32 and tuple(tensor.shape) == shape, name
    # Send side: the last channel's prefix is the tokens per rank / per node (a token once per node).
    in_node = in_rank.view(num_tokens, num_nodes, ranks_per_node).any(2)
    assert gbl_channel_prefix_matrix[:, -1].tolist() == in_rank.sum(0).tolist()
    assert rdma_channel_prefix_matrix[:, -1].tolist() == in_node.sum(0).tolist()
    assert torch.equal(send_rdma_head >= 0, in_node)
    # Receive side: source r's channels start at the rows of ranks before it; records add up per node.
    starts = [0] + recv_gbl_rank_prefix_sum.tolist()[:-1]
    assert recv_gbl_channel_prefix_matrix[:, 0].tolist() == starts
    assert recv_rdma_rank_prefix_sum[-1].item() == send_nvl_head.size(0)
    assert torch.equal(recv_rdma_rank_prefix_sum.diff(prepend=recv_rdma_rank_prefix_sum.new_zeros(1)),
                       recv_rdma_channel_prefix_matrix[:, -1])
    # recv_src_meta: 8 bytes per row, the source rank's node first.
    rows = sum(per_source)
    assert recv_src_meta.dtype == torch.uint8 and tuple(recv_src_meta.shape) == (rows, 8)
    source_nodes = np.repeat(np.arange(num_ranks) // ranks_per_node, per_source)
    assert recv_src_meta.view(torch.int32).view(rows, 2)[:, 0].tolist() == source_nodes.tolist()


def dispatch_and_combine(buffer, rank, num_ranks, ranks_per_node, seed, device):
    """Layout, dispatch and combine (weights, a bias) of seeded inputs, each checked against the reference.
    Returns what the worker checks further: the handle, the combine's inputs and outputs."""
    import epx_tools.reference as ref

    num_experts = 8 * num_ranks
    inputs = make_inputs(num_ranks, num_experts, seed)
    x, topk_idx, topk_weights = to_device(inputs[rank], device)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    exp_rank, _, exp_in_rank = ref.dispatch_layout(inputs[rank].topk_idx, num_experts, num_ranks)
    np.testing.assert_array_equal(per_rank.cpu().numpy(), exp_rank)
    nodes = exp_in_rank.reshape(len(exp_in_rank), num_ranks // ranks_per_node, ranks_per_node).any(axis=2)
    np.testing.assert_array_equal(per_rdma.cpu().numpy(), nodes.sum(axis=0))

    outputs, ref_handle = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN,
                                              expert_alignment=4)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=4)
    check_dispatch(outputs[rank], recv_x, recv_idx, recv_w, counts)
    check_internode_handle(handle, outputs[rank], in_rank, num_ranks, ranks_per_node, type(buffer).num_sms // 2)

    expert_out = [random_rows(seed * 7 + d, outputs[d].num_rows, d) for d in range(num_ranks)]
    bias0 = [random_rows(seed * 11 + r, len(inputs[r].topk_idx), r) for r in range(num_ranks)]
    expected = ref.normal_combine(ref_handle, expert_out, topk_weights=[o.recv_topk_weights for o in outputs],
                                  bias0=bias0, ranks_per_node=ranks_per_node)[rank]
    combined, combined_w, _ = buffer.combine(ref.to_torch_bf16(expert_out[rank], device), handle, topk_weights=recv_w,
                                             bias=ref.to_torch_bf16(bias0[rank], device))
    np.testing.assert_array_equal(ref.bf16_bits(combined), expected[0])
    np.testing.assert_array_equal(combined_w.cpu().numpy(), expected[1])

    return handle, expert_out, bias0, recv_w, combined, combined_w


def nodes_worker(rank, num_ranks, group, ranks_per_node, seed):
    os.environ["EPX_RANKS_PER_NODE"] = str(ranks_per_node)
    import torch

    import epx.compat.deep_ep as deep_ep
    import epx_tools.reference as ref

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 8 * num_ranks
    config = deep_ep.Config()
    buffer = deep_ep.Buffer(group, num_nvl_bytes=config.get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks),
                            num_rdma_bytes=config.get_rdma_buffer_size_hint(HIDDEN * 2, num_ranks, ranks_per_node),
                            explicitly_destroy=True)
    assert buffer.runtime.get_num_rdma_ranks() == num_ranks // ranks_per_node

    handle, expert_out, bias0, recv_w, combined, combined_w = dispatch_and_combine(buffer, rank, num_ranks,
                                                                                  ranks_per_node, seed, device)
    # The tuple rebuilt from its tensors passes back too (a framework that stores the elements).
    again, again_w, _ = buffer.combine(ref.to_torch_bf16(expert_out[rank], device), tuple(list(handle)),
                                       topk_weights=recv_w, bias=ref.to_torch_bf16(bias0[rank], device))
    assert torch.equal(again, combined) and torch.equal(again_w, combined_w)

    # Cached handle: new tokens, the same routing.
    fresh = make_inputs(num_ranks, num_experts, seed)
    for r, item in enumerate(fresh):
        item.x = random_rows(seed * 19 + r, len(item.topk_idx), r)
    cached_outputs, _ = ref.normal_dispatch(fresh, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN)
    result = buffer.dispatch(ref.to_torch_bf16(fresh[rank].x, device), handle=handle)
    check_dispatch(cached_outputs[rank], result[0], None, None, None)

    # FP8 with scales.
    fp8_inputs = make_inputs(num_ranks, num_experts, seed + 1, fp8=True)
    fp8_outputs, _ = ref.normal_dispatch(fp8_inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=HIDDEN,
                                         fp8=True)
    fx, fidx, fw = to_device(fp8_inputs[rank], device)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(fidx, num_experts)
    recv_x, recv_idx, recv_w, counts, _, _ = buffer.dispatch(
        fx, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=fidx, topk_weights=fw)
    check_dispatch(fp8_outputs[rank], recv_x, recv_idx, recv_w, counts)

    torch.cuda.synchronize()
    buffer.destroy()


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(2, 1), (4, 2), (4, 1)], ids=["2x1", "2x2", "4x1"])
def test_normal_mode_across_nodes(num_ranks, ranks_per_node):
    run(nodes_worker, num_ranks, ranks_per_node, 5)


def mixed_worker(rank, num_ranks, group, ranks_per_node, seed):
    """SGLang's way with DeepEP: one Buffer, sized with the larger of the two hints, serves normal calls (prefill)
    and low-latency calls (decode). A low-latency call right after normal ones is refused until every rank
    called clean_low_latency_buffer; normal calls need nothing after low-latency ones."""
    os.environ["EPX_RANKS_PER_NODE"] = str(ranks_per_node)
    import torch

    import epx
    import epx.compat.deep_ep as deep_ep
    from test_low_latency import HIDDEN as LL_HIDDEN
    from test_low_latency import MAX_TOKENS, Case, World, one_round

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 8 * num_ranks
    config = deep_ep.Config()
    num_rdma_bytes = max(config.get_rdma_buffer_size_hint(HIDDEN * 2, num_ranks, ranks_per_node),
                         deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, LL_HIDDEN, num_ranks, num_experts))
    buffer = deep_ep.Buffer(group, num_nvl_bytes=config.get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks),
                            num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True)
    case = Case(use_fp8=True)
    for step in range(2):
        dispatch_and_combine(buffer, rank, num_ranks, ranks_per_node, seed + step, device)
        world = World(num_ranks, num_experts, seed * 10 + step, case)
        with pytest.raises(epx.EpxError, match="clean_low_latency_buffer"):
            one_round(buffer, world, rank, num_experts, case, device)
        buffer.clean_low_latency_buffer(MAX_TOKENS, LL_HIDDEN, num_experts)
        one_round(buffer, world, rank, num_experts, case, device)
    torch.cuda.synchronize()
    buffer.destroy()


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_normal_and_low_latency_calls_share_one_buffer(num_ranks, ranks_per_node):
    import epx

    if not epx.WITH_NVSHMEM:
        pytest.skip("epx was built without the NVSHMEM transport")
    run(mixed_worker, num_ranks, ranks_per_node, 7)
