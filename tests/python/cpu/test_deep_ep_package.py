"""The top-level deep_ep package EPX ships (frameworks that import deep_ep run unchanged): its names, the
metadata distribution behind importlib.metadata.version("deep_ep"), the Buffer constructor's keywords (group or
mpi4py comm), the runtime queries and EventHandle. No GPU and no torch needed."""

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

import epx
import epx.compat.deep_ep as compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DIST = os.path.join(ROOT, "python", "deep_ep_dist")


def run_python(code, extra_path=()):
    env = dict(os.environ, EPX_NO_TORCH_PRELOAD="1", PYTHONPATH=os.pathsep.join([*extra_path, *sys.path]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)


# ---- Package surface ----


def test_deep_ep_reexports_the_compat_layer():
    import deep_ep
    import deep_ep.buffer
    import deep_ep.utils

    assert importlib.util.find_spec("deep_ep") is not None
    for name in ("Buffer", "Config", "EventOverlap", "EventHandle"):
        assert getattr(deep_ep, name) is getattr(compat, name), name
        assert name in deep_ep.__all__
    assert "topk_idx_t" in deep_ep.__all__
    assert deep_ep.utils.EventOverlap is compat.EventOverlap and deep_ep.utils.EventHandle is compat.EventHandle
    assert deep_ep.buffer.Buffer is compat.Buffer
    assert deep_ep.__version__ == f"1.2.1+epx{epx.__version__}"
    with pytest.raises(AttributeError):
        deep_ep.no_such_name  # noqa: B018


def test_megatron_imports():
    # megatron/core/transformer/moe/fused_a2a.py, as written.
    code = ("from deep_ep import Buffer\n"
            "from deep_ep.utils import EventHandle, EventOverlap\n"
            "import sys, epx.compat.deep_ep as c\n"
            "assert Buffer is c.Buffer and EventHandle is c.EventHandle and EventOverlap is c.EventOverlap\n"
            "assert 'torch' not in sys.modules\n"
            "print('ok')")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_topk_idx_t_is_torch_int64():
    import deep_ep

    if importlib.util.find_spec("torch") is None:
        with pytest.raises(ImportError):
            deep_ep.topk_idx_t  # noqa: B018  (needs torch, as DeepEP's does)
        return
    import torch

    from deep_ep import topk_idx_t

    assert topk_idx_t is torch.int64 and compat.topk_idx_t is torch.int64


# ---- Packaging ----


def test_epx_wheel_ships_deep_ep():
    with open(os.path.join(ROOT, "python", "pyproject.toml")) as f:
        text = f.read()
    packages = re.search(r"^wheel\.packages = \[(.*)\]", text, re.MULTILINE).group(1)
    assert [p.strip().strip('"') for p in packages.split(",")] == ["epx", "deep_ep"]
    assert os.path.isfile(os.path.join(ROOT, "python", "deep_ep", "__init__.py"))
    assert os.path.isfile(os.path.join(ROOT, "python", "deep_ep", "utils.py"))


def load_backend():
    spec = importlib.util.spec_from_file_location("deep_ep_dist_backend", os.path.join(DIST, "deep_ep_dist_backend.py"))
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    return backend


def test_metadata_distribution_versions_follow_epx():
    backend = load_backend()
    assert backend.DEEP_EP_VERSION == compat.DEEP_EP_VERSION
    assert backend.EPX_VERSION == epx.__version__
    assert backend.VERSION == f"{compat.DEEP_EP_VERSION}+epx{epx.__version__}"
    import deep_ep

    assert backend.VERSION == deep_ep.__version__


def test_metadata_distribution_builds(tmp_path):
    backend = load_backend()
    import tarfile
    import zipfile

    assert backend.get_requires_for_build_wheel() == []
    wheel = backend.build_wheel(str(tmp_path))
    assert wheel == f"deep_ep-{backend.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(tmp_path / wheel) as archive:
        names = sorted(archive.namelist())
        metadata = archive.read(f"{backend.DIST_INFO}/METADATA").decode()
        record = archive.read(f"{backend.DIST_INFO}/RECORD").decode()
    assert names == sorted(f"{backend.DIST_INFO}/{n}" for n in ("METADATA", "WHEEL", "RECORD"))
    assert "Name: deep_ep\n" in metadata and f"Version: {backend.VERSION}\n" in metadata
    assert f"Requires-Dist: epx=={epx.__version__}" in metadata
    assert len(record.splitlines()) == 3
    sdist = backend.build_sdist(str(tmp_path))
    with tarfile.open(tmp_path / sdist) as archive:
        assert sorted(archive.getnames()) == sorted(f"deep_ep-{backend.VERSION}/{n}" for n in
                                                    ("pyproject.toml", "deep_ep_dist_backend.py", "PKG-INFO"))


def test_pip_installs_the_metadata_distribution(tmp_path):
    # pip builds it offline with its in-tree backend; importlib.metadata then finds deep_ep. (A copy: pip builds
    # in place.)
    source, target = tmp_path / "deep_ep_dist", tmp_path / "site"
    shutil.copytree(DIST, source)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--disable-pip-version-check", "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=300, check=False)
    if pip.returncode != 0 and "No module named pip" in pip.stderr:
        pytest.skip("pip is not installed")
    assert pip.returncode == 0, pip.stdout + pip.stderr
    code = ("import importlib.metadata as m, importlib.util, deep_ep\n"
            "assert importlib.util.find_spec('deep_ep') is not None\n"
            "print(m.version('deep_ep'), m.requires('deep_ep'), deep_ep.__version__)")
    out = run_python(code, extra_path=[str(target)])
    assert out.returncode == 0, out.stderr
    version = f"1.2.1+epx{epx.__version__}"
    assert out.stdout.split() == [version, f"['epx=={epx.__version__}']", version]


# ---- Buffer constructor: group or comm, DeepEP's keywords and attributes ----


class RecordingBuffer:
    """Stands in for epx.Buffer in the compat constructor: records its arguments."""

    def __init__(self, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, *, num_sms, enable_shrink=False,
                 bootstrap=None):
        self.args = SimpleNamespace(group=group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                                    low_latency_mode=low_latency_mode, num_sms=num_sms, enable_shrink=enable_shrink,
                                    bootstrap=bootstrap)


class FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class FakeComm:
    """The mpi4py.MPI.Comm methods the constructor uses; allgather answers for every rank."""

    def __init__(self, rank, size):
        self.rank, self.size, self.gathered = rank, size, []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def allgather(self, obj):
        self.gathered.append(obj)
        return [obj] * self.size


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(compat, "_EpxBuffer", RecordingBuffer)


def test_buffer_over_a_process_group(recording):
    import deep_ep

    group = FakeGroup(3, 8)
    buffer = deep_ep.Buffer(group, 1 << 20, 2 << 20, low_latency_mode=True, num_qps_per_rank=4,
                            allow_nvlink_for_low_latency_mode=False, allow_mnnvl=True, explicitly_destroy=True,
                            enable_shrink=True, use_fabric=True)
    assert (buffer.rank, buffer.group_size, buffer.group) == (3, 8, group)
    assert (buffer.num_nvl_bytes, buffer.num_rdma_bytes, buffer.low_latency_mode) == (1 << 20, 2 << 20, True)
    assert buffer.explicitly_destroy and buffer.enable_shrink and buffer.use_fabric
    args = buffer.runtime.args
    assert args.group is group and args.bootstrap is None  # epx.Buffer bootstraps over the group
    assert (args.num_nvl_bytes, args.num_rdma_bytes, args.low_latency_mode) == (1 << 20, 2 << 20, True)
    assert args.num_sms == deep_ep.Buffer.num_sms
    assert args.enable_shrink is True  # passed through to epx.Buffer
    defaults = deep_ep.Buffer(group)
    assert not (defaults.explicitly_destroy or defaults.enable_shrink or defaults.use_fabric)
    assert defaults.runtime.args.enable_shrink is False
    assert (defaults.num_nvl_bytes, defaults.num_rdma_bytes, defaults.low_latency_mode) == (0, 0, False)


def test_buffer_over_an_mpi4py_comm(recording):
    import deep_ep

    comm = FakeComm(1, 4)
    buffer = deep_ep.Buffer(None, num_rdma_bytes=1 << 21, low_latency_mode=True, comm=comm)
    assert (buffer.rank, buffer.group_size, buffer.group) == (1, 4, comm)
    args = buffer.runtime.args
    assert args.group is comm
    rank, num_ranks, all_gather, barrier = args.bootstrap
    assert (rank, num_ranks) == (1, 4)
    assert all_gather(b"id") == [b"id"] * 4  # the set-up exchange goes through comm.allgather
    barrier()
    assert comm.gathered == [b"id", None]
    # The group wins when both are given, as in DeepEP.
    group = FakeGroup(0, 2)
    assert deep_ep.Buffer(group, comm=comm).runtime.args.bootstrap is None


def test_buffer_needs_a_group_or_a_comm(recording):
    import deep_ep

    with pytest.raises(epx.EpxError, match="invalid group = None: either group .* or comm .* must be given"):
        deep_ep.Buffer(None)
    with pytest.raises(epx.EpxError, match=r"invalid comm = object: must be an mpi4py.MPI.Comm \(missing Get_rank, "
                                           r"Get_size, allgather; is mpi4py installed\?\)"):
        deep_ep.Buffer(None, comm=object())


# ---- Runtime queries (deep_ep.Buffer.runtime is the epx.Buffer) ----


def runtime_buffer(rank, num_ranks, ranks_per_node, device=0):
    buffer = object.__new__(epx.Buffer)
    buffer.rank, buffer.num_ranks = rank, num_ranks
    buffer.runtime = SimpleNamespace(ranks_per_node=ranks_per_node, device=device, is_destroyed=False)
    return buffer


def test_runtime_queries():
    one_node = runtime_buffer(5, 8, 8, device=5)
    assert one_node.get_num_rdma_ranks() == 1 and one_node.get_rdma_rank() == 0
    assert one_node.get_local_device_id() == 5 and one_node.is_available()
    virtual_nodes = runtime_buffer(3, 4, 2, device=3)  # EPX_RANKS_PER_NODE=2 on 4 GPUs
    assert virtual_nodes.get_num_rdma_ranks() == 2 and virtual_nodes.get_rdma_rank() == 1
    nodes = runtime_buffer(17, 32, 8)
    assert nodes.get_num_rdma_ranks() == 4 and nodes.get_rdma_rank() == 2
    nodes.runtime.is_destroyed = True
    assert not nodes.is_available()


# ---- EventHandle ----


class FakeEvent:
    def __init__(self, handle):
        self.valid, self.handle, self.waited_on = True, handle, []

    def wait_on(self, stream):
        self.waited_on.append(stream)


@pytest.fixture
def events(monkeypatch):
    """EventHandle records FakeEvents; the current stream is stream 7."""
    import epx._util as util
    import epx.event as event_module

    recorded = []

    def record():
        recorded.append(FakeEvent(0x1000 + len(recorded)))
        return recorded[-1]

    monkeypatch.setattr(event_module, "_record_on_current_stream", record)
    monkeypatch.setattr(util, "current_stream", lambda: SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(util, "current_stream_handle", lambda device_index=None: 7)
    return recorded


def test_event_handle_records_and_waits(events):
    from deep_ep.utils import EventHandle, EventOverlap

    handle = EventHandle()
    assert len(events) == 1 and handle.native is events[0]
    assert handle.cuda_event == 0x1000 and handle.valid
    handle.current_stream_wait()
    assert events[0].waited_on == [7]
    handle.wait(SimpleNamespace(cuda_stream=9))
    assert events[0].waited_on == [7, 9]

    overlap = EventOverlap(EventHandle())
    assert overlap.event is not None and overlap.event.cuda_event == 0x1001  # .event gives the handle back
    overlap.current_stream_wait()
    with overlap:
        pass
    assert events[1].waited_on == [7, 7]


def test_event_handle_orders_a_call_as_previous_event(events):
    import epx._util as util
    from deep_ep.utils import EventHandle, EventOverlap

    # What the calls pass to the runtime for previous_event (Megatron: EventOverlap(EventHandle())).
    assert util.event_handle(EventOverlap(EventHandle())) == 0x1000
    assert util.event_handle(EventHandle()) == 0x1001
    assert util.event_handle(EventOverlap()) == 0 and util.event_handle(None) == 0


def test_event_overlap_without_event_does_nothing():
    from deep_ep.utils import EventOverlap

    overlap = EventOverlap()
    overlap.current_stream_wait()  # DeepEP asserts here; EPX does nothing
    with overlap:
        pass
    assert overlap.event is None


def test_capture_is_an_event_overlap_of_an_event_handle(events):
    import deep_ep

    if not epx.WITH_CUDA:
        with pytest.raises(epx.EpxError, match="without CUDA"):
            deep_ep.Buffer.capture()
        return
    captured = deep_ep.Buffer.capture()
    assert isinstance(captured, deep_ep.EventOverlap) and isinstance(captured.event, deep_ep.EventHandle)
    assert captured.event.native is events[0]


def test_event_handle_needs_cuda(monkeypatch):
    import epx.event as event_module

    monkeypatch.setattr(event_module._epx, "WITH_CUDA", False, raising=False)
    with pytest.raises(epx.EpxError, match="without CUDA"):
        epx.EventHandle()
