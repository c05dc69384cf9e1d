"""The binding's host-only parts: constants, size hints, layouts, errors, the bootstrap bridge. No GPU."""

import os
import subprocess
import sys

import pytest

import epx
from epx import _epx

MiB = 1 << 20


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
    # The package and its host-only parts load without importing torch.
    code = "import sys, epx, epx.compat.deep_ep, epx.reference; assert 'torch' not in sys.modules; print('ok')"
    env = dict(os.environ, EPX_NO_TORCH_PRELOAD="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---- Size hints ----


@pytest.mark.parametrize("num_max_tokens,hidden,num_ranks,num_experts",
                         [(128, 7168, 4, 288), (1, 128, 1, 1), (256, 4096, 8, 64), (64, 2048, 2, 32)])
def test_low_latency_size_hint(num_max_tokens, hidden, num_ranks, num_experts):
    hint = epx.get_low_latency_rdma_size_hint(num_max_tokens, hidden, num_ranks, num_experts)
    layout = _epx.LowLatencyLayout(num_max_tokens, hidden, num_ranks, num_experts)
    assert hint % (2 * MiB) == 0
    assert layout.total_bytes() <= hint < layout.total_bytes() + 2 * MiB
    # More tokens never need less memory.
    assert epx.get_low_latency_rdma_size_hint(num_max_tokens + 1, hidden, num_ranks, num_experts) >= hint


def test_normal_size_hint_fits_the_planned_tokens():
    for hidden in (128, 2048, 7168):
        for num_ranks in (1, 2, 4, 8):
            hint = epx.normal_nvl_buffer_size_hint(hidden * 2, num_ranks)
            assert hint % (2 * MiB) == 0
            assert epx.Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks) == hint
            # A BF16 dispatch with 16 top-k fits the default 4096 tokens per rank.
            shape = _epx.NormalShape(num_ranks=num_ranks, num_experts=num_ranks * 4, hidden=hidden,
                                     x_row_bytes=hidden * 2, num_scales=0, num_topk=16)
            assert _epx.NormalLayout.fit(shape, hint).capacity >= _epx.DEFAULT_MAX_TOKENS_PER_RANK
    small = epx.normal_nvl_buffer_size_hint(7168 * 2, 8, max_tokens_per_rank=128)
    assert small < epx.normal_nvl_buffer_size_hint(7168 * 2, 8)


def test_normal_layout_regions_are_ordered_and_aligned():
    shape = _epx.NormalShape(num_ranks=4, num_experts=64, hidden=7168, x_row_bytes=7168, num_scales=56, num_topk=8)
    layout = _epx.NormalLayout.with_capacity(shape, 100)
    offsets = [layout.send_counts_offset(), layout.expert_counts_offset(), layout.send_lists_offset(),
               layout.stage_x_offset(), layout.stage_scales_offset(), layout.stage_topk_idx_offset(),
               layout.stage_topk_weights_offset(), layout.combine_x_offset(), layout.combine_weights_offset(),
               layout.half_bytes()]
    assert offsets == sorted(offsets)
    assert all(offset % 128 == 0 for offset in offsets)
    assert layout.half_offset(1) - layout.half_offset(0) == layout.half_stride
    assert layout.total_bytes() == _epx.NormalLayout.CONTROL_BYTES + 2 * layout.half_stride
    # fit() picks the largest capacity whose halves fit.
    fitted = _epx.NormalLayout.fit(shape, layout.total_bytes())
    assert fitted.capacity >= 100
    assert _epx.NormalLayout.with_capacity(shape, fitted.capacity + 1).half_bytes() > fitted.half_stride


def test_low_latency_layout_control_depends_only_on_ranks():
    a = _epx.LowLatencyLayout(128, 7168, 4, 288)
    b = _epx.LowLatencyLayout(16, 256, 4, 8)
    assert a.control_bytes() == b.control_bytes()
    assert a.recv_flag_offset(1, 1, 3) == b.recv_flag_offset(1, 1, 3)
    assert a.num_local_experts() == 72 and a.num_recv_rows() == 512 and a.num_groups() == 56
    assert a.half_offset(1) - a.half_offset(0) == a.half_bytes()
    assert a.total_bytes() == a.half_offset(2)
    assert a.dispatch_recv_msg_offset(0, 1, 0) - a.dispatch_recv_msg_offset(0, 0, 0) == 128 * a.dispatch_msg_bytes()


# ---- Errors carry the C++ message ----


def test_size_hint_errors_name_argument_value_and_rule():
    with pytest.raises(epx.EpxError) as info:
        epx.get_low_latency_rdma_size_hint(128, 100, 4, 288)
    error = info.value
    assert "invalid hidden = 100: must be a multiple of 128" in str(error)
    assert error.message.startswith("invalid hidden = 100")
    assert error.file.endswith("low_latency_layout.hpp")
    assert isinstance(error.line, int) and error.line > 0
    assert str(error) == f"{error.file}:{error.line}: {error.message}"
    with pytest.raises(epx.EpxError, match="invalid num_experts = 10: must be a multiple of the number of ranks"):
        epx.get_low_latency_rdma_size_hint(128, 128, 4, 10)
    with pytest.raises(epx.EpxError, match="invalid num_max_dispatch_tokens_per_rank = 0: must be > 0"):
        epx.get_low_latency_rdma_size_hint(0, 128, 4, 8)
    with pytest.raises(epx.EpxError, match="invalid num_ranks = 9: must be <= 8"):
        epx.normal_nvl_buffer_size_hint(256, 9)
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
    assert str(error) == f"{error.file}:{error.line}: buffer half 1 is busy"
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


def test_buffer_options_carry_ranks_per_node():
    if not epx.WITH_CUDA:
        pytest.skip("built without CUDA")
    assert _epx.BufferOptions().ranks_per_node == 0
    options = _epx.BufferOptions(num_rdma_bytes=1 << 21, ranks_per_node=2)
    assert (options.num_rdma_bytes, options.ranks_per_node) == (1 << 21, 2)
    options.ranks_per_node = 4
    assert options.ranks_per_node == 4


def test_runtime_buffer_without_gpu_raises_epx_error():
    if not epx.WITH_CUDA:
        pytest.skip("built without CUDA")
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
