"""PEP 517 build backend of the deep_ep metadata distribution (see pyproject.toml): writes a wheel holding only
deep_ep's .dist-info, with the standard library alone, so it builds offline without build dependencies."""

import base64
import hashlib
import io
import os
import tarfile
import zipfile

NAME = "deep_ep"
DEEP_EP_VERSION = "1.2.1"  # keep equal to epx.compat.deep_ep.DEEP_EP_VERSION (a CPU test checks)
EPX_VERSION = "0.1.0"  # keep equal to the version in ../pyproject.toml (a CPU test checks)
VERSION = f"{DEEP_EP_VERSION}+epx{EPX_VERSION}"
DIST_INFO = f"{NAME}-{VERSION}.dist-info"

METADATA = f"""\
Metadata-Version: 2.1
Name: {NAME}
Version: {VERSION}
Summary: DeepEP's interface on EPX: the deep_ep package ships in epx; this distribution carries its metadata
Requires-Python: >=3.9
Requires-Dist: epx=={EPX_VERSION}
"""

WHEEL = """\
Wheel-Version: 1.0
Generator: deep_ep_dist_backend
Root-Is-Purelib: true
Tag: py3-none-any
"""

_HERE = os.path.dirname(os.path.abspath(__file__))
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # reproducible archives (the sdist: 1980-01-01 UTC as a timestamp)
_FIXED_TIMESTAMP = 315532800


def _dist_info_files():
    return {f"{DIST_INFO}/METADATA": METADATA.encode(), f"{DIST_INFO}/WHEEL": WHEEL.encode()}


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}\n"


def get_requires_for_build_wheel(config_settings=None):
    return []


get_requires_for_build_sdist = get_requires_for_build_editable = get_requires_for_build_wheel


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    for path, data in _dist_info_files().items():
        target = os.path.join(metadata_directory, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
    return DIST_INFO


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    files = _dist_info_files()
    record = "".join(_record_line(path, data) for path, data in files.items()) + f"{DIST_INFO}/RECORD,,\n"
    files[f"{DIST_INFO}/RECORD"] = record.encode()
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in files.items():
            info = zipfile.ZipInfo(path, _FIXED_TIME)
            info.external_attr = 0o644 << 16
            wheel.writestr(info, data, zipfile.ZIP_DEFLATED)
    return name


build_editable = build_wheel  # the wheel holds metadata only: an editable install is the same


def build_sdist(sdist_directory, config_settings=None):
    base = f"{NAME}-{VERSION}"
    name = f"{base}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as sdist:
        for file in ("pyproject.toml", "deep_ep_dist_backend.py"):
            sdist.add(os.path.join(_HERE, file), f"{base}/{file}")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        data = METADATA.encode()
        info.size, info.mtime, info.mode = len(data), _FIXED_TIMESTAMP, 0o644
        sdist.addfile(info, io.BytesIO(data))
    return name
