"""The binding's host-only parts: constants, size hints, layouts, errors, the bootstrap bridge. No GPU."""

import os
import subprocess
import sys

import pytest

import epx
from epx import _epx

MiB = 1 << 20
# The binding's CUDA runtime part (Buffer, Event, the call structs) is compiled only with CUDA.
needs_cuda_runtime = pytest.mark.skipif(not epx.WITH_CUDA, reason="built without CUDA (EPX_WITH_CUDA=OFF): "
                                        "epx._epx has no CUDA runtime part")


def test_module_basics():
    assert epx.__version__ == _epx.__version__
    assert epx.MAX_TOPK == 16
    assert _epx.MAX_NVL_RANKS == 8
    assert _epx.MAX_EXPERTS == 4096
    assert isinstance(epx.WITH_CUDA, bool)
    assert isinstance(epx.WITH_NVSHMEM, bool)
    assert epx.EpxError is _epx.EpxError
    assert issubclass(epx.EpxError, RuntimeError)


def test_import_needs_no_torch():
    # The package and its host-only parts load without importing torch, and without the tools (epx_tools),
    # whose CPU reference loads without torch too.
    code = ("import sys, epx, epx.compat.deep_ep; assert not [m for m in sys.modules if m.startswith('epx_tools')]; "
            "import epx_tools.reference; assert 'torch' not in sys.modules; print('ok')")
    env = dict(os.environ, EPX_NO_TORCH_PRELOAD="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_torch_extension_loads_where_built():
    """epx._epx_torch, where the build made it (beside epx._epx: torch was there), loads and accepts the table of
    the epx._epx beside it (the same headers), so epx.Buffer's hot calls take it."""
    import glob

    import epx._ext as ext

    built = glob.glob(os.path.join(os.path.dirname(_epx.__file__), "_epx_torch*.so"))
    if not built:
        pytest.skip("epx._epx_torch was not built (no torch at build time, or no CUDA)")
    pytest.importorskip("torch")
    if os.environ.get("EPX_TORCH_EXT") == "0":
        pytest.skip("EPX_TORCH_EXT=0 turns it off")
    assert ext.torch_calls is not None, ext.torch_calls_error
    assert callable(ext.torch_calls.low_latency_dispatch) and callable(ext.torch_calls.combine)


# ---- Size hints ----


@pytest.mark.parametrize("num_max_tokens,hidden,num_ranks,num_experts",
                         [(128, 7168, 4, 288), (1, 128, 1, 1), (256, 4096, 8, 64), (64, 2048, 2, 32)])
def test_low_latency_size_hint(num_max_tokens, hidden, num_ranks, num_experts):
    hint = epx.get_low_latency_rdma_size_hint(num_max_tokens, hidden, num_ranks, num_experts)
    layout = _epx.LowLatencyBufferMap(num_max_tokens, hidden, num_ranks, num_experts)
    assert hint % (2 * MiB) == 0
    assert layout.total_bytes() <= hint < layout.total_bytes() + 2 * MiB
    # More tokens never need less memory.
    assert epx.get_low_latency_rdma_size_hint(num_max_tokens + 1, hidden, num_ranks, num_experts) >= hint


def align(value, alignment):
    return (value + alignment - 1) // alignment * alignment


CONFIGS = [_epx.Config(), _epx.Config(num_sms=24, num_max_nvl_chunked_send_tokens=24),
           _epx.Config(2, 1, 1, 1, 1), _epx.Config(48, 8, 512, 16, 128), _epx.Config(257, 6, 256)]


def test_config_binding_fields_and_defaults():
    config = _epx.Config()
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 256)
    assert config.num_channels() == 10
    assert [_epx.Config(num_sms=n).num_channels() for n in (1, 2, 3, 24, 257)] == [1, 1, 1, 12, 128]
    config.num_max_nvl_chunked_recv_tokens = 128
    assert config == _epx.Config(num_max_nvl_chunked_recv_tokens=128) and config != _epx.Config()
    assert "num_max_nvl_chunked_recv_tokens=128" in repr(config)
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 16) == config.get_rdma_buffer_size_hint(7168 * 2, 16, 8) > 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 4, ranks_per_node=4) == 0
    with pytest.raises(epx.EpxError, match="invalid ranks_per_node = 3: must divide num_ranks"):
        config.get_rdma_buffer_size_hint(7168 * 2, 8, 3)
    # epx.Config converts both ways.
    custom = epx.Config(24, 8, 288, 16, 128)
    assert custom.to_native() == _epx.Config(24, 8, 288, 16, 128)
    assert epx.Config.from_native(custom.to_native()) == custom
    assert custom.num_channels() == custom.to_native().num_channels() == 12


@pytest.mark.parametrize("hidden", [128, 2048, 7168])
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_normal_size_hint_is_the_layout_of_the_largest_record(hidden, num_ranks):
    hidden_bytes = hidden * 2
    for config in CONFIGS:
        layout = _epx.NormalBufferMap.of(num_ranks, config, _epx.NormalRecord.largest(hidden_bytes))
        hint = _epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks, config)
        assert hint == align(layout.total_bytes(), 128)
        assert config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) == hint
        python_config = epx.Config.from_native(config)
        assert python_config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) == hint
        assert epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks, python_config) == hint
        assert epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks, config) == hint
        # The hint fits the queues of every call with this config: BF16 or FP8 dispatch, combine, top-k <= 16.
        for record in (_epx.NormalRecord.dispatch(_epx.NormalShape(num_ranks, num_ranks * 4, hidden, hidden_bytes,
                                                                   0, 16)),
                       _epx.NormalRecord.combine(hidden, 16), _epx.NormalRecord.combine(hidden, 0)):
            _epx.check_normal_map_fits(_epx.NormalBufferMap.of(num_ranks, config, record), hint)
        if hidden % 128 == 0:
            fp8 = _epx.NormalShape(num_ranks, num_ranks * 4, hidden, hidden, hidden // 128, 16)
            _epx.check_normal_map_fits(_epx.NormalBufferMap.of(num_ranks, config, _epx.NormalRecord.dispatch(fp8)),
                                          hint)
    # The default config is the default argument.
    assert epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks) == \
        _epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks) == \
        epx.Config().get_nvl_buffer_size_hint(hidden_bytes, num_ranks) == \
        _epx.Config().get_nvl_buffer_size_hint(hidden_bytes, num_ranks)


def test_normal_size_hint_takes_no_token_count():
    import inspect

    assert [p.name for p in inspect.signature(epx.normal_nvl_buffer_size_hint).parameters.values()] == [
        "hidden_bytes", "num_ranks", "config"]
    assert not hasattr(_epx, "DEFAULT_MAX_TOKENS_PER_RANK")
    with pytest.raises(TypeError):
        _epx.normal_nvl_buffer_size_hint(7168 * 2, 8, 4096)  # the old max_tokens_per_rank argument
    with pytest.raises(epx.EpxError, match="must be an epx.Config"):
        epx.normal_nvl_buffer_size_hint(7168 * 2, 8, 4096)


def test_normal_size_hint_grows_with_channels_and_queue_tokens_only():
    hidden_bytes, num_ranks = 7168 * 2, 8

    def hint(**fields):
        return _epx.normal_nvl_buffer_size_hint(hidden_bytes, num_ranks, _epx.Config(**fields))

    by_sms = [hint(num_sms=n) for n in (2, 12, 20, 24, 48, 132)]
    assert by_sms == sorted(set(by_sms))  # strictly increasing
    assert hint(num_sms=20) == hint(num_sms=21)  # the same 10 channels
    by_queue = [hint(num_max_nvl_chunked_recv_tokens=q) for q in (6, 64, 256, 512, 1024)]
    assert by_queue == sorted(set(by_queue))
    # The send chunk and the RDMA fields do not change the memory.
    assert hint(num_max_nvl_chunked_send_tokens=1) == hint(num_max_nvl_chunked_send_tokens=256) == hint()
    assert hint(num_max_rdma_chunked_send_tokens=20, num_max_rdma_chunked_recv_tokens=128) == hint()
    # Queue bytes scale linearly: twice the channels or twice the queue tokens, twice the queues.
    queues = hint() - _epx.NormalBufferMap.QUEUES_OFFSET
    assert hint(num_sms=40) - _epx.NormalBufferMap.QUEUES_OFFSET == 2 * queues
    assert hint(num_max_nvl_chunked_recv_tokens=512) - _epx.NormalBufferMap.QUEUES_OFFSET == 2 * queues
    # More ranks and wider rows need more; one rank needs no queues at all.
    by_ranks = [_epx.normal_nvl_buffer_size_hint(hidden_bytes, r) for r in range(1, 9)]
    assert by_ranks == sorted(set(by_ranks))
    assert by_ranks[0] == align(_epx.NormalBufferMap.QUEUES_OFFSET, 128)
    assert _epx.normal_nvl_buffer_size_hint(4096 * 2, num_ranks) < _epx.normal_nvl_buffer_size_hint(hidden_bytes,
                                                                                                    num_ranks)


def test_normal_layout_of_a_config():
    config = _epx.Config(num_sms=24, num_max_nvl_chunked_recv_tokens=128)
    record = _epx.NormalRecord.largest(7168 * 2)
    layout = _epx.NormalBufferMap.of(4, config, record)
    assert (layout.num_ranks, layout.num_channels, layout.queue_tokens, layout.record_bytes) == (4, 12, 128,
                                                                                                 record.bytes())
    assert layout.queue_bytes() == 128 * record.bytes()
    assert layout.total_bytes() == _epx.NormalBufferMap.QUEUES_OFFSET + 3 * 12 * layout.queue_bytes()
    bm = _epx.NormalBufferMap
    offsets = [bm.CONTROL_OFFSET, bm.COUNTERS_OFFSET, bm.NOTIFY_OFFSET, bm.DIRECT_OFFSET, bm.QUEUES_OFFSET]
    assert offsets == sorted(set(offsets)) and offsets[0] == 0
    assert all(offset % 128 == 0 for offset in offsets)
    assert bm.NOTIFY_OFFSET + 2 * bm.NOTIFY_HALF_BYTES == bm.DIRECT_OFFSET
    # Owners keep no queue from themselves.
    assert [_epx.NormalBufferMap.source_slot(src, 2) for src in (0, 1, 3)] == [0, 1, 2]
    assert _epx.MAX_CHANNELS == 128


def test_normal_records():
    largest = _epx.NormalRecord.largest(7168 * 2)
    assert (largest.x_bytes, largest.num_scales, largest.num_topk_idx, largest.num_topk_weights,
            largest.with_src_idx) == (14336, 0, 16, 16, True)
    assert largest.bytes() == align(14336 + 16 * 4 + 16 * 4 + 4, 16)
    offsets = [largest.scales_offset(), largest.topk_idx_offset(), largest.topk_weights_offset(),
               largest.src_idx_offset(), largest.bytes()]
    assert offsets == sorted(offsets)
    fp8 = _epx.NormalRecord.dispatch(_epx.NormalShape(num_ranks=8, num_experts=256, hidden=7168, x_row_bytes=7168,
                                                      num_scales=56, num_topk=8))
    assert (fp8.x_bytes, fp8.num_scales, fp8.num_topk_idx, fp8.num_topk_weights, fp8.with_src_idx) == (7168, 56, 8, 8,
                                                                                                         True)
    assert fp8.bytes() == align(7168 + 56 * 4 + 8 * 4 + 8 * 4 + 4, 16) and fp8.bytes() < largest.bytes()
    combine = _epx.NormalRecord.combine(7168, 8)
    assert (combine.x_bytes, combine.num_scales, combine.num_topk_idx, combine.num_topk_weights,
            combine.with_src_idx) == (14336, 0, 0, 8, False)
    assert combine.bytes() == align(14336 + 8 * 4, 16) and combine.bytes() < largest.bytes()
    custom = _epx.NormalRecord(x_bytes=256, num_topk_weights=3)
    assert custom.bytes() == align(256 + 12, 16) and not custom.with_src_idx
    assert all(r.bytes() % 16 == 0 for r in (largest, fp8, combine, custom))


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 100, 32768])
@pytest.mark.parametrize("num_channels", [1, 3, 10, 128])
def test_channel_token_ranges_cover_the_batch_in_order(num_tokens, num_channels):
    ranges = [_epx.channel_token_range(num_tokens, num_channels, c) for c in range(num_channels)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_tokens
    assert all(ranges[c][1] == ranges[c + 1][0] for c in range(num_channels - 1))
    per_channel = -(-num_tokens // num_channels)
    assert all(0 <= end - begin <= per_channel for begin, end in ranges)


def test_a_call_that_does_not_fit_names_the_bytes_it_needs():
    layout = _epx.NormalBufferMap.of(8, _epx.Config(), _epx.NormalRecord.largest(7168 * 2))
    _epx.check_normal_map_fits(layout, layout.total_bytes())
    with pytest.raises(epx.EpxError, match=f"invalid num_nvl_bytes = {layout.total_bytes() - 1}: must be >= "
                                           f"{layout.total_bytes()} for this call \\(8 ranks, 10 channels, 256 tokens"):
        _epx.check_normal_map_fits(layout, layout.total_bytes() - 1)


@pytest.mark.parametrize("fields,message", [
    (dict(num_sms=0), "invalid num_sms = 0: must be >= 1"),
    (dict(num_sms=258), "invalid num_sms = 258: must be < 258"),
    (dict(num_max_nvl_chunked_send_tokens=0), "invalid num_max_nvl_chunked_send_tokens = 0: must be >= 1"),
    (dict(num_max_nvl_chunked_recv_tokens=0), "invalid num_max_nvl_chunked_recv_tokens = 0: must be >= 1"),
    (dict(num_max_nvl_chunked_send_tokens=300),
     r"invalid num_max_nvl_chunked_send_tokens = 300: must be <= num_max_nvl_chunked_recv_tokens \(256\)"),
    (dict(num_max_rdma_chunked_send_tokens=0), "invalid num_max_rdma_chunked_send_tokens = 0: must be >= 1"),
    (dict(num_max_rdma_chunked_recv_tokens=-1), "invalid num_max_rdma_chunked_recv_tokens = -1: must be >= 1"),
])
def test_config_errors_name_the_field(fields, message):
    config = _epx.Config(**fields)  # the binding's struct is plain: the checks come where it is used
    with pytest.raises(epx.EpxError, match=message):
        _epx.validate_config(config)
    with pytest.raises(epx.EpxError, match=message):
        config.get_nvl_buffer_size_hint(7168 * 2, 8)
    with pytest.raises(epx.EpxError, match=message):
        _epx.normal_nvl_buffer_size_hint(7168 * 2, 8, config)
    with pytest.raises(epx.EpxError, match=message):
        epx.Config(**fields)  # epx.Config checks when built
    _epx.validate_config(_epx.Config())
    _epx.validate_config(_epx.Config(2, 256, 256, 1, 1))  # send chunk == queue tokens is allowed


def deep_ep_nvl_size_hint(config, hidden_bytes, num_ranks):
    """DeepEP V1's Config::get_nvl_buffer_size_hint within one NVLink domain (NUM_MAX_NVL_PEERS = 8, top-k ids
    int64, at most 128 top-k and 128 scales, NVSHMEM source metadata left out), rounded up to 128."""
    num_rdma_ranks = max(num_ranks // 8, 1)
    num_nvl_ranks = min(num_ranks, 8)
    num_channels = config.num_sms // 2
    num_recv_tokens = config.num_max_nvl_chunked_recv_tokens
    num_bytes = num_channels * num_nvl_ranks * (2 * num_rdma_ranks + 3) * 4
    num_bytes += num_channels * num_nvl_ranks * num_recv_tokens * (hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4)
    return align(num_bytes, 128)


@pytest.mark.parametrize("num_sms", [20, 24])
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_megatron_sizing_is_below_deep_ep(num_ranks, num_sms):
    import epx.compat.deep_ep as deep_ep

    hidden_bytes = 7168 * max(2, 2)  # Megatron-LM: hidden * max(x.element_size(), 2) for BF16 tokens
    old = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(num_sms)
        configs = (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks))
        ours = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for config in configs)
        theirs = max(deep_ep_nvl_size_hint(config, hidden_bytes, num_ranks) for config in configs)
    finally:
        deep_ep.Buffer.num_sms = old
    assert ours < theirs, (ours, theirs)
    # Each config's queues fit what Megatron allocates.
    for config in configs:
        layout = _epx.NormalBufferMap.of(num_ranks, config.to_native(), _epx.NormalRecord.largest(hidden_bytes))
        _epx.check_normal_map_fits(layout, ours)


@needs_cuda_runtime
def test_runtime_buffer_has_a_config_property():
    assert isinstance(_epx.Buffer.config, property) and _epx.Buffer.config.fset is not None


def test_low_latency_layout_control_depends_only_on_ranks():
    a = _epx.LowLatencyBufferMap(128, 7168, 4, 288)
    b = _epx.LowLatencyBufferMap(16, 256, 4, 8)
    assert a.control_end_offset() == b.control_end_offset()
    assert a.recv_flag_offset(1, 1, 3) == b.recv_flag_offset(1, 1, 3)
    assert a.num_local_experts() == 72 and a.num_recv_rows() == 512 and a.num_groups() == 56
    assert a.half_offset(1) - a.half_offset(0) == a.half_bytes()
    assert a.listings_offset(0) == a.half_offset(2)  # the listings of both halves follow the halves
    assert a.total_bytes() == a.listings_offset(2) == a.listings_offset(0) + 2 * a.listings_half_bytes()
    assert a.dispatch_recv_msg_offset(0, 1, 0) - a.dispatch_recv_msg_offset(0, 0, 0) == 128 * a.dispatch_msg_bytes()


# ---- Errors carry the C++ message ----


def test_size_hint_errors_name_argument_value_and_rule():
    with pytest.raises(epx.EpxError) as info:
        epx.get_low_latency_rdma_size_hint(128, 100, 4, 288)
    error = info.value
    assert "invalid hidden = 100: must be a multiple of 128" in str(error)
    assert error.message.startswith("invalid hidden = 100")
    assert error.file.endswith("low_latency_buffer_map.hpp")
    assert isinstance(error.line, int) and error.line > 0
    assert str(error) == error.message  # the source only with EPX_DEBUG_ERRORS=1 (docs/RELIABILITY.md)
    with pytest.raises(epx.EpxError, match="invalid num_experts = 10: must be a multiple of the number of ranks"):
        epx.get_low_latency_rdma_size_hint(128, 128, 4, 10)
    with pytest.raises(epx.EpxError, match="invalid num_max_dispatch_tokens_per_rank = 0: must be > 0"):
        epx.get_low_latency_rdma_size_hint(0, 128, 4, 8)
    with pytest.raises(epx.EpxError, match="invalid num_ranks = 65: must be <= 64"):
        epx.normal_nvl_buffer_size_hint(256, 65)
    with pytest.raises(epx.EpxError, match="invalid hidden_bytes = 100: must be a multiple of 16"):
        epx.normal_nvl_buffer_size_hint(100, 2)
    with pytest.raises(epx.EpxError, match="invalid num_topk = 17: must be <= 16"):
        _epx.validate_normal_shape(_epx.NormalShape(num_ranks=2, num_experts=4, hidden=128, x_row_bytes=256,
                                                    num_scales=0, num_topk=17))


def test_python_raised_error_has_no_location():
    error = epx.EpxError("from python")
    assert error.file is None and error.line is None and error.message is None
    assert str(error) == "from python"


# ---- C++ exceptions from calls that release the GIL (every call that waits on the GPU or peers does) ----
# _throw_with_gil: the exception translator (GIL held); _throw_without_gil: call_without_gil, how every
# GIL-releasing binding calls C++; _throw_call_guard: pybind11's py::call_guard<py::gil_scoped_release>.


@pytest.mark.parametrize("name", ["_throw_with_gil", "_throw_without_gil"])
def test_cpp_errors_reach_python(name):
    call = getattr(_epx, name)
    assert call("") == 42
    with pytest.raises(epx.EpxError) as info:
        call("epx", "buffer half 1 is busy")
    error = info.value
    assert error.message == "buffer half 1 is busy"
    assert error.file.endswith("core.cpp") and isinstance(error.line, int) and error.line > 0
    assert str(error) == "buffer half 1 is busy"
    # Other C++ exceptions keep pybind11's standard mapping.
    with pytest.raises(ValueError, match="bad shape"):
        call("invalid_argument", "bad shape")
    with pytest.raises(MemoryError):
        call("bad_alloc")
    # A message that is not UTF-8 still arrives (replaced bytes), as an EpxError.
    with pytest.raises(epx.EpxError) as info:
        call("epx", b"bad \xff byte")
    assert info.value.message == "bad \ufffd byte"
    assert call("") == 42  # and the module keeps working


def test_calls_without_gil_release_it_and_raise_in_any_thread():
    import threading
    import time

    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.02)
        before = len(ticks)
        with pytest.raises(epx.EpxError, match="after a wait"):
            _epx._throw_without_gil("epx", "after a wait", sleep_ms=200)
        during = len(ticks) - before
    finally:
        stop.set()
        spinner.join()
    assert during > 10, "the Python thread did not run while C++ waited: the GIL was not released"

    messages = []

    def fail(i):
        try:
            _epx._throw_without_gil("epx", f"thread {i}", sleep_ms=10)
        except epx.EpxError as error:
            messages.append(error.message)

    threads = [threading.Thread(target=fail, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(messages) == sorted(f"thread {i}" for i in range(8))


def test_cpp_errors_from_every_kind_of_call_in_a_fresh_process():
    # As the GPU tests import it (torch first when installed), each path raises and the process survives; a
    # crash names the path that took it down (faulthandler prints where).
    code = """
import epx
from epx import _epx
for name in ("_throw_with_gil", "_throw_without_gil", "_throw_call_guard"):
    print(name, flush=True)
    try:
        getattr(_epx, name)("epx", "boom")
    except epx.EpxError as error:
        assert error.message == "boom", error
    else:
        raise AssertionError(name + " did not raise")
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stdout, out.stderr)


@needs_cuda_runtime
def test_buffer_options_carry_ranks_per_node():
    assert _epx.BufferOptions().ranks_per_node == 0
    options = _epx.BufferOptions(num_rdma_bytes=1 << 21, ranks_per_node=2)
    assert (options.num_rdma_bytes, options.ranks_per_node) == (1 << 21, 2)
    options.ranks_per_node = 4
    assert options.ranks_per_node == 4


@needs_cuda_runtime
def test_call_structs_take_their_fields_by_keyword():
    """The torch layer fills a call's struct in one constructor call: every field by keyword (pointers as ints),
    defaults for the rest, a TypeError naming an unknown field or a value of the wrong type."""
    default = _epx.LowLatencyDispatchInput()
    given = _epx.LowLatencyDispatchInput(x=0x1000, num_tokens=3, use_fp8=False, topk_weights=0x2000)
    assert (given.x, given.num_tokens, given.use_fp8, given.topk_weights) == (0x1000, 3, False, 0x2000)
    assert (given.hidden, given.round_scale, given.topk_idx) == (default.hidden, default.round_scale, 0)
    dispatch = _epx.DispatchInput(format=_epx.TokenFormat.FP8, expert_alignment=4)
    assert dispatch.format == _epx.TokenFormat.FP8 and dispatch.expert_alignment == 4
    assert _epx.DispatchInput().expert_alignment == 1
    with pytest.raises(TypeError, match="unknown field num_tokenz"):
        _epx.LowLatencyDispatchInput(num_tokenz=3)
    with pytest.raises(TypeError, match="x: cannot take a str"):
        _epx.CombineInput(x="0x1000")
    with pytest.raises(TypeError, match="num_topk: cannot take a float"):
        _epx.LowLatencyCombineInput(num_topk=2.5)
    for name in ("DispatchLayoutOutput", "DispatchOutput", "CombineOutput", "LowLatencyDispatchOutput"):
        assert getattr(_epx, name)() is not None


def test_device_view_capsule_is_a_dltensor():
    torch = pytest.importorskip("torch")
    source = torch.arange(6, dtype=torch.int64)
    view = torch.utils.dlpack.from_dlpack(_epx.device_view_capsule(source.data_ptr(), 0, 64, [2, 3], 1, 0, source))
    assert view.dtype == torch.int64 and view.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert view.data_ptr() == source.data_ptr()


@needs_cuda_runtime
def test_runtime_buffer_without_gpu_raises_epx_error():
    options = _epx.BufferOptions(num_nvl_bytes=0, num_rdma_bytes=0)
    try:
        buffer = _epx.Buffer(0, 1, lambda payload: [payload], lambda: None, options)
    except epx.EpxError as error:
        # No GPU here: the first CUDA call fails and names itself.
        assert "CUDA call" in str(error)
    else:  # a GPU machine: a one-rank Buffer works and is freed collectively
        buffer.destroy()
        assert buffer.is_destroyed
        with pytest.raises(epx.EpxError, match="used after destroy"):
            buffer.rank


# ---- The bootstrap bridge (how a Buffer all-gathers through torch.distributed) ----


def test_bootstrap_round_trip_orders_payloads_by_rank():
    calls = []

    def all_gather(payload):
        calls.append(payload)
        return [b"r0" + payload[2:], payload, bytearray(b"r2" + payload[2:])]

    def barrier():
        calls.append("barrier")

    gathered = _epx._bootstrap_round_trip(1, 3, all_gather, barrier, b"r1xy")
    assert gathered == b"r0xyr1xyr2xy"
    assert calls == [b"r1xy", "barrier"]


def test_bootstrap_errors():
    ok_barrier = lambda: None  # noqa: E731
    with pytest.raises(epx.EpxError, match="rank 0 sent 3 bytes but rank 1 sent 2"):
        _epx._bootstrap_round_trip(1, 2, lambda p: [b"abc", p], ok_barrier, b"xy")
    with pytest.raises(epx.EpxError, match="all_gather result length = 1: must equal num_ranks"):
        _epx._bootstrap_round_trip(0, 2, lambda p: [p], ok_barrier, b"xy")
    with pytest.raises(epx.EpxError, match="must be a sequence"):
        _epx._bootstrap_round_trip(0, 1, lambda p: p, ok_barrier, b"xy")
    with pytest.raises(epx.EpxError, match="payload of rank 1 is a"):
        _epx._bootstrap_round_trip(0, 2, lambda p: [p, 7], ok_barrier, b"xy")

    def failing_gather(payload):
        raise ValueError("peer went away")

    with pytest.raises(epx.EpxError, match="all_gather: the Python callback raised ValueError: peer went away"):
        _epx._bootstrap_round_trip(0, 2, failing_gather, ok_barrier, b"xy")

    def failing_barrier():
        raise TimeoutError("barrier timed out")

    with pytest.raises(epx.EpxError, match="barrier: the Python callback raised TimeoutError: barrier timed out"):
        _epx._bootstrap_round_trip(0, 1, lambda p: [p], failing_barrier, b"xy")
    with pytest.raises(epx.EpxError, match="invalid rank = 2: must be < num_ranks"):
        _epx._bootstrap_round_trip(2, 2, lambda p: [p, p], ok_barrier, b"")
    with pytest.raises(epx.EpxError, match="all_gather"):
        _epx._bootstrap_round_trip(0, 1, "not callable", ok_barrier, b"")


def test_bootstrap_empty_payload_acts_as_barrier():
    assert _epx._bootstrap_round_trip(0, 2, lambda p: [b"", b""], lambda: None, b"") == b""


def test_package_version_matches_cmake_project():
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with open(os.path.join(root, "CMakeLists.txt")) as f:
        cmake_version = re.search(r"project\(epx VERSION ([0-9.]+)", f.read()).group(1)
    with open(os.path.join(root, "python", "pyproject.toml")) as f:
        package_version = re.search(r'^version = "([0-9.]+)"', f.read(), re.M).group(1)
    assert package_version == cmake_version == epx.__version__
