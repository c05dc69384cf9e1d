#!/usr/bin/env bash
# Installs what the build needs when it is missing: Debian packages with apt-get, Python ones with pip.
# On a machine that has everything (the GPU image, which has no network) it installs nothing.
set -euo pipefail

missing_debs=()
command -v cmake >/dev/null || missing_debs+=(cmake)
command -v ninja >/dev/null || missing_debs+=(ninja-build)
command -v g++ >/dev/null || missing_debs+=(g++)
command -v clang-format >/dev/null || missing_debs+=(clang-format)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -d /usr/src/googletest ] && [ -z "${EPX_GTEST_SOURCE_DIR:-}" ]; then
  missing_debs+=(libgtest-dev)
fi
if [ ${#missing_debs[@]} -gt 0 ]; then
  echo "deps: installing Debian packages: ${missing_debs[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing_debs[@]}"
fi

PYTHON=${PYTHON:-python3}
missing_pips=()
$PYTHON -c 'import nvidia.nvshmem' 2>/dev/null || missing_pips+=(nvidia-nvshmem-cu13==3.4.5)
$PYTHON -c 'import pybind11' 2>/dev/null || missing_pips+=(pybind11)
$PYTHON -c 'import pytest' 2>/dev/null || missing_pips+=(pytest)
$PYTHON -c 'import numpy' 2>/dev/null || missing_pips+=(numpy)
$PYTHON -c 'import scikit_build_core' 2>/dev/null || missing_pips+=(scikit-build-core)
$PYTHON -m ruff --version >/dev/null 2>&1 || missing_pips+=(ruff)
$PYTHON -c 'import matplotlib' 2>/dev/null || missing_pips+=(matplotlib)  # python -m epx.plot's drawing tests
# EPX_DEPS_FRAMEWORKS=1 (CI): torch and megatron-core too, so the CPU tests of the torch layer and of
# Megatron-LM's fused_a2a run instead of skipping (megatron-core without its optional dependencies).
if [ "${EPX_DEPS_FRAMEWORKS:-0}" = 1 ]; then
  $PYTHON -c 'import torch' 2>/dev/null || missing_pips+=(torch)
  $PYTHON -c 'import packaging' 2>/dev/null || missing_pips+=(packaging)
  if ! $PYTHON -c 'import megatron.core' 2>/dev/null; then
    echo "deps: installing megatron-core (without its dependencies)"
    $PYTHON -m pip install -q --no-deps megatron-core
  fi
fi
if [ ${#missing_pips[@]} -gt 0 ]; then
  echo "deps: installing Python packages: ${missing_pips[*]}"
  $PYTHON -m pip install -q "${missing_pips[@]}"
fi
