"""What the torch layer does per call (issue 37), on the CPU with one rank and the native calls stubbed
(fake_runtime.StubBinding): checks that pass build no text, handles are not copied, the low-latency calls through
deep_ep do nothing that would break a CUDA-graph capture (no host sync, no new stream or event, no stream switch),
and the helpers that replace torch's slower paths (DLPack views, the raw current stream, the comm-stream switch)
behave as the paths they replace. bench/python_host_overhead.py --stub times the same calls. Skipped without
torch."""

import gc
import os
import weakref

import pytest

torch = pytest.importorskip("torch")

import epx  # noqa: E402
import epx._util as util  # noqa: E402
from fake_runtime import deep_ep_wrapper, install_stub  # noqa: E402

HIDDEN, NUM_EXPERTS, NUM_TOPK, MAX_TOKENS = 256, 8, 4, 16


@pytest.fixture
def stub(monkeypatch):
    buffer, binding = install_stub(MAX_TOKENS, HIDDEN, NUM_EXPERTS, monkeypatch)
    return deep_ep_wrapper(buffer), binding


def ll_inputs(num_tokens=MAX_TOKENS):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    ids = torch.rand(num_tokens, NUM_EXPERTS, generator=generator).topk(NUM_TOPK, dim=1).indices
    weights = torch.rand(num_tokens, NUM_TOPK, generator=generator)
    stats = torch.zeros(NUM_EXPERTS, dtype=torch.int32)
    expert_out = torch.zeros(NUM_EXPERTS, MAX_TOKENS, HIDDEN, dtype=torch.bfloat16)
    return x, ids, weights, stats, expert_out


def layout_args(wrapper, ids, weights):
    """dispatch's keyword arguments from get_dispatch_layout, as DeepEP callers pass them."""
    per_rank, _, per_expert, in_rank, _ = wrapper.get_dispatch_layout(ids, NUM_EXPERTS)
    return dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=ids,
        topk_weights=weights,
    )


def ll_step(wrapper, inputs, hook=False):
    x, ids, weights, stats, expert_out = inputs
    recv_x, recv_count, handle, event, dispatch_hook = wrapper.low_latency_dispatch(
        x, ids, MAX_TOKENS, NUM_EXPERTS, cumulative_local_expert_recv_stats=stats, return_recv_hook=hook
    )
    if hook:
        dispatch_hook()
    combined, event, combine_hook = wrapper.low_latency_combine(expert_out, ids, weights, handle, return_recv_hook=hook)
    if hook:
        combine_hook()
    return recv_x, recv_count, handle, combined


def forbid(monkeypatch, owner, name, what):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} on a per-call path")

    monkeypatch.setattr(owner, name, refuse)


def test_passing_checks_build_no_text(stub, monkeypatch):
    wrapper, _ = stub
    inputs = ll_inputs()
    ll_step(wrapper, inputs)  # the first call of a shape may ask the binding (and format nothing either)
    forbid(monkeypatch, util, "_describe_shape", "a shape description")
    forbid(monkeypatch, util, "_raise_tensor_error", "a tensor check's slow path")
    forbid(monkeypatch, util, "error", "an error message")
    for hook in (False, True):
        ll_step(wrapper, inputs, hook)
    x, ids, weights, _, _ = inputs
    recv_x, _, recv_weights, _, handle, _ = wrapper.dispatch(x, **layout_args(wrapper, ids, weights))
    wrapper.dispatch(x, handle)
    wrapper.combine(recv_x, handle, topk_weights=recv_weights)


def test_failing_checks_still_name_the_argument_the_value_and_the_rule(stub):
    wrapper, _ = stub
    x, ids, weights, stats, expert_out = ll_inputs()
    with pytest.raises(epx.EpxError, match=r"invalid x.dtype = torch.float32: must be torch.bfloat16"):
        wrapper.low_latency_dispatch(x.float(), ids, MAX_TOKENS, NUM_EXPERTS)
    with pytest.raises(
        epx.EpxError,
        match=r"invalid topk_idx.shape = \(3, 4\): must have size 16 in dimension 0 "
        r"\(expected \[16, \*\]\)",
    ):
        wrapper.low_latency_dispatch(x, ids[:3], MAX_TOKENS, NUM_EXPERTS)
    with pytest.raises(
        epx.EpxError,
        match=r"invalid cumulative_local_expert_recv_stats.shape = \(3,\): must have "
        r"size 8 in dimension 0 \(expected \[8\]\)",
    ):
        wrapper.low_latency_dispatch(x, ids, MAX_TOKENS, NUM_EXPERTS, cumulative_local_expert_recv_stats=stats[:3])
    with pytest.raises(
        epx.EpxError,
        match=r"invalid topk_idx.dtype = torch.int16: must be torch.int64 or "
        r"torch.int32",
    ):
        wrapper.low_latency_dispatch(x, ids.to(torch.int16), MAX_TOKENS, NUM_EXPERTS)
    _, _, handle, _, _ = wrapper.low_latency_dispatch(x, ids, MAX_TOKENS, NUM_EXPERTS)
    with pytest.raises(epx.EpxError, match=r"invalid topk_weights = NoneType: must be a torch.Tensor"):
        wrapper.low_latency_combine(expert_out, ids, None, handle)
    with pytest.raises(epx.EpxError, match=r"invalid x = a non-contiguous tensor: must be contiguous"):
        wrapper.low_latency_combine(expert_out.transpose(0, 1).contiguous().transpose(0, 1), ids, weights, handle)
    with pytest.raises(epx.EpxError, match=r"invalid x = None: is required without zero_copy"):
        wrapper.low_latency_combine(None, ids, weights, handle)


def test_check_tensor_fast_path_agrees_with_its_checks():
    """check_tensor passes exactly where its checks one by one pass (the slow path raises the first failure)."""
    t = torch.zeros(4, 3)
    cases = [
        dict(),
        dict(ndim=2),
        dict(ndim=3),
        dict(shape=(4, 3)),
        dict(shape=(4, None)),
        dict(shape=(None, 2)),
        dict(shape=(4,)),
        dict(shape=(4, 3, None)),
        dict(shape=(4, 3, 1)),
        dict(dtype=torch.float32),
        dict(dtype=torch.int32),
        dict(contiguous=True),
    ]
    for kwargs in cases:
        for tensor in (t, t.t(), t[:, :2]):
            try:
                util._raise_tensor_error(
                    tensor,
                    "t",
                    kwargs.get("dtype"),
                    kwargs.get("ndim"),
                    kwargs.get("shape"),
                    False,
                    kwargs.get("contiguous", True),
                )
                expected = None
            except (epx.EpxError, IndexError) as failure:
                expected = type(failure), str(failure)
            try:
                util.check_tensor(tensor, "t", cuda=False, **kwargs)
                got = None
            except (epx.EpxError, IndexError) as failure:
                got = type(failure), str(failure)
            assert got == expected, (kwargs, tuple(tensor.shape))


def test_low_latency_calls_do_nothing_a_graph_capture_refuses(stub, monkeypatch):
    """What a CUDA-graph capture refuses or would bake in: host syncs (item, tolist, cpu, numpy, bool of a tensor,
    synchronize), new streams and events, stream switches. The low-latency calls through deep_ep, with and
    without hooks, do none of these after their first call of a shape."""
    wrapper, binding = stub
    inputs = ll_inputs()
    ll_step(wrapper, inputs)
    ll_step(wrapper, inputs, hook=True)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "record_stream"):
        forbid(monkeypatch, torch.Tensor, name, f"Tensor.{name}")
    for name in ("synchronize", "current_stream", "default_stream", "Stream", "Event", "stream", "set_stream"):
        forbid(monkeypatch, torch.cuda, name, f"torch.cuda.{name}")
    forbid(monkeypatch, util, "maybe_stream", "a stream switch")
    forbid(monkeypatch, util, "current_stream", "a torch.cuda.Stream object")
    forbid(monkeypatch, binding, "low_latency_dispatch_sizes", "a sizes query of a known shape")
    forbid(monkeypatch, binding, "StreamOrder", "a new StreamOrder for a known stream")
    import epx.buffer as buffer_module
    import epx.event as event_module

    forbid(monkeypatch, buffer_module, "maybe_stream", "a stream switch")
    forbid(monkeypatch, buffer_module, "current_stream", "a torch.cuda.Stream object")
    forbid(monkeypatch, event_module, "_record_on_current_stream", "a new event")
    for _ in range(3):
        ll_step(wrapper, inputs)
        ll_step(wrapper, inputs, hook=True)


def test_low_latency_handles_are_not_copied(stub, monkeypatch):
    import dataclasses

    wrapper, _ = stub
    inputs = ll_inputs()
    forbid(monkeypatch, dataclasses, "replace", "dataclasses.replace")
    _, _, handle, _ = ll_step(wrapper, inputs)
    src_info = handle[0]
    native = src_info._epx_handle
    # The handle the tuple carries does not hold its first tensor (no reference cycle), and combine finds it.
    assert native.recv_src_info is None and native.recv_layout_range is handle[1]
    referent = weakref.ref(src_info)
    del handle, src_info, native
    gc.disable()
    try:
        _, _, handle, _ = ll_step(wrapper, inputs)
        del handle
        assert referent() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_stream_orders_are_made_once_per_stream(stub):
    wrapper, binding = stub
    buffer = wrapper.runtime
    order = buffer._order(None, False)
    assert buffer._order(None, False) is order and buffer._order(None, True) is not order
    assert buffer._order(None, True).async_finish is True
    event = epx.EventOverlap()
    assert buffer._order(event, False) is not order  # a previous event: its own order


def test_normal_handle_views_are_made_once(stub):
    wrapper, _ = stub
    x, ids, weights, _, _ = ll_inputs()
    _, _, _, _, handle, _ = wrapper.dispatch(x, **layout_args(wrapper, ids, weights))
    native = handle[0]._epx_handle
    assert handle[3] is native.recv_src_idx and handle[5] is native.send_head
    assert native.recv_channel_offset is native.recv_channel_offset


def test_normal_handles_are_freed_by_reference_counting(stub):
    """deep_ep's normal-mode tuple carries the epx handle on its first tensor, which the handle must not hold: such
    a reference cycle keeps the handle (and its device arrays) until the garbage collector runs, so a dispatch
    finds no freed block to reuse and allocates from the pool instead (the torch profiler counted 0.9 pool
    allocations per dispatch on 2 x H100)."""
    from epx.compat.deep_ep_handles import normal_handle

    wrapper, _ = stub
    x, ids, weights, _, _ = ll_inputs()
    args = layout_args(wrapper, ids, weights)
    gc.disable()
    try:
        _, _, _, _, handle, _ = wrapper.dispatch(x, **args)
        epx_handle = weakref.ref(normal_handle(handle))
        matrices = epx_handle().deep_ep_matrices
        assert handle[0].data_ptr() == matrices[0].data_ptr() and handle[1] is matrices[1]
        del handle, matrices
        assert epx_handle() is None
    finally:
        gc.enable()


def test_a_dispatch_the_extension_declines_asks_it_once(stub, monkeypatch):
    """A call that is not the extension's plain case (its dispatch returns None: e.g. column-major FP8 scales)
    takes the Python path after one try, not a second one inside epx.Buffer.dispatch."""
    import epx.buffer as buffer_module

    wrapper, _ = stub
    x, ids, weights, _, _ = ll_inputs()
    args = layout_args(wrapper, ids, weights)
    tries = []

    class Declining:
        def dispatch(self, *arguments):
            tries.append(1)
            return None

    monkeypatch.setattr(buffer_module, "torch_calls", Declining())
    recv_x, _, _, _, handle, _ = wrapper.dispatch(x, **args)
    assert tries == [1]
    assert recv_x.shape[1] == HIDDEN and len(handle) == 6


def test_extension_views_become_the_handles_views(stub, monkeypatch):
    """A dispatch through the torch extension gets DeepEP's handle arrays as tensors with the call (the 9th item of
    its result): the epx handle keeps them as its views, and deep_ep's tuple is made of them, with no view call of
    its own; its first is the 7th view, a second tensor over rank_prefix_matrix that carries the handle (see the
    test above), which the handle does not hold. (A stand-in extension: the dispatch's result comes prebuilt.)"""
    import epx.buffer as buffer_module

    wrapper, _ = stub
    x, ids, weights, _, _ = ll_inputs()
    args = layout_args(wrapper, ids, weights)
    _, _, _, _, first, _ = wrapper.dispatch(x, **args)
    native = first[0]._epx_handle.native
    rows = MAX_TOKENS
    views = (torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32),
             torch.zeros(1, 4, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
             torch.zeros(rows, 1, dtype=torch.bool), torch.zeros(rows, 1, dtype=torch.int32),
             torch.zeros(1, 1, dtype=torch.int32))
    made = (torch.zeros(rows, HIDDEN, dtype=torch.bfloat16), None, torch.zeros(rows, NUM_TOPK, dtype=torch.int64),
            torch.zeros(rows, NUM_TOPK), native, rows, [rows] * 4, None, views)

    class Extension:
        def dispatch(self, *arguments):
            return made

    monkeypatch.setattr(buffer_module, "torch_calls", Extension())
    monkeypatch.setattr(util, "array_view", lambda *a, **k: pytest.fail("a view was made in Python"))
    _, _, _, _, handle, _ = wrapper.dispatch(x, **args)
    assert handle[0] is views[6] and len(handle) == 6
    assert all(a is b for a, b in zip(handle[1:], views[1:6]))
    assert handle[0]._epx_handle.deep_ep_matrices[0] is views[0]
    epx_handle = handle[0]._epx_handle
    assert epx_handle.recv_src_idx is views[3] and epx_handle.send_head is views[5]
    assert epx_handle.is_token_in_rank is views[4] and epx_handle.deep_ep_matrices == views[:3]


def test_dispatch_reads_the_spans_nodes_of_construction(stub, monkeypatch):
    """Whether the group spans nodes is read once, when the Buffer is made: a dispatch (through deep_ep, and its
    guess of the rows) asks the runtime nothing more for it."""
    wrapper, _ = stub
    x, ids, weights, _, _ = ll_inputs()
    args = layout_args(wrapper, ids, weights)
    wrapper.dispatch(x, **args)
    monkeypatch.delattr(wrapper.runtime.runtime, "spans_nodes")  # reading it now raises AttributeError
    _, _, _, _, handle, _ = wrapper.dispatch(x, **args)
    assert len(handle) == 6 and wrapper.runtime._guess_rows(True, 0) > 0


def test_config_fields_are_read_as_before():
    """config_fields (the per-call key of the config last set, and of deep_ep's fitted configs) reads what getattr
    over the field names read."""
    from epx.config import config_fields

    slow = lambda config: tuple(getattr(config, name, None) for name in epx.Config.__slots__)  # noqa: E731
    config = epx.Config(8, 4, 64, 5, 96)
    for each in (config, config.to_native(), object(), None):
        assert config_fields(each) == slow(each)
    assert config_fields(config) == (8, 4, 64, 5, 96)


def test_dispatch_count_wait_is_the_runtimes(stub):
    """epx.Buffer.dispatch_count_wait_us: the runtime's nanoseconds of host waits for dispatch counts, in µs."""
    wrapper, _ = stub
    wrapper.runtime.runtime.dispatch_count_wait_ns = 12_500
    assert wrapper.runtime.dispatch_count_wait_us == 12.5


def test_default_configs_are_set_once(stub, monkeypatch):
    wrapper, _ = stub
    x, ids, weights, _, _ = ll_inputs()
    args = layout_args(wrapper, ids, weights)
    recv_x, _, recv_weights, _, handle, _ = wrapper.dispatch(x, **args)
    runtime = wrapper.runtime.runtime
    sets = runtime.configs_set
    wrapper.dispatch(x, **args)
    wrapper.dispatch(x, handle)
    assert runtime.configs_set == sets  # the same default config: not set again
    config = epx.Config(8, 4, 64)
    wrapper.combine(recv_x, handle, topk_weights=recv_weights, config=config)
    assert runtime.configs_set == sets + 1 and wrapper.runtime.config == config
    config.num_sms = 12  # a Config changed in place is a new config
    wrapper.combine(recv_x, handle, topk_weights=recv_weights, config=config)
    assert runtime.configs_set == sets + 2 and wrapper.runtime.config == epx.Config(12, 4, 64)
    wrapper.runtime.num_sms = 16  # changed behind the calls' back: the next call sets its config again
    wrapper.combine(recv_x, handle, topk_weights=recv_weights, config=config)
    assert wrapper.runtime.config == epx.Config(12, 4, 64)


# ---- The helpers ----


def test_device_view_through_dlpack_keeps_its_owner():
    source = torch.arange(24, dtype=torch.int32)

    class Owner:
        pass

    owner = Owner()
    owner.memory = source
    alive = weakref.ref(owner)
    cpu = torch.device("cpu")
    view = util.device_view(source.data_ptr(), 96, torch.int32, (4, 6), owner, cpu)
    assert view.shape == (4, 6) and view.dtype == torch.int32 and torch.equal(view.flatten(), source)
    as_bool = util.device_view(source.data_ptr(), 24, torch.bool, (4, 6), owner, cpu)
    as_fp8 = util.device_view(source.data_ptr(), 24, torch.float8_e4m3fn, None, owner, cpu)
    assert as_bool.dtype == torch.bool and as_fp8.shape == (24,) and as_fp8.dtype == torch.float8_e4m3fn
    array = util.array_view(source.data_ptr(), torch.int64, (3, 4), owner, cpu)
    assert torch.equal(array.view(torch.int32).flatten(), source)
    assert util.device_view(source.data_ptr(), 0, torch.int32, (0, 3), owner, cpu).shape == (0, 3)
    with pytest.raises(RuntimeError, match=r"shape '\[5, 6\]' is invalid for input of size 24"):
        util.device_view(source.data_ptr(), 96, torch.int32, (5, 6), owner, cpu)
    with pytest.raises(epx.EpxError, match="invalid num_bytes = 7: must be a multiple of 4"):
        util.device_view(source.data_ptr(), 7, torch.int32, None, owner, cpu)
    del owner
    gc.collect()
    assert alive() is not None  # the views hold it
    del view, as_bool, as_fp8, array
    gc.collect()
    assert alive() is None
    # A capsule no tensor took frees its reference too.
    owner = Owner()
    alive = weakref.ref(owner)
    epx._epx.device_view_capsule(source.data_ptr(), 0, 32, [24], 1, 0, owner)
    del owner
    assert alive() is None


def test_current_stream_handle_reads_torchs_raw_stream(monkeypatch):
    asked = []

    def raw(device_index):
        asked.append(device_index)
        return 0xABC0 + device_index

    monkeypatch.setattr(util, "_raw_stream", raw)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert util.current_stream_handle(1) == 0xABC1 and util.current_stream_handle() == 0xABC3
    assert asked == [1, 3]


def test_stream_switch_swaps_and_restores_the_current_stream(monkeypatch):
    """StreamSwitch on the stream's device: torch's current stream becomes the stream's ids and goes back to what
    it was (nested and after an exception too); on another device it is torch.cuda.stream."""
    state = {"device": 0, 0: (10, 0, 1), 1: (20, 1, 1)}  # current device, current stream ids per device
    c = torch._C

    def set_stream(stream_id, device_index, device_type):
        state["device"] = device_index  # torch's setter also makes the stream's device current
        state[device_index] = (stream_id, device_index, device_type)

    monkeypatch.setattr(c, "_cuda_getDevice", lambda: state["device"], raising=False)
    monkeypatch.setattr(c, "_cuda_getCurrentStream", lambda index: state[index], raising=False)
    monkeypatch.setattr(c, "_cuda_setStream", set_stream, raising=False)

    class Stream:
        def __init__(self, stream_id, device_index):
            self.stream_id, self.device_index, self.device_type = stream_id, device_index, 1

    switch = util.StreamSwitch(Stream(11, 0))
    with switch:
        assert state[0] == (11, 0, 1)
        with util.StreamSwitch(Stream(12, 0)):
            assert state[0] == (12, 0, 1)
        assert state[0] == (11, 0, 1)
    assert state[0] == (10, 0, 1) and state["device"] == 0
    with pytest.raises(ValueError):
        with switch:
            raise ValueError("inside")
    assert state[0] == (10, 0, 1)
    entered = []

    class Context:
        def __init__(self, stream):
            entered.append(stream.stream_id)

        def __enter__(self):
            entered.append("enter")

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "stream", Context)
    with util.StreamSwitch(Stream(21, 1)):  # another device than the current one
        pass
    assert entered == [21, "enter", "exit"] and state[1] == (20, 1, 1)
    with util.StreamSwitch(None):
        pass


def test_allocator_is_inductors_only_on_the_buffers_device(monkeypatch):
    """Buffer._empty: torch.compile's allocator (it takes the current device) while the current device is the
    Buffer's, else torch.empty_strided on the Buffer's device."""
    import epx.buffer as buffer_module

    buffer = object.__new__(buffer_module.Buffer)
    buffer.device, buffer.comm_stream = torch.device("cuda", 1), None
    buffer._init_call_state()
    fast = torch._C._dynamo.guards._empty_strided_cuda
    assert buffer._fast_empty is fast
    buffer._current_device = lambda: 1
    assert buffer._empty() is fast
    buffer._current_device = lambda: 0
    made = []
    monkeypatch.setattr(torch, "empty_strided", lambda *args, **kwargs: made.append((args, kwargs)))
    buffer._empty()((2, 3), (3, 1), torch.int32)
    assert made == [(((2, 3), (3, 1)), dict(dtype=torch.int32, device=torch.device("cuda", 1)))]
    monkeypatch.setattr(torch._C._dynamo.guards, "_empty_strided_cuda", None)  # a torch without it
    buffer._init_call_state()
    buffer._current_device = lambda: 1
    buffer._empty()((4,), (1,), torch.int64)
    assert made[-1] == (((4,), (1,)), dict(dtype=torch.int64, device=torch.device("cuda", 1)))


def test_stream_objects_are_made_once_per_stream(stub, monkeypatch):
    """record_stream needs a torch.cuda.Stream: the Buffer makes one per stream handle, not one per call."""
    import epx.buffer as buffer_module

    wrapper, _ = stub
    buffer = wrapper.runtime
    made = []
    monkeypatch.setattr(buffer_module, "current_stream", lambda device=None: made.append(device) or object())
    handle = [7]
    monkeypatch.setattr(buffer_module, "current_stream_handle", lambda device_index=None: handle[0])
    first = buffer._current_stream_object()
    assert buffer._current_stream_object() is first and made == [buffer.device]  # the Buffer's device
    handle[0] = 8
    assert buffer._current_stream_object() is not first and len(made) == 2


def _host_overhead_module():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "python_host_overhead.py")
    spec = importlib.util.spec_from_file_location("python_host_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_local_cpus_reads_the_numa_node_of_the_gpu(tmp_path):
    bench = _host_overhead_module()
    device = tmp_path / "bus" / "pci" / "devices" / "0000:1b:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    node = tmp_path / "devices" / "system" / "node" / "node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("16-19,48,50-51\n")
    assert bench.gpu_local_cpus("0000:1B:00.0", str(tmp_path)) == [16, 17, 18, 19, 48, 50, 51]
    (device / "numa_node").write_text("-1\n")  # no NUMA information
    assert bench.gpu_local_cpus("0000:1b:00.0", str(tmp_path)) == []
    assert bench.gpu_local_cpus("0000:99:00.0", str(tmp_path)) == []  # no such device


def test_pick_cpus_gives_each_rank_its_own_cores_near_its_gpu(tmp_path):
    bench = _host_overhead_module()
    allowed = list(range(32))

    def pick(rank, num_ranks, local, allowed, count):  # no topology in sysfs: each CPU its own core
        return bench.pick_cpus(rank, num_ranks, local, allowed, count, str(tmp_path))

    # GPUs on different nodes: each rank near its own, past the node's first core.
    assert pick(0, 2, list(range(0, 16)), allowed, 4) == [1, 2, 3, 4]
    assert pick(1, 2, list(range(16, 32)), allowed, 4) == [24, 25, 26, 27]
    # GPUs on one node: disjoint cores of it.
    picks = [set(pick(r, 2, list(range(0, 16)), allowed, 4)) for r in range(2)]
    assert not picks[0] & picks[1] and picks[0] | picks[1] <= set(range(1, 16))
    # Fewer cores than asked: what the rank's slice holds, at least one.
    assert pick(1, 2, [0, 1, 2], allowed, 4) == [2]
    assert pick(0, 1, list(range(8)), allowed, 1) == [1]
    # Local CPUs the process may not use, or none known: among those it may use.
    assert pick(0, 1, [40, 41], allowed, 2) == [1, 2]
    assert pick(0, 1, [], [5], 4) == [5]
    assert pick(0, 1, [], [], 4) == []


def test_pick_cpus_keeps_a_cores_hyperthreads_to_one_thread(tmp_path):
    bench = _host_overhead_module()
    # 16 cores of two hyperthreads each, CPU n beside CPU n + 16 (one NUMA node, both GPUs on it).
    for cpu in range(32):
        topology = tmp_path / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        topology.joinpath("thread_siblings_list").write_text(f"{cpu % 16},{cpu % 16 + 16}\n")
    assert bench.thread_siblings(17, str(tmp_path)) == (1, 17)
    picks = [bench.pick_cpus(r, 2, list(range(32)), list(range(32)), 4, str(tmp_path)) for r in range(2)]
    # Past the first core, disjoint physical cores: rank 0 on cores 1-4, rank 1 on cores 8-11, one CPU each, so
    # no CPU of a rank (its calling thread's above all) has a hyperthread sibling that any rank uses.
    assert picks == [[1, 2, 3, 4], [8, 9, 10, 11]]
    used = {cpu for pick in picks for cpu in pick}
    assert not any((cpu + 16) % 32 in used for cpu in used)


def test_slowest_own_work_is_each_rows_largest_over_the_ranks():
    bench = _host_overhead_module()
    rank0 = [("a", 10.0, 11.0, 0.0, 9.0, 12.0, 12.0), ("b", 30.0, 31.0, 5.0, 25.0, 40.0, 35.0)]
    rank1 = [("a", 12.0, 11.0, 0.0, 12.0, 13.0, 13.0), ("b", 20.0, 31.0, 8.0, 12.0, 41.0, 33.0)]
    assert bench.slowest_own_us([rank0, rank1]) == [12.0, 25.0]


def test_compact_cpus_writes_runs_as_ranges():
    bench = _host_overhead_module()
    assert bench.compact_cpus([16, 0, 1, 2, 5, 17]) == "0-2,5,16-17" and bench.compact_cpus([]) == ""


def test_own_work_is_the_median_of_each_calls_host_time_less_its_wait():
    bench = _host_overhead_module()
    # Calls of 50, 60 and 100 µs that waited 40, 0 and 30: own work 10, 60, 70 -> median 60 (the median of host
    # times less the mean wait would read 60 - 23.3).
    assert abs(bench.own_work_us([50e-6, 60e-6, 100e-6], [40.0, 0.0, 30.0]) - 60.0) < 1e-6


def test_split_cores_gives_the_calling_thread_its_own_core():
    bench = _host_overhead_module()
    assert bench.split_cores([3, 4, 5, 6]) == ([3], [4, 5, 6])
    assert bench.split_cores([7]) == ([7], [7])  # one core serves both
    assert bench.split_cores([]) == ([], [])


def test_busy_threads_names_the_threads_that_kept_a_cpu_busy(tmp_path):
    bench = _host_overhead_module()
    ticks = os.sysconf("SC_CLK_TCK")

    def thread(tid, name, cpu_s, cpu):
        task = tmp_path / str(tid)
        task.mkdir()
        fields = ["S"] + ["0"] * 40  # fields 3.. of /proc/<pid>/task/<tid>/stat
        fields[11], fields[12] = str(int(cpu_s * ticks)), "0"  # utime, stime
        fields[36] = str(cpu)  # the CPU it last ran on
        (task / "stat").write_text(f"{tid} ({name}) " + " ".join(fields) + "\n")
        (task / "comm").write_text(name + "\n")

    thread(1, "python3", 5.0, 3)
    thread(2, "cuda-EvtHandlr", 0.1, 7)
    thread(3, "pt_autograd_0", 2.0, 4)
    # Busiest first; a thread under the share (0.1 s of 10 s) is left out.
    assert bench.busy_threads(0.05, str(tmp_path), lifetime_s=10.0) == [
        "python3 (tid 1, CPU 3): 5.0 s of 10.0 s",
        "pt_autograd_0 (tid 3, CPU 4): 2.0 s of 10.0 s",
    ]
    assert bench.process_lifetime_s() > 0


@pytest.mark.parametrize("extension", [False, True])
def test_stub_rows_time_every_entry_point_on_both_paths(monkeypatch, extension):
    """python_host_overhead.py --stub (--stub-extension) times every entry point: through the Python path, or
    through the torch extension's path with its calls stubbed (fake_runtime.StubTorchCalls), whose results the
    calls then return."""
    import epx.buffer as buffer_module

    bench = _host_overhead_module()
    flags = ["--stub", "--iters", "2", "--warmup", "1", "--hidden", "256"] + (["--stub-extension"] * extension)
    o = bench.parse_args(flags)
    buffer, _ = install_stub(o.normal_tokens, o.hidden, o.experts, monkeypatch, extension=o.stub_extension,
                             num_topk=o.topk)
    wrapper = deep_ep_wrapper(buffer)
    rows = bench.run_rows((wrapper, wrapper), torch, o, 1, torch.device("cpu"), False, lambda: None)
    assert [row[0] for row in rows] == list(bench.ENTRY_POINTS)
    calls = buffer_module.torch_calls
    assert (calls is not None) == extension
    if extension:
        gen = torch.Generator().manual_seed(1)
        ids = torch.rand(o.normal_tokens, o.experts, generator=gen).topk(o.topk, dim=1).indices
        per_rank, _, per_expert, in_rank, _ = wrapper.get_dispatch_layout(ids, o.experts)
        assert per_expert is calls.layout[2]
        x = torch.zeros(o.normal_tokens, o.hidden, dtype=torch.bfloat16)
        recv_x, *_ = wrapper.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                      num_tokens_per_expert=per_expert, topk_idx=ids,
                                      topk_weights=torch.rand(o.normal_tokens, o.topk))
        assert recv_x is calls.recv_x
