"""The robust least-squares problem of one connected component of clock anchors (see align.py):
Huber-reweighted, solved densely up to DENSE_LIMIT unknowns and by preconditioned conjugate
gradients on the never-formed normal equations above."""
from __future__ import annotations

import numpy as np

HUBER_K = 1.5
IRLS_STEPS = 8
# Components with more unknowns than this are solved by preconditioned conjugate gradients on the
# sparse normal equations (never formed); below, by a dense solve. Dense costs unknowns^2 memory
# and unknowns^3 time: 8192 unknowns (4096 ranks with drift) took 90 s and 1.5 GiB.
DENSE_LIMIT = 1536
CG_TOLERANCE = 1e-9  # relative residual; offsets then agree with the dense solve to about 1e-5 us


class Problem:
    """Anchors of one connected component: observations (node, instance, d = finish time in µs
    relative to the instance's mean, tau = seconds since the node's window start). A node is one
    clock (a host, or a rank of a trace without host identities) in one window."""

    def __init__(self, node: np.ndarray, instance: np.ndarray, d: np.ndarray, tau: np.ndarray, num_nodes: int,
                 prior: np.ndarray):
        order = np.lexsort((node, instance))
        self.order = order  # observation i here is observation order[i] as given (per-rank residuals)
        self.node, self.instance, self.d, self.tau = node[order], instance[order], d[order], tau[order]
        self.prior = prior[order]
        self.num_nodes = num_nodes
        _, self.inst_index, self.sizes = np.unique(self.instance, return_inverse=True, return_counts=True)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])

    def _features(self, drift: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per observation, the unknowns it loads on: offset a[node] with 1, drift b[node] with tau."""
        if not drift:
            return self.node[:, None], np.ones((len(self.node), 1))
        return (np.stack([self.node, self.node + self.num_nodes], axis=1),
                np.stack([np.ones(len(self.node)), self.tau], axis=1))

    def solve(self, weights: np.ndarray, drift: bool, start: np.ndarray | None = None) -> np.ndarray:
        """The weighted least-squares unknowns; `start`: a guess (the previous reweighting step's
        answer), which the iterative solve starts from."""
        if self.num_nodes * (2 if drift else 1) > DENSE_LIMIT:
            return self._solve_sparse(weights, drift, start)
        index, value = self._features(drift)
        unknowns = self.num_nodes * (2 if drift else 1)
        matrix = np.zeros(unknowns * unknowns)
        rhs = np.zeros(unknowns)
        # Eliminating the instance finish time T_c leaves, per instance, the weighted centering
        # matrix M = diag(w) - w w^T / sum(w) between its observations; accumulate by instance size.
        for size in np.unique(self.sizes):
            chosen = np.flatnonzero(self.sizes == size)
            obs = self.starts[chosen][:, None] + np.arange(size)[None, :]  # [instances, size]
            w = weights[obs]
            total = w.sum(axis=1, keepdims=True)
            total[total == 0] = 1.0
            m = -w[:, :, None] * w[:, None, :] / total[:, :, None]
            m[:, np.arange(size), np.arange(size)] += w
            d = self.d[obs]
            md = np.einsum("nij,nj->ni", m, d)  # [instances, size]
            for fi in range(index.shape[1]):
                np.add.at(rhs, index[obs, fi].ravel(), (md * value[obs, fi]).ravel())
                for fj in range(index.shape[1]):
                    flat = index[obs, fi][:, :, None] * unknowns + index[obs, fj][:, None, :]
                    contribution = m * value[obs, fi][:, :, None] * value[obs, fj][:, None, :]
                    matrix += np.bincount(flat.ravel(), weights=contribution.ravel(), minlength=unknowns * unknowns)
        matrix = matrix.reshape(unknowns, unknowns)
        # Gauge: only relative clocks are observable. Pin the mean offset (and mean drift) to zero,
        # which keeps the component's average wall-clock time, and regularize drift lightly.
        scale = max(1.0, float(np.abs(np.diag(matrix)).max()))
        ones = np.zeros(unknowns)
        ones[:self.num_nodes] = 1.0
        matrix += scale * np.outer(ones, ones) / self.num_nodes
        if drift:
            ones_b = np.zeros(unknowns)
            ones_b[self.num_nodes:] = 1.0
            matrix += scale * np.outer(ones_b, ones_b) / self.num_nodes
            matrix[self.num_nodes:, self.num_nodes:] += np.eye(self.num_nodes) * 1e-9 * scale
        return np.linalg.solve(matrix, rhs)

    def _centered(self, p: np.ndarray, weights: np.ndarray, totals: np.ndarray) -> np.ndarray:
        """Per observation w * (p - the weighted mean of p over its instance): M p, instance by instance."""
        means = np.bincount(self.inst_index, weights=weights * p, minlength=len(self.sizes)) / totals
        return weights * (p - means[self.inst_index])

    def _solve_sparse(self, weights: np.ndarray, drift: bool, start: np.ndarray | None = None) -> np.ndarray:
        """The same normal equations and gauge as the dense solve, by Jacobi-preconditioned
        conjugate gradients with a matrix-free product: each costs a few passes over the
        observations, so a component of thousands of ranks takes seconds, not minutes."""
        index, value = self._features(drift)
        n, unknowns = self.num_nodes, self.num_nodes * (2 if drift else 1)
        totals = np.bincount(self.inst_index, weights=weights, minlength=len(self.sizes))
        totals[totals == 0] = 1.0

        def normal(x: np.ndarray) -> np.ndarray:
            q = self._centered((value * x[index]).sum(axis=1), weights, totals)
            return np.bincount(index.ravel(), weights=(value * q[:, None]).ravel(), minlength=unknowns)

        rhs = np.bincount(index.ravel(), weights=(value * self._centered(self.d, weights, totals)[:, None]).ravel(),
                          minlength=unknowns)
        own = weights * (1.0 - weights / totals[self.inst_index])  # an observation's share of its diagonal
        diagonal = np.bincount(index.ravel(), weights=(own[:, None] * value * value).ravel(), minlength=unknowns)
        scale = max(1.0, float(np.abs(diagonal).max()))
        blocks = [slice(0, n)] + ([slice(n, 2 * n)] if drift else [])
        for block in blocks:  # gauge: the mean offset (and mean drift) pinned, as in the dense solve
            diagonal[block] += scale / n
        if drift:
            diagonal[n:] += 1e-9 * scale
            # A node's offset and drift move almost together (its anchors' tau are alike): the
            # preconditioner inverts each node's 2 x 2 block, not only the diagonal.
            cross = np.bincount(self.node, weights=own * self.tau, minlength=n)
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
        predicted = x[self.node] + (x[self.node + self.num_nodes] * self.tau if drift else 0.0)
        remaining = self.d - predicted
        totals = np.bincount(self.inst_index, weights=weights, minlength=len(self.sizes))
        means = np.bincount(self.inst_index, weights=weights * remaining, minlength=len(self.sizes))
        means = np.divide(means, totals, out=np.zeros_like(means), where=totals > 0)
        return remaining - means[self.inst_index]

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


def huber_loss(r: np.ndarray, scale: float) -> float:
    limit = HUBER_K * scale
    a = np.abs(r)
    return float(np.sum(np.where(a <= limit, 0.5 * a * a, limit * (a - 0.5 * limit))))


def components(nodes: np.ndarray, instance: np.ndarray, num_nodes: int) -> np.ndarray:
    """Connected components of nodes linked by shared instances (union-find)."""
    parent = np.arange(num_nodes)

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    order = np.argsort(instance, kind="stable")
    inst_sorted, node_sorted = instance[order], nodes[order]
    firsts = np.flatnonzero(np.concatenate([[True], inst_sorted[1:] != inst_sorted[:-1]]))
    first_node = np.repeat(node_sorted[firsts], np.diff(np.append(firsts, len(order))))
    for a, b in set(zip(first_node.tolist(), node_sorted.tolist())):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
    return np.array([find(i) for i in range(num_nodes)])


def balanced_link_weights(src: np.ndarray, dst: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Weights giving both directions of a link (per window) the same total, so the unknown
    transfer latency cancels between them; a link used in one direction only gets weight 0."""
    low, high = np.minimum(src, dst).astype(np.int64), np.maximum(src, dst).astype(np.int64)
    forward = (src < dst).astype(np.int64)
    key = np.stack([low, high, window.astype(np.int64), forward], axis=1)
    if not len(key):
        return np.zeros(0)
    _, direction_id, direction_count = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    _, link_id = np.unique(key[:, :3], axis=0, return_inverse=True)
    direction_id, link_id = direction_id.reshape(-1), link_id.reshape(-1)
    directions = np.bincount(link_id, weights=np.ones(len(key)) / direction_count[direction_id])
    weight = 1.0 / direction_count[direction_id]
    weight[directions[link_id] < 1.5] = 0.0
    # Scale so that a link's anchors together weigh as much as its messages would unweighted.
    link_total = np.bincount(link_id)
    return weight * link_total[link_id] / 2.0
