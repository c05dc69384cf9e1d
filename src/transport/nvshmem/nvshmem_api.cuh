#pragma once

// The NVSHMEM headers, included once for this folder. Their device code uses volatile compound assignments
// that C++20 deprecates; silence exactly those diagnostics (3012, 3013) rather than warnings in EPX code.
#pragma nv_diag_suppress 3012
#pragma nv_diag_suppress 3013
#include <nvshmem.h>
#include <nvshmemx.h>
