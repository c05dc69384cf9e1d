"""vLLM- and SGLang-style call sequences on EPX's deep_ep, on 2 and 4 ranks (or ranks sharing one GPU), each
checked bit-exactly against the CPU reference (epx_tools.reference, through call_site_data.py).

Written from how those frameworks call DeepEP V1 (what they pass, by keyword where they do, and in what order),
not copied from them:

- vLLM, high throughput (the deepep_ht prepare / finalize and the all2all manager that builds its Buffer): a
  Buffer over a Gloo group of a fixed size in MiB, layout and dispatch by keyword with the recommended config,
  BF16 or FP8 with block or per-token scales, Buffer.capture() as previous_event and an event waited on only
  when there is one, a rank that receives nothing, worst-case rows (num_worst_tokens), local expert ids mapped
  back to global ones, the experts' rows reduced locally and combined without weights into the caller's output.
- vLLM, low latency (deepep_ll, dual-batch overlap): two micro-batches dispatched with receive hooks before
  either is received, FP8 with round_scale / UE8M0-packed scales, combines into `out=` with and without a hook.
- SGLang (the DeepEP token dispatcher in auto mode): one Buffer for both modes, sized from the configs' hints for
  its dispatch dtype (one byte per channel for FP8) and the low-latency hint; normal mode with Buffer.capture()
  events, allocation on the comm stream, expert_alignment=128, FP8 scales as DeepGEMM lays them out
  (column-major, TMA-aligned, UE8M0 packed), explicit configs; clean_low_latency_buffer when it switches to low
  latency; low-latency dispatch / combine by keyword, with hooks or async events, statistics and zero-copy
  combine through get_next_low_latency_combine_buffer."""

import gc

import numpy as np
import pytest

from call_site_data import EXPERTS_PER_RANK, HIDDEN, LowLatencyWorld, NormalWorld, device_expert, expert
from dist_util import gpu_counts, run

NORMAL_TOKENS = (96, 70, 0, 33)  # per rank (cycled); a rank with no tokens, as in a DP step with nothing to do
LL_MAX_TOKENS = 64  # vLLM's max tokens per rank / SGLang's num_max_dispatch_tokens_per_rank
LL_TOKENS = ((64, 40, 1, 0), (17, 64, 0, 5))  # two micro-batches
DEEP_EP_RANK_COUNTS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)  # ranks DeepEP has recommended configs for


def per_rank(counts, num_ranks):
    return [counts[r % len(counts)] for r in range(num_ranks)]


def device():
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def gloo_group():
    """vLLM builds its Buffers over its CPU (Gloo) group."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


# ---- vLLM: high throughput ----

VLLM_BUFFER_MIB = 128  # VLLM_DEEPEP_BUFFER_SIZE_MB-style fixed size
VLLM_HT_ROUNDS = [
    dict(fp8_kind=None, capture=False, idle_rank=False, worst=False),
    dict(fp8_kind="row-major", capture=True, idle_rank=True, worst=False),
    dict(fp8_kind="per-token", capture=False, idle_rank=False, worst=True),
    dict(fp8_kind=None, capture=True, idle_rank=False, worst=True),
]


def vllm_high_throughput_worker(rank, num_ranks, group):
    import torch

    import deep_ep
    import epx_tools.reference as ref

    deep_ep.Buffer.set_num_sms(16)  # vLLM's manager may lower the SM budget (never raise it)
    buffer = deep_ep.Buffer(group=gloo_group(), num_nvl_bytes=VLLM_BUFFER_MIB << 20, num_rdma_bytes=0,
                            low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    configs = (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)) \
        if num_ranks in DEEP_EP_RANK_COUNTS else (None, None)
    for i, case in enumerate(VLLM_HT_ROUNDS):
        num_tokens = per_rank(NORMAL_TOKENS, num_ranks)
        worst = max(num_tokens) * num_ranks if case["worst"] else 0
        world = NormalWorld(num_ranks, num_tokens, 100 + i, fp8_kind=case["fp8_kind"], idle_rank=case["idle_rank"],
                            num_worst_tokens=worst)
        x, topk_ids, topk_weights = world.inputs(rank, device())

        # prepare: layout, then dispatch, both after the compute stream's event when one is captured.
        previous_event = buffer.capture() if case["capture"] else None
        per_rank_counts, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
            topk_idx=topk_ids, num_experts=world.num_experts, previous_event=previous_event, async_finish=False,
            allocate_on_comm_stream=False)
        recv, recv_ids, recv_weights, counts, handle, event = buffer.dispatch(
            x=x, handle=None, num_tokens_per_rank=per_rank_counts, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_ids,
            topk_weights=topk_weights, expert_alignment=1, num_worst_tokens=worst, config=configs[0],
            previous_event=previous_event, async_finish=case["capture"], allocate_on_comm_stream=False)
        # receiver
        if event.event is not None:
            event.current_stream_wait()
        world.check_dispatch(rank, recv, recv_ids, recv_weights, counts)
        offset = rank * EXPERTS_PER_RANK
        global_ids = torch.where(recv_ids == -1, world.num_experts - 1 if offset == 0 else 0, recv_ids + offset)
        valid = recv_ids >= 0
        assert torch.equal(global_ids[valid] - offset, recv_ids[valid])

        # finalize: the experts' rows, weighted and reduced locally (here: an elementwise stand-in), then a
        # combine without weights into the caller's output.
        data, scales = recv if isinstance(recv, tuple) else (recv, None)
        fused = expert(torch, data, scales)
        if worst:
            fused[world.outputs[rank].num_recv_tokens:] = float("nan")  # padding rows must not be read
        previous_event = buffer.capture() if case["capture"] else None
        combined, _, event = buffer.combine(x=fused, handle=handle, topk_weights=None, config=configs[1],
                                            previous_event=previous_event, async_finish=case["capture"],
                                            allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        output = torch.empty(world.num_tokens[rank], HIDDEN, dtype=torch.bfloat16, device=device())
        output.copy_(combined, non_blocking=True)
        np.testing.assert_array_equal(ref.bf16_bits(output), world.combined[rank], err_msg=f"round {i}")
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_vllm_high_throughput(num_ranks):
    run(vllm_high_throughput_worker, num_ranks)


# ---- vLLM: low latency with dual-batch overlap ----

VLLM_LL_ROUNDS = [dict(use_fp8=False, ue8m0=False), dict(use_fp8=True, ue8m0=False), dict(use_fp8=True, ue8m0=True)]


def vllm_low_latency_worker(rank, num_ranks, group):
    import torch

    import deep_ep
    import epx_tools.reference as ref

    num_experts = EXPERTS_PER_RANK * num_ranks
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=LL_MAX_TOKENS, hidden=HIDDEN, num_ranks=num_ranks, num_experts=num_experts)
    buffer = deep_ep.Buffer(group=gloo_group(), num_nvl_bytes=VLLM_BUFFER_MIB << 20, num_rdma_bytes=num_rdma_bytes,
                            low_latency_mode=True, num_qps_per_rank=EXPERTS_PER_RANK,
                            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                            enable_shrink=False)
    for i, case in enumerate(VLLM_LL_ROUNDS):
        ue8m0 = case["ue8m0"]
        worlds = [LowLatencyWorld(num_ranks, per_rank(counts, num_ranks), LL_MAX_TOKENS, 200 + 10 * i + u,
                                  use_fp8=case["use_fp8"], round_scale=ue8m0, use_ue8m0=ue8m0)
                  for u, counts in enumerate(LL_TOKENS)]
        # prepare_async of both micro-batches: sends only; each receive waits in its hook.
        pending = []
        for world in worlds:
            x, topk_ids, topk_weights = world.inputs(rank, device())
            expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
                x, topk_ids, LL_MAX_TOKENS, num_experts, use_fp8=case["use_fp8"], round_scale=ue8m0,
                use_ue8m0=ue8m0, async_finish=False, return_recv_hook=True)
            pending.append((world, topk_ids, topk_weights, expert_x, expert_num_tokens, handle, hook))
        outputs, combine_hooks = [], []
        for u, (world, topk_ids, topk_weights, expert_x, expert_num_tokens, handle, hook) in enumerate(pending):
            hook()  # micro-batch u's receive
            world.check_dispatch(rank, expert_x, expert_num_tokens)
            fused = device_expert(torch, expert_x, expert_num_tokens)
            output = torch.empty(world.num_tokens[rank], HIDDEN, dtype=torch.bfloat16, device=device())
            # Micro-batch 0 hands its combine's receive to the other micro-batch (a hook); the last one finishes
            # in place.
            with_hook = u == 0
            returned, _, combine_hook = buffer.low_latency_combine(
                fused, topk_ids, topk_weights, handle, async_finish=False, zero_copy=False,
                return_recv_hook=with_hook, out=output)
            assert returned.data_ptr() == output.data_ptr() and (combine_hook is not None) == with_hook
            outputs.append(output)
            combine_hooks.append(combine_hook)
        combine_hooks[0]()
        for world, output in zip(worlds, outputs):
            np.testing.assert_array_equal(ref.bf16_bits(output), world.combined[rank], err_msg=f"round {i}")
    buffer.destroy()


@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_vllm_low_latency_dual_batch(num_ranks):
    run(vllm_low_latency_worker, num_ranks)


# ---- SGLang: one Buffer, normal and low-latency rounds ----

SGLANG_ROUNDS = {
    # output dtype: rounds in order ("normal", FP8 scale layout or None, async) / ("low_latency", fp8, ue8m0, hook,
    # zero_copy)
    "bf16": [("normal", None, False), ("low_latency", False, False, True, False), ("normal", None, True),
             ("low_latency", False, False, False, True)],
    "fp8": [("normal", "row-major", True), ("low_latency", True, False, True, False),
            ("normal", "column-major", False), ("low_latency", True, True, False, True), ("normal", "ue8m0", True)],
}


def sglang_worker(rank, num_ranks, group, output_dtype):
    import deep_ep

    num_experts = EXPERTS_PER_RANK * num_ranks
    params_bytes = 1 if output_dtype == "fp8" else 2
    if output_dtype == "fp8":  # --deepep-config: explicit normal-mode configs
        dispatch_config, combine_config = deep_ep.Config(24, 6, 256, 6, 128), deep_ep.Config(24, 4, 256, 6, 128)
        num_sms = 24
    else:
        dispatch_config = combine_config = None
        num_sms = deep_ep.Buffer.num_sms
    hidden_bytes = HIDDEN * params_bytes
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (dispatch_config or deep_ep.Buffer.get_dispatch_config(num_ranks),
                   combine_config or deep_ep.Buffer.get_combine_config(num_ranks)):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks), num_rdma_bytes)
    num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_MAX_TOKENS, HIDDEN, num_ranks, num_experts),
                         num_rdma_bytes)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=max(num_sms, num_experts // num_ranks), allow_mnnvl=True)
    mode = None
    for i, round_ in enumerate(SGLANG_ROUNDS[output_dtype]):
        if round_[0] == "normal":
            mode = "normal"
            sglang_normal_round(buffer, rank, num_ranks, 300 + i, round_[1], round_[2], dispatch_config,
                                combine_config)
        else:
            if mode == "normal":  # switching from normal mode: SGLang cleans the low-latency buffer
                buffer.clean_low_latency_buffer(LL_MAX_TOKENS, HIDDEN, num_experts)
            mode = "low_latency"
            sglang_low_latency_round(buffer, rank, num_ranks, 300 + i, *round_[1:])
    # SGLang builds its Buffer without explicitly_destroy: free it on every rank together (the teardown is
    # collective), not at interpreter exit.
    del buffer
    gc.collect()


def sglang_normal_round(buffer, rank, num_ranks, seed, fp8_kind, async_finish, dispatch_config, combine_config):
    import torch

    import deep_ep
    import epx_tools.reference as ref

    world = NormalWorld(num_ranks, per_rank(NORMAL_TOKENS, num_ranks), seed, fp8_kind=fp8_kind,
                        expert_alignment=128)
    hidden_states, topk_ids, topk_weights = world.inputs(rank, device())
    topk_ids = topk_ids.to(torch.int64)
    # dispatch_a / dispatch_b
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    per_rank_counts, per_rdma, per_expert, in_rank, previous_event = buffer.get_dispatch_layout(
        topk_ids, world.num_experts, previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=previous_event is not None)
    recv, recv_ids, recv_weights, counts, handle, event = buffer.dispatch(
        hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=per_rank_counts,
        num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=(previous_event is not None) and async_finish, expert_alignment=128,
        config=dispatch_config)
    if async_finish:
        event.current_stream_wait()
    world.check_dispatch(rank, recv, recv_ids, recv_weights, counts)
    assert all(count % 128 == 0 for count in counts)
    # combine_a / combine_b
    data, scales = recv if isinstance(recv, tuple) else (recv, None)
    output = expert(torch, data, scales)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    combined, _, event = buffer.combine(output, handle, async_finish=async_finish, previous_event=previous_event,
                                        allocate_on_comm_stream=previous_event is not None, config=combine_config)
    if async_finish:
        event.current_stream_wait()
    np.testing.assert_array_equal(ref.bf16_bits(combined), world.combined[rank], err_msg=f"seed {seed}")


def sglang_low_latency_round(buffer, rank, num_ranks, seed, use_fp8, use_ue8m0, return_recv_hook, zero_copy):
    import torch

    import epx_tools.reference as ref

    world = LowLatencyWorld(num_ranks, per_rank(LL_TOKENS[0], num_ranks), LL_MAX_TOKENS, seed, use_fp8=use_fp8,
                            round_scale=use_ue8m0, use_ue8m0=use_ue8m0)
    hidden_states, topk_ids, topk_weights = world.inputs(rank, device())
    stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32, device=device())
    # dispatch_a / dispatch_b
    expected_m = (hidden_states.shape[0] * buffer.group_size * topk_ids.shape[1] + world.num_experts) \
        // world.num_experts
    assert expected_m >= 0
    kwargs = dict(round_scale=use_ue8m0, use_ue8m0=use_ue8m0) if use_fp8 else {}
    packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
        hidden_states, topk_ids, LL_MAX_TOKENS, world.num_experts, cumulative_local_expert_recv_stats=stats,
        use_fp8=use_fp8, async_finish=not return_recv_hook, return_recv_hook=return_recv_hook, **kwargs)
    hook() if return_recv_hook else event.current_stream_wait()
    world.check_dispatch(rank, packed_recv_hidden, packed_recv_count)
    assert torch.equal(stats, packed_recv_count)
    # combine_a / combine_b
    expert_out = device_expert(torch, packed_recv_hidden, packed_recv_count)
    if zero_copy:  # the experts write straight into the buffer the combine sends from
        buffer.get_next_low_latency_combine_buffer(handle).copy_(expert_out)
    combined, event, hook = buffer.low_latency_combine(
        x=expert_out, topk_idx=topk_ids, topk_weights=topk_weights, handle=handle, zero_copy=zero_copy,
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
    hook() if return_recv_hook else event.current_stream_wait()
    np.testing.assert_array_equal(ref.bf16_bits(combined), world.combined[rank], err_msg=f"seed {seed}")


@pytest.mark.parametrize("output_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("num_ranks", gpu_counts(2, 4))
def test_sglang_auto_mode(num_ranks, output_dtype):
    run(sglang_worker, num_ranks, output_dtype)
