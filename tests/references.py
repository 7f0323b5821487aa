"""Independent float64 numpy references shared by the verifier's tests."""

import itertools

import numpy as np


def loop_conv_matrix(kernel, height, width, circular=False):
    """Plain-loop matrix of the stride-1 cross-correlation (SAME zero padding, or periodic
    with ``circular``), row-major (H, W, C) flattening."""
    kernel = np.asarray(kernel, np.float64)
    k, _, c_in, c_out = kernel.shape
    p = (k - 1) // 2
    M = np.zeros((height * width * c_out, height * width * c_in))
    for y, x, a, b in itertools.product(range(height), range(width), range(k), range(k)):
        yy, xx = y + a - p, x + b - p
        if circular:
            yy, xx = yy % height, xx % width
        elif not (0 <= yy < height and 0 <= xx < width):
            continue
        r, q = (y * width + x) * c_out, (yy * width + xx) * c_in
        M[r : r + c_out, q : q + c_in] += kernel[a, b].T
    return M


def rho(M) -> float:
    """Spectral radius by numpy float64 ``eigvals``."""
    return float(np.max(np.abs(np.linalg.eigvals(np.asarray(M, np.float64)))))
