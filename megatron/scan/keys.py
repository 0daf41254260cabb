"""Grouping integer keys without sorting rows as records: the matching, the clock alignment and
the analyzers number millions of (rank, window, ...) keys at thousands of ranks."""
from __future__ import annotations

import numpy as np


def unique_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(matrix, axis=0, return_inverse=True) for integer columns, with the inverse flat:
    the columns packed into one int64 key (first column most significant, so the order is the
    same) where their ranges allow, which sorts one number per row instead of rows of a
    structured view (the analyzers group millions of rows at thousands of ranks)."""
    matrix = np.asarray(matrix)
    if matrix.ndim != 2 or not len(matrix) or matrix.dtype.kind not in "iub":
        keys, inverse = np.unique(matrix, axis=0, return_inverse=True)
        return keys, inverse.reshape(-1)
    matrix = matrix.astype(np.int64)
    low = matrix.min(axis=0)
    span = matrix.max(axis=0) - low + 1
    if float(np.prod(span.astype(np.float64))) >= 2.0 ** 62:
        keys, inverse = np.unique(matrix, axis=0, return_inverse=True)
        return keys, inverse.reshape(-1)
    packed = np.zeros(len(matrix), dtype=np.int64)
    for j in range(matrix.shape[1]):
        packed = packed * span[j] + (matrix[:, j] - low[j])
    cells = int(np.prod(span))
    if cells <= 2 * len(matrix) + 65536:
        # Few possible keys (ranks x iterations, tasks of a stage): counted in place, no sort.
        present = np.bincount(packed, minlength=cells) > 0
        index = np.cumsum(present) - 1
        flat = np.flatnonzero(present)
        keys = np.empty((len(flat), matrix.shape[1]), dtype=np.int64)
        for j in reversed(range(matrix.shape[1])):
            keys[:, j] = flat % span[j] + low[j]
            flat = flat // span[j]
        return keys, index[packed]
    # Every row of a group is the same, so any one stands for it (np.unique's first index is not
    # needed); a stable sort finds the runs of keys that come in order (rows in rank order) and is
    # no slower than a quicksort on others.
    order = np.argsort(packed, kind="stable")
    ordered = packed[order]
    new_row = np.empty(len(ordered), dtype=bool)
    new_row[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new_row[1:])
    inverse = np.empty(len(ordered), dtype=np.int64)
    inverse[order] = np.cumsum(new_row) - 1
    return matrix[order[new_row]], inverse


def group_middles(groups: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct groups, the median of each group's values: the middle value, or the mean
    of the two middle ones, as np.median; x + x halves back to x exactly) by one sort of all rows."""
    order = np.lexsort((values, groups))
    groups, values = groups[order], values[order]
    first = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]]) if len(groups) else np.zeros(0, np.int64)
    count = np.diff(np.r_[first, len(groups)])
    return groups[first], (values[first + (count - 1) // 2] + values[first + count // 2]) / 2
