#!/usr/bin/env bash
# Installs what a command needs when it is missing, and prints the Python interpreter to use (stdout; every
# message goes to stderr). Usage: scripts/deps.sh [NEED...]   (default: test)
#   build   cmake, ninja, g++, GoogleTest; the NVSHMEM wheel (the transport across nodes)
#   bench   build
#   test    build + pybind11 (the binding), pytest, numpy, matplotlib (python -m epx_tools.plot's tests)
#   format  clang-format, ruff
#   pip     the pip route: cmake, ninja, g++; scikit-build-core, pybind11, numpy
# EPX_DEPS_FRAMEWORKS=1 adds torch, packaging and megatron-core (without its dependencies) to `test`, so the
# CPU tests of the torch layer and of Megatron-LM's fused_a2a run instead of skipping.
#
# Where Python packages go (never into a system interpreter unless asked):
#   - the active virtual environment ($VIRTUAL_ENV, or ${PYTHON:-python3}'s own venv, or an active conda env);
#   - else, with EPX_DEPS_SYSTEM=1, the interpreter ${PYTHON:-python3} itself (CI: a throwaway machine);
#   - else the venv $EPX_VENV (default: .venv in the repository) if it exists;
#   - else ${PYTHON:-python3} as it is, if it already has everything (nothing to install);
#   - else that venv, created with --system-site-packages, so that what the interpreter already has (torch,
#     say) is reused, not installed again.
# Debian packages: apt-get as root, or through sudo; otherwise the script stops and prints the command to run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "deps: $*" >&2; }

needs=("$@")
[ ${#needs[@]} -gt 0 ] || needs=(test)
want_build=0 want_test=0 want_format=0 want_pip=0
for need in "${needs[@]}"; do
  case $need in
    build | bench) want_build=1 ;;
    test) want_build=1 want_test=1 ;;
    format) want_format=1 ;;
    pip) want_pip=1 ;;
    *) say "unknown need '$need' (known: build bench test format pip)"; exit 2 ;;
  esac
done

# ---- Debian packages ----
missing_debs=()
if [ $want_build = 1 ] || [ $want_pip = 1 ]; then
  command -v cmake >/dev/null || missing_debs+=(cmake)
  command -v ninja >/dev/null || missing_debs+=(ninja-build)
  command -v g++ >/dev/null || missing_debs+=(g++)
fi
if [ $want_build = 1 ] && [ ! -f /usr/include/gtest/gtest.h ] && [ ! -d /usr/src/googletest ] &&
  [ -z "${EPX_GTEST_SOURCE_DIR:-}" ]; then
  missing_debs+=(libgtest-dev)
fi
[ $want_format = 0 ] || command -v clang-format >/dev/null || missing_debs+=(clang-format)
if [ ${#missing_debs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null && { sudo -n true 2>/dev/null || [ -t 0 ]; }; then  # sudo asks on a terminal
    sudo=(sudo)
  else
    say "missing Debian packages: ${missing_debs[*]}. Install them (as root), then run this again:"
    echo "  sudo apt-get install -y ${missing_debs[*]}" >&2
    [[ " ${missing_debs[*]} " != *" libgtest-dev "* ]] ||
      echo "  (or, for GoogleTest, set EPX_GTEST_SOURCE_DIR to a GoogleTest source tree)" >&2
    exit 1
  fi
  say "installing Debian packages: ${missing_debs[*]}"
  "${sudo[@]}" apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing_debs[@]}" >&2
fi

# ---- Python packages: which ones ----
# Each entry: the module to import, then the pip requirement.
wanted=()
if [ $want_build = 1 ]; then wanted+=("nvidia.nvshmem nvidia-nvshmem-cu13==3.4.5"); fi
if [ $want_test = 1 ]; then
  wanted+=("pybind11 pybind11" "pytest pytest" "numpy numpy" "matplotlib matplotlib")
  if [ "${EPX_DEPS_FRAMEWORKS:-0}" = 1 ]; then wanted+=("torch torch" "packaging packaging"); fi
fi
if [ $want_pip = 1 ]; then wanted+=("scikit_build_core scikit-build-core" "pybind11 pybind11" "numpy numpy"); fi
if [ $want_format = 1 ]; then wanted+=("ruff ruff"); fi
want_megatron=0
if [ $want_test = 1 ] && [ "${EPX_DEPS_FRAMEWORKS:-0}" = 1 ]; then want_megatron=1; fi

# Prints the requirements that `$1` (an interpreter) lacks, one per line.
missing_in() {
  local entry
  for entry in "${wanted[@]}"; do
    "$1" -c "import ${entry%% *}" 2>/dev/null || echo "${entry#* }"
  done
  if [ $want_megatron = 1 ]; then "$1" -c 'import megatron.core' 2>/dev/null || echo megatron-core; fi
}

# ---- Python packages: which interpreter ----
python=$(command -v "${PYTHON:-python3}") || { say "no Python interpreter '${PYTHON:-python3}' found"; exit 1; }
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  python=$VIRTUAL_ENV/bin/python
  say "using the active virtual environment $VIRTUAL_ENV"
elif "$python" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
  say "using the virtual environment of $python"
elif [ -n "${CONDA_PREFIX:-}" ] && [ "$("$python" -c 'import sys; print(sys.prefix)')" = "$CONDA_PREFIX" ]; then
  say "using the active conda environment $CONDA_PREFIX"
elif [ "${EPX_DEPS_SYSTEM:-0}" = 1 ]; then
  say "EPX_DEPS_SYSTEM=1: using $python itself; what it lacks is installed there"
  export PIP_ROOT_USER_ACTION=ignore  # asked for: pip's warning about root would only repeat it
elif venv=${EPX_VENV:-$root/.venv} && { [ -x "$venv/bin/python" ] || [ -n "$(missing_in "$python")" ]; }; then
  if [ ! -x "$venv/bin/python" ]; then
    say "creating the virtual environment $venv (from $python; set EPX_VENV to put it elsewhere)"
    if ! "$python" -m venv --system-site-packages "$venv" >&2; then
      say "could not create it: install the venv module (Debian: sudo apt-get install -y python3-venv),"
      say "activate a virtual environment of your own, or set EPX_DEPS_SYSTEM=1 to install into $python"
      exit 1
    fi
  fi
  python=$venv/bin/python
  say "using $venv (activate it with: source $venv/bin/activate)"
else
  say "using $python: it has every package needed"
fi

# ---- Python packages: install ----
mapfile -t missing_pips < <(missing_in "$python")
pips=() megatron=0
for requirement in "${missing_pips[@]}"; do
  if [ "$requirement" = megatron-core ]; then megatron=1; else pips+=("$requirement"); fi
done
if [ ${#pips[@]} -gt 0 ]; then
  say "installing Python packages into $python: ${pips[*]}"
  "$python" -m pip install -q --disable-pip-version-check "${pips[@]}" >&2
fi
if [ $megatron = 1 ]; then
  say "installing megatron-core (without its dependencies)"
  "$python" -m pip install -q --disable-pip-version-check --no-deps megatron-core >&2
fi
echo "$python"
