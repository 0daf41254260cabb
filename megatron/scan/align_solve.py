"""The robust least-squares problem of one connected component of clock anchors (see align.py):
Huber-reweighted, solved densely up to DENSE_LIMIT unknowns and by preconditioned conjugate
gradients above. The normal matrix is built from one small block per set of instance members
(`_Blocks`), whatever the number of iterations traced."""
from __future__ import annotations

import numpy as np

from megatron.scan.keys import group_middles, unique_rows

HUBER_K = 1.5
IRLS_STEPS = 8
# Components with more unknowns than this are solved by preconditioned conjugate gradients on the
# sparse normal equations (kept as blocks); below, by a dense solve. Dense costs unknowns^2 memory
# and unknowns^3 time: 8192 unknowns (4096 ranks with drift) took 90 s and 1.5 GiB.
DENSE_LIMIT = 1536
CG_TOLERANCE = 1e-9  # relative residual; offsets then agree with the dense solve to about 1e-5 us
CHUNK = 1 << 15  # observations a reweighting step works on at a time (_Blocks)


class Problem:
    """Anchors of one connected component: observations (node, instance, d = finish time in µs
    relative to the instance's mean, tau = seconds since the node's window start). A node is one
    clock (a host, or a rank of a trace without host identities) in one window."""

    def __init__(self, node: np.ndarray, instance: np.ndarray, d: np.ndarray, tau: np.ndarray, num_nodes: int,
                 prior: np.ndarray):
        order = np.lexsort((node, instance))
        # Instances, each's observations by node, are then put in _Blocks' order (by size, then by
        # member nodes), so that every block's observations are one contiguous slice.
        order = order[_by_member_set(node[order], instance[order])]
        self.order = order  # observation i here is observation order[i] as given (per-rank residuals)
        self.node, self.instance, self.d, self.tau = node[order], instance[order], d[order], tau[order]
        self.prior = prior[order]
        self.num_nodes = num_nodes
        first = np.flatnonzero(np.concatenate([[True], self.instance[1:] != self.instance[:-1]]))
        self.starts, self.sizes = first, np.diff(np.append(first, len(order)))
        self.blocks: _Blocks | None = None  # built at the first solve (tests replace fit)

    def solve(self, weights: np.ndarray, drift: bool, start: np.ndarray | None = None) -> np.ndarray:
        """The weighted least-squares unknowns; `start`: a guess (the previous reweighting step's
        answer), which the iterative solve starts from."""
        if self.blocks is None:
            self.blocks = _Blocks(self.node, self.starts, self.sizes)
        n, unknowns = self.num_nodes, self.num_nodes * (2 if drift else 1)
        parts = self.blocks.normal(weights, self.d, self.tau if drift else None, n)
        rhs = np.zeros(unknowns)
        for at, _, right in parts:
            rhs += np.bincount(at.ravel(), weights=right.ravel(), minlength=unknowns)
        if unknowns > DENSE_LIMIT:
            return self._solve_sparse(parts, rhs, drift, start)
        matrix = np.zeros(unknowns * unknowns)
        for at, block, _ in parts:
            np.add.at(matrix, (at[:, :, None] * unknowns + at[:, None, :]).ravel(), block.ravel())
        matrix = matrix.reshape(unknowns, unknowns)
        # Gauge: only relative clocks are observable. Pin the mean offset (and mean drift) to zero,
        # which keeps the component's average wall-clock time, and regularize drift lightly.
        scale = max(1.0, float(np.abs(np.diag(matrix)).max()))
        ones = np.zeros(unknowns)
        ones[:n] = 1.0
        matrix += scale * np.outer(ones, ones) / n
        if drift:
            ones_b = np.zeros(unknowns)
            ones_b[n:] = 1.0
            matrix += scale * np.outer(ones_b, ones_b) / n
            matrix[n:, n:] += np.eye(n) * 1e-9 * scale
        return np.linalg.solve(matrix, rhs)

    def _solve_sparse(self, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], rhs: np.ndarray, drift: bool,
                      start: np.ndarray | None = None) -> np.ndarray:
        """The same normal equations and gauge as the dense solve, by Jacobi-preconditioned
        conjugate gradients on the matrix kept as its blocks: a product costs the blocks' entries,
        not a pass over the observations, so a component of thousands of ranks takes seconds."""
        n, unknowns = self.num_nodes, self.num_nodes * (2 if drift else 1)

        def normal(x: np.ndarray) -> np.ndarray:
            y = np.zeros(unknowns)
            for at, block, _ in parts:
                y += np.bincount(at.ravel(), weights=np.matmul(block, x[at][:, :, None]).ravel(), minlength=unknowns)
            return y

        # A block's diagonal holds each member's own share, w v v (1 - w / sum(w)) summed over the
        # instances, whether or not a node appears twice in the set: the Jacobi preconditioner.
        diagonal, cross = np.zeros(unknowns), np.zeros(n)
        for at, block, _ in parts:
            size = at.shape[1]
            diagonal += np.bincount(at.ravel(), weights=np.diagonal(block, axis1=1, axis2=2).ravel(),
                                    minlength=unknowns)
            if drift:
                half = np.arange(size // 2)
                cross += np.bincount(at[:, half].ravel(), weights=block[:, half, half + size // 2].ravel(),
                                     minlength=n)
        scale = max(1.0, float(np.abs(diagonal).max()))
        blocks = [slice(0, n)] + ([slice(n, 2 * n)] if drift else [])
        for block in blocks:  # gauge: the mean offset (and mean drift) pinned, as in the dense solve
            diagonal[block] += scale / n
        if drift:
            diagonal[n:] += 1e-9 * scale
            # A node's offset and drift move almost together (its anchors' tau are alike): the
            # preconditioner inverts each node's 2 x 2 block, not only the diagonal.
            det = diagonal[:n] * diagonal[n:] - cross * cross
            det = np.where(np.abs(det) > 1e-300, det, 1.0)

        def apply(x: np.ndarray) -> np.ndarray:
            y = normal(x)
            for block in blocks:
                y[block] += scale * x[block].sum() / n
            if drift:
                y[n:] += 1e-9 * scale * x[n:]
            return y

        inverse = 1.0 / np.where(diagonal > 0, diagonal, 1.0)

        def precondition(r: np.ndarray) -> np.ndarray:
            if not drift:
                return inverse * r
            a, b = r[:n], r[n:]
            return np.concatenate([(diagonal[n:] * a - cross * b) / det, (diagonal[:n] * b - cross * a) / det])

        x = np.zeros(unknowns) if start is None or len(start) != unknowns else start.copy()
        r = rhs - apply(x) if x.any() else rhs.copy()
        z = precondition(r)
        direction = z.copy()
        rz = float(r @ z)
        limit = CG_TOLERANCE * max(float(np.linalg.norm(rhs)), 1e-300)
        for _ in range(10 * unknowns):
            if float(np.linalg.norm(r)) <= limit:
                break
            product = apply(direction)
            step = rz / float(direction @ product)
            x += step * direction
            r -= step * product
            z = precondition(r)
            rz, previous = float(r @ z), rz
            direction = z + (rz / previous) * direction
        return x

    def residuals(self, x: np.ndarray, weights: np.ndarray, drift: bool) -> np.ndarray:
        if self.blocks is None:
            self.blocks = _Blocks(self.node, self.starts, self.sizes)
        return self.blocks.residuals(x, weights, self.node, self.d, self.tau if drift else None, self.num_nodes)

    def fit(self, drift: bool, sigma: float | None = None, tick=None) -> tuple[np.ndarray, np.ndarray, float]:
        """IRLS with Huber weights; returns (unknowns, residuals, robust scale in µs). A given
        `sigma` fixes the scale (so two models are judged by the same yardstick). `tick()` is
        called after each of the IRLS_STEPS solves (progress)."""
        weights = self.prior.copy()
        scale = sigma or 1.0
        x = None
        for _ in range(IRLS_STEPS):
            x = self.solve(weights, drift, x)
            if tick is not None:
                tick()
            r = self.residuals(x, weights, drift)
            if sigma is None:
                scale = max(1.4826 * float(np.median(np.abs(r))), 1.0)  # µs; below 1 µs is clock noise
            weights = self.prior * np.minimum(1.0, HUBER_K * scale / np.maximum(np.abs(r), 1e-12))
        return x, r, scale


def one_clock(node: np.ndarray, instance: np.ndarray, d_us: np.ndarray, prior: np.ndarray, skip: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Anchors of instances whose members share one node (no unknown to fit): each residual (its
    finish less its instance's `prior`-weighted mean, 0 where the weights are), and the nodes not
    in `skip` (no other anchor) with their robust scale (µs, at least 1, as a fit's)."""
    total = np.bincount(instance, weights=prior)
    mean = np.divide(np.bincount(instance, weights=prior * d_us), total, out=np.zeros(len(total)), where=total > 0)
    r = d_us - mean[instance]
    alone = ~np.isin(node, skip)
    nodes, middle = group_middles(node[alone], np.abs(r[alone]))
    return r, nodes, np.maximum(1.4826 * middle, 1.0)


def _by_member_set(node: np.ndarray, instance: np.ndarray) -> np.ndarray:
    """The order of observations (sorted by instance, then node) that puts instances by size, then
    by their member nodes (the same instance order otherwise), each instance's observations kept."""
    first = np.flatnonzero(np.concatenate([[True], instance[1:] != instance[:-1]])) if len(node) else node[:0]
    sizes = np.diff(np.append(first, len(node)))
    chosen = []
    for size in np.unique(sizes).tolist():
        these = np.flatnonzero(sizes == size)
        members = node[first[these][:, None] + np.arange(size)[None, :]]
        chosen.append(these[np.lexsort(members.T[::-1])])
    ranked = np.concatenate(chosen) if chosen else first
    # Each chosen instance's observations, in place: its start repeated, plus 0 .. size-1.
    counts = sizes[ranked]
    offsets = np.arange(len(node)) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(first[ranked], counts) + offsets


class _Blocks:
    """The normal matrix of a component as a sum of small dense blocks, one per member set (the
    nodes of an instance, in order). An instance adds w v v^T (feature values v: 1 for the offset,
    tau for the drift) on each member's diagonal and takes (w v)(w v)^T / sum(w) across its
    members; instances of one member set (a TP group's thousands of all-reduces, a link's
    messages) share the block's place, so their sum is one matrix product per set, and the
    number of blocks does not grow with the iterations. Observations come in _by_member_set's
    order, so each size's instances are one [instances, size] slice, walked in chunks of whole
    sets of about CHUNK observations: each reweighting step makes a few dozen passes over them,
    which then stay in the cache instead of streaming millions of values from memory each."""

    def __init__(self, node: np.ndarray, starts: np.ndarray, sizes: np.ndarray):
        # Per instance size: (size, members [sets, size], chunks (first and end observation, the
        # chunk's set bounds in instances from its start, first and end set)).
        self.classes = []
        classes = np.flatnonzero(np.concatenate([[True], sizes[1:] != sizes[:-1]])) if len(sizes) else sizes
        for a, b in zip(classes.tolist(), np.append(classes[1:], len(sizes)).tolist()):
            size, lo = int(sizes[a]), int(starts[a])
            members = node[lo:lo + (b - a) * size].reshape(b - a, size)
            first = np.flatnonzero(np.concatenate([[True], (members[1:] != members[:-1]).any(axis=1)]))
            bounds = np.append(first, b - a)
            chunks, s0 = [], 0
            while s0 < len(first):
                s1 = max(s0 + 1, int(np.searchsorted(bounds, bounds[s0] + max(1, CHUNK // size), "right")) - 1)
                chunks.append((lo + int(bounds[s0]) * size, lo + int(bounds[s1]) * size, bounds[s0:s1 + 1] - bounds[s0],
                               s0, s1))
                s0 = s1
            self.classes.append((size, members[first], chunks))

    def normal(self, weights: np.ndarray, d: np.ndarray, tau: np.ndarray | None, num_nodes: int
               ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per size, (unknown index [sets, f x size], block [sets, f x size, f x size], right-hand
        side [sets, f x size]) with f = 1 (offset) or 2 (offset and drift, `tau` given): the normal
        matrix is the sum of the blocks scattered at their indices, and the right-hand side,
        the features times M d (M: the weighted centering of each instance), likewise."""
        result = []
        for size, members, chunks in self.classes:
            width = size * (1 if tau is None else 2)
            block, right = np.empty((len(members), width, width)), np.empty((len(members), width))
            own = np.arange(size)
            for lo, hi, bounds, s0, s1 in chunks:
                w = weights[lo:hi].reshape(-1, size)
                total = w.sum(axis=1)
                total[total == 0] = 1.0
                d_ = d[lo:hi].reshape(-1, size)
                centered = w * (d_ - (w * d_).sum(axis=1)[:, None] / total[:, None])
                t = None if tau is None else tau[lo:hi].reshape(-1, size)
                y = w if t is None else np.concatenate([w, w * t], axis=1)  # feature-major: offsets, then drifts
                scaled = y / total[:, None]
                for s, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()), start=s0):
                    np.matmul(y[a:b].T, scaled[a:b], out=block[s])
                sets = slice(s0, s1)
                block[sets] *= -1.0
                block[sets, own, own] += np.add.reduceat(w, bounds[:-1], axis=0)
                right[sets, :size] = np.add.reduceat(centered, bounds[:-1], axis=0)
                if t is not None:
                    wt = np.add.reduceat(y[:, size:], bounds[:-1], axis=0)
                    block[sets, own, own + size] += wt
                    block[sets, own + size, own] += wt
                    block[sets, own + size, own + size] += np.add.reduceat(y[:, size:] * t, bounds[:-1], axis=0)
                    right[sets, size:] = np.add.reduceat(centered * t, bounds[:-1], axis=0)
            at = members if tau is None else np.concatenate([members, members + num_nodes], axis=1)
            result.append((at, block, right))
        return result

    def residuals(self, x: np.ndarray, weights: np.ndarray, node: np.ndarray, d: np.ndarray, tau: np.ndarray | None,
                  num_nodes: int) -> np.ndarray:
        """d less the fitted clocks, less its instance's weighted mean (0 where all weights are 0)."""
        out = np.empty(len(d))
        for size, _, chunks in self.classes:
            for lo, hi, _, _, _ in chunks:
                remaining = d[lo:hi] - x[node[lo:hi]]
                if tau is not None:
                    remaining -= x[node[lo:hi] + num_nodes] * tau[lo:hi]
                remaining = remaining.reshape(-1, size)
                w = weights[lo:hi].reshape(-1, size)
                totals = w.sum(axis=1)
                means = np.divide((w * remaining).sum(axis=1), totals, out=np.zeros(len(totals)), where=totals > 0)
                out[lo:hi] = (remaining - means[:, None]).ravel()
        return out


def huber_loss(r: np.ndarray, scale: float) -> float:
    limit = HUBER_K * scale
    a = np.abs(r)
    return float(np.sum(np.where(a <= limit, 0.5 * a * a, limit * (a - 0.5 * limit))))


_DENSE_PAIRS = 1 << 26  # node pairs marked in a table (64 MB) rather than sorted


def components(nodes: np.ndarray, instance: np.ndarray, num_nodes: int) -> np.ndarray:
    """Connected components of nodes linked by shared instances, each labelled by its lowest node."""
    label = np.arange(num_nodes)
    if not len(nodes):
        return label
    # Each anchor links its node with one node of its instance (whichever the assignment leaves):
    # the distinct pairs, without a sort (millions of anchors, a few thousand nodes).
    nodes = np.asarray(nodes, dtype=np.int64)
    _, inverse = unique_rows(np.asarray(instance)[:, None])
    one_node = np.empty(int(inverse.max()) + 1, dtype=np.int64)
    one_node[inverse] = nodes
    if num_nodes * num_nodes <= _DENSE_PAIRS:
        linked = np.zeros(num_nodes * num_nodes, dtype=bool)
        linked[one_node[inverse] * num_nodes + nodes] = True
        a, b = np.divmod(np.flatnonzero(linked), num_nodes)
    else:
        pairs, _ = unique_rows(np.stack([one_node[inverse], nodes], axis=1))
        a, b = pairs[:, 0], pairs[:, 1]
    # Both ends of every link take the lower label, and labels follow their labels to a fixed
    # point (pointer jumping): each pass halves the distance a lowest label still has to travel.
    while True:
        low = np.minimum(label[a], label[b])
        moved = label.copy()
        np.minimum.at(moved, a, low)
        np.minimum.at(moved, b, low)
        while True:
            jumped = moved[moved]
            if np.array_equal(jumped, moved):
                break
            moved = jumped
        if np.array_equal(moved, label):
            return label
        label = moved


def balanced_link_weights(src: np.ndarray, dst: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Weights giving both directions of a link (per window) the same total, so the unknown
    transfer latency cancels between them; a link used in one direction only gets weight 0."""
    low, high = np.minimum(src, dst).astype(np.int64), np.maximum(src, dst).astype(np.int64)
    forward = (src < dst).astype(np.int64)
    key = np.stack([low, high, window.astype(np.int64), forward], axis=1)
    if not len(key):
        return np.zeros(0)
    _, direction_id = unique_rows(key)
    direction_count = np.bincount(direction_id)
    _, link_id = unique_rows(key[:, :3])
    directions = np.bincount(link_id, weights=np.ones(len(key)) / direction_count[direction_id])
    weight = 1.0 / direction_count[direction_id]
    weight[directions[link_id] < 1.5] = 0.0
    # Scale so that a link's anchors together weigh as much as its messages would unweighted.
    link_total = np.bincount(link_id)
    return weight * link_total[link_id] / 2.0
