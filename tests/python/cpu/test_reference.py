"""The CPU reference through the binding (the oracle of the GPU tests), checked against plain numpy."""

import numpy as np
import pytest

import epx
import epx_tools.reference as ref

native = ref.native


def routing(seed, num_tokens, num_topk, num_experts, drop=0.0):
    spec = native.RoutingSpec(num_tokens=num_tokens, num_topk=num_topk, num_experts=num_experts,
                              drop_probability=drop)
    return native.make_topk_idx(spec, seed).reshape(num_tokens, num_topk)


def test_bf16_conversions_round_trip():
    values = np.array([0.0, -0.0, 1.0, -2.5, 3.140625, 1e-3, 65504.0, np.inf], dtype=np.float32)
    bits = ref.float_to_bf16(values)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(ref.bf16_to_float(bits), [0.0, -0.0, 1.0, -2.5, 3.140625,
                                                            ref.bf16_to_float(ref.float_to_bf16(np.float32(1e-3))),
                                                            65536.0, np.inf])
    # Ties round to even.
    assert ref.float_to_bf16(np.array([1.0 + 2 ** -8], dtype=np.float32))[0] == 0x3F80
    assert ref.float_to_bf16(np.array([1.0 + 3 * 2 ** -8], dtype=np.float32))[0] == 0x3F82


def test_seeded_generators_are_deterministic_and_stamped():
    a = native.random_bf16_tokens(7, 4, 256, 3)
    b = native.random_bf16_tokens(7, 4, 256, 3)
    np.testing.assert_array_equal(a, b)
    rows = a.reshape(4, 256)
    assert native.read_stamp(rows[2]) == (3, 2)
    ids = native.random_topk_idx(1, 32, 4, 16).reshape(32, 4)
    assert ids.dtype == np.int64
    assert all(len(set(row)) == 4 for row in ids.tolist())  # distinct experts per token
    weights = native.random_topk_weights(1, 32, 4)
    assert np.all((weights * 16) == np.round(weights * 16)) and weights.min() >= 1 / 16 and weights.max() <= 1
    x, scales = native.random_fp8_tokens(3, 5, 256, 0)
    assert x.dtype == np.uint8 and x.size == 5 * 256 and scales.size == 5 * 2


def test_dispatch_layout_matches_numpy():
    num_tokens, num_topk, num_experts, num_ranks = 50, 4, 16, 4
    ids = routing(5, num_tokens, num_topk, num_experts, drop=0.2)
    per_rank, per_expert, in_rank = ref.dispatch_layout(ids, num_experts, num_ranks)
    local = num_experts // num_ranks
    expected_in_rank = np.zeros((num_tokens, num_ranks), dtype=bool)
    expected_per_expert = np.zeros(num_experts, dtype=np.int32)
    for t in range(num_tokens):
        for e in set(ids[t].tolist()) - {-1}:
            expected_in_rank[t, e // local] = True
            expected_per_expert[e] += 1
    np.testing.assert_array_equal(in_rank, expected_in_rank)
    np.testing.assert_array_equal(per_rank, expected_in_rank.sum(axis=0))
    np.testing.assert_array_equal(per_expert, expected_per_expert)


def test_dispatch_layout_rejects_bad_ids():
    ids = np.array([[0, 8]], dtype=np.int64)
    with pytest.raises(epx.EpxError, match="topk_idx"):
        ref.dispatch_layout(ids, 8, 2)
    with pytest.raises(epx.EpxError, match="topk_idx size"):
        native.get_dispatch_layout(np.zeros(3, dtype=np.int64), 2, 2, 8, 2)


def make_normal_inputs(num_ranks, num_tokens, hidden, num_topk, num_experts, seed=1):
    inputs = []
    for r in range(num_ranks):
        inputs.append(ref.NormalRankInput(
            x=native.random_bf16_tokens(seed * 100 + r, num_tokens[r], hidden, r).reshape(num_tokens[r], hidden),
            topk_idx=routing(seed * 1000 + r, num_tokens[r], num_topk, num_experts, drop=0.1),
            topk_weights=native.random_topk_weights(seed * 10 + r, num_tokens[r], num_topk).reshape(num_tokens[r],
                                                                                                   num_topk)))
    return inputs


def test_normal_dispatch_places_rows_by_source_then_token():
    num_ranks, hidden, num_topk, num_experts = 3, 128, 3, 12
    num_tokens = [7, 0, 11]
    inputs = make_normal_inputs(num_ranks, num_tokens, hidden, num_topk, num_experts)
    outputs, handle = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=hidden,
                                          expert_alignment=4)
    local = num_experts // num_ranks
    for d, out in enumerate(outputs):
        expected = [(s, t) for s in range(num_ranks) for t in range(num_tokens[s])
                    if any(e >= 0 and e // local == d for e in inputs[s].topk_idx[t])]
        assert out.num_rows == out.num_recv_tokens == len(expected)
        for row, (s, t) in enumerate(expected):
            assert native.read_stamp(out.recv_x[row]) == (s, t)
            np.testing.assert_array_equal(out.recv_x[row], inputs[s].x[t])
            ids = inputs[s].topk_idx[t]
            on_d = (ids >= 0) & (ids // local == d)
            np.testing.assert_array_equal(out.recv_topk_idx[row], np.where(on_d, ids - d * local, -1))
            np.testing.assert_array_equal(out.recv_topk_weights[row], np.where(on_d, inputs[s].topk_weights[t], 0))
        counts = [int(np.sum(out.recv_topk_idx == le)) for le in range(local)]
        assert out.num_recv_tokens_per_expert_list == [(c + 3) // 4 * 4 for c in counts]
    assert list(handle.num_tokens) == num_tokens


def test_normal_combine_sums_copies_and_weights():
    num_ranks, hidden, num_topk, num_experts = 4, 256, 4, 16
    num_tokens = [9, 5, 0, 12]
    inputs = make_normal_inputs(num_ranks, num_tokens, hidden, num_topk, num_experts, seed=2)
    outputs, handle = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=hidden)
    bias = [native.random_bf16_tokens(50 + r, num_tokens[r], hidden, r, stamp=False).reshape(num_tokens[r], hidden)
            for r in range(num_ranks)]
    # Experts return what they received: each token comes back once per rank it went to.
    combined = ref.normal_combine(handle, [o.recv_x for o in outputs],
                                  topk_weights=[o.recv_topk_weights for o in outputs], bias0=bias)
    local = num_experts // num_ranks
    for r in range(num_ranks):
        x, weights = combined[r]
        copies = np.array([len({e // local for e in ids if e >= 0}) for ids in inputs[r].topk_idx.tolist()],
                          dtype=np.float32).reshape(-1, 1)
        expected = ref.bf16_to_float(inputs[r].x) * copies + ref.bf16_to_float(bias[r])
        np.testing.assert_array_equal(ref.bf16_to_float(x), expected)  # small integers: exact
        np.testing.assert_array_equal(weights, np.where(inputs[r].topk_idx >= 0, inputs[r].topk_weights, 0))


def test_tokens_per_node_counts_a_token_once_per_node():
    # Experts 0..3 live on ranks 0..3; nodes of 2 ranks: {0, 1} and {2, 3}.
    ids = np.array([[0, 3], [1, -1], [-1, -1], [2, 1]], dtype=np.int64)
    assert ref.tokens_per_node(ids, 4, 4, 2).tolist() == [3, 2]
    assert ref.tokens_per_node(ids, 4, 4, 1).tolist() == [1, 2, 1, 1]  # nodes of one rank: per rank
    assert ref.tokens_per_node(ids, 4, 4, 4).size == 0  # one node: none (DeepEP returns None there)
    with pytest.raises(epx.EpxError, match="invalid ranks_per_node = 3: must divide num_ranks"):
        ref.tokens_per_node(ids, 4, 4, 3)


def test_combine_across_nodes_reduces_inside_each_node_first():
    num_ranks, hidden, num_topk, num_experts = 4, 128, 4, 16
    num_tokens = [9, 5, 0, 12]
    inputs = make_normal_inputs(num_ranks, num_tokens, hidden, num_topk, num_experts, seed=4)
    outputs, handle = ref.normal_dispatch(inputs, num_ranks=num_ranks, num_experts=num_experts, hidden=hidden)
    # Uniform expert outputs, so rounding shows.
    x = [native.random_bf16_tokens(60 + r, o.num_rows, hidden, r, native.TokenValues.UNIFORM, False).reshape(
        o.num_rows, hidden) for r, o in enumerate(outputs)]
    bias = [native.random_bf16_tokens(70 + r, num_tokens[r], hidden, r, native.TokenValues.UNIFORM, False).reshape(
        num_tokens[r], hidden) for r in range(num_ranks)]
    weights = [o.recv_topk_weights for o in outputs]
    one_node = ref.normal_combine(handle, x, topk_weights=weights, bias0=bias)
    # Nodes of one rank: each partial is one BF16 row, nothing rounds early.
    singles = ref.normal_combine(handle, x, topk_weights=weights, bias0=bias, ranks_per_node=1)
    pairs = ref.normal_combine(handle, x, topk_weights=weights, bias0=bias, ranks_per_node=2)
    for r in range(num_ranks):
        np.testing.assert_array_equal(singles[r][0], one_node[r][0])
        np.testing.assert_array_equal(pairs[r][1], one_node[r][1])  # weights come back whole
    # 2 x 2 by hand, in float32: each node's partial rounded to BF16, nodes in order, then the bias.
    local = num_experts // num_ranks
    for r in range(num_ranks):
        for t in range(num_tokens[r]):
            acc = np.zeros(hidden, dtype=np.float32)
            for node in range(2):
                partial = np.zeros(hidden, dtype=np.float32)
                ranks = [d for d in (2 * node, 2 * node + 1)
                         if any(e >= 0 and e // local == d for e in inputs[r].topk_idx[t])]
                for d in ranks:
                    partial += ref.bf16_to_float(x[d][handle.recv_row[r][t * num_ranks + d]])
                if ranks:
                    acc += ref.bf16_to_float(ref.float_to_bf16(partial))
            acc += ref.bf16_to_float(bias[r][t])
            np.testing.assert_array_equal(pairs[r][0][t], ref.float_to_bf16(acc))


def test_normal_worst_case_rows_are_padded():
    inputs = make_normal_inputs(2, [6, 4], 128, 2, 4, seed=3)
    outputs, _ = ref.normal_dispatch(inputs, num_ranks=2, num_experts=4, hidden=128, num_worst_tokens=10)
    for out in outputs:
        assert out.num_rows == 10 and out.num_recv_tokens <= 10
        assert np.all(out.recv_topk_idx[out.num_recv_tokens:] == -1)
        assert np.all(out.recv_src_rank[out.num_recv_tokens:] == -1)
        assert out.num_recv_tokens_per_expert_list == []
    with pytest.raises(epx.EpxError, match="num_worst_tokens"):
        ref.normal_dispatch(inputs, num_ranks=2, num_experts=4, hidden=128, num_worst_tokens=1)


def test_normal_fp8_is_carried_unchanged():
    inputs = []
    for r in range(2):
        x, scales = native.random_fp8_tokens(r, 3, 256, r)
        inputs.append(ref.NormalRankInput(x_fp8=x.reshape(3, 256), x_scales=scales.reshape(3, 2),
                                          topk_idx=np.array([[0, 3], [1, -1], [2, 3]], dtype=np.int64),
                                          topk_weights=np.full((3, 2), 0.5, dtype=np.float32)))
    outputs, _ = ref.normal_dispatch(inputs, num_ranks=2, num_experts=4, hidden=256, fp8=True)
    # Rank 1 holds experts 2 and 3: tokens 0 and 2 of each source.
    np.testing.assert_array_equal(outputs[1].recv_x_fp8, np.concatenate([inputs[0].x_fp8[[0, 2]],
                                                                         inputs[1].x_fp8[[0, 2]]]))
    np.testing.assert_array_equal(outputs[1].recv_x_scales, np.concatenate([inputs[0].x_scales[[0, 2]],
                                                                            inputs[1].x_scales[[0, 2]]]))


def test_low_latency_dispatch_and_weighted_combine():
    num_ranks, hidden, num_topk, num_experts, max_tokens = 2, 256, 3, 8, 6
    params = ref.low_latency_params(num_ranks=num_ranks, num_experts=num_experts, hidden=hidden, num_topk=num_topk,
                                    num_max_dispatch_tokens_per_rank=max_tokens)
    num_tokens = [6, 4]
    xs = [native.random_bf16_tokens(r, num_tokens[r], hidden, r, native.TokenValues.UNIFORM).reshape(-1, hidden)
          for r in range(num_ranks)]
    ids = [routing(10 + r, num_tokens[r], num_topk, num_experts, drop=0.2) for r in range(num_ranks)]
    weights = [native.random_topk_weights(20 + r, num_tokens[r], num_topk).reshape(-1, num_topk)
               for r in range(num_ranks)]
    local, rows = num_experts // num_ranks, num_ranks * max_tokens
    stats = [np.zeros(local, dtype=np.int32) for _ in range(num_ranks)]
    received = ref.low_latency_dispatch(xs, ids, params, use_fp8=False, cumulative_local_expert_recv_stats=stats)
    for d, out in enumerate(received):
        assert out.recv_x.shape == (local, rows, hidden)
        np.testing.assert_array_equal(stats[d], out.recv_count)
        for le in range(local):
            expert = d * local + le
            expected = [(s, t) for s in range(num_ranks) for t in range(num_tokens[s]) if expert in ids[s][t]]
            assert out.recv_count[le] == len(expected)
            for row, (s, t) in enumerate(expected):
                assert (out.recv_src_rank[le, row], out.recv_src_token_idx[le, row]) == (s, t)
                np.testing.assert_array_equal(out.recv_x[le, row], xs[s][t])
    # Identity experts: combined = sum_k w_k * x in top-k order, float32 multiply then add.
    combined = ref.low_latency_combine([o.recv_x for o in received], ids, weights, params)
    for r in range(num_ranks):
        acc = np.zeros((num_tokens[r], hidden), dtype=np.float32)
        x = ref.bf16_to_float(xs[r])
        for k in range(num_topk):
            term = weights[r][:, k:k + 1] * x
            acc = np.where(ids[r][:, k:k + 1] >= 0, acc + term, acc).astype(np.float32)
        np.testing.assert_array_equal(combined[r], ref.float_to_bf16(acc))


def test_low_latency_fp8_scales_are_column_major_views():
    params = ref.low_latency_params(num_ranks=1, num_experts=2, hidden=512, num_topk=1,
                                    num_max_dispatch_tokens_per_rank=4)
    x = native.random_bf16_tokens(1, 4, 512, 0, native.TokenValues.UNIFORM).reshape(4, 512)
    ids = np.array([[0], [1], [0], [-1]], dtype=np.int64)
    (out,) = ref.low_latency_dispatch([x], [ids], params, use_fp8=True, round_scale=True)
    assert out.recv_x.dtype == np.uint8 and out.recv_x.shape == (2, 4, 512)
    assert out.recv_x_scales.shape == (2, 4, 4)
    scales = out.recv_x_scales[0, : out.recv_count[0]]
    assert np.all(scales > 0) and np.all(np.log2(scales) == np.round(np.log2(scales)))  # powers of two
    (packed,) = ref.low_latency_dispatch([x], [ids], params, use_fp8=True, round_scale=True, use_ue8m0=True)
    assert packed.recv_x_scales.shape == (2, 4, 1) and packed.recv_x_scales.dtype == np.uint32
    with pytest.raises(epx.EpxError, match="use_ue8m0"):
        ref.low_latency_dispatch([x], [ids], params, use_fp8=True, round_scale=False, use_ue8m0=True)


def test_low_latency_rejects_too_many_tokens():
    params = ref.low_latency_params(num_ranks=1, num_experts=2, hidden=128, num_topk=1,
                                    num_max_dispatch_tokens_per_rank=2)
    x = np.zeros((3, 128), dtype=np.uint16)
    with pytest.raises(epx.EpxError, match="num_tokens"):
        ref.low_latency_dispatch([x], [np.zeros((3, 1), dtype=np.int64)], params, use_fp8=False)


def test_kwargs_constructors_reject_unknown_fields():
    with pytest.raises(AttributeError):
        native.NormalDispatchParams(num_ranks=2, no_such_field=1)
    params = native.NormalDispatchParams(num_ranks=2, num_experts=4, hidden=128)
    assert (params.num_ranks, params.num_experts, params.hidden, params.expert_alignment) == (2, 4, 128, 1)


def test_low_latency_masked_rank_is_left_out():
    num_ranks, hidden, num_topk, num_experts, max_tokens = 2, 256, 3, 8, 6
    params = ref.low_latency_params(num_ranks=num_ranks, num_experts=num_experts, hidden=hidden, num_topk=num_topk,
                                    num_max_dispatch_tokens_per_rank=max_tokens, masked_ranks=[1])
    assert list(params.masked_ranks) == [1]
    num_tokens = [6, 4]
    xs = [native.random_bf16_tokens(r, num_tokens[r], hidden, r, native.TokenValues.UNIFORM).reshape(-1, hidden)
          for r in range(num_ranks)]
    ids = [routing(30 + r, num_tokens[r], num_topk, num_experts) for r in range(num_ranks)]
    weights = [native.random_topk_weights(40 + r, num_tokens[r], num_topk).reshape(-1, num_topk)
               for r in range(num_ranks)]
    local = num_experts // num_ranks
    received = ref.low_latency_dispatch(xs, ids, params, use_fp8=False)
    # Rank 0 keeps only its own tokens; the masked rank's experts receive nothing.
    for le in range(local):
        expected = [t for t in range(num_tokens[0]) if le in ids[0][t]]
        assert received[0].recv_count[le] == len(expected)
        assert list(received[0].recv_src_rank[le, :len(expected)]) == [0] * len(expected)
    assert list(received[1].recv_count) == [0] * local
    # Combine: entries on the masked rank count as -1.
    combined = ref.low_latency_combine([o.recv_x for o in received], ids, weights, params)
    x = ref.bf16_to_float(xs[0])
    acc = np.zeros((num_tokens[0], hidden), dtype=np.float32)
    for k in range(num_topk):
        kept = (ids[0][:, k:k + 1] >= 0) & (ids[0][:, k:k + 1] < local)
        acc = np.where(kept, acc + weights[0][:, k:k + 1] * x, acc).astype(np.float32)
    np.testing.assert_array_equal(combined[0], ref.float_to_bf16(acc))
